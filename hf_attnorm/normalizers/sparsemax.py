"""sparsemax (Martins & Astudillo 2016): p_i = [s_i - tau]_+, the Euclidean projection onto the simplex.

Exact and sort-based: rows sum to 1 with exact zeros outside the support; masked keys are excluded from the sort;
fully masked rows give 0. The backward pass uses the closed-form Jacobian (supp * (g - mean_supp(g))).
"""

from __future__ import annotations

import torch

from ..registry import register_normalizer
from .base import Ctx, Normalizer, masked_fill_zero, masked_max, safe_divide


def _sorted_visible(z: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores sorted descending with masked keys last; returns (sorted values with masked ones set to 0,
    validity mask of sorted positions)."""
    keep = keep.expand_as(z)
    key = torch.where(keep, z, torch.full((), float("-inf"), dtype=z.dtype, device=z.device))
    zs, idx = torch.sort(key, dim=-1, descending=True)
    valid = torch.gather(keep, -1, idx)
    return torch.where(valid, zs, torch.zeros_like(zs)), valid


def sparsemax_threshold(z: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """tau [..., 1] with sum_i [z_i - tau]_+ = 1 over visible keys (any value on fully masked rows)."""
    zs, valid = _sorted_visible(z, keep)
    k = torch.arange(1, z.shape[-1] + 1, device=z.device, dtype=z.dtype)
    cs = zs.cumsum(dim=-1)
    support = valid & (1 + k * zs > cs)
    size = support.sum(dim=-1, keepdim=True).clamp_min(1)
    return (torch.gather(cs, -1, size - 1) - 1) / size.to(z.dtype)


class _SparsemaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        z = z - masked_max(z, keep)
        tau = sparsemax_threshold(z, keep)
        p = masked_fill_zero(torch.clamp(z - tau, min=0), keep)
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (p,) = ctx.saved_tensors
        supp = (p > 0).to(grad.dtype)
        g = grad * supp
        mean = safe_divide(g.sum(dim=-1, keepdim=True), supp.sum(dim=-1, keepdim=True))
        return supp * (grad - mean), None


def sparsemax(z: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Sparsemax over the last dim, restricted to ``keep``. z: [..., Lk]; keep broadcastable to z."""
    return _SparsemaxFn.apply(z, keep.expand_as(z))


@register_normalizer
class Sparsemax(Normalizer):
    name = "sparsemax"
    paper = "Martins & Astudillo 2016, From Softmax to Sparsemax, https://arxiv.org/abs/1602.02068"
    kernel_family = "fused"
    fused_map = "sparsemax"
    description = "sparsemax: Euclidean projection onto the simplex (exact zeros)"
    row_sum = "one"
    sparse = True

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        return sparsemax(scores, keep)
