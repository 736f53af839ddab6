"""llama4_pos: Llama 4's attention temperature by query position, as Mistral / Ministral 3 parameterise it.

scale_i = 1 + beta ln(1 + floor(pos_i / L_orig)), pos_i the 0-based position of query i: transformers'
``get_llama_4_attn_scale(position_ids, llama_4_scaling_beta, original_max_position_embeddings)`` in
``models/ministral3/modeling_ministral3.py`` (config ``rope_parameters``: llama_4_scaling_beta = 0.1,
original_max_position_embeddings = 16384 by default there), multiplied into q before attention. L_orig here: option
``train_length`` (the original, pre-extension context), else the config's rope_parameters
original_max_position_embeddings, else its max_position_embeddings.

Here pos_i = max(0, Lk - Lq + i) (the last query is the last key: a prefill's i, a cache decode's Lk - 1), the position
transformers' ``position_ids`` hold for unpadded and right-padded rows. Left padding shifts it: transformers then
counts positions from the first real token, while pos_i counts the pad slots too (the scale changes only when
pos_i crosses a multiple of L_orig, so only such rows differ).

The other scale, ``llama4``, is the same formula on n (keys the query sees, = position + 1 without padding or a
window) with Llama 4's own constants (attn_scale 0.1, floor_scale 8192): it follows masking (padding, sliding
windows shrink n) and counts from 1, where this one follows the position alone, as Ministral 3 does.

A model that applies it itself (``rope_parameters`` with a nonzero llama_4_scaling_beta) is refused at load/set time.
"""

from __future__ import annotations

import torch

from ..normalizers.base import Ctx
from ..registry import register_scale
from ..settings import AttnormSettings, declare_option, nonnegative
from .base import Scale
from .qwen_logn import TRAIN_LENGTH

BETA = declare_option("llama4_pos_beta", float, 0.1, "llama4_pos: beta in 1 + beta ln(1 + floor(pos / L_orig)) (>= 0)",
                      check=nonnegative)


def llama4_pos_scale(pos: torch.Tensor, beta: float, original: int) -> torch.Tensor:
    """1 + beta ln(1 + floor(pos / original)), pos 0-based."""
    return 1.0 + beta * torch.log1p(torch.floor(pos / original))


def original_length(settings: AttnormSettings, module_info: dict) -> int:
    """L_orig: option train_length, else the config's rope_parameters original_max_position_embeddings, else its
    max_position_embeddings; ValueError naming them if none is known."""
    if settings.train_length:
        return int(settings.train_length)
    for rope in module_info.get("rope", ()):
        if rope.get("original_max_position_embeddings"):
            return int(rope["original_max_position_embeddings"])
    if module_info.get("max_positions"):
        return int(module_info["max_positions"])
    raise ValueError("llama4_pos needs attnorm option train_length (its L_orig, >= 2): the config of "
                     f"{module_info.get('family', 'this model')} has neither rope_parameters "
                     "original_max_position_embeddings nor max_position_embeddings")


@register_scale
class Llama4Pos(Scale):
    name = "llama4_pos"
    paper = "Ministral 3 (Mistral AI 2025), transformers models/ministral3/modeling_ministral3.py"
    description = "scaling * (1 + beta ln(1 + floor(pos/L_orig))), pos = query position (Ministral 3's Llama-4 scale)"
    options = (BETA, TRAIN_LENGTH)
    # the query's position is read as Lk - Lq + i, which holds per sequence, not in the packed layout
    continuous_batching = "per_sequence"

    def refuses(self, module_info: dict) -> str | None:
        if any(r.get("llama_4_scaling_beta") for r in module_info.get("rope", ())):
            return (f"the llama4_pos scale would be applied twice: the config of {module_info.get('family', 'this')} "
                    "has rope_parameters llama_4_scaling_beta, and the model multiplies q by that scale itself")
        return None

    def prepare(self, settings: AttnormSettings, module_info: dict) -> None:
        reason = self.refuses(module_info)
        if reason:
            raise ValueError(reason)
        original_length(settings, module_info)

    def multiplier(self, n: torch.Tensor, ctx: Ctx) -> torch.Tensor | None:
        lq = n.shape[-1]
        # (clamped at 0: more queries than keys, e.g. cross-attention, has no cache offset to count)
        pos = (torch.arange(lq, device=n.device, dtype=n.dtype) + float(ctx.lk - lq)).clamp(min=0)
        scale = llama4_pos_scale(pos, ctx.settings.llama4_pos_beta, original_length(ctx.settings, ctx.module_info))
        return scale.view(1, 1, lq)
