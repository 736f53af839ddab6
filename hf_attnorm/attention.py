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
from .kernels.base import Around, AttnCall, alibi_bias, query_factor, repeat_kv
from .kernels.fused.maps import fused_takes
from .kernels.memory import memory_specs, prepend_memory
from .masks import MaskError, build_mask_info, select_keys, split_float_mask
from .normalizers.base import Ctx, ParamSpec
from .registry import NORMALIZERS, SCALES
from .settings import AttnormSettings, resolve_settings


def param_specs(settings: AttnormSettings) -> tuple[ParamSpec, ...]:
    """Per-head values of the settings' normalizer and scale, and the learned memory key/values if used."""
    return (*NORMALIZERS.get(settings.normalizer).params, *SCALES.get(settings.scale).params,
            *memory_specs(settings))


def _key_values_per_query_head(settings: AttnormSettings, heads: Mapping[str, torch.Tensor], num_heads: int) -> bool:
    """Whether a normalizer's or scale's per-key/value-head value (``ParamSpec.heads="kv"``, not the learned memory,
    which handles its own) was given with one entry per query head."""
    return any(spec.heads == "kv" and spec.name in heads and heads[spec.name].shape[0] == num_heads
               for spec in (*NORMALIZERS.get(settings.normalizer).params, *SCALES.get(settings.scale).params))


def constant_heads(settings: AttnormSettings, num_heads: int, device=None,
                   head_dim: int | None = None, kv_heads: int | None = None,
                   value_dim: int | None = None) -> dict[str, torch.Tensor]:
    """Per-head values ([H] or [H, ...], ``ParamSpec.shape``) at their initial values (fp32), for calls without a
    module. head_dim: D of q/k, needed only by values shaped by it; kv_heads: Hkv, read by values per key/value head
    (``ParamSpec.heads="kv"``: learned memory key/values, hedgehog's key feature maps), default H (which
    ``make_call`` also accepts with GQA: one value per query head, k/v then repeated, see ``kernels/memory.py``);
    value_dim: Dv, read by values shaped by it (default head_dim)."""
    return {spec.name: spec.initial(num_heads, settings, head_dim, device, kv_heads, value_dim)
            for spec in param_specs(settings)}


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
    *,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    selection: torch.Tensor | None = None,
    heads_checked: bool = False,
    forget_prefix: torch.Tensor | None = None,
) -> AttnCall:
    """Resolve one call: mask -> keep/n, scale -> multiplier, per-head factors, score modifiers. Shapes as
    ``attention``. A float mask is split into visibility (entries <= finfo.min / 2 or -inf are masked) and a
    bias (its other values), so a float mask holding a position bias acts as in eager attention. ``heads_checked``:
    the normalizer's check against the head count already ran (a model's modules, when the implementation was set),
    so it is not repeated per call. ``forget_prefix``: for a normalizer with forget gates, the cumulative log gates
    [B, H, P] of the first P keys, kept from earlier calls (hf/forget_cache.py): only the gates of the other keys
    are computed, their sum continued from its last entry."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, H, L, D]; got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if H % Hkv != 0 or v.shape[1] != Hkv or v.shape[2] != Lk or k.shape[-1] != D:
        raise ValueError(f"incompatible shapes q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    norm = NORMALIZERS.get(settings.normalizer)
    if not heads_checked:  # (a model's modules were checked when the implementation was set: hf/state.py)
        norm.check_heads(settings, H)
    if norm.differential and D < 2:
        raise ValueError(f"normalizer {settings.normalizer!r} splits each head's query/key dims into two halves, so "
                         f"the head dim must be at least 2; got {D}")
    if isinstance(attention_mask, torch.Tensor) and attention_mask.is_floating_point():
        attention_mask, mask_bias = split_float_mask(attention_mask)
        bias = _add_bias(bias, mask_bias)
    if alibi_slopes is not None:
        alibi_slopes = _check_slopes(alibi_slopes, H)
        # with memory keys the in-kernel positions would count them: materialised before they are prepended
        if not _alibi_in_kernel(norm, alibi_slopes) or memory_specs(settings):
            bias, alibi_slopes = _add_bias(bias, alibi_bias(alibi_slopes, Lq, Lk)), None
    bias = _check_bias(bias, B, H, Lq, Lk)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != H):
        raise ValueError(f"sinks (s_aux) must be one logit per head, shape [{H}], got {list(sinks.shape)}")
    if sinks is not None and norm.row_sum == "free":
        raise ValueError(f"normalizer {settings.normalizer!r} weighs each key on its own (no sum over keys), so an "
                         "attention sink (s_aux) would change nothing; it is refused rather than ignored")
    if (bias is not None or softcap is not None or sinks is not None or alibi_slopes is not None) and norm.scoreless:
        raise ValueError(f"normalizer {settings.normalizer!r} has no score matrix, so it cannot apply a score bias, "
                         "soft-cap or attention sinks")
    mask = build_mask_info(attention_mask, B, H, Lq, Lk, causal, q.device)
    if selection is not None:
        mask = select_keys(mask, _selection_heads(selection, B, H, Hkv))
    if mask.dead is not None:
        # keys no query can see (padding) are zeroed, so garbage there (1e10, NaN) cannot leak through 0 * x; always
        # applied with a mask (a where per layer) rather than after asking whether any key is dead (a host sync)
        zero = torch.zeros((), dtype=k.dtype, device=k.device)
        k = torch.where(mask.dead, zero, k)
        v = torch.where(mask.dead, zero.to(v.dtype), v)
    heads = dict(heads)
    if Hkv != H and _key_values_per_query_head(settings, heads, H):
        # values declared per key/value head (a key-side feature map) given one per query head, as constant_heads
        # makes them without kv_heads: the group's query heads then have different key sides, so k/v are repeated
        k, v = repeat_kv(k, H // Hkv), repeat_kv(v, H // Hkv)
    info = dict(module_info or {})
    # gated attention: from the caller's raw queries (before memory query rows are prepended)
    gate = norm.output_gate(q, Ctx(settings, heads, D, mask.n, info, Lk))
    drop = memory = 0
    if memory_specs(settings):  # learned memory key/values, prepended here for every path (kernels/memory.py)
        q, k, v, mask, bias, drop = prepend_memory(q, k, v, mask, bias, heads["mem_k"], heads["mem_v"])
        memory, Lk = heads["mem_k"].shape[1], k.shape[2]
    ctx = Ctx(settings, heads, D, mask.n, info, Lk)
    prefix = 0 if forget_prefix is None or memory else forget_prefix.shape[-1]
    # forgetting attention: [B, H, Lk - prefix], cumulated over the keys in order
    log_gates = norm.forget_gates(v[:, :, prefix:] if prefix else v, ctx)
    forget = None
    if log_gates is not None:
        # in float64: the bias is a difference of two sums that grow with the length, so float32 sums would lose
        # the bias of near keys (1e-4 at 4096 keys); the bias itself is formed in float64 and then cast
        wide = torch.float32 if q.device.type == "mps" else torch.float64  # (MPS has no float64)
        if prefix:  # continued from the kept sum: the same additions, in the same order, as over every key
            assert forget_prefix is not None
            tail = torch.cumsum(torch.cat([forget_prefix[..., -1:], log_gates.to(wide)], dim=-1), dim=-1)
            forget = torch.cat([forget_prefix, tail[..., 1:]], dim=-1)
        else:
            forget = torch.cumsum(log_gates.to(wide), dim=-1)
    mult = query_factor(settings, q, ctx)
    if scaling is None:
        scaling = D**-0.5
    base = float(scaling) if norm.uses_base_scaling else 1.0
    around = (Around(gate, memory, drop, norm.differential)
              if gate is not None or memory or drop or norm.differential else None)
    return AttnCall(q, k, v, mask, settings, heads, base, mult, dropout, need_weights, info, bias=bias,
                    softcap=None if softcap is None else float(softcap), sinks=sinks, alibi_slopes=alibi_slopes,
                    forget=forget, around=around)


def _selection_heads(selection: torch.Tensor, B: int, H: int, Hkv: int) -> torch.Tensor:
    """selection [B or 1, 1 or Hkv or H, Lq or 1, Lk] -> [B or 1, 1 or H, Lq or 1, Lk]: query head h takes the
    selection of its key/value head h // (H / Hkv), as transformers' repeat_kv pairs them."""
    if not isinstance(selection, torch.Tensor) or selection.dim() != 4 or selection.shape[0] not in (1, B) \
            or selection.shape[1] not in (1, Hkv, H):
        got = list(selection.shape) if isinstance(selection, torch.Tensor) else type(selection).__name__
        raise MaskError(f"a key selection must be [B={B} or 1, 1, Hkv={Hkv} or H={H} heads, Lq or 1, Lk]; got {got}")
    h = selection.shape[1]
    return selection.repeat_interleave(H // h, dim=1) if h not in (1, H) else selection


def _check_slopes(slopes: torch.Tensor, H: int) -> torch.Tensor:
    if not isinstance(slopes, torch.Tensor) or not slopes.is_floating_point() or slopes.numel() != H:
        raise ValueError(f"alibi_slopes must be a float tensor of {H} values (one per head), got "
                         + (f"{slopes.dtype} of shape {list(slopes.shape)}" if isinstance(slopes, torch.Tensor)
                            else type(slopes).__name__))
    return slopes.reshape(H)


def _alibi_in_kernel(norm, slopes: torch.Tensor) -> bool:
    """Slopes stay unmaterialised (``AttnCall.alibi_slopes``) for normalizers the fused kernels run, which
    compute -m |i - j| in place; every other path adds ``AttnCall.score_bias()``. Slopes that need a gradient are
    materialised (the kernels give none for them)."""
    return fused_takes(norm, "fused") is None and not (slopes.requires_grad and torch.is_grad_enabled())


def _add_bias(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else a + b


def _check_bias(bias: torch.Tensor | None, B: int, H: int, Lq: int, Lk: int) -> torch.Tensor | None:
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        raise ValueError(f"a score bias must be a float tensor, got {type(bias).__name__}"
                         + (f" of dtype {bias.dtype}" if isinstance(bias, torch.Tensor) else ""))
    if bias.dim() == 3:
        bias = bias.unsqueeze(0)
    ok = bias.dim() == 4 and all(s in (1, full) for s, full in zip(bias.shape, (B, H, Lq, Lk)))
    if not ok:
        raise ValueError(f"score bias of shape {list(bias.shape)} does not broadcast to [B={B}, H={H}, Lq={Lq}, "
                         f"Lk={Lk}]; expected [B or 1, H or 1, Lq or 1, Lk or 1]")
    return bias


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
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    selection: torch.Tensor | None = None,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention with any registered normalizer and scale on plain tensors.

    q: [B, H, Lq, D]; k: [B, Hkv, Lk, D]; v: [B, Hkv, Lk, Dv] (H a multiple of Hkv); attention_mask: None, or a
    mask [B|1, 1|H, Lq, Lk], [B, Lq, Lk] or [B, Lk] that is bool (True = keep), integer 0/1 (1 = keep) or additive
    float as SDPA and eager attention read it (-inf/finfo.min = masked, any other value is added to the score: a
    float 0/1 mask is therefore a bias, not a keep-mask); causal: with no mask, query i sees keys
    j <= i (upper-left, as SDPA); scaling: the base scale (default 1/sqrt(D)); heads: per-head values [H]
    (e.g. ``{"ssmax_s": s}``; default: initial values from the settings; learned memory key/values
    ``mem_k``/``mem_v`` are [Hkv, M, D] per key/value head, or [H, M, D] per query head); options: attnorm options
    (``eta=0.5``...). Score modifiers, applied to the scaled scores before the normalizer: softcap c
    (s = c tanh(s / c)), bias (float, broadcastable to [B, H, Lq, Lk], added), alibi_slopes [H] (adds
    -slopes[h] |i - j|, see ``alibi_bias``), sinks [H] (an always-visible extra key with that logit and value 0).
    selection: bool [B|1, 1|Hkv|H, Lq|1, Lk] (True = selected; ``masks.selected_keys`` builds it from a sparse
    indexer's indices): each query attends to exactly the keys the mask keeps and the selection selects.
    Returns (out [B, H, Lq, Dv], weights [B, H, Lq, Lk] if need_weights else None).
    """
    settings = implementation if isinstance(implementation, AttnormSettings) else resolve_settings(
        implementation, options)
    if isinstance(implementation, AttnormSettings) and options:
        settings = settings.replace(**options)
    all_heads = constant_heads(settings, q.shape[1], q.device, q.shape[-1], k.shape[1], v.shape[-1])
    all_heads.update(heads or {})
    call = make_call(q, k, v, settings, all_heads, attention_mask, causal, scaling, dropout, need_weights,
                     module_info, bias=bias, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes,
                     selection=selection)
    out, w, _ = attend(call, path)
    return out, w


