"""entmax-1.5 (Peters, Niculae & Martins 2019): p_i = [s_i/2 - tau]_+^2 with tau such that the row sums to 1.

Exact and sort-based (the algorithm of the ``entmax`` package), sparse (exact zeros), masked keys excluded, fully
masked rows give 0. The backward pass uses the closed-form Jacobian: the autograd graph of the sort-based threshold
would hit sqrt'(0) = inf on rejected candidates and turn the gradient into NaN.
"""

from __future__ import annotations

import torch

from ..registry import register_normalizer
from .base import Ctx, Normalizer, masked_fill_zero, masked_max, safe_divide
from .sparsemax import _sorted_visible


def entmax15_threshold(z: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """tau [..., 1] with sum_i [z_i - tau]_+^2 = 1 over visible keys (z already halved)."""
    zs, valid = _sorted_visible(z, keep)
    rho = torch.arange(1, z.shape[-1] + 1, device=z.device, dtype=z.dtype)
    mean = zs.cumsum(dim=-1) / rho
    mean_sq = (zs * zs).cumsum(dim=-1) / rho
    ss = rho * (mean_sq - mean * mean)
    delta = (1 - ss) / rho
    tau = mean - torch.sqrt(delta.clamp_min(0))
    support = valid & (tau <= zs)
    size = support.sum(dim=-1, keepdim=True).clamp_min(1)
    return torch.gather(tau, -1, size - 1)


class _Entmax15Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        z = (z - masked_max(z, keep)) / 2
        tau = entmax15_threshold(z, keep)
        p = masked_fill_zero(torch.clamp(z - tau, min=0) ** 2, keep)
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (p,) = ctx.saved_tensors
        gppr = p.sqrt()
        dz = grad * gppr
        q = safe_divide(dz.sum(dim=-1, keepdim=True), gppr.sum(dim=-1, keepdim=True))
        return dz - q * gppr, None


def entmax15(z: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Entmax-1.5 over the last dim, restricted to ``keep``. z: [..., Lk]; keep broadcastable to z."""
    return _Entmax15Fn.apply(z, keep.expand_as(z))


@register_normalizer
class Entmax15(Normalizer):
    name = "entmax15"
    paper = "Peters et al. 2019, Sparse Sequence-to-Sequence Models, https://arxiv.org/abs/1905.05702"
    kernel_family = "fused"
    fused_map = "entmax15"
    description = "entmax-1.5: [s_i/2 - tau]_+^2, sparse (exact zeros)"
    row_sum = "one"
    sparse = True

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        return entmax15(scores, keep)
