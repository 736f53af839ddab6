"""Fused CPU stick-breaking attention (path ``stickbreaking_cpu``): the C++ kernel of ``stickbreaking_cpu.cpp``,
compiled as this family's own extension (``NATIVE``, kernels/native.py), forward and backward. The math and the
scan order are those of ``stickbreaking.py``; OpenMP (torch's threads) over (batch x head, query blocks) in the
forward and over kv heads split into parts with private dK/dV buffers in the backward (deterministic). Memory: q,
k, v, out and the stick left at each key block's edge, e [B, H, Lq, Lk / block_k + 1] (the C++ scan runs in
product form, e = exp(-c), one exp per score; the others in log space)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..base import AttnCall, compute_dtype, dense_keep, last_dim_contiguous
from ..native import OPS, cpu_call_reason, extension
from .scan import common_reason, options, own_index, takes, with_offset

#: (block_q, block_k): the query block is the vector width of the scan, the key block the BLAS inner size
BLOCKS = (128, 256)
#: tests set this to small blocks so that odd lengths cross block edges
BLOCK_OVERRIDE: tuple[int, int] | None = None
#: this family's extension; its C++ ops live in the namespace ``hf_attnorm_native_stickbreaking``
NATIVE = extension("stick-breaking", [Path(__file__).with_name("stickbreaking_cpu.cpp")],
                   "hf_attnorm_native_stickbreaking", "stickbreaking_scan")


class _SBFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, keep, own, attend_current: bool, remainder: bool, blocks: tuple[int, int]):
        out, c = OPS.sb_forward(q, k, v, keep, own, attend_current, remainder, *blocks)
        ctx.save_for_backward(q, k, v, keep, own, c)
        ctx.meta = (attend_current, remainder, blocks)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, keep, own, c = ctx.saved_tensors
        attend_current, remainder, blocks = ctx.meta
        dq, dk, dv = OPS.sb_backward(q, k, v, keep, own, attend_current, remainder, c,
                                                       dout.contiguous(), *blocks)
        return dq, dk, dv, None, None, None, None, None


def _define_ops() -> None:
    """The two ops (``NATIVE.define_op``) with their shape-only implementations, at import."""

    def forward_fake(q, k, v, keep, own, attend_current, remainder, block_q, block_k):
        B, H, Lq = q.shape[:3]
        return [q.new_empty((B, H, Lq, v.shape[-1])), q.new_empty((B, H, Lq, -(-k.shape[2] // block_k) + 1))]

    def backward_fake(q, k, v, keep, own, attend_current, remainder, c, dout, block_q, block_k):
        return [x.new_empty(x.shape) for x in (q, k, v)]

    NATIVE.define_op("sb_forward(Tensor q, Tensor k, Tensor v, Tensor? keep, Tensor own, bool attend_current, "
                        "bool remainder, int block_q, int block_k) -> Tensor[]", forward_fake)
    NATIVE.define_op("sb_backward(Tensor q, Tensor k, Tensor v, Tensor? keep, Tensor own, bool attend_current, "
                        "bool remainder, Tensor c, Tensor dout, int block_q, int block_k) -> Tensor[]", backward_fake)


_define_ops()


def accepts(call: AttnCall) -> str | None:
    reason = common_reason(call)
    if reason is not None:
        return reason
    reason = cpu_call_reason(call)
    if reason is not None:
        return reason
    return NATIVE.reason()


def stickbreaking_cpu_attention(call: AttnCall) -> tuple[torch.Tensor, None]:
    """out [B, H, Lq, Dv] in the input dtype (fp16/bf16 computed in fp32); k/v are not repeated for GQA."""
    dt = compute_dtype(call.q.dtype)
    q, k = with_offset(call, call.q.to(dt) * call.q_factor(dt), call.k.to(dt))
    q = q.contiguous()
    k, v = last_dim_contiguous(k), last_dim_contiguous(call.v.to(dt))
    B, H, Lq, _ = q.shape
    keep = dense_keep(call, B, H, Lq, k.shape[2])
    attend_current, remainder = options(call)
    own = own_index(call).contiguous()
    out = _SBFn.apply(q, k, v, keep, own, attend_current, remainder, BLOCK_OVERRIDE or BLOCKS)
    return out.to(call.q.dtype), None


from ..dispatch import register_path  # noqa: E402  (registration at import, like the normalizers)

register_path("stickbreaking_cpu", stickbreaking_cpu_attention, takes=takes, accepts=accepts, priority=43,
              auto_exclude=("cuda",), prepare=NATIVE.build)
