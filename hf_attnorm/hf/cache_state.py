"""Per-sequence state kept on a transformers cache across cached decoding: one protocol for every normalizer that
needs one (linear attention's recurrent state, ``recurrent.py``; selective attention's column sums,
``selective_cache.py``; forgetting attention's cumulative gates, ``forget_cache.py``; cosine's normalised keys,
``key_cache.py``; the next stateful variant registers another kind here).

A state lives on a cache layer (an attribute of the ``DynamicLayer``), so it lives and dies with the cache. The
attention function never sees the cache, so each attention module that serves a stateful normalizer gets one forward
pre-hook (``sync`` installs or removes it as the module's normalizer changes). The hook leaves the attention function
one note per call (``CallNote`` under ``NOTE_ATTR``), which also says whether the call came packed from continuous
batching (``mark_packed``: the module received the paged cache): one side channel for both. For every kind that
serves the module's normalizer:

1. the pre-hook, BEFORE the module appends its new keys, finds the cache and the layer and asks the kind to ``arm``
   the layer's state: the state only if it still describes exactly the layer's tensors (else None, and why);
2. the attention function (``steps_for``) asks the kind for a ``CacheStep`` of this call (or None: no state is
   involved), before the call is resolved, so a call that cannot be exact is refused before any work;
3. ``CacheStep.inputs(query, key)`` (optional) gives ``make_call`` what the state saves it computing (forgetting
   attention's ``forget_prefix``); ``CacheStep.begin(call)`` puts the state on the resolved call
   (``AttnCall.recurrent``, ``AttnCall.selective_carry``), and ``CacheStep.after(call, path)`` records the state for
   the layer's new tensors (advanced, rebuilt, or dropped).

Nothing here reads a tensor's values: identity, shape and version checks on the host (``versions``: by identity
alone for tensors made under ``torch.inference_mode``, which keep no version counter). Under ``torch.compile`` the
pre-hook does nothing (nothing may persist across a graph) and each kind says what its calls do there.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from ..kernels.base import AttnCall
from ..normalizers.base import Normalizer
from ..registry import NORMALIZERS
from ..settings import AttnormSettings
from . import compat

#: attribute of an attention module: the pre-hook's note for the call in progress (``CallNote``), read and cleared by
#: the attention function; None when there is nothing to say
NOTE_ATTR = "_hf_attnorm_call"
#: attribute of an attention module: True once continuous batching runs it (``mark_packed``), so its pre-hook also
#: notes whether a call received the paged cache
PACKED_MARK = "_hf_attnorm_packed_calls"


def _none() -> None:
    return None


def versions(*tensors: torch.Tensor) -> tuple[int | None, ...]:
    """The tensors' version counters (an in-place write bumps one), the check that a kept state still describes a
    cache layer's tensors. An inference tensor (made under ``torch.inference_mode``) keeps no counter: None there,
    so such a state is checked by the tensors' identity alone (transformers' DynamicLayer replaces its tensors on
    every update, crop, reorder and batch change instead of writing into them)."""
    return tuple(None if t.is_inference() else t._version for t in tensors)


@dataclasses.dataclass(eq=False)
class Pending:
    """What the pre-hook saw for one kind: the cache (weakly), the layer index, the armed state (None: none valid)
    and why there is none."""

    cache: weakref.ref
    layer_idx: int
    armed: Any
    why: str

    def __reduce__(self):
        # a note for one call in progress: a pickled or copied module carries none (weak references cannot pickle)
        return _none, ()

    def layer(self) -> Any:
        """The cache layer (None when the cache is gone or has no such layer)."""
        cache = self.cache()
        return None if cache is None else compat.cache_layer(cache, self.layer_idx)


class CallNote(NamedTuple):
    """What the pre-hook saw for one call of an attention module: whether it came packed from continuous batching
    (the module received the paged cache) and, per kind serving the module's normalizer, its ``Pending`` (None: no
    cache reached the module, a packed call, or none serves it)."""

    packed: bool = False
    pending: dict[str, Pending] | None = None


class CacheStep(Protocol):
    """One attention call's use of a kind's state (``inputs``, optional: keywords for ``make_call``, before it)."""

    def begin(self, call: AttnCall, query: torch.Tensor, key: torch.Tensor) -> None:
        """Put the state on the resolved call (or raise when it cannot make the call exact)."""

    def after(self, call: AttnCall, path: str) -> None:
        """Record the state for the layer's tensors after the call (advanced, rebuilt or dropped)."""


class CacheStateKind:
    """A kind of per-sequence state (subclass, instantiate once, ``register``)."""

    #: the kind's name (the key of its pre-hook note)
    name: str = ""

    def serves(self, normalizer: Normalizer) -> bool:
        """Whether calls of ``normalizer`` keep this state."""
        raise NotImplementedError

    def arm(self, layer: Any, module: nn.Module) -> tuple[Any, str]:
        """In the pre-hook: (the layer's state if it is valid for this module's next call, else None; why not).
        May drop a stale state from the layer."""
        raise NotImplementedError

    def step(self, module: nn.Module, pending: Pending | None, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, settings: AttnormSettings, causal: bool) -> CacheStep | None:
        """In the attention function: this call's step, or None. ``pending`` is the pre-hook's note (None: no cache
        reached the module's forward, or under torch.compile)."""
        raise NotImplementedError

    def drop(self, layer: Any) -> None:
        """Forget the state ``layer`` holds (``drop_states``)."""
        raise NotImplementedError


#: every registered kind, by name
KINDS: dict[str, CacheStateKind] = {}


def register(kind: CacheStateKind) -> CacheStateKind:
    if not kind.name or kind.name in KINDS:
        raise ValueError(f"cache state kinds need a unique name; got {kind.name!r} (registered: {sorted(KINDS)})")
    KINDS[kind.name] = kind
    return kind


def kinds_serving(normalizer: str) -> list[CacheStateKind]:
    norm = NORMALIZERS.get(normalizer)
    return [kind for kind in KINDS.values() if kind.serves(norm)]


def _module_kinds(module: nn.Module) -> list[CacheStateKind]:
    settings = getattr(module._modules.get("attnorm"), "settings", None)
    return [] if settings is None else kinds_serving(settings.normalizer)


def _pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    # (getattr, not __dict__.get: what Dynamo traces when a compiled model runs continuous batching)
    if getattr(module, PACKED_MARK, False) and compat.paged_cache_in_call(args, kwargs):
        module.__dict__[NOTE_ATTR] = CallNote(True)  # (no transformers Cache: no state kept across calls)
        return None
    if torch.compiler.is_compiling():  # (nothing may persist across a graph)
        return None
    kinds = _module_kinds(module)
    cache = compat.cache_of_call(args, kwargs) if kinds else None
    idx = getattr(module, "layer_idx", None)
    if cache is None or not isinstance(idx, int):  # no cache reached the module: nothing to say
        module.__dict__[NOTE_ATTR] = None
        return None
    layer = compat.cache_layer(cache, idx)
    notes: dict[str, Pending] = {}
    for kind in kinds:
        armed, why = (None, "the cache has no layer for this module") if layer is None else kind.arm(layer, module)
        notes[kind.name] = Pending(weakref.ref(cache), idx, armed, why)
    module.__dict__[NOTE_ATTR] = CallNote(False, notes)
    return None


def take_note(module: nn.Module) -> CallNote | None:
    """The pre-hook's note for the call in progress, cleared (each note serves one call). Under torch.compile only a
    packed call's note is read (the hook writes no other there) and nothing is cleared but it."""
    if torch.compiler.is_compiling():
        note = getattr(module, NOTE_ATTR, None)  # (getattr, not __dict__: what Dynamo of torch 2.11 traces)
        if note is None or not note.packed:
            return None
    else:
        note = module.__dict__.get(NOTE_ATTR)  # (an eager call: a dict lookup, not nn.Module's __getattr__)
        if note is None:
            return None
    module.__dict__[NOTE_ATTR] = None
    return note


def hooked(module: nn.Module) -> bool:
    """Whether the module carries the pre-hook."""
    return _pre_hook in module._forward_pre_hooks.values()


def sync(module: nn.Module) -> None:
    """Install the pre-hook when the module's normalizer keeps a state or continuous batching runs it
    (``mark_packed``), remove it otherwise (once; a module-level function, so models still deepcopy and pickle)."""
    if not _module_kinds(module) and not getattr(module, PACKED_MARK, False):
        detach(module)
    elif not hooked(module):
        module.register_forward_pre_hook(_pre_hook, with_kwargs=True)


def mark_packed(modules: Iterable[nn.Module]) -> None:
    """Continuous batching runs these attention modules: their pre-hook (installed here, once per module) also notes
    whether a call comes packed from it (the module received the paged cache), so that only such calls may carry
    the manager's keywords."""
    for module in modules:
        module.__dict__[PACKED_MARK] = True
        sync(module)


def detach(module: nn.Module) -> None:
    """Remove the pre-hook, its note and the continuous-batching mark from the module."""
    for key, fn in list(module._forward_pre_hooks.items()):
        if fn is _pre_hook:
            del module._forward_pre_hooks[key]
            module._forward_pre_hooks_with_kwargs.pop(key, None)
    module.__dict__.pop(NOTE_ATTR, None)
    module.__dict__.pop(PACKED_MARK, None)


def drop_states(cache: Any, kinds: list[str] | None = None) -> None:
    """Forget every state (of ``kinds``, default all) that ``cache`` holds."""
    chosen = [KINDS[name] for name in kinds] if kinds is not None else list(KINDS.values())
    for layer in compat.cache_layers(cache):
        for kind in chosen:
            kind.drop(layer)


def steps_for(module: nn.Module, note: CallNote | None, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              settings: AttnormSettings, causal: bool) -> list[CacheStep]:
    """The steps of this attention call, one per kind serving its normalizer that keeps state for it (usually
    none or one), from the pre-hook's ``note`` for the call (``take_note``)."""
    kinds = kinds_serving(settings.normalizer)
    if not kinds:
        return []
    notes = None if note is None else note.pending
    steps = []
    for kind in kinds:
        pending = notes.get(kind.name) if notes else None
        step = kind.step(module, pending, query, key, value, settings, causal)
        if step is not None:
            steps.append(step)
    return steps
