"""O(n) path of the ``linear`` normalizer (chunked running sums; see normalizers/linear.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..normalizers.base import masked_fill_zero, safe_divide
from ..normalizers.linear import linear_attention
from . import PathDeclined
from .base import AttnCall, compute_dtype, score_mod_reason


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


def linear_chunked_attention(call: AttnCall) -> tuple[torch.Tensor, None]:
    """out [B, H, Lq, Dv]; raises PathDeclined (with the reason) for calls this path cannot run."""
    if not call.normalizer.scoreless:  # e.g. forced through HF_ATTNORM_PATH onto another normalizer
        raise PathDeclined(f"normalizer {call.settings.normalizer!r} has no linear (scoreless) form")
    if score_mod_reason(call) is not None:
        raise PathDeclined(f"{score_mod_reason(call)} (linear attention forms no scores)")
    if call.dropout > 0:
        raise PathDeclined("dropout > 0 acts on the weights, which this path never forms")
    parts = decompose_mask(call)
    if parts is None:
        raise PathDeclined("the mask is not key padding x causal with a constant offset (no O(n) form)")
    causal, offset, key_valid, query_valid = parts
    fq, fk, v = call.features(compute_dtype(call.q.dtype))
    if causal and offset == 0 and fq.shape[2] == fk.shape[2]:
        out = causal_linear_attention_batched(fq, fk, v, key_valid=key_valid, query_valid=query_valid)
    else:
        out = linear_attention(fq, fk, v, causal=causal, offset=offset, key_valid=key_valid,
                               query_valid=query_valid)
    return out.to(call.q.dtype), None


#: chunk length of the batched causal form (intra-chunk work is O(n * CHUNK * d), the states O(n / CHUNK * d^2))
CHUNK = 64


def causal_linear_attention_batched(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, *,
                                    key_valid: torch.Tensor | None = None,
                                    query_valid: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """Causal linear attention (query i sees keys j <= i, Lq == Lk) with every chunk processed at once.

    fq, fk: [B, H, L, D] feature-mapped (positive); v: [B, H, L, Dv]; key_valid: bool [B, L]; query_valid: bool
    [B, L]. The sequence is cut into C chunks of ``chunk``: inside a chunk the (masked) c x c products, across
    chunks the exclusive prefix sums of sum_j phi(k_j) v_j^T and sum_j phi(k_j), all as batched tensor ops (no
    Python loop over chunks, which dominated the time of the per-chunk loop at n = 8192). Returns [B, H, L, Dv].
    """
    c = chunk or CHUNK
    B, H, L, D = fq.shape
    Dv = v.shape[-1]
    if key_valid is not None:
        kv = key_valid[:, None, :, None].to(fk.dtype)
        fk, v = fk * kv, v * kv
    pad = (-L) % c
    if pad:  # zero keys add nothing; padded query rows are dropped
        fq = F.pad(fq, (0, 0, 0, pad))
        fk = F.pad(fk, (0, 0, 0, pad))
        v = F.pad(v, (0, 0, 0, pad))
    C = (L + pad) // c
    q5, k5, v5 = fq.view(B, H, C, c, D), fk.view(B, H, C, c, D), v.view(B, H, C, c, Dv)
    s = (q5 @ k5.transpose(-1, -2)).tril()  # [B, H, C, c, c], key j <= query i inside the chunk
    num = s @ v5
    den = s.sum(-1)
    kv_chunk = k5.transpose(-1, -2) @ v5  # [B, H, C, D, Dv]
    state = kv_chunk.cumsum(2) - kv_chunk  # exclusive prefix: chunks strictly before
    z_chunk = k5.sum(3)  # [B, H, C, D]
    z = z_chunk.cumsum(2) - z_chunk
    num = num + q5 @ state
    den = den + (q5 @ z.unsqueeze(-1)).squeeze(-1)
    out = safe_divide(num, den.unsqueeze(-1)).reshape(B, H, C * c, Dv)[:, :, :L]
    if query_valid is not None:
        out = masked_fill_zero(out, query_valid[:, None, :, None])
    return out


from . import register_path  # noqa: E402  (registration at import, like normalizers)

register_path("linear_chunked", linear_chunked_attention, ["linear"])
