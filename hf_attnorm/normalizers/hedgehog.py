"""hedgehog: linear attention with a learned feature map that mimics softmax (Zhang et al. 2024, "The Hedgehog &
the Porcupine: Expressive Linear Attentions with Softmax Mimicry", arXiv 2402.04347; the feature map of LoLCATs,
arXiv 2410.10254):

    phi(x) = [softmax(x W), softmax(-x W)]   (each softmax over the feature dim; 2 D features),
    w_ij = phi(q_i) . phi(k_j) / sum_l phi(q_i) . phi(k_l)

with a learned W_h [D, D] per head, started at the identity (LoLCATs' start) and trained so that the weights
match softmax's (the papers' attention distillation). The queries have their own map per query
head (``hedgehog_q`` [H, D, D]); the keys one per key/value head (``hedgehog_k`` [Hkv, D, D]), so that the O(n)
paths and the recurrent decode state compute the key features once per key/value head of a GQA model, as for
``linear``. As in ``linear``, no 1/sqrt(d) (the paper's map reads the raw q and k) and the length-aware scale
multiplies q before the map.

Everything else is ``linear``'s: the chunked O(n) path, the recurrent decode state (``query_features`` and
``key_features``: the softmax over features already bounds every feature by 1, and the query side's denominator is
a per-query constant that cancels in the weights), the materialised reference (phi(q) . phi(k) over the visible
keys, divided by its sum).
"""

from __future__ import annotations

import torch

from ..registry import register_normalizer
from ..settings import declare_option
from .base import Ctx, ParamSpec
from .linear import Linear

HEDGEHOG_INIT = declare_option("hedgehog_init", float, 1.0,
                               "hedgehog: the feature maps' W_h start as this times the identity [head_dim, head_dim]")
HEDGEHOG_LEARNABLE = declare_option("hedgehog_learnable", bool, True,
                                    "hedgehog: learn the feature maps' W_h per head (else the constant start)")


def hedgehog_features(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """phi(x) = [softmax(x W), softmax(-x W)] over the last dim: x [B, H, L, D], w [H, D, F] -> [B, H, L, 2F] in
    x's dtype (an fp32 compute dtype on the paths; w is fp32 and cast to it)."""
    y = torch.matmul(x, w.to(device=x.device, dtype=x.dtype).unsqueeze(0))
    return torch.cat((torch.softmax(y, dim=-1), torch.softmax(-y, dim=-1)), dim=-1)


def _per_head(w: torch.Tensor, heads: int, side: str) -> torch.Tensor:
    """w [Hw, D, F] for ``heads`` heads: as it is, or each of its heads repeated for the heads of its group (keys
    repeated to the query heads of a GQA model by a path that materialises them)."""
    if w.shape[0] == heads:
        return w
    if heads % w.shape[0]:
        raise ValueError(f"hedgehog: the {side} feature maps are for {w.shape[0]} heads, which do not divide the "
                         f"call's {heads} {side} heads")
    return w.repeat_interleave(heads // w.shape[0], dim=0)


@register_normalizer
class Hedgehog(Linear):
    name = "hedgehog"
    paper = ("Zhang et al. 2024, The Hedgehog & the Porcupine: Expressive Linear Attentions with Softmax Mimicry, "
             "https://arxiv.org/abs/2402.04347")
    description = ("linear attention with a learned feature map [softmax(xW), softmax(-xW)] per head (trained to "
                   "mimic softmax), O(n) and O(1)-per-token decoding as linear")
    options = (HEDGEHOG_INIT, HEDGEHOG_LEARNABLE)
    params = (
        ParamSpec("hedgehog_q", HEDGEHOG_INIT, HEDGEHOG_LEARNABLE,
                  "per-head feature map W_h [head_dim, head_dim] of the queries", shape=("head_dim", "head_dim"),
                  init="eye"),
        ParamSpec("hedgehog_k", HEDGEHOG_INIT, HEDGEHOG_LEARNABLE,
                  "feature map W_h [head_dim, head_dim] of the keys, per key/value head",
                  shape=("head_dim", "head_dim"), init="eye", heads="kv"),
    )

    def feature_map(self, q: torch.Tensor, k: torch.Tensor, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, H, Lq, D], k [B, H or Hkv, Lk, D] -> phi(q) [B, H, Lq, 2D], phi(k) [B, H or Hkv, Lk, 2D]."""
        return self.query_features(q, ctx), self.key_features(k, ctx)

    def query_features(self, q: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        return hedgehog_features(q, _per_head(ctx.heads["hedgehog_q"], q.shape[1], "query"))

    def key_features(self, k: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        return hedgehog_features(k, _per_head(ctx.heads["hedgehog_k"], k.shape[1], "key"))
