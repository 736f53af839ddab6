"""The dispatcher: the registered paths, what each declares it can run, and the rule that picks one for a call.

The package docstring (``hf_attnorm/kernels/__init__.py``) describes the paths and the rule; this module sees only
the call every path reads (``AttnCall``). What the 2025 variants do around a call (learned memory, gated and
differential attention) is composed around it by ``kernels/variants.py``.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Collection

import torch

from ..normalizers.base import Normalizer
from ..registry import NORMALIZERS, AttnormError
from ..torch_compat import DYNAMIC_EXPORT, DYNAMIC_EXPORT_FEATURE, is_exporting
from .base import AttnCall
from .reference import reference_attention

KernelResult = "tuple[torch.Tensor, torch.Tensor | None]"
Kernel = Callable[[AttnCall], KernelResult]
Check = Callable[[AttnCall], "str | None"]
NormCheck = Callable[[Normalizer], "str | None"]
#: a path's direct entry: (q [B, H, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv], the call's per-head values
#: (name -> [H] or [H, ...], as the module's state gives them for the call)) -> out [B, H, Lq, Dv]
Direct = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, dict], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Path:
    """A registered path: its kernel and its declared capabilities (see the module docstring)."""

    name: str
    kernel: Kernel
    takes: NormCheck
    accepts: Check
    priority: int
    #: device types on which the automatic rule skips this path (a better one exists there; forced, it still runs)
    auto_exclude: frozenset[str] = frozenset()
    #: considered by the automatic rule under torch.export (see the module docstring)
    exportable: bool = False
    #: False: declines every call while torch.compile traces (its ``accepts`` says so; a compiled model runs another
    #: path). For kernels whose host-side launch code Dynamo cannot trace
    traceable: bool = True
    #: the call features (``FEATURES``) it applies; it declines every call carrying another
    supports: frozenset[str] = frozenset()
    #: False: while torch.compile traces, declines calls that need gradients (its backward cannot be traced: the
    #: compiled model runs another path for training; compiled inference still runs it)
    compiled_backward: bool = True
    #: run once before the path is first considered (``prepare_path``), e.g. building its C++ extension; None: nothing
    prepare: Callable[[], object] | None = None
    #: ``accepts`` reads nothing beyond a plan's facts (True, or a function saying so for one call): a reused
    #: ``Route`` does not ask it again (see the module docstring)
    plan_stable: bool | Callable[[AttnCall], bool] = False
    #: given a resolved call, its direct entry (``Direct``), valid for every call with the same plan facts, or None
    direct: Callable[[AttnCall], Direct | None] | None = None

    @property
    def forget(self) -> bool:
        """Applies forgetting attention's decay (``AttnCall.forget``)."""
        return "forget" in self.supports

    def stable_for(self, call: AttnCall) -> bool:
        """Whether ``accepts`` gives this call's answer for every call with the same plan facts."""
        return self.plan_stable(call) if callable(self.plan_stable) else self.plan_stable

    def check(self, call: AttnCall) -> str | None:
        """None when this path can run ``call``, else the reason (runs nothing)."""
        return self.takes(call.normalizer) or self.accepts(call)


def _any_normalizer(norm: Normalizer) -> None:
    return None


def _reference_accepts(call: AttnCall) -> None:
    return None


def _reference_can_run(call: AttnCall) -> None:
    """Raise when even the reference declines ``call`` (it carries a call feature no path declares)."""
    why = PATHS["reference"].accepts(call)
    if why is not None:
        raise AttnormError(f"no attention path can run this call: {why}")


#: name -> path
PATHS: dict[str, Path] = {}
#: the fast paths by priority, and per (normalizer, device type) those the automatic rule considers (filled lazily:
#: the hot path then only runs the accepts checks)
_ORDER: list[Path] = []
_AUTO: dict[tuple[str, str], list[Path]] = {}

#: the paths whose ``prepare`` has run
_PREPARED: set[str] = set()

ENV_VAR = "HF_ATTNORM_PATH"
#: the path HF_ATTNORM_PATH forces ("auto": none); read at import and by ``set_forced_path``
_FORCED: dict[str, str] = {"path": "auto"}
#: bumped when what the rule decides may change (a path registered, the forced path set): routes kept before are stale
_EPOCH = [0]


def plan_epoch() -> int:
    """The rule's current version (a plan made under another is stale)."""
    return _EPOCH[0]


def _declining_compile(name: str, accepts: Check) -> Check:
    """``accepts`` of a path registered ``traceable=False``: the compile reason first, then its own checks."""
    def check(call: AttnCall) -> str | None:
        if torch.compiler.is_compiling():
            return f"torch.compile: path {name!r} is not traced (registered traceable=False); another path runs"
        return accepts(call)
    return check


#: What a call may carry that changes its result, and that a path applies only when it says so
#: (``register_path(supports=...)``): name -> (what it is, whether a call carries it). A path is never offered a
#: call carrying a feature it does not declare, so a feature added here is declined by every path that has not
#: declared it (the reference declares them all); its own ``accepts`` then checks only the finer conditions.
FEATURES: dict[str, tuple[str, Callable[[AttnCall], bool]]] = {
    "softcap": ("a soft-cap", lambda call: call.softcap is not None),
    "bias": ("a score bias", lambda call: call.bias is not None),
    "alibi": ("ALiBi slopes", lambda call: call.alibi_slopes is not None),
    "sinks": ("attention sinks (s_aux)", lambda call: call.sinks is not None),
    "forget": ("a forget gate (forgetting attention)", lambda call: call.forget is not None),
    "selective_carry": ("a selective_carry (the earlier queries' penalty of selective attention)",
                        lambda call: call.selective_carry is not None),
    "dropout": ("attention dropout", lambda call: call.dropout > 0),
}


def _declining_features(name: str, supports: frozenset[str], accepts: Check) -> Check:
    """``accepts`` of a path: a call carrying a feature the path does not declare is declined first."""
    def check(call: AttnCall) -> str | None:
        for feature, (what, carried) in FEATURES.items():
            if feature not in supports and carried(call):
                return f"path {name!r} does not apply {what} (call feature {feature!r}: not one it declares)"
        return accepts(call)
    return check


def _declining_compiled_backward(name: str, accepts: Check) -> Check:
    """``accepts`` of a path registered ``compiled_backward=False``: traced calls needing gradients are declined."""
    def check(call: AttnCall) -> str | None:
        # (torch.export traces no backward: it is not declined there)
        if torch.compiler.is_compiling() and not is_exporting() and call.needs_grad:
            return (f"torch.compile: path {name!r} does not trace its backward (registered compiled_backward=False);"
                    " another path runs")
        return accepts(call)
    return check


def register_path(name: str, kernel: Kernel, *, takes: NormCheck, accepts: Check, priority: int,
                  supports: Collection[str] = (), auto_exclude: Collection[str] = (), exportable: bool = False,
                  traceable: bool = True, compiled_backward: bool = True,
                  prepare: Callable[[], object] | None = None,
                  plan_stable: bool | Callable[[AttnCall], bool] = False,
                  direct: Callable[[AttnCall], Direct | None] | None = None) -> None:
    """Register a path with its declared capabilities (see the package docstring); ``supports``: the names of the
    ``FEATURES`` it applies."""
    supports = frozenset(supports)
    unknown = sorted(supports - FEATURES.keys())
    if unknown:
        raise ValueError(f"path {name!r} declares unknown call features {unknown}; known: {sorted(FEATURES)}")
    accepts = _declining_features(name, supports, accepts)
    if not compiled_backward:
        accepts = _declining_compiled_backward(name, accepts)
    if not traceable:
        accepts = _declining_compile(name, accepts)
    PATHS[name] = Path(name, kernel, takes, accepts, priority, frozenset(auto_exclude), exportable, traceable,
                       supports, compiled_backward, prepare, plan_stable, direct)
    _PREPARED.discard(name)
    _ORDER[:] = sorted((p for p in PATHS.values() if p.name != "reference"), key=lambda p: p.priority)
    _AUTO.clear()
    _EPOCH[0] += 1


@torch.compiler.assume_constant_result
def prepare_path(name: str) -> bool:
    """Run path ``name``'s ``prepare`` once (build its C++ extension: a minute the first time, cached after that);
    its ``accepts`` then reads the outcome. Marked a constant result, so torch.compile calls it for real while
    tracing instead of tracing it (no graph break). Returns True."""
    path = PATHS[name]
    if path.prepare is not None and name not in _PREPARED:
        path.prepare()
        _PREPARED.add(name)
    return True


def set_forced_path(path: str | None = None) -> str:
    """Set the globally forced path (None: re-read ``HF_ATTNORM_PATH``; "auto": none). Returns it."""
    forced = path if path is not None else (os.environ.get(ENV_VAR) or "auto")
    if forced != "auto" and forced not in PATHS:
        raise ValueError(f"unknown attention path {forced!r} (from {ENV_VAR if path is None else 'path='}); "
                         f"available: auto, {', '.join(PATHS)}")
    _FORCED["path"] = forced
    _EPOCH[0] += 1
    return forced


def forced_path() -> str:
    return _FORCED["path"]


def available_paths() -> list[str]:
    return [p.name for p in sorted(PATHS.values(), key=lambda p: p.priority)]


def paths_for(normalizer: str) -> list[str]:
    """The fast paths that implement a normalizer (reference excluded), by priority."""
    norm = NORMALIZERS.get(normalizer)
    return [p.name for p in _ORDER if p.takes(norm) is None]


def declared_normalizers(path: str) -> list[str] | None:
    """Normalizers a path implements (None for the reference and the paths that take every normalizer)."""
    p = PATHS[path]
    names = [n for n, norm in NORMALIZERS.items() if p.takes(norm) is None]
    return None if len(names) == len(NORMALIZERS) else names


def _auto_candidates(call: AttnCall) -> list[Path]:
    if call.need_weights:
        return []  # only the materialised path has the weights: explicit fallback
    key = (call.settings.normalizer, call.q.device.type)
    found = _AUTO.get(key)
    exporting = is_exporting()
    if found is None:
        norm = call.normalizer
        found = [p for p in _ORDER if key[1] not in p.auto_exclude and p.takes(norm) is None]
        if not exporting:  # (an exported program holds no custom op: nothing to build)
            for p in found:
                if p.prepare is not None:
                    prepare_path(p.name)
            _AUTO[key] = found
    if exporting:  # portable graphs: no custom op, no length-sized loop (docs/export.md);
        if not DYNAMIC_EXPORT and any(isinstance(n, torch.SymInt) for n in (*call.q.shape, *call.k.shape)):
            raise AttnormError(DYNAMIC_EXPORT_FEATURE.message())
        # auto_exclude is about speed on a device, so it does not apply here (sdpa_sinkcol takes the sinks)
        return [p for p in _ORDER if p.exportable and p.takes(call.normalizer) is None]
    return found


def candidate_paths(call: AttnCall) -> list[str]:
    """Fast paths the rule considers for this call, in order (the reference is always last)."""
    return [p.name for p in _auto_candidates(call)]


def choose(call: AttnCall, path: str | None = None) -> str:
    """The path that will run ``call`` (``path``/HF_ATTNORM_PATH forcing one); raises ValueError when a forced path
    cannot take it. Runs nothing."""
    forced = path or _FORCED["path"]
    if forced != "auto":
        if forced not in PATHS:
            raise ValueError(f"unknown attention path {forced!r} (from {'path=' if path else ENV_VAR}); "
                             f"available: auto, {', '.join(PATHS)}")
        if call.need_weights and forced != "reference":
            raise ValueError(f"path {forced!r} cannot return attention weights; output_attentions needs 'reference'")
        if PATHS[forced].prepare is not None and not is_exporting():
            prepare_path(forced)
        why = PATHS[forced].check(call)
        if why is not None:
            raise ValueError(f"path {forced!r} cannot run this call (normalizer {call.settings.normalizer!r}, "
                             f"dtype {call.q.dtype}, device {call.q.device}, mask {call.mask.kind}, "
                             f"dropout {call.dropout}): {why}")
        return forced
    chosen = "reference"
    for p in _auto_candidates(call):  # (a loop: Dynamo before torch 2.9 cannot trace next() over a generator)
        if p.accepts(call) is None:
            chosen = p.name
            break
    else:
        _reference_can_run(call)
    if call.dropout > 0 and not torch.compiler.is_compiling():
        _warn_dropout_fallback(call, chosen)
    return chosen


#: (normalizer, device type, path without dropout, path with it) already warned about
_WARNED_DROPOUT: set[tuple[str, str, str, str]] = set()


def _warn_dropout_fallback(call: AttnCall, chosen: str) -> None:
    """Attention dropout moved the call off the path it takes without dropout: say so once per pair of paths (the
    path it runs on applies the dropout exactly, but the switch to a slower path should not be silent)."""
    plain = dataclasses.replace(call, dropout=0.0)
    fast = next((p for p in _auto_candidates(plain) if p.accepts(plain) is None), None)
    if fast is None or fast.name == chosen:
        return
    key = (call.settings.normalizer, call.q.device.type, fast.name, chosen)
    if key in _WARNED_DROPOUT:
        return
    _WARNED_DROPOUT.add(key)
    warnings.warn(
        f"hf_attnorm: attention dropout {call.dropout} (training): path {fast.name!r} cannot apply it "
        f"({fast.accepts(call)}), so {call.settings.normalizer!r} runs on {chosen!r} instead (exact, slower). Set "
        "the model's attention dropout to 0 to keep the fast path.", stacklevel=2)


def explain(call: AttnCall) -> list[tuple[str, str]]:
    """For each path the rule considers, in order: (name, why it declines or "runs"). Runs no kernel."""
    report = []
    for p in _auto_candidates(call):
        why = p.accepts(call)
        report.append((p.name, why or "runs"))
        if why is None:
            return report
    report.append(("reference", "runs" if not call.need_weights else "runs (weights requested)"))
    return report


@dataclasses.dataclass(frozen=True)
class Route:
    """What the automatic rule decided for a call, to reuse for the calls with the same plan facts (module
    docstring): ``path`` ran; ``ask`` are the paths to ask again on each call, in order (those before ``path`` whose
    decline is not stable, then ``path`` itself when its acceptance is not)."""

    path: str
    ask: tuple[Path, ...]


def route(call: AttnCall) -> Route | None:
    """The reusable decision for ``call`` (runs no kernel), or None when it cannot be reused: a forced path,
    dropout, autograd on (whether inputs need gradients is no plan fact), while tracing or exporting."""
    if (_FORCED["path"] != "auto" or call.dropout > 0 or torch.is_grad_enabled() or torch.compiler.is_compiling()
            or is_exporting()):
        return None
    ask = []
    for p in _auto_candidates(call):
        stable = p.stable_for(call)
        if p.accepts(call) is None:
            return Route(p.name, (*ask, p) if not stable else tuple(ask))
        if not stable:
            ask.append(p)
    return Route("reference", tuple(ask)) if PATHS["reference"].accepts(call) is None else None


def choose_routed(call: AttnCall, kept: Route) -> str:
    """The path for ``call`` from a kept ``Route``: only its ``ask`` paths are asked again; should the routed path
    itself decline, the whole rule decides (``choose``)."""
    for p in kept.ask:
        if p.accepts(call) is None:
            return p.name
        if p.name == kept.path:  # the routed path declines this call
            return choose(call)
    return kept.path


def attend(call: AttnCall, path: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """Run one call on the path the rule (or ``path``) picks: (out [B, H, Lq, Dv], weights or None, the path's
    name), as the path returns them (the variants around the call: kernels/variants.py)."""
    return run_path(call, choose(call, path))


def run_path(call: AttnCall, name: str) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """Run ``call`` on the path ``name`` (chosen by ``choose`` or ``choose_routed``)."""
    out, w = PATHS[name].kernel(call)
    return out, w, name




register_path("reference", reference_attention, takes=_any_normalizer, accepts=_reference_accepts, priority=100,
              supports=FEATURES.keys(), exportable=True, plan_stable=True)
