"""sink: exp(s_i) / (exp(sigma_h) + sum_j exp(s_j)) with a per-head sink logit sigma_h (as in gpt-oss).

sigma_h is an ``nn.Parameter`` named ``attnorm.sink_logit`` on every attention module (learnable by default).
"""

from __future__ import annotations

import math

import torch

from ..registry import register_normalizer
from ..settings import AttnormSettings, declare_option
from .base import Calibration, Continuation, Ctx, Normalizer, ParamSpec, TeacherStats, masked_max, safe_divide
from .softmax import masked_exp

SINK_INIT = declare_option("sink_init", float, 0.0, "sink: initial sink logit sigma_h of every head")
SINK_LEARNABLE = declare_option("sink_learnable", bool, True, "sink: learn sigma_h per head (else a constant)")
#: the largest share of a calibration row the calibrated sink may take: 1e-4, softmax to within 1e-4 (the bound of
#: ``conversion_start``) while the sink keeps a gradient (Adam rescales a small one)
CALIBRATION_SINK_MASS = 1e-4


@register_normalizer
class Sink(Normalizer):
    name = "sink"
    paper = ("Xiao et al. 2023, attention sinks, https://arxiv.org/abs/2309.17453; learned per"
             "-head sinks as gpt-oss (OpenAI 2025)")
    description = "exp(s_i)/(exp(sigma_h) + sum exp(s_j)), learnable sink logit per head"
    row_sum = "at_most_one"
    options = (SINK_INIT, SINK_LEARNABLE)
    kernel_family = "softmax"
    params = (ParamSpec("sink_logit", SINK_INIT, SINK_LEARNABLE, "per-head sink logit sigma_h"),)
    # a constant sink (sink_learnable false) walked from where it takes no mass (e^-30 of a row) to its value
    continuation = Continuation("sink_init", -30.0, note="a sink logit sigma -> -inf is softmax")

    def calibrate(self, stats: TeacherStats, settings: AttnormSettings) -> Calibration:
        """The sink takes sigmoid(sigma_h - LSE_i) of row i; sigma_h -> -inf is softmax. sigma_h = min_i LSE_i -
        ln((1 - eps) / eps), eps = ``CALIBRATION_SINK_MASS``: the sink takes at most eps of every calibration row."""
        eps = CALIBRATION_SINK_MASS
        sigma = stats.lse_min.float() - math.log((1 - eps) / eps)
        return Calibration({"sink_logit": sigma},
                           f"sigma_h = min LSE - ln((1-eps)/eps), eps = {eps:g}: the sink takes at most {eps:g} of a "
                           "calibration row (more only on a held-out row whose LSE is below that minimum)")

    def sink_logit(self, ctx: Ctx, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        return ctx.heads["sink_logit"].to(device=ctx.n.device, dtype=dtype)

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        sigma = ctx.head("sink_logit").to(scores.dtype)  # [1, H, 1, 1]
        shift = masked_max(scores, keep, floor=sigma)
        e = masked_exp(scores, keep, shift)
        den = e.sum(dim=-1, keepdim=True) + torch.exp(sigma - shift)
        return safe_divide(e, den)
