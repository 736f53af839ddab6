"""fox: forgetting attention (Lin, Nikishin, He & Courville, "Forgetting Transformer: Softmax Attention with a Forget
Gate", ICLR 2025, arXiv 2503.02130): softmax with a data-dependent decay added to the scores,

    w_ij = softmax_j(s_ij + F_ij),   F_ij = sum_{l=j+1..i} log f_l,   f_l = sigmoid(w_f . x_l + b_f)  (per head),

so a key fades by the forget gates of every later token up to the query. The paper's gate reads the layer input
x_l. An attention function sees q, k and v only; here the gate reads the value vector v_l = x_l W_v (no rotary
embedding, unlike k; a linear function of x_l restricted to W_v's row space): f_l = sigmoid(w_h . v_l + b_h) with
w_h [Dv] (``fox_w``) and b_h (``fox_b``) learnable per query head (a GQA head reads its key/value head's v).

Initial values: w = 0 and b = ``fox_bias_init`` (default 0, the paper's zero bias: f = 1/2 at first, a strong
decay that training adjusts). A large bias makes it nearly plain softmax (f = sigmoid(b) -> 1; b = 10 leaves a
decay of 4.5e-5 per token). The gates come from the cached values; cached decoding keeps their
cumulative sum c on the cache (hf/forget_cache.py), so a step computes its new key's gate only. Outside causal rows
(a bidirectional mask) the decay is -|c_i - c_j|, the gates between the two positions; the paper defines the causal
case only.

Kernels: every path that supports ``forget`` (``hf_attnorm.kernels``): triton_forget (on a GPU: the fused
Triton kernels' softmax with the decay formed per block from the cumulative gates, O(n) memory, forward and backward
with the gates' gradient), sdpa (on a CPU, causal and padded calls through SDPA's flash kernel with the exact decay in
blocks of its mask, training included; elsewhere the materialised bias for small calls), chunked (the bias formed per
chunk, O(n) memory), decode, reference.
"""

from __future__ import annotations

import torch

from ..registry import register_normalizer
from ..settings import declare_option
from .base import Ctx, ParamSpec
from .softmax import Softmax

FOX_BIAS_INIT = declare_option("fox_bias_init", float, 0.0, "fox: initial forget-gate bias b_h (f = sigmoid(w . v + "
                               "b); 0 as in the paper, large (e.g. 10) to start at plain softmax)")
FOX_WEIGHT_INIT = declare_option("fox_weight_init", float, 0.0,
                                 "fox: initial value of every entry of w_h [value head dim] of the forget gate")
FOX_LEARNABLE = declare_option("fox_learnable", bool, True, "fox: learn the forget gate's w_h and b_h per head "
                               "(else constants)")


@register_normalizer
class Fox(Softmax):
    name = "fox"
    paper = "Lin et al. 2025, Forgetting Transformer, https://arxiv.org/abs/2503.02130"
    description = "forgetting attention: softmax(s_ij + sum_{l=j+1..i} log f_l), f_l = sigmoid(w . v_l + b) per head"
    options = (FOX_BIAS_INIT, FOX_WEIGHT_INIT, FOX_LEARNABLE)
    # f = sigmoid(10) = 1 - 4.5e-5: a decay of 4.5e-5 per key, 0.02 over 512 keys (the gate learns from there)
    key_order = True  # the decay follows the keys' positions
    # the decay reads the query's key position as Lk - Lq + i, which holds per sequence, not in the packed layout
    continuous_batching = "per_sequence"
    key_order_note = ("here a key after the query decays by the forget gates between them as one before it does "
                      "(-|c_i - c_j|), an extension of the paper's causal definition")
    params = (
        ParamSpec("fox_w", FOX_WEIGHT_INIT, FOX_LEARNABLE, "per-head forget-gate weights w_h [Dv] on the values",
                  shape=("value_dim",)),
        ParamSpec("fox_b", FOX_BIAS_INIT, FOX_LEARNABLE, "per-head forget-gate bias b_h"),
    )

    def forget_gates(self, v: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        """log f [B, H, Lk] = logsigmoid(w_h . v_l + b_h); v: [B, Hkv, Lk, Dv]."""
        dt = torch.float32 if v.dtype in (torch.float16, torch.bfloat16) else v.dtype  # fp32 at least, fp64 kept
        w = ctx.heads["fox_w"].to(device=v.device, dtype=dt)  # [H, Dv]
        b = ctx.heads["fox_b"].to(device=v.device, dtype=dt)
        B, Hkv, Lk, Dv = v.shape
        H = w.shape[0]
        if w.shape[-1] != Dv:
            raise ValueError(f"fox: the forget gate's weights have {w.shape[-1]} entries per head but the values "
                             f"have head dim {Dv}")
        # each query head reads its key/value head's values (a broadcast product, no GQA copy of v)
        logits = (v.to(dt).unsqueeze(2) * w.view(1, Hkv, H // Hkv, 1, Dv)).sum(-1).reshape(B, H, Lk)
        return torch.nn.functional.logsigmoid(logits + b.view(1, H, 1))
