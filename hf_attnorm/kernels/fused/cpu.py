"""Fused blocked CPU kernels (C++, ``fused_cpu.cpp`` beside it) for the non-exponential normalizers.

A block of queries meets a block of keys: scores -> the normalizer's map -> accumulate numerator and denominator,
with no [Lq, Lk] tensor; the backward pass recomputes the blocks. Memory is O((Lq + Lk) d) plus a few cache-sized
buffers per thread. Threshold maps (sparsemax, entmax-1.5) take two passes over a [block, Lk] row buffer.

The extension (this family's own: ``kernels/native.py``) is compiled on first use (cached by torch under
``TORCH_EXTENSIONS_DIR``; about a minute once). Without a C++ compiler, when its build fails, or with
``HF_ATTNORM_NO_NATIVE=1``, this path declines every call after a one-time warning and the dispatcher uses the
pure-PyTorch ``chunked`` path (same math, O(n * chunk) memory, slower).

Score modifiers run in the kernel on each score tile: soft-cap, an additive bias read through its broadcast strides
(never expanded to [B, H, Lq, Lk]; its gradient is reduced to its own shape in the kernel) and ALiBi slopes
(-m_h |i - j|, never materialised). Attention sinks (``s_aux``) are declined (the chunked path applies them).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from ...normalizers.base import HEAD_MAP_IDS, N_TERM_IDS, Normalizer, RowForm
from ..base import (
    AttnCall,
    compact_bias,
    compute_dtype,
    dense_keep,
    factored_query,
    has_query_factor,
    last_dim_contiguous,
    one_query_ctx,
    query_factor,
)
from ..native import NO_NATIVE_ENV as NO_NATIVE_ENV  # (re-exported: read where the fused kernels are tested)
from ..native import OPS, NativeExtension, compiler, extension
from ..native import build_error_summary as build_error_summary
from ..native import cpu_call_reason as cpu_call_reason
from .maps import (
    MAP_IDS,
    MAPS,
    THRESHOLD,
    FusedMap,
    cpp_facts_header,
    cpp_header,
    fused_takes,
    lookup_id,
    map_id,
    table_key,
)

_THRESHOLD_IDS = frozenset(MAP_IDS[name] for name in THRESHOLD)
_ALPHA_IDS = frozenset(m.kernel_id for m in MAPS if m.row_value_use == "alpha")
#: (block_q, block_k) of the blocked kernels (tuned on a 2-core AVX-512 Xeon, d = 64: 128 x 256 was best of
#: 32..256 x 64..512 at n = 1024..4096); threshold maps take block_q_threshold queries against a full row buffer
BLOCKS = {"block_q": 128, "block_k": 256, "block_q_threshold": 128}
#: tests set this to small blocks so that odd lengths cross block edges: (block_q, block_k) or None
BLOCK_OVERRIDE: tuple[int, int] | None = None

_SOURCE = Path(__file__).with_name("fused_cpu.cpp")


def _table_options(table: tuple[FusedMap, ...]) -> dict[str, Any]:
    """What the fused kernel is built with for the map table ``table``: the generated ``hf_map_facts_generated.h``
    (its facts: maps.cpp_facts_header) and ``hf_maps_generated.h`` (its per-entry code: maps.cpp_header)."""
    return {"generated": lambda: {"hf_map_facts_generated.h": cpp_facts_header(table),
                                  "hf_maps_generated.h": cpp_header(table)}}


#: the fused maps' extension (``maps.MAPS``); its C++ ops live in the namespace ``hf_attnorm_native``
NATIVE = extension("fused", [_SOURCE], "hf_attnorm_native", "chunked", **_table_options(MAPS))
#: builds for other map tables (``build_ops``), by table key
_TABLE_BUILDS: dict[str, NativeExtension] = {}


def build_ops(table: tuple[FusedMap, ...]) -> Any:
    """The C++ kernel (``fused_cpu.cpp``) built for the map table ``table`` instead of ``maps.MAPS``, as its own
    extension with its own op namespace (returned: ``torch.ops.<namespace>``, whose ``forward`` / ``backward`` /
    ``map_facts`` take the ids of ``table``), so that both can be loaded in one process. For tests of maps declared
    outside ``MAPS``; raises on a build error."""
    if compiler() is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    key = table_key(table)
    ext = _TABLE_BUILDS.get(key)
    if ext is None:
        namespace = f"hf_attnorm_maps_{hashlib.sha1(key.encode()).hexdigest()[:10]}"
        ext = _TABLE_BUILDS[key] = NativeExtension("maps", [_SOURCE], namespace, "chunked",
                                                   **_table_options(table))
    if ext.build(warn=False) is None:
        raise RuntimeError(f"the fused kernel for another map table is unavailable: {ext.error}")
    return ext.ops


def native_ops(warn: bool = True) -> Any | None:
    """The ops the fused kernels call (``torch.ops.hf_attnorm_fused``), building the fused maps' extension on first
    call; None when unavailable (no compiler, build error, or ``HF_ATTNORM_NO_NATIVE=1``), with a one-time warning
    saying why."""
    return None if NATIVE.build(warn=warn) is None else OPS


def _define_ops() -> None:
    """The two ops with their shape-only implementations (torch.compile and torch.export trace through them)."""

    def forward_fake(map_id, q, k, v, keep, causal, row_value, bias, slopes, cap, block_q, block_k, need_u=True):
        B, H, Lq = q.shape[:3]
        out = q.new_empty((B, H, Lq, v.shape[-1]))
        dv = v.shape[-1]
        width = 2 * dv + 3 if map_id in _ALPHA_IDS else dv  # alpha-entmax: [U | A | Z | H | M]
        hv_sum = q.new_empty((B, H, Lq, width)) if map_id in _THRESHOLD_IDS and need_u else q.new_empty((0,))
        return [out, q.new_empty((B, H, Lq)), q.new_empty((B, H, Lq)), hv_sum]

    def backward_fake(map_id, q, k, v, keep, causal, row_value, bias, slopes, cap, bias_grad, out, den_or_tau,
                      shift_or_gsum, hv_sum, dout, block_q, block_k):
        # contiguous like the C++ at::empty(x.sizes()) (empty_like would keep a transposed input's strides)
        dbias = q.new_empty(bias.shape) if bias_grad else q.new_empty((0,))
        return [*(x.new_empty(x.shape) for x in (q, k, v, row_value)), dbias]

    NATIVE.define_op("forward(int map_id, Tensor q, Tensor k, Tensor v, Tensor? keep, bool causal, Tensor row_value, "
              "Tensor? bias, "
              "Tensor? slopes, float cap, int block_q, int block_k, bool need_u=True) -> Tensor[]", forward_fake)
    NATIVE.define_op("backward(int map_id, Tensor q, Tensor k, Tensor v, Tensor? keep, bool causal, Tensor row_value, "
              "Tensor? bias, "
              "Tensor? slopes, float cap, bool bias_grad, Tensor out, Tensor r1, Tensor r2, Tensor u, Tensor dout, "
              "int block_q, int block_k) -> Tensor[]", backward_fake)


def unavailable_reason(warn: bool = False) -> str | None:
    """Why the fused maps' C++ kernels cannot run (None when they can); builds them if needed."""
    return NATIVE.unavailable_reason(warn)


class _FusedAttention(torch.autograd.Function):
    """out = fused(q, k, v; row_value, bias) with gradients for q, k, v, the map's per-row value and the score bias
    (in its own broadcast shape). slopes (ALiBi) and cap (soft-cap, 0 for none) are constants. Saved per row for
    the backward pass (fused_cpu.cpp, above fused_forward): den_or_tau (the denominator, or the threshold),
    shift_or_gsum (the weights' running shift, or the sum of the Jacobian weights) and hv_sum (threshold maps)."""

    @staticmethod
    def forward(ctx, q, k, v, row_value, bias, keep, slopes, cap: float, causal: bool, map_id: int,
                blocks: tuple[int, int], need_grad: bool):
        ops = OPS
        lookup_id(map_id)  # an id no map declares: a ValueError here, before the kernel (which also refuses it)
        # need_grad False (inference): the threshold maps skip hv_sum, which only the backward pass reads
        out, den_or_tau, shift_or_gsum, hv_sum = ops.forward(map_id, q, k, v, keep, causal, row_value, bias, slopes,
                                                             cap, *blocks, need_grad)
        ctx.save_for_backward(q, k, v, row_value, bias, keep, slopes, out, den_or_tau, shift_or_gsum, hv_sum)
        ctx.meta = (causal, map_id, blocks, cap)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, row_value, bias, keep, slopes, out, den_or_tau, shift_or_gsum, hv_sum = ctx.saved_tensors
        causal, map_id, blocks, cap = ctx.meta
        bias_grad = bias is not None and ctx.needs_input_grad[4]
        dq, dk, dv, drow_value, dbias = OPS.backward(
            map_id, q, k, v, keep, causal, row_value, bias, slopes, cap, bias_grad, out, den_or_tau, shift_or_gsum,
            hv_sum, dout.contiguous(), *blocks)
        return (dq, dk, dv, (drow_value if ctx.needs_input_grad[3] else None), (dbias if bias_grad else None),
                None, None, None, None, None, None, None)


def row_value(call: AttnCall, dtype: torch.dtype) -> torch.Tensor:
    """The map's per-row value [B, H, Lq] (contiguous): ``call.row_value`` (symax |eta_h|, sigmoid's bias, relu_len
    1/n, ...; ``maps.FusedMap.row_value``), else n (the kernel zeroes the gradient of single-key rows, where those
    maps are constant)."""
    B, H, Lq = call.q.shape[:3]
    value = call.row_value(dtype)
    if value is None:
        value = call.mask.n.to(device=call.q.device, dtype=dtype)
    return value.expand(B, H, Lq).contiguous()


def takes(norm: Normalizer) -> str | None:
    """The normalizers with a fused map and no q/k transform (``maps.fused_takes``)."""
    return fused_takes(norm, "fused")


def accepts(call: AttnCall) -> str | None:
    """None when this path can run the call, else the reason it cannot (builds nothing: ``NATIVE.reason()``)."""
    reason = cpu_call_reason(call)
    if reason is not None:
        return reason
    if call.q.numel() == 0 or call.k.numel() == 0:
        return "empty inputs"
    return NATIVE.reason()


def _blocks(name: str, lq: int) -> tuple[int, int]:
    """(block_q, block_k) for map ``name`` and ``lq`` queries."""
    if BLOCK_OVERRIDE is not None:
        return BLOCK_OVERRIDE
    if name in THRESHOLD:
        # few queries (decode): a query block no larger than needed, since the threshold maps keep a [block_q, Lk]
        # row buffer per thread (128 rows for one query made a 4096-key decode step about 2x slower)
        return min(BLOCKS["block_q_threshold"], max(8, lq)), BLOCKS["block_k"]
    return BLOCKS["block_q"], BLOCKS["block_k"]


def fused_cpu_attention(call: AttnCall) -> tuple[torch.Tensor, None]:
    """out [B, H, Lq, Dv] in the input dtype (fp16/bf16 computed in fp32), for calls ``accepts`` takes."""
    name = call.normalizer.fused_map
    dt = compute_dtype(call.q.dtype)
    q = (call.q.to(dt) * call.q_factor(dt)).contiguous()
    k = last_dim_contiguous(call.k.to(dt))
    v = last_dim_contiguous(call.v.to(dt))
    B, H, Lq, _ = q.shape
    keep = dense_keep(call, B, H, Lq, k.shape[2])
    causal = keep is None and call.mask.causal
    blocks = _blocks(name, Lq)
    rv = row_value(call, dt)
    bias = None if call.bias is None else compact_bias(call.bias, dt)
    slopes = None if call.alibi_slopes is None else call.alibi_slopes.detach().to(dt).contiguous()
    cap = 0.0 if call.softcap is None else float(call.softcap)
    need_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, rv, bias))
    out = _FusedAttention.apply(q, k, v, rv, bias, keep, slopes, cap, causal, map_id(name), blocks, need_grad)
    return out.to(call.q.dtype), None


def direct(call: AttnCall) -> Any:
    """The direct entry of a plain one-query call (a cached decode step without a mask tensor, score modifier,
    sink or dropout; q, k and v of one dtype computed as is), for the plan to reuse: the fused kernel's one-output
    ``decode`` op on the raw (q, k, v), without autograd. Its row value comes from the normalizer's declared
    ``row_form``, evaluated in the op from the raw per-head value with n = Lk (every row sees every key); a
    normalizer that overrides ``row_value`` itself has it resolved here, from the call's per-head values, as
    ``make_call`` resolves it; so does the per-query factor. Exactly what ``fused_cpu_attention`` computes for such
    a call. None for every other call."""
    q = call.q
    if (q.shape[2] != 1 or call.modifies_scores or call.mask.keep is not None or call.mask.causal
            or call.dropout > 0 or compute_dtype(q.dtype) != q.dtype or call.k.dtype != q.dtype
            or call.v.dtype != q.dtype or BLOCK_OVERRIDE is not None or NATIVE.reason() is not None):
        return None
    norm, settings, info = call.normalizer, call.settings, call.module_info
    B, H = q.shape[:2]
    dt, base, kernel = q.dtype, float(call.base), map_id(norm.fused_map)
    blocks, factored = _blocks(norm.fused_map, 1), has_query_factor(settings)
    native = NATIVE.ops  # (the compiled op itself: plans are made only in eager calls, never traced)
    declared = type(norm).row_value is Normalizer.row_value
    form = (norm.row_form(settings) or RowForm(n_term="n")) if declared else None

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: dict) -> torch.Tensor:
        k, v = last_dim_contiguous(k), last_dim_contiguous(v)
        ctx = one_query_ctx(settings, heads, q, k.shape[2], info) if factored or form is None else None
        # (as fused_cpu_attention: q times base x multiplier, then the kernel)
        q, scale = factored_query(q, query_factor(settings, q, ctx) if factored else None, base)
        if form is not None:
            return native.decode(kernel, q, k, v, None if form.head is None else heads[form.head],
                                 HEAD_MAP_IDS[form.head_map], form.floor, N_TERM_IDS[form.n_term],
                                 form.negate_single_key, scale, *blocks)
        r = norm.row_value(ctx, dt)
        rv = (ctx.n.to(device=q.device, dtype=dt) if r is None else r.to(q.device)).expand(B, H, 1).contiguous()
        # (the decode op's steps: q times the scale, then the forward kernel without its backward's extra output)
        return native.forward(kernel, (q * scale).contiguous(), k, v, None, False, rv, None, None, 0.0, *blocks,
                              False)[0]

    return run


_define_ops()

from ..dispatch import register_path  # noqa: E402  (registration at import, like the normalizers)

register_path("fused_cpu", fused_cpu_attention, takes=takes, accepts=accepts, priority=40, auto_exclude=("cuda",),
              supports=("softcap", "bias", "alibi"),
              prepare=NATIVE.build, plan_stable=True, direct=direct)
