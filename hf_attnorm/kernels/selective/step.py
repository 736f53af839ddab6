"""One-query calls (a cached decode step) of selective attention (``normalizers/selective.py``) as one SDPA call.

A call with one query has no other query in it, so its penalty is the carry alone (``AttnCall.selective_carry``
[B, Lk]: what the cache's earlier queries selected, kept by hf/selective_cache.py; none: F = 0), and its weights are
softmax(s - carry) over the visible keys: SDPA with the float mask -carry (-inf where masked), the query heads of a
kv head reading their kv head in place (``enable_gqa``: no GQA copies of the cache). The generic ``decode`` path
gives the same through the normalizer's reference (about ten elementwise passes over the row of every head): this
one is its fast form (a decode step at 4096 cached keys measured 2.08x -> 1.61x sdpa's, docs/kernels.md).

Declines score modifiers and dropout (``decode`` / the reference apply them), several queries (the blocked
``selective`` path), and a carry that needs a gradient (SDPA gives none to its mask; the blocked path does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...normalizers.base import Normalizer
from ...normalizers.selective import check_carry
from ..base import AttnCall, compute_dtype
from .blocked import takes as selective_takes


def takes(norm: Normalizer) -> str | None:
    why = selective_takes(norm)
    if why is None and (type(norm).transform_qk is not Normalizer.transform_qk
                        or type(norm).feature_map is not Normalizer.feature_map):
        why = f"normalizer {norm.name!r} transforms q/k (this path forms plain scores)"
    return why


def accepts(call: AttnCall) -> str | None:
    if call.q.shape[2] != 1:
        return f"{call.q.shape[2]} queries (this path is for one: a decode step)"
    if call.q.numel() == 0 or call.k.shape[2] == 0:
        return "empty inputs"
    c = call.selective_carry
    if c is not None and c.requires_grad and torch.is_grad_enabled():
        return "the carry requires grad (SDPA gives no gradient to its mask; the selective path does)"
    return None


def step_attention(call: AttnCall) -> tuple[torch.Tensor, None]:
    """out [B, H, 1, Dv] in the input dtype (fp16/bf16 computed in fp32)."""
    dt = compute_dtype(call.q.dtype)
    q = call.q.to(dt) * call.q_factor(dt)
    k, v = call.k.to(dt), call.v.to(dt)
    B, lk = q.shape[0], k.shape[2]
    m = call.mask
    carry = call.selective_carry
    mask = None
    if carry is not None:
        mask = -check_carry(carry, B, lk).to(dt)[:, None, None, :]  # [B|1, 1, 1, Lk]
    if m.keep is not None:
        neg = torch.full((), float("-inf"), dtype=dt, device=q.device)
        mask = torch.where(m.keep, neg.new_zeros(()) if mask is None else mask, neg)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=k.shape[1] != q.shape[1])
    if m.keep is not None:  # a row with no visible key: SDPA gives NaN, the output is 0
        out = torch.where(m.has_keys[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out.to(call.q.dtype), None


from ..dispatch import register_path  # noqa: E402  (registration at import, like the normalizers)

# before ``decode`` (25), which takes the same calls through the normalizer's reference
register_path("selective_step", step_attention, takes=takes, accepts=accepts, priority=24,
              supports=("selective_carry",), plan_stable=True)
