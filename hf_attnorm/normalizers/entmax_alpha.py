"""alpha-entmax with a per-head (learnable) alpha (Peters, Niculae & Martins 2019, "Sparse Sequence-to-Sequence
Models", arXiv 1905.05702; Correia, Niculae & Martins 2019, "Adaptively Sparse Transformers", arXiv 1909.00015).

    p_i = [(alpha - 1) s_i - tau]_+^(1 / (alpha - 1)),   tau such that sum_i p_i = 1 over the visible keys,

alpha > 1: alpha = 1.5 is ``entmax15``, alpha = 2 is ``sparsemax``, alpha -> 1+ approaches softmax. tau is found by
bisection as in deep-spin/entmax ``entmax_bisect``: with x = (alpha - 1)(s - max s), tau lies in
[-1, -(1/n)^(alpha - 1)] (n visible keys), and a fixed number of halvings (the mantissa bits of the dtype, plus a few)
brings it to rounding precision, after which the row is renormalised. A fixed count means no data-dependent loop
and no host sync.

Gradients (closed form, Correia et al. 2019, eq. 10-12): with g_i = p_i^(2 - alpha) on the support,
ds_i = g_i (dp_i - sum_j dp_j g_j / sum_j g_j), and per row
d alpha = sum_i dp_i [(p_i - pt_i) / (alpha - 1)^2 - (p_i ln p_i - pt_i H) / (alpha - 1)], pt = g / sum g,
H = sum_j p_j ln p_j. A learned alpha is used clamped to >= ``ALPHA_MIN`` (its gradient is 0 below).
"""

from __future__ import annotations

import math

import torch

from ..registry import register_normalizer
from ..settings import AttnormSettings, declare_option
from .base import Ctx, Normalizer, ParamSpec, RowForm, masked_fill_zero, safe_divide

#: smallest alpha in use: below it 1 / (alpha - 1) > 1000 and the powers underflow in fp32 (use softmax for 1)
ALPHA_MIN = 1.001
#: the row value: alpha held at >= ALPHA_MIN
_ROW = RowForm(head="entmax_alpha", head_map="at_least", floor=ALPHA_MIN)


def _check_alpha(v: float) -> str | None:
    if not (math.isfinite(v) and v >= ALPHA_MIN):
        return (f"must be a finite number >= {ALPHA_MIN} (alpha-entmax needs alpha > 1, typically in (1, 2]: "
                "1.5 = entmax15, 2 = sparsemax; for alpha = 1 use softmax)")
    return None


ENTMAX_ALPHA = declare_option("entmax_alpha", float, 1.5,
                              "entmax_alpha / asentmax: alpha > 1 of alpha-entmax (initial value when learned)",
                              check=_check_alpha)
ENTMAX_ALPHA_LEARNABLE = declare_option("entmax_alpha_learnable", bool, True,
                                        "entmax_alpha / asentmax: learn alpha per head (else a constant)")


def bisect_iterations(dtype: torch.dtype) -> int:
    """Halvings of the threshold bracket (width <= 1): the dtype's mantissa bits plus 4."""
    return round(-math.log2(torch.finfo(dtype).eps)) + 4


def entmax_alpha_threshold(x: torch.Tensor, keep: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """tau [..., 1] (bisection) with sum_i [x_i - tau]_+^(1/(alpha-1)) ~ 1 over ``keep``; x: [..., Lk] with
    visible max 0 (already times alpha - 1), alpha: [..., 1]. Rows with no visible key give -1."""
    n = keep.sum(dim=-1, keepdim=True).clamp_min(1).to(x.dtype)
    inv = 1.0 / (alpha - 1)
    lo = torch.full_like(n, -1.0)
    width = -(1.0 / n) ** (alpha - 1) - lo  # tau_hi - tau_lo, in [0, 1)
    for _ in range(bisect_iterations(x.dtype)):
        width = width / 2
        mid = lo + width
        f = masked_fill_zero(torch.clamp(x - mid, min=0) ** inv, keep).sum(dim=-1, keepdim=True)
        lo = torch.where(f >= 1, mid, lo)
    return lo


class _EntmaxAlphaFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, keep: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        neg = torch.finfo(z.dtype).min
        zmax = torch.where(keep, z, torch.full((), neg, dtype=z.dtype, device=z.device)).amax(-1, keepdim=True)
        zmax = torch.where(zmax == neg, torch.zeros_like(zmax), zmax)
        x = (z - zmax) * (alpha - 1)
        tau = entmax_alpha_threshold(x, keep, alpha)
        p = masked_fill_zero(torch.clamp(x - tau, min=0) ** (1.0 / (alpha - 1)), keep)
        p = safe_divide(p, p.sum(dim=-1, keepdim=True))  # bisection leaves sum within rounding of 1: make it exact
        ctx.save_for_backward(p, alpha)
        return p

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        p, alpha = ctx.saved_tensors
        on = p > 0
        zero = torch.zeros((), dtype=p.dtype, device=p.device)
        g = torch.where(on, p.clamp_min(torch.finfo(p.dtype).tiny) ** (2 - alpha), zero)
        gsum = g.sum(dim=-1, keepdim=True)
        dz = g * (grad - safe_divide((grad * g).sum(dim=-1, keepdim=True), gsum))
        dalpha = None
        if ctx.needs_input_grad[2]:
            plogp = torch.where(on, p * torch.log(p.clamp_min(torch.finfo(p.dtype).tiny)), zero)
            ent = plogp.sum(dim=-1, keepdim=True)
            pt = safe_divide(g, gsum)
            am1 = alpha - 1
            dalpha = (grad * ((p - pt) / am1**2 - (plogp - pt * ent) / am1)).sum(dim=-1, keepdim=True)
        return dz, None, dalpha


def entmax_alpha(z: torch.Tensor, keep: torch.Tensor, alpha: torch.Tensor | float) -> torch.Tensor:
    """alpha-entmax over the last dim, restricted to ``keep``. z: [..., Lk]; keep broadcastable to z; alpha: a float
    or a tensor broadcastable to [..., 1] (e.g. [1, H, 1, 1]), > 1. Rows with no visible key give 0. fp16/bf16 are
    computed in fp32."""
    dtype = z.dtype
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    z = z.to(work)
    alpha = torch.as_tensor(alpha, dtype=work, device=z.device).expand(*z.shape[:-1], 1)
    return _EntmaxAlphaFn.apply(z, keep.expand_as(z), alpha).to(dtype)


@register_normalizer
class EntmaxAlpha(Normalizer):
    name = "entmax_alpha"
    paper = "Correia et al. 2019, Adaptively Sparse Transformers, https://arxiv.org/abs/1909.00015"
    description = "alpha-entmax [(alpha-1) s_i - tau]_+^(1/(alpha-1)), alpha > 1 per head (learnable), sparse"
    row_sum = "one"
    sparse = True
    kernel_family = "fused"
    fused_map = "entmax_alpha"
    options = (ENTMAX_ALPHA, ENTMAX_ALPHA_LEARNABLE)
    params = (ParamSpec("entmax_alpha", ENTMAX_ALPHA, ENTMAX_ALPHA_LEARNABLE,
                        "per-head alpha of alpha-entmax (used clamped to >= 1.001)"),)

    def alpha(self, ctx: Ctx, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """alpha_h [H] in ``dtype``, held at >= ALPHA_MIN (a learned value may drift below 1): the row value."""
        return _ROW.evaluate(ctx, dtype).view(-1)

    def row_form(self, settings: AttnormSettings) -> RowForm:
        """r = max(alpha_h, ALPHA_MIN) [1, H, 1], the fused kernels' per-row constant; its gradient is d alpha."""
        return _ROW

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        alpha = self.alpha(ctx, scores.dtype).to(scores.device).view(1, -1, 1, 1)
        return entmax_alpha(scores, keep, alpha)
