"""What a KV cache keeps for selective attention (``normalizers/selective.py``) so that later calls are exact: the
running column sums C [B, Lk] of the selecting head's selecting entries R (its relu'd scores where a query may select:
visible, not BOS, not the query's own key, the query's own key live) over every query processed so far.

A call's penalty is F = carry + the exclusive cumsum of its own R over its queries (``AttnCall.selective_carry``,
taken by the ``selective``, ``decode`` and ``reference`` paths), so after the call C = carry + ``column_sums(call)``.
``column_sums`` is a separate pass over the selecting head only, q_h k_h^T in query blocks: O(Lq Lk d) time for one
head (1/H of the attention's), O(block Lk) memory, no gradient (the cache is for generation), and it leaves the
training kernels untouched. ``prefix_column_sums`` recomputes C for a prefix of the positions from what the cache
stores per position (the selecting head's q' and k' and which keys are live), for a cropped cache (assisted
decoding): the same rule under key padding x causal visibility, the pattern generation builds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...normalizers.base import Normalizer
from ..base import AttnCall, compute_dtype
from .blocked import _Plan, block_size


def _identity_features(norm: Normalizer) -> bool:
    """Whether q' and k' of one head are q times its factor and k as they come (no transform, no feature map)."""
    return (type(norm).transform_qk is Normalizer.transform_qk
            and type(norm).feature_map is Normalizer.feature_map)


def selecting_features(call: AttnCall, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The selecting head's (q' [B, Lq, D], k' [B, Lk, D]) in the compute dtype, as the paths form the scores
    (s_h = q' k'^T): without the other heads' work or GQA copies when the normalizer has no q/k transform."""
    dt = dtype or compute_dtype(call.q.dtype)
    norm = call.normalizer
    h = norm.selecting_head(call.settings)
    if not _identity_features(norm):
        q, k, _ = call.features(dt)
        return q[:, h], k[:, h]
    q = call.q[:, h].to(dt)
    f = call.q_factor(dt)
    if isinstance(f, torch.Tensor):
        q = q * f[:, h if f.shape[1] > 1 else 0]
    elif f != 1.0:
        q = q * f
    return q, call.k[:, h // call.groups].to(dt)


def column_sums(call: AttnCall) -> torch.Tensor:
    """sum over the call's queries of R, float [B, Lk] in the compute dtype (module docstring); the call must carry
    no score modifier (the transformers integration refuses those on cached steps)."""
    return column_sums_and_parts(call)[0]


@torch.no_grad()
def column_sums_and_parts(call: AttnCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(column sums [B, Lk], the selecting head's q' [B, Lq, D] and k' [B, Lk, D], live keys bool [b, Lk]): what a
    cache stores after a call, each formed once."""
    if call.modifies_scores:
        raise ValueError("selective column sums with score modifiers (bias, soft-cap, sinks) are not implemented")
    qh, kh = selecting_features(call)
    if qh.shape[1] == 1:
        sums, live = _one_query_sums(call, qh, kh)
        return sums, qh, kh, live
    plan = _Plan(call)
    B, lq = qh.shape[:2]
    out = qh.new_zeros(B, plan.lk)
    blk = block_size(B, 1, plan.lk)
    zero = torch.zeros((), dtype=qh.dtype, device=qh.device)
    for i0 in range(0, lq, blk):
        i1 = min(i0 + blk, lq)
        keys = plan.keys(i1)
        sel = plan.selects(plan.keep(i0, i1, keys, qh.device), i0, i1, keys)
        s = qh[:, i0:i1] @ kh[:, :keys].transpose(-1, -2)
        out[:, :keys] += torch.where(sel, F.relu(s), zero).sum(dim=1)
    return out, qh, kh, plan.live


def one_query_live(call: AttnCall) -> torch.Tensor:
    """bool [b, Lk]: the keys the one query of a call sees (its live keys: no other query sees any)."""
    keep = call.mask.keep
    if keep is None:  # one query without a mask sees every key
        return torch.ones((), dtype=torch.bool, device=call.q.device).expand(1, call.k.shape[2])
    h = call.normalizer.selecting_head(call.settings)
    return keep[:, h if keep.shape[1] > 1 else 0, 0]


def _one_query_sums(call: AttnCall, qh: torch.Tensor, kh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R of a one-query call [B, Lk], its live keys [b, Lk]): the general rule with Lq = 1 in a few in-place ops
    (a decode step's per-token cost): R = relu(s) on the visible keys but BOS (the first visible) and the query's
    own key (the last), and no R at all when that own key is not visible."""
    r = F.relu_((qh @ kh.transpose(-1, -2))[:, 0])  # [B, Lk]
    live = one_query_live(call)
    if call.mask.keep is None:
        r[:, 0] = 0
    else:
        r.masked_fill_(~live, 0)
        r.masked_fill_(~live[:, -1:], 0)  # the own key is padding: it selects nothing
        bos = live.to(torch.int8).argmax(dim=-1, keepdim=True)  # [b, 1]
        r.scatter_(1, bos.expand(r.shape[0], 1), 0)
    r[:, -1] = 0
    return r, live


@torch.no_grad()
def prefix_column_sums(qs: torch.Tensor, ks: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """C [B, L] over positions 0..L-1 from what a cache stores per position: qs, ks [B, L, D] (the selecting head's
    q' and k'; zero rows where no query was), live bool [B, L]. Query i sees key j iff j <= i and j is live (key
    padding x causal); R_ij enters when i is live, j is not BOS (the first live key) and j != i."""
    B, L, _ = qs.shape
    out = qs.new_zeros(B, L)
    bos = live.to(torch.int8).argmax(dim=-1)  # [B]
    j = torch.arange(L, device=qs.device)
    col_ok = live & (j[None] != bos[:, None])  # [B, L]
    zero = torch.zeros((), dtype=qs.dtype, device=qs.device)
    blk = block_size(B, 1, L)
    for i0 in range(0, L, blk):
        i1 = min(i0 + blk, L)
        i = torch.arange(i0, i1, device=qs.device)
        sel = (col_ok[:, None, :i1] & (j[None, None, :i1] < i[None, :, None]) & live[:, i0:i1, None])
        s = qs[:, i0:i1] @ ks[:, :i1].transpose(-1, -2)
        out[:, :i1] += torch.where(sel, F.relu(s), zero).sum(dim=1)
    return out
