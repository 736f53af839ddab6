"""Selective attention (``normalizers/selective.py``) without the n x n matrix: query blocks in order, carrying the
running column sums of the selecting head's relu'd scores.

For the query block [i0, i1): R = the selecting entries of relu(q_h k_h^T) (rows of the block), the penalty
F = carry + exclusive cumsum of R over the block's rows, then carry += column sums of R. The block's output is SDPA
(CPU flash kernel) with the float mask -F (and -inf where masked), every head at once. Only the carries at block
starts ([blocks, B, Lk]) are saved, with q, k, v and the output.

Backward, blocks in reverse order, with the gradient g of the carry leaving the block: recompute the block's weights
P (``[B, H, block, Lk]``: O(block n) memory), dV += P^T dO, dS = P (dO v^T - delta), dQ = dS K, dK += dS^T Q; the
penalty's gradient dF = -sum_heads dS flows to R through the exclusive cumsum (dR_r = sum_{r' > r} dF_r' + g) and to
the entering carry (g += sum_rows dF), and from R to the selecting head's scores where they are positive.

A call after earlier ones (a cached step, a chunked prefill: ``AttnCall.selective_carry`` [B, Lk] set) starts from
that carry instead of zeros; its gradient is the g left after the first block. Declines calls with score modifiers
(soft-cap, bias, sinks) and dropout; those run on the reference path (exact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...masks import MaskInfo
from ...normalizers.base import Normalizer
from ...normalizers.selective import check_carry, document_starts
from ..base import AttnCall, compute_dtype

#: scores per block (B x H x block x Lk); as the chunked path
BLOCK_ELEMENTS = 1 << 22
MIN_BLOCK, MAX_BLOCK = 16, 256
#: tests set this to force a block size (so short sequences span several blocks)
BLOCK_OVERRIDE: int | None = None


def block_size(b: int, h: int, lk: int) -> int:
    if BLOCK_OVERRIDE is not None:
        return BLOCK_OVERRIDE
    return int(min(MAX_BLOCK, max(MIN_BLOCK, BLOCK_ELEMENTS // max(1, b * h * lk))))


class _Plan:
    """The call's visibility, read block by block, and the selection facts of ``selection_parts``."""

    def __init__(self, call: AttnCall) -> None:
        m: MaskInfo = call.mask
        self.mask, self.head = m, call.normalizer.selecting_head(call.settings)
        B, H, self.lq, _ = call.q.shape
        self.lk = call.k.shape[2]
        self.block = block_size(B, H, self.lk)
        dev = call.q.device
        if m.keep is None:
            live_n = min(self.lq, self.lk) if m.causal else self.lk  # upper-left causal: keys >= Lq are unseen
            self.live = (torch.arange(self.lk, device=dev) < live_n)[None]  # [1, Lk]
            self.starts = (torch.arange(self.lk, device=dev) == 0)[None]  # [1, Lk]: key 0 is the only BOS
        else:
            ks = m.keep[:, self.head] if m.keep.shape[1] > 1 else m.keep[:, 0]
            self.live = ks.any(dim=-2)  # [b, Lk]
            self.starts = document_starts(ks)  # [b, Lk]: every document's first key (packing)

    def keys(self, i1: int) -> int:
        return min(self.lk, i1) if self.mask.keep is None and self.mask.causal else self.lk

    def keep(self, i0: int, i1: int, keys: int, device) -> torch.Tensor:
        """bool [b, 1 | H, i1 - i0, keys]."""
        m = self.mask
        if m.keep is None:
            if m.causal:
                i = torch.arange(i0, i1, device=device)[:, None]
                return (torch.arange(keys, device=device)[None, :] <= i)[None, None]
            return torch.ones(1, 1, i1 - i0, keys, dtype=torch.bool, device=device)
        kp = m.keep[:, :, i0:i1] if m.keep.shape[2] > 1 else m.keep
        return kp.expand(kp.shape[0], kp.shape[1], i1 - i0, keys)

    def selects(self, keep: torch.Tensor, i0: int, i1: int, keys: int) -> torch.Tensor:
        """bool [b, i1 - i0, keys]: where the selecting head's relu'd score enters R (normalizers/selective.py)."""
        ks = keep[:, self.head] if keep.shape[1] > 1 else keep[:, 0]
        dev = keep.device
        j = torch.arange(keys, device=dev)
        own = torch.arange(i0, i1, device=dev) + (self.lk - self.lq)
        live = self.live
        own_live = torch.where((own >= 0) & (own < self.lk), live[:, own.clamp(0, self.lk - 1)], True)
        return (ks & ~self.starts[:, None, :keys] & (j[None, :] != own[:, None])[None]
                & own_live[..., None])


def _penalty(plan: _Plan, qh: torch.Tensor, kh: torch.Tensor, sel: torch.Tensor, carry: torch.Tensor):
    """(s0 [B, c, keys], F [B, c, keys], column sums of R [B, keys]) of one block; carry [B, keys]."""
    s0 = qh @ kh.transpose(-1, -2)
    r = torch.where(sel, F.relu(s0), torch.zeros((), dtype=s0.dtype, device=s0.device))
    cs = torch.cumsum(r, dim=1)
    pen = carry[:, None, :] + (cs - r)
    return s0, pen, cs[:, -1]


def _forward(plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, carry: torch.Tensor):
    """(out [B, H, Lq, Dv], the carries at block starts): the blocked forward, traceable (no host sync); carry
    [B, Lk]: the initial one (the earlier calls' column sums, ``AttnCall.selective_carry``, or zeros)."""
    B, H, lq, _ = q.shape
    h, c = plan.head, plan.block
    carries, outs = [], []
    neg = torch.full((), float("-inf"), dtype=q.dtype, device=q.device)
    for i0 in range(0, lq, c):
        i1 = min(i0 + c, lq)
        keys = plan.keys(i1)
        keep = plan.keep(i0, i1, keys, q.device)
        sel = plan.selects(keep, i0, i1, keys)
        qb, kb, vb = q[:, :, i0:i1], k[:, :, :keys], v[:, :, :keys]
        carries.append(carry[:, :keys].clone())
        _, pen, rsum = _penalty(plan, qb[:, h], kb[:, h], sel, carry[:, :keys])
        carry = torch.cat([carry[:, :keys] + rsum, carry[:, keys:]], dim=1)
        mask = torch.where(keep, -pen[:, None], neg)
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=1.0)
        has = keep.any(dim=-1, keepdim=True)  # rows with no visible key give 0
        outs.append(torch.where(has, out, torch.zeros((), dtype=out.dtype, device=out.device)))
    out = torch.cat(outs, dim=2) if outs else q.new_zeros(B, H, lq, v.shape[-1])
    return out, carries


class _SelectiveFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, q, k, v, carry):
        out, carries = _forward(plan, q, k, v, carry)
        ctx.plan, ctx.carries = plan, carries
        ctx.save_for_backward(q, k, v, out)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        plan: _Plan = ctx.plan
        q, k, v, out = ctx.saved_tensors
        B, H, lq, _ = q.shape
        h, c = plan.head, plan.block
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        g = q.new_zeros(B, plan.lk)  # gradient of the carry after the current block
        zero = torch.zeros((), dtype=q.dtype, device=q.device)
        starts = list(range(0, lq, c))
        for bi in reversed(range(len(starts))):
            i0 = starts[bi]
            i1 = min(i0 + c, lq)
            keys = plan.keys(i1)
            keep = plan.keep(i0, i1, keys, q.device)
            sel = plan.selects(keep, i0, i1, keys)
            qb, kb, vb, dob = q[:, :, i0:i1], k[:, :, :keys], v[:, :, :keys], dout[:, :, i0:i1]
            s0, pen, _ = _penalty(plan, qb[:, h], kb[:, h], sel, ctx.carries[bi])
            # head by head: each head's [B, block, keys] temporaries stay cache-resident (measured faster than all
            # heads at once), and baddbmm folds the penalty and delta into the matmuls
            has = keep.any(dim=-1) if plan.mask.keep is not None else None
            delta = (dob * out[:, :, i0:i1]).sum(dim=-1)  # [B, H, c]
            dqb = torch.empty_like(qb)
            df = torch.zeros_like(pen)
            neg_pen = -pen
            for hh in range(H):
                qh, kh, vh, doh = qb[:, hh], kb[:, hh], vb[:, hh], dob[:, hh]
                kp = keep[:, hh] if keep.shape[1] > 1 else keep[:, 0]
                s = torch.baddbmm(neg_pen, qh, kh.transpose(1, 2)).masked_fill_(~kp, float("-inf"))
                # torch.softmax, not exp: its kernel stays fast where exp underflows (a large penalty), which a
                # plain exp does not (measured 15x slower on such rows)
                p = torch.softmax(s, dim=-1)
                if has is not None:  # rows with no visible key: softmax gives NaN, the output is 0
                    hk = has[:, hh] if has.shape[1] > 1 else has[:, 0]
                    p = torch.where(hk[..., None], p, zero)
                dv[:, hh, :keys] += p.transpose(1, 2) @ doh
                ds = torch.baddbmm(-delta[:, hh, :, None], doh, vh.transpose(1, 2)).mul_(p)
                dqb[:, hh] = ds @ kh
                dk[:, hh, :keys] += ds.transpose(1, 2) @ qh
                df.sub_(ds)  # the penalty enters every head's scores with sign -1
            gk = g[:, :keys]
            rev = torch.flip(torch.cumsum(torch.flip(df, [1]), dim=1), [1]) - df  # sum over later rows of the block
            dr = rev + gk[:, None, :]
            g[:, :keys] = gk + df.sum(dim=1)
            ds0 = torch.where(sel & (s0 > 0), dr, zero)
            dqb[:, h] += ds0 @ kb[:, h]
            dk[:, h, :keys] += ds0.transpose(-1, -2) @ qb[:, h]
            dq[:, :, i0:i1] = dqb
        # g is now the gradient of the carry entering the first block: the initial carry's
        return None, dq, dk, dv, (g if ctx.needs_input_grad[4] else None)


def takes(norm: Normalizer) -> str | None:
    if not norm.query_coupled or not callable(getattr(norm, "selecting_head", None)):
        return f"normalizer {norm.name!r} declares no selecting head (selective attention's penalty)"
    return None


def accepts(call: AttnCall) -> str | None:
    if call.q.numel() == 0 or call.k.shape[2] == 0:
        return "empty inputs"
    return None


def selective_attention(call: AttnCall) -> tuple[torch.Tensor, None]:
    """out [B, H, Lq, Dv] in the input dtype (fp16/bf16 computed in fp32)."""
    q, k, v = call.features(compute_dtype(call.q.dtype))
    B, lk = q.shape[0], k.shape[2]
    carry = call.selective_carry
    carry = q.new_zeros(B, lk) if carry is None else check_carry(carry, B, lk).to(q.dtype).expand(B, lk)
    if torch.compiler.is_compiling():  # forward only (compiled_backward=False): the blocked loop traces
        out, _ = _forward(_Plan(call), q, k, v, carry)
    else:
        out = _SelectiveFn.apply(_Plan(call), q, k, v, carry)
    return out.to(call.q.dtype), None


from ..dispatch import register_path  # noqa: E402  (registration at import, like the normalizers)

# the blocked backward is not traced (the reference's is): compiled training runs the reference
register_path("selective", selective_attention, takes=takes, accepts=accepts, priority=85,
              supports=("selective_carry",), compiled_backward=False, plan_stable=True)
