"""log_n: scaling * ln n (Chiang & Cholak 2022; the fixed-s form of SSMax)."""

from __future__ import annotations

import torch

from ..normalizers.base import Ctx
from ..registry import register_scale
from .base import Scale


def log_n_scale(n: torch.Tensor) -> torch.Tensor:
    """ln n for n >= 1 (0 for a single visible key)."""
    return torch.log(n)


@register_scale
class LogN(Scale):
    name = "log_n"
    paper = ("Chiang & Cholak 2022, Overcoming a Theoretical Limitation of Self-Attention, htt"
             "ps://arxiv.org/abs/2202.12172")
    description = "scaling * ln n"

    def multiplier(self, n: torch.Tensor, ctx: Ctx) -> torch.Tensor | None:
        return log_n_scale(n)
