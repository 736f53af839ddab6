"""Learned memory key/values kept in front of the transformers cache's keys during generation.

With learned memory (``num_mem_kv``, kernels/memory.py) a call's keys are the M memory keys followed by its own, and
its values likewise, so ``make_call`` would copy every cached key and value behind the memory on each decode step
(O(Lk d) per layer and step, as much as the attention reads). Here each ``DynamicLayer`` that served such a call gets
an attribute ``_hf_attnorm_memory`` holding k' = [mem_k, k] and v' = [mem_v, v] in buffers with spare room at the
end; a step writes its new keys and values after the kept ones (amortised O(1) per step) and hands ``make_call``
views of the first M + Lk positions (``memory_kv``), which it uses instead of the copies: the same values.

The state follows the protocol of hf/cache_state.py and the checks of forgetting attention's (hf/forget_cache.py):
armed by the module's pre-hook only while the layer still holds the very key/value tensors the state was made from,
unchanged in place, and the memory parameters are the ones it was made with, unchanged; used only for a call whose
keys are the layer's and whose first Lk - Lq keys the state covers, without autograd, outside torch.compile.
Anything else copies as before, which is exact too, so nothing is refused here: the state only saves work. A
normalizer that keeps a state of its own (linear, selective, fox, cosine) copies as before.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicLayer

from ..kernels.base import AttnCall, repeat_kv
from ..kernels.memory import memory_specs
from ..normalizers.base import Normalizer
from ..registry import NORMALIZERS
from ..settings import AttnormSettings
from . import cache_state, compat
from .cache_state import _none  # (what a pickled state becomes: None)

#: attribute of a transformers cache layer holding its ``MemoryState``
STATE_ATTR = "_hf_attnorm_memory"


@dataclasses.dataclass(eq=False)
class MemoryState:
    """k [B, Hm, M + capacity, D], v [B, Hm, M + capacity, Dv]: the memory (M positions) and then the layer's first
    ``length`` keys and values (Hm: the memory's heads; the rest is spare room), with what they were made from (the
    layer's key/value tensors, weakly, and their versions; the module; its settings and parameter marks)."""

    k: torch.Tensor
    v: torch.Tensor
    memory: int
    length: int
    keys: weakref.ref
    values: weakref.ref
    versions: tuple[int | None, ...]
    module: weakref.ref
    settings: AttnormSettings
    marks: tuple

    def __reduce__(self):
        return _none, ()  # (weak references cannot be pickled: a pickled cache carries no state)

    def matches(self, layer: DynamicLayer, module: nn.Module) -> bool:
        k, v = compat.layer_tensors(layer)
        return (k is not None and self.keys() is k and self.values() is v and self.module() is module
                and cache_state.versions(k, v) == self.versions and cache_state.parameter_marks(module) == self.marks)


def _grown(buf: torch.Tensor, used: int, needed: int) -> torch.Tensor:
    """``buf`` [B, Hm, capacity, d] with room for at least ``needed`` positions (twice as many), ``used`` kept."""
    if buf.shape[2] >= needed:
        return buf
    return F.pad(buf[:, :, :used], (0, 0, 0, max(2 * needed, 64) - used))


@dataclasses.dataclass(eq=False)
class MemoryStep:
    """One call's use of a layer's kept memory and keys: ``inputs`` extends them by the call's new keys and values
    (or builds them) and hands them to ``make_call``; ``after`` keeps them for the layer's new tensors."""

    layer: DynamicLayer
    module: nn.Module
    armed: MemoryState | None
    settings: AttnormSettings
    value: torch.Tensor
    kept: MemoryState | None = None

    def inputs(self, query: torch.Tensor, key: torch.Tensor) -> dict[str, Any]:
        heads = self.module.attnorm(query.device)
        mem_k, mem_v = heads["mem_k"], heads["mem_v"]
        value, st = self.value, self.armed
        b, hkv, lk, _ = key.shape
        hm, m = mem_k.shape[0], mem_k.shape[1]
        if hm % hkv:
            return {}
        rep = hm // hkv
        if (st is not None and st.settings is self.settings and st.k.shape[:2] == (b, hm) and st.memory == m
                and st.k.dtype == key.dtype and st.v.shape[-1] == value.shape[-1]
                and st.length == lk - query.shape[2] and st.length > 0):
            used = m + st.length
            st.k, st.v = _grown(st.k, used, m + lk), _grown(st.v, used, m + lk)
            st.k[:, :, used:m + lk] = repeat_kv(key[:, :, st.length:], rep)
            st.v[:, :, used:m + lk] = repeat_kv(value[:, :, st.length:], rep)
            st.length = lk
        else:  # a prefill (or a state that does not fit): spare room for as many steps as keys
            room = m + lk + max(lk, 64)
            kbuf = key.new_empty(b, hm, room, key.shape[-1])
            vbuf = value.new_empty(b, hm, room, value.shape[-1])
            kbuf[:, :, :m], vbuf[:, :, :m] = mem_k.to(key.dtype), mem_v.to(value.dtype)
            kbuf[:, :, m:m + lk], vbuf[:, :, m:m + lk] = repeat_kv(key, rep), repeat_kv(value, rep)
            st = MemoryState(kbuf, vbuf, m, lk, weakref.ref(key), weakref.ref(value), (-1, -1),
                             weakref.ref(self.module), self.settings, cache_state.parameter_marks(self.module))
        self.kept = st
        return {"memory_kv": (st.k[:, :, :m + lk], st.v[:, :, :m + lk])}

    def begin(self, call: AttnCall, query: torch.Tensor, key: torch.Tensor) -> None:
        return None

    def after(self, call: AttnCall, path: str) -> None:
        layer, st = self.layer, self.kept
        if st is None or torch.is_grad_enabled():
            if hasattr(layer, STATE_ATTR):
                delattr(layer, STATE_ATTR)
            return
        k, v = compat.layer_tensors(layer)
        st.keys, st.values, st.versions = weakref.ref(k), weakref.ref(v), cache_state.versions(k, v)
        setattr(layer, STATE_ATTR, st)


class MemoryKind(cache_state.CacheStateKind):
    """Learned memory's keys and values in front of the cached ones (module docstring)."""

    name = "memory_kv"

    def serves(self, normalizer: Normalizer) -> bool:
        return False  # (learned memory is an option of any normalizer: ``serves_settings``)

    def serves_settings(self, settings: AttnormSettings) -> bool:
        if not memory_specs(settings):
            return False
        norm = NORMALIZERS.get(settings.normalizer)
        return not any(kind.serves(norm) for kind in cache_state.KINDS.values() if kind is not self)

    def arm(self, layer: DynamicLayer, module: nn.Module) -> tuple[MemoryState | None, str]:
        owned = getattr(layer, STATE_ATTR, None)
        if isinstance(owned, MemoryState):
            if compat.plain_dynamic_layer(layer) and owned.matches(layer, module):
                return owned, ""
            delattr(layer, STATE_ATTR)  # stale: the cache (or the memory's parameters) changed under it
        return None, "the cache layer holds no memory keys for its keys"

    def drop(self, layer: DynamicLayer) -> None:
        if hasattr(layer, STATE_ATTR):
            delattr(layer, STATE_ATTR)

    def step(self, module: nn.Module, pending: cache_state.Pending | None, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, settings: AttnormSettings, causal: bool) -> MemoryStep | None:
        """The layer's step when this call's keys are a plain ``DynamicLayer``'s tensors, without autograd; None
        otherwise (the keys are then copied behind the memory)."""
        if pending is None or torch.compiler.is_compiling() or torch.is_grad_enabled():
            return None
        layer = pending.layer()
        if layer is None or not compat.plain_dynamic_layer(layer):
            return None
        keys, values = compat.layer_tensors(layer)
        if keys is not key or values is not value:
            self.drop(layer)
            return None
        return MemoryStep(layer, module, pending.armed, settings, value)


KIND = cache_state.register(MemoryKind())
