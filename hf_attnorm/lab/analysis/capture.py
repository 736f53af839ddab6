"""Capture what an attention function receives — q after RoPE, k, the mask, the model's scaling — without changing
what the model computes.

``capture_attention(model, callback)`` wraps, for the duration of a ``with`` block, the function transformers looks
up for the model's attention implementation (``sdpa``, any hf_attnorm name, ``eager``...) in the global
``AttentionInterface`` mapping: the wrapper hands the call to ``callback`` and then runs the original function, so
outputs are unchanged. The mapping is global: do not run two captures of different models concurrently.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from ...hf.families import attention_modules
from ...masks import build_mask_info

#: callback(module, layer, q [B, H, Lq, D], k [B, Hkv, Lk, D], keep bool [B|1, 1|H, Lq, Lk], scaling)
Callback = Callable[[nn.Module, int, torch.Tensor, torch.Tensor, torch.Tensor, float], None]


def _eager_for(module: nn.Module) -> Callable:
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(f"cannot capture attention of {type(module).__name__}: its modeling file has no "
                           "eager_attention_forward; load the model with attn_implementation='sdpa'")
    return fn


@contextlib.contextmanager
def capture_attention(model: nn.Module, callback: Callback) -> Iterator[dict[nn.Module, int]]:
    """Call ``callback`` for every attention call of ``model`` inside the block. Yields module -> layer index
    (the module's ``layer_idx``, else its order in the model). A module whose attention bypasses the interface
    (GPT-2 eager with ``reorder_and_upcast_attn``) never reaches the callback: callers check that every layer did."""
    modules = [m for _, m in attention_modules(model)]
    if not modules:
        raise ValueError(f"{type(model).__name__} has no attention modules that call the attention interface")
    layers = {m: (m.layer_idx if isinstance(getattr(m, "layer_idx", None), int) else i) for i, m in
              enumerate(modules)}
    impls = {m.config._attn_implementation for m in modules}
    mapping = AttentionInterface._global_mapping
    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    saved: dict[str, tuple[dict, Any]] = {}

    def make_wrapper(original: Callable | None) -> Callable:
        def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
            fn = original or _eager_for(module)
            if module in layers:
                scaling = kwargs.get("scaling")
                if scaling is None:  # what sdpa and eager use when no scaling is passed
                    scaling = query.shape[-1] ** -0.5
                causal = kwargs.get("is_causal")
                if causal is None:
                    causal = bool(getattr(module, "is_causal", False))
                b, h, lq, _ = query.shape
                keep = build_mask_info(attention_mask, b, h, lq, key.shape[2], causal, query.device).dense()
                callback(module, layers[module], query.detach(), key.detach(), keep, float(scaling))
            return fn(module, query, key, value, attention_mask, *args, **kwargs)

        return wrapper

    try:
        for impl in impls:
            if impl is None:
                raise ValueError("the model has no attention implementation set (config._attn_implementation)")
            where = local if impl in local else mapping
            if impl not in where and impl != "eager":
                raise ValueError(f"attention implementation {impl!r} is not registered in transformers' "
                                 "AttentionInterface; cannot capture it")
            saved[impl] = (where, where.get(impl, _MISSING))
            where[impl] = make_wrapper(where.get(impl))
        yield layers
    finally:
        for impl, (where, original) in saved.items():
            if original is _MISSING:
                where.pop(impl, None)
            else:
                where[impl] = original


_MISSING = object()
