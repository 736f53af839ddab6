"""A normalizer's key transform kept on the transformers cache during generation: cosine's l2-normalised keys.

A normalizer that declares a row-wise l2 normalisation of q and k (``Normalizer.qk_norm_eps``: cosine) would
normalise every cached key again on each decode step. Here each ``DynamicLayer`` that served such a call gets an
attribute ``_hf_attnorm_keys`` holding the transformed keys in a buffer with spare room at the end; a step transforms
its new keys only, writes them after the kept ones (amortised O(1) per step) and hands the view of all of them to the
call as ``AttnCall.k_transformed``, which the SDPA path takes instead of transforming the keys (the transform is
row-wise, so each key's is the same whatever keys were transformed with it).

The state follows the protocol of hf/cache_state.py and the checks of hf/recurrent.py: armed by the module's
pre-hook only while the layer still holds the very key/value tensors the state was made from, unchanged in place;
used only for a call whose keys are the layer's and whose first Lk - Lq keys the state covers, without autograd,
without learned memory. Anything else transforms every key, as before, and keeps that for the next step.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicLayer

from ..kernels.base import AttnCall, compute_dtype
from ..kernels.memory import memory_specs
from ..normalizers.base import Normalizer
from ..settings import AttnormSettings
from . import cache_state, compat
from .cache_state import _none  # (what a pickled state becomes: None)

#: attribute of a transformers cache layer holding its ``KeyState``
STATE_ATTR = "_hf_attnorm_keys"


@dataclasses.dataclass(eq=False)
class KeyState:
    """buf [B, Hkv, capacity, D]: the transformed keys of the layer's first ``length`` positions (the rest is spare
    room), with what they were made from (the layer's key/value tensors, weakly, and their versions; the module; its
    settings)."""

    buf: torch.Tensor
    length: int
    keys: weakref.ref
    values: weakref.ref
    versions: tuple[int | None, ...]
    module: weakref.ref
    settings: AttnormSettings

    def __reduce__(self):
        return _none, ()  # (weak references cannot be pickled: a pickled cache carries no state)

    def matches(self, layer: DynamicLayer, module: nn.Module) -> bool:
        k, v = compat.layer_tensors(layer)
        return (k is not None and self.keys() is k and self.values() is v and self.module() is module
                and cache_state.versions(k, v) == self.versions)


def _transform_keys(call: AttnCall, keys: torch.Tensor) -> torch.Tensor:
    """The normalizer's transform of ``keys`` [B, Hkv, n, D] in the call's compute dtype."""
    work = compute_dtype(call.q.dtype)
    return call.normalizer.transform_qk(call.q[:, :1, :1].to(work), keys.to(work), call.ctx())[1]


@dataclasses.dataclass(eq=False)
class KeyStep:
    """One call's use of a layer's kept keys: ``begin`` extends them by the call's new keys (or transforms all of
    them) and sets ``AttnCall.k_transformed``; ``after`` keeps them for the layer's new tensors."""

    layer: DynamicLayer
    module: nn.Module
    armed: KeyState | None
    settings: AttnormSettings
    kept: KeyState | None = None

    def begin(self, call: AttnCall, query: torch.Tensor, key: torch.Tensor) -> None:
        st, lk = self.armed, call.k.shape[2]
        work = compute_dtype(call.q.dtype)
        if (st is not None and st.settings is self.settings and st.buf.dtype == work
                and st.buf.shape[0] == call.k.shape[0] and st.length == lk - query.shape[2] and st.length > 0):
            if st.buf.shape[2] < lk:  # room for twice as many keys: amortised O(1) per step
                st.buf = F.pad(st.buf[:, :, :st.length], (0, 0, 0, max(2 * lk, 64) - st.length))
            st.buf[:, :, st.length:lk] = _transform_keys(call, call.k[:, :, st.length:])
            st.length = lk
            self.kept = st
        else:
            full = _transform_keys(call, call.k)
            buf = F.pad(full, (0, 0, 0, max(lk, 64)))  # (a prefill: spare room for as many steps as keys)
            self.kept = KeyState(buf, lk, weakref.ref(key), weakref.ref(key), (-1, -1), weakref.ref(self.module),
                                 self.settings)
        call.k_transformed = self.kept.buf[:, :, :lk]

    def after(self, call: AttnCall, path: str) -> None:
        layer, st = self.layer, self.kept
        if st is None or torch.is_grad_enabled():
            if hasattr(layer, STATE_ATTR):
                delattr(layer, STATE_ATTR)
            return
        k, v = compat.layer_tensors(layer)
        st.keys, st.values, st.versions = weakref.ref(k), weakref.ref(v), cache_state.versions(k, v)
        setattr(layer, STATE_ATTR, st)


class KeyKind(cache_state.CacheStateKind):
    """The transformed keys of the cached positions (module docstring)."""

    name = "transformed_keys"

    def serves(self, normalizer: Normalizer) -> bool:
        return normalizer.qk_norm_eps is not None and type(normalizer).transform_qk is not Normalizer.transform_qk

    def arm(self, layer: DynamicLayer, module: nn.Module) -> tuple[KeyState | None, str]:
        owned = getattr(layer, STATE_ATTR, None)
        if isinstance(owned, KeyState):
            if compat.plain_dynamic_layer(layer) and owned.matches(layer, module):
                return owned, ""
            delattr(layer, STATE_ATTR)  # stale: the cache changed under it
        return None, "the cache layer holds no transformed keys for its keys"

    def drop(self, layer: DynamicLayer) -> None:
        if hasattr(layer, STATE_ATTR):
            delattr(layer, STATE_ATTR)

    def step(self, module: nn.Module, pending: cache_state.Pending | None, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, settings: AttnormSettings, causal: bool) -> KeyStep | None:
        """The layer's step when this call's keys are a plain ``DynamicLayer``'s tensors, no grad, no learned
        memory; None otherwise (every key is then transformed by the path)."""
        if pending is None or torch.compiler.is_compiling() or torch.is_grad_enabled() or memory_specs(settings):
            return None
        layer = pending.layer()
        if layer is None or not compat.plain_dynamic_layer(layer):
            return None
        keys, values = compat.layer_tensors(layer)
        if keys is not key or values is not value:
            self.drop(layer)
            return None
        return KeyStep(layer, module, pending.armed, settings)


KIND = cache_state.register(KeyKind())
