"""softmax_n: exp(s_i) / (n_extra + sum_j exp(s_j)); softmax1 ("attention is off by one") is n_extra = 1.

The n_extra term is an always-visible phantom key with score 0 and value 0, so a head can put weight "nowhere".
"""

from __future__ import annotations

import math

import torch

from ..registry import register_normalizer
from ..settings import declare_option, nonnegative
from .base import Ctx, Normalizer, masked_max, safe_divide
from .softmax import masked_exp

N_EXTRA = declare_option(
    "n_extra", float, 1.0, "softmax_n: the constant added to the denominator (real, >= 0; 1 = softmax1)",
    check=nonnegative,
)


@register_normalizer
class SoftmaxN(Normalizer):
    name = "softmax_n"
    paper = "Miller 2023, Attention Is Off By One, https://www.evanmiller.org/attention-is-off-by-one.html"
    description = "exp(s_i)/(n_extra + sum exp(s_j)), n_extra >= 0 (softmax_n)"
    row_sum = "at_most_one"
    options = (N_EXTRA,)
    kernel_family = "softmax"
    presets = {"softmax1": ("softmax_1, 'attention is off by one': exp(s_i)/(1 + sum exp(s_j))", {"n_extra": 1.0})}

    def sink_logit(self, ctx: Ctx, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        n_extra = ctx.settings.n_extra
        if n_extra == 0:
            return None  # softmax_n with n_extra = 0 is softmax
        return torch.tensor(math.log(n_extra), dtype=dtype, device=ctx.n.device)

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        n_extra = ctx.settings.n_extra
        shift = masked_max(scores, keep, floor=0.0)  # >= 0 so n_extra * exp(-shift) cannot overflow
        e = masked_exp(scores, keep, shift)
        den = e.sum(dim=-1, keepdim=True) + n_extra * torch.exp(-shift)
        return safe_divide(e, den)
