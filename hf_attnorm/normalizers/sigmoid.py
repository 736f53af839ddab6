"""sigmoid: sigmoid(s_i + b), not normalised (Ramapuram et al. 2024, "Theory, analysis and best practices for
sigmoid self-attention"). Default b = -ln n (n = keys the query sees); a constant b and a learned per-head offset
are options."""

from __future__ import annotations

import torch

from ..registry import register_normalizer
from ..settings import AttnormSettings, declare_option
from .base import Calibration, Ctx, Normalizer, ParamSpec, TeacherStats, masked_fill_zero

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
    #: one offset per head needs the learnable (per-head) value
    calibration_options = {"sigmoid_bias_learnable": True}
    #: no measured rate: stage 1 alone ended nearer the teacher at 1e-2 than at the default 2e-2 on SmolLM2, but whole
    #: conversions at 1e-2 ended worse in 3 of 4 final perplexities (docs/convert.md, "Stage-1 learning rates")

    def calibrate(self, stats: TeacherStats, settings: AttnormSettings) -> Calibration:
        """sigmoid(z_i + b) is near the softmax weight e^(z_i - LSE) when b = -LSE and the weights are small; exact
        row mass 1 needs b = c_i >= -LSE_i (sum_j sigmoid(z_ij + c_i) = 1, larger on peaked rows, where sigmoid
        saturates). One b per head: with b = -ln n + b_h (the default, derived -ln n), b_h = mean_i (c_i + ln n_i);
        with a constant sigmoid_bias, b_h = mean_i c_i. Ramapuram et al.'s b = -ln n is about a flat row's c_i (all n
        scores 0: c_i = -ln(n - 1)); b_h = -mean(LSE - ln n) is the small-weight limit (c_i -> -LSE_i)."""
        if settings.sigmoid_bias is None:
            return Calibration({"sigmoid_bias": stats.unit_sigmoid_bias_plus_log_n.float()},
                               "b = -ln n + b_h, b_h = mean over the teacher's rows of (c_i + ln n_i), c_i the bias "
                               "that gives row i unit mass: rows whose c_i + ln n_i is off the mean keep mass off 1 "
                               "(the spread of LSE - ln n, lse_minus_log_n_std, predicts it), and within a row "
                               "sigmoid's saturation reshapes the weights of peaked rows")
        return Calibration({"sigmoid_bias": stats.unit_sigmoid_bias.float()},
                           "b_h = mean of c_i (constant-bias form): rows of other lengths keep mass off 1 (-ln n per "
                           "row, the default form, is closer)")

    def row_value(self, ctx: Ctx, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The bias b [1 or B, H, 1 or Lq]: the per-head value, minus ln n when derived (sigmoid_bias null)."""
        bias = ctx.heads["sigmoid_bias"].to(device=ctx.n.device, dtype=dtype).view(1, -1, 1)
        if ctx.settings.sigmoid_bias is None:
            bias = bias - torch.log(ctx.n.to(dtype))
        return bias

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        bias = self.row_value(ctx, scores.dtype).unsqueeze(-1)
        return masked_fill_zero(torch.sigmoid(scores + bias), keep)
