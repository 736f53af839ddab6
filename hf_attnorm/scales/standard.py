"""standard: the model's own scaling (1/sqrt(d) for most models), nothing length-dependent."""

from __future__ import annotations

import torch

from ..normalizers.base import Ctx
from ..registry import register_scale
from .base import Scale


@register_scale
class Standard(Scale):
    name = "standard"
    paper = "Vaswani et al. 2017, Attention Is All You Need, https://arxiv.org/abs/1706.03762"
    description = "the model's own scaling (1/sqrt(d))"

    def multiplier(self, n: torch.Tensor, ctx: Ctx) -> torch.Tensor | None:
        return None
