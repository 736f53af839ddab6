"""softplus: softplus(s_i) / sum_j softplus(s_j), softplus(x) = ln(1 + e^x); with a length scale it is LSSA.

Gao, Spratling (and Gionfrida), "Softplus Attention with Re-weighting Boosts Length Extrapolation in Large Language
Models", arXiv 2501.13428: softmax read as "a positive map, then l1-normalisation", with the exponential replaced
by softplus (no overflow: it grows linearly) and the scores multiplied by a length-dependent factor from entropy
invariance, LSSA (Length Scaled Softplus Attention): w_i = softplus(alpha(n) s_i) / sum_j softplus(alpha(n) s_j).

The preset ``lssa`` is this normalizer with the scale ``log_train_n``: alpha(n) = ln n / ln L_train (L_train: option
``train_length``, default the model's max_position_embeddings), multiplied into the scores with the model's own
1/sqrt(d). Constants: the paper's body (its exact alpha) was not readable from this environment (only its
abstract: "a dynamic scale factor based on invariance entropy"), so alpha(n) = log_{L_train} n is our documented
choice: the entropy-invariant scale of Su (2021, kexue.fm/archives/8823), equal to 1 at the training length, as
SSMax's s ln n with s = 1 / ln L_train. The paper's second stage, the re-weighting (LSSAR: sharpening the
normalised weights with a power function), is not implemented here; ``power`` is the related map on raw scores.

Kernels: the fused map ``softplus`` (C++ and Triton); the length scale reaches every path through the per-query
multiplier. Weights are computed in units of e^c, c = min(0, row max), so rows of very negative scores (where
softplus underflows) still get their (then softmax-like) weights.
"""

from __future__ import annotations

import torch

from ..registry import register_normalizer
from .base import Ctx, Normalizer, masked_fill_zero, masked_max, safe_divide


@register_normalizer
class Softplus(Normalizer):
    name = "softplus"
    paper = "Gao et al. 2025, LSSA, https://arxiv.org/abs/2501.13428"
    description = "softplus(s_i)/sum softplus(s_j); preset lssa adds the length scale log_{L_train} n (2501.13428)"
    row_sum = "one"
    kernel_family = "fused"
    fused_map = "softplus"
    presets = {"lssa": ("LSSA (arXiv 2501.13428): softplus(a(n) s_i)/sum softplus(a(n) s_j), a(n) = log_{L_train} n",
                        {"scale": "log_train_n"})}

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        """scores: [B, H, Lq, Lk] -> weights [B, H, Lq, Lk].

        Computed as softplus(s) e^-c with c = min(0, row max) (detached; cancels in the ratio): where every visible
        score is very negative, softplus(s) = ln(1 + e^s) underflows while the weights (then ~ softmax(s)) do not.
        """
        c = masked_max(scores, keep).clamp(max=0.0)
        # Written with torch.where, never clamp/abs/max on the gradient path: at their kinks the subgradient is a
        # torch convention (torch 2.14 passes 0 through clamp(x, max=0) at x = 0, 2.13 passed 1), and the kinks
        # here sit on reachable points (s = 0; s - c = 0 at the max of a row of negative scores).
        pos = scores > 0
        t = torch.where(pos, -scores, scores)  # -|s|
        u = torch.exp(t)  # e^-|s| in (0, 1]
        # log1p(u) / u; its series below 1e-5 (error < u^3 / 4), where the quotient's gradient would be inf - inf
        big = u > 1e-5
        ratio = torch.where(big, torch.log1p(u) / torch.where(big, u, torch.ones_like(u)), 1.0 - u / 2 + u * u / 3)
        # e^-c softplus(s): for s > 0 (then c = 0) s + log1p(e^-s) (exact: F.softplus is linear above its
        # threshold); for s <= 0, e^(s - c) log1p(u) / u, u = e^s (-> e^(s - c) where u underflows). s - c <= 0 at
        # every visible key; the where only keeps masked keys above the row max from overflowing.
        d = t - c
        neg = torch.exp(torch.where(d > 0, torch.zeros_like(d), d)) * ratio
        a = masked_fill_zero(torch.where(pos, scores + u * ratio, neg), keep)
        return safe_divide(a, a.sum(dim=-1, keepdim=True))
