"""Triton selective attention (path ``selective_triton``): CUDA, or CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` set before triton is imported; tests/test_selective_triton.py).

The math is ``normalizers/selective.py``'s (Leviathan et al., arXiv 2410.02703), computed as ``blocked.py``
does, in query blocks of BLOCK_M rows, with S the selecting head's scores (option ``selective_head``, h0):

    R_kj = relu(S_kj) where query k selects key j (visible, not BOS, not its own key, its own key live), else 0
    F_ij = C_m(j) + sum_{k in the block, k < i} R_kj     (C_m = carry entering block m = sum of R over earlier rows)
    w_i = softmax_j(s_ij - F_ij) for every head

Forward, two kernels: ``_colsum_kernel`` (a program per [query block, key block, batch] tile) writes the column sums
of R per query block [B, nq, Lk]; their exclusive cumsum over blocks (torch) plus the optional entering carry
``AttnCall.selective_carry`` [B, Lk] (a cache's running sums) gives C [B, nq, Lk]. ``_fwd_kernel`` (a program per
[query block, batch x head]) walks the key blocks, recomputes the selecting head's tile, F = C + ``tl.cumsum`` over
rows minus R (exclusive), and runs the online softmax of s - F; it saves the log-sum-exp per row (0 on rows without a
visible key, whose output is 0).

Backward, one kernel ``_bwd_kernel``, a program per [key block, batch]: query blocks from the last to the first,
with G = sum over the later blocks' rows of dF (registers, [BLOCK_N]). Per block: every head's P = exp(s - F - lse),
dV += P^T dO, dS = P (dO V^T - delta) with delta = rowsum(dO * O), dQ += dS K, dK += dS^T Q, dF -= dS; then
dR = G + the in-block reverse exclusive cumsum of dF (``tl.cumsum(reverse=True)``), dS0 = dR where R > 0 (and
selecting), dQ_h0 += dS0 K_h0, dK_h0 += dS0^T Q_h0, G += column sums of dF. G after the first block is the gradient
of the entering carry. dQ, dK, dV go into fp32 buffers by ``tl.atomic_add`` (several programs add to dQ; dK/dV rows
belong to one program but are updated once per head and block), so they are not bitwise deterministic on GPUs.

Memory: O(n d) plus C and the column sums, [B, nq, Lk] fp32 (n^2 / BLOCK_M per batch row, as the CPU path's saved
carries). Inputs are computed in fp32 (fp16/bf16 converted first), dots in IEEE fp32: F sums relu'd scores over
all earlier queries, so TF32's rounding would grow along the sequence. Each tile recomputes the selecting head's
scores (one extra dot per tile and head), and the backward's parallelism is B x ceil(Lk / BLOCK_N) programs, each
looping over every query block and head: written for correctness, not measured on a GPU (none while writing it).

Declines score modifiers (bias, soft-cap, ALiBi, sinks), dropout, q/k transforms, fp64 and calls under
``torch.compile``; those run on the ``selective`` path or the reference.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch

from ...normalizers.base import Normalizer
from ...normalizers.selective import document_starts
from ..base import AttnCall
from ..fused import triton as ta
from .blocked import takes as selective_takes

#: (BLOCK_M, BLOCK_N) on GPUs for head_dim <= 64 and above; interpreted runs use 16 x 16. With one pipeline stage
#: (``NUM_STAGES``) the sm_80 compile reports 24 / 49 / 82 KB of shared memory (column sums / forward / backward) at
#: 64 x 32, D = 64, and 33 / 53 / 100 KB at 32 x 32, D = 128 (Triton's default stages: up to 257 KB, over sm_90's
#: limit); larger head dims need smaller blocks still
BLOCKS_GPU = {64: (64, 32), 128: (32, 32)}
NUM_STAGES = 1
#: dQ, dK, dV are added with tl.atomic_add: not bitwise reproducible on GPUs (tests/test_gpu.py reads this)
DETERMINISTIC = False
#: tests set this to force block sizes
BLOCK_OVERRIDE: tuple[int, int] | None = None

tl: Any = None  # triton.language, bound on first use (the package imports no triton)


# ---------------------------------------------------------------------------------------------------- device code


def _visible(KEEP, b, h, rows, cols, rmask, cmask, sm_b, sm_h, sm_l,
             HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr):
    """bool [BM, BN]: head h's visibility (the keep-mask, else upper-left causal j <= i, else every key)."""
    ok = rmask[:, None] & cmask[None, :]
    if HAS_MASK:
        kp = KEEP + b * sm_b + h * sm_h + rows[:, None] * sm_l + cols[None, :]
        ok = ok & (tl.load(kp, mask=ok, other=0) != 0)
    elif CAUSAL:
        ok = ok & (cols[None, :] <= rows[:, None])
    return ok


def _select_tile(Q, K, KEEP, ROWSEL, b, h0, hk0, STARTS, m, kb, H, HKV, LQ, LK, OFF, DH, sm_b, sm_h, sm_l,
                 HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """The selecting head's tile (query block m, key block kb): (s0 [BM, BN], sel [BM, BN] where R may be > 0,
    q0 [BM, D], k0 [BN, D])."""
    rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rmask = rows < LQ
    cmask = cols < LK
    dmask = offs_d < DH
    q0 = tl.load(Q + ((b * H + h0) * LQ + rows)[:, None] * DH + offs_d[None, :], mask=rmask[:, None] & dmask[None, :],
                 other=0.0)
    k0 = tl.load(K + ((b * HKV + hk0) * LK + cols)[:, None] * DH + offs_d[None, :],
                 mask=cmask[:, None] & dmask[None, :], other=0.0)
    s0 = tl.dot(q0, tl.trans(k0), input_precision="ieee")
    rowsel = tl.load(ROWSEL + b * LQ + rows, mask=rmask, other=0) != 0
    sel = _visible(KEEP, b, h0, rows, cols, rmask, cmask, sm_b, sm_h, sm_l, HAS_MASK, CAUSAL)
    not_bos = tl.load(STARTS + b * LK + cols, mask=cmask, other=0) == 0  # BOS: every document's first key
    sel = sel & rowsel[:, None] & not_bos[None, :] & (cols[None, :] != (rows + OFF)[:, None])
    return s0, sel, q0, k0


def _colsum_kernel(Q, K, KEEP, ROWSEL, STARTS, CS, H, HKV, GROUPS, LQ, LK, OFF, DH, H0, NQ, sm_b, sm_h, sm_l,
                   HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """CS[b, m, cols] = column sums of R over query block m's rows (CS zero-initialised)."""
    m = tl.program_id(0)
    kb = tl.program_id(1)
    b = tl.program_id(2)
    # causal without a mask: a tile right of the block's last row selects nothing
    if (not CAUSAL) or HAS_MASK or kb * BLOCK_N <= m * BLOCK_M + BLOCK_M - 1:
        s0, sel, _, _ = _select_tile(Q, K, KEEP, ROWSEL, b, H0, H0 // GROUPS, STARTS, m, kb, H, HKV, LQ, LK, OFF, DH,
                                     sm_b, sm_h, sm_l, HAS_MASK, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D)
        r = tl.where(sel, tl.maximum(s0, 0.0), 0.0)
        cols = kb * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(CS + (b * NQ + m) * LK + cols, tl.sum(r, axis=0), mask=cols < LK)


def _fwd_kernel(Q, K, V, KEEP, ROWSEL, STARTS, CARRY, OUT, LSE, H, HKV, GROUPS, LQ, LK, OFF, DH, DV, H0, NQ,
                sm_b, sm_h, sm_l,
                HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUPS
    rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < LQ
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    dmask = offs_d < DH
    emask = offs_e < DV
    q = tl.load(Q + (bh * LQ + rows)[:, None] * DH + offs_d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    end = LK
    if CAUSAL and not HAS_MASK:
        end = tl.minimum(LK, m * BLOCK_M + BLOCK_M)
    for kb in range(0, tl.cdiv(end, BLOCK_N)):
        cols = kb * BLOCK_N + offs_n
        cmask = cols < LK
        s0, sel, _, _ = _select_tile(Q, K, KEEP, ROWSEL, b, H0, H0 // GROUPS, STARTS, m, kb, H, HKV, LQ, LK, OFF, DH,
                                     sm_b, sm_h, sm_l, HAS_MASK, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D)
        r = tl.where(sel, tl.maximum(s0, 0.0), 0.0)
        f = tl.load(CARRY + (b * NQ + m) * LK + cols, mask=cmask, other=0.0)[None, :] + tl.cumsum(r, axis=0) - r
        k = tl.load(K + ((b * HKV + hk) * LK + cols)[:, None] * DH + offs_d[None, :],
                    mask=cmask[:, None] & dmask[None, :], other=0.0)
        vis = _visible(KEEP, b, h, rows, cols, rmask, cmask, sm_b, sm_h, sm_l, HAS_MASK, CAUSAL)
        s = tl.where(vis, tl.dot(q, tl.trans(k), input_precision="ieee") - f, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet: exp(-inf) = 0
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m_i - shift)
        v = tl.load(V + ((b * HKV + hk) * LK + cols)[:, None] * DV + offs_e[None, :],
                    mask=cmask[:, None] & emask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(OUT + (bh * LQ + rows)[:, None] * DV + offs_e[None, :], out, mask=rmask[:, None] & emask[None, :])
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), 0.0)
    tl.store(LSE + bh * LQ + rows, lse, mask=rmask)


def _bwd_kernel(Q, K, V, KEEP, ROWSEL, STARTS, CARRY, LSE, DELTA, DO, DQ, DK, DV_, DCARRY, H, HKV, GROUPS, LQ, LK, OFF,
                DH, DV, H0, NQ, sm_b, sm_h, sm_l,
                HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    kb = tl.program_id(0)
    b = tl.program_id(1)
    hk0 = H0 // GROUPS
    cols = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < LK
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    dmask = offs_d < DH
    emask = offs_e < DV
    kmask = cmask[:, None] & dmask[None, :]
    vmask = cmask[:, None] & emask[None, :]
    g = tl.zeros((BLOCK_N,), dtype=tl.float32)  # sum of dF over the rows of the later query blocks
    first = 0
    if CAUSAL and not HAS_MASK:
        first = (kb * BLOCK_N) // BLOCK_M  # earlier query blocks see none of these keys
    for t in range(0, NQ - first):
        m = NQ - 1 - t
        rows = m * BLOCK_M + offs_m
        rmask = rows < LQ
        s0, sel, q0, k0 = _select_tile(Q, K, KEEP, ROWSEL, b, H0, hk0, STARTS, m, kb, H, HKV, LQ, LK, OFF, DH,
                                       sm_b, sm_h, sm_l, HAS_MASK, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D)
        r = tl.where(sel, tl.maximum(s0, 0.0), 0.0)
        f = tl.load(CARRY + (b * NQ + m) * LK + cols, mask=cmask, other=0.0)[None, :] + tl.cumsum(r, axis=0) - r
        df = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for h in range(0, H):
            bh = b * H + h
            hk = h // GROUPS
            qmask = rmask[:, None] & dmask[None, :]
            omask = rmask[:, None] & emask[None, :]
            q = tl.load(Q + (bh * LQ + rows)[:, None] * DH + offs_d[None, :], mask=qmask, other=0.0)
            do = tl.load(DO + (bh * LQ + rows)[:, None] * DV + offs_e[None, :], mask=omask, other=0.0)
            lse = tl.load(LSE + bh * LQ + rows, mask=rmask, other=0.0)
            delta = tl.load(DELTA + bh * LQ + rows, mask=rmask, other=0.0)
            k = tl.load(K + ((b * HKV + hk) * LK + cols)[:, None] * DH + offs_d[None, :], mask=kmask, other=0.0)
            v = tl.load(V + ((b * HKV + hk) * LK + cols)[:, None] * DV + offs_e[None, :], mask=vmask, other=0.0)
            vis = _visible(KEEP, b, h, rows, cols, rmask, cmask, sm_b, sm_h, sm_l, HAS_MASK, CAUSAL)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") - f
            p = tl.where(vis, tl.exp(s - lse[:, None]), 0.0)
            ds = p * (tl.dot(do, tl.trans(v), input_precision="ieee") - delta[:, None])
            dkv = (b * HKV + hk) * LK + cols
            tl.atomic_add(DV_ + dkv[:, None] * DV + offs_e[None, :], tl.dot(tl.trans(p), do, input_precision="ieee"),
                          mask=vmask)
            tl.atomic_add(DK + dkv[:, None] * DH + offs_d[None, :], tl.dot(tl.trans(ds), q, input_precision="ieee"),
                          mask=kmask)
            tl.atomic_add(DQ + (bh * LQ + rows)[:, None] * DH + offs_d[None, :],
                          tl.dot(ds, k, input_precision="ieee"), mask=qmask)
            df -= ds  # the penalty enters every head's scores with sign -1
        dr = g[None, :] + tl.cumsum(df, axis=0, reverse=True) - df  # sum of dF over the later rows
        ds0 = tl.where(sel & (s0 > 0), dr, 0.0)
        tl.atomic_add(DQ + ((b * H + H0) * LQ + rows)[:, None] * DH + offs_d[None, :],
                      tl.dot(ds0, k0, input_precision="ieee"), mask=rmask[:, None] & dmask[None, :])
        tl.atomic_add(DK + ((b * HKV + hk0) * LK + cols)[:, None] * DH + offs_d[None, :],
                      tl.dot(tl.trans(ds0), q0, input_precision="ieee"), mask=kmask)
        g += tl.sum(df, axis=0)
    tl.store(DCARRY + b * LK + cols, g, mask=cmask)


_JIT = ("_visible", "_select_tile", "_colsum_kernel", "_fwd_kernel", "_bwd_kernel")
_HELPERS = ("_visible", "_select_tile")
_COMPILED: dict[bool, types.SimpleNamespace] = {}


def _compiled() -> types.SimpleNamespace:
    """The jitted kernels for the current mode (compiled or interpreted), once per mode (see ``fused/triton.py``)."""
    global tl
    ta._load_triton()
    tl = ta.tl
    mode = ta.jit_interprets()
    if mode not in _COMPILED:
        _COMPILED[mode] = ta.jit_namespace(globals(), _JIT, _HELPERS, mode)
    return _COMPILED[mode]


# ------------------------------------------------------------------------------------------------------ host code


def _blocks(q: torch.Tensor) -> tuple[int, int]:
    if BLOCK_OVERRIDE is not None:
        return BLOCK_OVERRIDE
    if not q.is_cuda:
        return 16, 16
    return BLOCKS_GPU[64] if q.shape[-1] <= 64 else BLOCKS_GPU[128]


def _launch(q: torch.Tensor) -> dict[str, int]:
    """Launch options: one pipeline stage on GPUs (shared memory, above); none for the interpreter."""
    return {"num_stages": NUM_STAGES} if q.is_cuda else {}


class _Meta:
    """Per call: the mask as uint8 [B, H, Lq, Lk] (broadcast strides) or None, the selection facts and sizes."""

    def __init__(self, call: AttnCall) -> None:
        q, k = call.q, call.k
        B, H, self.lq, _ = q.shape
        self.lk = k.shape[2]
        self.head = call.normalizer.selecting_head(call.settings)
        self.causal = bool(call.mask.causal)
        dev = q.device
        keep = call.mask.keep
        if keep is None:
            live_n = min(self.lq, self.lk) if self.causal else self.lk  # upper-left causal: keys >= Lq are unseen
            live = (torch.arange(self.lk, device=dev) < live_n)[None].expand(B, self.lk)
            starts = (torch.arange(self.lk, device=dev) == 0)[None]  # key 0 is the only BOS
            self.keep = None
        else:
            keep = keep.to(dev)
            ks = keep[:, self.head] if keep.shape[1] > 1 else keep[:, 0]
            live = ks.any(dim=-2).expand(B, self.lk)  # keys some query of the selecting head sees
            starts = document_starts(ks)
            keep = (keep if keep.stride(-1) == 1 else keep.contiguous()).expand(B, H, self.lq, self.lk)
            self.keep = keep.view(torch.uint8)  # (a byte per entry either way; Triton loads u8, not i1)
        # the BOS keys (every document's first key under packing), uint8 [B, Lk]
        self.starts = starts.expand(B, self.lk).to(torch.uint8).contiguous()
        own = torch.arange(self.lq, device=dev) + (self.lk - self.lq)  # query i's own key
        inside = (own >= 0) & (own < self.lk)
        # a query whose own key is dead (padding) selects nothing: uint8 [B, Lq]
        self.rowsel = torch.where(inside, live[:, own.clamp(0, self.lk - 1)], True).to(torch.uint8).contiguous()

    def mask_args(self, fallback: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
        if self.keep is None:
            return fallback, 0, 0, 0
        s = self.keep.stride()
        return self.keep, s[0], s[1], s[2]


class _SelTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, carry0, meta: _Meta):
        kern = _compiled()
        B, H, Lq, D = q.shape
        Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
        bm, bn = _blocks(q)
        nq, nk = -(-Lq // bm), -(-Lk // bn)
        keep, sb, sh, sl = meta.mask_args(meta.rowsel)
        flags = dict(HAS_MASK=meta.keep is not None, CAUSAL=meta.causal, BLOCK_M=bm, BLOCK_N=bn,
                     BLOCK_D=ta._pow2(D))
        cs = torch.zeros(B, nq, Lk, device=q.device, dtype=torch.float32)
        ta.launch(kern._colsum_kernel, (nq, nk, B))(
            q, k, keep, meta.rowsel, meta.starts, cs, H, Hkv, H // Hkv, Lq, Lk, Lk - Lq, D, meta.head, nq, sb, sh, sl,
            **flags, **_launch(q))
        carry = torch.cumsum(cs, dim=1) - cs  # exclusive over blocks: the sums entering each block
        if carry0 is not None:
            carry = carry + carry0[:, None, :]
        carry = carry.contiguous()
        out = torch.empty(B, H, Lq, Dv, device=q.device, dtype=torch.float32)
        lse = torch.empty(B, H, Lq, device=q.device, dtype=torch.float32)
        ta.launch(kern._fwd_kernel, (nq, B * H))(
            q, k, v, keep, meta.rowsel, meta.starts, carry, out, lse, H, Hkv, H // Hkv, Lq, Lk, Lk - Lq, D, Dv,
            meta.head, nq, sb, sh, sl, BLOCK_DV=ta._pow2(Dv), **flags, **_launch(q))
        ctx.save_for_backward(q, k, v, carry, out, lse)
        ctx.meta, ctx.blocks, ctx.has_carry = meta, (bm, bn), carry0 is not None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, carry, out, lse = ctx.saved_tensors
        meta: _Meta = ctx.meta
        bm, bn = ctx.blocks
        kern = _compiled()
        B, H, Lq, D = q.shape
        Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
        nq, nk = -(-Lq // bm), -(-Lk // bn)
        dout = dout.float().contiguous()
        delta = (dout * out).sum(dim=-1).contiguous()  # [B, H, Lq]
        dq = torch.zeros_like(q)
        dk = torch.zeros(B, Hkv, Lk, D, device=q.device, dtype=torch.float32)
        dv = torch.zeros(B, Hkv, Lk, Dv, device=q.device, dtype=torch.float32)
        dcarry = torch.empty(B, Lk, device=q.device, dtype=torch.float32)
        keep, sb, sh, sl = meta.mask_args(meta.rowsel)
        ta.launch(kern._bwd_kernel, (nk, B))(
            q, k, v, keep, meta.rowsel, meta.starts, carry, lse, delta, dout, dq, dk, dv, dcarry, H, Hkv, H // Hkv, Lq,
            Lk, Lk - Lq, D, Dv, meta.head, nq, sb, sh, sl, HAS_MASK=meta.keep is not None, CAUSAL=meta.causal,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=ta._pow2(D), BLOCK_DV=ta._pow2(Dv), **_launch(q))
        return dq, dk, dv, dcarry if ctx.has_carry else None, None


def takes(norm: Normalizer) -> str | None:
    """Query-coupled normalizers with a selecting head (``selective``) that do not transform q/k."""
    why = selective_takes(norm)
    if why is None and (type(norm).transform_qk is not Normalizer.transform_qk
                        or type(norm).feature_map is not Normalizer.feature_map):
        why = f"normalizer {norm.name!r} transforms q/k, which the Triton selective kernels do not"
    return why


def accepts(call: AttnCall) -> str | None:
    """None, or why not (score modifiers and dropout: declared features, not supported): empty inputs, CPU tensors
    without the interpreter, fp64, a ``selective_carry`` not a float [B | 1, Lk], triton missing or imported before
    ``TRITON_INTERPRET`` changed."""
    q, k, v = call.q, call.k, call.v
    if q.numel() == 0 or k.shape[2] == 0 or v.numel() == 0:
        return "empty inputs"
    if not (q.is_cuda or (q.device.type == "cpu" and ta.interpreter_requested())):
        return (f"Triton kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter "
                f"(TRITON_INTERPRET=1, set before triton is imported); got device {q.device}")
    if not (k.device == v.device == q.device):
        return "q, k, v on different devices"
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {q.dtype}: the Triton kernels take float32, float16 and bfloat16"
    carry = getattr(call, "selective_carry", None)
    if carry is not None and (carry.dim() != 2 or carry.shape[0] not in (1, q.shape[0]) or carry.shape[1] != k.shape[2]
                              or not carry.is_floating_point()):
        return (f"selective_carry must be a float tensor [B={q.shape[0]} or 1, Lk={k.shape[2]}]; got {carry.dtype} "
                f"{list(carry.shape)}")
    if not ta.triton_installed():
        return "triton is not installed (pip install triton)"
    ta._load_triton()
    if not ta.interpreter_consistent():
        return ("TRITON_INTERPRET changed after triton was imported (triton fixes interpreted vs compiled mode at "
                "import); set TRITON_INTERPRET=1 in the environment before anything imports triton")
    return None


def triton_selective_attention(call: AttnCall) -> tuple[torch.Tensor, None]:
    """out [B, H, Lq, Dv] in the input dtype (computed in fp32); k/v are not repeated for GQA. A call carrying
    ``selective_carry`` [B | 1, Lk] (the column sums of the earlier queries' R, a cache's state) starts from it."""
    with torch.cuda.device(call.q.device) if call.q.is_cuda else contextlib.nullcontext():
        q = (call.q.float() * call.q_factor(torch.float32)).contiguous()  # scale (and its gradient) in torch
        k, v = call.k.float().contiguous(), call.v.float().contiguous()
        carry = getattr(call, "selective_carry", None)
        if carry is not None:
            carry = carry.to(device=q.device, dtype=torch.float32).expand(q.shape[0], k.shape[2]).contiguous()
        out = _SelTriton.apply(q, k, v, carry, _Meta(call))
    return out.to(call.q.dtype), None


from ..dispatch import register_path  # noqa: E402  (registration at import, like the normalizers)

register_path("selective_triton", triton_selective_attention, takes=takes, accepts=accepts, priority=35,
              supports=("selective_carry",), auto_exclude=("cpu",),
              traceable=False)  # (the host-side plan and the launches in an autograd.Function)
