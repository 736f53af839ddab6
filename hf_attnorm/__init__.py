"""hf_attnorm: attention normalizers and length-aware scales as Hugging Face Transformers attention implementations.

``import hf_attnorm`` registers every implementation name (``hf_attnorm.available()``) with transformers'
``AttentionInterface`` and ``AttentionMaskInterface``; then::

    AutoModelForCausalLM.from_pretrained(path, attn_implementation="symax")
    AutoModelForCausalLM.from_pretrained(path, attn_implementation="softmax", attnorm={"scale": "ssmax"})
    model.set_attn_implementation("softmax1")

On plain tensors: ``from hf_attnorm.attention import attention``.
"""

from __future__ import annotations

import torch as _torch

from .supported import MIN_TORCH as _MIN_TORCH
from .supported import torch_problem as _torch_problem

if (_problem := _torch_problem(_torch.__version__)) is not None:  # (pip refuses it too; a source checkout may not)
    raise ImportError(f"{_problem}. Install a supported torch, e.g. pip install 'torch>={_MIN_TORCH}'")

from . import normalizers, scales  # noqa: E402, F401  (registers every normalizer and scale)
from .hf.integration import apply, register  # noqa: E402
from .hf.state import AttnormState  # noqa: E402
from .registry import NORMALIZERS, PRESETS, SCALES, AttnormError, UnknownNameError, first_line  # noqa: E402
from .settings import OPTIONS, AttnormSettings, resolve_settings  # noqa: E402
from .version import __version__  # noqa: E402


def available(kind: str = "implementations") -> dict[str, str]:
    """Registered names -> one-line description. kind: "implementations" (attn_implementation names, default),
    "normalizers", "scales" or "options"."""
    if kind == "implementations":
        return {name: first_line(p.description) for name, p in PRESETS.items()}
    if kind == "normalizers":
        return {name: first_line(n.description) for name, n in NORMALIZERS.items()}
    if kind == "scales":
        return {name: first_line(s.description) for name, s in SCALES.items()}
    if kind == "options":
        return {name: o.help for name, o in OPTIONS.items()}
    raise ValueError(f"available(kind=...) must be implementations, normalizers, scales or options; got {kind!r}")


register()

__all__ = [
    "AttnormError",
    "AttnormSettings",
    "AttnormState",
    "UnknownNameError",
    "apply",
    "available",
    "resolve_settings",
    "__version__",
]
