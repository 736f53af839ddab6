"""What every kernel receives: one attention call, fully resolved."""

from __future__ import annotations

import dataclasses

import torch

from ..masks import MaskInfo
from ..normalizers.base import Ctx, Normalizer
from ..registry import NORMALIZERS
from ..settings import AttnormSettings


@dataclasses.dataclass
class AttnCall:
    """One attention call.

    q: [B, H, Lq, D]; k, v: [B, Hkv, Lk, D] / [B, Hkv, Lk, Dv] with H a multiple of Hkv (GQA: kernels repeat or
    index k/v themselves); mask: visibility and n; base: the model's scaling (1.0 for normalizers that opt out);
    multiplier: float [B or 1, 1 or H, Lq] = scale(n) x per-head factors, or None for 1; heads: per-head values [H];
    dropout: probability on the weights (training); need_weights: return the weights [B, H, Lq, Lk].
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: MaskInfo
    settings: AttnormSettings
    heads: dict[str, torch.Tensor]
    base: float
    multiplier: torch.Tensor | None
    dropout: float = 0.0
    need_weights: bool = False
    module_info: dict = dataclasses.field(default_factory=dict)

    @property
    def normalizer(self) -> Normalizer:
        return NORMALIZERS.get(self.settings.normalizer)

    @property
    def groups(self) -> int:
        return self.q.shape[1] // self.k.shape[1]

    def ctx(self) -> Ctx:
        return Ctx(self.settings, self.heads, self.q.shape[-1], self.mask.n, self.module_info, self.k.shape[2])

    def q_factor(self, dtype: torch.dtype) -> torch.Tensor | float:
        """What q is multiplied by before the feature map: base x multiplier, as [B|1, H|1, Lq, 1] or a float."""
        if self.multiplier is None:
            return self.base
        return (self.multiplier.to(dtype) * self.base).unsqueeze(-1)

    def features(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q', k', v) [B, H, L, *] in ``dtype``, k/v repeated for GQA: the normalizer's q/k transform, q times
        base x multiplier, then its feature map, so that scores = q' @ k'^T (the paths that form scores themselves)."""
        norm, ctx = self.normalizer, self.ctx()
        q, k = self.q.to(dtype), repeat_kv(self.k, self.groups).to(dtype)
        q, k = norm.transform_qk(q, k, ctx)
        q, k = norm.feature_map(q * self.q_factor(dtype), k, ctx)
        return q, k, repeat_kv(self.v, self.groups).to(dtype)

    def row_value(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The normalizer's declared per-row constant (``Normalizer.row_value``: symax |eta_h|, sigmoid's bias,
        relu_len 1/n) on q's device, broadcastable to [B, H, Lq]; None for maps without one."""
        r = self.normalizer.row_value(self.ctx(), dtype)
        return None if r is None else r.to(self.q.device)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, L, D] -> [B, Hkv * groups, L, D] (head h uses kv head h // groups, as transformers)."""
    if groups == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 inputs are computed in fp32 inside (denominators such as sum s^2 overflow in half precision)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
