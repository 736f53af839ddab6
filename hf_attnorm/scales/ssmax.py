"""ssmax: Scalable-Softmax, scaling * (s_h * ln n + b_h) with s_h learnable per head (Nakanishi 2025, arXiv
2501.19399). b_h is the paper's bias variant ("SSMax with bias", s log n + b, per layer and head): 0 and constant by
default (the plain s_h * ln n); ``ssmax_bias_learnable=true`` makes it a per-head value, which admits softmax
exactly (s_h = 0, b_h = 1) and the anchored form 1 + s_h (ln n - ln L) (b_h = 1 - s_h ln L). ``ssmax_anchor`` a mixes
softmax's multiplier in, (1 - a)(s_h ln n + b_h) + a: a = 1 is softmax whatever s_h and b_h are, a = 0 plain SSMax."""

from __future__ import annotations

import torch

from ..normalizers.base import Ctx, ParamSpec
from ..registry import register_scale
from ..settings import declare_option
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
                              "SSMax, the default; 1 = softmax)",
                              check=lambda v: None if 0.0 <= v <= 1.0 else "must be in [0, 1]")


@register_scale
class SSMax(Scale):
    name = "ssmax"
    paper = "Nakanishi 2025, Scalable-Softmax Is Superior for Attention, https://arxiv.org/abs/2501.19399"
    description = "scaling * (s_h * ln n + b_h), s_h per head (learnable), b_h = 0 unless the bias variant is on"
    options = (SSMAX_S, SSMAX_LEARNABLE, SSMAX_BIAS, SSMAX_BIAS_LEARNABLE, SSMAX_ANCHOR)
    params = (ParamSpec("ssmax_s", SSMAX_S, SSMAX_LEARNABLE, "per-head SSMax factor s_h"),
              ParamSpec("ssmax_bias", SSMAX_BIAS, SSMAX_BIAS_LEARNABLE, "per-head SSMax bias b_h"))

    def multiplier(self, n: torch.Tensor, ctx: Ctx) -> torch.Tensor | None:
        # (b_h always joins the graph, 0 in plain SSMax: a per-head value handed in is one the call uses)
        m = (ctx.heads["ssmax_s"].to(n.dtype).view(1, -1, 1) * torch.log(n)
             + ctx.heads["ssmax_bias"].to(n.dtype).view(1, -1, 1))
        anchor = float(ctx.settings.ssmax_anchor)
        return m if anchor == 0.0 else (1.0 - anchor) * m + anchor
