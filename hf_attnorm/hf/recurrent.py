"""Where the recurrent state of linear attention lives during generation, and when it may be used.

The owner is the transformers cache: each ``DynamicLayer`` of a ``Cache`` gets an attribute ``_hf_attnorm_linear``
holding a ``LinearState`` (kernels/linear/recurrent.py: S = sum_j phi(k_j) v_j^T [B, Hkv, D, Dv] and
z = sum_j phi(k_j) [B, Hkv, D] over its cached keys) together with what it was built for: the key and value tensors
of the layer at that time (weak references and their version counters) and the attention module that built it.
So the state lives and dies with the cache (a new ``generate`` call makes a new cache, hence a new state) and is
used only when it corresponds to exactly the cached keys:

* the attention module's forward pre-hook (hf/cache_state.py, the protocol every cache-kept state follows; the
  attention function never sees the cache) looks at the layer BEFORE the module appends its new keys: the state is
  armed only if the layer still holds the very tensors the state was made from, unchanged in place
  (``cache_state.versions``).
  Anything transformers does to a cache between steps (``reorder_cache`` for beam search, ``crop``,
  ``batch_select_indices``, ``batch_repeat_interleave``, ``reset``, offloading) replaces those tensors or changes them
  in place, so it disarms (and drops) the state;
* the attention function (``RecurrentKind.step``, a ``StepHandle``) then requires that the layer is a plain
  ``DynamicLayer`` (it appends by concatenation; sliding-window, static, quantized and other layers keep the exact
  O(Lk) step), that the keys and values it received are the layer's, one query, and Lk = the state's length + 1;
* after the call: a recurrent step leaves the state advanced by one key; any other call rebuilds it from all the
  cached keys when it is a prefill (several queries, or the layer's first keys), else drops it (so after a beam
  reorder decoding stays on the exact path).

All of this is identity, shape and version checks on the host: no tensor value is read. Not done under
``torch.compile`` (static-cache generation compiles the exact path), with grads (training), for masks that are not
key padding, or for calls selecting keys per query (``indices``/``block_indices``: each step's selection is its
own). Masked (padding) keys are multiplied by 0 when they enter S; a later step's mask is trusted to keep the earlier
keys' visibility, as ``generate`` does (its 2-D mask only grows by ones): a custom loop that re-masks cached keys
must start a new cache (or call ``drop_states``).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref

import torch
import transformers
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from ..kernels.base import AttnCall
from ..kernels.linear.recurrent import LinearState, build_state
from ..kernels.linear.recurrent import takes as recurrent_takes
from ..normalizers.base import Normalizer
from ..settings import AttnormSettings
from . import cache_state, compat
from .cache_state import _none  # (what a pickled state becomes: None)

#: attribute of a transformers cache layer holding its ``_Owned`` state
STATE_ATTR = "_hf_attnorm_linear"
#: the path name of the recurrent step (kernels/linear/recurrent.py)
RECURRENT_PATH = "linear_recurrent"


@dataclasses.dataclass(eq=False)
class _Owned:
    """A state and what it was made from: the layer's keys/values tensors (weakly) with their versions, the module."""

    state: LinearState
    keys: weakref.ref
    values: weakref.ref
    versions: tuple[int | None, ...]
    module: weakref.ref

    def __reduce__(self):
        # weak references cannot be pickled, and a state is meaningless apart from its tensors: a pickled cache (or
        # model) carries None in its place, i.e. no state (copy.deepcopy keeps it, and the copy's new tensors fail
        # the identity check, so it is dropped there too)
        return _none, ()

    def matches(self, layer: DynamicLayer, module: nn.Module) -> bool:
        k, v = compat.layer_tensors(layer)
        return (k is not None and self.keys() is k and self.values() is v and self.module() is module
                and cache_state.versions(k, v) == self.versions)


@dataclasses.dataclass(eq=False)
class StepHandle:
    """The cache layer of one attention call and its armed state (None: not armed)."""

    layer: DynamicLayer
    module: nn.Module
    armed: LinearState | None

    def begin(self, call: AttnCall, query: torch.Tensor, key: torch.Tensor) -> None:
        """``AttnCall.recurrent``: the armed state when it is exactly one key short of this call."""
        st = self.armed
        if st is not None and query.shape[2] == 1 and key.shape[2] == st.length + 1:
            call.recurrent = st

    def after(self, call: AttnCall, path: str) -> None:
        """Record the state for the layer's current tensors: advanced (recurrent step), rebuilt (prefill), or
        dropped."""
        layer = self.layer
        if path == RECURRENT_PATH:
            state = call.recurrent
        elif call.q.shape[2] > 1 or call.q.shape[2] == call.k.shape[2]:
            state = build_state(call)
        else:
            state = None
        if state is None:
            if hasattr(layer, STATE_ATTR):
                delattr(layer, STATE_ATTR)
            return
        k, v = compat.layer_tensors(layer)
        setattr(layer, STATE_ATTR, _Owned(state, weakref.ref(k), weakref.ref(v), cache_state.versions(k, v),
                                          weakref.ref(self.module)))


#: reasons already warned about (once per process each: a model has many layers and steps)
_WARNED: set[str] = set()


def _warn_off(module: nn.Module, why: str) -> None:
    if why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(f"hf_attnorm: linear attention's recurrent decode state is not used in "
                      f"{type(module).__name__} (transformers {transformers.__version__}): {why}. Each cached step "
                      "recomputes over every cached key instead: results are exact, a step costs O(keys) instead of "
                      "O(1).", stacklevel=4)


class RecurrentKind(cache_state.CacheStateKind):
    """Linear attention's recurrent state (module docstring)."""

    name = "linear_recurrent"

    def serves(self, normalizer: Normalizer) -> bool:
        return recurrent_takes(normalizer) is None

    def arm(self, layer: DynamicLayer, module: nn.Module) -> tuple[LinearState | None, str]:
        owned = getattr(layer, STATE_ATTR, None)
        if isinstance(owned, _Owned):
            if compat.plain_dynamic_layer(layer) and owned.matches(layer, module):
                return owned.state, ""
            delattr(layer, STATE_ATTR)  # stale: the cache changed under it
        return None, "the cache layer holds no state for its keys"

    def drop(self, layer: DynamicLayer) -> None:
        if hasattr(layer, STATE_ATTR):
            delattr(layer, STATE_ATTR)

    def step(self, module: nn.Module, pending: cache_state.Pending | None, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, settings: AttnormSettings, causal: bool) -> StepHandle | None:
        """The cache layer this call's keys are, when it can hold a state; None otherwise (no cache, another layer
        type, keys that are not the layer's, under torch.compile). A cached decode step (one query, earlier keys, no
        grad) of a module that has the pre-hook but cannot use the state warns once per reason: the O(1) step must
        not turn itself off silently."""
        if torch.compiler.is_compiling():
            return None
        # (cross-attention keeps no state; the hook scan comes last: every attention call of every module passes here)
        decoding = (query.shape[2] == 1 and key.shape[2] > 1 and not torch.is_grad_enabled()
                    and getattr(module, "is_causal", True) is not False and cache_state.hooked(module))
        if pending is None:
            if decoding:
                _warn_off(module, "no transformers Cache reached the attention module's forward (looked for the "
                                  f"keywords {', '.join(compat.CACHE_ARGUMENTS)} and positional arguments)")
            return None
        layer = pending.layer()
        if layer is None or not compat.plain_dynamic_layer(layer):
            if decoding:
                kind = type(layer).__name__ if layer is not None else type(pending.cache()).__name__
                _warn_off(module, f"its cache layer is a {kind}, not a DynamicLayer (the state follows only the "
                                  "default DynamicCache's layers)")
            return None
        keys, values = compat.layer_tensors(layer)
        if keys is not key or values is not value:
            self.drop(layer)
            if decoding:
                _warn_off(module, "the keys the module passed are not its cache layer's tensors")
            return None
        return StepHandle(layer, module, pending.armed)


KIND = cache_state.register(RecurrentKind())


def drop_states(cache: Cache) -> None:
    """Forget every recurrent state held by ``cache`` (the next steps take the exact path until a prefill)."""
    cache_state.drop_states(cache, [KIND.name])
