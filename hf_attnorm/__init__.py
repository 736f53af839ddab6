"""hf_attnorm: attention normalizers and length-aware scales as Hugging Face Transformers attention implementations.

``import hf_attnorm`` registers every implementation name (``hf_attnorm.available()``) with transformers'
``AttentionInterface`` and ``AttentionMaskInterface``; then::

    AutoModelForCausalLM.from_pretrained(path, attn_implementation="symax")
    AutoModelForCausalLM.from_pretrained(path, attn_implementation="softmax", attnorm={"scale": "ssmax"})
    model.set_attn_implementation("softmax1")

On plain tensors: ``from hf_attnorm.attention import attention``.
"""

from __future__ import annotations

from . import normalizers, scales  # noqa: F401  (registers every normalizer and scale)
from .hf.integration import apply, register
from .hf.state import AttnormState
from .registry import NORMALIZERS, PRESETS, SCALES, AttnormError, UnknownNameError, first_line
from .settings import OPTIONS, AttnormSettings, resolve_settings
from .version import __version__


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
