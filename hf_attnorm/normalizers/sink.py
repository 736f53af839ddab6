"""sink: exp(s_i) / (exp(sigma_h) + sum_j exp(s_j)) with a per-head sink logit sigma_h (as in gpt-oss).

sigma_h is an ``nn.Parameter`` named ``attnorm.sink_logit`` on every attention module (learnable by default).
"""

from __future__ import annotations

import torch

from ..registry import register_normalizer
from ..settings import declare_option
from .base import Ctx, Normalizer, ParamSpec, masked_max, safe_divide
from .softmax import masked_exp

SINK_INIT = declare_option("sink_init", float, 0.0, "sink: initial sink logit sigma_h of every head")
SINK_LEARNABLE = declare_option("sink_learnable", bool, True, "sink: learn sigma_h per head (else a constant)")


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
    def sink_logit(self, ctx: Ctx, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        return ctx.heads["sink_logit"].to(device=ctx.n.device, dtype=dtype)

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        sigma = ctx.head("sink_logit").to(scores.dtype)  # [1, H, 1, 1]
        shift = masked_max(scores, keep, floor=sigma)
        e = masked_exp(scores, keep, shift)
        den = e.sum(dim=-1, keepdim=True) + torch.exp(sigma - shift)
        return safe_divide(e, den)
