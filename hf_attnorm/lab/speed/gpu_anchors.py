"""The field's own GPU kernels, timed beside hf_attnorm's in the GPU check's benchmark (the anchors): for each, the
implementations it is the anchor of, where it comes from and a call on the benchmark's inputs q, k, v [B, H, n, d].

* flash-linear-attention (``fla-core``, a pure Python + Triton wheel): ``fla.ops.forgetting_attn`` (the FoX authors'
  kernel), ``fla.ops.stickbreaking_attn``, ``fla.ops.linear_attn`` (chunked, with the elu + 1 feature map applied
  first as hf_attnorm's ``linear`` does);
* AdaSplash (``adasplash``): entmax-1.5 (its v2 kernel on causal calls), alpha-entmax (alpha 1.33) and sparsemax
  (alpha 2) through its v1 kernel;
* torch's ``flex_attention`` (compiled), with a score_mod: SSMax's length scale s_h ln(i + 1) and FoX's decay
  c_i - c_j, under a causal block mask.

The GPU machine is offline: the wheels travel with the call (``scripts/gpu_wheels.sh`` downloads them here into
``.cache/gpu-wheels``, ``scripts/gpu_check.sh --wheels .cache/gpu-wheels`` installs them there, without
dependencies). A missing package is recorded as the row's status, never an error of the check.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

#: the wheels the anchors need on the GPU machine (pure Python; torch and triton are the machine's own)
WHEELS = ("fla-core==0.6.0", "adasplash==0.2.2", "einops==0.8.2")


@dataclasses.dataclass(frozen=True)
class Anchor:
    """One anchor row: ``build(q, k, v, causal)`` returns a function computing the output (its inputs are leaves
    with gradients, so the benchmark's forward+backward differentiates it)."""

    name: str
    of: tuple[str, ...]
    package: str | None
    source: str
    build: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], Callable[[], torch.Tensor]]
    causal_only: bool = False

    def missing(self, device: torch.device) -> str | None:
        """Why this anchor cannot run here, or None (every anchor is a GPU kernel)."""
        if device.type != "cuda":
            return "not run: a GPU kernel (no CUDA device)"
        if self.package is not None and importlib.util.find_spec(self.package) is None:
            return (f"not run: {self.package} is not installed ({self.source}; carry the wheels of "
                    "scripts/gpu_wheels.sh and pass --wheels)")
        return None


def _bthd(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B, T, H, D] contiguous (flash-linear-attention's layout)."""
    return x.transpose(1, 2).contiguous()


def _fla_forgetting(q, k, v, causal):
    from fla.ops.forgetting_attn import parallel_forgetting_attn

    g = F.logsigmoid(torch.randn(q.shape[0], q.shape[2], q.shape[1], device=q.device, dtype=torch.float32) + 3.0)
    g.requires_grad_(True)
    return lambda: parallel_forgetting_attn(_bthd(q), _bthd(k), _bthd(v), g)


def _fla_stickbreaking(q, k, v, causal):
    from fla.ops.stickbreaking_attn import parallel_stickbreaking_attn

    return lambda: parallel_stickbreaking_attn(_bthd(q), _bthd(k), _bthd(v))[0]


def _fla_linear(q, k, v, causal):
    from fla.ops.linear_attn import chunk_linear_attn

    return lambda: chunk_linear_attn(F.elu(_bthd(q)) + 1, F.elu(_bthd(k)) + 1, _bthd(v), scale=1.0,
                                     normalize=True)[0]


def _adasplash(alpha: float):
    def build(q, k, v, causal):
        from adasplash import adasplash

        return lambda: adasplash(q, k, v, alpha=alpha, is_causal=causal)
    return build


def _flex(kind: str):
    def build(q, k, v, causal):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        B, H, n, _ = q.shape
        mask = create_block_mask(lambda b, h, i, j: j <= i, B=None, H=None, Q_LEN=n, KV_LEN=n, device=q.device)
        attn = torch.compile(flex_attention, dynamic=False)
        if kind == "ssmax":
            s_h = torch.full((H,), 0.3, device=q.device, requires_grad=True)

            def score_mod(score, b, h, i, j):
                return score * s_h[h] * torch.log((i + 1).to(torch.float32))
        else:  # fox: c = the cumulative log forget gates, [B, H, n]
            c = torch.cumsum(F.logsigmoid(torch.randn(B, H, n, device=q.device) + 3.0), -1).requires_grad_(True)

            def score_mod(score, b, h, i, j):
                return score + c[b, h, i] - c[b, h, j]
        return lambda: attn(q, k, v, score_mod=score_mod, block_mask=mask)
    return build


ANCHORS: dict[str, Anchor] = {a.name: a for a in (
    Anchor("fla_forgetting_attn", ("fox",), "fla", "fla-core 0.6.0", _fla_forgetting, causal_only=True),
    Anchor("fla_stickbreaking_attn", ("stickbreaking",), "fla", "fla-core 0.6.0", _fla_stickbreaking,
           causal_only=True),
    Anchor("fla_linear_attn", ("linear",), "fla", "fla-core 0.6.0", _fla_linear, causal_only=True),
    Anchor("adasplash_entmax15", ("entmax15",), "adasplash", "adasplash 0.2.2", _adasplash(1.5)),
    Anchor("adasplash_alpha_1.33", ("entmax_alpha", "asentmax"), "adasplash", "adasplash 0.2.2", _adasplash(1.33)),
    Anchor("adasplash_sparsemax", ("sparsemax",), "adasplash", "adasplash 0.2.2", _adasplash(2.0)),
    Anchor("flex_ssmax", ("ssmax",), None, "torch flex_attention (compiled)", _flex("ssmax"), causal_only=True),
    Anchor("flex_fox", ("fox",), None, "torch flex_attention (compiled)", _flex("fox"), causal_only=True),
)}
ROW_PREFIX = "anchor:"


def row_name(anchor: Anchor) -> str:
    return f"{ROW_PREFIX}{anchor.name}"


def anchor_of_row(row: str) -> Anchor | None:
    return ANCHORS.get(row[len(ROW_PREFIX):]) if row.startswith(ROW_PREFIX) else None


def anchors_for(implementation: str) -> list[Anchor]:
    """The anchors of an implementation (an implementation may have none)."""
    return [a for a in ANCHORS.values() if implementation in a.of]


def build(anchor: Anchor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Callable[[], Any]:
    """The anchor's call on these inputs (ValueError when it needs a causal call and this is not one)."""
    if anchor.causal_only and not causal:
        raise ValueError(f"{anchor.name} is a causal kernel")
    return anchor.build(q, k, v, causal)
