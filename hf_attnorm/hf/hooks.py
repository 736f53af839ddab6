"""The forward pre-hooks that keep per-cache state for an attention module (``recurrent.py``: linear attention's
state; ``selective_cache.py``: selective attention's column sums): installed once, removed with what they left on
the module."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def add_pre_hook(module: nn.Module, hook: Callable) -> None:
    """Install ``hook`` (a module-level function, so models still deepcopy and pickle) as a keyword pre-hook, once."""
    if hook not in module._forward_pre_hooks.values():
        module.register_forward_pre_hook(hook, with_kwargs=True)


def remove_pre_hook(module: nn.Module, hook: Callable, pending_attr: str) -> None:
    """Remove ``hook`` from ``module`` and the per-call note it keeps in ``module.__dict__[pending_attr]``."""
    for key, fn in list(module._forward_pre_hooks.items()):
        if fn is hook:
            del module._forward_pre_hooks[key]
            module._forward_pre_hooks_with_kwargs.pop(key, None)
    module.__dict__.pop(pending_attr, None)
