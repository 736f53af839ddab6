"""Kernel layer: one entry point, a dispatch rule, and an override so tests can force any path.

Paths (``available_paths()``): ``reference`` (materialised, any normalizer, the only one returning weights) and
the fast paths registered by the other modules of this package. The rule picks, for (normalizer, device, dtype,
needs-weights, dropout), the first registered fast path that accepts the call, else the reference.
Override: ``path=`` on ``attention()``/``attend()``, or the environment variable ``HF_ATTNORM_PATH`` (a path name or
``auto``). A forced path that cannot take a call raises instead of silently falling back.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Callable

import torch

from .base import AttnCall
from .reference import reference_attention

Kernel = Callable[[AttnCall], "tuple[torch.Tensor, torch.Tensor | None] | None"]

#: name -> kernel; a kernel returns None when it cannot take the call (unsupported mask, dtype, ...)
PATHS: dict[str, Kernel] = {"reference": reference_attention}
#: normalizer name -> fast path names to try in order (all normalizers: "*")
RULES: dict[str, list[str]] = {}

ENV_VAR = "HF_ATTNORM_PATH"


def register_path(name: str, kernel: Kernel, normalizers: list[str]) -> None:
    """Register a fast path for the given normalizers (tried in registration order)."""
    PATHS[name] = kernel
    for norm in normalizers:
        RULES.setdefault(norm, []).append(name)


def available_paths() -> list[str]:
    return list(PATHS)


def candidate_paths(call: AttnCall) -> list[str]:
    """Fast paths the rule would try for this call, in order (the reference is always last)."""
    if call.need_weights:
        return []  # only the materialised path has the weights: explicit fallback
    return [*RULES.get(call.settings.normalizer, []), *RULES.get("*", [])]


def attend(call: AttnCall, path: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """Run one call. Returns (out [B, H, Lq, Dv], weights or None, name of the path that ran)."""
    forced = path or os.environ.get(ENV_VAR) or "auto"
    if forced != "auto":
        if forced not in PATHS:
            raise ValueError(f"unknown attention path {forced!r} (from {'path=' if path else ENV_VAR}); "
                             f"available: auto, {', '.join(PATHS)}")
        if call.need_weights and forced != "reference":
            raise ValueError(f"path {forced!r} cannot return attention weights; output_attentions needs 'reference'")
        res = PATHS[forced](call)
        if res is None:
            mask = "given" if call.mask.keep is not None else "none"
            raise ValueError(f"path {forced!r} cannot run this call (normalizer {call.settings.normalizer!r}, "
                             f"dtype {call.q.dtype}, device {call.q.device}, mask {mask})")
        return res[0], res[1], forced
    for name in candidate_paths(call):
        res = PATHS[name](call)
        if res is not None:
            return res[0], res[1], name
    out, w = reference_attention(call)
    return out, w, "reference"


# every other module of this package registers its path(s) with register_path when imported
for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name not in ("base", "reference"):
        importlib.import_module(f"{__name__}.{_info.name}")
