"""ssmax: Scalable-Softmax, scaling * s_h * ln n with s_h learnable per head (Nakanishi 2025, arXiv 2501.19399)."""

from __future__ import annotations

import torch

from ..normalizers.base import Ctx, ParamSpec
from ..registry import register_scale
from ..settings import declare_option
from .base import Scale

SSMAX_S = declare_option("ssmax_s", float, 1.0, "ssmax: initial per-head factor s_h in s_h * ln n")
SSMAX_LEARNABLE = declare_option("ssmax_learnable", bool, True, "ssmax: learn s_h per head (else a constant)")


@register_scale
class SSMax(Scale):
    name = "ssmax"
    paper = "Nakanishi 2025, Scalable-Softmax Is Superior for Attention, https://arxiv.org/abs/2501.19399"
    description = "scaling * s_h * ln n, s_h per head (learnable)"
    options = (SSMAX_S, SSMAX_LEARNABLE)
    params = (ParamSpec("ssmax_s", SSMAX_S, SSMAX_LEARNABLE, "per-head SSMax factor s_h"),)

    def multiplier(self, n: torch.Tensor, ctx: Ctx) -> torch.Tensor | None:
        return ctx.heads["ssmax_s"].to(n.dtype).view(1, -1, 1) * torch.log(n)
