"""One-query calls (a cached decode step) for the normalizers without a kernel of their own, on CPU.

With Lq = 1 the scores of a call are one row per head, [B, H, 1, Lk]: O(Lk) memory, like the fused kernels, so
they are simply formed, with the query heads of a kv head as one matrix (no GQA copy of k or v), and passed through
the normalizer's own ``reference``. The fused maps decode on their fused kernel instead (``fused_cpu``, whose
blocked kernel groups a kv head's query heads into one block of rows for such calls): one op where this path runs
the scores, the map, the sum and the weighted values as separate PyTorch ops.

Query-coupled normalizers (selective attention) run here too: a one-query call has no other query in it, and what
the earlier queries of a cache accumulated arrives as ``AttnCall.selective_carry``, which ``call.ctx()`` hands to the
normalizer's reference (F = carry for the one query).
"""

from __future__ import annotations

import torch

from ..normalizers.base import Normalizer
from .base import AttnCall, compute_dtype, modify_scores, normalize


def takes(norm: Normalizer) -> str | None:
    if norm.kernel_family != "generic":
        # (the fused maps decode on their fused kernels, whose one-query form groups a kv head's query heads)
        return f"normalizer {norm.name!r} has a faster {norm.kernel_family} path for one query"
    if type(norm).feature_map is not Normalizer.feature_map:
        return f"normalizer {norm.name!r} has a feature map"
    return None


def accepts(call: AttnCall) -> str | None:
    if call.q.shape[2] != 1:
        return f"{call.q.shape[2]} queries (this path is for one: a decode step)"
    if call.q.numel() == 0 or call.k.shape[2] == 0:
        return "empty inputs"
    return None


def decode_attention(call: AttnCall) -> tuple[torch.Tensor, None]:
    """out [B, H, 1, Dv] (input dtype; fp16/bf16 computed in fp32); soft-cap, bias and sinks as the reference."""
    dt = compute_dtype(call.q.dtype)
    norm, ctx = call.normalizer, call.ctx()
    q, k = norm.transform_qk(call.q.to(dt), call.k.to(dt), ctx)  # row-wise, so fine on unrepeated k
    q = q * call.q_factor(dt)
    B, H, _, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    G = H // Hkv
    scores = (q.reshape(B, Hkv, G, D) @ k.transpose(-1, -2)).reshape(B, H, 1, Lk)
    # bias [B|1, H|1, 1|Lq, Lk] broadcasts onto the row
    scores = modify_scores(scores, call.softcap, call.score_bias())
    w = normalize(norm, scores, call.mask.dense(scores.device), ctx, call.sinks)
    out = w.reshape(B, Hkv, G, Lk) @ call.v.to(dt)
    return out.reshape(B, H, 1, call.v.shape[-1]).to(call.q.dtype), None


from .dispatch import register_path  # noqa: E402  (registration at import, like the normalizers)

# on GPUs the Triton kernels take decode steps too (not measured against this: no GPU while writing it)
register_path("decode", decode_attention, takes=takes, accepts=accepts, priority=25, auto_exclude=("cuda",),
              supports=("softcap", "bias", "alibi", "sinks", "forget", "selective_carry"), plan_stable=True)
