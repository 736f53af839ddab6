"""Stick-breaking attention (``normalizers/stickbreaking.py``) without the [Lq, Lk] tensor: the block scan, in plain
PyTorch (path ``stickbreaking_scan``), and what the fused C++ and Triton paths share with it.

The scan. For a block of queries the key blocks are visited from the query's own key backwards, carrying per row
c_i = sum of softplus(z_ik) over the keys already visited (those after the current block), so that inside a block
log A_ij = logsigmoid(z_ij) - c_i - sum_{k > j in the block} softplus(z_ik), O += A V, c_i += the block's sum. At the
end the stick's remainder is r_i = exp(-c_i), added to the own key's value when ``stickbreaking_remainder`` is on.

Backward: with g_ij = dO_i . v_j and R_i = r_i (dO_i . v_own(i)), z_ij enters A_ij through logsigmoid and every
A_ik (k < j) through -softplus, so

    dz_ij = A_ij g_ij - sigmoid(z_ij) (P_ij + R_i),   P_ij = sum_{k <= j} A_ik g_ik;

dV += A^T dO (+ r_i dO_i on the own key), dK += dz^T Q, dQ += dz K. P is a prefix sum: the key blocks are visited
left to right, each recomputed from the c the forward saved at its edge ([B, H, Lq, Lk / block_k + 1] floats: n^2 / 256
per head, below the n d of q for n < 256 d). Computing P as the row total minus a suffix sum would lose it far from
the query, where it is tiny but multiplied by sigmoid(z) ~ 1/2 (measured: 70x the reference's dq error at n = 513).
Masked keys have A = 0 and break nothing (softplus left out); a row's own key is its last visible key
(``own_index``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...normalizers.base import Normalizer
from ...normalizers.stickbreaking import uses_offset
from ..base import AttnCall, compute_dtype, unfused_call_reason

#: (query block, key block) of the PyTorch scan
BLOCKS = (128, 256)
#: tests set this to small blocks so that odd lengths cross block edges
BLOCK_OVERRIDE: tuple[int, int] | None = None


def takes(norm: Normalizer) -> str | None:
    """The normalizers declaring ``kernel_family = "stickbreaking"``."""
    if norm.kernel_family != "stickbreaking":
        return f"normalizer {norm.name!r} is not stick-breaking (kernel_family {norm.kernel_family!r})"
    return None


def common_reason(call: AttnCall) -> str | None:
    """Why none of the stick-breaking kernels can run ``call`` (shared by the three paths), or None."""
    return unfused_call_reason(call)


def options(call: AttnCall) -> tuple[bool, bool]:
    """(attend_current, remainder) of the call's settings."""
    s = call.settings
    return bool(s.stickbreaking_attend_current), bool(s.stickbreaking_remainder)


def with_offset(call: AttnCall, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-head offset c_h (``stickbreaking_offset``) folded into q and k, so that every kernel's q . k is
    z - c_h: q [B, H, Lq, D] (scaled) gets a last column -c_h, k [B, H or Hkv, Lk, D] a last column of ones (one for
    every query head of a GQA group). Autograd carries c_h's gradient through q's column. Unchanged (no extra
    column) when the offset cannot change the weights: a constant 0, the paper's."""
    if not uses_offset(call.settings):
        return q, k
    c = call.heads["stickbreaking_offset"].to(device=q.device, dtype=q.dtype).view(1, -1, 1, 1)
    q = torch.cat([q, (-c).expand(*q.shape[:-1], 1)], dim=-1)
    k = torch.cat([k, k.new_ones(*k.shape[:-1], 1)], dim=-1)
    return q, k


def own_index(call: AttnCall) -> torch.Tensor:
    """int64 [B, H, Lq]: each query's own key, i.e. the last key it sees (-1 when it sees none): min(i, Lk - 1) for
    the causal pattern (upper-left, as ``MaskInfo``), Lk - 1 without a mask (a decode step), else the mask's last
    True."""
    B, H, Lq = call.q.shape[:3]
    Lk = call.k.shape[2]
    m, dev = call.mask, call.q.device
    if m.keep is None:
        if m.causal:
            own = torch.arange(Lq, device=dev).clamp_max(Lk - 1)
        else:
            own = torch.full((Lq,), Lk - 1, device=dev)
        return own.expand(B, H, Lq)
    keep = m.keep.to(dev)
    idx = torch.arange(Lk, device=dev)
    return torch.where(keep, idx, -1).amax(dim=-1).expand(B, H, Lq)


def _tile(q, k, keep, causal, own, attend_current, i0, i1, j0, j1):
    """Scores z [B, H, i1-i0, j1-j0] and the keys that break the stick there (bool, broadcastable)."""
    z = q[:, :, i0:i1] @ k[:, :, j0:j1].transpose(-1, -2)
    j = torch.arange(j0, j1, device=q.device)
    # without a mask every batch row and head has the same own keys (an expanded [Lq]): a [bq, bk] pattern, not
    # [B, H, bq, bk] (the boolean ops cost as much as the float ones)
    o = (own[:1, :1] if keep is None else own)[:, :, i0:i1, None]
    if keep is not None:
        part = keep[:, :, i0:i1, j0:j1]
    else:
        part = j <= o  # causal: j <= min(i, Lk - 1); no mask: every key (own = Lk - 1)
    if not attend_current:
        part = part & (j != o)
    return z, part


#: weights below e^LOG_TINY are set to 0: exp would otherwise leave subnormal numbers (far keys' weights run down
#: to e^-87 in fp32), which made every later elementwise op and matmul on them ~50x slower on x86 (measured: the
#: whole path 60x SDPA at n = 4096); they are far below any output's resolution
LOG_TINY = -60.0


def _weights(part: torch.Tensor, log_a: torch.Tensor) -> torch.Tensor:
    """A = exp(log A) on the stick-breaking keys, 0 elsewhere and below e^LOG_TINY."""
    return torch.where(part & (log_a > LOG_TINY), torch.exp(log_a.clamp_min(LOG_TINY)), 0.0)


def _suffix(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inclusive suffix sum over the last dim, the exclusive one) without subtracting (no cancellation)."""
    incl = x.flip(-1).cumsum(-1).flip(-1)
    return incl, torch.cat([incl[..., 1:], torch.zeros_like(incl[..., :1])], dim=-1)


def _key_end(own: torch.Tensor, i0: int, i1: int, keep: torch.Tensor | None, lk: int) -> int:
    """Keys past the block's largest own key are never visible (no mask: known without reading a tensor)."""
    return lk if keep is not None else min(lk, int(own[0, 0, i1 - 1]) + 1)


def scan_forward(q, k, v, keep, causal, own, attend_current, remainder, blocks):
    """q: [B, H, Lq, D] (scaled), k/v: [B, H, Lk, D/Dv], keep: bool [B|1, H|1, Lq, Lk] or None, own: [B, H, Lq].
    Returns (out [B, H, Lq, Dv], c [B, H, Lq, nkb + 1]): c[..., b] the softplus sum over the stick-breaking keys
    of the key blocks after block b (what the backward needs to recompute block b exactly), c[..., -1] the row's
    total (its remainder is exp(-total))."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    bq, bk = blocks
    nkb = -(-Lk // bk)
    out = q.new_zeros(B, H, Lq, v.shape[-1])
    c_all = q.new_zeros(B, H, Lq, nkb + 1)
    for i0 in range(0, Lq, bq):
        i1 = min(i0 + bq, Lq)
        c = q.new_zeros(B, H, i1 - i0)
        acc = out[:, :, i0:i1]
        end = _key_end(own, i0, i1, keep, Lk)
        for j0 in reversed(range(0, end, bk)):
            j1 = min(j0 + bk, end)
            c_all[:, :, i0:i1, j0 // bk] = c
            z, part = _tile(q, k, keep, causal, own, attend_current, i0, i1, j0, j1)
            z = torch.where(part, z, 0.0)
            sp = torch.where(part, F.softplus(z), 0.0)
            incl, after = _suffix(sp)
            a = _weights(part, F.logsigmoid(z) - after - c[..., None])
            acc += a @ v[:, :, j0:j1]
            c = c + incl[..., 0]
        c_all[:, :, i0:i1, -1] = c
    if remainder:
        out = out + _remainder(c_all[..., -1], own)[..., None] * _gather_own(v, own)
    return out, c_all


def _remainder(c: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """r_i = exp(-c_i) on rows with a key, 0 on the others."""
    return torch.where(own >= 0, torch.exp(-c), 0.0)


def _gather_own(v: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """v[b, h, own[b, h, i]] as [B, H, Lq, Dv] (rows without a key read key 0; their r is 0)."""
    idx = own.clamp_min(0)[..., None].expand(*own.shape, v.shape[-1])
    return torch.gather(v, 2, idx)


def scan_backward(q, k, v, keep, causal, own, attend_current, remainder, blocks, c_all, dout):
    """Gradients (dq, dk, dv) of ``scan_forward``: key blocks left to right, the prefix P_ij = sum_{k <= j} A_ik g_ik
    accumulated from the far keys (whose terms are tiny) to the near ones, so it keeps its relative precision far
    from the query (G_i minus a suffix sum would not: sigmoid(z) multiplies P, not A); block b's A is recomputed
    from the saved c[..., b]."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    bq, bk = blocks
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    r = _remainder(c_all[..., -1], own) if remainder else torch.zeros_like(c_all[..., -1])
    rr = r * (dout * _gather_own(v, own)).sum(-1) if remainder else r  # R_i = r_i dO_i . v_own
    for i0 in range(0, Lq, bq):
        i1 = min(i0 + bq, Lq)
        p = q.new_zeros(B, H, i1 - i0)
        do = dout[:, :, i0:i1]
        end = _key_end(own, i0, i1, keep, Lk)
        for j0 in range(0, end, bk):
            j1 = min(j0 + bk, end)
            z, part = _tile(q, k, keep, causal, own, attend_current, i0, i1, j0, j1)
            z = torch.where(part, z, 0.0)
            sp = torch.where(part, F.softplus(z), 0.0)
            _, after = _suffix(sp)
            a = _weights(part, F.logsigmoid(z) - after - c_all[:, :, i0:i1, j0 // bk, None])
            ag = a * (do @ v[:, :, j0:j1].transpose(-1, -2))
            prefix = p[..., None] + ag.cumsum(-1)  # P_ij
            sig = torch.where(part & (z > LOG_TINY), torch.sigmoid(z), 0.0)
            dz = torch.where(part, ag - sig * (prefix + rr[:, :, i0:i1, None]), 0.0)
            dq[:, :, i0:i1] += dz @ k[:, :, j0:j1]
            dk[:, :, j0:j1] += dz.transpose(-1, -2) @ q[:, :, i0:i1]
            dv[:, :, j0:j1] += a.transpose(-1, -2) @ do
            p = prefix[..., -1]
    if remainder:
        idx = own.clamp_min(0)[..., None].expand(*own.shape, v.shape[-1])
        dv.scatter_add_(2, idx, r[..., None] * dout)
    return dq, dk, dv


class _ScanFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, keep, causal, own, attend_current, remainder, blocks):
        out, c = scan_forward(q, k, v, keep, causal, own, attend_current, remainder, blocks)
        ctx.save_for_backward(q, k, v, keep, own, c)
        ctx.meta = (causal, attend_current, remainder, blocks)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, keep, own, c = ctx.saved_tensors
        causal, attend_current, remainder, blocks = ctx.meta
        dq, dk, dv = scan_backward(q, k, v, keep, causal, own, attend_current, remainder, blocks, c, dout.contiguous())
        return dq, dk, dv, None, None, None, None, None, None


def scan_accepts(call: AttnCall) -> str | None:
    reason = common_reason(call)
    if reason is not None:
        return reason
    if torch.compiler.is_compiling():
        return "torch.compile (the scan's Python loop over blocks; the chunked path traces)"
    return None


def scan_attention(call: AttnCall) -> tuple[torch.Tensor, None]:
    """out [B, H, Lq, Dv] in the input dtype (fp16/bf16 computed in fp32)."""
    q, k, v = call.features(compute_dtype(call.q.dtype))
    q, k = with_offset(call, q, k)
    keep = call.mask.keep
    if keep is not None:
        keep = keep.to(q.device)
    attend_current, remainder = options(call)
    own = own_index(call)
    out = _ScanFn.apply(q, k, v, keep, call.mask.causal, own, attend_current, remainder,
                        BLOCK_OVERRIDE or BLOCKS)
    return out.to(call.q.dtype), None


from ..dispatch import register_path  # noqa: E402  (registration at import, like the normalizers)

register_path("stickbreaking_scan", scan_attention, takes=takes, accepts=scan_accepts, priority=87)
