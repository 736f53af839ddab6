"""O(n) path of the ``linear`` normalizer (chunked running sums; see normalizers/linear.py)."""

from __future__ import annotations

import torch

from ..normalizers.linear import linear_attention
from .base import AttnCall, compute_dtype, repeat_kv


def decompose_mask(call: AttnCall) -> tuple[bool, int, torch.Tensor | None, torch.Tensor | None] | None:
    """Express the call's visibility as (causal, offset, key_valid [B, Lk], query_valid [B, Lq]) if it is
    "key padding x causal with a constant offset x fully masked rows"; None otherwise."""
    m = call.mask
    if m.keep is None:
        return m.causal and m.lq > 1, 0, None, None
    keep = m.keep
    if keep.shape[1] != 1:
        return None
    keep = keep[:, 0].expand(-1, m.lq, -1)  # [B, Lq, Lk]
    key_valid = keep.any(dim=1)  # [B, Lk]
    query_valid = keep.any(dim=2)  # [B, Lq]
    full = key_valid[:, None, :] & query_valid[:, :, None]
    if torch.equal(full, keep):
        return False, 0, key_valid, query_valid
    # causal with offset: the last visible key of query i is i + offset for every valid row
    last = torch.where(keep, torch.arange(m.lk, device=keep.device), -1).amax(dim=2)  # [B, Lq]
    rows = torch.arange(m.lq, device=keep.device)[None, :]
    offsets = torch.where(query_valid, last - rows, last.new_full((), -(1 << 30)))
    offset = int(offsets.max().item())
    i = torch.arange(m.lq, device=keep.device)[:, None]
    j = torch.arange(m.lk, device=keep.device)[None, :]
    cand = full & (j <= i + offset)[None]
    if torch.equal(cand, keep):
        return True, offset, key_valid, query_valid
    return None


def linear_chunked_attention(call: AttnCall) -> tuple[torch.Tensor, None] | None:
    """out [B, H, Lq, Dv] or None when the mask is not of a supported form."""
    if call.dropout > 0:
        return None  # dropout acts on the weights, which this path never forms
    parts = decompose_mask(call)
    if parts is None:
        return None
    causal, offset, key_valid, query_valid = parts
    dt = compute_dtype(call.q.dtype)
    norm, ctx = call.normalizer, call.ctx()
    q, k = call.q.to(dt), repeat_kv(call.k, call.groups).to(dt)
    q, k = norm.transform_qk(q, k, ctx)
    q = q * call.q_factor(dt)
    fq, fk = norm.feature_map(q, k, ctx)
    out = linear_attention(fq, fk, repeat_kv(call.v, call.groups).to(dt), causal=causal, offset=offset,
                           key_valid=key_valid, query_valid=query_valid)
    return out.to(call.q.dtype), None


from . import register_path  # noqa: E402  (registration at import, like normalizers)

register_path("linear_chunked", linear_chunked_attention, ["linear"])
