"""Exact cached generation for query-coupled normalizers (selective attention): the running column sums kept on the
transformers cache.

A query's penalty sums what every earlier query selected (normalizers/selective.py), so a cached step needs, besides
the cached keys and values, C [B, Lk] = sum over every query processed so far of the selecting head's selecting
entries R (kernels/selective/carry.py). Like linear attention's recurrent state (hf/recurrent.py), C lives on the
cache: each ``DynamicLayer`` that served a selective call gets an attribute ``_hf_attnorm_selective`` holding a
``SelectiveState``: C, and per cached position what recomputing C for a prefix needs (the selecting head's q' and k',
and which keys are live), with weak references to the layer's key/value tensors (and their versions) and the module
that built it. So it lives and dies with the cache, and is used only while it describes exactly the cached keys:

* the attention module's forward pre-hook (hf/cache_state.py, the protocol every cache-kept state follows) looks at
  the layer before the module appends its keys and arms the state only if the layer still holds the very tensors it
  was made for, unchanged in place;
* the attention function (``SelectiveKind.step``): a call with earlier keys (Lk > Lq: a decode step, a chunked prefill,
  a continued generation) passes C, padded with 0 for the new keys, as ``AttnCall.selective_carry``; after the call C
  += the call's column sums (one cheap pass over the selecting head). A first call (Lk = Lq) runs as usual and then
  builds C. A call with earlier keys but no valid state raises ``AttnormError`` saying why: never a silently wrong step
  (unlike linear attention, there is no exact path without the state);
* the cache operations of generation are followed, not merely detected: on its first state a plain ``DynamicLayer``
  becomes a ``SelectiveLayer`` (a subclass; pickles and deep-copies as a plain ``DynamicLayer`` without the state)
  whose ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave`` (beam search, contrastive and
  batched decoding) apply the same batch operation to the state, whose ``crop`` (assisted decoding) recomputes C
  over the kept positions from the stored q'/k' (O(L^2 d) for one head), and whose ``reset`` drops it.

Refused with a clear error at the first cached step (generate time): encoder-decoder caches (the decoder's cross-
attention would need column sums of its own), static, sliding-window, quantized and other cache layers (a
StaticCache's call sees max_cache_len keys whose positions only cache_position knows), score modifiers (bias, soft-
cap, sinks: the column-sum pass forms plain scores), masks that are not key padding x causal, key selections
(``indices``/``block_indices``: a sparse indexer's choice changes per step), calls under
``torch.compile`` (nothing may persist across a graph), and caches changed by anything not listed above. A later
step's mask is trusted to keep the cached keys' visibility, as ``generate`` does.
"""

from __future__ import annotations

import copyreg
import dataclasses
import weakref

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from ..kernels.base import AttnCall
from ..kernels.selective.carry import column_sums_and_parts, prefix_column_sums
from ..normalizers.base import Normalizer
from ..registry import AttnormError
from ..settings import AttnormSettings
from . import cache_state, compat
from .cache_state import _none  # (what a pickled state becomes: None)

#: attribute of a transformers cache layer holding its ``SelectiveState``
STATE_ATTR = "_hf_attnorm_selective"
#: attribute of a cache layer: why the last call left no state (named by the error of the next cached step)
WHY_ATTR = "_hf_attnorm_selective_why"

_ADVICE = ("Generate with the default DynamicCache, or without a KV cache (model.generate(..., use_cache=False): "
           "each step then recomputes the whole sequence exactly).")


@dataclasses.dataclass(eq=False)
class SelectiveState:
    """Over the first ``length`` key positions of the calls (learned memory columns first), in the calls' compute
    dtype: c [B, L], the column sums over every query so far; qs, ks [B, L, D], per position the selecting head's q'
    (zeros where no query was: memory columns) and k'; live bool [B, L], keys some query sees. Held in buffers with
    spare room at the end (c's is zero there), so a step appends in place, amortised O(1), instead of copying the
    state (``view`` gives the first n positions)."""

    cbuf: torch.Tensor
    qbuf: torch.Tensor
    kbuf: torch.Tensor
    lbuf: torch.Tensor
    length: int
    settings: AttnormSettings
    keys: weakref.ref | None = None
    values: weakref.ref | None = None
    versions: tuple[int | None, ...] = (-1, -1)
    module: weakref.ref | None = None

    @classmethod
    def empty(cls, like_q: torch.Tensor, batch: int, settings: AttnormSettings, module: nn.Module,
              capacity: int) -> SelectiveState:
        d, dt, dev = like_q.shape[-1], like_q.dtype, like_q.device
        return cls(torch.zeros(batch, capacity, dtype=dt, device=dev), like_q.new_zeros(batch, capacity, d),
                   like_q.new_zeros(batch, capacity, d), torch.zeros(batch, capacity, dtype=torch.bool, device=dev),
                   0, settings, module=weakref.ref(module))

    @property
    def c(self) -> torch.Tensor:
        return self.cbuf[:, :self.length]

    @property
    def qs(self) -> torch.Tensor:
        return self.qbuf[:, :self.length]

    @property
    def ks(self) -> torch.Tensor:
        return self.kbuf[:, :self.length]

    @property
    def live(self) -> torch.Tensor:
        return self.lbuf[:, :self.length]

    def carry(self, new_keys: int) -> torch.Tensor:
        """C for a call with ``new_keys`` more keys, [B, length + new_keys] (0 for those): a view of the buffer."""
        self.reserve(self.length + new_keys)
        return self.cbuf[:, :self.length + new_keys]

    def reserve(self, n: int) -> None:
        cap = self.cbuf.shape[1]
        if n <= cap:
            return
        extra = max(n, 2 * cap, 64) - cap
        self.cbuf = F.pad(self.cbuf, (0, extra))
        self.qbuf, self.kbuf = F.pad(self.qbuf, (0, 0, 0, extra)), F.pad(self.kbuf, (0, 0, 0, extra))
        self.lbuf = F.pad(self.lbuf, (0, extra))

    def append(self, add: torch.Tensor, qs: torch.Tensor, ks: torch.Tensor, live: torch.Tensor) -> None:
        """C over the call's keys += add [B, Lk]; the positions length..Lk-1 get qs, ks [B, n, D], live [B, n]."""
        lk = add.shape[1]
        self.reserve(lk)
        self.cbuf[:, :lk] += add
        self.qbuf[:, self.length:lk], self.kbuf[:, self.length:lk], self.lbuf[:, self.length:lk] = qs, ks, live
        self.length = lk

    def __reduce__(self):
        # weak references cannot be pickled and a state is meaningless apart from its tensors (as hf/recurrent.py)
        return _none, ()

    def record(self, layer: DynamicLayer) -> None:
        k, v = compat.layer_tensors(layer)
        self.keys, self.values, self.versions = weakref.ref(k), weakref.ref(v), cache_state.versions(k, v)

    def matches(self, layer: DynamicLayer) -> bool:
        k, v = compat.layer_tensors(layer)
        return (k is not None and v is not None and self.keys is not None and self.keys() is k
                and self.values() is v and cache_state.versions(k, v) == self.versions)

    def map_batch(self, fn) -> None:
        self.cbuf, self.qbuf, self.kbuf, self.lbuf = fn(self.cbuf), fn(self.qbuf), fn(self.kbuf), fn(self.lbuf)

    def crop_to(self, n: int) -> None:
        """Keep positions 0..n-1: C recomputed over them (the queries after them are gone)."""
        self.length = n
        self.cbuf[:, n:] = 0
        self.cbuf[:, :n] = prefix_column_sums(self.qs, self.ks, self.live)


def _current(layer: DynamicLayer) -> SelectiveState | None:
    """The layer's state if it still describes its tensors; a stale one is dropped."""
    st = layer.__dict__.get(STATE_ATTR)
    if st is None:
        return None
    if isinstance(st, SelectiveState) and st.matches(layer):
        return st
    _drop(layer, "the cache layer's tensors were replaced or changed in place by an operation hf_attnorm does not "
                 "follow (it follows reorder_cache, batch_select_indices, batch_repeat_interleave, crop and reset)")
    return None


def _drop(layer: DynamicLayer, why: str) -> None:
    layer.__dict__.pop(STATE_ATTR, None)
    layer.__dict__[WHY_ATTR] = why


class SelectiveLayer(DynamicLayer):
    """A ``DynamicLayer`` holding a selective state, which follows the layer's cache operations (module docstring).
    Installed by assigning ``__class__`` on the layer that gets the state (transformers creates the layers)."""

    def _follow(self, op, *args) -> None:
        st = _current(self)
        before = compat.layer_length(self)
        getattr(DynamicLayer, op)(self, *args)
        if st is None:
            return
        if op == "crop":
            # what crop's argument means changed across releases (5.4: the length to keep, or minus the count to
            # remove; 5.23+: minus the count only): count what it removed instead of reading the argument
            removed = before - compat.layer_length(self)
            if removed >= st.length:
                _drop(self, "the cache was cropped to nothing")
                return
            if removed:
                st.crop_to(st.length - removed)
        elif op == "reorder_cache":
            st.map_batch(lambda t: t.index_select(0, args[0].to(t.device)))
        elif op == "batch_select_indices":
            st.map_batch(lambda t: t[args[0].to(t.device) if isinstance(args[0], torch.Tensor) else args[0]])
        elif op == "batch_repeat_interleave":
            st.map_batch(lambda t: t.repeat_interleave(args[0], dim=0))
        if self.keys is None or self.values is None:
            _drop(self, "the cache was reset")
        else:
            st.record(self)

    def crop(self, length: int) -> None:
        self._follow("crop", length)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._follow("reorder_cache", beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._follow("batch_select_indices", indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._follow("batch_repeat_interleave", repeats)

    def offload(self) -> None:
        self._follow("offload")

    def prefetch(self) -> None:
        self._follow("prefetch")

    def reset(self) -> None:
        DynamicLayer.reset(self)
        _drop(self, "the cache was reset")

    def __reduce_ex__(self, protocol):
        # a plain DynamicLayer without the state: unpickling needs no hf_attnorm, and a copy's tensors are new anyway
        state = {k: v for k, v in self.__dict__.items() if k not in (STATE_ATTR, WHY_ATTR)}
        return copyreg._reconstructor, (DynamicLayer, object, None), state


def state_of_layer(layer: DynamicLayer) -> SelectiveState | None:
    """The state a cache layer holds (for tests and inspection), or None."""
    st = layer.__dict__.get(STATE_ATTR)
    return st if isinstance(st, SelectiveState) else None


def _refuse(name: str, query: torch.Tensor, key: torch.Tensor, why: str) -> AttnormError:
    return AttnormError(
        f"normalizer {name!r} couples the queries of a call (each query's weights depend on every earlier query), "
        f"so a step with cached keys ({query.shape[2]} queries, {key.shape[2]} keys) needs the earlier queries' "
        f"column sums, which hf_attnorm keeps on the cache layer; here it cannot: {why}. {_ADVICE}")


def _plain_key_padding(call: AttnCall) -> str | None:
    """Why the state cannot describe this call (None: it can)."""
    if call.modifies_scores:
        return "the call carries score modifiers (bias, soft-cap, ALiBi or sinks), which the column sums do not apply"
    if call.mask.selected:
        return ("the call selects keys per query (a sparse indexer's indices), which the column sums, kept for key "
                "padding x causal, do not follow")
    if call.mask.padding() is None:
        return "the attention mask is not key padding x causal (the pattern generation builds)"
    return None


@dataclasses.dataclass(eq=False)
class SelectiveStep:
    """One causal call of a query-coupled normalizer on a cache layer: its carry before, the state after."""

    layer: DynamicLayer
    module: nn.Module
    state: SelectiveState | None  # the armed state (a call with earlier keys), None for a first call
    new_keys: int  # keys this call appends (its query count before learned memory)

    def begin(self, call: AttnCall, query: torch.Tensor, key: torch.Tensor) -> None:
        """Set ``call.selective_carry`` (calls with earlier keys); raises when the state does not fit the call."""
        st = self.state
        if st is None:
            return
        name = call.settings.normalizer
        why = _plain_key_padding(call)
        past = call.k.shape[2] - self.new_keys
        if why is None and st.settings != call.settings:
            why = "the cache's column sums were built with other attnorm settings"
        if why is None and (st.length != past or st.cbuf.shape[0] != call.q.shape[0]):
            why = (f"the state covers {st.cbuf.shape[0]} sequences x {st.length} keys, the call has "
                   f"{call.q.shape[0]} x {past} earlier keys")
        if why is not None:
            _drop(self.layer, why)
            raise _refuse(name, query, key, why)
        call.selective_carry = st.carry(self.new_keys)

    def after(self, call: AttnCall, path: str) -> None:
        """C += the call's column sums; the new positions' q', k', liveness appended (a first call: built)."""
        layer = self.layer
        why = _plain_key_padding(call)
        if why is None and torch.is_grad_enabled() and call.q.requires_grad:
            why = "the prefill ran with inputs requiring grad (training); generation runs without"
        if why is not None:
            _drop(layer, why)
            return
        add, qh, kh, live = column_sums_and_parts(call)
        B, lk = add.shape
        st = self.state
        if st is None:
            st = SelectiveState.empty(qh, B, call.settings, self.module, lk + 64)
        past = st.length
        lq = qh.shape[1]
        if lq == lk - past:  # the queries are the new positions, one each (every call without learned memory)
            qs = qh
        else:
            rows = torch.arange(lq, device=qh.device) + (lk - lq) - past  # query row -> its key position - past
            qs = qh.new_zeros(B, lk - past, qh.shape[-1])
            ok = rows >= 0  # (learned memory's zero query rows repeat positions already held)
            qs[:, rows[ok]] = qh[:, ok]
        # (the carry the call read is a view of st's buffer: C += add in place)
        st.append(add, qs, kh[:, past:], live.expand(B, lk)[:, past:])
        if type(layer) is DynamicLayer:
            layer.__class__ = SelectiveLayer
        layer.__dict__.pop(WHY_ATTR, None)
        st.record(layer)
        layer.__dict__[STATE_ATTR] = st


class SelectiveKind(cache_state.CacheStateKind):
    """Selective attention's column sums (module docstring)."""

    name = "selective"

    def serves(self, normalizer: Normalizer) -> bool:
        return normalizer.query_coupled

    def arm(self, layer: DynamicLayer, module: nn.Module) -> tuple[SelectiveState | None, str]:
        armed = _current(layer)
        why = layer.__dict__.get(WHY_ATTR, "the cache holds no selective state for its keys")
        if armed is not None and (armed.module is None or armed.module() is not module):
            return None, "the cache layer's selective state belongs to another attention module"
        return armed, why

    def drop(self, layer: DynamicLayer) -> None:
        if STATE_ATTR in layer.__dict__:
            _drop(layer, "drop_states was called")

    def step(self, module: nn.Module, pending: cache_state.Pending | None, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, settings: AttnormSettings, causal: bool) -> SelectiveStep | None:
        """For a causal call: the step on its cache layer; None when there is no cache and no earlier key (a plain
        call). Raises ``AttnormError`` for a call with earlier keys that cannot be exact."""
        if not causal:
            return None
        name = settings.normalizer
        past = key.shape[2] > query.shape[2]
        if torch.compiler.is_compiling():
            if past:
                raise _refuse(name, query, key, "under torch.compile the column sums cannot be kept across calls")
            return None
        if pending is None:
            if past:
                raise _refuse(name, query, key, "no transformers Cache reached the attention module's forward "
                                                f"(transformers {transformers.__version__}; looked for the keywords "
                                                f"{', '.join(compat.CACHE_ARGUMENTS)} and positional arguments)")
            return None
        cache = pending.cache()
        layer = pending.layer()
        if layer is None or not isinstance(layer, DynamicLayer) or type(layer) not in (DynamicLayer, SelectiveLayer):
            if past and hasattr(cache, "cross_attention_cache"):
                raise _refuse(name, query, key, "encoder-decoder caches (EncoderDecoderCache) are not followed: the "
                                                "decoder's cross-attention would need column sums of its own, over "
                                                "the encoder keys")
            if past:
                kind = type(layer).__name__ if layer is not None else "missing"
                raise _refuse(name, query, key, f"its cache layer is {kind} (static, sliding-window, quantized and "
                                                "other layers are not supported; only DynamicLayer, the default "
                                                "DynamicCache's)")
            return None
        layer_keys, layer_values = compat.layer_tensors(layer)
        if layer_keys is not key or layer_values is not value:
            if past:
                raise _refuse(name, query, key, "the keys the module passed are not its cache layer's")
            return None
        if past and pending.armed is None:
            raise _refuse(name, query, key, pending.why)
        return SelectiveStep(layer, module, pending.armed if past else None, query.shape[2])


KIND = cache_state.register(SelectiveKind())


def drop_states(cache: Cache) -> None:
    """Forget every selective state held by ``cache`` (its next cached step is then refused)."""
    cache_state.drop_states(cache, [KIND.name])
