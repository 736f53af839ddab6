"""squared: s_i^2 / sum_j s_j^2. A row whose visible scores are all 0 (0/0) gives weights 0 by convention.

The same function as ``power`` with a constant p = 2 (tests/test_power_softplus.py checks values and gradients);
kept as its own normalizer: its fused map needs no log/exp, and its saved configs and checkpoints (no per-head p)
load unchanged."""

from __future__ import annotations

import torch

from ..registry import register_normalizer
from .base import Ctx, Normalizer, masked_fill_zero, safe_divide


@register_normalizer
class Squared(Normalizer):
    name = "squared"
    paper = "no paper: the p = 2 case of power (PolySketchFormer, https://arxiv.org/abs/2310.01655)"
    kernel_family = "fused"
    fused_map = "squared"
    description = "s_i^2/sum s_j^2 (rows of zeros give 0)"
    row_sum = "at_most_one"  # 1 except on all-zero rows, where it is 0 by convention

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        a = masked_fill_zero(scores * scores, keep)
        return safe_divide(a, a.sum(dim=-1, keepdim=True))
