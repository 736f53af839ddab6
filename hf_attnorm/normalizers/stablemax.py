"""stablemax: g(s_i) / sum_j g(s_j), g(x) = x + 1 for x >= 0 and 1/(1 - x) for x < 0 (Prieto et al. 2025,
"Grokking at the edge of numerical stability"). No exponentials, so no overflow."""

from __future__ import annotations

import torch

from ..registry import register_normalizer
from .base import Ctx, Normalizer, masked_fill_zero, safe_divide


def stablemax_g(x: torch.Tensor) -> torch.Tensor:
    # the negative branch sees min(x, 0) = x - relu(x), so it never produces inf (no NaN gradients); no clamp on the
    # selected branch: clamp's gradient at its bound is a torch convention that changed in torch 2.14 (g'(0) = 1)
    return torch.where(x >= 0, x + 1, 1 / (1 - (x - torch.relu(x))))


@register_normalizer
class Stablemax(Normalizer):
    name = "stablemax"
    paper = "Prieto et al. 2025, Grokking at the Edge of Numerical Stability, https://arxiv.org/abs/2501.04697"
    kernel_family = "fused"
    fused_map = "stablemax"
    description = "g(s_i)/sum g(s_j), g(x) = x+1 (x>=0), 1/(1-x) (x<0)"
    row_sum = "one"

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        g = masked_fill_zero(stablemax_g(scores), keep)
        return safe_divide(g, g.sum(dim=-1, keepdim=True))
