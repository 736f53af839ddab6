"""symax: |s_i| / (eta + sum_j |s_j|), eta >= 0 (xnought/symax); eta optionally learned per head.

A learned eta is used as |eta| so it cannot turn the denominator negative.
"""

from __future__ import annotations

import torch

from ..registry import register_normalizer
from ..settings import AttnormSettings, declare_option, nonnegative
from .base import Ctx, Normalizer, ParamSpec, RowForm, masked_fill_zero, safe_divide

ETA = declare_option("eta", float, 1.0, "symax: the constant eta >= 0 in |s_i|/(eta + sum|s_j|)", check=nonnegative)
_ROW = RowForm(head="symax_eta", head_map="abs")
ETA_LEARNABLE = declare_option("eta_learnable", bool, False, "symax: learn eta per head (initialised at eta)")


@register_normalizer
class Symax(Normalizer):
    name = "symax"
    paper = "xnought/symax, https://github.com/xnought/symax"
    description = "|s_i|/(eta + sum |s_j|), eta >= 0 (default 1, optionally learned per head)"
    row_sum = "at_most_one"
    options = (ETA, ETA_LEARNABLE)
    kernel_family = "fused"
    fused_map = "symax"
    params = (ParamSpec("symax_eta", ETA, ETA_LEARNABLE, "per-head eta (used as |eta|)"),)

    def row_form(self, settings: AttnormSettings) -> RowForm:
        """r = |eta_h| [1, H, 1], added to the denominator."""
        return _ROW

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        eta = ctx.head("symax_eta").to(scores.dtype).abs()
        a = masked_fill_zero(scores.abs(), keep)
        return safe_divide(a, eta + a.sum(dim=-1, keepdim=True))
