"""qwen_logn: max(1, log_{L_train} n) — Qwen's log-n attention scaling, neutral inside the training length."""

from __future__ import annotations

import math

import torch

from ..normalizers.base import Ctx
from ..registry import register_scale
from ..settings import AttnormSettings, declare_option
from .base import Scale

TRAIN_LENGTH = declare_option(
    "train_length", int, None,
    "training context length L_train (>= 2) of qwen_logn, log_train_n, yarn (dynamic s) and llama4_pos (its L_orig); "
    "null = the model's max_position_embeddings (llama4_pos: its rope original_max_position_embeddings first)",
    optional=True, check=lambda v: "must be >= 2" if v < 2 else None,
)


def qwen_logn_scale(n: torch.Tensor, train_length: int) -> torch.Tensor:
    """max(1, ln n / ln L_train)."""
    return torch.clamp(torch.log(n) / math.log(train_length), min=1.0)


@register_scale
class QwenLogN(Scale):
    name = "qwen_logn"
    paper = "Bai et al. 2023, Qwen Technical Report (logn attention), https://arxiv.org/abs/2309.16609"
    description = "scaling * max(1, log_{L_train} n)"
    options = (TRAIN_LENGTH,)

    def prepare(self, settings: AttnormSettings, module_info: dict) -> None:
        length = settings.train_length or module_info.get("max_positions")
        if not length or length < 2:  # at load time, not at the first forward
            raise ValueError(f"qwen_logn needs attnorm option train_length (>= 2): the config of "
                             f"{module_info.get('family', 'this model')} has no max_position_embeddings")

    def multiplier(self, n: torch.Tensor, ctx: Ctx) -> torch.Tensor | None:
        length = ctx.settings.train_length or ctx.module_info.get("max_positions")
        if not length or length < 2:
            raise ValueError(
                "qwen_logn needs attnorm option train_length (>= 2): the model config has no max_position_embeddings"
            )
        return qwen_logn_scale(n, int(length))
