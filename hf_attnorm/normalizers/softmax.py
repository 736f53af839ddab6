"""softmax: exp(s_i) / sum_j exp(s_j) — the reference every other normalizer is compared with."""

from __future__ import annotations

import torch

from ..registry import register_normalizer
from .base import Ctx, Normalizer, masked_max, safe_divide


def masked_exp(scores: torch.Tensor, keep: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """exp(s - shift) on visible keys, exactly 0 elsewhere. Masked scores become -inf BEFORE exp, so no inf*0
    reaches the gradient."""
    z = torch.where(keep, scores - shift, torch.full((), float("-inf"), dtype=scores.dtype, device=scores.device))
    return torch.exp(z)


@register_normalizer
class Softmax(Normalizer):
    name = "softmax"
    paper = "Vaswani et al. 2017, Attention Is All You Need, https://arxiv.org/abs/1706.03762"
    description = "softmax exp(s_i)/sum exp(s_j) (the reference)"
    row_sum = "one"
    kernel_family = "softmax"

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        e = masked_exp(scores, keep, masked_max(scores, keep))
        return safe_divide(e, e.sum(dim=-1, keepdim=True))
