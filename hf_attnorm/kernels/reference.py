"""The naive reference path: materialise scores [B, H, Lq, Lk], apply the normalizer's reference, multiply by v.

Quadratic in memory; always correct; the only path that can return the weights (``output_attentions``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttnCall, compute_dtype, modify_scores, normalize, repeat_kv


def reference_scores(call: AttnCall) -> torch.Tensor:
    """Scaled scores [B, H, Lq, Lk] in the compute dtype, soft-capped and biased when the call says so."""
    q, k, _ = call.features(compute_dtype(call.q.dtype))
    return modify_scores(q @ k.transpose(-1, -2), call.softcap, call.score_bias())


def reference_weights(call: AttnCall) -> torch.Tensor:
    """Attention weights [B, H, Lq, Lk] (compute dtype), before dropout."""
    scores = reference_scores(call)
    keep = call.mask.dense(scores.device)
    return normalize(call.normalizer, scores, keep, call.ctx(), call.sinks)


def reference_attention(call: AttnCall) -> tuple[torch.Tensor, torch.Tensor | None]:
    """out [B, H, Lq, Dv] (input dtype), weights [B, H, Lq, Lk] or None."""
    w = reference_weights(call)
    if call.dropout > 0:
        w = F.dropout(w, p=call.dropout, training=True)
    out = w @ repeat_kv(call.v, call.groups).to(w.dtype)
    return out.to(call.q.dtype), (w.to(call.q.dtype) if call.need_weights else None)
