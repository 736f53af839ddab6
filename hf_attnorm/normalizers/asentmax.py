"""ASEntmax, adaptive-scalable entmax (Vasylenko, Pitorro, Martins & Treviso 2025, "Long-Context Generalization
with Sparse Attention", arXiv 2506.16640, ICLR 2026; code deep-spin/asentmax): alpha-entmax of scores scaled per
query by a length- and content-dependent temperature,

    p = alpha-entmax(theta_i * s_i),   theta_i = delta_h + beta_h(q_i) * (ln n_i)^gamma_h,
    beta_h(q_i) = softplus(w_h . q_i),

with n_i the keys query i sees, q_i its raw query vector [D] (before the model's scaling), and per head: w_h [D]
(``asentmax_w``, a [H, D] value), delta_h, gamma_h and alpha_h (shared with ``entmax_alpha``). This is the method
as implemented here. The authors' code (deep-spin/asentmax, synthetic/src/models/architectures/sparse_gemma.py,
``_apply_length_scaling``, read for this docstring) scales the queries the same way, theta = delta + beta (log
l)^gamma, and differs in three places a reproduction should know:

* its content-dependent mode ("adapt-softplus-tanh") projects the layer's hidden state x_i, not q_i: beta =
  softplus(W_beta x_i), and gamma is content-dependent too, gamma = 2 tanh(W_gamma x_i) (W: Linear(hidden, heads)).
  An attention function sees q, k, v only, so here beta reads q_i (a linear function of x_i, after RoPE) and gamma
  is a learned per-head constant, as in the code's other mode ("learn": beta_h, gamma_h constants);
* its length l is the query's position + 2 (log(i + 2), never 0); here it is n_i, the visible keys, so padding does
  not count and the first query is unscaled (theta = delta). For an unpadded causal row n_i = i + 1;
* delta = 1 is a config constant there; here delta_h is learnable (``asentmax_learnable``), initial value 1.

Our initial values: w = 0 (beta = ln 2 for every query at first, the gradient still reaches w), delta = 1, gamma = 1,
so theta starts as 1 + ln 2 ln n, which is SSMax's s ln n growth (s ~ 0.7) on top of the plain scores. The code's
"learn" mode draws beta ~ U(0.1, 1), gamma ~ N(0, 0.1).

theta multiplies q through ``Normalizer.query_multiplier``, so every path (chunked, reference, and any kernel that
takes alpha-entmax) gets it for free and autograd carries the gradient to w, delta and gamma.
"""

from __future__ import annotations

import torch

from ..registry import register_normalizer
from ..settings import declare_option
from .base import Ctx, ParamSpec
from .entmax_alpha import ENTMAX_ALPHA, ENTMAX_ALPHA_LEARNABLE, EntmaxAlpha

ASENTMAX_DELTA = declare_option("asentmax_delta", float, 1.0, "asentmax: initial delta_h, the length-free part of "
                                "the temperature theta = delta + softplus(w . q) (ln n)^gamma")
ASENTMAX_GAMMA = declare_option("asentmax_gamma", float, 1.0, "asentmax: initial exponent gamma_h of ln n")
ASENTMAX_W = declare_option("asentmax_w", float, 0.0,
                            "asentmax: initial value of every entry of w_h [head_dim] in beta(q) = softplus(w . q)")
ASENTMAX_LEARNABLE = declare_option("asentmax_learnable", bool, True,
                                    "asentmax: learn delta, gamma and w per head (else constants)")


@register_normalizer
class ASEntmax(EntmaxAlpha):
    name = "asentmax"
    paper = "Vasylenko et al. 2025, adaptive-scalable entmax, https://arxiv.org/abs/2506.16640"
    description = ("adaptive-scalable entmax: alpha-entmax of (delta + softplus(w.q) (ln n)^gamma) s, "
                   "per-head alpha, delta, gamma, w (learnable)")
    options = (ENTMAX_ALPHA, ENTMAX_ALPHA_LEARNABLE, ASENTMAX_DELTA, ASENTMAX_GAMMA, ASENTMAX_W, ASENTMAX_LEARNABLE)
    params = EntmaxAlpha.params + (
        ParamSpec("asentmax_delta", ASENTMAX_DELTA, ASENTMAX_LEARNABLE, "per-head delta of the temperature"),
        ParamSpec("asentmax_gamma", ASENTMAX_GAMMA, ASENTMAX_LEARNABLE, "per-head exponent gamma of ln n"),
        ParamSpec("asentmax_w", ASENTMAX_W, ASENTMAX_LEARNABLE, "per-head w [head_dim] of beta(q) = softplus(w . q)",
                  shape=("head_dim",)),
    )

    def query_multiplier(self, q: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        """theta [B, H, Lq] = delta_h + softplus(w_h . q_i) (ln n_i)^gamma_h; q: [B, H, Lq, D] (raw)."""
        dt = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype  # fp32 at least, fp64 kept
        w = ctx.heads["asentmax_w"].to(device=q.device, dtype=dt)  # [H, D]
        # a broadcast product and a sum, not einsum: einsum's backward views the gradient as [H, B*Lq, D], which
        # fails under torch.compile's aot_eager backend when q is a transposed (non-contiguous) projection
        beta = torch.nn.functional.softplus((q.to(dt) * w[None, :, None, :]).sum(-1))
        delta = ctx.heads["asentmax_delta"].to(device=q.device, dtype=dt).view(1, -1, 1)
        gamma = ctx.heads["asentmax_gamma"].to(device=q.device, dtype=dt).view(1, -1, 1)
        logn = torch.log(ctx.n.to(device=q.device, dtype=dt))  # >= 0 (n >= 1)
        # (ln n)^gamma with 0 at n = 1 and no 0 * log 0 in the gradient of gamma there
        pos = logn > 0
        power = torch.where(pos, logn.clamp_min(1e-30) ** gamma, torch.zeros((), dtype=dt, device=q.device))
        return (delta + beta * power).to(q.dtype)
