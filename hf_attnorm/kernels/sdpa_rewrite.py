"""Exact rewrites of the softmax family onto ``scaled_dot_product_attention`` (SDPA).

* every per-query scale (log n, SSMax, alpha*(n), ...): q rows are multiplied by base x multiplier (autograd
  carries the gradient to learnable factors such as ``ssmax_s``), SDPA runs with ``scale=1``;
* ``cosine``: q and k are l2-normalised first (the normalizer's own ``transform_qk``), then as above;
* ``softmax_n`` / ``sink``: an always-visible extra logit lambda (ln n_extra, or sigma_h per head) with value 0.
  Path ``sdpa`` (CPU) uses SDPA's CPU flash kernel, which returns the row log-sum-exp L:
  out' = out * exp(L - L') with L' = logaddexp(L, lambda), and the flash backward fed with (out', L') is exactly
  the backward of softmax over the keys plus the sink; d lambda = -sum_i exp(lambda - L'_i) (dO_i . out'_i).
  No extra key, no extra feature, masks and causality unchanged. Path ``sdpa_sinkcol`` (any device) appends one
  feature instead: q' = [q, lambda], k' = [k, 0], plus a prepended key [0, 1] with value 0 that every query sees
  (with a causal call and no mask, a prepended zero query keeps the upper-left causal pattern aligned; its row is
  dropped). It is exact but on CPU D+1 falls off SDPA's fast kernel (several times slower), so the rule uses it
  only on other devices.

Fully masked rows give 0 with finite gradients; fp16/bf16 on CPU are computed in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..masks import causal_keep
from ..normalizers.base import Normalizer
from . import PathDeclined
from .base import AttnCall, compute_dtype

#: the normalizers these rewrites are exact for: name -> has an extra always-visible logit (a sink)
SOFTMAX_FAMILY: dict[str, bool] = {"softmax": False, "cosine": False, "softmax_n": True, "sink": True}


def sink_logit(call: AttnCall, dtype: torch.dtype) -> torch.Tensor | None:
    """lambda: 0-d (softmax_n: ln n_extra) or [H] (sink: sigma_h, autograd-connected), combined with the call's
    attention sinks (s_aux [H]) as log(e^lambda + e^s_aux); None without any sink."""
    lam = _own_sink_logit(call, dtype)
    if call.sinks is None:
        return lam
    aux = call.sinks.to(device=call.q.device, dtype=dtype)
    return aux if lam is None else torch.logaddexp(lam, aux)


def _own_sink_logit(call: AttnCall, dtype: torch.dtype) -> torch.Tensor | None:
    name = call.settings.normalizer
    if name == "softmax_n":
        n_extra = call.settings.n_extra
        if n_extra == 0:
            return None  # softmax_n with n_extra = 0 is softmax
        return torch.tensor(math.log(n_extra), dtype=dtype, device=call.q.device)
    if name == "sink":
        return call.heads["sink_logit"].to(device=call.q.device, dtype=dtype)
    return None


def _bias_cap_reason(call: AttnCall) -> str | None:
    """SDPA applies a bias (as a float mask) and sinks (the lse rewrite) exactly, but cannot soft-cap scores."""
    if call.softcap is not None:
        return "SDPA cannot soft-cap the scores (tanh) before its softmax"
    return None


def _check_family(call: AttnCall) -> None:
    name = call.settings.normalizer
    if name not in SOFTMAX_FAMILY:
        raise PathDeclined(f"normalizer {name!r} is not a softmax rewrite (these are: {', '.join(SOFTMAX_FAMILY)})")
    if type(call.normalizer).feature_map is not Normalizer.feature_map:
        raise PathDeclined(f"normalizer {name!r} has a feature map")
    if call.q.numel() == 0 or call.k.shape[2] == 0:
        raise PathDeclined("empty inputs")  # SDPA's CPU kernel crashes (SIGFPE) on zero keys
    reason = _bias_cap_reason(call)
    if reason is not None:
        raise PathDeclined(reason)
    if not call.q.dtype.is_floating_point:
        raise PathDeclined(f"dtype {call.q.dtype}")


def _prepare(call: AttnCall, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (transformed and scaled by base x multiplier), k (transformed), v, all in ``dtype``."""
    q, k, v = call.q.to(dtype), call.k.to(dtype), call.v.to(dtype)
    norm = call.normalizer
    if type(norm).transform_qk is not Normalizer.transform_qk:
        q, k = norm.transform_qk(q, k, call.ctx())  # row-wise (cosine: l2-normalise), so fine on unrepeated k
    return q * call.q_factor(dtype), k, v


def _simplify_mask(call: AttnCall) -> tuple[torch.Tensor | None, bool]:
    """(keep or None, is_causal): a mask that is all-visible or exactly the upper-left causal pattern becomes None,
    because SDPA with an explicit mask is slower and O(Lq Lk) in memory."""
    m = call.mask
    if m.keep is None:
        return None, m.causal
    keep = m.keep
    if bool(keep.all()):
        return None, False
    if m.lq > 1 and keep.shape[-2] == m.lq:
        tril = causal_keep(m.lq, m.lk, keep.device)
        if torch.equal(keep, tril.expand_as(keep)):
            return None, True
    return keep, False


def _additive(keep: torch.Tensor | None, dtype: torch.dtype, bias: torch.Tensor | None = None,
              shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The float mask SDPA adds to the scores: the bias (or 0) where visible, -inf elsewhere."""
    if bias is None:
        assert keep is not None
        return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))
    bias = bias.to(dtype)
    if keep is not None:
        bias = bias.masked_fill(~keep, float("-inf"))
    # one [B|1, H|1, Lq, Lk] mask (SDPA broadcasts the leading dims only)
    return bias.expand(*bias.shape[:2], *shape[2:]) if shape is not None else bias


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _FlashCPU(torch.autograd.Function):
    """SDPA's CPU flash kernel with an optional sink logit lambda (0-d or [H]); see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, lam, mask, causal: bool):
        out, lse = _FLASH(q, k, v, 0.0, causal, attn_mask=mask, scale=1.0)
        if lam is not None:
            lam_b = lam.view(1, -1, 1) if lam.dim() == 1 else lam
            lse_all = torch.logaddexp(lse, lam_b)
            # rows without visible keys: the kernel gives out 0 and lse 0; with the sink their lse is lambda
            if mask is not None:
                lse_all = torch.where(torch.isinf(mask).all(-1), lam_b.expand_as(lse_all), lse_all)
            out = out * torch.exp(lse - lse_all).unsqueeze(-1)
            lse = lse_all
        ctx.save_for_backward(q, k, v, out, lse, mask, lam)
        ctx.causal = causal
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, mask, lam = ctx.saved_tensors
        dq, dk, dv = _FLASH_BWD(dout.contiguous(), q, k, v, out.contiguous(), lse, 0.0, ctx.causal,
                                attn_mask=mask, scale=1.0)
        dlam = None
        if lam is not None and ctx.needs_input_grad[3]:
            lam_b = lam.view(1, -1, 1) if lam.dim() == 1 else lam
            g = -torch.exp(lam_b - lse) * (dout * out).sum(-1)  # [B, H, Lq]
            dlam = g.sum(dim=(0, 2)) if lam.dim() == 1 else g.sum()
        return dq, dk, dv, dlam, None, None


def _zero_dead_rows(keep: torch.Tensor | None, call: AttnCall) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """With a mask where some query sees no key: (mask with those rows opened, bool [B|1, 1|H, Lq, 1] of live rows)
    so SDPA never sees an empty row (NaN on some backends); the caller zeroes the dead rows' outputs."""
    if keep is None or bool(call.mask.has_keys.all()):
        return keep, None
    live = call.mask.has_keys.to(keep.device).unsqueeze(-1)
    return keep | ~live, live


def sdpa_attention(call: AttnCall) -> tuple[torch.Tensor, None]:
    """softmax / cosine (any device, dropout ok) and softmax_n / sink (CPU, no dropout, D == Dv)."""
    _check_family(call)
    has_sink = SOFTMAX_FAMILY[call.settings.normalizer] or call.sinks is not None
    on_cpu = call.q.device.type == "cpu"
    dt = compute_dtype(call.q.dtype) if on_cpu else call.q.dtype
    lam = sink_logit(call, dt) if has_sink else None
    same_dim = call.v.shape[-1] == call.q.shape[-1]
    keep, causal = _simplify_mask(call)
    bias = call.bias
    if bias is not None and causal:  # a bias goes in SDPA's float mask, which excludes is_causal
        keep, causal = call.mask.dense(call.q.device), False
    # the flash kernel's backward gives no gradient to its mask: a learned bias (T5) takes SDPA's own autograd
    bias_grad = bias is not None and bias.requires_grad and torch.is_grad_enabled()
    shape = (call.q.shape[0], call.q.shape[1], call.q.shape[2], call.k.shape[2])
    if on_cpu and call.dropout == 0 and same_dim and dt in (torch.float32, torch.float64) and not bias_grad:
        q, k, v = _prepare(call, dt)
        mask = None if keep is None and bias is None else _additive(keep, dt, bias, shape)
        out = _FlashCPU.apply(q, k, v, lam, mask, causal)
        return out.to(call.q.dtype), None
    if lam is not None:
        why = ("dropout > 0" if call.dropout > 0 else "head dims of v and q differ" if not same_dim else
               "a score bias that needs a gradient" if bias_grad else
               f"device {call.q.device}" if not on_cpu else f"dtype {dt}")
        raise PathDeclined(f"the lse rewrite of the sink needs SDPA's CPU flash kernel ({why}); see sdpa_sinkcol")
    q, k, v = _prepare(call, dt)
    keep, live = _zero_dead_rows(keep, call)
    if bias is not None:
        keep = _additive(keep, dt, bias, shape)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=call.dropout, is_causal=causal,
                                         scale=1.0, enable_gqa=q.shape[1] != k.shape[1])
    if live is not None:
        out = torch.where(live, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out.to(call.q.dtype), None


def sdpa_sinkcol_attention(call: AttnCall) -> tuple[torch.Tensor, None]:
    """softmax_n / sink through plain SDPA with one extra feature and a prepended sink key (any device)."""
    _check_family(call)
    if not SOFTMAX_FAMILY[call.settings.normalizer]:
        raise PathDeclined("sdpa_sinkcol is for the normalizers with a sink (softmax_n, sink)")
    if call.bias is not None:
        raise PathDeclined("sdpa_sinkcol does not apply a score bias")
    dt = compute_dtype(call.q.dtype) if call.q.device.type == "cpu" else call.q.dtype
    lam = sink_logit(call, dt)
    q, k, v = _prepare(call, dt)
    if lam is None:  # softmax_n with n_extra = 0: plain softmax
        keep, causal = _simplify_mask(call)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=call.dropout, is_causal=causal,
                                             scale=1.0, enable_gqa=q.shape[1] != k.shape[1])
        return out.to(call.q.dtype), None
    B, H, Lq, _ = q.shape
    Hkv = k.shape[1]
    lam_col = (lam.view(1, H, 1, 1) if lam.dim() == 1 else lam.view(1, 1, 1, 1)).expand(B, H, Lq, 1)
    q = torch.cat([q, lam_col.to(q.dtype)], dim=-1)
    k = torch.cat([k, k.new_zeros(B, Hkv, k.shape[2], 1)], dim=-1)
    sink_key = torch.zeros(B, Hkv, 1, k.shape[-1], dtype=k.dtype, device=k.device)
    sink_key[..., -1] = 1
    k = torch.cat([sink_key, k], dim=2)
    v = torch.cat([v.new_zeros(B, Hkv, 1, v.shape[-1]), v], dim=2)
    keep, causal = _simplify_mask(call)
    dummy = False
    if keep is not None:
        # the sink key (index 0) is visible to every query, so no row is ever empty
        keep = torch.cat([keep.new_ones(*keep.shape[:-1], 1), keep], dim=-1)
    elif causal:
        q = torch.cat([q.new_zeros(B, H, 1, q.shape[-1]), q], dim=2)  # query i+1 sees the sink and keys <= i
        dummy = True
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=call.dropout, is_causal=causal,
                                         scale=1.0, enable_gqa=H != Hkv)
    if dummy:
        out = out[:, :, 1:]
    return out.to(call.q.dtype), None


from . import register_path  # noqa: E402  (registration at import, like the normalizers)

register_path("sdpa", sdpa_attention, list(SOFTMAX_FAMILY))
register_path("sdpa_sinkcol", sdpa_sinkcol_attention, [n for n, sink in SOFTMAX_FAMILY.items() if sink],
              exclude_devices=("cpu",))
