"""Triton stick-breaking attention (path ``stickbreaking_triton``): CUDA, or CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` set before triton is imported; tests/test_stickbreaking_triton.py).

The scan of ``stickbreaking.py`` with a program per (query block, batch x head): key blocks from the block's last
own key backwards, in log space inside a block (the suffix sums of softplus by ``tl.cumsum(reverse=True)``),
O += A V by ``tl.dot``; the running sum c is saved at each key block's edge ([B, H, Lq, nkb + 1]). Backward, one
program per query block again: key blocks left to right, the prefix P by ``tl.cumsum``, dQ in registers, dK and dV
by ``tl.atomic_add`` into fp32 buffers (so the gradients of k and v are not bitwise deterministic on GPUs; the CPU
paths are). Inputs are computed in fp32 (fp16/bf16 converted first); dots in IEEE fp32 (TF32's 10-bit mantissa would
put ~1e-3 relative errors into the scores, and the stick compounds them along the row). Not measured on a GPU (none
while writing it): correctness is checked under the interpreter only.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch

from ..base import AttnCall
from ..fused import triton as ta
from .scan import common_reason, options, own_index, takes, with_offset

#: (BLOCK_M, BLOCK_N) on GPUs; interpreted runs use 16 x 16
BLOCKS_GPU = (64, 32)
#: dK and dV are added with tl.atomic_add: not bitwise reproducible on GPUs (tests/test_gpu.py reads this)
DETERMINISTIC = False
#: tests set this to force block sizes
BLOCK_OVERRIDE: tuple[int, int] | None = None

tl: Any = None  # triton.language, bound on first use (the package imports no triton)


# ---------------------------------------------------------------------------------------------------- device code


def _softplus_parts(z):
    """(softplus(z), logsigmoid(z)) from one exp and one log."""
    l1p = tl.log(1.0 + tl.exp(-tl.abs(z)))
    return tl.maximum(z, 0.0) + l1p, tl.minimum(z, 0.0) - l1p


def _tile(K, KEEP, q, lim, rows, rmask, kb, LK, sk_l, sm_b, sm_h, sm_l, b, h, offs_n, offs_d, dmask,
          HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Scores z [BM, BN] of the key block kb and the keys that break the stick there."""
    cols = kb * BLOCK_N + offs_n
    cmask = cols < LK
    k = tl.load(K + cols[:, None] * sk_l + offs_d[None, :], mask=cmask[:, None] & dmask[None, :], other=0.0)
    z = tl.dot(q, tl.trans(k), input_precision="ieee")
    part = (cols[None, :] < lim[:, None]) & rmask[:, None] & cmask[None, :]
    if HAS_MASK:
        kp = KEEP + b * sm_b + h * sm_h + rows[:, None] * sm_l + cols[None, :]
        part = part & (tl.load(kp, mask=rmask[:, None] & cmask[None, :], other=0) != 0)
    return tl.where(part, z, 0.0), part, cols, cmask


def _sb_fwd_kernel(Q, K, V, KEEP, OWN, OUT, C, H, GROUPS, LQ, LK, DH, DV, NC,
                   sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sm_b, sm_h, sm_l,
                   ATTEND_CURRENT: tl.constexpr, REMAINDER: tl.constexpr, HAS_MASK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUPS
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < LQ
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    dmask = offs_d < DH
    emask = offs_e < DV
    own = tl.load(OWN + bh * LQ + rows, mask=rmask, other=-1)
    lim = own + ATTEND_CURRENT
    q = tl.load(Q + (bh * LQ + rows)[:, None] * DH + offs_d[None, :], mask=rmask[:, None] & dmask[None, :],
                other=0.0)
    Kh = K + b * sk_b + hk * sk_h
    Vh = V + b * sv_b + hk * sv_h
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    c = tl.zeros((BLOCK_M,), dtype=tl.float32)
    end = tl.minimum(tl.max(own, axis=0) + 1, LK)
    nk = (end + BLOCK_N - 1) // BLOCK_N
    for t in range(0, nk):
        kb = nk - 1 - t
        tl.store(C + (bh * LQ + rows) * NC + kb, c, mask=rmask)
        z, part, cols, cmask = _tile(Kh, KEEP, q, lim, rows, rmask, kb, LK, sk_l, sm_b, sm_h, sm_l, b, h,
                                     offs_n, offs_d, dmask, HAS_MASK, BLOCK_N)
        sp, ls = _softplus_parts(z)
        sp = tl.where(part, sp, 0.0)
        after = tl.cumsum(sp, axis=1, reverse=True) - sp
        a = tl.where(part, tl.exp(ls - after - c[:, None]), 0.0)
        v = tl.load(Vh + cols[:, None] * sv_l + offs_e[None, :], mask=cmask[:, None] & emask[None, :], other=0.0)
        acc += tl.dot(a, v, input_precision="ieee")
        c += tl.sum(sp, axis=1)
    tl.store(C + (bh * LQ + rows) * NC + NC - 1, c, mask=rmask)
    if REMAINDER:
        has = rmask & (own >= 0)
        vo = tl.load(Vh + tl.maximum(own, 0)[:, None] * sv_l + offs_e[None, :], mask=has[:, None] & emask[None, :],
                     other=0.0)
        acc += tl.where(has, tl.exp(-c), 0.0)[:, None] * vo
    tl.store(OUT + (bh * LQ + rows)[:, None] * DV + offs_e[None, :], acc, mask=rmask[:, None] & emask[None, :])


def _sb_bwd_kernel(Q, K, V, KEEP, OWN, C, DO, DQ, DK, DV_, H, GROUPS, HKV, LQ, LK, DH, DV, NC,
                   sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sm_b, sm_h, sm_l,
                   ATTEND_CURRENT: tl.constexpr, REMAINDER: tl.constexpr, HAS_MASK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUPS
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < LQ
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    dmask = offs_d < DH
    emask = offs_e < DV
    own = tl.load(OWN + bh * LQ + rows, mask=rmask, other=-1)
    lim = own + ATTEND_CURRENT
    q = tl.load(Q + (bh * LQ + rows)[:, None] * DH + offs_d[None, :], mask=rmask[:, None] & dmask[None, :],
                other=0.0)
    do = tl.load(DO + (bh * LQ + rows)[:, None] * DV + offs_e[None, :], mask=rmask[:, None] & emask[None, :],
                 other=0.0)
    Kh = K + b * sk_b + hk * sk_h
    Vh = V + b * sv_b + hk * sv_h
    DKh = DK + (b * HKV + hk) * LK * DH
    DVh = DV_ + (b * HKV + hk) * LK * DV
    rr = tl.zeros((BLOCK_M,), dtype=tl.float32)
    r = tl.zeros((BLOCK_M,), dtype=tl.float32)
    has = rmask & (own >= 0)
    if REMAINDER:
        vo = tl.load(Vh + tl.maximum(own, 0)[:, None] * sv_l + offs_e[None, :], mask=has[:, None] & emask[None, :],
                     other=0.0)
        ctot = tl.load(C + (bh * LQ + rows) * NC + NC - 1, mask=rmask, other=0.0)
        r = tl.where(has, tl.exp(-ctot), 0.0)
        rr = r * tl.sum(do * vo, axis=1)
    p = tl.zeros((BLOCK_M,), dtype=tl.float32)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    end = tl.minimum(tl.max(own, axis=0) + 1, LK)
    nk = (end + BLOCK_N - 1) // BLOCK_N
    for kb in range(0, nk):
        z, part, cols, cmask = _tile(Kh, KEEP, q, lim, rows, rmask, kb, LK, sk_l, sm_b, sm_h, sm_l, b, h,
                                     offs_n, offs_d, dmask, HAS_MASK, BLOCK_N)
        c = tl.load(C + (bh * LQ + rows) * NC + kb, mask=rmask, other=0.0)
        sp, ls = _softplus_parts(z)
        sp = tl.where(part, sp, 0.0)
        after = tl.cumsum(sp, axis=1, reverse=True) - sp
        a = tl.where(part, tl.exp(ls - after - c[:, None]), 0.0)
        kmask = cmask[:, None] & dmask[None, :]
        k = tl.load(Kh + cols[:, None] * sk_l + offs_d[None, :], mask=kmask, other=0.0)
        vmask = cmask[:, None] & emask[None, :]
        v = tl.load(Vh + cols[:, None] * sv_l + offs_e[None, :], mask=vmask, other=0.0)
        ag = a * tl.dot(do, tl.trans(v), input_precision="ieee")
        prefix = p[:, None] + tl.cumsum(ag, axis=1)
        sig = tl.where(part, tl.exp(ls), 0.0)
        dz = tl.where(part, ag - sig * (prefix + rr[:, None]), 0.0)
        dq += tl.dot(dz, k, input_precision="ieee")
        tl.atomic_add(DKh + cols[:, None] * DH + offs_d[None, :], tl.dot(tl.trans(dz), q, input_precision="ieee"),
                      mask=kmask)
        tl.atomic_add(DVh + cols[:, None] * DV + offs_e[None, :], tl.dot(tl.trans(a), do, input_precision="ieee"),
                      mask=vmask)
        p += tl.sum(ag, axis=1)
    tl.store(DQ + (bh * LQ + rows)[:, None] * DH + offs_d[None, :], dq, mask=rmask[:, None] & dmask[None, :])
    if REMAINDER:  # dv_own += r_i dO_i
        tl.atomic_add(DVh + tl.maximum(own, 0)[:, None] * DV + offs_e[None, :], r[:, None] * do,
                      mask=has[:, None] & emask[None, :])


_JIT = ("_softplus_parts", "_tile", "_sb_fwd_kernel", "_sb_bwd_kernel")
_HELPERS = ("_softplus_parts", "_tile")
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
    return BLOCKS_GPU if q.is_cuda else (16, 16)


class _SBTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, keep, own, attend_current: bool, remainder: bool):
        kern = _compiled()
        B, H, Lq, D = q.shape
        Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
        bm, bn = _blocks(q)
        nc = -(-Lk // bn) + 1
        out = torch.empty(B, H, Lq, Dv, device=q.device, dtype=torch.float32)
        c = torch.zeros(B, H, Lq, nc, device=q.device, dtype=torch.float32)
        ms = keep.stride() if keep is not None else (0, 0, 0, 0)
        grid = (-(-Lq // bm), B * H)
        ta.launch(kern._sb_fwd_kernel, grid)(
            q, k, v, keep if keep is not None else own, own, out, c, H, H // Hkv, Lq, Lk, D, Dv, nc,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), ms[0], ms[1], ms[2],
            ATTEND_CURRENT=int(attend_current), REMAINDER=remainder, HAS_MASK=keep is not None,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=ta._pow2(D), BLOCK_DV=ta._pow2(Dv))
        ctx.save_for_backward(q, k, v, keep, own, c)
        ctx.meta = (attend_current, remainder, (bm, bn))
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, keep, own, c = ctx.saved_tensors
        attend_current, remainder, (bm, bn) = ctx.meta
        kern = _compiled()
        B, H, Lq, D = q.shape
        Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
        dq = torch.empty_like(q)
        dk = torch.zeros(B, Hkv, Lk, D, device=q.device, dtype=torch.float32)
        dv = torch.zeros(B, Hkv, Lk, Dv, device=q.device, dtype=torch.float32)
        ms = keep.stride() if keep is not None else (0, 0, 0, 0)
        grid = (-(-Lq // bm), B * H)
        ta.launch(kern._sb_bwd_kernel, grid)(
            q, k, v, keep if keep is not None else own, own, c, dout.float().contiguous(), dq, dk, dv, H, H // Hkv,
            Hkv, Lq, Lk, D, Dv, c.shape[-1],
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), ms[0], ms[1], ms[2],
            ATTEND_CURRENT=int(attend_current), REMAINDER=remainder, HAS_MASK=keep is not None,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=ta._pow2(D), BLOCK_DV=ta._pow2(Dv))
        return dq, dk, dv, None, None, None, None


def accepts(call: AttnCall) -> str | None:
    """None, or why not (score modifiers and dropout: declared features, none supported): the shared reasons (empty
    inputs, a q/k transform), CPU tensors without the interpreter, fp64, triton missing or imported before
    ``TRITON_INTERPRET`` changed."""
    reason = common_reason(call)
    if reason is not None:
        return reason
    q = call.q
    if not (q.is_cuda or (q.device.type == "cpu" and ta.interpreter_requested())):
        return (f"Triton kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter "
                f"(TRITON_INTERPRET=1, set before triton is imported); got device {q.device}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {q.dtype}: the Triton kernels take float32, float16 and bfloat16"
    if not ta.triton_installed():
        return "triton is not installed (pip install triton)"
    ta._load_triton()
    if not ta.interpreter_consistent():
        return ("TRITON_INTERPRET changed after triton was imported (triton fixes interpreted vs compiled mode at "
                "import); set TRITON_INTERPRET=1 in the environment before anything imports triton")
    return None


def triton_stickbreaking_attention(call: AttnCall) -> tuple[torch.Tensor, None]:
    """out [B, H, Lq, Dv] in the input dtype (computed in fp32); k/v are not repeated for GQA."""
    with torch.cuda.device(call.q.device) if call.q.is_cuda else contextlib.nullcontext():
        # (an offset's extra column pads the head dim to the next power of two in the kernels' blocks)
        q, k = with_offset(call, call.q.float() * call.q_factor(torch.float32), call.k.float())
        q, v = q.contiguous(), call.v.float()
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        B, H, Lq, _ = q.shape
        keep = call.mask.keep
        if keep is not None:
            keep = keep.to(q.device)
            keep = (keep if keep.stride(-1) == 1 else keep.contiguous()).expand(B, H, Lq, k.shape[2])
            keep = keep.view(torch.uint8)  # (a byte per entry either way; Triton loads u8, not i1)
        attend_current, remainder = options(call)
        own = own_index(call).to(torch.int32).contiguous()
        out = _SBTriton.apply(q, k, v, keep, own, attend_current, remainder)
    return out.to(call.q.dtype), None


from ..dispatch import register_path  # noqa: E402  (registration at import, like the normalizers)

register_path("stickbreaking_triton", triton_stickbreaking_attention, takes=takes, accepts=accepts, priority=33,
              auto_exclude=("cpu",),
              traceable=False)  # (the host-side plan and the launches in an autograd.Function)
