"""The function transformers calls for every registered name (``AttentionInterface``): it calls the module's
``AttnormState`` for the per-head values, resolves the call (mask, n, scale) and dispatches to a kernel.

Call plans: what can be decided from the module, its settings, the tensors' dtypes, device and head shapes, the kind
of mask and the phase (one query, as in a cached decode step, or several) is decided once per module and kept
(``CallPlan``, by plan key): the path the rule chooses (a ``kernels.Route``), whether a cache state is involved, and
for plain calls a path's direct entry on the raw tensors. A changed fact (settings edited, dtype or device moved, a
new kind of mask, train/eval, a path registered or forced) is a new key, so a new plan. Plans are made only without
autograd and outside torch.compile / torch.export; every other call is decided in full, as ``explain`` reports.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..attention import make_call
from ..kernels import PATHS, Route, attend, plan_epoch, route, run_on, run_routed
from ..kernels.base import one_query_ctx
from ..kernels.reference import reference_scores
from ..normalizers.base import Normalizer
from ..registry import AttnormError
from ..settings import AttnormSettings, resolve_settings
from ..torch_compat import is_exporting
from . import continuous_batching
from .cache_state import kinds_serving, steps_for, take_note
from .families import key_selection, refused_keywords
from .state import AttnormState, state_of

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
    "causal" or "none"); ``paths``: every call's path, in order (one per sequence of a call split per sequence),
    eager calls only (in a compiled graph ``path`` and ``mask`` are written, which Dynamo does without a guard)."""

    path: str = ""
    mask: str = ""
    paths: list[str] = dataclasses.field(default_factory=list)
    #: how many eager calls came packed from transformers' continuous batching (``generate_batch``)
    packed: int = 0


#: the records of this context (thread, asyncio task) being written (record_paths); empty, eager calls write nothing
_RECORDS: contextvars.ContextVar[tuple[PathRecord, ...]] = contextvars.ContextVar("hf_attnorm_records", default=())
#: the records of every thread's eager calls (``record_paths(all_threads=True)``: a command that owns its process)
_PROCESS_RECORDS: list[PathRecord] = []
#: every record, for traced calls (Dynamo cannot read a ContextVar)
_TRACED_RECORDS: list[PathRecord] = []


@contextlib.contextmanager
def record_paths(record: PathRecord | None = None, *, all_threads: bool = False) -> Iterator[PathRecord]:
    """Record which path each attention call takes inside the block (also inside ``torch.compile``d code)::

        with record_paths() as rec:
            model(**batch)
        rec.path, rec.paths  # e.g. "fused_cpu", ["fused_cpu", "fused_cpu"]

    The records belong to the context (a thread, an asyncio task): calls that other threads make meanwhile (a
    server's) are not recorded; ``all_threads=True`` records every thread's calls instead (for a command that owns
    its process). A ``torch.compile``d graph, which cannot read the context, writes ``path`` and ``mask`` of the
    records active in any thread when it was traced. ``explain(call)`` says why a path was chosen; this says which
    ran."""
    record = PathRecord() if record is None else record
    token = None if all_threads else _RECORDS.set((*_RECORDS.get(), record))
    if all_threads:
        _PROCESS_RECORDS.append(record)
    _TRACED_RECORDS.append(record)
    try:
        yield record
    finally:
        _TRACED_RECORDS.remove(record)
        if token is None:
            _PROCESS_RECORDS.remove(record)
        else:
            try:
                _RECORDS.reset(token)
            except ValueError:  # (left in another context than it was entered in: drop this record only)
                _RECORDS.set(tuple(r for r in _RECORDS.get() if r is not record))


def _active_records() -> tuple[PathRecord, ...] | list[PathRecord]:
    """The records an attention call writes: its context's and the process-wide ones, or under torch.compile all."""
    if torch.compiler.is_compiling():
        return _TRACED_RECORDS
    own = _RECORDS.get()
    return (*own, *_PROCESS_RECORDS) if _PROCESS_RECORDS else own


def __getattr__(name: str) -> Any:
    if name == "LAST_CALL":  # (a module-global the attention function used to write on every call)
        raise AttributeError("hf_attnorm.hf.forward.LAST_CALL was removed: record the paths of a block of calls with "
                             "`with hf_attnorm.hf.forward.record_paths() as rec: ...` (rec.path, rec.paths)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    return _attend(module, state_of(module, implementation), query, key, value, attention_mask, scaling, dropout,
                   kwargs)


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
    # the module's pre-hook note for this call (hf/cache_state.py): a packed call from continuous batching, or what
    # a state kept on the cache found there
    note = take_note(module)
    causal = _causal(module, kwargs)
    if note is not None and note.packed:
        out = continuous_batching.attend_packed(module, state, query, key, value, attention_mask, causal, scaling,
                                                dropout, kwargs, _compute)
        if not torch.compiler.is_compiling():  # (traced, the count guards on its value: a recompile a call)
            for record in _active_records():
                record.packed += 1
        return _to_model_layout(out), None
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
    # a sparse indexer's choice of keys (indices, block_indices), which eager/sdpa get folded into their mask
    selection = key_selection(module, state.module_info, kwargs, key.shape[2])
    weights_requested = _weights_requested(kwargs)
    plan_key = None if selection is not None else _plan_key(module, state, query, key, value, attention_mask,
                                                             causal, scaling, dropout, weights_requested, kwargs)
    plan = None if plan_key is None else _kept_plan(module, state, plan_key)
    if plan is not None and plan.direct is not None:  # a plain call: the path's entry on the raw tensors
        plan.uses += 1
        heads = (state(query.device) if plan.constants is None else plan.constants) if plan.heads else {}
        out = plan.direct(query, key, value, heads)
        _record(plan.path, plan.mask)
        return _to_model_layout(out), None
    # state kept on the cache across decoding (hf/cache_state.py): linear attention's recurrent state, selective
    # attention's column sums; a call that cannot be exact is refused here, before any work
    steps = steps_for(module, note, query, key, value, state.settings, causal) if plan is None or plan.kinds else []
    out, weights = _compute(module, state, query, key, value, attention_mask, causal, scaling, dropout, kwargs, steps,
                            selection, plan_key, plan)
    return _to_model_layout(out), weights


def _compute(module: nn.Module, state: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: object, causal: bool, scaling: float | None, dropout: float, kwargs: Mapping[str, Any],
             steps: list, selection: torch.Tensor | None = None, plan_key: tuple | None = None,
             plan: CallPlan | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One resolved call: query [B, H, Lq, D], key/value [B, Hkv, Lk, D], selection None or bool
    [B, 1 | Hs, Lq, Lk] -> (out [B, H, Lq, Dv], weights or None). With a plan key, the path comes from the
    module's plan for it (made here on the key's first call)."""
    inputs: dict[str, Any] = {}
    for step in steps:  # (what a kept cache state hands make_call: forgetting attention's cumulative gates)
        inputs.update(step.inputs(query, key) if hasattr(step, "inputs") else {})
    call = make_call(
        query, key, value, state.settings, state(query.device), attention_mask, causal, scaling,
        dropout if module.training else 0.0, _weights_requested(kwargs), state.module_info,
        **_score_modifiers(kwargs), selection=selection, heads_checked=True, **inputs,
    )
    for step in steps:
        step.begin(call, query, key)
    if plan_key is None:
        out, weights, path = attend(call)
    else:
        out, weights, path = _planned(module, state, plan_key, plan, call, attention_mask, kwargs)
    for step in steps:
        step.after(call, path)
    _record(path, call.mask.kind)
    return out, weights


def _record(path: str, mask: str) -> None:
    """Write the call's path and mask kind to the active ``record_paths`` records."""
    records = _active_records()
    if records:  # (nothing to do unless record_paths is active)
        for record in records:
            record.path, record.mask = path, mask
            if not torch.compiler.is_compiling():  # (a traced append guards on the list's length: a recompile a call)
                record.paths.append(path)


# ------------------------------------------------------------------------------------------------------ call plans

#: attribute of an attention module: its call plans by plan key (``_Plans``)
PLANS_ATTR = "_hf_attnorm_plans"
#: at most this many plans per module (a new one beyond it starts the module's plans afresh)
MAX_PLANS = 32
#: whether calls are planned (``unplanned`` turns it off inside a block)
_PLANNING = [True]


@contextlib.contextmanager
def unplanned() -> Iterator[None]:
    """Inside the block every attention call is decided in full (``kernels.choose``), as without plans: the
    reference that plans are checked against."""
    before = _PLANNING[0]
    _PLANNING[0] = False
    try:
        yield
    finally:
        _PLANNING[0] = before


class _Plans(dict):
    """A module's plans; a copied or pickled module carries none (they are rebuilt on its first calls)."""

    def __reduce__(self):
        return _Plans, ()


@dataclasses.dataclass(eq=False)
class CallPlan:
    """What is decided once for a module's calls with one plan key (the module docstring): the state and settings
    it was made for, the rule's version, whether a cache state kind serves the normalizer (``kinds``: steps are
    asked per call), the route per set of resolved call facts (``_call_facts``), and for plain calls the direct
    entry of the path (``direct``, ``path``, ``mask``: its path and mask kind, as ``record_paths`` reports them).
    ``uses``: calls served from the plan after the one that made it."""

    state: nn.Module
    settings: AttnormSettings
    epoch: int
    kinds: bool
    routes: dict[tuple, Route | None] = dataclasses.field(default_factory=dict)
    direct: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, dict], torch.Tensor] | None = None
    #: whether the direct entry reads per-head values (the module's state is then called for each call)
    heads: bool = False
    #: the per-head values of a state that has only constants (no parameter, no hook on it when the plan was made):
    #: given to the direct entry without calling the state (``_direct_entry``)
    constants: dict[str, torch.Tensor] | None = None
    path: str = ""
    mask: str = ""
    uses: int = 0


def plans_of(module: nn.Module) -> dict[tuple, CallPlan]:
    """The plans ``module`` keeps (empty before its first planned call)."""
    return module.__dict__.get(PLANS_ATTR) or {}


def _plan_key(module: nn.Module, state: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: object, causal: bool, scaling: float | None, dropout: float, weights: bool,
              kwargs: Mapping[str, Any]) -> tuple | None:
    """The facts a plan is decided from, or None for a call decided in full: autograd on, tracing or exporting,
    empty inputs, dropout, or a mask tensor over several queries (whose form is read per mask)."""
    if not _PLANNING[0] or torch.is_grad_enabled() or torch.compiler.is_compiling() or is_exporting():
        return None
    qs, ks = query.shape, key.shape  # (each tensor attribute read costs: read once)
    lq = qs[2]
    if attention_mask is None:
        mask = None
    elif isinstance(attention_mask, torch.Tensor) and lq == 1:
        mask = (attention_mask.dtype, attention_mask.shape[:-1])
    else:
        return None
    training = module.training
    if 0 in qs or ks[2] == 0 or (training and dropout > 0):
        return None
    return (state, query.dtype, key.dtype, value.dtype, query.device, qs[:2], lq == 1, ks[1], qs[3],
            value.shape[3], mask, causal, scaling, weights, training, kwargs.get("position_bias") is not None,
            kwargs.get("softcap"), kwargs.get("s_aux") is not None)


def _kept_plan(module: nn.Module, state: Any, plan_key: tuple) -> CallPlan | None:
    plan = plans_of(module).get(plan_key)
    if plan is None or plan.settings is not state.settings or plan.epoch != plan_epoch():
        return None
    return plan


def _call_facts(call: Any) -> tuple:
    """What a resolved call carries beyond its plan key that a path's ``accepts`` reads."""
    return (call.mask.kind, call.mask.selected, call.bias is not None, call.softcap is not None,
            call.sinks is not None, call.alibi_slopes is not None, call.forget is not None,
            call.recurrent is not None, call.selective_carry is not None,
            None if call.around is None else (call.around.memory, call.around.differential), call.need_weights,
            call.k.shape[1])


def _planned(module: nn.Module, state: Any, plan_key: tuple, plan: CallPlan | None, call: Any,
             attention_mask: object, kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """Run ``call`` on the path its plan routes it to, making the plan (or the route of these call facts) first."""
    if plan is None:
        plans = module.__dict__.get(PLANS_ATTR)
        if plans is None or len(plans) >= MAX_PLANS or any(p.state is not state for p in plans.values()):
            plans = module.__dict__[PLANS_ATTR] = _Plans()
        plan = plans[plan_key] = CallPlan(state, state.settings, plan_epoch(),
                                          bool(kinds_serving(state.settings.normalizer)))
    facts = _call_facts(call)
    if facts in plan.routes:
        kept = plan.routes[facts]
        if kept is None:  # (a call the rule decides in full)
            return attend(call)
        plan.uses += 1
        return run_routed(call, kept)
    kept = plan.routes[facts] = route(call)
    if kept is None:
        return attend(call)
    if len(plan.routes) == 1:  # (a plain call's facts follow from its key: one route)
        _direct_entry(plan, kept, state, call, attention_mask, kwargs)
    return run_on(call, kept.path)


def _direct_entry(plan: CallPlan, kept: Route, state: Any, call: Any, attention_mask: object,
                  kwargs: Mapping[str, Any]) -> None:
    """Give ``plan`` its path's direct entry when every call with its key resolves as plainly as ``call``: no cache
    state, mask tensor, key selection, score keyword, weights or learned memory, and a normalizer whose forget gates
    are absent by its class (not by this call's n), whose output gate too unless the call has one query per head
    (the gate of the raw query is then multiplied in after the entry, as ``run_path`` does). Per-head values and
    per-query factors (a length-aware scale) are the entry's to resolve per call, from the values the module's state
    gives."""
    norm = call.normalizer
    gated = type(norm).output_gate is not Normalizer.output_gate
    plain = (not plan.kinds and attention_mask is None and not kept.ask and not call.need_weights
             and not any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "s_aux"))
             and (call.around is None  # (else only a gate around it)
                  or not (call.around.memory or call.around.drop_queries or call.around.differential))
             and (call.q.shape[2] == 1 or not gated)
             and call.forget is None and not call.mask.selected
             and type(norm).forget_gates is Normalizer.forget_gates)
    entry = PATHS[kept.path].direct
    direct = entry(call) if plain and entry is not None else None
    if direct is not None and gated:
        direct = _gated_entry(direct, norm, call.settings, call.module_info)
    if direct is not None:
        plan.direct, plan.heads, plan.path, plan.mask = direct, bool(call.heads), kept.path, call.mask.kind
        # a plain AttnormState without parameters returns constants of its settings (a plan's settings: kept until
        # they change); one wrapped (PEFT), hooked or with parameters is called per call, so that what wraps or
        # hooks it sees each call
        if (plan.heads and type(state) is AttnormState and not state._parameters and not state._forward_hooks
                and not state._forward_pre_hooks):
            plan.constants = state(call.q.device)


def _gated_entry(direct: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, dict], torch.Tensor], norm: Normalizer,
                 settings: AttnormSettings, info: dict) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, dict],
                                                                    torch.Tensor]:
    """``direct`` followed by the normalizer's output gate of the raw query q [B, H, 1, D], with the ``Ctx`` that
    ``make_call`` resolves for one query against every key, multiplied in as ``run_path`` does (in the gate's
    dtype, then back)."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: dict) -> torch.Tensor:
        gate = norm.output_gate(q, one_query_ctx(settings, heads, q, k.shape[2], info))
        out = direct(q, k, v, heads)
        return out if gate is None else (out.to(gate.dtype) * gate).to(out.dtype)

    return run


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
    causality, softcap, sinks, position bias and key selection), without dropout: query [B, H, Lq, D], key/value
    [B, Hkv, Lk, D] -> [B, Lq, H, Dv]. The teacher of attention transfer (``hf_attnorm.lab.convert``)."""
    state = module._modules.get("attnorm")
    info = getattr(state, "module_info", None) or {}
    call = make_call(query, key, value, _softmax_settings(), {}, attention_mask, _causal(module, kwargs), scaling,
                     0.0, False, info, **_score_modifiers(kwargs),
                     selection=key_selection(module, info, kwargs, key.shape[2]))
    out, _, _ = attend(call)
    return out.transpose(1, 2).contiguous()


def softmax_row_statistics(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: object, scaling: float | None,
                           kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of the call's softmax attention as the model's own attention computes them (see
    ``softmax_attention``): query [B, H, Lq, D], key/value [B, Hkv, Lk, D] -> (LSE [B, H, Lq], the logsumexp of each
    row's visible scaled scores, the family's sink logit included; n [B, H, Lq], the keys each row sees, float;
    z: the scaled scores, -inf where masked, with the sink as a last column [B, H, Lq, Lk (+1)]). Rows that see no
    key have n = 0 (and LSE -inf). What calibration (``hf_attnorm.lab.convert.calibration``) measures."""
    state = module._modules.get("attnorm")
    info = getattr(state, "module_info", None) or {}
    call = make_call(query, key, value, _softmax_settings(), {}, attention_mask, _causal(module, kwargs), scaling,
                     0.0, False, info, **_score_modifiers(kwargs),
                     selection=key_selection(module, info, kwargs, key.shape[2]))
    scores = reference_scores(call).float()  # [B, H, Lq, Lk]
    keep = call.mask.dense(scores.device).expand_as(scores)
    z = scores.masked_fill(~keep, float("-inf"))
    if call.sinks is not None:  # an always-visible extra key with logit sinks[h]
        sink = call.sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        z = torch.cat([z, sink], dim=-1)
    return torch.logsumexp(z, dim=-1), keep.sum(-1).float(), z


@functools.cache
def forward_for(implementation: str):
    """The function registered under ``implementation`` (a named partial, so tracebacks say which)."""
    fn = functools.partial(hf_attention_forward, implementation=implementation)
    functools.update_wrapper(fn, hf_attention_forward)
    fn.__name__ = f"hf_attnorm_{implementation}"
    return fn
