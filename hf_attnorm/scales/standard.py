"""standard: the model's own scaling (1/sqrt(d) for most models), nothing length-dependent."""

from __future__ import annotations

import torch

from ..normalizers.base import Ctx
from ..registry import register_scale
from .base import Scale


@register_scale
class Standard(Scale):
    name = "standard"
    description = "the model's own scaling (1/sqrt(d))"

    def multiplier(self, n: torch.Tensor, ctx: Ctx) -> torch.Tensor | None:
        return None
