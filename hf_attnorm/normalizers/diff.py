"""diff: differential attention (Ye et al., "Differential Transformer", ICLR 2025, arXiv 2410.05258):

    DiffAttn(X) = (softmax(Q1 K1^T / sqrt(d)) - lambda softmax(Q2 K2^T / sqrt(d))) V,
    lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init,
    lambda_init = 0.8 - 0.6 exp(-0.3 l)      (l: the layer's 0-based index),
    out = RMSNorm(DiffAttn(X)) x (1 - lambda_init)   (per head, over its value dims),

so two softmax maps of one head cancel each other's common-mode noise (attention to irrelevant context); the paper
reports better long-context retrieval and fewer activation outliers.

How it is realised on an attention function's q, k, v: each head's D query/key dims are split into two halves of
D/2 (Q1/K1 and Q2/K2; d = D/2, so the scaling is sqrt(2) x the model's), each half attended with softmax on whatever
path the call takes (SDPA included: ``variants.halves``, ``attend``), the two results combined as above. The halves
keep rotary pairs whole: in transformers' rotary layout (``rotate_half``) dim i pairs with i + D/2, so half 1 holds
dims [0, D/4) and [D/2, 3D/4) and half 2 the rest, and each half is again a rotary layout of D/2 dims (the paper's
code splits into contiguous halves with interleaved rotary, the same thing in its layout). A head dim that is not a
multiple of 4 (no rotary model has one) is split into its first floor(D/2) dims and the rest, each half scaled for
its own width.
The values are not split (V has 2d dims per head in the paper, here the head's Dv). With GQA, half s of a query
head reads half s of its key/value head.

Learnable per head (the paper has one lambda and one RMSNorm weight per layer; here per head, which contains it):
the four re-parameterisation vectors ``diff_lambda_q1``/``k1``/``q2``/``k2`` [H, D] drawn from N(0, 0.1^2) as in
the paper's code (the products, not the vector length, enter lambda) and the RMSNorm weight ``diff_norm_w`` [H, Dv]
(1 at the start; eps 1e-5). ``diff_lambda_init`` fixes lambda_init; unset, it follows the layer depth (a call
without a layer index is layer 0: 0.2).

No setting of differential attention equals plain softmax (half-width scores, the subtraction, the normalisation);
the paper trains from scratch.
The weights (``output_attentions``) are A1 - lambda A2: rows sum to 1 - lambda, entries may be negative.
"""

from __future__ import annotations

import math

import torch

from ..registry import register_normalizer
from ..settings import declare_option, nonnegative
from .base import Ctx, ParamSpec
from .softmax import Softmax

DIFF_LAMBDA_INIT = declare_option(
    "diff_lambda_init", float, None, "diff: lambda_init, the constant part of lambda and the output factor "
    "(1 - lambda_init); unset: 0.8 - 0.6 exp(-0.3 layer_idx), the paper's depth rule", optional=True)
DIFF_LAMBDA_STD = declare_option("diff_lambda_std", float, 0.1, "diff: standard deviation of the initial lambda "
                                 "re-parameterisation vectors (the paper: 0.1)", check=nonnegative)
DIFF_NORM_INIT = declare_option("diff_norm_init", float, 1.0,
                                "diff: initial value of the per-head RMSNorm weight on the output")
DIFF_LEARNABLE = declare_option("diff_learnable", bool, True,
                                "diff: learn the lambda vectors and the RMSNorm weight per head (else constants)")
#: the paper's RMSNorm epsilon
RMS_EPS = 1e-5


def depth_lambda_init(layer_idx: int) -> float:
    """The paper's lambda_init for a 0-based layer index: 0.8 - 0.6 exp(-0.3 layer_idx)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


@register_normalizer
class Diff(Softmax):
    name = "diff"
    paper = "Ye et al. 2025, Differential Transformer, https://arxiv.org/abs/2410.05258"
    description = ("differential attention: (softmax(Q1 K1) - lambda softmax(Q2 K2)) V on the two halves of each "
                   "head, RMS-normalised per head")
    row_sum = "free"
    differential = True
    options = (DIFF_LAMBDA_INIT, DIFF_LAMBDA_STD, DIFF_NORM_INIT, DIFF_LEARNABLE)
    params = (
        *(ParamSpec(f"diff_lambda_{part}", DIFF_LAMBDA_STD, DIFF_LEARNABLE,
                    f"per-head lambda re-parameterisation vector lambda_{part} [head_dim], N(0, std^2) at the start",
                    shape=("head_dim",), init="normal") for part in ("q1", "k1", "q2", "k2")),
        ParamSpec("diff_norm_w", DIFF_NORM_INIT, DIFF_LEARNABLE, "per-head RMSNorm weight on the output [Dv]",
                  shape=("value_dim",)),
    )

    def lambda_init(self, ctx: Ctx) -> float:
        fixed = ctx.settings.options["diff_lambda_init"]
        if fixed is not None:
            return float(fixed)
        layer = ctx.module_info.get("layer_idx")
        return depth_lambda_init(layer if isinstance(layer, int) else 0)

    def lambda_full(self, ctx: Ctx) -> torch.Tensor:
        """lambda per head, [H] (fp32 at least, fp64 kept): exp(q1 . k1) - exp(q2 . k2) + lambda_init."""
        h = {n: ctx.heads[f"diff_lambda_{n}"] for n in ("q1", "k1", "q2", "k2")}
        h = {n: t.to(torch.promote_types(t.dtype, torch.float32)) for n, t in h.items()}
        return (torch.exp((h["q1"] * h["k1"]).sum(-1)) - torch.exp((h["q2"] * h["k2"]).sum(-1))
                + self.lambda_init(ctx))

    def halves_difference(self, first: torch.Tensor, second: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        """first - lambda second, per head: outputs [B, H, Lq, Dv] or weights [B, H, Lq, Lk] (fp32 at least)."""
        dt = torch.promote_types(first.dtype, torch.float32)
        lam = self.lambda_full(ctx).to(device=first.device, dtype=dt).view(1, -1, 1, 1)
        return first.to(dt) - lam * second.to(dt)

    def difference_form(self, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """(lambda [H], the RMSNorm weight [H, Dv], 1 - lambda_init, RMS_EPS): ``normalize_output`` of
        ``halves_difference`` in one form (the kernels' fused combination)."""
        return self.lambda_full(ctx), ctx.heads["diff_norm_w"], 1.0 - self.lambda_init(ctx), RMS_EPS

    def normalize_output(self, out: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        """RMSNorm over each head's value dims with its weight, times (1 - lambda_init); out [B, H, Lq, Dv].
        A fully masked row (zeros) stays zero."""
        w = ctx.heads["diff_norm_w"].to(device=out.device, dtype=out.dtype)  # [H, Dv]
        if w.shape[-1] != out.shape[-1]:
            raise ValueError(f"diff: the RMSNorm weight has {w.shape[-1]} value dims per head but the values have "
                             f"{out.shape[-1]}")
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + RMS_EPS)
        return normed * w[None, :, None, :] * (1.0 - self.lambda_init(ctx))
