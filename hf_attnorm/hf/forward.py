"""The function transformers calls for every registered name (``AttentionInterface``): it calls the module's
``AttnormState`` for the per-head values, resolves the call (mask, n, scale) and dispatches to a kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..attention import make_call
from ..kernels import attend
from ..registry import AttnormError
from ..settings import AttnormSettings, resolve_settings
from ..torch_compat import is_exporting
from .cache_state import steps_for
from .families import refused_keywords
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


@dataclasses.dataclass(eq=False)  # (records are removed by identity)
class PathRecord:
    """What the most recent attention call under ``record_paths`` ran: its path and ``MaskInfo.kind`` ("given",
    "causal" or "none"); ``paths``: every call's path, in order."""

    path: str = ""
    mask: str = ""
    paths: list[str] = dataclasses.field(default_factory=list)


#: the records being written (record_paths); empty, the attention calls write nothing
_RECORDS: list[PathRecord] = []


@contextlib.contextmanager
def record_paths(record: PathRecord | None = None) -> Iterator[PathRecord]:
    """Record which path each attention call takes inside the block (also inside ``torch.compile``d code)::

        with record_paths() as rec:
            model(**batch)
        rec.path, rec.paths  # e.g. "fused_cpu", ["fused_cpu", "fused_cpu"]

    ``explain(call)`` says why a path was chosen; this says which ran."""
    record = PathRecord() if record is None else record
    _RECORDS.append(record)
    try:
        yield record
    finally:
        _RECORDS.remove(record)


def __getattr__(name: str) -> Any:
    if name == "LAST_CALL":  # (a module-global the attention function used to write on every call)
        raise AttributeError("hf_attnorm.hf.forward.LAST_CALL was removed: record the paths of a block of calls with "
                             "`with hf_attnorm.hf.forward.record_paths() as rec: ...` (rec.path, rec.paths)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: the signature of an attention observer (see ``hf_attention_forward``)
AttentionObserver = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


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
    weights [B, H, Lq, Lk] when output_attentions is requested, else None).

    An observer set on the module's state (``module.attnorm.observer``, e.g. attention transfer in
    ``hf_attnorm.lab.convert``) is called instead, as ``observer(module, query, key, value, attention_mask, scaling,
    kwargs, student)`` where ``student()`` computes this function's own result; it returns what the layer gets."""
    state = state_of(module, implementation)
    observer = state.observer
    if observer is not None:
        def student() -> tuple[torch.Tensor, torch.Tensor | None]:
            return _attend(module, state, query, key, value, attention_mask, scaling, dropout, kwargs)

        return observer(module, query, key, value, attention_mask, scaling, kwargs, student)
    return _attend(module, state, query, key, value, attention_mask, scaling, dropout, kwargs)


def _causal(module: nn.Module, kwargs: Mapping[str, Any]) -> bool:
    """The call's causality: its ``is_causal`` keyword, else the module's attribute (default True)."""
    causal = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", True)) if causal is None else causal


def _score_modifiers(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The keywords of the call that change the scores, as ``make_call`` takes them."""
    return {"bias": kwargs.get("position_bias"), "softcap": kwargs.get("softcap"), "sinks": kwargs.get("s_aux")}


def _attend(module: nn.Module, state: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask: object, scaling: float | None, dropout: float,
            kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    causal = _causal(module, kwargs)
    refused = refused_keywords(kwargs)
    if refused:  # a backstop: modules are checked at load/set time, but **kwargs can carry anything
        raise AttnormError(f"{type(module).__name__} passed {', '.join(refused)} to the attention function, which "
                           "hf_attnorm does not implement; it could change what attention computes, so it is not "
                           "ignored. Use attn_implementation='sdpa' or 'eager' for this call.")
    window = kwargs.get("sliding_window")
    if window is not None and attention_mask is None and key.shape[2] > window:
        # sdpa_mask returns None only when the window cannot matter (fewer keys than the window)
        raise AttnormError(f"{type(module).__name__}: sliding_window={window} with {key.shape[2]} keys but no "
                           "mask; hf_attnorm would attend beyond the window. Build the model's masks with "
                           "transformers' mask functions (sdpa_mask).")
    # state kept on the cache across decoding (hf/cache_state.py): linear attention's recurrent state, selective
    # attention's column sums; a call that cannot be exact is refused here, before any work
    steps = steps_for(module, query, key, value, state.settings, causal)
    call = make_call(
        query, key, value, state.settings, state(query.device), attention_mask, causal, scaling,
        dropout if module.training else 0.0, _weights_requested(kwargs), state.module_info,
        **_score_modifiers(kwargs), heads_checked=True,
    )
    for step in steps:
        step.begin(call, query, key)
    out, weights, path = attend(call)
    for step in steps:
        step.after(call, path)
    if _RECORDS:  # (nothing to do unless record_paths is active)
        for record in _RECORDS:
            record.path, record.mask = path, call.mask.kind
            record.paths.append(path)
    return _to_model_layout(out), weights


def _to_model_layout(out: torch.Tensor) -> torch.Tensor:
    """[B, H, Lq, Dv] -> [B, Lq, H, Dv], contiguous (the layout transformers reshapes). Under torch.export an
    explicit copy: a ``contiguous()`` that is free at trace time (the kernel's output already [B, Lq, H, Dv]-major) is
    dropped from the graph, and the ONNX decomposition, whose SDPA gives another layout, then cannot view it."""
    out = out.transpose(1, 2)
    return out.clone(memory_format=torch.contiguous_format) if is_exporting() else out.contiguous()


@functools.cache
def _softmax_settings() -> AttnormSettings:
    return resolve_settings("softmax", {})


def softmax_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: object, scaling: float | None, kwargs: Mapping[str, Any]) -> torch.Tensor:
    """Plain softmax attention of the same call, as the model's own attention computes it (its mask, scaling,
    causality, softcap, sinks and position bias), without dropout: query [B, H, Lq, D], key/value [B, Hkv, Lk, D]
    -> [B, Lq, H, Dv]. The teacher of attention transfer (``hf_attnorm.lab.convert``)."""
    state = module._modules.get("attnorm")
    info = getattr(state, "module_info", None) or {}
    call = make_call(query, key, value, _softmax_settings(), {}, attention_mask, _causal(module, kwargs), scaling,
                     0.0, False, info, **_score_modifiers(kwargs))
    out, _, _ = attend(call)
    return out.transpose(1, 2).contiguous()


@functools.cache
def forward_for(implementation: str):
    """The function registered under ``implementation`` (a named partial, so tracebacks say which)."""
    fn = functools.partial(hf_attention_forward, implementation=implementation)
    functools.update_wrapper(fn, hf_attention_forward)
    fn.__name__ = f"hf_attnorm_{implementation}"
    return fn
