"""log_train_n: log_{L_train} n = ln n / ln L_train, the entropy-invariant length scale (LSSA's alpha(n)).

Su (2021, "Entropy invariance and the scale of attention", kexue.fm/archives/8823): multiplying the scores by
log_{L_train} n keeps a row's attention entropy roughly constant as the number n of visible keys changes; 1 at
n = L_train. The preset ``lssa`` pairs it with the ``softplus`` normalizer (Gao et al., arXiv 2501.13428; see
``normalizers/softplus.py`` for why this is our documented choice of their alpha(n)). As an implementation of its
own, ``log_train_n`` is softmax with this scale. It differs from ``qwen_logn`` (max(1, log_{L_train} n)) by not
being clamped at 1: shorter rows are flattened, not left at the model's scale; and from ``ssmax`` by a fixed,
length-derived factor 1 / ln L_train instead of a learned s_h.
"""

from __future__ import annotations

import math

import torch

from ..normalizers.base import Ctx
from ..registry import register_scale
from ..settings import AttnormSettings
from .base import Scale
from .qwen_logn import TRAIN_LENGTH


def train_length(settings: AttnormSettings, module_info: dict, scale: str) -> int:
    """L_train: option ``train_length``, else the model's max_position_embeddings; ValueError naming both if
    neither is known (raised by ``prepare`` at load time, not at the first forward)."""
    length = settings.train_length or module_info.get("max_positions")
    if not length or length < 2:
        raise ValueError(f"{scale} needs attnorm option train_length (>= 2): the config of "
                         f"{module_info.get('family', 'this model')} has no max_position_embeddings")
    return int(length)


def log_train_n_scale(n: torch.Tensor, train_length: int) -> torch.Tensor:
    """ln n / ln L_train for n >= 1 (0 for a single visible key)."""
    return torch.log(n) / math.log(train_length)


@register_scale
class LogTrainN(Scale):
    name = "log_train_n"
    paper = "Su 2021, https://kexue.fm/archives/8823; LSSA (Gao et al. 2025), https://arxiv.org/abs/2501.13428"
    description = "scaling * log_{L_train} n (entropy-invariant; LSSA's length scale, not clamped)"
    options = (TRAIN_LENGTH,)

    def prepare(self, settings: AttnormSettings, module_info: dict) -> None:
        train_length(settings, module_info, self.name)

    def multiplier(self, n: torch.Tensor, ctx: Ctx) -> torch.Tensor | None:
        return log_train_n_scale(n, train_length(ctx.settings, ctx.module_info, self.name))
