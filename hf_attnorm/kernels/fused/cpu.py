"""Fused blocked CPU kernels (C++, ``fused_cpu.cpp`` beside it) for the non-exponential normalizers.

A block of queries meets a block of keys: scores -> the normalizer's map -> accumulate numerator and denominator,
with no [Lq, Lk] tensor; the backward pass recomputes the blocks. Memory is O((Lq + Lk) d) plus a few cache-sized
buffers per thread. Threshold maps (sparsemax, entmax-1.5) take two passes over a [block, Lk] row buffer.

The extension is compiled on first use with ``torch.utils.cpp_extension.load`` (cached by torch under
``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``; about a minute once). Without a C++ compiler, or
with ``HF_ATTNORM_NO_NATIVE=1``, this path declines every call after a one-time warning and the dispatcher uses
the pure-PyTorch ``chunked`` path (same math, O(n * chunk) memory, slower).

Score modifiers run in the kernel on each score tile: soft-cap, an additive bias read through its broadcast strides
(never expanded to [B, H, Lq, Lk]; its gradient is reduced to its own shape in the kernel) and ALiBi slopes
(-m_h |i - j|, never materialised). Attention sinks (``s_aux``) are declined (the chunked path applies them).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...normalizers.base import Normalizer
from ...torch_compat import register_export_ops
from ..base import AttnCall, compact_bias, compute_dtype, dense_keep, last_dim_contiguous
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

logger = logging.getLogger("hf_attnorm")

_THRESHOLD_IDS = frozenset(MAP_IDS[name] for name in THRESHOLD)
_ALPHA_IDS = frozenset(m.kernel_id for m in MAPS if m.row_value_use == "alpha")
#: (block_q, block_k) of the blocked kernels (tuned on a 2-core AVX-512 Xeon, d = 64: 128 x 256 was best of
#: 32..256 x 64..512 at n = 1024..4096); threshold maps take block_q_threshold queries against a full row buffer
BLOCKS = {"block_q": 128, "block_k": 256, "block_q_threshold": 128}
#: tests set this to small blocks so that odd lengths cross block edges: (block_q, block_k) or None
BLOCK_OVERRIDE: tuple[int, int] | None = None
#: set to disable the native build (forces the pure-PyTorch fallback, e.g. to test it)
NO_NATIVE_ENV = "HF_ATTNORM_NO_NATIVE"

_SOURCE = Path(__file__).with_name("fused_cpu.cpp")
#: the kernels folder: the header every C++ source includes (cpu_common.h) and the family folders
_KERNELS = Path(__file__).parents[1]
#: further sources compiled into the same extension (their ops are TORCH_LIBRARY_FRAGMENTs of hf_attnorm_native),
#: each beside the Python of its family
EXTRA_SOURCES = [_KERNELS / "stickbreaking" / "stickbreaking_cpu.cpp", _KERNELS / "selective" / "selective_cpu.cpp"]
_lock = threading.Lock()
_state: dict[str, Any] = {"ops": None, "error": None, "warned": False}

#: the ops that traced and exported graphs hold. Their schemas, shape functions and CPU implementations are
#: registered here from Python when hf_attnorm is imported, so a saved ``torch.export`` program resolves them after
#: ``import hf_attnorm`` with nothing built; the CPU implementation builds the C++ extension (whose own ops live in
#: the namespace ``hf_attnorm_native``) on its first call.
OPS_NAMESPACE = "hf_attnorm_fused"
_LIB = torch.library.Library(OPS_NAMESPACE, "DEF")
register_export_ops()  # (and torch's own op that such programs hold, on a torch that defines it late)


def define_op(schema: str, fake: Callable[..., Any]) -> None:
    """Declare ``hf_attnorm_fused::<schema>`` (the C++ op of the same name and schema in hf_attnorm_native) with
    its shape function ``fake``."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)

    def cpu_kernel(*args: Any, **kwargs: Any) -> Any:
        if native_ops() is None:
            raise RuntimeError(f"{OPS_NAMESPACE}::{name} runs the fused CPU kernels, which are unavailable here: "
                               f"{unavailable_reason()}; export without them (the automatic rule does: "
                               "docs/export.md)")
        return getattr(torch.ops.hf_attnorm_native, name)(*args, **kwargs)

    _LIB.impl(name, cpu_kernel, "CPU")
    torch.library.register_fake(f"{OPS_NAMESPACE}::{name}", lib=_LIB)(fake)


def _cpu_fingerprint(table: tuple[FusedMap, ...] = MAPS) -> str:
    """Identifies the instruction set the extension is compiled for (-march=native) and the map table it is
    built for (its facts and per-entry code: maps.table_key): a cache shared between machines must not hand one
    CPU's binary to another, nor one table's build to another table."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        flags = platform.processor() + platform.machine()
    # torch's JIT rebuilds when a source file changes but does not read the headers they include: hash those into
    # the build name, so an edited header (kernels/*.h) never links against a stale cached build
    headers = "".join(h.read_text() for h in sorted(_KERNELS.glob("*.h")))
    maps = table_key(table)  # (torch's JIT also rebuilds on changed flags; this keeps names apart)
    return hashlib.sha1(f"{flags}|{torch.__version__}|{headers}|{maps}".encode()).hexdigest()[:10]


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")


def _cflags() -> list[str]:
    """Compiler flags (the fused maps' facts come in the generated headers: kernels/fused/maps.py)."""
    # -fno-trapping-math lets GCC vectorise floor() (in the exponential). On x86 the loops GCC vectorises itself use
    # 256-bit vectors even where the CPU has AVX-512 (the explicit AVX-512 intrinsics still run there): 512-bit
    # ones were 5-10% faster at n = 4096 on an AVX-512 Xeon, but on another AVX-512 Xeon they put alpha-entmax's
    # fp32 d alpha beyond 5x the fp32 reference's error (3.3e-4 against 5.9e-5 at alpha = 1.15, L = 300), which
    # 256-bit vectors keep within it (2.2e-4)
    flags = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-fno-math-errno", "-DNDEBUG"]
    if platform.machine().lower() in ("x86_64", "amd64", "x86", "i686"):
        flags.insert(-1, "-mprefer-vector-width=256")
    return flags


def _load(name: str, sources: list[str], table: tuple[FusedMap, ...], extra: tuple[str, ...] = ()) -> None:
    """Compile (or load from torch's cache) extension ``name`` from ``sources`` for the map table ``table``:
    the generated ``hf_map_facts_generated.h`` (maps.cpp_facts_header) and ``hf_maps_generated.h``
    (maps.cpp_header) are written into the build directory first."""
    from torch.utils.cpp_extension import _get_build_directory, load

    build_dir = Path(_get_build_directory(name, verbose=False))
    if not (build_dir / f"{name}.so").exists():  # a first build takes about a minute: say so
        logger.warning("hf_attnorm: compiling the fused CPU attention kernels (first use only, about a "
                       "minute; cached in %s)", build_dir)
    generated = build_dir / "generated"
    generated.mkdir(parents=True, exist_ok=True)
    for file, text in (("hf_map_facts_generated.h", cpp_facts_header(table)),
                       ("hf_maps_generated.h", cpp_header(table))):
        header = generated / file
        if not header.exists() or header.read_text() != text:
            header.write_text(text)
    load(
        name=name,
        sources=sources,
        extra_cflags=[*_cflags(), *extra],
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(_KERNELS), str(generated)],
        is_python_module=False,
        verbose=os.environ.get("HF_ATTNORM_VERBOSE_BUILD", "0") not in ("", "0"),
    )


def build_ops(table: tuple[FusedMap, ...]) -> Any:
    """The C++ kernel (``fused_cpu.cpp`` alone) built for the map table ``table`` instead of ``maps.MAPS``, as its
    own extension with its own op namespace (returned: ``torch.ops.<namespace>``, whose ``forward`` / ``backward``
    / ``map_facts`` take the ids of ``table``). For tests of maps declared outside ``MAPS``; raises on a build
    error."""
    if _compiler() is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    tag = _cpu_fingerprint(table)
    namespace = f"hf_attnorm_maps_{tag}"
    with _lock:
        if not hasattr(torch.ops, namespace) or not hasattr(getattr(torch.ops, namespace), "forward"):
            _load(f"hf_attnorm_maps_{tag}", [str(_SOURCE)], table, (f"-DHF_ATTNORM_NATIVE_NS={namespace}",))
    return getattr(torch.ops, namespace)


def native_ops(warn: bool = True) -> Any | None:
    """The compiled ops (``torch.ops.hf_attnorm_fused``), building them on first call; None when unavailable
    (no compiler, build error, or ``HF_ATTNORM_NO_NATIVE=1``), with a one-time warning saying why."""
    if _state["ops"] is not None:
        return _state["ops"]
    if torch.compiler.is_compiling():
        # building (a lock, files, a compiler) cannot be traced; eager calls build it (see compile_ready)
        return None
    if os.environ.get(NO_NATIVE_ENV, "0") not in ("", "0"):
        _fail(f"{NO_NATIVE_ENV} is set", warn)
        return None
    if _state["error"] is not None:
        _fail(_state["error"], warn)  # (warns if the first failure was recorded silently)
        return None
    with _lock:
        if _state["ops"] is not None:
            return _state["ops"]
        if _compiler() is None:
            _fail("no C++ compiler found (set CXX or install g++)", warn)
            return None
        try:
            _load(f"hf_attnorm_fused_{_cpu_fingerprint()}", [str(_SOURCE), *map(str, EXTRA_SOURCES)], MAPS)
            if not torch.ops.hf_attnorm_native.blas_available():
                _fail("this torch build exports no BLAS sgemm_/dgemm_ for extensions", warn)
                return None
            _state["ops"] = torch.ops.hf_attnorm_fused
        except Exception as exc:  # a failed build must not break attention: the chunked path takes over
            _fail(f"building the C++ extension failed: {build_error_summary(exc)}", warn)
            return None
    return _state["ops"]


def build_error_summary(exc: BaseException, max_lines: int = 12) -> str:
    """The compiler's error lines of a failed build (``error:`` / ``fatal error:`` / undefined references, at most
    ``max_lines``), not just the last line (which only says that ninja failed); the message's last line otherwise."""
    text = str(exc).strip()
    if not text:
        return repr(exc)
    lines = text.splitlines()
    errors = [ln.strip() for ln in lines if "error:" in ln or "undefined reference" in ln or "Error " in ln]
    if errors:
        more = f" (+{len(errors) - max_lines} more)" if len(errors) > max_lines else ""
        return "; ".join(dict.fromkeys(errors[:max_lines])) + more
    return lines[-1]


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

    define_op("forward(int map_id, Tensor q, Tensor k, Tensor v, Tensor? keep, bool causal, Tensor row_value, "
              "Tensor? bias, "
              "Tensor? slopes, float cap, int block_q, int block_k, bool need_u=True) -> Tensor[]", forward_fake)
    define_op("backward(int map_id, Tensor q, Tensor k, Tensor v, Tensor? keep, bool causal, Tensor row_value, "
              "Tensor? bias, "
              "Tensor? slopes, float cap, bool bias_grad, Tensor out, Tensor r1, Tensor r2, Tensor u, Tensor dout, "
              "int block_q, int block_k) -> Tensor[]", backward_fake)


def _fail(reason: str, warn: bool) -> None:
    _state["error"] = reason
    if warn and not _state["warned"]:
        _state["warned"] = True
        warnings.warn(f"hf_attnorm: fused CPU kernels unavailable ({reason}); using the slower pure-PyTorch "
                      "'chunked' path instead", stacklevel=3)


def unavailable_reason(warn: bool = False) -> str | None:
    """Why the native kernels cannot run (None when they can); builds them if needed."""
    if native_ops(warn=warn) is not None:
        return None
    return _state["error"] or ("not built yet, and torch.compile cannot build it while tracing: run one eager call "
                               "(or native_ops()) before compiling")


class _FusedAttention(torch.autograd.Function):
    """out = fused(q, k, v; row_value, bias) with gradients for q, k, v, the map's per-row value and the score bias
    (in its own broadcast shape). slopes (ALiBi) and cap (soft-cap, 0 for none) are constants. Saved per row for
    the backward pass (fused_cpu.cpp, above fused_forward): den_or_tau (the denominator, or the threshold),
    shift_or_gsum (the weights' running shift, or the sum of the Jacobian weights) and hv_sum (threshold maps)."""

    @staticmethod
    def forward(ctx, q, k, v, row_value, bias, keep, slopes, cap: float, causal: bool, map_id: int,
                blocks: tuple[int, int], need_grad: bool):
        ops = _state["ops"]
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
        dq, dk, dv, drow_value, dbias = _state["ops"].backward(
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


def cpu_call_reason(call: AttnCall) -> str | None:
    """Why the C++ kernels of this extension cannot take the call's tensors (device, dtype), or None."""
    if call.q.device.type != "cpu":
        return f"device {call.q.device} (CPU only)"
    if call.q.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        return f"dtype {call.q.dtype}"
    return None


def accepts(call: AttnCall) -> str | None:
    """None when this path can run the call, else the reason it cannot (builds the extension on first use)."""
    if call.sinks is not None:  # the chunked path applies them
        return "this path does not apply attention sinks (s_aux)"
    reason = cpu_call_reason(call)
    if reason is not None:
        return reason
    if call.dropout > 0:
        return "dropout > 0 (the weights are never formed)"
    if call.q.numel() == 0 or call.k.numel() == 0:
        return "empty inputs"
    return unavailable_reason(warn=True)


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
    if BLOCK_OVERRIDE is not None:
        blocks = BLOCK_OVERRIDE
    elif name in THRESHOLD:
        # few queries (decode): a query block no larger than needed, since the threshold maps keep a [block_q, Lk]
        # row buffer per thread (128 rows for one query made a 4096-key decode step about 2x slower)
        blocks = (min(BLOCKS["block_q_threshold"], max(8, Lq)), BLOCKS["block_k"])
    else:
        blocks = (BLOCKS["block_q"], BLOCKS["block_k"])
    rv = row_value(call, dt)
    bias = None if call.bias is None else compact_bias(call.bias, dt)
    slopes = None if call.alibi_slopes is None else call.alibi_slopes.detach().to(dt).contiguous()
    cap = 0.0 if call.softcap is None else float(call.softcap)
    need_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, rv, bias))
    out = _FusedAttention.apply(q, k, v, rv, bias, keep, slopes, cap, causal, map_id(name), blocks, need_grad)
    return out.to(call.q.dtype), None


_define_ops()

from .. import register_path  # noqa: E402  (registration at import, like the normalizers)

register_path("fused_cpu", fused_cpu_attention, takes=takes, accepts=accepts, priority=40, auto_exclude=("cuda",))
