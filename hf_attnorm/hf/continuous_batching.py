"""Continuous batching (``generate_batch``, ``init_continuous_batching``, ``transformers serve``) with hf_attnorm's
implementations, in one place: which route each runs (``continuous_batching_support``), the hooks on transformers'
entry point and the manager's name checks (``install``, ``prepare``), the refusal of those it cannot run exactly
(``refusal``), and the packed call itself (``attend_packed``, which the attention function hands a call the module's
pre-hook marked as the manager's: ``cache_state.mark_packed``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import transformers
from torch import nn

from ..masks import additive_keep
from ..normalizers.base import CONTINUOUS_BATCHING_MODES, ContinuousBatching
from ..registry import NORMALIZERS, SCALES, AttnormError, canonical, is_ours
from ..settings import AttnormSettings
from . import cache_state, compat
from .families import SELECTION_KEYWORDS, attention_modules, refused_keywords
from .state import AttnormState

#: the attention function's computation of one call (``forward._compute``): (module, state, query, key, value,
#: mask, causal, scaling, dropout, kwargs, cache steps) -> (out [B, H, Lq, Dv], weights or None)
Compute = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]

#: the continuous-batching names hooked by ``install`` (transformers' entry point and the manager's checks)
HOOKED: set[str] = set()
#: the transformers names continuous batching relies on that the installed version lacks (then it is refused for
#: our implementations)
CONTINUOUS_BATCHING_MISSING: list[str] = []


def continuous_batching_support(settings: AttnormSettings) -> tuple[ContinuousBatching, str]:
    """How transformers' continuous batching runs ``settings`` (``normalizers.base.ContinuousBatching``), from the
    declarations of its normalizer and scale (``continuous_batching``, ``continuous_batching_note``): "refused" when
    either refuses, "per_sequence" when either needs it, else "packed"; with the notes of the declarations that
    decide it (why it is refused, or what differs)."""
    norm, scale = NORMALIZERS.get(settings.normalizer), SCALES.get(settings.scale)
    modes = []
    for owner in (norm, scale):
        mode = owner.continuous_batching
        if mode is None:  # (a normalizer's default: its declared coupling of queries decides)
            mode = "refused" if owner.query_coupled else "packed"
        if mode not in CONTINUOUS_BATCHING_MODES:
            raise AttnormError(f"{type(owner).__name__}.continuous_batching is {mode!r}; allowed: "
                               f"{', '.join(CONTINUOUS_BATCHING_MODES)} (or None on a normalizer: derived)")
        modes.append((mode, owner.continuous_batching_note))
    for wanted in ("refused", "per_sequence", "packed"):
        notes = [note for mode, note in modes if mode == wanted]
        if notes:
            return wanted, "; ".join(n for n in notes if n)  # type: ignore[return-value]
    raise AssertionError("unreachable")  # pragma: no cover


def _packed_error(module: nn.Module, what: str) -> AttnormError:
    return AttnormError(f"{type(module).__name__}: continuous batching's packed call {what}")


def attend_packed(module: nn.Module, state: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: object, causal: bool, scaling: float | None, dropout: float,
                  kwargs: Mapping[str, Any], compute: Compute) -> torch.Tensor:
    """A call from continuous batching's sdpa route: query [1, H, Q_total, D] (the scheduled sequences' new tokens,
    packed), key/value [1, Hkv, K_total, D] (each sequence's keys gathered from the paged cache, sequence after
    sequence), attention_mask [1, 1, Q_total, K_total] (additive, block-diagonal causal, with the sliding window
    where the layer has one) -> out [1, H, Q_total, Dv]. Run as one call of ``compute`` (the attention function's
    own computation of a call), or split per sequence, as the settings declare (``continuous_batching_support``)."""
    accepted = compat.packed_keywords()
    refused = refused_keywords([k for k in kwargs if k not in accepted])
    if refused:
        raise _packed_error(module, f"passed {', '.join(refused)}, which hf_attnorm does not implement; it could "
                                    "change what attention computes, so it is not ignored")
    if any(name in kwargs for name in compat.CACHE_ARGUMENTS):
        raise _packed_error(module, "hands the paged cache to the attention function, so the keys were not gathered "
                                    f"(the module did not call its update; transformers {transformers.__version__})")
    selections = [k for k in SELECTION_KEYWORDS if kwargs.get(k) is not None]
    if selections:  # (the families passing one keep their indexer keys in caches of their own, not the paged one)
        raise _packed_error(module, f"carries {', '.join(map(repr, selections))} (a sparse indexer's choice of "
                                    "keys), which hf_attnorm does not apply on the packed route; use generate")
    if kwargs.get("block_table") is not None:
        raise _packed_error(module, "carries a block table (paged decoding, whose keys stay in the cache); "
                                    "hf_attnorm needs them gathered, as on the sdpa route")
    mode, note = continuous_batching_support(state.settings)
    if mode == "refused":
        raise _packed_error(module, f"cannot run {state.settings.implementation!r}: {note}")
    if query.shape[0] != 1 or not isinstance(attention_mask, torch.Tensor):
        raise _packed_error(module, f"has queries {list(query.shape)} and a mask of type "
                                    f"{type(attention_mask).__name__}; expected [1, H, Q_total, D] and the "
                                    "block-diagonal mask tensor [1, 1, Q_total, K_total] of the sdpa route")
    # the manager's mask is additive (0 / finfo.min): as a keep-mask it carries no score bias, which a scoreless
    # normalizer would refuse
    attention_mask = additive_keep(attention_mask) if attention_mask.is_floating_point() else attention_mask
    if mode == "packed":
        return compute(module, state, query, key, value, attention_mask, causal, scaling, dropout, kwargs, [])[0]
    return _per_sequence(module, state, query, key, value, attention_mask, causal, scaling, dropout, kwargs, compute)


def _per_sequence(module: nn.Module, state: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor, causal: bool, scaling: float | None, dropout: float,
                  kwargs: Mapping[str, Any], compute: Compute) -> torch.Tensor:
    """The packed call split at ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (this layer's, as ``PagedAttentionCache.update``
    leaves them): sequence s gets query rows cu_q[s]:cu_q[s+1], keys cu_k[s]:cu_k[s+1] and its mask block, the layout
    of a cached ``generate`` step. query [1, H, Q_total, D] -> out [1, H, Q_total, Dv] (0 on padding rows)."""
    bounds = [kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")]
    if not all(isinstance(b, torch.Tensor) and b.dim() == 1 for b in bounds):
        raise _packed_error(module, "has no per-layer cu_seq_lens_q / cu_seq_lens_k tensors (the module must let "
                                    "PagedAttentionCache.update select its layer's), which the per-sequence split of "
                                    f"{state.settings.implementation!r} reads")
    cu_q, cu_k = (b.tolist() for b in bounds)  # (host values: the boundaries of the slices)
    lq, lk = query.shape[2], key.shape[2]
    if len(cu_q) != len(cu_k) or cu_q[-1] > lq or cu_k[-1] > lk:
        raise _packed_error(module, f"has sequence boundaries cu_seq_lens_q={cu_q}, cu_seq_lens_k={cu_k} that do "
                                    f"not fit {lq} queries and {lk} keys")
    parts, done = [], 0
    for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        if q1 == q0:
            continue  # (a padding sequence)
        out, _ = compute(module, state, query[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1],
                         attention_mask[..., q0:q1, k0:k1], causal, scaling, dropout, kwargs, [])
        parts.append(out)
        done = q1
    if done < lq:  # padding rows past the last sequence see no key
        dtype = parts[0].dtype if parts else query.dtype
        parts.append(query.new_zeros(1, query.shape[1], lq - done, value.shape[-1], dtype=dtype))
    return torch.cat(parts, dim=2)


def install() -> set[str]:
    """Hook continuous batching (called once by ``integration.register``); returns the names hooked. It runs only
    transformers' own implementations by name: its entry point checks ours (the manager would raise deep inside, or
    switch the model to flash attention with a log line, i.e. run softmax) and lets the manager run those that are
    exact on its sdpa route."""
    owner = compat.continuous_batching_owner()
    entry = compat.CONTINUOUS_BATCHING_ENTRY[1]
    if owner is not None and compat.hook(owner, entry, _entry_hook):
        HOOKED.add(entry)
        hooked = compat.hook_continuous_batching(prepare, runs_packed)
        HOOKED.update(hooked)
        if hooked and compat.hook_manager_thread_context(lambda model: runs_packed(getattr(model, "config", None))):
            HOOKED.add(compat.CONTINUOUS_BATCHING_THREAD[1])
        CONTINUOUS_BATCHING_MISSING[:] = [] if hooked else compat.continuous_batching_missing()
    return set(HOOKED)


def runs_packed(config: Any) -> bool:
    """Whether the continuous-batching manager builds masks for a model of ``config``, which it then runs on its
    sdpa route under the model's own implementation name: ours (the manager's name check has refused those that
    are not exact there, ``prepare``)."""
    return is_ours(canonical(getattr(config, "_attn_implementation", None)))


def refusal(model: nn.Module) -> str | None:
    """Why continuous batching cannot run ``model``'s hf_attnorm implementation exactly (None when it can): the
    installed transformers lacks a name the integration relies on, or a normalizer or scale declares it refused
    (``Normalizer.continuous_batching``)."""
    return settings_refusal(mod.settings for mod in model.modules() if isinstance(mod, AttnormState))


def settings_refusal(settings: Iterable[AttnormSettings]) -> str | None:
    """``refusal`` for the settings a model will run with (before it is built: ``hf_attnorm serve`` decides from a
    checkpoint's config.json)."""
    if CONTINUOUS_BATCHING_MISSING or compat.CONTINUOUS_BATCHING_SWITCH[1] not in HOOKED:
        missing = ", ".join(CONTINUOUS_BATCHING_MISSING) or "the manager's name checks"
        return (f"transformers {compat.transformers_version_string()} lacks {missing}, through which hf_attnorm "
                "runs its implementations on continuous batching's sdpa route; transformers runs it only with its own "
                "attention (sdpa, paged|eager or flash attention) and would either refuse this implementation or "
                "switch the model to flash attention, i.e. compute softmax instead")
    for s in settings:
        mode, note = continuous_batching_support(s)
        if mode == "refused":
            return note or f"{s.implementation!r} declares it is not exact there"
    return None


def _refuse(model: nn.Module, implementation: str) -> None:
    reason = refusal(model)
    if reason is not None:
        raise AttnormError(
            f"continuous batching (generate_batch, init_continuous_batching) cannot run hf_attnorm's "
            f"{implementation!r}: {reason}. Use model.generate(...) with a padded batch, which runs the model's own "
            "normalizer."
        )


def prepare(model: nn.Module) -> bool:
    """The manager's name check, whenever a manager is built or reused for ``model`` (``compat
    .hook_continuous_batching``): False for a model that does not run ours (transformers' own check follows). For
    ours: refused where not exact; a declared difference is warned about; the attention modules get the pre-hook
    that marks the manager's packed calls (``cache_state.mark_packed``); True (the model keeps its name)."""
    impl = canonical(getattr(getattr(model, "config", None), "_attn_implementation", None))
    if not is_ours(impl):
        return False
    _refuse(model, impl)
    notes = {note for mod in model.modules() if isinstance(mod, AttnormState)
             for mode, note in [continuous_batching_support(mod.settings)] if note}
    for note in sorted(notes):
        warnings.warn(f"hf_attnorm: under continuous batching, {impl!r} {note}", stacklevel=3)
    cache_state.mark_packed(mod for _, mod in attention_modules(model))
    return True


def _entry_hook(orig):
    """``init_continuous_batching`` (the one entry of ``generate_batch`` and its context manager): refused, before
    the manager allocates anything, for a model running an hf_attnorm implementation that continuous batching
    cannot run exactly (``refusal``: every implementation, on a transformers lacking a name the integration relies
    on). The manager then prepares the others (``prepare``)."""

    def init_continuous_batching(self, *args, **kwargs):
        impl = canonical(getattr(getattr(self, "config", None), "_attn_implementation", None))
        if is_ours(impl):
            _refuse(self, impl)
        return orig(self, *args, **kwargs)

    return init_continuous_batching
