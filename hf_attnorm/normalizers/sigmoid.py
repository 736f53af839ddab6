"""sigmoid: sigmoid(s_i + b), not normalised (Ramapuram et al. 2024, "Theory, analysis and best practices for
sigmoid self-attention"). Default b = -ln n (n = keys the query sees); a constant b and a learned per-head offset
are options."""

from __future__ import annotations

import torch

from ..registry import register_normalizer
from ..settings import AttnormSettings, declare_option
from .base import Ctx, Normalizer, ParamSpec, RowForm, masked_fill_zero

SIGMOID_BIAS = declare_option(
    "sigmoid_bias", float, None,
    "sigmoid: constant bias b; null (default) means b = -ln n per query", optional=True,
)
SIGMOID_BIAS_LEARNABLE = declare_option(
    "sigmoid_bias_learnable", bool, False,
    "sigmoid: learn a per-head offset added to b (initialised at sigmoid_bias, or 0 with -ln n)",
)
# the learned/constant per-head offset is initialised from this derived option (0 when sigmoid_bias is null)


@register_normalizer
class Sigmoid(Normalizer):
    name = "sigmoid"
    paper = ("Ramapuram et al. 2024, Theory, Analysis, and Best Practices for Sigmoid Self-Att"
             "ention, https://arxiv.org/abs/2409.04431")
    description = "sigmoid(s_i + b), b = -ln n by default (not normalised)"
    row_sum = "free"
    options = (SIGMOID_BIAS, SIGMOID_BIAS_LEARNABLE)
    kernel_family = "fused"
    fused_map = "sigmoid"
    params = (ParamSpec("sigmoid_bias", SIGMOID_BIAS, SIGMOID_BIAS_LEARNABLE, "per-head bias offset"),)
    def row_form(self, settings: AttnormSettings) -> RowForm:
        """r = the bias b [1 or B, H, 1 or Lq]: the per-head value, minus ln n when derived (sigmoid_bias null)."""
        return RowForm(head="sigmoid_bias", n_term="minus_log_n" if settings.sigmoid_bias is None else "none")

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        bias = self.row_value(ctx, scores.dtype).unsqueeze(-1)
        return masked_fill_zero(torch.sigmoid(scores + bias), keep)
