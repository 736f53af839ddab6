"""cosine (QK-norm): softmax over cos(q_i, k_j) * T, with q and k l2-normalised inside.

The temperature T = tau_h * scale(n): tau_h is a per-head factor (``attnorm.cosine_temperature``, learnable by
default, initialised at 1) and the default scale is ``max_gradient`` with the cosine score model of the head
dimension (alpha*(n), about 3.5 ln n at d = 128). The model's own 1/sqrt(d) is not applied: unit vectors already
give scores in [-1, 1].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import register_normalizer
from ..settings import declare_option, positive
from .base import Ctx, Normalizer, ParamSpec, masked_max, safe_divide
from .softmax import masked_exp

COSINE_TEMPERATURE = declare_option(
    "cosine_temperature", float, 1.0, "cosine: initial per-head factor tau_h on the scale (> 0)", check=positive
)
COSINE_TEMPERATURE_LEARNABLE = declare_option(
    "cosine_temperature_learnable", bool, True, "cosine: learn tau_h per head (else a constant)"
)
#: l2-normalisation floor (F.normalize eps): zero vectors stay zero instead of NaN
NORM_EPS = 1e-6


@register_normalizer
class Cosine(Normalizer):
    name = "cosine"
    paper = "Henry et al. 2020, Query-Key Normalization for Transformers, https://arxiv.org/abs/2010.04245"
    description = "softmax(cos(q,k) * tau_h * scale(n)), QK-norm; default scale alpha*(n) of the cosine model"
    row_sum = "one"
    options = (COSINE_TEMPERATURE, COSINE_TEMPERATURE_LEARNABLE)
    params = (ParamSpec("cosine_temperature", COSINE_TEMPERATURE, COSINE_TEMPERATURE_LEARNABLE,
                        "per-head factor tau_h on the temperature"),)
    uses_base_scaling = False
    kernel_family = "softmax"
    default_scale = "max_gradient"
    default_settings = {"max_gradient_dist": "cosine"}

    qk_norm_eps = NORM_EPS

    def transform_qk(self, q: torch.Tensor, k: torch.Tensor, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
        return F.normalize(q, dim=-1, eps=NORM_EPS), F.normalize(k, dim=-1, eps=NORM_EPS)

    def head_multiplier(self, ctx: Ctx) -> torch.Tensor | None:
        return ctx.heads["cosine_temperature"]

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        e = masked_exp(scores, keep, masked_max(scores, keep))
        return safe_divide(e, e.sum(dim=-1, keepdim=True))
