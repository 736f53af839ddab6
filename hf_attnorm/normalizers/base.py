"""The Normalizer interface: what turns attention scores into weights.

A normalizer file defines a subclass, decorates it with ``@register_normalizer`` and thereby becomes an attention
implementation name, a CLI choice and a case in every generic test.

Pipeline for one attention call (see ``hf_attnorm.attention``)::

    q, k   = normalizer.transform_qk(q, k, ctx)           # e.g. cosine: l2-normalise
    q      = q * base * multiplier[b, h, i]               # base = model scaling (1 if not uses_base_scaling);
                                                          # multiplier = length-aware scale x per-head factors
                                                          # x per-query factors (query_multiplier, from raw q)
    q, k   = normalizer.feature_map(q, k, ctx)            # e.g. linear attention: elu + 1
    s      = q @ k^T                                      # [B, H, Lq, Lk]
    w      = normalizer.reference(s, keep, ctx)           # [B, H, Lq, Lk], exactly 0 where keep is False
    out    = w @ v
    out    = out * normalizer.output_gate(q_raw, ctx)     # only a normalizer that has one (gated attention)
"""

from __future__ import annotations

import dataclasses
import warnings
import zlib
from typing import Any, ClassVar, Literal, get_args

import torch

from ..settings import AttnormSettings

RowSum = Literal["one", "at_most_one", "signed", "free"]
#: how the fast kernels can run a normalizer (see ``Normalizer.kernel_family``)
KernelFamily = Literal["softmax", "fused", "linear", "stickbreaking", "generic"]
#: how transformers' continuous batching (``generate_batch``) can run a normalizer or scale, which it hands every
#: scheduled sequence at once: queries packed as q [1, H, Q_total, D], each sequence's keys gathered from the paged
#: cache, k/v [1, Hkv, K_total, D], and one block-diagonal causal mask [1, 1, Q_total, K_total].
#: "packed": one call as it comes; exact when a query's weights depend only on the keys its mask row shows (n read
#: per row), its own query and per-head values. "per_sequence": the call split at the sequences' boundaries, each
#: part laid out as a cached ``generate`` step (the last query is the last key), for maps that read a query's
#: position as Lk - Lq + i. "refused": not exact on that route.
ContinuousBatching = Literal["packed", "per_sequence", "refused"]
CONTINUOUS_BATCHING_MODES: tuple[str, ...] = get_args(ContinuousBatching)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """A per-head value that may be learned: initialised from option ``init_option``; a trainable
    ``nn.Parameter`` named ``name`` when option ``learnable_option`` is true, else a constant.

    Its shape is [H] followed by ``shape``: each trailing dim an int, ``"head_dim"`` (D of q/k, known from the
    attention module or the call), ``"value_dim"`` (Dv of v; D unless the module says otherwise) or the name of an
    integer option (e.g. a number of memory slots). ``init``:
    ``"fill"`` sets every entry to the init option's value; ``"normal"`` draws N(0, value^2) entries from a generator
    seeded by the name and shape (reproducible, so a constant is the same on every device and call), for vectors whose
    entries must differ (learned memory keys); ``"eye"`` gives each head the value times the identity matrix over
    the two trailing dims (a learned linear map that starts as the identity: Hedgehog's feature map). ``heads``: what
    the leading dim counts, ``"query"`` (H, the default) or ``"kv"`` (Hkv, the key/value heads of a GQA module: values
    that belong to k/v, such as learned memory key/values, which are then prepended to k/v without repeating them to
    the query heads, or hedgehog's key feature maps)."""

    name: str
    init_option: str
    learnable_option: str
    help: str
    shape: tuple[int | str, ...] = ()
    init: Literal["fill", "normal", "eye"] = "fill"
    heads: Literal["query", "kv"] = "query"

    def is_learnable(self, settings: AttnormSettings) -> bool:
        return bool(settings.options[self.learnable_option])

    def init_value(self, settings: AttnormSettings) -> float:
        value = settings.options[self.init_option]
        return 0.0 if value is None else float(value)  # None: the option's "derived" mode (e.g. sigmoid -ln n)

    def dims(self, num_heads: int, settings: AttnormSettings, head_dim: int | None = None,
             kv_heads: int | None = None, value_dim: int | None = None) -> tuple[int, ...]:
        """The full shape (H or Hkv, *trailing); ``kv_heads`` (Hkv, default H: no GQA) is read by ``heads="kv"``
        values only; ``value_dim`` (Dv) defaults to ``head_dim``. ValueError naming the missing fact when
        ``"head_dim"`` or ``"value_dim"`` is needed but unknown."""
        if self.heads == "kv" and kv_heads is not None and (kv_heads < 1 or num_heads % kv_heads):
            raise ValueError(f"per-head value {self.name!r} is per key/value head, but {kv_heads} key/value heads do "
                             f"not divide the {num_heads} query heads")
        out = [num_heads if self.heads == "query" or kv_heads is None else int(kv_heads)]
        for d in self.shape:
            if d == "value_dim" and value_dim:
                out.append(int(value_dim))
            elif d in ("head_dim", "value_dim"):
                if not head_dim:
                    raise ValueError(f"per-head value {self.name!r} has shape [H, {d}, ...] but the attention "
                                     "module's head dimension is unknown (no head_dim / attention_head_size)")
                out.append(int(head_dim))
            elif isinstance(d, str):
                out.append(int(settings.options[d]))
            else:
                out.append(int(d))
        return tuple(out)

    def initial(self, num_heads: int, settings: AttnormSettings, head_dim: int | None = None,
                device: torch.device | str | None = None, kv_heads: int | None = None,
                value_dim: int | None = None) -> torch.Tensor:
        """The initial value, fp32, of shape ``dims(...)``."""
        shape, value = self.dims(num_heads, settings, head_dim, kv_heads, value_dim), self.init_value(settings)
        if self.init == "fill":
            return torch.full(shape, value, dtype=torch.float32, device=device)
        if self.init == "eye":
            if len(shape) != 3:
                raise ValueError(f"per-head value {self.name!r}: init 'eye' needs a matrix per head, got {shape}")
            eye = torch.eye(shape[1], shape[2], dtype=torch.float32, device=device) * value
            return eye.expand(shape).clone()
        seed = zlib.crc32(f"{self.name}:{shape}".encode())
        gen = torch.Generator().manual_seed(seed)
        return (torch.randn(shape, generator=gen, dtype=torch.float32) * value).to(device)


#: how a row form maps its per-head value (``RowForm.head_map``), with the number the C++ decode op takes for each
HEAD_MAP_IDS: dict[str, int] = {"value": 0, "abs": 1, "at_least": 2}
#: the term of n (the keys a row sees) a row form adds (``RowForm.n_term``), with its number for the C++ decode op
N_TERM_IDS: dict[str, int] = {"none": 0, "n": 1, "minus_log_n": 2, "inverse_n": 3}
HeadMap = Literal["value", "abs", "at_least"]
NTerm = Literal["none", "n", "minus_log_n", "inverse_n"]


@dataclasses.dataclass(frozen=True)
class RowForm:
    """A fused map's per-row value r (``Normalizer.row_value``) as a function of one per-head value h [H] and the
    keys n a row sees: r = head_map(h) + n_term(n) (only the one that is declared when the other is absent),
    negated on rows with one visible key when ``negate_single_key``, all in the row value's dtype (h cast first).

    head_map: "value" h, "abs" |h|, "at_least" max(h, floor) written h + relu(floor - h) (gradient 1 at the floor
    on every torch); n_term: "none", "n", "minus_log_n" -ln n, "inverse_n" 1 / n. Declared once per normalizer
    (``Normalizer.row_form``): ``Normalizer.row_value`` evaluates it with PyTorch ops (``evaluate``,
    autograd-connected to h), and the C++ decode op of a cached step evaluates the same form per head from the
    raw h (``kernels/fused/fused_cpu.cpp``, ``decode_row_values``), with the same operations in the same order."""

    head: str | None = None
    head_map: HeadMap = "value"
    floor: float = 0.0
    n_term: NTerm = "none"
    negate_single_key: bool = False

    def __post_init__(self) -> None:
        if self.head_map not in HEAD_MAP_IDS or self.n_term not in N_TERM_IDS:
            raise ValueError(f"RowForm: head_map must be one of {list(HEAD_MAP_IDS)} (got {self.head_map!r}) and "
                             f"n_term one of {list(N_TERM_IDS)} (got {self.n_term!r})")
        if self.head is None and self.n_term == "none":
            raise ValueError("RowForm: a row form needs a per-head value (head) or a term of n (n_term)")

    def evaluate(self, ctx: Ctx, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """r in ``dtype``, broadcastable to [B, H, Lq]: [1, H, 1] from the head alone, else ctx.n's shape."""
        r = None
        if self.head is not None:
            h = ctx.heads[self.head].to(device=ctx.n.device, dtype=dtype).view(1, -1, 1)
            if self.head_map == "abs":
                h = h.abs()
            elif self.head_map == "at_least":
                h = h + torch.relu(self.floor - h)
            r = h
        if self.n_term != "none":
            n = ctx.n.to(dtype)
            if self.n_term == "minus_log_n":  # (h - ln n: the subtraction the C++ form makes)
                r = -torch.log(n) if r is None else r - torch.log(n)
            else:
                term = n if self.n_term == "n" else 1.0 / n
                r = term if r is None else r + term
        assert r is not None  # (__post_init__)
        if self.negate_single_key:
            r = r * torch.where(ctx.n > 1, 1.0, -1.0).to(dtype)
        return r


@dataclasses.dataclass
class Ctx:
    """What a normalizer or scale may read during one attention call.

    settings: the validated settings; heads: per-head values name -> tensor [H] or [H, ...] (``ParamSpec.shape``;
    parameters or constants, fp32);
    head_dim: D of q/k; n: visible keys per query, float [B, 1 or H, Lq] (>= 1); module_info: static facts about
    the attention module (``train_length`` ...).
    """

    settings: AttnormSettings
    heads: dict[str, torch.Tensor]
    head_dim: int
    n: torch.Tensor
    module_info: dict
    #: number of keys Lk of the call (an upper bound of n known from shapes alone, so no data-dependent sync)
    lk: int = 0
    #: query-coupled normalizers (selective): what earlier calls' queries accumulated per key, [B, Lk] (0 for the
    #: call's new keys), the call's ``AttnCall.selective_carry``; None: no earlier queries
    selective_carry: torch.Tensor | None = None

    def head(self, name: str) -> torch.Tensor:
        """Per-head value as [1, H, 1, 1] for broadcasting against [B, H, Lq, Lk]."""
        return self.heads[name].view(1, -1, 1, 1)


class Normalizer:
    """Base class. Subclasses set the class attributes and implement ``reference``."""

    name: ClassVar[str]
    description: ClassVar[str]
    #: where the method comes from: authors year, title, link (the README's implementations table shows it)
    paper: ClassVar[str] = ""
    #: "one": every row with a visible key sums to 1; "at_most_one": <= 1 (weights >= 0 for both); "signed": weights
    #: may be negative and their absolute values sum to 1 (Cog attention); "free": no constraint
    row_sum: ClassVar[RowSum] = "one"
    #: options this normalizer reads (declared with ``declare_option`` in its file)
    options: ClassVar[tuple[str, ...]] = ()
    #: per-head values that can be learned
    params: ClassVar[tuple[ParamSpec, ...]] = ()
    #: multiply scores by the model's own ``scaling`` (1/sqrt(d)); cosine and linear do not
    uses_base_scaling: ClassVar[bool] = True
    #: weights are exactly zero outside a data-dependent support (entmax family)
    sparse: ClassVar[bool] = False
    #: True when the normalizer has its own fast O(n) path that does not need scores (linear attention)
    scoreless: ClassVar[bool] = False
    #: True when the weights depend on the order of the keys, not only on which keys are visible (stick-breaking
    #: scans them from the last visible one backwards): permuting keys with a non-causal call changes the output
    key_order: ClassVar[bool] = False
    #: with ``key_order``: what the weights do without causality (the warning on a bidirectional module says it)
    key_order_note: ClassVar[str] = ""
    #: True when a query's weights depend on the other queries of the call (selective attention's penalty sums the
    #: earlier queries' scores): paths that split the queries (chunked, decode) decline it, and a cached decoding
    #: step (whose earlier queries are gone) is refused by the transformers integration
    query_coupled: ClassVar[bool] = False
    #: how transformers' continuous batching runs it (``ContinuousBatching``); None: derived, "refused" for a
    #: query-coupled normalizer (its weights need the earlier queries of the sequence), else "packed"
    continuous_batching: ClassVar[ContinuousBatching | None] = None
    #: why it is refused there, or what differs there (then said in a warning when continuous batching starts)
    continuous_batching_note: ClassVar[str] = ""

    #: differential attention: each head's q/k dims are split into two halves (``variants.halves``), each attended
    #: with this normalizer's own map (``reference`` and its kernel family) on whatever path takes the call, and
    #: ``attend`` forms ``normalize_output(halves_difference(first, second))``; the weights are
    #: ``halves_difference`` of the halves' weights (head dim at least 2)
    differential: ClassVar[bool] = False

    # ---- what the kernels need to know (hf_attnorm.kernels reads these; no kernel switches on a name) ----
    #: "softmax": exp(s) over the visible keys plus at most one always-visible sink logit (``sink_logit``), exact
    #: on SDPA; "fused": an elementwise map of the fused CPU / Triton kernels, named by ``fused_map``; "linear":
    #: scoreless (``feature_map`` only), the O(n) path; "stickbreaking": the stick-breaking scan kernels
    #: (``kernels/stickbreaking/``); "generic": only the chunked and reference paths
    kernel_family: ClassVar[KernelFamily] = "generic"
    #: with kernel_family "fused": the kernels' map, a name of ``hf_attnorm.kernels.fused.maps.MAP_IDS``
    fused_map: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # the attribute's former name: a subclass setting it still runs on its map, with a DeprecationWarning
        if "fused_kind" in cls.__dict__:
            warnings.warn(f"{cls.__name__}.fused_kind is deprecated: name the fused map with fused_map",
                          DeprecationWarning, stacklevel=2)
            if "fused_map" not in cls.__dict__:
                cls.fused_map = cls.__dict__["fused_kind"]

    def row_form(self, settings: AttnormSettings) -> RowForm | None:
        """How the fused map's per-row value r follows from a per-head value and n (``RowForm``), or None when the
        map reads none (the kernels then get n). The one declaration of r: ``row_value`` evaluates it."""
        return None

    def row_value(self, ctx: Ctx, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """The per-row constant r of a fused map, in ``dtype`` broadcastable to [B, H, Lq] (autograd-connected to the
        per-head values it comes from), or None when the map reads none (the kernels then get n): ``row_form``
        evaluated. A subclass may override this instead (its cached decode steps then resolve r in Python)."""
        form = self.row_form(ctx.settings)
        return None if form is None else form.evaluate(ctx, dtype)

    def sink_logit(self, ctx: Ctx, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """softmax family: the always-visible extra logit lambda (value 0), 0-d or [H] in ``dtype``; None if none."""
        return None

    def validate(self, settings: AttnormSettings) -> None:
        """Cross-option checks (single options are range-checked where declared)."""

    def check_heads(self, settings: AttnormSettings, num_heads: int) -> None:
        """Checks against the number of query heads, when a model's implementation is set and by ``make_call``
        for the functional API; raise AttnormError."""

    def transform_qk(self, q: torch.Tensor, k: torch.Tensor, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """Before scaling. q: [B, H, Lq, D], k: [B, H, Lk, D]."""
        return q, k

    #: ``transform_qk`` is l2-normalisation of q and k rows, x / max(|x|, qk_norm_eps) (cosine's QK-norm): the
    #: kernels may run it fused with the query scale; None: another transform or none (tests check the declaration)
    qk_norm_eps: ClassVar[float | None] = None

    def head_multiplier(self, ctx: Ctx) -> torch.Tensor | None:
        """Per-head factor multiplied into q with the scale ([H]) or None."""
        return None

    def query_multiplier(self, q: torch.Tensor, ctx: Ctx) -> torch.Tensor | None:
        """Per-query factor multiplied into q with the scale (so every path, the fused kernels included, gets it
        through q, and autograd carries its gradient): [B, H, Lq] computed from the call's raw q [B, H, Lq, D]
        (before ``transform_qk`` and any scaling; ASEntmax's delta + softplus(w . q) (ln n)^gamma), or None."""
        return None

    def output_gate(self, q: torch.Tensor, ctx: Ctx) -> torch.Tensor | None:
        """A gate multiplied into the attention output, [B, H, Lq, Dv] (fp32 at least), computed from the call's raw
        queries q [B, H, Lq, D] (before ``transform_qk`` and any scaling; gated attention's sigmoid(q W + b)), or
        None. Applied by ``attend`` after whichever path ran, so every path has it and the weights are unchanged."""
        return None

    def forget_gates(self, v: torch.Tensor, ctx: Ctx) -> torch.Tensor | None:
        """Forgetting attention: log f_l <= 0, the log forget gate of every key, [B, H, Lk] (fp32 at least),
        computed from the call's values v [B, Hkv, Lk, Dv] (key l's value vector; learned memory values first), or
        None for no forget gate. ``make_call`` turns it into ``AttnCall.forget`` (its cumulative sum), which adds
        -|c_{p_i} - c_j| to the scores; only the paths supporting ``forget`` take such a call."""
        return None

    def halves_difference(self, first: torch.Tensor, second: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        """Differential normalizers: the two halves' outputs [B, H, Lq, Dv] or weights [B, H, Lq, Lk] combined."""
        raise NotImplementedError(f"normalizer {self.name!r} is not differential")

    def normalize_output(self, out: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        """Differential normalizers: the combined output [B, H, Lq, Dv] after its per-head normalisation."""
        return out

    def difference_form(self, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor, float, float] | None:
        """Differential normalizers whose ``normalize_output(halves_difference(first, second))`` is
        RMSNorm_eps(first - lam_h second) * weight_h * factor per row: (lam [H], weight [H, Dv], factor, eps), which
        the kernels may compute in one fused pass (tests check it against the two methods); None otherwise."""
        return None

    def feature_map(self, q: torch.Tensor, k: torch.Tensor, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """After scaling, before q @ k^T."""
        return q, k

    def reference(self, scores: torch.Tensor, keep: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        """Naive weights from materialised scores.

        scores: [B, H, Lq, Lk] float (already scaled); keep: bool, broadcastable to scores, True = visible.
        Returns weights [B, H, Lq, Lk] with exact zeros where keep is False and on fully masked rows.
        """
        raise NotImplementedError


def masked_fill_zero(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """x where keep else 0 (no arithmetic with masks, so no inf*0)."""
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


def safe_divide(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den with 0 where den == 0 (fully masked rows, all-zero rows), finite gradients."""
    nonzero = den != 0
    return torch.where(nonzero, num / torch.where(nonzero, den, torch.ones_like(den)), torch.zeros_like(num))


def masked_max(scores: torch.Tensor, keep: torch.Tensor, floor: float | torch.Tensor | None = None) -> torch.Tensor:
    """Row max over visible keys, [..., 1], detached (a stabiliser, not part of the math). Rows with no visible key
    give 0 (or ``floor``)."""
    s = scores.detach()
    neg = torch.finfo(s.dtype).min
    m = torch.where(keep, s, torch.full((), neg, dtype=s.dtype, device=s.device)).amax(dim=-1, keepdim=True)
    m = torch.where(m == neg, torch.zeros_like(m), m)
    if floor is not None:
        m = torch.maximum(m, torch.as_tensor(floor, dtype=m.dtype, device=m.device).detach())
    return m
