"""Where the recurrent state of linear attention lives during generation, and when it may be used.

The owner is the transformers cache: each ``DynamicLayer`` of a ``Cache`` gets an attribute ``_hf_attnorm_linear``
holding a ``LinearState`` (kernels/linear_recurrent.py: S = sum_j phi(k_j) v_j^T [B, Hkv, D, Dv] and
z = sum_j phi(k_j) [B, Hkv, D] over its cached keys) together with what it was built for: the key and value tensors
of the layer at that time (weak references and their version counters) and the attention module that built it.
So the state lives and dies with the cache (a new ``generate`` call makes a new cache, hence a new state) and is
used only when it corresponds to exactly the cached keys:

* a forward pre-hook on the attention module (``attach``; the attention function never sees the cache) looks at the
  layer BEFORE the module appends its new keys: the state is armed only if the layer still holds the very tensors
  the state was made from, unchanged in place (``_version``). Anything transformers does to a cache between steps
  (``reorder_cache`` for beam search, ``crop``, ``batch_select_indices``, ``batch_repeat_interleave``, ``reset``,
  offloading) replaces those tensors or changes them in place, so it disarms (and drops) the state;
* the attention function (``StepHandle``) then requires that the layer is a plain ``DynamicLayer`` (it appends by
  concatenation; sliding-window, static, quantized and other layers keep the exact O(Lk) step), that the keys and
  values it received are the layer's, one query, and Lk = the state's length + 1;
* after the call: a recurrent step leaves the state advanced by one key; any other call rebuilds it from all the
  cached keys when it is a prefill (several queries, or the layer's first keys), else drops it (so after a beam
  reorder decoding stays on the exact path).

All of this is identity, shape and version checks on the host: no tensor value is read. Not done under
``torch.compile`` (static-cache generation compiles the exact path), with grads (training), or for masks that are not
key padding. Masked (padding) keys are multiplied by 0 when they enter S; a later step's mask is trusted to keep
the earlier keys' visibility, as ``generate`` does (its 2-D mask only grows by ones): a custom loop that re-masks
cached keys must start a new cache (or call ``drop_states``).
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
from ..kernels.linear_recurrent import LinearState, build_state
from ..kernels.linear_recurrent import takes as recurrent_takes
from ..registry import NORMALIZERS
from . import compat
from .hooks import add_pre_hook, remove_pre_hook

#: attribute of a transformers cache layer holding its ``_Owned`` state
STATE_ATTR = "_hf_attnorm_linear"
#: attribute of an attention module: what its pre-hook saw of the cache for the call in progress
PENDING_ATTR = "_hf_attnorm_pending"
#: the path name of the recurrent step (kernels/linear_recurrent.py)
RECURRENT_PATH = "linear_recurrent"


@dataclasses.dataclass(eq=False)
class _Owned:
    """A state and what it was made from: the layer's keys/values tensors (weakly) with their versions, the module."""

    state: LinearState
    keys: weakref.ref
    values: weakref.ref
    versions: tuple[int, int]
    module: weakref.ref

    def __reduce__(self):
        # weak references cannot be pickled, and a state is meaningless apart from its tensors: a pickled cache (or
        # model) carries None in its place, i.e. no state (copy.deepcopy keeps it, and the copy's new tensors fail
        # the identity check, so it is dropped there too)
        return _none, ()

    def matches(self, layer: DynamicLayer, module: nn.Module) -> bool:
        k, v = compat.layer_tensors(layer)
        return (k is not None and self.keys() is k and self.values() is v and self.module() is module
                and (k._version, v._version) == self.versions)


@dataclasses.dataclass(eq=False)
class _Pending:
    cache: weakref.ref
    layer_idx: int
    armed: LinearState | None

    def __reduce__(self):
        return _none, ()


def _none() -> None:
    return None


def supports(module: nn.Module) -> bool:
    """Whether the module's current hf_attnorm normalizer has a recurrent step."""
    settings = getattr(module._modules.get("attnorm"), "settings", None)
    return settings is not None and recurrent_takes(NORMALIZERS.get(settings.normalizer)) is None


def _pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if torch.compiler.is_compiling():
        return None
    cache = compat.cache_of_call(args, kwargs)
    idx = getattr(module, "layer_idx", None)
    if cache is None or not isinstance(idx, int) or not supports(module):
        module.__dict__[PENDING_ATTR] = None
        return None
    layer = compat.cache_layer(cache, idx)
    owned = getattr(layer, STATE_ATTR, None)
    armed = None
    if isinstance(owned, _Owned):
        if compat.plain_dynamic_layer(layer) and owned.matches(layer, module):
            armed = owned.state
        else:
            delattr(layer, STATE_ATTR)  # stale: the cache changed under it
    module.__dict__[PENDING_ATTR] = _Pending(weakref.ref(cache), idx, armed)
    return None


def attach(module: nn.Module) -> None:
    """Install the pre-hook on an attention module (once; a module-level function, so models still deepcopy and
    pickle)."""
    add_pre_hook(module, _pre_hook)


def detach(module: nn.Module) -> None:
    remove_pre_hook(module, _pre_hook, PENDING_ATTR)


def drop_states(cache: Cache) -> None:
    """Forget every recurrent state held by ``cache`` (the next steps take the exact path until a prefill)."""
    for layer in compat.cache_layers(cache):
        if hasattr(layer, STATE_ATTR):
            delattr(layer, STATE_ATTR)


@dataclasses.dataclass(eq=False)
class StepHandle:
    """The cache layer of one attention call and its armed state (None: not armed)."""

    layer: DynamicLayer
    module: nn.Module
    armed: LinearState | None

    def state_for(self, query: torch.Tensor, key: torch.Tensor) -> LinearState | None:
        """The state to pass as ``AttnCall.recurrent``: armed and exactly one key short of this call."""
        st = self.armed
        if st is None or query.shape[2] != 1 or key.shape[2] != st.length + 1:
            return None
        return st

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
        setattr(layer, STATE_ATTR, _Owned(state, weakref.ref(k), weakref.ref(v), (k._version, v._version),
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


def step_handle(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> StepHandle | None:
    """For the attention function: the cache layer this call's keys are, when it can hold a state; None otherwise
    (no cache, another layer type, keys that are not the layer's, under torch.compile). A cached decode step (one
    query, earlier keys, no grad) of a module that has the state's pre-hook but cannot use the state warns once per
    reason: the O(1) step must not turn itself off silently."""
    if torch.compiler.is_compiling():
        return None
    pending = module.__dict__.pop(PENDING_ATTR, None)
    # (cross-attention keeps no state; the hook scan comes last: every attention call of every module passes here)
    decoding = (query.shape[2] == 1 and key.shape[2] > 1 and not torch.is_grad_enabled()
                and getattr(module, "is_causal", True) is not False
                and _pre_hook in module._forward_pre_hooks.values())
    if pending is None:
        if decoding and supports(module):
            _warn_off(module, "no transformers Cache reached the attention module's forward (looked for the "
                              f"keywords {', '.join(compat.CACHE_ARGUMENTS)} and positional arguments)")
        return None
    layer = compat.cache_layer(pending.cache(), pending.layer_idx)
    if layer is None or not compat.plain_dynamic_layer(layer):
        if decoding:
            kind = type(layer).__name__ if layer is not None else type(pending.cache()).__name__
            _warn_off(module, f"its cache layer is a {kind}, not a DynamicLayer (the state follows only the "
                              "default DynamicCache's layers)")
        return None
    keys, values = compat.layer_tensors(layer)
    if keys is not key or values is not value:
        if hasattr(layer, STATE_ATTR):
            delattr(layer, STATE_ATTR)
        if decoding:
            _warn_off(module, "the keys the module passed are not its cache layer's tensors")
        return None
    return StepHandle(layer, module, pending.armed)
