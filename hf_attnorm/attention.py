"""The tensor API: attention with any registered normalizer and scale on plain tensors.

``attention(q, k, v, ...)`` works on raw tensors (benchmarks, tests, custom models); ``make_call`` resolves one
call (mask -> keep/n, scale -> multiplier, per-head factors) into the ``AttnCall`` every kernel receives. The
function transformers calls (``hf_attnorm.hf.forward``) builds on ``make_call`` with a module's state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .kernels import attend
from .kernels.base import AttnCall
from .masks import build_mask_info
from .normalizers.base import Ctx, ParamSpec
from .registry import NORMALIZERS, SCALES
from .settings import AttnormSettings, resolve_settings


def param_specs(settings: AttnormSettings) -> tuple[ParamSpec, ...]:
    """Per-head values of the settings' normalizer and scale."""
    return (*NORMALIZERS.get(settings.normalizer).params, *SCALES.get(settings.scale).params)


def constant_heads(settings: AttnormSettings, num_heads: int, device=None) -> dict[str, torch.Tensor]:
    """Per-head values [H] at their initial values (fp32), for calls without a module."""
    return {
        spec.name: torch.full((num_heads,), spec.init_value(settings), dtype=torch.float32, device=device)
        for spec in param_specs(settings)
    }


def make_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    settings: AttnormSettings,
    heads: Mapping[str, torch.Tensor],
    attention_mask: object = None,
    causal: bool = False,
    scaling: float | None = None,
    dropout: float = 0.0,
    need_weights: bool = False,
    module_info: Mapping[str, Any] | None = None,
) -> AttnCall:
    """Resolve one call: mask -> keep/n, scale -> multiplier, per-head factors. Shapes as ``attention``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, H, L, D]; got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if H % Hkv != 0 or v.shape[1] != Hkv or v.shape[2] != Lk or k.shape[-1] != D:
        raise ValueError(f"incompatible shapes q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    norm, sc = NORMALIZERS.get(settings.normalizer), SCALES.get(settings.scale)
    mask = build_mask_info(attention_mask, B, H, Lq, Lk, causal, q.device)
    if mask.dead is not None:
        # keys no query can see (padding) are zeroed, so garbage there (1e10, NaN) cannot leak through 0 * x; always
        # applied with a mask (a where per layer) rather than after asking whether any key is dead (a host sync)
        zero = torch.zeros((), dtype=k.dtype, device=k.device)
        k = torch.where(mask.dead, zero, k)
        v = torch.where(mask.dead, zero.to(v.dtype), v)
    heads = dict(heads)
    info = dict(module_info or {})
    ctx = Ctx(settings, heads, D, mask.n, info, Lk)
    mult = sc.multiplier(mask.n, ctx)
    head_factor = norm.head_multiplier(ctx)
    if head_factor is not None:
        hf = head_factor.view(1, -1, 1)
        mult = hf if mult is None else mult * hf
    if scaling is None:
        scaling = D**-0.5
    base = float(scaling) if norm.uses_base_scaling else 1.0
    return AttnCall(q, k, v, mask, settings, heads, base, mult, dropout, need_weights, info)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    implementation: str | AttnormSettings = "softmax",
    *,
    attention_mask: object = None,
    causal: bool = False,
    scaling: float | None = None,
    heads: Mapping[str, torch.Tensor] | None = None,
    dropout: float = 0.0,
    need_weights: bool = False,
    path: str | None = None,
    module_info: Mapping[str, Any] | None = None,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention with any registered normalizer and scale on plain tensors.

    q: [B, H, Lq, D]; k: [B, Hkv, Lk, D]; v: [B, Hkv, Lk, Dv] (H a multiple of Hkv); attention_mask: None, or a
    bool/0-1/additive mask [B|1, 1|H, Lq, Lk], [B, Lq, Lk] or [B, Lk]; causal: with no mask, query i sees keys
    j <= i (upper-left, as SDPA); scaling: the base scale (default 1/sqrt(D)); heads: per-head values [H]
    (e.g. ``{"ssmax_s": s}``; default: initial values from the settings); options: attnorm options
    (``eta=0.5``...). Returns (out [B, H, Lq, Dv], weights [B, H, Lq, Lk] if need_weights else None).
    """
    settings = implementation if isinstance(implementation, AttnormSettings) else resolve_settings(
        implementation, options)
    if isinstance(implementation, AttnormSettings) and options:
        settings = settings.replace(**options)
    all_heads = constant_heads(settings, q.shape[1], q.device)
    all_heads.update(heads or {})
    call = make_call(q, k, v, settings, all_heads, attention_mask, causal, scaling, dropout, need_weights,
                     module_info)
    out, w, _ = attend(call, path)
    return out, w


