"""The 2025 variants, composed around the dispatcher: what learned memory, gated and differential attention add
around one call, so that the dispatcher and every path see only the call they read (``AttnCall`` without its
``around``).

``make_call`` records on a call what it needs around it (``AttnCall.around``, an ``Around``; None for a plain call).
``attend`` runs, from the inside out:

* differential attention (``Around.differential``): the call's two halves (``halves``: half of every head's q/k
  dims each), both on the path the rule picks for the first half (or the forced one), combined by the normalizer:
  ``normalize_output(halves_difference(first, second))``, in fp32 at least (on a GPU in half precision in one fused
  pass, kernels/triton_rows.py); the weights are ``halves_difference`` of the halves' weights. With attention
  dropout, which acts on the combined weights A1 - lambda A2, the combined weights are formed, dropped and
  multiplied by v (the materialised reference's computation);
* learned memory key/values (``Around.memory``, ``Around.drop_queries``): k, v and the mask already hold the memory
  keys and q its zero query rows (kernels/memory.py); those rows, and the memory keys' columns of the weights, are
  dropped from what the path returned;
* gated attention (``Around.gate``): the output times the gate [B, H, Lq, Dv] (fp32 at least; the weights
  unchanged).

The dispatcher's questions (``choose``, ``explain``, ``candidate_paths``, ``route``) are asked of ``decided(call)``:
a differential call's first half (both halves take the same path), the call itself otherwise. Forgetting
attention's gates are not a variant here: they are a score modifier (``AttnCall.forget``), a call feature that only
the paths declaring it take (``dispatch.FEATURES``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import torch

from . import dispatch, triton_rows
from .base import AttnCall, repeat_kv
from .dispatch import Route
from .reference import reference_weights

Result = tuple[torch.Tensor, torch.Tensor | None, str]


def is_differential(call: AttnCall) -> bool:
    """A whole call of a differential normalizer (``attend`` runs its two halves)."""
    return call.around is not None and call.around.differential


def halves(call: AttnCall) -> tuple[AttnCall, AttnCall]:
    """The two calls of a differential call, each with half of every head's q/k dims: with D a multiple of 4, half
    0 holds the dims [0, D/4) and [D/2, 3D/4) and half 1 the rest (rotary pairs i, i + D/2 stay together);
    otherwise the first floor(D/2) dims and the rest. Each half is scaled for its own dims d (base x
    sqrt(D / d)); when v has D dims too its q keeps all D dims with the other half's zeroed and its k is the
    call's whole k (the same scores, SDPA's fused kernels, no copy of k), else q and k are the half's dims; the
    same v, mask and score modifiers; per-head values without the normalizer's own; nothing around them."""
    d = call.q.shape[-1]
    quarter, middle = d // 4, d // 2

    def part(x: torch.Tensor, half: int) -> torch.Tensor:
        if d % 4:
            return x[..., :middle] if half == 0 else x[..., middle:]
        if half == 0:
            return torch.cat([x[..., :quarter], x[..., middle:middle + quarter]], dim=-1)
        return torch.cat([x[..., quarter:middle], x[..., middle + quarter:]], dim=-1)

    own = {spec.name for spec in call.normalizer.params}
    heads = {name: t for name, t in call.heads.items() if name not in own}
    calls = []
    for i in (0, 1):
        if call.v.shape[-1] == d:
            # q as wide as v keeps SDPA on its fused kernels (CPU and CUDA fall back to the materialising math
            # kernel when the key and value head dims differ: 8x slower): q with the other half's dims zeroed
            # against the whole k gives the half's q . k (zero dims add nothing), one pass over q, k not copied
            keep = part(torch.arange(d, device=call.q.device), i)
            mask = torch.zeros(d, dtype=call.q.dtype, device=call.q.device).index_fill_(0, keep, 1)
            q, k, width = call.q * mask, call.k, keep.numel()
        else:
            q, k = part(call.q, i), part(call.k, i)
            width = q.shape[-1]
        calls.append(dataclasses.replace(call, q=q, k=k, heads=heads, around=None,
                                         base=call.base * (d / width) ** 0.5, k_transformed=None))
    return calls[0], calls[1]


def decided(call: AttnCall) -> AttnCall:
    """The call the rule decides on: a differential call's first half (both halves take the same path)."""
    return halves(call)[0] if is_differential(call) else call


#: why a differential call with attention dropout runs on the reference path
DIFFERENTIAL_DROPOUT = ("attention dropout on a differential normalizer drops entries of the combined weights "
                        "A1 - lambda A2, which only the materialised 'reference' path forms")


def choose(call: AttnCall, path: str | None = None) -> str:
    """The path that will run ``call`` (``path``/HF_ATTNORM_PATH forcing one); raises ValueError when a forced path
    cannot take it. Runs nothing."""
    if is_differential(call) and call.dropout > 0:
        return _choose_differential_dropout(call, path)
    return dispatch.choose(decided(call), path)


def explain(call: AttnCall) -> list[tuple[str, str]]:
    """For each path the rule considers, in order: (name, why it declines or "runs"). Runs no kernel."""
    if is_differential(call) and call.dropout > 0:
        return [*((p, DIFFERENTIAL_DROPOUT) for p in dispatch.candidate_paths(decided(call))), ("reference", "runs")]
    return dispatch.explain(decided(call))


def candidate_paths(call: AttnCall) -> list[str]:
    """Fast paths the rule considers for this call, in order (the reference is always last)."""
    return dispatch.candidate_paths(decided(call))


def route(call: AttnCall) -> Route | None:
    """The reusable decision for ``call`` (``dispatch.route``); of a differential call, its first half's, kept only
    when it needs no asking again (both halves then run on it)."""
    if is_differential(call):
        kept = dispatch.route(decided(call))
        return kept if kept is not None and not kept.ask else None
    return dispatch.route(call)


def attend(call: AttnCall, path: str | None = None) -> Result:
    """Run one call with what it needs around it. Returns (out [B, H, Lq, Dv], weights or None, name of the path
    that ran)."""
    if call.around is None:
        return dispatch.attend(call, path)
    if not call.around.differential:
        return _finish(call, *dispatch.attend(call, path))
    if call.dropout > 0:
        return _finish(call, *_differential_dropout(call, path))
    return _finish(call, *_differential(call, lambda half: dispatch.attend(half, path)))


def run_routed(call: AttnCall, kept: Route) -> Result:
    """Run ``call`` on the path of a kept ``Route`` (``dispatch.choose_routed``), with what it needs around it (a
    differential route needs no asking again: both halves run on its path)."""
    return run_on(call, kept.path if is_differential(call) else dispatch.choose_routed(call, kept))


def run_on(call: AttnCall, name: str) -> Result:
    """Run ``call`` on the path ``name`` the rule picked for it, with what it needs around it."""
    if call.around is None:
        return dispatch.run_path(call, name)
    if call.around.differential:
        return attend(call, name)
    return _finish(call, *dispatch.run_path(call, name))


def finish(call: AttnCall, out: torch.Tensor,
           weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What ``attend`` does after a path ran a (not differential) call: learned memory's rows and columns dropped,
    the output gate multiplied in. For a path's kernel called on its own."""
    out, weights, _ = _finish(call, out, weights, "")
    return out, weights


def _finish(call: AttnCall, out: torch.Tensor, weights: torch.Tensor | None, name: str) -> Result:
    around = call.around
    assert around is not None
    dtype = call.q.dtype if around.differential else out.dtype  # (a differential combination is in fp32)
    if around.drop_queries or around.memory:  # learned memory key/values (kernels/memory.py): the caller's shapes
        out = out[:, :, around.drop_queries:]
        weights = None if weights is None else weights[:, :, around.drop_queries:, around.memory:]
    if around.gate is not None:  # gated attention: the weights are unchanged, the output gated (in fp32)
        out = out.to(around.gate.dtype) * around.gate
    return out.to(dtype), weights, name


def _differential(call: AttnCall, run: Callable[[AttnCall], Result]) -> Result:
    """Both halves run by ``run`` (a half -> its result), combined and normalised by the normalizer (in fp32 at
    least; the output before its cast to the input dtype)."""
    norm, ctx = call.normalizer, call.ctx()
    first, second = halves(call)
    out_first, w_first, name = run(first)
    out_second, w_second, _ = run(second)
    form = norm.difference_form(ctx) if triton_rows.usable(out_first) else None
    if form is not None and tuple(form[1].shape) == (out_first.shape[1], out_first.shape[-1]):
        # on a GPU in half precision: the combination and its RMSNorm in one fused pass (fp32 inside)
        out = triton_rows.rms_difference(out_first, out_second, *form)
    else:
        out = norm.normalize_output(norm.halves_difference(out_first, out_second, ctx), ctx)
    w = None if w_first is None else norm.halves_difference(w_first, w_second, ctx).to(w_first.dtype)
    return out, w, name


def weights(call: AttnCall) -> torch.Tensor:
    """The materialised weights [B, H, Lq, Lk] of ``call`` (compute dtype, before dropout), of a differential call
    its halves' combined: A1 - lambda A2 (learned memory's rows and columns kept)."""
    if not is_differential(call):
        return reference_weights(call)
    first, second = halves(call)
    return call.normalizer.halves_difference(reference_weights(first), reference_weights(second), call.ctx())


def _choose_differential_dropout(call: AttnCall, path: str | None) -> str:
    """Attention dropout acts on the combined weights A1 - lambda A2 (dropping the halves apart would keep a weight
    where only one half is dropped), which only the materialised path forms: forced elsewhere, refused."""
    forced = path or dispatch.forced_path()
    if forced not in ("auto", "reference"):
        raise ValueError(f"path {forced!r} cannot run this call (normalizer {call.settings.normalizer!r}, dropout "
                         f"{call.dropout}): {DIFFERENTIAL_DROPOUT} (set the attention dropout to 0 to keep the fast "
                         "paths)")
    return "reference"


def _differential_dropout(call: AttnCall, path: str | None) -> Result:
    """The combined weights, dropped, times v, normalised (``_choose_differential_dropout``)."""
    forced = path or dispatch.forced_path()
    name = call.settings.normalizer
    _choose_differential_dropout(call, path)  # raises when another path is forced
    if forced == "auto" and not torch.compiler.is_compiling():
        fast = choose(dataclasses.replace(call, dropout=0.0))
        key = (name, call.q.device.type, fast, "reference")
        if fast != "reference" and key not in dispatch._WARNED_DROPOUT:
            dispatch._WARNED_DROPOUT.add(key)
            warnings.warn(f"hf_attnorm: attention dropout {call.dropout} (training): {name!r} drops entries of its "
                          "combined weights, which only the materialised path forms, so it runs on 'reference' "
                          f"instead of {fast!r} (exact, slower). Set the model's attention dropout to 0 to keep the "
                          "fast path.", stacklevel=3)
    norm, ctx = call.normalizer, call.ctx()
    w = torch.nn.functional.dropout(weights(call), p=call.dropout, training=True)
    out = norm.normalize_output(w @ repeat_kv(call.v, call.groups).to(w.dtype), ctx)
    return out, (w.to(call.q.dtype) if call.need_weights else None), "reference"
