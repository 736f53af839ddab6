"""llama4: 1 + attn_scale * ln(1 + floor(n / floor_scale)), Llama 4's attention temperature tuning (n = position+1).

n is the number of keys the query sees (transformers' Llama 4 uses cache_position + 1, which n equals without
padding or a window). ``llama4_pos`` is the position-based form Mistral / Ministral 3 use: 1 + beta ln(1 +
floor(pos / original_max_position_embeddings)) on the 0-based query position, unaffected by padding or windows.
"""

from __future__ import annotations

import torch

from ..normalizers.base import Ctx
from ..registry import register_scale
from ..settings import declare_option, nonnegative, positive
from .base import Scale

ATTN_SCALE = declare_option("llama4_attn_scale", float, 0.1, "llama4: attn_scale (>= 0)", check=nonnegative)
FLOOR_SCALE = declare_option("llama4_floor_scale", float, 8192.0, "llama4: floor_scale (> 0)", check=positive)


def llama4_scale(n: torch.Tensor, attn_scale: float, floor_scale: float) -> torch.Tensor:
    return 1.0 + attn_scale * torch.log1p(torch.floor(n / floor_scale))


@register_scale
class Llama4(Scale):
    name = "llama4"
    paper = "Llama 4 attention temperature tuning (Meta 2025), transformers models/llama4/modeling_llama4.py"
    description = "scaling * (1 + attn_scale * ln(1 + floor(n/floor_scale)))"
    options = (ATTN_SCALE, FLOOR_SCALE)

    def multiplier(self, n: torch.Tensor, ctx: Ctx) -> torch.Tensor | None:
        s = ctx.settings
        return llama4_scale(n, s.llama4_attn_scale, s.llama4_floor_scale)
