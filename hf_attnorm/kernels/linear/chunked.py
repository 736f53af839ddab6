"""O(n) path of the ``linear`` normalizer (chunked running sums; see normalizers/linear.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...normalizers.base import Normalizer, masked_fill_zero, safe_divide
from ...normalizers.linear import linear_attention
from ..base import AttnCall, compute_dtype, repeat_kv


def takes(norm: Normalizer) -> str | None:
    if norm.kernel_family != "linear":
        return f"normalizer {norm.name!r} has no linear (scoreless) form (kernel_family {norm.kernel_family!r})"
    return None


def accepts(call: AttnCall) -> str | None:
    """No dropout; the visibility must be key padding x causal with a constant offset (``MaskInfo.padding``)."""
    if call.mask.padding() is None:
        return ("the mask is not key padding x causal with a constant offset (no O(n) form), or it cannot be "
                "analysed while tracing (torch.compile with a 4-D mask and several queries)")
    return None


def linear_chunked_attention(call: AttnCall) -> tuple[torch.Tensor, None]:
    """out [B, H, Lq, Dv] for calls ``accepts`` takes."""
    key_valid, query_valid, causal, offset = call.mask.padding()
    fq, fk, v = _features(call, compute_dtype(call.q.dtype))
    if fq.shape[2] == 1:
        return _one_query(fq, fk, v, key_valid).to(call.q.dtype), None
    fk, v = repeat_kv(fk, call.groups), repeat_kv(v, call.groups)
    if causal and offset == 0 and fq.shape[2] == fk.shape[2]:
        out = causal_linear_attention_batched(fq, fk, v, key_valid=key_valid, query_valid=query_valid)
    else:
        out = linear_attention(fq, fk, v, causal=causal, offset=offset, key_valid=key_valid,
                               query_valid=query_valid)
    return out.to(call.q.dtype), None


def _features(call: AttnCall, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(phi(q) [B, H, Lq, F], phi(k) [B, Hkv, Lk, F], v [B, Hkv, Lk, Dv]): like ``AttnCall.features`` but with k and v
    NOT repeated for GQA, so the key feature map runs once per kv head (linear's is the same for every head;
    hedgehog's key maps are per kv head). Feature dim F (D for linear, 2 D for hedgehog)."""
    norm, ctx = call.normalizer, call.ctx()
    q, k = norm.transform_qk(call.q.to(dtype), call.k.to(dtype), ctx)
    fq, fk = norm.feature_map(q * call.q_factor(dtype), k, ctx)
    return fq, fk, call.v.to(dtype)


def _one_query(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None) -> torch.Tensor:
    """A decode step, O(Lk d): fq [B, H, 1, D] sees every (valid) key of fk [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv]:
    out = sum_j (fq . fk_j) v_j / sum_j fq . fk_j, the G = H / Hkv query heads of a kv head as one matrix (no copy
    of k or v per query head). Returns [B, H, 1, Dv]."""
    B, H, _, D = fq.shape
    Hkv = fk.shape[1]
    w = fq.reshape(B, Hkv, H // Hkv, D) @ fk.transpose(-1, -2)  # [B, Hkv, G, Lk], > 0
    if key_valid is not None:
        w = masked_fill_zero(w, key_valid[:, None, None, :])
    out = safe_divide(w @ v, w.sum(-1, keepdim=True))  # [B, Hkv, G, Dv]
    return out.reshape(B, H, 1, v.shape[-1])


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


from ..dispatch import register_path  # noqa: E402  (registration at import, like normalizers)

# (a mask tensor over several queries is analysed per mask: MaskInfo.padding reads its values)
register_path("linear_chunked", linear_chunked_attention, takes=takes, accepts=accepts, priority=50,
              plan_stable=lambda call: call.mask.keep is None or call.q.shape[2] == 1)
