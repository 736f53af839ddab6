"""ssmax: Scalable-Softmax, scaling * (s_h * ln n + b_h) with s_h learnable per head (Nakanishi 2025, arXiv
2501.19399). b_h is the paper's bias variant ("SSMax with bias", s log n + b, per layer and head): 0 and constant by
default (the plain s_h * ln n); ``ssmax_bias_learnable=true`` makes it a per-head value, which admits the exact
conversion start s_h = 0, b_h = 1 (softmax) and the anchored form 1 + s_h (ln n - ln L) (b_h = 1 - s_h ln L).
``ssmax_anchor`` a mixes softmax's multiplier in, (1 - a)(s_h ln n + b_h) + a: a = 1 is softmax whatever s_h and b_h
are, so a conversion's stage 1 can start at the teacher with the calibrated s_h in place and release the anchor to
a = 0 (plain SSMax) while s_h trains (``continuation``)."""

from __future__ import annotations

import math

import torch

from ..normalizers.base import Calibration, Continuation, Ctx, ParamSpec, TeacherStats
from ..registry import register_scale
from ..settings import AttnormSettings, declare_option
from .base import Scale

SSMAX_S = declare_option("ssmax_s", float, 1.0, "ssmax: initial per-head factor s_h in s_h * ln n + b_h")
SSMAX_LEARNABLE = declare_option("ssmax_learnable", bool, True, "ssmax: learn s_h per head (else a constant)")
SSMAX_BIAS = declare_option("ssmax_bias", float, 0.0,
                            "ssmax: initial per-head bias b_h in s_h * ln n + b_h (the paper's bias variant; "
                            "0 = plain SSMax)")
SSMAX_BIAS_LEARNABLE = declare_option("ssmax_bias_learnable", bool, False,
                                      "ssmax: learn b_h per head (the paper's bias variant; else the constant "
                                      "ssmax_bias)")

SSMAX_ANCHOR = declare_option("ssmax_anchor", float, 0.0,
                              "ssmax: weight a of softmax's multiplier 1 mixed in, (1 - a)(s_h ln n + b_h) + a (0 = "
                              "SSMax, the default; 1 = softmax; a conversion releases it from 1 to 0)",
                              check=lambda v: None if 0.0 <= v <= 1.0 else "must be in [0, 1]")


@register_scale
class SSMax(Scale):
    name = "ssmax"
    paper = "Nakanishi 2025, Scalable-Softmax Is Superior for Attention, https://arxiv.org/abs/2501.19399"
    description = "scaling * (s_h * ln n + b_h), s_h per head (learnable), b_h = 0 unless the bias variant is on"
    options = (SSMAX_S, SSMAX_LEARNABLE, SSMAX_BIAS, SSMAX_BIAS_LEARNABLE, SSMAX_ANCHOR)
    params = (ParamSpec("ssmax_s", SSMAX_S, SSMAX_LEARNABLE, "per-head SSMax factor s_h"),
              ParamSpec("ssmax_bias", SSMAX_BIAS, SSMAX_BIAS_LEARNABLE, "per-head SSMax bias b_h"))

    #: stage 1 from the calibrated s_h on SmolLM2: 2e-2 overshot (layer error 0.037 -> 0.09 at step 5 and back),
    #: 5e-3 fell steadily (1e-3 to 2e-2 measured)
    transfer_learning_rate = 5e-3
    #: the anchor released: stage 1 starts at softmax (a = 1) with the calibrated s_h in place and ends at SSMax. Not
    #: walked by default: measured on SmolLM2 (docs/convert.md), it ends stage 1 further from the teacher than
    #: training the calibrated plain form from its first step (held-out layer error 0.028 against 0.022)
    continuation = Continuation(
        "ssmax_anchor", 1.0, note="(1 - a)(s_h ln n + b_h) + a with a from 1 (softmax) to 0", by_default=False,
        off_note="its calibrated start is already near the teacher (SmolLM2: layer error 0.037); releasing the anchor "
                 "over stage 1 ended further from it than training that start (0.028 against 0.022 after 20 steps)")

    def multiplier(self, n: torch.Tensor, ctx: Ctx) -> torch.Tensor | None:
        # (b_h always joins the graph, 0 in plain SSMax: a per-head value handed in is one the call uses)
        m = (ctx.heads["ssmax_s"].to(n.dtype).view(1, -1, 1) * torch.log(n)
             + ctx.heads["ssmax_bias"].to(n.dtype).view(1, -1, 1))
        anchor = float(ctx.settings.ssmax_anchor)
        return m if anchor == 0.0 else (1.0 - anchor) * m + anchor

    def calibrate(self, stats: TeacherStats, settings: AttnormSettings) -> Calibration:
        """With a learnable bias: s_h = 0, b_h = 1, softmax exactly. Without: the multiplier s_h ln n is 1
        (softmax) only on rows of n = e^(1/s_h) keys, so s_h is fitted to the teacher: s_h = sum V_i ln n_i /
        sum V_i (ln n_i)^2 minimises sum_i V_i (s_h ln n_i - 1)^2, the second-order KL of every row's softmax against
        its ssmax (V_i = the row's score variance, ``TeacherStats.weighted_ln_n``); 1/ln L (exact on rows of L keys)
        for a head whose rows are all flat."""
        heads = stats.lse_min.shape[0]
        if settings.ssmax_bias_learnable:
            return Calibration({"ssmax_s": torch.zeros(heads), "ssmax_bias": torch.ones(heads)},
                               "s_h = 0, b_h = 1: softmax exactly on every row (training moves s_h from 0)")
        if stats.max_n < 2:
            return Calibration({}, f"rows of {stats.max_n} key: ln n = 0, no s_h reproduces softmax")
        fallback = 1.0 / math.log(stats.max_n)
        fitted = stats.weighted_ln_n.float() / stats.weighted_ln2_n.float()
        s = torch.where(stats.weighted_ln2_n > 0, fitted, torch.full((heads,), fallback))
        return Calibration({"ssmax_s": s},
                           "s_h = sum V ln n / sum V (ln n)^2 (V = a row's score variance under softmax): the "
                           "multiplier s_h ln n is 1 only on rows of e^(1/s_h) keys, shorter rows flatter, longer "
                           f"sharper (1/ln L = {fallback:.4f} would be exact on rows of L = {stats.max_n}; exact "
                           "everywhere: --attnorm ssmax_bias_learnable=true)")
