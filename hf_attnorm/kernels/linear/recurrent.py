"""Recurrent decode step of linear attention: O(D Dv) per step, independent of the number of cached keys.

Linear attention (normalizers/linear.py) is out_i = phi(q_i) S / phi(q_i) . z with S = sum_j phi(k_j) v_j^T and
z = sum_j phi(k_j) over the keys query i sees (Katharopoulos et al. 2020, arXiv:2006.16236, section 3.4: "transformers
are RNNs"). For a decode step (one query that sees every cached key) S and z over the cached keys are all it needs, so
a ``LinearState`` holding them turns the O(Lk D) step (phi of every cached key, one product per key) into adding one
key and two small products:

    m' = max(m, max phi(k_new)),  S' = S m / m' + phi(k_new) v_new^T / m',  z' = z m / m' + phi(k_new) / m'

with m a running maximum of the summed key features per (batch, kv head): ``feature_map`` divides phi(k) by the
maximum over the keys of a call to keep products away from underflow, and any per-(batch, head) constant cancels
in the weights, so the state keeps the keys at the scale of the running maximum and rescales the sums when it grows
(exactly the same weights, different rounding).

Who owns the state and when it is valid is the caller's business (``hf_attnorm.hf.recurrent`` keeps one per
transformers cache layer and passes it only when it covers exactly the first Lk - 1 cached keys): this path takes a
call only with ``AttnCall.recurrent`` set, and checks what it can from shapes alone (one query, Lk = length + 1, the
same batch, heads, head dims, dtype and settings). ``build_state`` makes a state from a call's keys (a prefill).
Key padding enters as the mask says when a key is added: masked keys are multiplied by 0 (their phi is not 0), and
the mask of a later step is not compared with the earlier ones (generation only appends visible keys).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ...normalizers.base import Ctx, Normalizer
from ...settings import AttnormSettings
from ..base import AttnCall, compute_dtype


@dataclasses.dataclass(eq=False)
class LinearState:
    """Sums over the first ``length`` keys of a cache, as one tensor sz [B, Hkv, F, Dv + 1] (compute dtype; F the
    feature dim, D for linear):
    sz[..., :Dv] = S = sum_j phi(k_j) v_j^T, sz[..., Dv] = z = sum_j phi(k_j) (one product then gives numerator and
    denominator), at the scale 1 / m with m [B, Hkv, 1, 1] the running maximum of phi(k) over those keys (``tiny``
    before any valid key); ``settings``: those of the calls it was built by (the key features depend on them)."""

    sz: torch.Tensor
    m: torch.Tensor
    length: int
    settings: AttnormSettings

    @property
    def s(self) -> torch.Tensor:
        return self.sz[..., :-1]

    @property
    def z(self) -> torch.Tensor:
        return self.sz[..., -1]


def takes(norm: Normalizer) -> str | None:
    if norm.kernel_family != "linear":
        return f"normalizer {norm.name!r} has no linear (scoreless) form (kernel_family {norm.kernel_family!r})"
    if not (callable(getattr(norm, "key_features", None)) and callable(getattr(norm, "query_features", None))):
        return (f"normalizer {norm.name!r} declares no key_features / query_features (the two sides of its feature "
                "map, the key side without its per-head rescaling)")
    return None


def accepts(call: AttnCall) -> str | None:
    st = call.recurrent
    if st is None:
        return ("no recurrent state for this call (one is kept per transformers DynamicCache layer and passed only "
                "when it holds exactly the cached keys before this step)")
    if call.q.shape[2] != 1:
        return f"{call.q.shape[2]} queries (a recurrent step takes one: a decode step)"
    if call.k.shape[2] != st.length + 1:
        return f"the state holds {st.length} keys, the call has {call.k.shape[2]} (needs exactly one more)"
    B = call.q.shape[0]
    Hkv, Dv = call.k.shape[1], call.v.shape[-1]
    dt = compute_dtype(call.q.dtype)
    # (its feature dim F is the feature map's, fixed by the settings compared below: D for linear, 2 D for hedgehog)
    if (st.sz.shape[:2], st.sz.shape[-1]) != ((B, Hkv), Dv + 1) or st.sz.dtype != dt or st.sz.device != call.q.device:
        return (f"the state is {list(st.sz.shape)} {st.sz.dtype} on {st.sz.device}; the call needs "
                f"[{B}, {Hkv}, F, {Dv + 1}] {dt} on {call.q.device}")
    if st.settings != call.settings:
        return "the state was built with other settings"
    if call.mask.selected:
        return ("the call selects keys per query (a sparse indexer's indices): the state sums every cached key, the "
                "selection leaves some out")
    if call.mask.padding() is None:
        return "the mask is not key padding (one query with a per-head mask)"
    if torch.is_grad_enabled() and (call.q.requires_grad or call.k.requires_grad or call.v.requires_grad):
        return "inputs require grad (a state kept across calls would hold their graph; decoding runs without grad)"
    return None


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in ``dtype`` (``Tensor.to`` costs microseconds even when there is nothing to do: 4 calls a step)."""
    return x if x.dtype == dtype else x.to(dtype)


def _transforms(norm: Normalizer) -> bool:
    """Whether the normalizer has a q/k transform (skipped otherwise: every op counts on a per-token path)."""
    return type(norm).transform_qk is not Normalizer.transform_qk


def _key_part(call: AttnCall, ctx: Ctx, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(phi(k) [B, Hkv, L, D] with masked keys 0, [v, 1] [B, Hkv, L, Dv + 1]) in ``dtype`` for keys k, values v
    [B, Hkv, L, *]; valid: bool [B|1, L] or None."""
    norm, k = call.normalizer, _as(k, dtype)
    if _transforms(norm):
        k = norm.transform_qk(_as(call.q, dtype), k, ctx)[1]  # row-wise: the same on any subset of the keys
    fk = norm.key_features(k, ctx)
    if valid is not None:
        fk = fk * valid[:, None, :, None].to(dtype)
    return fk, F.pad(_as(v, dtype), (0, 1), value=1.0)


def build_state(call: AttnCall) -> LinearState | None:
    """The state over every key of ``call`` (k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv]): O(Lk D Dv). None when the
    call's mask is not key padding x causal (``MaskInfo.padding``; queries of a later step see every earlier key
    that the mask keeps for some query), selects keys per query (``MaskInfo.selected``) or the inputs need grad."""
    if takes(call.normalizer) is not None or call.dropout > 0 or call.modifies_scores:
        return None
    if torch.is_grad_enabled() and (call.k.requires_grad or call.v.requires_grad):
        return None
    if call.mask.selected:  # (a later step's selection is its own: no sum over the cached keys describes it)
        return None
    padding = call.mask.padding()
    if padding is None:
        return None
    dt = compute_dtype(call.q.dtype)
    fk, v1 = _key_part(call, call.ctx(), call.k, call.v, padding[0], dt)
    m = fk.amax(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(dt).tiny)  # [B, Hkv, 1, 1]
    return LinearState((fk / m).transpose(-1, -2) @ v1, m, call.k.shape[2], call.settings)


def recurrent_attention(call: AttnCall) -> tuple[torch.Tensor, None]:
    """One decode step: adds the call's last key to ``call.recurrent`` (in place: the state then holds Lk keys) and
    returns out [B, H, 1, Dv] (input dtype) = phi(q) S / phi(q) . z, 0 when no cached key is visible."""
    st, ctx = call.recurrent, call.ctx()
    dt = st.sz.dtype
    key_valid = call.mask.padding()[0]
    valid = None if key_valid is None else key_valid[:, -1:]
    fk, v1 = _key_part(call, ctx, call.k[:, :, -1:], call.v[:, :, -1:], valid, dt)  # [B, Hkv, 1, D], [.., Dv + 1]
    m = torch.maximum(st.m, fk.amax(dim=(-2, -1), keepdim=True))
    # rescaled by m_old / m_new <= 1 (never through the raw scale, which underflows when every phi(k) is tiny)
    st.sz = st.sz * (st.m / m) + (fk / m).transpose(-1, -2) * v1  # outer product by broadcasting (cheaper than a
    # batched matmul of one key on CPU)
    st.m, st.length = m, st.length + 1
    norm, q = call.normalizer, _as(call.q, dt)
    if _transforms(norm):
        q = norm.transform_qk(q, _as(call.k[:, :, -1:], dt), ctx)[0]
    factor = call.q_factor(dt)
    fq = norm.query_features(q if isinstance(factor, float) and factor == 1.0 else q * factor, ctx)
    B, H, _, D = fq.shape
    Hkv = st.sz.shape[1]
    nd = fq.reshape(B, Hkv, H // Hkv, D) @ st.sz  # the G query heads of a kv head as one matrix: [B, Hkv, G, Dv + 1]
    # den = phi(q) . z is 0 with no visible key (or when it underflows), and num = phi(q) S is then 0 too: the clamp
    # gives 0 instead of 0/0, as the safe_divide of the other paths does, in one op on this per-token path
    out = nd[..., :-1] / nd[..., -1:].clamp_min(torch.finfo(dt).tiny)
    return _as(out.reshape(B, H, 1, -1), call.q.dtype), None


from ..dispatch import register_path  # noqa: E402  (registration at import, like the normalizers)

register_path("linear_recurrent", recurrent_attention, takes=takes, accepts=accepts, priority=45)
