"""stickbreaking: stick-breaking attention (Tan, Shen, Panda, Chen, Courville, Wang: "Scaling Stick-Breaking
Attention: An Efficient Implementation and In-depth Study", arXiv 2410.17980; reference code
github.com/shawntan/stickbreaking-attention).

Each key, from the one nearest the query backwards, breaks off a share beta_ij = sigmoid(z_ij) of what is left of a
unit stick::

    A_ij = beta_ij * prod_{j < k < i} (1 - beta_ik)                                   (j < i)
    log A_ij = logsigmoid(z_ij) - sum_{j < k < i} softplus(z_ik)                      (computed in log space)

so the keys nearest the query are served first and rows sum to 1 - prod_k (1 - beta_ik) <= 1 ("at_most_one").

Choices (all options, validated at load/set time):

* ``stickbreaking_attend_current`` (default False, the reference code's ``attend_current=False``): whether the
  query's own key breaks the stick too (``k <= i`` above instead of ``k < i``).
* ``stickbreaking_remainder`` (default True): the mass left on the stick, r_i = 1 - sum_j A_ij = exp(-sum_k
  softplus(z_ik)), goes to the query's own key (o_i += r_i v_i), as the paper's trained model and every reference
  test of the reference code do (``o = o + rem[..., None] * v``); its kernels return ``rem`` separately. With it
  rows sum to exactly 1; without it, to at most 1.
* ``stickbreaking_offset`` (default 0, the paper's) and ``stickbreaking_offset_learnable`` (default False): a
  per-head offset c_h subtracted from the scores before the stick breaks, beta_ij = sigmoid(z_ij - c_h). Softmax
  written as a stick broken from the nearest key has break logits z_ij - ln sum_{m<j} e^{z_im}, about z_ij - z_i0
  when an early "sink" key holds most of the row, so one offset per head near the row's logsumexp brings the
  weights close to softmax's.
* The paper keeps the model's 1/sqrt(d) (the reference passes ``inv_temp = 1/sqrt(d)``): ``uses_base_scaling`` stays
  True. Its models use no position embeddings; hf_attnorm does not remove a model's RoPE.

Key order and masks. "The query's own key" is the last key its row sees (key i for causal self-attention, key
Lk - 1 for a decode step against a cache); the stick is broken over the visible keys in decreasing position from
there. A masked key (padding) is skipped entirely: it neither receives weight nor breaks the stick (its softplus is
left out of every product). A row that sees no key gives 0 (no remainder either). For a non-causal call (a
bidirectional encoder) the same rule applies: every query breaks the stick from the last visible key of the
sequence backwards (a right-to-left order, not position-invariant); the paper's model is causal, and loading this
normalizer into a non-causal attention module warns (``hf/state.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import register_normalizer
from ..settings import AttnormSettings, declare_option
from .base import Ctx, Normalizer, ParamSpec, masked_fill_zero

SB_ATTEND_CURRENT = declare_option(
    "stickbreaking_attend_current", bool, False,
    "stickbreaking: the query's own key breaks the stick too (reference code's attend_current; default False)",
)
SB_REMAINDER = declare_option(
    "stickbreaking_remainder", bool, True,
    "stickbreaking: add the stick's remainder 1 - sum A to the query's own value, as the paper's model (default True)",
)

SB_OFFSET = declare_option(
    "stickbreaking_offset", float, 0.0,
    "stickbreaking: per-head offset c_h subtracted from the scores, beta = sigmoid(z - c_h) (default 0, the paper's)",
)
SB_OFFSET_LEARNABLE = declare_option(
    "stickbreaking_offset_learnable", bool, False,
    "stickbreaking: learn the offset c_h per head (initialised at stickbreaking_offset; else a constant)",
)


def uses_offset(settings: AttnormSettings) -> bool:
    """Whether the per-head offset can change the weights (learned, or a nonzero constant)."""
    return bool(settings.stickbreaking_offset_learnable) or float(settings.stickbreaking_offset) != 0.0


def own_key(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keep: bool [..., Lk] -> (index of each row's last visible key [..., 1] (-1 on rows with none), bool [..., Lk]
    marking that key)."""
    idx = torch.arange(keep.shape[-1], device=keep.device)
    last = torch.where(keep, idx, -1).amax(dim=-1, keepdim=True)
    return last, keep & (idx == last)


def idx_last(t: torch.Tensor) -> torch.Tensor:
    """bool [Lk]: the last position of t's last dim."""
    idx = torch.arange(t.shape[-1], device=t.device)
    return idx == t.shape[-1] - 1


def stickbreaking_weights(scores: torch.Tensor, keep: torch.Tensor, attend_current: bool,
                          remainder: bool) -> torch.Tensor:
    """Stick-breaking weights in log space. scores: [B, H, Lq, Lk] (scaled); keep: bool broadcastable to scores.
    Returns [B, H, Lq, Lk], exact zeros on masked keys and rows without a visible key."""
    keep = keep.expand_as(scores)
    _, own = own_key(keep)
    part = keep if attend_current else keep & ~own  # keys that break the stick
    z = masked_fill_zero(scores, part)  # garbage (inf/NaN) on masked keys never reaches a nonlinearity
    sp = masked_fill_zero(F.softplus(z), part)
    # sum over k > j of softplus(z_ik) for each j: the inclusive suffix sum shifted by one (no cancellation)
    incl = sp.flip(-1).cumsum(-1).flip(-1)
    # (a roll, not a slice and a cat: under torch.export a slice of Lk - 1 keys guards Lk != 2)
    after = torch.where(idx_last(incl), 0.0, torch.roll(incl, -1, dims=-1))
    w = masked_fill_zero(torch.exp(F.logsigmoid(z) - after), part)
    if remainder:
        w = w + masked_fill_zero(torch.exp(-incl[..., :1]), own)  # r_i = prod_k (1 - beta_ik) on the own key
    return w


@register_normalizer
class StickBreaking(Normalizer):
    name = "stickbreaking"
    paper = "Tan et al. 2024, Scaling Stick-Breaking Attention, https://arxiv.org/abs/2410.17980"
    description = "stick-breaking: A_ij = sigmoid(z_ij) prod_{j<k<i} (1 - sigmoid(z_ik)), nearest keys first"
    row_sum = "at_most_one"
    options = (SB_ATTEND_CURRENT, SB_REMAINDER, SB_OFFSET, SB_OFFSET_LEARNABLE)
    params = (ParamSpec("stickbreaking_offset", SB_OFFSET, SB_OFFSET_LEARNABLE, "per-head break offset c_h"),)
    kernel_family = "stickbreaking"
    #: weights depend on the keys' order (not only on the set of visible keys): see the module docstring
    key_order = True
    key_order_note = ("here every query breaks the stick from the last visible key of the sequence backwards (right "
                      "to left), which is not position-invariant")
    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        s = ctx.settings
        if uses_offset(s):  # (a constant 0, the paper's, is skipped here as in the kernels)
            scores = scores - ctx.head("stickbreaking_offset").to(scores.dtype)
        return stickbreaking_weights(scores, keep, bool(s.stickbreaking_attend_current),
                                     bool(s.stickbreaking_remainder))
