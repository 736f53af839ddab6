"""gated: gated attention (Qiu et al. 2025, "Gated Attention for Large Language Models: Non-linearity, Sparsity,
and Attention-Sink-Free", arXiv 2505.06708, NeurIPS 2025; used by Qwen3-Next): softmax attention whose output is
multiplied elementwise by a head-specific sigmoid gate computed from the query token,

    Y'_i = softmax(s_i) V  (.)  sigmoid(x_i W_theta),

the paper's best variant (G1: after SDPA, elementwise, per head). It reports that the gate removes attention sinks
and massive activations and steadies training. The paper's gate reads the layer input x_i; an attention function
sees q, k and v only, so here it reads the query vector q_i (a linear function of x_i, after rotary embeddings in
rotary models, as ``asentmax``'s temperature does): gate_h(q_i) = sigmoid(q_i W_h + b_h) with W_h [D, Dv]
(``gated_w``) and b_h [Dv] (``gated_b``) learnable per head. On the output rows only: the weights are softmax's, and
every path runs it (the gate is applied after the path: ``kernels/variants.py``).

Initial values: W = 0 and b = ``gated_bias_init`` (default 0: every gate 1/2, which the output projection absorbs;
the paper initialises W_theta randomly, so its gates start near 1/2 too). A large bias makes it nearly plain softmax
(b = 10 gives gates of 0.99995).
"""

from __future__ import annotations

import torch

from ..registry import register_normalizer
from ..settings import declare_option
from .base import Ctx, ParamSpec
from .softmax import Softmax

GATED_BIAS_INIT = declare_option("gated_bias_init", float, 0.0, "gated: initial gate bias b_h (every entry); 0 gives "
                                 "gates of 1/2, a large value (e.g. 10) starts at plain softmax")
GATED_WEIGHT_INIT = declare_option("gated_weight_init", float, 0.0,
                                   "gated: initial value of every entry of the gate's W_h [head_dim, value head dim]")
GATED_LEARNABLE = declare_option("gated_learnable", bool, True, "gated: learn the gate's W_h and b_h per head (else "
                                 "constants)")


@register_normalizer
class Gated(Softmax):
    name = "gated"
    paper = "Qiu et al. 2025, Gated Attention for Large Language Models, https://arxiv.org/abs/2505.06708"
    description = "gated attention: softmax attention's output times sigmoid(q W + b), elementwise per head"
    options = (GATED_BIAS_INIT, GATED_WEIGHT_INIT, GATED_LEARNABLE)
    params = (
        ParamSpec("gated_w", GATED_WEIGHT_INIT, GATED_LEARNABLE, "per-head gate weights W_h [head_dim, Dv] on q",
                  shape=("head_dim", "value_dim")),
        ParamSpec("gated_b", GATED_BIAS_INIT, GATED_LEARNABLE, "per-head gate bias b_h [Dv]", shape=("value_dim",)),
    )

    def output_gate(self, q: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        """sigmoid(q W_h + b_h): [B, H, Lq, Dv] from the raw q [B, H, Lq, D]. Computed in fp32 at least (fp64
        kept), except fp16/bf16 on a GPU: there in the input dtype, as a gate layer of a half-precision model runs
        (a tensor-core product accumulated in fp32; fp32 copies of the [B, H, Lq, Dv] gate and output would cost the
        path more than its attention)."""
        half = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
        dt = q.dtype if half else torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        w = ctx.heads["gated_w"].to(device=q.device, dtype=dt)  # [H, D, Dv]
        b = ctx.heads["gated_b"].to(device=q.device, dtype=dt)  # [H, Dv]
        if w.shape[1] != q.shape[-1]:
            raise ValueError(f"gated: the gate's weights take {w.shape[1]} query dims per head but the queries have "
                             f"head dim {q.shape[-1]}")
        return torch.sigmoid(torch.matmul(q.to(dt), w.unsqueeze(0)) + b[None, :, None, :])
