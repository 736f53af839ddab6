"""From whatever mask transformers passes to the boolean keep-mask and the per-query key count n.

transformers (with our names registered in AttentionMaskInterface with ``sdpa_mask``) passes either a boolean mask
[B, 1, Lq, Lk] (True = keep) or None when nothing beyond causality is masked. With None the causal pattern is
rebuilt here, upper-left aligned like SDPA's ``is_causal`` (query i sees keys j <= i); a single query (cache decode)
sees every key. Additive float masks (eager style, 0 / finfo.min / -inf) are accepted too, but never added to the
scores: non-exponential normalizers would turn finfo.min into huge weights.
"""

from __future__ import annotations

import dataclasses

import torch


class MaskError(TypeError):
    """An attention mask of an unsupported type or shape."""


@dataclasses.dataclass
class MaskInfo:
    """The visibility pattern of one attention call.

    keep: bool [B or 1, 1 or H, Lq, Lk] (True = visible), or None for the structured cases below;
    causal: with keep None, query i sees keys j <= i (upper-left aligned); otherwise every key;
    n: float [B or 1, 1 or H, Lq], number of visible keys, clamped to >= 1 (a scale's log n stays finite);
    has_keys: bool like n, False on fully masked rows (their output is 0).
    """

    keep: torch.Tensor | None
    causal: bool
    n: torch.Tensor
    has_keys: torch.Tensor
    lq: int
    lk: int

    def dense(self, device: torch.device | None = None) -> torch.Tensor:
        """The keep-mask materialised as bool [B or 1, 1 or H, Lq, Lk]."""
        if self.keep is not None:
            return self.keep
        device = device or self.n.device
        if self.causal:
            return causal_keep(self.lq, self.lk, device)
        return torch.ones(1, 1, 1, self.lk, dtype=torch.bool, device=device)


def causal_keep(lq: int, lk: int, device: torch.device | str) -> torch.Tensor:
    """bool [1, 1, Lq, Lk]: key j visible to query i iff j <= i (SDPA's upper-left alignment)."""
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    return (j <= i)[None, None]


def _to_bool(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        # additive mask: 0 = keep; masked entries are -inf or at most half of finfo.min (eager uses finfo.min)
        masked = mask <= torch.finfo(mask.dtype).min / 2
        if not bool(((mask == 0) | masked).all()):
            raise MaskError(
                "additive float attention masks may only hold 0 (keep) and -inf/finfo.min (masked); this one holds "
                "other values (a position bias?), which hf_attnorm normalizers cannot apply. Pass a boolean mask."
            )
        return ~masked
    if mask.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise MaskError("integer attention masks must hold only 0 (masked) and 1 (keep)")
        return mask != 0
    raise MaskError(f"attention mask dtype {mask.dtype} is not supported; use bool (True = keep)")


def build_mask_info(
    attention_mask: object, batch: int, heads: int, lq: int, lk: int, causal: bool, device: torch.device
) -> MaskInfo:
    """Normalise ``attention_mask`` for a call with q [B, H, Lq, D] and k [B, Hkv, Lk, D].

    Accepted: None; bool/int/additive-float tensors of shape [B|1, 1|H, Lq, Lk] (the 4-D masks transformers
    builds), [B|1, Lq, Lk], or [B, Lk] (a padding mask over keys, combined with causality when ``causal``).
    """
    if attention_mask is None:
        if causal and lq > 1:
            i = torch.arange(lq, device=device, dtype=torch.float32)
            n = torch.clamp(i + 1, max=lk).view(1, 1, lq)
            return MaskInfo(None, True, n, n > 0, lq, lk)
        n = torch.full((1, 1, lq), float(lk), device=device)
        return MaskInfo(None, False, n.clamp_min(1), n > 0, lq, lk)
    if not isinstance(attention_mask, torch.Tensor):
        raise MaskError(
            f"attention_mask of type {type(attention_mask).__name__} is not supported by hf_attnorm; expected None "
            "or a tensor (bool, 0/1 integer or additive float) of shape [B, 1, Lq, Lk], [B, Lq, Lk] or [B, Lk]"
        )
    keep = _to_bool(attention_mask)
    if keep.dim() == 2:
        if keep.shape[1] != lk or keep.shape[0] not in (1, batch):
            raise MaskError(f"2-D padding mask must be [B={batch}, Lk={lk}], got {list(keep.shape)}")
        keep = keep[:, None, None, :]
        if causal and lq > 1:
            keep = keep & causal_keep(lq, lk, keep.device)
    elif keep.dim() == 3:
        keep = keep[:, None]
    elif keep.dim() != 4:
        raise MaskError(f"attention mask must be 2-D, 3-D or 4-D, got shape {list(attention_mask.shape)}")
    b, h, mq, mk = keep.shape
    if b not in (1, batch) or h not in (1, heads) or mq not in (1, lq) or mk != lk:
        raise MaskError(
            f"attention mask of shape {list(attention_mask.shape)} does not fit queries [B={batch}, H={heads}, "
            f"Lq={lq}] and {lk} keys; expected [B or 1, 1 or H, Lq or 1, Lk]"
        )
    keep = keep.to(device)
    count = keep.sum(dim=-1, dtype=torch.int32).to(torch.float32)
    if count.shape[-1] != lq:
        count = count.expand(*count.shape[:-1], lq)
    return MaskInfo(keep, causal, count.clamp_min(1), count > 0, lq, lk)
