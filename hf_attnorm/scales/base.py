"""The Scale interface: a per-query multiplier on the scores as a function of n, the number of visible keys.

scores = (q . k) * base * multiplier(n) * head_factor, with base the model's own ``scaling`` (1/sqrt(d), or what
GPT-2 folds into it) unless the normalizer opts out (cosine, linear). A scale file defines a subclass, decorates it
with ``@register_scale`` and becomes a ``scale`` choice and an attention implementation (softmax + that scale).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..normalizers.base import ContinuousBatching, Ctx, ParamSpec
from ..settings import AttnormSettings


class Scale:
    name: ClassVar[str]
    description: ClassVar[str]
    #: where the method comes from: authors year, title, link (the README's implementations table shows it)
    paper: ClassVar[str] = ""
    options: ClassVar[tuple[str, ...]] = ()
    params: ClassVar[tuple[ParamSpec, ...]] = ()
    #: option values of the preset named after this scale
    preset_settings: ClassVar[dict] = {}
    #: how transformers' continuous batching runs it (``normalizers.base.ContinuousBatching``); a scale of n alone
    #: is exact on the packed call (n is read per row from the block-diagonal mask)
    continuous_batching: ClassVar[ContinuousBatching] = "packed"
    #: why it is refused there, or what differs there
    continuous_batching_note: ClassVar[str] = ""

    def validate(self, settings: AttnormSettings) -> None:
        """Cross-option checks."""

    def refuses(self, module_info: dict) -> str | None:
        """Why a model (its attention modules' ``module_info``, incl. the config's ``rope`` settings) cannot take
        this scale, e.g. because it applies the same scale itself; None if it can. ``prepare`` raises it."""
        return None

    def prepare(self, settings: AttnormSettings, module_info: dict) -> None:
        """Called once when a model's attention module gets this scale (e.g. to precompute tables for the
        model's context length, so forward passes need no host-side work)."""

    def multiplier(self, n: torch.Tensor, ctx: Ctx) -> torch.Tensor | None:
        """n: float [B, 1 or H, Lq] (>= 1). Returns a multiplier broadcastable to [B, H, Lq], or None for 1."""
        raise NotImplementedError
