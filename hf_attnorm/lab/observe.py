"""Observing a model's attention calls from the lab: attention transfer and the calibrated start (``convert/``), and
tests that look at what a call receives.

The plugin core has no observer. While a module is observed, the function registered in transformers'
``AttentionInterface`` under the implementation name it runs is replaced by a wrapper that looks the calling module
up: an observed module's call goes to its observer, any other module's straight to the function wrapped. When no
module is observed any more, the original functions are registered again, so a model nobody observes pays nothing.

An observer is called as ``observer(module, query, key, value, attention_mask, scaling, kwargs, student)`` (query
[B, H, Lq, D], key/value [B, Hkv, Lk, D]; ``kwargs``: the call's other keywords; ``student()`` computes the call as
the module would have) and returns what the layer gets: (out [B, Lq, H, Dv], weights or None).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..hf.families import attention_modules

Result = tuple[torch.Tensor, torch.Tensor | None]
Observer = Callable[..., Result]

#: observed attention module -> its observer (a module dropped by its model leaves on its own)
_OBSERVERS: weakref.WeakKeyDictionary[nn.Module, Observer] = weakref.WeakKeyDictionary()
#: implementation name -> the function registered under it before it was wrapped
_ORIGINALS: dict[str, Callable[..., Result]] = {}
_LOCK = threading.Lock()


def _wrapper(original: Callable[..., Result]) -> Callable[..., Result]:
    def observed(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: object, scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> Result:
        observer = _OBSERVERS.get(module)
        if observer is None:
            return original(module, query, key, value, attention_mask, scaling, dropout, **kwargs)

        def student() -> Result:
            return original(module, query, key, value, attention_mask, scaling, dropout, **kwargs)

        return observer(module, query, key, value, attention_mask, scaling, kwargs, student)

    observed.__name__ = f"observed_{getattr(original, '__name__', 'attention')}"
    observed.__wrapped__ = original  # type: ignore[attr-defined]
    return observed


def _implementation(module: nn.Module) -> str | None:
    """The hf_attnorm implementation ``module`` runs (its state's settings), or None for a module hf_attnorm does not
    run (a PEFT wrapper of the state forwards ``settings``)."""
    settings = getattr(getattr(module, "attnorm", None), "settings", None)
    return getattr(settings, "implementation", None)


def observe(modules: Iterable[nn.Module], observer: Observer | None) -> int:
    """Put ``observer`` on (None: take any off) each attention module of ``modules`` that hf_attnorm runs; returns
    how many there were. Safe to call again after a module's implementation changed (its new name is wrapped)."""
    count = 0
    with _LOCK:
        for module in modules:
            name = _implementation(module)
            if name is None:
                continue
            count += 1
            if observer is None:
                _OBSERVERS.pop(module, None)
                continue
            _OBSERVERS[module] = observer
            if name not in _ORIGINALS:
                _ORIGINALS[name] = ALL_ATTENTION_FUNCTIONS[name]
                AttentionInterface.register(name, _wrapper(_ORIGINALS[name]))
        if not _OBSERVERS:
            for name, original in _ORIGINALS.items():
                AttentionInterface.register(name, original)
            _ORIGINALS.clear()
    return count


def observe_model(model: nn.Module, observer: Observer | None) -> int:
    """``observe`` on every attention module of ``model`` (under a PEFT wrapper too); returns how many hf_attnorm
    runs."""
    return observe([mod for _, mod in attention_modules(model)], observer)


@contextlib.contextmanager
def observing(model: nn.Module, observer: Observer | None) -> Iterator[int]:
    """``observer`` on every hf_attnorm attention module of ``model`` for the block, taken off after it (also on an
    error); yields how many modules carry it."""
    modules = [mod for _, mod in attention_modules(model)]
    count = observe(modules, observer)
    try:
        yield count
    finally:
        observe(modules, None)


def observed_names() -> list[str]:
    """The implementation names whose registered function is wrapped now (empty when nothing is observed)."""
    with _LOCK:
        return sorted(_ORIGINALS)
