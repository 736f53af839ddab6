"""Forgetting attention's cumulative gates kept on the transformers cache during generation.

A call of a normalizer with forget gates (fox) adds the decay F_ij = c_{p_i} - c_j, c the cumulative log forget gates
over the keys in float64 (``make_call``), and each gate reads its cached value. Without a state each cached step
would recompute every gate and the whole cumulative sum; here each ``DynamicLayer`` that served such a call gets an
attribute ``_hf_attnorm_forget`` holding c [B, H, L] of its cached keys, and a step computes the gates of its new
keys only, continuing the sum from c's last entry (the same float64 additions in the same order: the result is the
one the whole sum gives).

The state follows the protocol of hf/cache_state.py and the checks of linear attention's state (hf/recurrent.py):
armed by the module's pre-hook only while the layer still holds the very key/value tensors the state was made from,
unchanged in place, and the per-head gate parameters are the ones it was made with, unchanged; used only for a call
whose keys are the layer's and whose first Lk - Lq keys the state covers. Anything else (beam reordering, cropping,
another cache layer type, a learned memory, autograd, torch.compile) computes c from every value as before, which is
exact too, so nothing is refused here: the state only saves work.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

from ..kernels.base import AttnCall
from ..kernels.memory import memory_specs
from ..normalizers.base import Normalizer
from ..settings import AttnormSettings
from . import cache_state, compat
from .cache_state import _none  # (what a pickled state becomes: None)

#: attribute of a transformers cache layer holding its ``ForgetState``
STATE_ATTR = "_hf_attnorm_forget"


def _parameter_marks(module: nn.Module) -> tuple:
    """(identity, version) of each learnable per-head value of the module's state: the gates read them."""
    state = getattr(module, "attnorm", None)
    params = dict(state.named_parameters(recurse=False)) if isinstance(state, nn.Module) else {}
    return tuple((name, id(p), *cache_state.versions(p)) for name, p in sorted(params.items()))


@dataclasses.dataclass(eq=False)
class ForgetState:
    """c [B, H, L] (float64, or float32 on MPS): the cumulative log forget gates of the layer's L cached keys, with
    what it was made from (the layer's key/value tensors, weakly, and their versions; the module; its settings and
    parameter marks)."""

    c: torch.Tensor
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
                and cache_state.versions(k, v) == self.versions and _parameter_marks(module) == self.marks)


@dataclasses.dataclass(eq=False)
class ForgetStep:
    """One call's use of a layer's state: ``inputs`` hands ``make_call`` the cumulative gates of the keys the state
    covers; ``after`` keeps the call's gates for the layer's new tensors."""

    layer: DynamicLayer
    module: nn.Module
    armed: ForgetState | None
    settings: AttnormSettings

    def inputs(self, query: torch.Tensor, key: torch.Tensor) -> dict[str, Any]:
        st = self.armed
        if (st is None or st.settings is not self.settings or st.c.shape[0] != key.shape[0]
                or st.c.shape[-1] != key.shape[2] - query.shape[2] or st.c.shape[-1] == 0):
            return {}
        return {"forget_prefix": st.c}

    def begin(self, call: AttnCall, query: torch.Tensor, key: torch.Tensor) -> None:
        return None

    def after(self, call: AttnCall, path: str) -> None:
        layer = self.layer
        if call.forget is None or (call.around is not None and call.around.memory) or torch.is_grad_enabled():
            if hasattr(layer, STATE_ATTR):
                delattr(layer, STATE_ATTR)
            return
        k, v = compat.layer_tensors(layer)
        setattr(layer, STATE_ATTR, ForgetState(call.forget, weakref.ref(k), weakref.ref(v), cache_state.versions(k, v),
                                               weakref.ref(self.module), self.settings,
                                               _parameter_marks(self.module)))


class ForgetKind(cache_state.CacheStateKind):
    """The cumulative forget gates of the cached keys (module docstring)."""

    name = "forget_gates"

    def serves(self, normalizer: Normalizer) -> bool:
        return type(normalizer).forget_gates is not Normalizer.forget_gates

    def arm(self, layer: DynamicLayer, module: nn.Module) -> tuple[ForgetState | None, str]:
        owned = getattr(layer, STATE_ATTR, None)
        if isinstance(owned, ForgetState):
            if compat.plain_dynamic_layer(layer) and owned.matches(layer, module):
                return owned, ""
            delattr(layer, STATE_ATTR)  # stale: the cache (or the gate's parameters) changed under it
        return None, "the cache layer holds no cumulative gates for its keys"

    def drop(self, layer: DynamicLayer) -> None:
        if hasattr(layer, STATE_ATTR):
            delattr(layer, STATE_ATTR)

    def step(self, module: nn.Module, pending: cache_state.Pending | None, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, settings: AttnormSettings, causal: bool) -> ForgetStep | None:
        """The layer's step when this call's keys are a plain ``DynamicLayer``'s tensors, no grad, no learned
        memory (its columns come first); None otherwise (c is then computed from every value)."""
        if pending is None or torch.compiler.is_compiling() or torch.is_grad_enabled() or memory_specs(settings):
            return None
        layer = pending.layer()
        if layer is None or not compat.plain_dynamic_layer(layer):
            return None
        keys, values = compat.layer_tensors(layer)
        if keys is not key or values is not value:
            self.drop(layer)
            return None
        return ForgetStep(layer, module, pending.armed, settings)


KIND = cache_state.register(ForgetKind())
