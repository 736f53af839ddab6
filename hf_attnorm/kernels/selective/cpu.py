"""Fused CPU selective attention (path ``selective_cpu``): the C++ kernel of ``selective_cpu.cpp``, compiled as this
family's own extension (``NATIVE``, kernels/native.py), forward and backward. The math is that of
``normalizers/selective.py`` (Leviathan et al., arXiv 2410.02703): every head's softmax of s - F,
F_ij = sum_{k < i} relu(S_kj) over the selecting entries of one head's scores S.

Unlike the blocked ``selective`` path, the query blocks run in parallel: a first pass forms each block's column sums
of relu(S) (one head's Q K^T) and a prefix over the blocks gives the carry entering each block; then per (batch,
query block), key tile by key tile, the penalty tile F = carry + the exclusive cumsum of the block's rows comes from
the selecting head's scores (formed once, reused as that head's own scores) and every head runs a flash-style online
softmax of s - F. The backward mirrors it (selective_cpu.cpp explains the two passes). Memory: q, k, v, out, the row
logsumexp [B, H, Lq] and each query block's column sums [B, Lq / block_q, Lk]; no [Lq, Lk] tensor.

Which entries select (BOS, the query's own key, padding) is decided here exactly as ``selection_parts`` does, and
passed to the kernel as the BOS keys per batch row (every document's first key: ``document_starts``) and whether each
query may select.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...normalizers.selective import document_starts
from ..base import AttnCall, compute_dtype, dense_keep, last_dim_contiguous, unfused_call_reason
from ..native import OPS, cpu_call_reason, extension
from .blocked import takes

#: (block_q, block_k): queries per parallel work item, keys per tile (the BLAS inner size)
BLOCKS = (128, 256)
#: tests set this to small blocks so that odd lengths cross block edges
BLOCK_OVERRIDE: tuple[int, int] | None = None
#: this family's extension; its C++ ops live in the namespace ``hf_attnorm_native_selective``
NATIVE = extension("selective", [Path(__file__).with_name("selective_cpu.cpp")], "hf_attnorm_native_selective",
                   "selective")


class _SelFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, carry0, keep, causal: bool, head: int, scale: float, starts, selrow,
                blocks: tuple[int, int]):
        out, lse, colsums = OPS.sel_forward(q, k, v, keep, causal, head, scale, starts, selrow,
                                                               carry0, *blocks)
        ctx.save_for_backward(q, k, v, keep, starts, selrow, carry0, colsums, out, lse)
        ctx.meta = (causal, head, scale, blocks)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, keep, starts, selrow, carry0, colsums, out, lse = ctx.saved_tensors
        causal, head, scale, blocks = ctx.meta
        dq, dk, dv, dcarry = OPS.sel_backward(q, k, v, keep, causal, head, scale, starts, selrow,
                                                                 carry0, colsums, out, lse, dout.contiguous(),
                                                                 *blocks)
        return dq, dk, dv, (dcarry if ctx.needs_input_grad[3] else None), None, None, None, None, None, None, None


def _define_ops() -> None:
    """The two ops (``NATIVE.define_op``) with their shape-only implementations, at import."""

    def forward_fake(q, k, v, keep, causal, head, scale, starts, selrow, carry0, block_q, block_k):
        B, H, Lq = q.shape[:3]
        return [q.new_empty((B, H, Lq, v.shape[-1])), q.new_empty((B, H, Lq)),
                q.new_empty((B, -(-Lq // block_q), k.shape[2]))]

    def backward_fake(q, k, v, keep, causal, head, scale, starts, selrow, carry0, colsums, out, lse, dout, block_q,
                      block_k):
        return [*(x.new_empty(x.shape) for x in (q, k, v)), q.new_empty((q.shape[0], k.shape[2]))]

    NATIVE.define_op("sel_forward(Tensor q, Tensor k, Tensor v, Tensor? keep, bool causal, int head, float scale, "
                        "Tensor starts, Tensor selrow, Tensor? carry0, int block_q, int block_k) -> Tensor[]",
                        forward_fake)
    NATIVE.define_op("sel_backward(Tensor q, Tensor k, Tensor v, Tensor? keep, bool causal, int head, "
                        "float scale, Tensor starts, Tensor selrow, Tensor? carry0, Tensor colsums, Tensor out, "
                        "Tensor lse, Tensor dout, int block_q, int block_k) -> Tensor[]", backward_fake)


_define_ops()


def carry_reason(call: AttnCall) -> str | None:
    """Why the call's carried-in column sums (``selective_carry``, cached decoding) cannot be used, or None."""
    carry = getattr(call, "selective_carry", None)
    if carry is None:
        return None
    B, Lk = call.q.shape[0], call.k.shape[2]
    if not isinstance(carry, torch.Tensor) or carry.dim() != 2 or carry.shape[1] != Lk or carry.shape[0] not in (1, B):
        shape = tuple(carry.shape) if isinstance(carry, torch.Tensor) else type(carry).__name__
        return f"selective_carry of shape {shape} (this path takes column sums [B, Lk] = [{B}, {Lk}])"
    if carry.device != call.q.device:
        return f"selective_carry on {carry.device}, q on {call.q.device}"
    return None


def accepts(call: AttnCall) -> str | None:
    reason = unfused_call_reason(call)
    if reason is not None:
        return reason
    reason = cpu_call_reason(call)
    if reason is not None:
        return reason
    reason = carry_reason(call)
    if reason is not None:
        return reason
    return NATIVE.reason()


def selection_facts(call: AttnCall, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts bool [B, Lk]: the BOS keys, selrow bool [B, Lq]: the query's own key i + Lk - Lq is live or outside
    the keys), as ``normalizers.selective.selection_parts`` decides them: a key is live when the selecting head's
    visibility lets some query see it."""
    m = call.mask
    B, _, Lq = call.q.shape[:3]
    Lk = call.k.shape[2]
    dev = call.q.device
    if m.keep is None:
        live_n = min(Lq, Lk) if m.causal else Lk  # upper-left causal: keys >= Lq are unseen
        live = (torch.arange(Lk, device=dev) < live_n)[None]  # [1, Lk]
        starts = (torch.arange(Lk, device=dev) == 0)[None]  # [1, Lk]: key 0 is the only BOS
    else:
        keep = m.keep.to(dev)
        ks = keep[:, head] if keep.shape[1] > 1 else keep[:, 0]
        live = ks.any(dim=-2)  # [b, Lk]
        starts = document_starts(ks)  # [b, Lk]: every document's first key (packing)
    own = torch.arange(Lq, device=dev) + (Lk - Lq)
    inside = (own >= 0) & (own < Lk)
    selrow = torch.where(inside, live[:, own.clamp(0, Lk - 1)], True)  # [b, Lq]
    return starts.expand(B, Lk).contiguous(), selrow.expand(B, Lq).contiguous()


def selective_cpu_attention(call: AttnCall) -> tuple[torch.Tensor, None]:
    """out [B, H, Lq, Dv] in the input dtype (fp16/bf16 computed in fp32); k/v are not repeated for GQA."""
    norm = call.normalizer
    head = norm.selecting_head(call.settings)
    dt = compute_dtype(call.q.dtype)
    # a plain float scale goes to the kernel (a factor on its matmuls: no scaled copy of q, no extra pass)
    factor = call.q_factor(dt)
    scale = float(factor) if isinstance(factor, float) else 1.0
    q = (call.q.to(dt) if isinstance(factor, float) else call.q.to(dt) * factor).contiguous()
    k, v = last_dim_contiguous(call.k.to(dt)), last_dim_contiguous(call.v.to(dt))
    B, H, Lq, _ = q.shape
    keep = dense_keep(call, B, H, Lq, k.shape[2])
    causal = keep is None and call.mask.causal
    starts, selrow = selection_facts(call, head)
    carry = getattr(call, "selective_carry", None)
    if carry is not None:
        carry = carry.to(dt).expand(B, k.shape[2]).contiguous()
    out = _SelFn.apply(q, k, v, carry, keep, causal, head, scale, starts, selrow, BLOCK_OVERRIDE or BLOCKS)
    return out.to(call.q.dtype), None


from ..dispatch import register_path  # noqa: E402  (registration at import, like the normalizers)

register_path("selective_cpu", selective_cpu_attention, takes=takes, accepts=accepts, priority=44,
              supports=("selective_carry",), auto_exclude=("cuda",), prepare=NATIVE.build)
