"""Continuation schedules of a conversion's stage 1: for a normalizer or scale reachable from softmax along one
option (a recipe's ``continuation``, ``recipes.py``: alpha of entmax from 1.001 to 1.5, a constant sink logit from -30
to its value, softmax_n's n_extra from 0; for a scale, ssmax's anchor released from 1 to 0), stage 1 starts at the
teacher and ends at the asked normalizer. The option moves linearly over the first ``fraction`` of the stage's steps
and then stays at its end, so the last steps (and every held-out measurement that stage 1's keep-best compares) train
and measure the asked normalizer itself.

A continuation is planned only where it changes nothing a run saves: the option is not the start of a learned
per-head value (a learned alpha or sink moves by training, not by a schedule), and the stage's implementation has the
same learned values as the asked one, so the tensors stage 1 trains are the asked normalizer's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ...attention import param_specs
from ...settings import AttnormSettings, resolve_settings
from .recipes import normalizer_recipe, scale_recipe


class ContinuationError(ValueError):
    """A continuation that cannot run with these options."""


@dataclasses.dataclass(frozen=True)
class ContinuationPlan:
    """Stage 1 runs ``implementation`` with ``options`` and ``option`` at ``value_at(step)``; at the end of the ramp
    that implementation computes the asked one."""

    implementation: str
    options: dict[str, Any]
    option: str
    start: float
    end: float
    fraction: float
    note: str

    def ramp_steps(self, total: int) -> int:
        """Steps over which the option moves (at least 1 when the stage has steps)."""
        return max(1, round(self.fraction * total)) if total else 0

    def value_at(self, step: int, total: int) -> float:
        """The option's value for the optimizer step that starts at ``step`` (0-based) of ``total``."""
        ramp = self.ramp_steps(total)
        t = 1.0 if ramp == 0 else min(1.0, step / ramp)
        return self.end if t >= 1.0 else self.start + (self.end - self.start) * t

    def at_end(self, step: int, total: int) -> bool:
        """Whether the model computes the asked normalizer after ``step`` steps."""
        return step >= self.ramp_steps(total)

    def options_at(self, step: int, total: int) -> dict[str, Any]:
        return {**self.options, self.option: self.value_at(step, total)}

    def describe(self) -> dict[str, Any]:
        return {"implementation": self.implementation, "option": self.option, "start": self.start, "end": self.end,
                "fraction": self.fraction, "note": self.note}


def plan_continuation(implementation: str, options: Mapping[str, Any], fraction: float,
                      asked: bool = False) -> tuple[ContinuationPlan | None, str]:
    """The continuation of ``implementation`` with ``options`` (its settings' normalizer's recipe, else its
    scale's), or None and why not. ``asked``: plan one declared off by default too (``--continuation`` given).
    ContinuationError when the declaration cannot run (a bad ``via``)."""
    target = resolve_settings(implementation, dict(options))
    norm, scale = normalizer_recipe(target.normalizer), scale_recipe(target.scale)
    cont = norm.continuation or scale.continuation
    if cont is None:
        return None, (f"{target.normalizer} declares no continuation from softmax" if target.scale == "standard" else
                      f"neither {target.normalizer} nor scale {target.scale} declares a continuation from softmax")
    owner = target.normalizer if norm.continuation is not None else f"scale {target.scale}"
    if not cont.by_default and not asked:
        return None, f"{owner}'s continuation is off by default ({cont.off_note}); --continuation walks it"
    end = float(target.options[cont.option]) if cont.end is None else float(cont.end)
    learned = _learned_from(target, cont.option)
    if learned:
        return None, (f"{cont.option} is the start of learned per-head value {learned}: training moves it, no "
                      "schedule does")
    if end == cont.start:
        return None, f"{cont.option} = {end} is already the continuation's start"
    via = cont.via or implementation
    via_options = {**dict(options), **cont.via_options}
    try:
        stage = resolve_settings(via, {**via_options, cont.option: end})
    except Exception as exc:  # a registry error names the bad option or value
        raise ContinuationError(f"{owner}'s continuation via {via!r}: {exc}") from exc
    if _learned_names(stage) != _learned_names(target):
        raise ContinuationError(f"{owner}'s continuation via {via!r} learns {_learned_names(stage)}, "
                                f"the asked implementation {_learned_names(target)}")
    return ContinuationPlan(via, via_options, cont.option, float(cont.start), end, fraction, cont.note), ""


def _learned_names(settings: AttnormSettings) -> list[str]:
    return sorted(spec.name for spec in param_specs(settings) if spec.is_learnable(settings))


def _learned_from(settings: AttnormSettings, option: str) -> str | None:
    """The learned per-head value whose start is ``option``, if any."""
    return next((spec.name for spec in param_specs(settings)
                 if spec.init_option == option and spec.is_learnable(settings)), None)
