"""relu_len ("ReLU/L"): relu(s_i) / n with n the number of visible keys (Wortsman et al. 2023, "Replacing softmax
with ReLU in vision transformers"). Not normalised."""

from __future__ import annotations

import torch

from ..registry import register_normalizer
from ..settings import AttnormSettings
from .base import Ctx, Normalizer, RowForm, masked_fill_zero


@register_normalizer
class ReluLen(Normalizer):
    name = "relu_len"
    paper = "Wortsman et al. 2023, Replacing softmax with ReLU in Vision Transformers, https://arxiv.org/abs/2309.08586"
    description = "relu(s_i)/n, n = visible keys (not normalised)"
    row_sum = "free"
    kernel_family = "fused"
    fused_map = "relu_len"

    def row_form(self, settings: AttnormSettings) -> RowForm:
        """r = 1 / n [B or 1, 1 or H, Lq], the factor on relu(s)."""
        return RowForm(n_term="inverse_n")

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        return masked_fill_zero(torch.relu(scores) / ctx.n.to(scores.dtype).unsqueeze(-1), keep)
