"""power: |s_i|^p / sum_j |s_j|^p with p >= 1 per head (optionally learned); ``squared`` is p = 2.

Polynomial instead of exponential weights, so a row's weights depend on the score ratios |s_i| / |s_j| only.
Source: the generalisation of ``squared`` to a real, per-head p; the integer-degree form
(q.k)^p / sum (q.k)^p with even p is Kacham, Mirrokni and Zhong, "PolySketchFormer" (arXiv 2310.01655), and
|s|^p equals it for even p. Rows whose visible scores are all 0 (0/0) give weights 0 by convention, as ``squared``.

Weights are computed relative to the row's largest p ln|s| (detached, a stabiliser only), so large |s| or p cannot
overflow: a = exp(p ln|s_i| - m) / sum_j exp(p ln|s_j| - m). Gradients: dw/ds through p |s|^(p-1) sign(s) (0 at
s = 0) and dw/dp through |s|^p ln|s| (0 at s = 0, where |s|^p ln|s| -> 0 for p >= 1). A learned p is used as
max(p, 1): below 1 the map's derivative at s = 0 is infinite, so the exponent is held at 1 there (its gradient
stops pushing it lower).

Kernels: the fused map ``power`` (C++ and Triton) reads p through ``row_value`` as +p on rows with more than one
visible key and -p on rows with one (the kernels use |p|; the sign tells them the row's weights are constant, so
its gradients are exactly 0 instead of rounding noise amplified by p / s).
"""

from __future__ import annotations

import torch

from ..registry import register_normalizer
from ..settings import AttnormSettings, declare_option
from .base import Ctx, Normalizer, ParamSpec, RowForm, masked_fill_zero, safe_divide

POWER_P = declare_option(
    "power_p", float, 2.0, "power: exponent p >= 1 of |s|^p (initial value when learned)",
    check=lambda v: "must be >= 1 (|s|^p with p < 1 has an infinite derivative at s = 0)"
    if not v >= 1.0 else None,
)
POWER_LEARNABLE = declare_option("power_learnable", bool, True, "power: learn p per head (initialised at power_p)")

#: the kernels' row value: p used as max(p, 1) (power_exponent), its sign marking single-key rows
_ROW = RowForm(head="power_p", head_map="at_least", floor=1.0, negate_single_key=True)


def power_exponent(ctx: Ctx) -> torch.Tensor:
    """p_h = max(p_h, 1), [H] fp32 (autograd-connected to a learned p). Written p + relu(1 - p) so that p = 1 gets
    the gradient 1 on every torch: clamp's gradient at its bound is a torch convention (1 before torch 2.14, 0 since),
    and p starts at 1 when power_p = 1."""
    p = ctx.heads["power_p"]
    return p + torch.relu(1.0 - p)


@register_normalizer
class Power(Normalizer):
    name = "power"
    paper = "Kacham et al. 2023, PolySketchFormer (even integer p), https://arxiv.org/abs/2310.01655"
    description = "|s_i|^p/sum |s_j|^p, p >= 1 per head (learnable; p = 2 is squared; rows of zeros give 0)"
    row_sum = "at_most_one"  # 1 except on all-zero rows, where it is 0 by convention
    options = (POWER_P, POWER_LEARNABLE)
    kernel_family = "fused"
    fused_map = "power"
    params = (ParamSpec("power_p", POWER_P, POWER_LEARNABLE, "per-head exponent p (used as max(p, 1))"),)

    def row_form(self, settings: AttnormSettings) -> RowForm:
        """r = +max(p_h, 1) on rows with more than one visible key, -max(p_h, 1) on rows with one: [B or 1, H, Lq]."""
        return _ROW

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        """scores: [B, H, Lq, Lk] -> weights [B, H, Lq, Lk]."""
        p = power_exponent(ctx).to(scores.dtype).view(1, -1, 1, 1)
        mag = scores.abs()
        live = keep & (mag > 0)
        # log of 1 where |s| = 0 or masked: no inf in the graph (0 * inf would make NaN gradients)
        logs = p * torch.log(torch.where(live, mag, torch.ones_like(mag)))
        neg = torch.finfo(scores.dtype).min
        m = torch.where(live, logs.detach(), torch.full((), neg, dtype=scores.dtype, device=scores.device))
        m = m.amax(dim=-1, keepdim=True)
        m = torch.where(m == neg, torch.zeros_like(m), m)
        a = masked_fill_zero(torch.exp(logs - m), live)
        return safe_divide(a, a.sum(dim=-1, keepdim=True))
