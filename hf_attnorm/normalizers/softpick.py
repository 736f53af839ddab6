"""softpick: relu(e^{s_i} - 1) / sum_j |e^{s_j} - 1| over visible keys (Zuhri et al. 2025, "Softpick").

Computed as relu(e^{s-M} - e^{-M}) / sum |e^{s-M} - e^{-M}| with M = max(0, row max), which is the same ratio
without overflow. A row whose visible scores are all 0 gives 0.
"""

from __future__ import annotations

import torch

from ..registry import register_normalizer
from .base import Ctx, Normalizer, masked_fill_zero, masked_max, safe_divide
from .softmax import masked_exp


@register_normalizer
class Softpick(Normalizer):
    name = "softpick"
    paper = "Zuhri et al. 2025, Softpick, https://arxiv.org/abs/2504.20966"
    kernel_family = "fused"
    fused_map = "softpick"
    description = "relu(e^s_i - 1)/sum |e^s_j - 1| (rectified, can put weight nowhere)"
    row_sum = "at_most_one"

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        shift = masked_max(scores, keep, floor=0.0)
        a = masked_fill_zero(masked_exp(scores, keep, shift) - torch.exp(-shift), keep)
        return safe_divide(torch.relu(a), a.abs().sum(dim=-1, keepdim=True))
