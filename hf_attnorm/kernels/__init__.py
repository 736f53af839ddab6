"""Kernel layer: one entry point, a dispatch rule, and an override so tests can force any path.

Paths (``available_paths()``): ``reference`` (materialised, any normalizer, the only one returning weights) and
the fast paths registered by the other modules of this package with ``register_path``:

============== ================================================= ==========================================
path           normalizers                                       takes
============== ================================================= ==========================================
sdpa           softmax, cosine, softmax_n, sink (+ every scale)  CPU: any dtype (fp16/bf16 in fp32); other
                                                                 devices: softmax/cosine. Dropout: softmax,
                                                                 cosine only. Needs D == Dv for the sinks.
sdpa_sinkcol   softmax_n, sink                                   any device (auto: not on CPU, where D+1
                                                                 falls off SDPA's fast kernel); dropout ok
fused_cpu      symax, squared, stablemax, softpick, sigmoid,     CPU, no dropout, C++ compiled on first use
               relu_len, entmax15, sparsemax
triton         the fused_cpu set                                 CUDA (or TRITON_INTERPRET=1), no dropout
linear_chunked linear                                            any, no dropout
chunked        every normalizer ("*")                            any (pure PyTorch, O(n * chunk) memory)
reference      every normalizer                                  any; the only path returning weights
============== ================================================= ==========================================

The rule, for (normalizer, device, dtype, needs-weights, dropout): needs-weights (``output_attentions``) -> the
reference, explicitly; otherwise the normalizer's own fast paths in registration order, then the ``"*"`` paths,
then the reference; each path inspects the call and declines what it cannot run (device, dtype, dropout, a
missing compiler...), so the first one that accepts runs it. Override: ``path=`` on ``attention()``/``attend()``,
or the environment variable ``HF_ATTNORM_PATH`` (a path name or ``auto``). A forced path that cannot take a call
raises, naming the reason, instead of silently falling back.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Callable, Collection

import torch

from .base import AttnCall
from .reference import reference_attention

Kernel = Callable[[AttnCall], "tuple[torch.Tensor, torch.Tensor | None] | None"]


class PathDeclined(Exception):
    """Raised by a kernel that cannot run a call (same meaning as returning None, but with the reason)."""


#: name -> kernel; a kernel returns None (or raises PathDeclined) when it cannot take the call
PATHS: dict[str, Kernel] = {"reference": reference_attention}
#: normalizer name -> fast path names to try in order (all normalizers: "*")
RULES: dict[str, list[str]] = {}
#: path name -> device types the automatic rule skips it on (it still runs there when forced)
AUTO_EXCLUDE: dict[str, frozenset[str]] = {}

ENV_VAR = "HF_ATTNORM_PATH"


def register_path(name: str, kernel: Kernel, normalizers: list[str], *,
                  exclude_devices: Collection[str] = ()) -> None:
    """Register a fast path for the given normalizers (tried in registration order; ``"*"`` = every normalizer,
    tried after the specific ones). ``exclude_devices``: device types ("cpu", "cuda") where the automatic rule
    skips this path because a better one exists there."""
    PATHS[name] = kernel
    if exclude_devices:
        AUTO_EXCLUDE[name] = frozenset(exclude_devices)
    for norm in normalizers:
        RULES.setdefault(norm, []).append(name)


def available_paths() -> list[str]:
    return list(PATHS)


def paths_for(normalizer: str) -> list[str]:
    """Fast paths declared for a normalizer (its own, then the ``"*"`` ones), in the order the rule tries them."""
    return [*RULES.get(normalizer, []), *RULES.get("*", [])]


def declared_normalizers(path: str) -> list[str] | None:
    """Normalizers a path declares (None for the reference and ``"*"`` paths, which take every normalizer)."""
    if path == "reference" or path in RULES.get("*", []):
        return None
    return [norm for norm, names in RULES.items() if path in names]


def candidate_paths(call: AttnCall) -> list[str]:
    """Fast paths the rule would try for this call, in order (the reference is always last)."""
    if call.need_weights:
        return []  # only the materialised path has the weights: explicit fallback
    device = call.q.device.type
    return [p for p in paths_for(call.settings.normalizer) if device not in AUTO_EXCLUDE.get(p, ())]


def _run(name: str, call: AttnCall) -> tuple[tuple[torch.Tensor, torch.Tensor | None] | None, str | None]:
    try:
        return PATHS[name](call), None
    except PathDeclined as exc:
        return None, str(exc)


def explain(call: AttnCall) -> list[tuple[str, str]]:
    """For each path the rule considers, in order: (name, why it declines or "runs"). Runs the kernels (it is
    how they decide), so use it for diagnosis, not in a hot loop."""
    report = []
    for name in candidate_paths(call):
        res, why = _run(name, call)
        if res is not None:
            report.append((name, "runs"))
            return report
        report.append((name, why or "declines"))
    report.append(("reference", "runs" if not call.need_weights else "runs (weights requested)"))
    return report


def attend(call: AttnCall, path: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """Run one call. Returns (out [B, H, Lq, Dv], weights or None, name of the path that ran)."""
    forced = path or os.environ.get(ENV_VAR) or "auto"
    if forced != "auto":
        if forced not in PATHS:
            raise ValueError(f"unknown attention path {forced!r} (from {'path=' if path else ENV_VAR}); "
                             f"available: auto, {', '.join(PATHS)}")
        if call.need_weights and forced != "reference":
            raise ValueError(f"path {forced!r} cannot return attention weights; output_attentions needs 'reference'")
        res, why = _run(forced, call)
        if res is None:
            mask = "given" if call.mask.keep is not None else ("causal" if call.mask.causal else "none")
            raise ValueError(f"path {forced!r} cannot run this call (normalizer {call.settings.normalizer!r}, "
                             f"dtype {call.q.dtype}, device {call.q.device}, mask {mask}, dropout {call.dropout})"
                             + (f": {why}" if why else ""))
        return res[0], res[1], forced
    for name in candidate_paths(call):
        res, _ = _run(name, call)
        if res is not None:
            return res[0], res[1], name
    out, w = reference_attention(call)
    return out, w, "reference"


# every other module of this package registers its path(s) with register_path when imported
for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name not in ("base", "reference"):
        importlib.import_module(f"{__name__}.{_info.name}")
