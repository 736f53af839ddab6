"""Row-wise Triton kernels around SDPA on a GPU: the elementwise work of the softmax-family paths in one pass each
(half-precision inputs computed in fp32 inside, written back in the input dtype), forward and backward, where the
PyTorch ops would spend several passes through fp32 copies.

* ``row_scale(x, factor, normalize, eps)``: y = x / max(|x|, eps) * f (``normalize``: cosine's QK-norm) or x * f,
  per row of x [B, H, L, D], f [B|1, H|1, L|1] fp32 (a per-query scale, with its gradient) or a number; the
  queries of every length scale and cosine's queries and keys;
* ``rms_difference(first, second, lam, weight, factor, eps)``: y = RMSNorm(first - lam_h second) weight_h factor per
  row of [B, H, L, Dv] (differential attention's combination of its two halves, the form ``Normalizer.
  difference_form`` declares).

The paths use them for CUDA tensors in fp16/bf16 outside torch.compile (which fuses the same PyTorch ops itself);
forced onto the CPU under Triton's interpreter, tests/test_triton_rows.py checks them against those PyTorch ops.
Device code first (plain functions jitted on first use, ``triton_common.jit_namespace``), then the host side.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from . import triton_common as tc

tl: Any = None  # triton.language, bound on first use (the package imports no triton)

BLOCK_ROWS = 16


# ---------------------------------------------------------------------------------------------------- device code


def _row_offsets(pid_r, pid_bh, H, L, sb, sh, sl, BLOCK_R: tl.constexpr):
    """(rows of this program [BR] within its (batch, head), their element offsets through the strides, valid)."""
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    return rows, b * sb + h * sh + rows.to(tl.int64) * sl, rows < L


def _row_scale_fwd(X, F, Y, H, L, D, sxb, sxh, sxl, sfb, sfh, sfl, EPS,
                   NORMALIZE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Y [B, H, L, D] contiguous (X's dtype) = X / max(|X|, EPS) * F or X * F, per row; F [B|1, H|1, L|1] fp32."""
    pid_r = tl.program_id(0)
    pid_bh = tl.program_id(1)
    rows, xoff, valid = _row_offsets(pid_r, pid_bh, H, L, sxb, sxh, sxl, BLOCK_R)
    _, foff, _ = _row_offsets(pid_r, pid_bh, H, L, sfb, sfh, sfl, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    m = valid[:, None] & (cols < D)[None, :]
    x = tl.load(X + xoff[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    f = tl.load(F + foff, mask=valid, other=0.0)
    if NORMALIZE:
        f = f / tl.maximum(tl.sqrt(tl.sum(x * x, 1)), EPS)
    y = x * f[:, None]
    out = (pid_bh.to(tl.int64) * L + rows.to(tl.int64)) * D
    tl.store(Y + out[:, None] + cols[None, :], y.to(Y.dtype.element_ty), mask=m)


def _row_scale_bwd(X, F, G, DX, DF, H, L, D, sxb, sxh, sxl, sfb, sfh, sfl, sgb, sgh, sgl, EPS,
                   NORMALIZE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """DX [B, H, L, D] contiguous (X's dtype) and DF [B, H, L] fp32 (d/dF per row, summed to F's shape by the
    host) from the output's gradient G. NORMALIZE with n = |x| >= EPS: y = f x / n, so dx = f / n (g - xh (xh . g))
    with xh = x / n, df = xh . g; below EPS, y = f x / EPS: dx = f g / EPS, df = x . g / EPS."""
    pid_r = tl.program_id(0)
    pid_bh = tl.program_id(1)
    rows, xoff, valid = _row_offsets(pid_r, pid_bh, H, L, sxb, sxh, sxl, BLOCK_R)
    _, foff, _ = _row_offsets(pid_r, pid_bh, H, L, sfb, sfh, sfl, BLOCK_R)
    _, goff, _ = _row_offsets(pid_r, pid_bh, H, L, sgb, sgh, sgl, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    m = valid[:, None] & (cols < D)[None, :]
    x = tl.load(X + xoff[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    g = tl.load(G + goff[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    f = tl.load(F + foff, mask=valid, other=0.0)
    if NORMALIZE:
        n = tl.sqrt(tl.sum(x * x, 1))
        big = n >= EPS
        inv = 1.0 / tl.maximum(n, EPS)
        xh = x * inv[:, None]
        xg = tl.sum(xh * g, 1)
        dx = (f * inv)[:, None] * (g - tl.where(big, xg, 0.0)[:, None] * xh)
        df = xg
    else:
        dx = f[:, None] * g
        df = tl.sum(x * g, 1)
    row = pid_bh.to(tl.int64) * L + rows.to(tl.int64)
    tl.store(DX + (row * D)[:, None] + cols[None, :], dx.to(DX.dtype.element_ty), mask=m)
    tl.store(DF + row, df, mask=valid)


def _rms_diff_fwd(A, C, LAM, W, Y, H, L, DV, FACTOR, EPS, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Y = (A - LAM[h] C) rsqrt(mean((A - LAM[h] C)^2) + EPS) W[h] FACTOR per row; A, C, Y [B, H, L, Dv]
    contiguous (the input dtype), LAM [H], W [H, Dv] fp32."""
    pid_r = tl.program_id(0)
    pid_bh = tl.program_id(1)
    h = pid_bh % H
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    valid = rows < L
    m = valid[:, None] & (cols < DV)[None, :]
    off = ((pid_bh.to(tl.int64) * L + rows.to(tl.int64)) * DV)[:, None] + cols[None, :]
    d = (tl.load(A + off, mask=m, other=0.0).to(tl.float32)
         - tl.load(LAM + h) * tl.load(C + off, mask=m, other=0.0).to(tl.float32))
    r = 1.0 / tl.sqrt(tl.sum(d * d, 1) / DV + EPS)
    w = tl.load(W + h * DV + cols, mask=cols < DV, other=0.0)
    y = d * r[:, None] * w[None, :] * FACTOR
    tl.store(Y + off, y.to(Y.dtype.element_ty), mask=m)


def _rms_diff_bwd(A, C, LAM, W, G, DA, DC, DLAM, DW, H, L, DV, FACTOR, EPS,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """From the output's gradient G [B, H, L, Dv] (contiguous): DA = dd, DC = -lam dd (the input dtype) with
    dd = r (g w c) - d r^3 mean(d g w c); DLAM [B, H, L] = -sum_j c_j dd_j per row and DW [B x H, programs along L,
    Dv] = sum over the program's rows of g d r c (the host sums both per head)."""
    pid_r = tl.program_id(0)
    pid_bh = tl.program_id(1)
    h = pid_bh % H
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    valid = rows < L
    cv = cols < DV
    m = valid[:, None] & cv[None, :]
    row = pid_bh.to(tl.int64) * L + rows.to(tl.int64)
    off = (row * DV)[:, None] + cols[None, :]
    lam = tl.load(LAM + h)
    a = tl.load(A + off, mask=m, other=0.0).to(tl.float32)
    c = tl.load(C + off, mask=m, other=0.0).to(tl.float32)
    g = tl.load(G + off, mask=m, other=0.0).to(tl.float32)
    w = tl.load(W + h * DV + cols, mask=cv, other=0.0)
    d = a - lam * c
    r = 1.0 / tl.sqrt(tl.sum(d * d, 1) / DV + EPS)
    gw = g * w[None, :] * FACTOR
    dd = r[:, None] * gw - d * (r * r * r * tl.sum(d * gw, 1) / DV)[:, None]
    tl.store(DA + off, dd.to(DA.dtype.element_ty), mask=m)
    tl.store(DC + off, (-lam * dd).to(DC.dtype.element_ty), mask=m)
    tl.store(DLAM + row, -tl.sum(c * dd, 1), mask=valid)
    part = tl.sum(g * d * r[:, None] * FACTOR, 0)
    tl.store(DW + (pid_bh.to(tl.int64) * tl.num_programs(0) + pid_r) * DV + cols, part, mask=cv)


_JIT = ("_row_offsets", "_row_scale_fwd", "_row_scale_bwd", "_rms_diff_fwd", "_rms_diff_bwd")
_HELPERS = ("_row_offsets",)
_COMPILED: dict[bool, types.SimpleNamespace] = {}


def _compiled() -> types.SimpleNamespace:
    """The jitted kernels for the current mode (compiled or interpreted), once per mode (``triton_common``)."""
    global tl
    tc.load()
    tl = tc.tl
    mode = tc.jit_interprets()
    if mode not in _COMPILED:
        _COMPILED[mode] = tc.jit_namespace(globals(), _JIT, _HELPERS, mode)
    return _COMPILED[mode]


# ------------------------------------------------------------------------------------------------------ host code


def usable(x: torch.Tensor) -> bool:
    """Whether the row kernels take over from the PyTorch ops: half precision on CUDA, triton there, not while
    torch.compile traces (it fuses the PyTorch ops itself), not under torch.export."""
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and tc.triton_installed()
            and not torch.compiler.is_compiling())


def _rows4(t: torch.Tensor) -> list[int]:
    """Strides of the batch, head and row dims of a [B|1, H|1, L|1, ...] tensor (0 on its size-1 dims)."""
    return [0 if t.shape[i] == 1 else t.stride(i) for i in range(3)]


class _RowScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor, normalize: bool, eps: float):
        kern = _compiled()
        B, H, L, D = x.shape
        y = torch.empty(B, H, L, D, dtype=x.dtype, device=x.device)
        grid = (tc.cdiv(L, BLOCK_ROWS), B * H)
        tc.launch(kern._row_scale_fwd, grid)(x, factor, y, H, L, D, *_rows4(x), *_rows4(factor), eps,
                                             NORMALIZE=normalize, BLOCK_R=BLOCK_ROWS, BLOCK_D=tc.pow2(D))
        ctx.save_for_backward(x, factor)
        ctx.normalize, ctx.eps = normalize, eps
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        x, factor = ctx.saved_tensors
        if g.stride(-1) != 1:  # (e.g. the expanded ones of a sum's backward)
            g = g.contiguous()
        kern = _compiled()
        B, H, L, D = x.shape
        dx = torch.empty(B, H, L, D, dtype=x.dtype, device=x.device)
        df = torch.empty(B, H, L, dtype=torch.float32, device=x.device)
        grid = (tc.cdiv(L, BLOCK_ROWS), B * H)
        tc.launch(kern._row_scale_bwd, grid)(x, factor, g, dx, df, H, L, D, *_rows4(x), *_rows4(factor),
                                             *_rows4(g), ctx.eps, NORMALIZE=ctx.normalize, BLOCK_R=BLOCK_ROWS,
                                             BLOCK_D=tc.pow2(D))
        dfactor = None
        if ctx.needs_input_grad[1]:
            dims = [i for i in range(3) if factor.shape[i] == 1 and df.shape[i] > 1]
            dfactor = (df.sum(dims, keepdim=True) if dims else df).view(factor.shape)
        return dx, dfactor, None, None


def row_scale(x: torch.Tensor, factor: torch.Tensor | float, normalize: bool = False,
              eps: float = 1e-12) -> torch.Tensor:
    """[B, H, L, D] in x's dtype: x / max(|x|, eps) * f (``normalize``) or x * f, computed in fp32 in one pass
    (backward too); factor: [B|1, H|1, L|1] or [B|1, H|1, L|1, 1] (any float dtype, with its gradient), or a
    number. Last dim of x contiguous."""
    if not isinstance(factor, torch.Tensor):
        factor = torch.full((1, 1, 1), float(factor), dtype=torch.float32, device=x.device)
    if factor.dim() == 4:
        factor = factor.squeeze(-1)
    factor = factor.to(torch.float32)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _RowScale.apply(x, factor, normalize, eps)


class _RmsDifference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, first, second, lam, weight, factor: float, eps: float):
        kern = _compiled()
        first, second = first.contiguous(), second.contiguous()
        B, H, L, DV = first.shape
        y = torch.empty_like(first)
        grid = (tc.cdiv(L, BLOCK_ROWS), B * H)
        tc.launch(kern._rms_diff_fwd, grid)(first, second, lam, weight, y, H, L, DV, factor, eps,
                                            BLOCK_R=BLOCK_ROWS, BLOCK_D=tc.pow2(DV))
        ctx.save_for_backward(first, second, lam, weight)
        ctx.factor, ctx.eps = factor, eps
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        first, second, lam, weight = ctx.saved_tensors
        kern = _compiled()
        B, H, L, DV = first.shape
        nblk = tc.cdiv(L, BLOCK_ROWS)
        da, dc = torch.empty_like(first), torch.empty_like(second)
        dlam = torch.empty(B, H, L, dtype=torch.float32, device=first.device)
        dw = torch.empty(B * H, nblk, DV, dtype=torch.float32, device=first.device)
        tc.launch(kern._rms_diff_bwd, (nblk, B * H))(first, second, lam, weight, g.contiguous(), da, dc, dlam, dw,
                                                     H, L, DV, ctx.factor, ctx.eps, BLOCK_R=BLOCK_ROWS,
                                                     BLOCK_D=tc.pow2(DV))
        return (da, dc, dlam.sum((0, 2)).to(lam.dtype), dw.view(B, H, nblk, DV).sum((0, 2)).to(weight.dtype),
                None, None)


def rms_difference(first: torch.Tensor, second: torch.Tensor, lam: torch.Tensor, weight: torch.Tensor,
                   factor: float, eps: float) -> torch.Tensor:
    """[B, H, L, Dv] in first's dtype: RMSNorm_eps(first - lam_h second) * weight_h * factor per row, in fp32 inside,
    one pass forward and backward. first, second: [B, H, L, Dv]; lam: [H]; weight: [H, Dv] (gradients to all)."""
    return _RmsDifference.apply(first, second, lam.to(torch.float32).contiguous(),
                                weight.to(torch.float32).contiguous(), float(factor), float(eps))
