"""What every kernel receives: one attention call, fully resolved."""

from __future__ import annotations

import dataclasses

import torch

from ..masks import MaskInfo, build_mask_info
from ..normalizers.base import Ctx, Normalizer
from ..registry import NORMALIZERS, SCALES
from ..settings import AttnormSettings


@dataclasses.dataclass(frozen=True)
class Around:
    """What a call of the 2025 variants needs around the path that runs it (``AttnCall.around``, applied by
    kernels/variants.py's ``attend``): ``gate``: gated attention's output gate [B, H, Lq, Dv] in fp32 or fp64 (rows
    of the caller's queries), multiplied into the output; ``memory``/``drop_queries``: learned memory's leading keys
    and zero query rows in the call (kernels/memory.py), dropped from what the path returns; ``differential``: the
    call runs as its two halves, combined by the normalizer."""

    gate: torch.Tensor | None = None
    memory: int = 0
    drop_queries: int = 0
    differential: bool = False


@dataclasses.dataclass
class AttnCall:
    """One attention call.

    q: [B, H, Lq, D]; k, v: [B, Hkv, Lk, D] / [B, Hkv, Lk, Dv] with H a multiple of Hkv (GQA: kernels repeat or
    index k/v themselves); mask: visibility and n; base: the model's scaling (1.0 for normalizers that opt out);
    multiplier: float [B or 1, 1 or H, Lq] = scale(n) x per-head factors, or None for 1; heads: per-head values [H];
    dropout: probability on the weights (training); need_weights: return the weights [B, H, Lq, Lk].

    Score modifiers (None = absent), applied in this order to the scaled scores s = q' @ k'^T before the
    normalizer: softcap c: s = c tanh(s / c) (Gemma2); bias: s = s + bias, float broadcastable to [B, H, Lq, Lk]
    (T5's position_bias, ALiBi, the values of a float mask); sinks: float [H], an always-visible extra key with
    logit sinks[h] and value 0 (transformers' ``s_aux``, GPT-OSS), so for softmax w_j = e^s_j / (e^sink + sum e^s).
    alibi_slopes: float [H], ALiBi's bias -slopes[h] |(Lk - Lq + i) - j| added with ``bias``, left unmaterialised
    for the kernels that compute it in place (fused_cpu, triton); the other paths add ``score_bias()``.

    Learned memory key/values (``kernels/memory.py``) are already part of k/v/mask: the leading ``around.memory``
    keys are memory and the leading ``around.drop_queries`` query rows are zero queries, which ``attend`` drops from
    what the path returns (kernels/variants.py).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: MaskInfo
    settings: AttnormSettings
    heads: dict[str, torch.Tensor]
    base: float
    multiplier: torch.Tensor | None
    dropout: float = 0.0
    need_weights: bool = False
    module_info: dict = dataclasses.field(default_factory=dict)
    bias: torch.Tensor | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None
    #: a recurrent state of the cached keys (``linear.recurrent.LinearState``), set by the transformers integration
    #: on decode steps when a cache holds one; None for every other call
    recurrent: object | None = None
    #: query-coupled normalizers (selective attention): float [B, Lk], per key the sum over the queries of EARLIER
    #: calls (a KV cache's) of what they accumulated (the selecting head's relu'd scores; 0 for this call's new keys),
    #: the initial carry of the penalty F = carry + the in-call exclusive cumsum. Set by the transformers integration
    #: on cached steps (hf/selective_cache.py); None: no earlier queries. Only the paths that declare it (selective,
    #: decode, reference) may take a call carrying it; every other path must decline it.
    selective_carry: torch.Tensor | None = None
    #: forgetting attention (a normalizer's ``forget_gates``): float [B, H, Lk], the cumulative log forget gates
    #: c_j = sum_{l <= j} log f_l over the keys in order, in float64, autograd-connected to what the gates read.
    #: Adds F_ij = -|c_{p_i} - c_j| to the scores, p_i = Lk - Lq + i the query's own key (for a causal row the
    #: paper's sum_{l=j+1..i} log f_l). Only the paths supporting ``forget`` take a call carrying it
    #: (reference, chunked, decode, sdpa, triton_forget); ``score_bias()`` materialises it for those that add a bias
    #: tensor.
    forget: torch.Tensor | None = None
    #: the normalizer's (row-wise) key transform of ``k``, [B, Hkv, Lk, D] in ``compute_dtype(q.dtype)``, kept on
    #: the cache across decoding (hf/key_cache.py: cosine's normalised keys): a path that transforms q/k may take
    #: the keys from here and transform q only; every other path computes from ``k`` (the same values). None: not kept
    k_transformed: torch.Tensor | None = None
    #: what ``attend`` does around the path that runs the call (learned memory, gated and differential attention:
    #: kernels/variants.py); None: nothing. The dispatcher and the paths never read it
    around: Around | None = None

    @property
    def modifies_scores(self) -> bool:
        """Any score modifier present (paths that only form plain scores must decline)."""
        return (self.bias is not None or self.softcap is not None or self.sinks is not None
                or self.alibi_slopes is not None or self.forget is not None)

    def score_bias(self, with_forget: bool = True) -> torch.Tensor | None:
        """The whole additive score bias, broadcastable to [B, H, Lq, Lk]: ``bias`` plus the materialised ALiBi
        bias [1, H, Lq, Lk] when slopes are carried and the forget bias [B, H, Lq, Lk] of forgetting attention (for
        the paths that add a bias tensor; ``with_forget=False``: without it, for a path that adds it per block)."""
        bias = self.bias
        if self.alibi_slopes is not None:
            alibi = alibi_bias(self.alibi_slopes, self.q.shape[2], self.k.shape[2])
            bias = alibi if bias is None else bias + alibi
        if self.forget is not None and with_forget:
            decay = forget_bias(self.forget, self.q.shape[2])
            bias = decay if bias is None else bias + decay
        return bias

    @property
    def normalizer(self) -> Normalizer:
        return NORMALIZERS.get(self.settings.normalizer)

    @property
    def needs_grad(self) -> bool:
        """Autograd is on and an input of the call (q, k, v, a per-head value, the bias, the forget gates) needs a
        gradient: flags only, nothing is read."""
        return torch.is_grad_enabled() and any(
            t is not None and t.requires_grad
            for t in (self.q, self.k, self.v, self.bias, self.forget, *self.heads.values()))

    @property
    def groups(self) -> int:
        return self.q.shape[1] // self.k.shape[1]

    def ctx(self) -> Ctx:
        return Ctx(self.settings, self.heads, self.q.shape[-1], self.mask.n, self.module_info, self.k.shape[2],
                   self.selective_carry)

    def q_factor(self, dtype: torch.dtype) -> torch.Tensor | float:
        """What q is multiplied by before the feature map: base x multiplier, as [B|1, H|1, Lq, 1] or a float."""
        if self.multiplier is None:
            return self.base
        return (self.multiplier.to(dtype) * self.base).unsqueeze(-1)

    def features(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q', k', v) [B, H, L, *] in ``dtype``, k/v repeated for GQA: the normalizer's q/k transform, q times
        base x multiplier, then its feature map, so that scores = q' @ k'^T (the paths that form scores themselves)."""
        norm, ctx = self.normalizer, self.ctx()
        q, k = self.q.to(dtype), repeat_kv(self.k, self.groups).to(dtype)
        q, k = norm.transform_qk(q, k, ctx)
        q, k = norm.feature_map(q * self.q_factor(dtype), k, ctx)
        return q, k, repeat_kv(self.v, self.groups).to(dtype)

    def row_value(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The normalizer's declared per-row constant (``Normalizer.row_value``: symax |eta_h|, sigmoid's bias,
        relu_len 1/n) on q's device, broadcastable to [B, H, Lq]; None for maps without one."""
        r = self.normalizer.row_value(self.ctx(), dtype)
        return None if r is None else r.to(self.q.device)


def query_factor(settings: AttnormSettings, q: torch.Tensor, ctx: Ctx) -> torch.Tensor | None:
    """The per-query multiplier of a call, [B|1, H|1, Lq] or None (``AttnCall.multiplier``): the scale's multiplier
    of n = ``ctx.n``, times the normalizer's per-head multiplier and its per-query multiplier from the raw queries
    q [B, H, Lq, D]."""
    norm, sc = NORMALIZERS.get(settings.normalizer), SCALES.get(settings.scale)
    mult = sc.multiplier(ctx.n, ctx)
    head_factor = norm.head_multiplier(ctx)
    if head_factor is not None:
        hf = head_factor.view(1, -1, 1)
        mult = hf if mult is None else mult * hf
    per_query = norm.query_multiplier(q, ctx)  # [B, H, Lq] from the raw query (ASEntmax)
    if per_query is not None:
        mult = per_query if mult is None else mult * per_query
    return mult


def factored_query(q: torch.Tensor, mult: torch.Tensor | None, base: float) -> tuple[torch.Tensor, float]:
    """(q, scale) for a kernel that scales its scores by ``scale``: q [B, H, Lq, D] times base x multiplier
    ([B|1, H|1, Lq], ``query_factor``) with scale 1, or q as it is with scale ``base`` when there is no multiplier
    (what the paths do with ``AttnCall.q_factor``; the direct entries of planned calls share it)."""
    if mult is None:
        return q, base
    return q * (mult.to(q.dtype) * base).unsqueeze(-1), 1.0


def one_query_ctx(settings: AttnormSettings, heads: dict[str, torch.Tensor], q: torch.Tensor, lk: int,
                  module_info: dict) -> Ctx:
    """The ``Ctx`` that ``make_call`` resolves for a call of one query per head, q [B, H, 1, D], against ``lk``
    keys without a mask or learned memory: every row sees the ``lk`` keys (n = lk, the mask facts' own tensor). For
    the direct entries of planned decode steps (``kernels.Direct``)."""
    mask = build_mask_info(None, q.shape[0], q.shape[1], 1, lk, False, q.device)
    return Ctx(settings, heads, q.shape[-1], mask.n, module_info, lk)


def has_query_factor(settings: AttnormSettings) -> bool:
    """Whether calls of ``settings`` may carry a per-query multiplier: a scale other than the standard one, or a
    normalizer with a per-head or per-query multiplier (by their classes, not by any call's n)."""
    norm, sc = NORMALIZERS.get(settings.normalizer), SCALES.get(settings.scale)
    standard = type(SCALES.get("standard")).multiplier
    return (type(sc).multiplier is not standard
            or type(norm).head_multiplier is not Normalizer.head_multiplier
            or type(norm).query_multiplier is not Normalizer.query_multiplier)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, L, D] -> [B, Hkv * groups, L, D] (head h uses kv head h // groups, as transformers)."""
    if groups == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


#: from this many keys a one-query CPU call runs ``one_query_softmax`` rather than SDPA's CPU flash kernel, which
#: walks the keys in blocks per (batch, head) row: with one query row per head, two matrix products over all keys
#: and one softmax do the same work in fewer, larger steps. Alone the form is faster from about 2,048 keys (1.1-1.3x
#: there, 1.5-1.8x at 8,192 on 2 threads), but in whole decode steps of a tiny Llama, where each layer's keys come
#: from memory, only from 8,192 keys (steps 0.94-1.00x there, 1.00-1.04x at 2,048 and 4,096): bench/one_query.
ONE_QUERY_KEYS = 8192


def one_query_runs(lk: int) -> bool:
    """Whether a one-query CPU call of ``lk`` keys runs ``one_query_softmax`` (``ONE_QUERY_KEYS``, read per call)."""
    return lk >= ONE_QUERY_KEYS


def one_query_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      mask: torch.Tensor | None = None,
                      lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softmax(scale q k^T + mask) v for one query per head, the query heads of a kv head as one matrix (no GQA copy
    of k or v): q [B, H, 1, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv], mask None or float [B|1, H|1, 1, Lk]
    (-inf: hidden), all of one float dtype, no autograd -> (out [B, H, 1, Dv], the row log-sum-exp [B, H, 1] when
    ``lse``, else None). A row that sees no key gets out 0 and log-sum-exp -inf."""
    B, H, _, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    g = H // Hkv
    s = torch.matmul(q.reshape(B, Hkv, g, D), k.transpose(-1, -2))  # [B, Hkv, g, Lk]
    if mask is None:
        s.mul_(scale)
    else:
        s = torch.add(mask.expand(B, H, 1, Lk).reshape(B, Hkv, g, Lk), s, alpha=scale)
    # (torch.softmax, not exp and sum: its vectorised exp has no slow path for the weights that underflow, which a
    # decay or a wide score range makes many of; torch.exp and logsumexp take glibc's, about 20x slower there)
    p = torch.softmax(s, dim=-1)
    out = torch.matmul(p, v).reshape(B, H, 1, v.shape[-1])
    if mask is None and not lse:
        return out, None
    m = s.amax(dim=-1).reshape(B, H, 1)
    if mask is not None:  # (a row that sees no key: max -inf, p NaN)
        dead = m == float("-inf")
        out = out.masked_fill(dead.unsqueeze(-1), 0.0)
    if not lse:
        return out, None
    # log-sum-exp = max s + log sum_j e^(s_j - max s), and that sum is 1 / (the weight at the maximum)
    lse_ = m - p.amax(dim=-1).reshape(B, H, 1).log()
    return out, (lse_ if mask is None else lse_.masked_fill_(dead, float("-inf")))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 inputs are computed in fp32 inside (denominators such as sum s^2 overflow in half precision)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def unfused_call_reason(call: AttnCall) -> str | None:
    """Why a kernel that computes s = c (q . k) itself cannot take ``call``: empty inputs, or a normalizer that
    transforms q/k. None when neither holds (score modifiers and dropout are call features: a path declining them
    declares none, ``dispatch.FEATURES``)."""
    if call.q.numel() == 0 or call.k.shape[2] == 0:
        return "empty inputs"
    if type(call.normalizer).transform_qk is not Normalizer.transform_qk or \
            type(call.normalizer).feature_map is not Normalizer.feature_map:
        return "the normalizer transforms q/k"
    return None


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dim is contiguous (the C++ kernels read rows through strides), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def dense_keep(call: AttnCall, b: int, h: int, lq: int, lk: int) -> torch.Tensor | None:
    """The call's keep mask as a [B, H, Lq, Lk] view with a contiguous last dim (broadcast dims stay stride 0), on
    q's device; None for a mask-free call."""
    keep = call.mask.keep
    if keep is None:
        return None
    return last_dim_contiguous(keep.to(call.q.device)).expand(b, h, lq, lk)


def alibi_bias(slopes: torch.Tensor, lq: int, lk: int) -> torch.Tensor:
    """ALiBi (Press et al.): bias [1, H, Lq, Lk] = -slopes[h] * |pos_i - j| with query i at key position
    i + Lk - Lq (the last query is the last key, as in cached decoding). For causal attention this is the paper's
    -m (i - j); BLOOM's m * j differs from it by a per-row constant, which softmax ignores."""
    dt = torch.promote_types(slopes.dtype, torch.float32)
    pos_q = torch.arange(lq, device=slopes.device, dtype=dt) + (lk - lq)
    dist = (pos_q[:, None] - torch.arange(lk, device=slopes.device, dtype=dt)[None, :]).abs()
    return -slopes.to(dt).view(1, -1, 1, 1) * dist


def forget_bias(forget: torch.Tensor, lq: int, rows: slice | None = None, keys: int | None = None) -> torch.Tensor:
    """Forgetting attention's bias F [B, H, Lq, Lk] from the cumulative log forget gates ``forget`` c [B, H, Lk]:
    F_ij = -|c_{p_i} - c_j| with query i at key position p_i = Lk - Lq + i (the last query is the last key, as in
    cached decoding; with more queries than keys, a query before the first key is placed at it). c never increases
    (log f <= 0), so for j <= p_i this is c_{p_i} - c_j = sum_{l=j+1..p_i} log f_l, the decay of the gates after key
    j up to the query. ``rows``: only those query rows; ``keys``: only the first ``keys`` keys (a causal chunk's)."""
    lk = forget.shape[-1]
    rows = rows or slice(0, lq)
    if lq <= lk:
        at_query = forget[..., lk - lq + rows.start:lk - lq + rows.stop, None]
    else:  # more queries than keys: those before the first key are placed at it
        pos = (torch.arange(rows.start, rows.stop, device=forget.device) + (lk - lq)).clamp_min(0)
        at_query = forget.index_select(-1, pos).unsqueeze(-1)
    return -(at_query - forget[..., None, :keys]).abs()


def compact_bias(bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bias [B|1, H|1, Lq|1, Lk|1] in ``dtype`` with its expanded (stride-0) dims back to size 1 and a contiguous
    last dim, so that neither the cast nor the copy is ever of size B x H x Lq x Lk when the bias is smaller (the
    kernels read size-1 dims with stride 0). Differentiable: the gradient flows back to the caller's bias."""
    for d in range(4):
        if bias.shape[d] > 1 and bias.stride(d) == 0:
            bias = bias.narrow(d, 0, 1)
    bias = bias.to(dtype)
    return bias if bias.shape[3] == 1 or bias.stride(3) == 1 else bias.contiguous()


def modify_scores(scores: torch.Tensor, softcap: float | None, bias: torch.Tensor | None) -> torch.Tensor:
    """scores [B, H, Lq, Lk] -> c tanh(scores / c) + bias (either step skipped when None)."""
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    return scores


def normalize(norm: Normalizer, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx,
              sinks: torch.Tensor | None) -> torch.Tensor:
    """The normalizer's weights [B, H, Lq, Lk]; with ``sinks`` [H] an always-visible extra key with logit
    sinks[h] (and value 0) takes part in the normalisation and is dropped from the returned weights. For a normalizer
    whose weights depend on the key order (``key_order``) the sink sits before the first key (the farthest)."""
    if sinks is None:
        return norm.reference(scores, keep, ctx)
    lead = scores.shape[:-1]
    col = sinks.to(device=scores.device, dtype=scores.dtype).view(1, -1, 1, 1).expand(*lead, 1)
    ones = keep.new_ones(()).expand(*lead, 1)
    if norm.key_order:  # order-dependent weights (stick-breaking): the sink is the farthest key, before the first
        keep = torch.cat([ones, keep.expand(*lead, keep.shape[-1])], dim=-1)
        return norm.reference(torch.cat([col, scores], dim=-1), keep, ctx)[..., 1:]
    keep = torch.cat([keep.expand(*lead, keep.shape[-1]), ones], dim=-1)
    return norm.reference(torch.cat([scores, col], dim=-1), keep, ctx)[..., :-1]
