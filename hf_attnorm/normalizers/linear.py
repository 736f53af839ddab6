"""linear: linear attention (Katharopoulos et al. 2020), phi(q_i).phi(k_j) / sum_j phi(q_i).phi(k_j) with the
feature map phi = elu + 1.

The length-aware scale multiplies q before the feature map (the model's 1/sqrt(d) is not applied: the linear
transformer has none). Besides the materialised reference, ``linear_attention`` computes the same output in O(n)
time and memory: chunks of ``chunk`` queries attend to their own chunk quadratically and to everything before it
through a running state sum_j phi(k_j) v_j^T, so no n x n tensor exists. Decoding keeps that state across calls
(the paper's RNN form, arXiv:2006.16236 section 3.4): ``query_features`` and ``key_features`` are the two sides of
``feature_map`` for kernels/linear/recurrent.py, which adds one key per step to a state kept on the cache.
"""

from __future__ import annotations

import torch

from ..registry import register_normalizer
from .base import Ctx, Normalizer, masked_fill_zero, safe_divide


def elu_feature(x: torch.Tensor) -> torch.Tensor:
    """elu(x) + 1, computed as x + 1 (x > 0) or e^x (x <= 0): F.elu(x) + 1 = (e^x - 1) + 1 rounds to 0 below x ~ -37
    in fp64 (-17 in fp32), which would turn rows into 0/0. Written as exp(x - relu(x)) + relu(x) (the same values, and
    the gradient 1 at x = 0 on every torch: relu's gradient at 0 is 0 everywhere, while clamp's at its bound changed
    in torch 2.14) because torch.where is several times slower than exp on CPU (it is on every decode step)."""
    pos = torch.relu(x)
    return torch.exp(x - pos) + pos


@register_normalizer
class Linear(Normalizer):
    name = "linear"
    paper = "Katharopoulos et al. 2020, Transformers are RNNs, https://arxiv.org/abs/2006.16236"
    description = ("linear attention, phi = elu+1, causal via running sums (O(n)); decode from a recurrent state "
                   "(O(1) per token)")
    row_sum = "one"
    uses_base_scaling = False
    scoreless = True
    kernel_family = "linear"
    continuous_batching = "packed"
    continuous_batching_note = (
        "runs without its recurrent decode state (kept on a transformers Cache, which the paged cache is not): "
        "every step recomputes over the gathered keys, exactly, at O(keys) per token instead of O(1)")

    def feature_map(self, q: torch.Tensor, k: torch.Tensor, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
        # The weights phi(q_i).phi(k_j) / sum_j phi(q_i).phi(k_j) do not change when phi(q_i) is divided by any
        # per-query constant or phi(k) by a per-head constant: dividing by the (detached) maxima keeps every
        # product away from underflow (elu + 1 = e^x for x < 0), so large negative scores still give rows that
        # sum to 1 instead of 0/0.
        fk = elu_feature(k)
        fk = fk / fk.detach().amax(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(fk.dtype).tiny)
        return self.query_features(q, ctx), fk

    def query_features(self, q: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        """phi(q) [..., D] divided by its own (detached) maximum per query: the query side of ``feature_map``."""
        fq = elu_feature(q)
        return fq / fq.detach().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(fq.dtype).tiny)

    def key_features(self, k: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        """phi(k) [..., D] without ``feature_map``'s division by the per-(batch, head) maximum (a constant that
        cancels in the weights): what a recurrent state accumulates key by key (kernels/linear/recurrent.py keeps
        its own running maximum instead, so adding a key never changes the scale of the keys already summed)."""
        return elu_feature(k)

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        a = masked_fill_zero(scores, keep)  # phi > 0, so scores > 0 on visible keys
        return safe_divide(a, a.sum(dim=-1, keepdim=True))


def linear_attention(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    offset: int = 0,
    key_valid: torch.Tensor | None = None,
    query_valid: torch.Tensor | None = None,
    chunk: int = 128,
) -> torch.Tensor:
    """O(n) linear attention on feature-mapped inputs.

    fq: [B, H, Lq, D], fk: [B, H, Lk, D] (already phi-mapped, positive), v: [B, H, Lk, Dv].
    causal: query i sees keys j <= i + offset (offset = Lk - Lq for a cache, 0 for SDPA's top-left alignment);
    otherwise every key. key_valid: bool [B, Lk] (padding), query_valid: bool [B, Lq] (rows to zero).
    Returns [B, H, Lq, Dv]; rows that see no valid key are 0.
    """
    B, H, Lq, D = fq.shape
    Lk = fk.shape[2]
    if key_valid is not None:
        kv = key_valid[:, None, :, None].to(fk.dtype)
        fk, v = fk * kv, v * kv
    if not causal:
        state = torch.einsum("bhkd,bhke->bhde", fk, v)
        z = fk.sum(dim=2)  # [B, H, D]
        num = torch.einsum("bhqd,bhde->bhqe", fq, state)
        den = torch.einsum("bhqd,bhd->bhq", fq, z).unsqueeze(-1)
        out = safe_divide(num, den)
    else:
        outs = []
        # keys visible to every query: j < offset + 1 of the first query's window start
        state = fq.new_zeros(B, H, D, v.shape[-1])
        z = fq.new_zeros(B, H, D)
        consumed = 0  # keys folded into the running state
        for start in range(0, Lq, chunk):
            stop = min(start + chunk, Lq)
            first_key = max(0, min(start + offset, Lk))  # keys [0, first_key) are visible to the whole chunk
            if first_key > consumed:
                ks, vs = fk[:, :, consumed:first_key], v[:, :, consumed:first_key]
                state = state + torch.einsum("bhkd,bhke->bhde", ks, vs)
                z = z + ks.sum(dim=2)
                consumed = first_key
            last_key = max(0, min(stop - 1 + offset + 1, Lk))  # exclusive bound for the chunk's last query
            qc = fq[:, :, start:stop]
            num = torch.einsum("bhqd,bhde->bhqe", qc, state)
            den = torch.einsum("bhqd,bhd->bhq", qc, z)
            if last_key > consumed:
                kc, vc = fk[:, :, consumed:last_key], v[:, :, consumed:last_key]
                s = torch.einsum("bhqd,bhkd->bhqk", qc, kc)
                qi = torch.arange(start, stop, device=fq.device)[:, None] + offset
                kj = torch.arange(consumed, last_key, device=fq.device)[None, :]
                s = masked_fill_zero(s, kj <= qi)
                num = num + torch.einsum("bhqk,bhke->bhqe", s, vc)
                den = den + s.sum(dim=-1)
            outs.append(safe_divide(num, den.unsqueeze(-1)))
        out = torch.cat(outs, dim=2)
    if query_valid is not None:
        out = masked_fill_zero(out, query_valid[:, None, :, None])
    return out
