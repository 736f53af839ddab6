"""selective: softmax over scores minus a selection penalty accumulated over earlier queries (Leviathan, Kalman,
Matias, "Selective Attention Improves Transformer", arXiv 2410.02703, section 3 and its code listing).

With S = the scores of one head (the paper: head 0; option ``selective_head``), already scaled:

    R_kj = relu(S_kj) for visible (k, j), 0 for j = BOS and for j = k (a query never masks itself, nor BOS)
    F_ij = sum_{k < i} R_kj                       (exclusive: the paper's roll(cumsum(R, -2), 1, -2), row 0 = 0)
    w_i  = softmax_j(s_ij - F_ij)  over the visible keys, for EVERY head (one F shared by the heads)

A query k "selects" key j (reduces its attention from every later query) by a positive score. Parameter-free.
Choices where the paper is silent (documented in docs/kernels.md):

* the gradient flows through F (the paper and x-transformers' ``selective_attn`` do not detach it);
* GQA: the selecting head is a query head (its key is its kv head's);
* "self": query i is at key position i + Lk - Lq (the last query is the last key, as in cached decoding);
* padding: a key no query sees is dead; BOS is the first live key of each sequence (key 0 without padding, the first
  real token with left padding); a query whose own key is dead (a padded position) selects nothing, and masked
  entries select nothing, so padding changes no live position's output;
* packing (several documents in one row, a block-diagonal mask: ``document_starts``): every document's first key is
  a BOS, so a packed document gets exactly the output it gets alone;
* the accumulation runs over the queries of the call in order, for any mask (a bidirectional call is defined the
  same way: earlier queries penalise keys for later ones). A call after earlier ones (a cached decode step, a chunked
  prefill) gets what the earlier queries accumulated, the column sums C_j = sum_{earlier k} R_kj, as
  ``ctx.selective_carry`` [B, Lk] (``AttnCall.selective_carry``): F = C + the in-call exclusive cumsum. The
  transformers integration keeps C on the KV cache (hf/selective_cache.py), so cached generation is exact.

scores: [B, H, Lq, Lk]; keep broadcastable to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import AttnormError, register_normalizer
from ..settings import AttnormSettings, declare_option, nonnegative
from .base import Ctx, Normalizer, masked_max, safe_divide
from .softmax import masked_exp

SELECTIVE_HEAD = declare_option("selective_head", int, 0, "selective: the query head whose scores select "
                                "(the paper: 0)", check=nonnegative)


def document_starts(keep_sel: torch.Tensor) -> torch.Tensor:
    """The BOS keys, bool [b, Lk], from the selecting head's visibility keep_sel: bool [b, Lq | 1, Lk].

    Key j starts a document when some query sees it and every query that sees it sees no key before it. Without
    packing that is the first live key only (key 0, or the first real token after left padding; a sliding window or
    a cached call adds none: a query that sees a later key also sees an earlier one). With packing (transformers'
    ``sdpa_mask`` turns ``position_ids`` restarting per document, with no attention mask and no cache, into a
    block-diagonal mask) it is the first key of every document, so a packed document equals the same document
    alone."""
    lk = keep_sel.shape[-1]
    j = torch.arange(lk, device=keep_sel.device)
    first = keep_sel.to(torch.int8).argmax(dim=-1)  # [b, Lq | 1]: each query's first visible key (0 when none)
    sees_earlier = keep_sel & (first[..., None] != j)  # the query sees j and a key before it
    return keep_sel.any(dim=-2) & ~sees_earlier.any(dim=-2)


def selection_parts(keep_sel: torch.Tensor, lq: int, lk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keep_sel: bool [b, Lq | 1, Lk] (the selecting head's visibility) -> (live [b, Lk]: keys some query sees,
    selects [b, Lq, Lk]: bool, where relu(S) may select: visible, not a BOS (``document_starts``), not the query's
    own key, and the query's own key live)."""
    live = keep_sel.any(dim=-2)  # [b, Lk]
    starts = document_starts(keep_sel)  # [b, Lk]
    j = torch.arange(lk, device=keep_sel.device)
    own = torch.arange(lq, device=keep_sel.device) + (lk - lq)  # query i's own key position
    # [b, Lq] (logical ops, not a where on bools: onnxruntime has no bool Where)
    own_live = (own < 0) | (own >= lk) | live[:, own.clamp(0, lk - 1)]
    selects = keep_sel & ~starts[:, None, :] & (j[None, :] != own[:, None])[None] & own_live[..., None]
    return live, selects


def selection_penalty(s_sel: torch.Tensor, keep_sel: torch.Tensor) -> torch.Tensor:
    """F [B, Lq, Lk] from the selecting head's scores s_sel [B, Lq, Lk] and its visibility keep_sel
    [b, Lq | 1, Lk]: F_ij = sum_{k < i} relu(S_kj) over the selecting entries (module docstring)."""
    lq, lk = s_sel.shape[-2:]
    _, selects = selection_parts(keep_sel, lq, lk)
    r = torch.where(selects, F.relu(s_sel), torch.zeros((), dtype=s_sel.dtype, device=s_sel.device))
    # exclusive: row i sums rows k < i (a roll, as the paper's listing: a slice of Lq - 1 rows guards Lq != 2 under
    # torch.export)
    first_row = (torch.arange(lq, device=r.device) == 0)[:, None]
    return torch.where(first_row, 0.0, torch.roll(torch.cumsum(r, dim=-2), 1, dims=-2))


def check_carry(carry: torch.Tensor, batch: int, lk: int) -> torch.Tensor:
    """The carry of a cached step (``AttnCall.selective_carry``), float [B | 1, Lk]; a clear error otherwise."""
    if carry.dim() != 2 or carry.shape[0] not in (1, batch) or carry.shape[1] != lk or not carry.is_floating_point():
        raise ValueError(f"selective_carry must be a float tensor [B={batch}, Lk={lk}] (the earlier queries' column "
                         f"sums per key); got {carry.dtype} {list(carry.shape)}")
    return carry


def head_keep(keep: torch.Tensor, head: int, batch: int, lq: int, lk: int) -> torch.Tensor:
    """The selecting head's visibility [b, Lq | 1, Lk] from a keep-mask broadcastable to [B, H, Lq, Lk]."""
    k = keep[:, head] if keep.shape[1] > 1 else keep[:, 0]
    return k.expand(k.shape[0], k.shape[1], lk)


@register_normalizer
class Selective(Normalizer):
    name = "selective"
    paper = "Leviathan et al. 2024, Selective Attention, https://arxiv.org/abs/2410.02703"
    description = ("selective attention (Leviathan et al. 2024): softmax(s - F), F = earlier queries' relu'd scores"
                   " of one head")
    row_sum = "one"
    options = (SELECTIVE_HEAD,)
    query_coupled = True
    continuous_batching = "refused"
    continuous_batching_note = (
        "selective attention subtracts from each query's scores what every earlier query of its sequence selected, "
        "and continuous batching does not keep those queries: prefix sharing and chunked prefill skip them and "
        "decoding steps drop them (the paged cache holds keys and values only)")

    def selecting_head(self, settings: AttnormSettings) -> int:
        """The query head whose scores select (kernels/selective/blocked.py reads this)."""
        return int(settings.selective_head)

    def check_heads(self, settings: AttnormSettings, num_heads: int) -> None:
        if settings.selective_head >= num_heads:
            raise AttnormError(f"attnorm option 'selective_head' (used by normalizer 'selective') is "
                               f"{settings.selective_head} but the attention has {num_heads} query heads; "
                               f"allowed: 0..{num_heads - 1}")

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        B, H, Lq, Lk = scores.shape
        h = self.selecting_head(ctx.settings)
        keep = keep.to(scores.device)
        carry = ctx.selective_carry
        if carry is not None:
            carry = check_carry(carry, B, Lk).to(scores.dtype)
        if Lq == 1:  # one query has no earlier query in its call (a decode step): F = the carry alone
            z = scores if carry is None else scores - carry[:, None, None, :]
        else:
            pen = selection_penalty(scores[:, h], head_keep(keep, h, B, Lq, Lk))
            if carry is not None:  # a cached step: what the earlier calls' queries accumulated per key
                pen = pen + carry[:, None, :]
            z = scores - pen[:, None]
        e = masked_exp(z, keep, masked_max(z, keep))
        return safe_divide(e, e.sum(dim=-1, keepdim=True))
