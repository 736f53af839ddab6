"""Query-chunked attention in plain PyTorch for every normalizer: the pure-PyTorch fallback.

The queries are cut into chunks; each chunk's scores [B, H, chunk, Lk] go through the normalizer's own
``reference`` (so any registered normalizer works, unchanged) and are multiplied by v, then freed. A custom
autograd Function saves only the inputs and recomputes each chunk in the backward pass (like activation
checkpointing), so peak memory is O(B H chunk Lk + n d) instead of O(B H Lq Lk). Exact: the same operations as
the reference, row by row. Dropout is supported: the RNG state is recorded in the forward pass and replayed.

The chunk holds about ``CHUNK_ELEMENTS`` scores and at most Lk / ``CHUNK_FRACTION`` queries (between ``MIN_CHUNK``
and ``MAX_CHUNK``); with a causal call and no mask a chunk only scores the keys it can see.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..normalizers.base import Ctx, Normalizer
from ..torch_compat import is_exporting
from .base import AttnCall, compute_dtype, forget_bias, modify_scores, normalize

#: scores per chunk (B x H x chunk x Lk); 2^22 fp32 scores are 16 MB per temporary
CHUNK_ELEMENTS = 1 << 22
#: and at most Lk / CHUNK_FRACTION queries: a normalizer's reference holds several chunk-sized temporaries (the
#: sort-based entmax about a dozen), so this keeps the peak a small fraction of the materialised path's
CHUNK_FRACTION = 32
MIN_CHUNK, MAX_CHUNK = 32, 512
#: tests set this to force a chunk size (so short sequences span several chunks)
CHUNK_OVERRIDE: int | None = None


def chunk_size(b: int, h: int, lk: int) -> int:
    if CHUNK_OVERRIDE is not None:
        return CHUNK_OVERRIDE
    by_budget = CHUNK_ELEMENTS // max(1, b * h * lk)
    return int(min(MAX_CHUNK, max(MIN_CHUNK, min(by_budget, lk // CHUNK_FRACTION))))


class _Plan:
    """What a chunk needs besides the tensors: the normalizer, the mask, n, the dropout."""

    def __init__(self, call: AttnCall, head_names: list[str]) -> None:
        self.norm = call.normalizer
        self.settings = call.settings
        self.module_info = call.module_info
        self.mask = call.mask
        self.head_names = head_names
        self.dropout = call.dropout
        self.head_dim = call.q.shape[-1]
        self.softcap = call.softcap
        self.chunk = chunk_size(call.q.shape[0], call.q.shape[1], call.k.shape[2])
        self.lq = call.q.shape[2]

    def chunk_out(self, qc, k, v, heads: list[torch.Tensor], i0: int, i1: int, bias: torch.Tensor | None = None,
                  sinks: torch.Tensor | None = None, forget: torch.Tensor | None = None) -> torch.Tensor:
        """Output rows [i0, i1) from the query rows qc = q[:, :, i0:i1]: [B, H, i1 - i0, Dv]. bias: the call's
        score bias (broadcastable to [B, H, Lq, Lk]) without the forget gate; sinks: [H] or None; forget: the
        cumulative log forget gates [B, H, Lk] (``AttnCall.forget``), whose bias is formed for this chunk only."""
        m = self.mask
        keys = m.lk
        if m.keep is None:
            if m.causal:
                keys = min(m.lk, i1)  # query i sees keys j <= i: later keys are never visible in this chunk
                i = torch.arange(i0, i1, device=qc.device)[:, None]
                keep = (torch.arange(keys, device=qc.device)[None, :] <= i)[None, None]
            else:
                keep = torch.ones(1, 1, 1, keys, dtype=torch.bool, device=qc.device)
        else:
            keep = m.keep[:, :, i0:i1] if m.keep.shape[2] > 1 else m.keep
        n = m.n[..., i0:i1] if m.n.shape[-1] > 1 else m.n
        ctx = Ctx(self.settings, dict(zip(self.head_names, heads)), self.head_dim, n, self.module_info)
        scores = qc @ k[:, :, :keys].transpose(-1, -2)
        if bias is not None:
            bias = bias[:, :, i0:i1] if bias.shape[2] > 1 else bias
            bias = bias[..., :keys] if bias.shape[3] > 1 else bias
        if forget is not None:
            decay = forget_bias(forget, self.lq, slice(i0, i1), keys).to(scores.dtype)
            bias = decay if bias is None else bias + decay
        scores = modify_scores(scores, self.softcap, bias)
        w = normalize(self.norm, scores, keep.to(scores.device), ctx, sinks)
        if self.dropout > 0:
            w = F.dropout(w, p=self.dropout, training=True)
        return w @ v[:, :, :keys]


class _ChunkedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, q, k, v, bias, sinks, forget, *heads):
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, bias, sinks, forget, *heads)
        ctx.rng = _rng_state(q.device) if plan.dropout > 0 else None
        lq = q.shape[2]
        return torch.cat([plan.chunk_out(q[:, :, i0:i0 + plan.chunk], k, v, list(heads), i0, min(i0 + plan.chunk, lq),
                                         bias, sinks, forget)
                          for i0 in range(0, lq, plan.chunk)], dim=2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        plan: _Plan = ctx.plan
        q, k, v, bias, sinks, forget, *heads = ctx.saved_tensors
        # inputs in the order [q, k, v, *heads, bias, sinks, forget]; None tensors never need a gradient
        need = (*ctx.needs_input_grad[1:4], *ctx.needs_input_grad[7:], *ctx.needs_input_grad[4:7])
        nh = len(heads)
        dq = torch.zeros_like(q) if need[0] else None
        dk = torch.zeros_like(k) if need[1] else None
        dv = torch.zeros_like(v) if need[2] else None
        dheads = [torch.zeros_like(h) if n else None for h, n in zip(heads, need[3:3 + nh])]
        dbias = torch.zeros_like(bias) if need[3 + nh] else None
        dsinks = torch.zeros_like(sinks) if need[4 + nh] else None
        dforget = torch.zeros_like(forget) if need[5 + nh] else None
        lq = q.shape[2]
        # fork_rng only with dropout: it cannot be traced by torch.compile, and without dropout there is no RNG
        replay = (torch.random.fork_rng(devices=[q.device] if q.device.type == "cuda" else [])
                  if ctx.rng is not None else contextlib.nullcontext())
        with replay:
            if ctx.rng is not None:
                _set_rng_state(q.device, ctx.rng)
            for i0 in range(0, lq, plan.chunk):
                i1 = min(i0 + plan.chunk, lq)
                with torch.enable_grad():
                    qc = q[:, :, i0:i1].detach().requires_grad_(need[0])
                    kl, vl = k.detach().requires_grad_(need[1]), v.detach().requires_grad_(need[2])
                    hl = [h.detach().requires_grad_(n) for h, n in zip(heads, need[3:3 + nh])]
                    bl = None if bias is None else bias.detach().requires_grad_(need[3 + nh])
                    sl = None if sinks is None else sinks.detach().requires_grad_(need[4 + nh])
                    fl = None if forget is None else forget.detach().requires_grad_(need[5 + nh])
                    out = plan.chunk_out(qc, kl, vl, hl, i0, i1, bl, sl, fl)
                    inputs = [t for t, n in zip([qc, kl, vl, *hl, bl, sl, fl], need) if n]
                    grads = torch.autograd.grad(out, inputs, dout[:, :, i0:i1], allow_unused=True)
                grads = iter(grads)
                if need[0]:
                    g = next(grads)
                    if g is not None:
                        dq[:, :, i0:i1] = g
                for acc, n in ((dk, need[1]), (dv, need[2])):
                    if n:
                        g = next(grads)
                        if g is not None:
                            acc += g
                for acc, n in (*zip(dheads, need[3:3 + nh]), (dbias, need[3 + nh]), (dsinks, need[4 + nh]),
                               (dforget, need[5 + nh])):
                    if n:
                        g = next(grads)
                        if g is not None:
                            acc += g
        return (None, dq, dk, dv, dbias, dsinks, dforget, *dheads)


def _rng_state(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_rng_state(device: torch.device, state) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def accepts(call: AttnCall) -> str | None:
    if call.q.numel() == 0 or call.k.shape[2] == 0:
        return "empty inputs"
    if is_exporting():
        return None  # torch.export traces the chunk loop below (fixed lengths: the loop follows the sequence length)
    return None


def chunked_attention(call: AttnCall) -> tuple[torch.Tensor, None]:
    """out [B, H, Lq, Dv] in the input dtype (fp16/bf16 computed in fp32), any normalizer."""
    q, k, v = call.features(compute_dtype(call.q.dtype))
    names = list(call.heads)
    plan = _Plan(call, names)
    heads = [call.heads[n] for n in names]
    bias = call.score_bias(with_forget=False)
    if torch.compiler.is_compiling():
        # compiled inference (compiled_backward=False declines training): the chunk loop traces, the recomputing
        # autograd.Function (torch.autograd.grad inside it) does not
        lq = q.shape[2]
        out = torch.cat([plan.chunk_out(q[:, :, i0:i0 + plan.chunk], k, v, heads, i0, min(i0 + plan.chunk, lq),
                                        bias, call.sinks, call.forget) for i0 in range(0, lq, plan.chunk)], dim=2)
        return out.to(call.q.dtype), None
    out = _ChunkedFn.apply(plan, q, k, v, bias, call.sinks, call.forget, *heads)
    return out.to(call.q.dtype), None


def _any(norm: Normalizer) -> str | None:
    if norm.query_coupled:
        return f"normalizer {norm.name!r} couples the queries of a call, which this path splits into chunks"
    return None


from .dispatch import register_path  # noqa: E402  (registration at import, like the normalizers)

# its backward recomputes chunks with torch.autograd.grad, which torch.compile cannot trace: compiled training runs
# the reference
register_path("chunked", chunked_attention, takes=_any, accepts=accepts, priority=90,
              supports=("softcap", "bias", "alibi", "sinks", "forget", "dropout"),
              compiled_backward=False, plan_stable=True)
