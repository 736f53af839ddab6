"""cog: sign(s_i) e^{|s_i|} / sum_j e^{|s_j|} over visible keys (Lv et al. 2024, "More Expressive Attention with
Negative Weights", Cog attention).

Signed weights: a key whose score is negative is subtracted from the output, so one head can copy and delete at
once; the absolute weights of a row sum to 1. Computed as sign(s) e^{|s| - M} / sum e^{|s| - M} with M the row max
of |s| (the same ratio without overflow). A score of exactly 0 gets weight 0 (sign 0), as in the authors' code.
The fused kernels (C++ and Triton) keep M as a running max, rescaling what they accumulated when it rises.
"""

from __future__ import annotations

import torch

from ..registry import register_normalizer
from .base import Ctx, Normalizer, masked_max, safe_divide
from .softmax import masked_exp


@register_normalizer
class Cog(Normalizer):
    name = "cog"
    paper = "Lv et al. 2024, More Expressive Attention with Negative Weights, https://arxiv.org/abs/2411.07176"
    description = "sign(s_i) e^|s_i| / sum e^|s_j| (signed weights: a head can subtract)"
    row_sum = "signed"
    kernel_family = "fused"
    fused_map = "cog"  # (the shifted form with the running max of |s|: kernels/fused/maps.py)

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        magnitude = scores.abs()
        e = masked_exp(magnitude, keep, masked_max(magnitude, keep))
        return torch.sign(scores) * safe_divide(e, e.sum(dim=-1, keepdim=True))
