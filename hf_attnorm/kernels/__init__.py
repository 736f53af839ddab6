"""Kernel layer: one entry point, paths that declare what they accept, and an override so tests can force any path.

Every path (``register_path``) states, without running anything:

* ``takes(normalizer)``: None if it implements that normalizer (read from the normalizer's declared
  ``kernel_family`` / ``fused_map``, never from its name), else the reason;
* ``accepts(call)``: None if it can run this call (device, dtype, dropout, mask kind, weights, head dims ...), else
  the reason. It looks only at shapes, dtypes, devices and settings: no kernel runs, no value is read from a tensor,
  so it costs microseconds and traces under torch.compile;
* ``priority``: lower is tried first; ``auto_exclude``: device types on which the automatic rule skips it;
* ``prepare``: what the path needs done once before it can accept a call (building its family's C++ extension,
  kernels/native.py), run by the dispatcher the first time its rule considers the path for a normalizer and device, or
  when it is forced (``prepare_path``): never by ``accepts``, and never traced (under torch.compile it runs for real
  while Dynamo traces, so a model compiled before any eager call still gets the path);
* ``exportable``: the automatic rule considers it under ``torch.export`` (and so ``torch.onnx.export``): a pure
  PyTorch path whose traced graph holds no hf_attnorm custom op and no loop sized from the sequence length, so the
  exported program runs without the compiled extension, converts to ONNX, and keeps a dynamic sequence length.

============== ========= ============================================= =========================================
path           priority  normalizers (declared family)                 accepts
============== ========= ============================================= =========================================
triton_forget  8         "softmax" with forget gates (fox)             a call carrying a forget gate; auto: CUDA;
                                                                       forced: CPU under TRITON_INTERPRET=1
sdpa           10        "softmax" (softmax, cosine, softmax_n, sink)  CPU: any float dtype (fp16/bf16 in fp32);
                                                                       elsewhere no sink. Dropout: no sink only.
sdpa_sinkcol   20        "softmax" with a sink (softmax_n, sink)       any; auto: not on CPU (D+1 is slow there)
selective_step 24        query-coupled with a selecting head           one query (a decode step), no score
                         (selective)                                   modifiers, no dropout, no carry needing
                                                                       grad
triton         30        "fused" (symax, squared, stablemax, ...)      auto: CUDA; forced: CPU under
                                                                       TRITON_INTERPRET=1. No dropout, no fp64
selective_triton
               35        query-coupled with a selecting head           auto: CUDA; forced: CPU under
                         (selective), no q/k transform                 TRITON_INTERPRET=1. No score modifiers,
                                                                       no dropout, no fp64, not under compile;
                                                                       takes ``selective_carry``
fused_cpu      40        "fused"                                       CPU, no dropout, C++ built on first use
selective_cpu  44        query-coupled with a selecting head           CPU, no score modifiers, no dropout, a
                         (selective)                                   ``selective_carry`` only as [B | 1, Lk];
                                                                       C++ built on first use
linear_recurrent
               45        "linear" with query/key_features (linear)     one query with ``AttnCall.recurrent`` set
                                                                       (a cache's state, hf/recurrent.py); no
                                                                       dropout, no grad
linear_chunked 50        "linear" (linear)                             no dropout; a mask only as key padding x
                                                                       causal (MaskInfo.padding), or one query
selective      85        query-coupled with a selecting head           no score modifiers, no dropout; takes
                         (selective)                                   ``AttnCall.selective_carry`` (a cached
                                                                       step), as decode and reference do; every
                                                                       other path declines a call carrying it
chunked        90        every normalizer but query-coupled ones       any (pure PyTorch, O(n * chunk) memory)
reference      100       every normalizer                              any; the only path returning weights
============== ========= ============================================= =========================================

Score modifiers on the call (``AttnCall.softcap``/``bias``/``alibi_slopes``/``sinks``) are part of each
``accepts``: reference, chunked and decode apply all of them (ALiBi slopes through ``AttnCall.score_bias()``); sdpa
a bias (in its float mask; a bias that needs a gradient leaves the sink rewrite) and sinks, not a soft-cap;
sdpa_sinkcol sinks only; triton and fused_cpu a soft-cap, a bias (read through its broadcast strides, with its
gradient) and ALiBi slopes in the kernel, not sinks; linear_recurrent and linear_chunked none. ``make_call``
leaves ALiBi slopes unmaterialised only for the normalizers the fused kernels take (the softmax family gets the bias
tensor).

The rule: needs-weights (``output_attentions``) -> the reference; otherwise the first path by priority whose
``auto_exclude`` does not hold the call's device and whose ``takes`` and ``accepts`` say None; while
``torch.compiler.is_exporting()``, only the ``exportable`` paths (sdpa, sdpa_sinkcol: any device) and the reference
(docs/export.md); while ``torch.compile`` traces, a path registered ``traceable=False`` (triton_stickbreaking,
triton_selective) declines,
and one registered ``compiled_backward=False`` (chunked, selective) declines calls that need gradients;
a call carrying a forget gate (``AttnCall.forget``, forgetting attention) only goes to the paths registered
``forget=True`` (reference, chunked, decode, sdpa, triton_forget). A differential call (differential attention) is
decided and run as its two halves (``AttnCall.halves``), which ``attend`` combines; with attention dropout it runs on
the reference.
``explain(call)`` lists every candidate with its reason, running nothing.

Plans (``Route``, used by the transformers integration, hf/forward.py): what the rule decided for one call is kept
and reused for every call with the same plan facts (device, dtypes, head counts and dims, one query or several, the
kind of mask, which score modifiers and cache states the call carries, no autograd, no forced path). A path
registered ``plan_stable`` (True, or a function of the call) declares that its ``accepts`` reads nothing beyond
those facts, so a reused route asks it nothing again; every other path is asked again on each call. A path may
offer a ``direct`` entry: given a resolved call, a function of the raw (q, k, v) and the call's per-head values
computing the same output for every call with the same plan facts, or None (hf/forward.py uses it only for calls
without a mask tensor, score modifiers, output gate, forget gates, learned memory or cache state).

Override: ``path=`` on ``attention()``/``attend()``, or the environment variable ``HF_ATTNORM_PATH`` (a path name or
``auto``; read when this package is imported and by ``set_forced_path()``), so ``attend`` reads no environment. A
forced path that cannot take a call raises, naming the reason, instead of silently falling back.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
import warnings
from collections.abc import Callable, Collection

import torch

from ..normalizers.base import Normalizer
from ..registry import NORMALIZERS, AttnormError
from ..torch_compat import DYNAMIC_EXPORT, DYNAMIC_EXPORT_FEATURE, is_exporting
from .base import AttnCall, repeat_kv
from .reference import reference_attention, reference_weights

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
    #: applies forgetting attention's decay (``AttnCall.forget``); False: declines every call carrying one
    forget: bool = False
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


#: name -> path
PATHS: dict[str, Path] = {
    "reference": Path("reference", reference_attention, _any_normalizer, _reference_accepts, 100, exportable=True,
                      forget=True, plan_stable=True),
}
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


def _declining_forget(name: str, accepts: Check) -> Check:
    """``accepts`` of a path registered without ``forget``: calls carrying a forget gate are declined first."""
    def check(call: AttnCall) -> str | None:
        if call.forget is not None:
            return f"path {name!r} does not apply a forget gate (forgetting attention; registered forget=False)"
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
                  auto_exclude: Collection[str] = (), exportable: bool = False, traceable: bool = True,
                  forget: bool = False, compiled_backward: bool = True,
                  prepare: Callable[[], object] | None = None,
                  plan_stable: bool | Callable[[AttnCall], bool] = False,
                  direct: Callable[[AttnCall], Direct | None] | None = None) -> None:
    """Register a path with its declared capabilities (see the module docstring)."""
    if not forget:
        accepts = _declining_forget(name, accepts)
    if not compiled_backward:
        accepts = _declining_compiled_backward(name, accepts)
    if not traceable:
        accepts = _declining_compile(name, accepts)
    PATHS[name] = Path(name, kernel, takes, accepts, priority, frozenset(auto_exclude), exportable, traceable,
                       forget, compiled_backward, prepare, plan_stable, direct)
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
    return [p.name for p in _auto_candidates(_routed(call))]


def _routed(call: AttnCall) -> AttnCall:
    """The call the rule decides on: a differential call's first half (both halves take the same path)."""
    return call.halves()[0] if call.split else call


def choose(call: AttnCall, path: str | None = None) -> str:
    """The path that will run ``call`` (``path``/HF_ATTNORM_PATH forcing one); raises ValueError when a forced path
    cannot take it. Runs nothing."""
    if call.split and call.dropout > 0:
        return _choose_differential_dropout(call, path)
    call = _routed(call)
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
    if call.split and call.dropout > 0:
        return [*((p.name, DIFFERENTIAL_DROPOUT) for p in _auto_candidates(_routed(call))), ("reference", "runs")]
    call = _routed(call)
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
    dropout, autograd on (whether inputs need gradients is no plan fact), while tracing or exporting, or a
    differential call whose path would have to be asked again."""
    if (_FORCED["path"] != "auto" or call.dropout > 0 or torch.is_grad_enabled() or torch.compiler.is_compiling()
            or is_exporting()):
        return None
    if call.split:  # both halves take the path decided for the first; kept only when it needs no asking again
        kept = route(call.halves()[0])
        return kept if kept is not None and not kept.ask else None
    ask = []
    for p in _auto_candidates(call):
        stable = p.stable_for(call)
        if p.accepts(call) is None:
            return Route(p.name, (*ask, p) if not stable else tuple(ask))
        if not stable:
            ask.append(p)
    return Route("reference", tuple(ask))


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
    """Run one call. Returns (out [B, H, Lq, Dv], weights or None, name of the path that ran)."""
    if call.split:
        return _attend_differential(call, path)
    return run_path(call, choose(call, path))


def run_path(call: AttnCall, name: str) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """Run a whole (not differential) call on the path ``name`` (chosen by ``choose`` or ``choose_routed``)."""
    out, w = PATHS[name].kernel(call)
    if call.drop_queries or call.memory:  # learned memory key/values (kernels/memory.py): the caller's shapes
        out = out[:, :, call.drop_queries:]
        w = None if w is None else w[:, :, call.drop_queries:, call.memory:]
    if call.output_gate is not None:  # gated attention: the weights are unchanged, the output gated (in fp32)
        out = (out.to(call.output_gate.dtype) * call.output_gate).to(out.dtype)
    return out, w, name


def _attend_differential(call: AttnCall, path: str | None) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """Differential attention: both halves on the path the rule (or ``path``) picks for them, then combined and
    normalised by the normalizer (in fp32 at least), the output gate (if any) after that."""
    if call.dropout > 0:
        return _attend_differential_dropout(call, path)
    norm, ctx = call.normalizer, call.ctx()
    first, second = call.halves()
    out_first, w_first, name = attend(first, path)
    out_second, w_second, _ = attend(second, path)
    form = norm.difference_form(ctx) if triton_rows.usable(out_first) else None
    if form is not None and tuple(form[1].shape) == (out_first.shape[1], out_first.shape[-1]):
        # on a GPU in half precision: the combination and its RMSNorm in one fused pass (fp32 inside)
        out = triton_rows.rms_difference(out_first, out_second, *form)
    else:
        out = norm.normalize_output(norm.halves_difference(out_first, out_second, ctx), ctx)
    if call.output_gate is not None:
        out = out * call.output_gate
    w = None if w_first is None else norm.halves_difference(w_first, w_second, ctx).to(w_first.dtype)
    return out.to(call.q.dtype), w, name


#: why a differential call with attention dropout runs on the reference path
DIFFERENTIAL_DROPOUT = ("attention dropout on a differential normalizer drops entries of the combined weights "
                        "A1 - lambda A2, which only the materialised 'reference' path forms")


def _choose_differential_dropout(call: AttnCall, path: str | None) -> str:
    """Attention dropout acts on the combined weights A1 - lambda A2 (dropping the halves apart would keep a weight
    where only one half is dropped), which only the materialised path forms: forced elsewhere, refused."""
    forced = path or _FORCED["path"]
    if forced not in ("auto", "reference"):
        raise ValueError(f"path {forced!r} cannot run this call (normalizer {call.settings.normalizer!r}, dropout "
                         f"{call.dropout}): {DIFFERENTIAL_DROPOUT} (set the attention dropout to 0 to keep the fast "
                         "paths)")
    return "reference"


def _attend_differential_dropout(call: AttnCall, path: str | None) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """The combined weights, dropped, times v (``_choose_differential_dropout``)."""
    forced = path or _FORCED["path"]
    name = call.settings.normalizer
    choose(call, path)  # raises when another path is forced
    if forced == "auto" and not torch.compiler.is_compiling():
        fast = choose(dataclasses.replace(call, dropout=0.0))
        key = (name, call.q.device.type, fast, "reference")
        if fast != "reference" and key not in _WARNED_DROPOUT:
            _WARNED_DROPOUT.add(key)
            warnings.warn(f"hf_attnorm: attention dropout {call.dropout} (training): {name!r} drops entries of its "
                          "combined weights, which only the materialised path forms, so it runs on 'reference' "
                          f"instead of {fast!r} (exact, slower). Set the model's attention dropout to 0 to keep the "
                          "fast path.", stacklevel=3)
    norm, ctx = call.normalizer, call.ctx()
    w = torch.nn.functional.dropout(reference_weights(call), p=call.dropout, training=True)
    out = w @ repeat_kv(call.v, call.groups).to(w.dtype)
    if call.drop_queries or call.memory:
        out, w = out[:, :, call.drop_queries:], w[:, :, call.drop_queries:, call.memory:]
    out = norm.normalize_output(out, ctx)
    if call.output_gate is not None:
        out = out * call.output_gate
    return out.to(call.q.dtype), (w.to(call.q.dtype) if call.need_weights else None), "reference"


# every other module and family folder of this package registers its path(s) with register_path when imported
for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name not in ("base", "reference", "memory"):
        importlib.import_module(f"{__name__}.{_info.name}")
set_forced_path()

from . import triton_rows  # noqa: E402  (imported with the paths above; used by the differential combine)
