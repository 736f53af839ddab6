"""The function transformers calls for every registered name (``AttentionInterface``): it calls the module's
``AttnormState`` for the per-head values, resolves the call (mask, n, scale) and dispatches to a kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..attention import make_call
from ..kernels import attend
from .state import state_of

try:  # transformers' collector of requested outputs (private; looked up once, not per call)
    from transformers.utils.output_capturing import _active_collector
except (ImportError, AttributeError):  # pragma: no cover - older transformers without it
    _active_collector = None


def _weights_requested(kwargs: Mapping[str, Any]) -> bool:
    if kwargs.get("output_attentions"):
        return True
    if _active_collector is None or torch.compiler.is_compiling():
        return False  # (the collector is a ContextVar, which dynamo cannot trace)
    collected = _active_collector.get()
    return isinstance(collected, dict) and ("attentions" in collected or "cross_attentions" in collected)


@dataclasses.dataclass
class _LastCall:
    path: str = ""


#: the path the most recent call took (for tests and benchmarks)
LAST_CALL = _LastCall()


def hf_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: object,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    implementation: str,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The AttentionInterface function. query [B, H, Lq, D], key/value [B, Hkv, Lk, D] -> (out [B, Lq, H, Dv],
    weights [B, H, Lq, Lk] when output_attentions is requested, else None)."""
    state = state_of(module, implementation)
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = bool(getattr(module, "is_causal", True))
    if kwargs.get("position_bias") is not None:
        raise ValueError("hf_attnorm does not support additive position biases (position_bias)")
    if kwargs.get("softcap") is not None:
        raise ValueError("hf_attnorm does not support logit soft-capping (softcap)")
    if kwargs.get("sliding_window") is not None and attention_mask is None:
        warnings.warn("hf_attnorm: sliding_window given without a mask; full causal attention is used", stacklevel=2)
    call = make_call(
        query, key, value, state.settings, state(query.device), attention_mask, causal, scaling,
        dropout if module.training else 0.0, _weights_requested(kwargs), state.module_info,
    )
    out, weights, path = attend(call)
    LAST_CALL.path = path
    return out.transpose(1, 2).contiguous(), weights


@functools.cache
def forward_for(implementation: str):
    """The function registered under ``implementation`` (a named partial, so tracebacks say which)."""
    fn = functools.partial(hf_attention_forward, implementation=implementation)
    functools.update_wrapper(fn, hf_attention_forward)
    fn.__name__ = f"hf_attnorm_{implementation}"
    return fn
