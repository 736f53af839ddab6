"""GPU fast path: flash-style Triton kernels (forward and backward) for the non-softmax normalizers.

One forward kernel (plus a threshold kernel for the sparse maps) and two backward kernels serve every normalizer
below: a map's declared facts (``maps.py``) are compile-time constants (``map_constants``) and its per-entry code
the generated ``_map_weight`` / ``_map_slope`` (``maps.triton_source``); no device code names a map. No n x n tensor
is ever formed: per query block the kernel walks the key blocks, recomputes the scores
s = score_scale_i (q_i . k_j) and accumulates

* sum-normalised maps (symax, squared, stablemax, softpick): numerator O_i = sum_j a(s_ij) v_j and denominator
  D_i = r_i + sum_j b(s_ij) (r_i = |eta| for symax, else 0); out = O / D, 0 where D = 0. Without exponentials
  no running max is needed; softpick keeps one (its exp) and rescales O and D as flash attention does.
* non-normalised maps (sigmoid, relu_len): out_i = sum_j a(s_ij) v_j.
* sparse maps (sparsemax, entmax15): a first kernel finds the per-row threshold tau with safeguarded Newton steps,
  one pass over the key blocks each (O(n d) memory); the forward kernel then accumulates
  p = [z - tau]_+^(1/(alpha-1)) (z = s or s/2) like a non-normalised map.

Per row i: score_scale_i = base x multiplier (the per-query scale, with gradient), r_i = the normalizer's row value
(symax |eta_h|, sigmoid b_h - ln n_i or b_h, relu_len 1/n_i) with gradient. The forward pass saves D and the
softpick shift / sparse threshold per row (fp32); the backward pass recomputes score blocks. With
dp_ij = do_i . v_j: normalised ds_ij = (a'(s_ij) dp_ij - b'(s_ij) delta_i) / D_i, delta_i = sum_j w_ij dp_ij;
sparse ds_ij = g_ij (dp_ij - delta_i), g = p^(2 - alpha), delta_i = sum_j g_ij dp_ij / sum_j g_ij; non-normalised
ds_ij = a'(s_ij) dp_ij. Then dq_i = score_scale_i sum_j ds_ij k_j, dscore_scale_i = q_i . sum_j ds_ij k_j,
dk_j = sum_i score_scale_i ds_ij q_i,
dv_j = sum_i w_ij do_i. delta comes from a first pass of the dq kernel rather than flash attention's do . out:
see ``_bwd_dq_kernel``.
One program per (key block, batch, kv head) loops over the heads of its GQA group, so dk/dv need no atomics.

Masks: none; causal (upper-left, key j visible to query i iff j <= i: MaskInfo's meaning of ``keep is None``);
or the boolean keep-mask (any pattern: padding, fully masked rows, cache offsets, per head) read blockwise, with a
block table (one byte per [query block, key block]) so blocks without a visible key are skipped.

Score modifiers (``_mods``, wherever a score block is formed): soft-cap c tanh(s / c), a bias read through its
broadcast strides (gradient: block sums of ds added atomically into the bias's own shape), ALiBi from the slopes
(-m_h |Lk - Lq + i - j|); constexpr flags leave the unmodified kernels as they were. Sinks are declined.

Dispatch: automatic on CUDA tensors. Forced (``path="triton"``), CPU tensors run too while Triton's interpreter is on
(``TRITON_INTERPRET=1``): that is how the tests run these kernels without a GPU. Triton is imported and the kernels
are jitted on first use (per interpreter mode), so importing this module needs no triton.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import linecache
import math
import os
import types
import warnings
from typing import Any

import torch

from ...normalizers.base import Normalizer
from ..base import AttnCall, compact_bias
from .maps import MAPS, SHIFT_IDS, THRESHOLD, FusedMap, fused_takes, lookup_id, table_key, triton_source

# imported on first use (``_load_triton``): the plain package needs no triton, and triton fixes compiled vs
# interpreted mode for its own library functions when it is imported
triton: Any = None
tl: Any = None

#: power: |s| below the smallest normal fp32 counts as 0 (weight 0); the log-domain "minus infinity" of its shift
TINY = 1.1754943508222875e-38
POW_NEG = -1e30
# alpha-entmax: alpha_i = r_i (per head, d alpha through DR), scores shifted by the row max (ROWMAX) and scaled by
# alpha - 1 before the threshold, as the reference and the C++ kernel (see _threshold_kernel)
#: at most this many Newton passes for the sparse threshold (measured: sparsemax 3-5, entmax15 6-8, plus one max pass)
THRESHOLD_STEPS = 30

#: (BLOCK_M, BLOCK_N) override for every call (tests use small blocks so odd lengths cross block edges)
BLOCK_OVERRIDE: tuple[int, int] | None = None


#: the outputs and the gradients of q, k, v (and the score scale and row value) are bitwise reproducible: no
#: atomics outside the score-bias gradient (dk/dv: one program per key block and kv head). Read by
#: tests/test_gpu.py's determinism check.
DETERMINISTIC = True
#: NVIDIA GPUs below this compute capability are refused with ``TritonKernelError``: Triton's supported range
#: (compute capability 8.0 and newer), and the kernels were compiled and checked for sm_80 and newer only
MIN_CAPABILITY = (8, 0)
#: how to run another path, named in every ``TritonKernelError``
ESCAPE = ("set HF_ATTNORM_PATH=chunked in the environment (or pass path='chunked' to attention()) to run the "
          "pure-PyTorch path instead")


class TritonKernelError(RuntimeError):
    """A Triton kernel of hf_attnorm failed to compile or launch, or the device is one the kernels do not support.
    The message names the kernel, the device and how to force another path (``ESCAPE``); never a silent fallback."""


def describe_device(device: torch.device | None) -> str:
    """'cuda:0 (NVIDIA H100 80GB HBM3, compute capability 9.0)', or 'cpu (Triton interpreter)'."""
    if device is None:
        return "an unknown device"
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda:{index} ({torch.cuda.get_device_name(index)}, compute capability {major}.{minor})"
    if device.type == "cpu":
        return "cpu (Triton interpreter)"
    return str(device)


def device_problem(device: torch.device | None) -> str | None:
    """None, or why the Triton kernels cannot run on ``device`` (an NVIDIA GPU below ``MIN_CAPABILITY``)."""
    if device is None or device.type != "cuda" or torch.version.hip is not None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(index)
    if tuple(capability) < MIN_CAPABILITY:
        return (f"compute capability {capability[0]}.{capability[1]} is below "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}, the lowest the hf_attnorm Triton kernels support")
    return None


def kernel_name(kernel: Any) -> str:
    """'hf_attnorm.kernels.fused.triton._fwd_kernel' for a jitted kernel of ``jit_namespace``."""
    fn = getattr(kernel, "fn", kernel)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def launch(kernel: Any, grid: tuple[int, ...]) -> Any:
    """``kernel[grid]`` whose failures say what failed: a device below ``MIN_CAPABILITY`` or any error while Triton
    compiles or launches the kernel (compile errors, shared memory or registers out of resources, ...) raises
    ``TritonKernelError`` naming the kernel, the device, the cause and ``ESCAPE``. CUDA out-of-memory passes as is."""
    def run(*args: Any, **kwargs: Any) -> Any:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        problem = device_problem(device)
        if problem is not None:
            raise TritonKernelError(f"Triton kernel {kernel_name(kernel)} cannot run on {describe_device(device)}: "
                                    f"{problem}; {ESCAPE}")
        try:
            return kernel[grid](*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001  (any compile/launch error is re-raised with the facts a user needs)
            cause = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            raise TritonKernelError(f"Triton kernel {kernel_name(kernel)} failed to compile or launch on "
                                    f"{describe_device(device)} (triton {getattr(triton, '__version__', '?')}): "
                                    f"{cause}; {ESCAPE}") from exc
    return run


#: looked up once at import (without importing triton): the paths' accepts ask on every call, also while Dynamo
#: traces, and Dynamo refuses to trace importlib's find_spec
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_installed() -> bool:
    return _TRITON_INSTALLED


def interpreter_requested() -> bool:
    """True when ``TRITON_INTERPRET`` asks for Triton's interpreter (kernels then run on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


def _load_triton() -> None:
    global triton, tl
    if triton is None:
        import triton as _triton
        import triton.language as _tl

        triton, tl = _triton, _tl


def jit_interprets() -> bool:
    """Whether ``triton.jit`` now makes interpreted functions (triton loaded): ``triton.knobs`` since triton 3.4;
    before it, jit read the variable itself, interpreting only for exactly "1"."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@torch.compiler.assume_constant_result  # Dynamo cannot trace isinstance on a Triton function nor triton's knobs
def interpreter_consistent() -> bool:
    """Triton's library functions (tl.sum ...) were jitted in the mode now requested. False when
    ``TRITON_INTERPRET=1`` was set after triton had been imported (or unset after): interpreted kernels calling
    compiled library functions cannot run."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction) == jit_interprets()


# ---------------------------------------------------------------------------------------------------- device code
# Plain functions here; ``_compiled()`` wraps them with triton.jit on first use. Every name a kernel calls must be
# listed in _JIT_FUNCTIONS (dependency order).


def _entry(s, r, keep, shift, MAP: tl.constexpr, RUNNING_SHIFT: tl.constexpr, THRESHOLD_EXP: tl.constexpr):
    """Forward map of one score block: (a, b) with a the numerator weight and b the denominator term.

    s: [BM, BN] fp32 scores; r: [BM] row values; keep: [BM, BN] bool; shift: [BM] (softpick running max,
    sparse: threshold tau). Masked entries give exactly 0.
    """
    zero = 0.0  # (scalars, not tl.zeros_like: library calls are slow in the interpreter)
    if RUNNING_SHIFT == 1:  # (shift 'max_score') softpick in units of e^-M: e^(s-M) - e^-M
        e = tl.exp(tl.where(keep, s - shift[:, None], -float("inf")))
        p = e - tl.exp(-shift)[:, None]
        a = tl.where(keep & (p > 0), p, zero)
        b = tl.where(keep, tl.abs(p), zero)
    elif THRESHOLD_EXP == 1:  # sparsemax [s - tau]_+
        a = tl.where(keep, tl.maximum(s - shift[:, None], 0.0), zero)
        b = a
    elif RUNNING_SHIFT == 3:  # ('log_abs_max') power |s|^p = e^(p ln|s| - M), p = |r|, M = max of p ln|s|
        mag = tl.abs(s)
        nz = keep & (mag >= TINY)
        a = tl.where(nz, tl.exp(tl.where(nz, tl.abs(r)[:, None] * tl.log(tl.where(nz, mag, 1.0)) - shift[:, None],
                                         POW_NEG)), zero)
        b = a
    elif RUNNING_SHIFT == 2:  # ('max_score_below_zero') softplus(s) e^-c, c = min(0, running max) (shift):
        # s + log1p(e^-s) for s > 0
        # (then c = 0), else e^(s - c) log1p(u) / u with u = e^s (exact where u underflows); log1p by Goldberg
        u = tl.exp(-tl.abs(s))
        w = 1.0 + u
        d = w - 1.0
        lp = tl.where(d == 0, u, tl.log(w) * (u / tl.where(d == 0, 1.0, d)))
        ratio = tl.where(u > 0, lp / tl.where(u > 0, u, 1.0), 1.0)
        neg = tl.exp(tl.minimum(s - shift[:, None], 0.0)) * ratio
        a = tl.where(keep, tl.where(s > 0, s + lp, neg), zero)
        b = a
    elif THRESHOLD_EXP == -1:  # alpha-entmax [x - tau]_+^(1/(alpha-1)), x = (s - M)(alpha - 1) from the caller
        d = tl.where(keep, s - shift[:, None], zero)
        pos = d > 0
        a = tl.where(pos, tl.exp(tl.log(tl.where(pos, d, 1.0)) / (r - 1.0)[:, None]), zero)
        b = a
    elif THRESHOLD_EXP == 2:  # entmax-1.5 [s/2 - tau]_+^2
        t = tl.where(keep, tl.maximum(s * 0.5 - shift[:, None], 0.0), zero)
        a = t * t
        b = a
    else:  # the declared per-entry code (FusedMap.code; _map_weight is generated from it)
        a = tl.where(keep, _map_weight(s, r[:, None], MAP), zero)  # noqa: F821  (generated: _compiled)
        b = a
    return a, b


def _slopes(s, r, keep, shift, MAP: tl.constexpr, RUNNING_SHIFT: tl.constexpr, THRESHOLD_EXP: tl.constexpr):
    """Backward map of one score block: (a, da, db) with da = a'(s), db = b'(s) (0 on masked entries).

    For the sparse maps da is the Jacobian weight g = p^(2 - alpha) (1 on sparsemax's support, sqrt(p) for
    entmax-1.5) and db is unused.
    """
    zero = 0.0
    if RUNNING_SHIFT == 1:  # (shift 'max_score') softpick
        e = tl.exp(tl.where(keep, s - shift[:, None], -float("inf")))
        p = e - tl.exp(-shift)[:, None]
        a = tl.where(keep & (p > 0), p, zero)
        da = tl.where(keep & (p > 0), e, zero)
        db = tl.where(keep, tl.where(p > 0, e, tl.where(p < 0, -e, 0.0)), zero)
    elif THRESHOLD_EXP == 1:  # sparsemax
        a = tl.where(keep, tl.maximum(s - shift[:, None], 0.0), zero)
        da = tl.where(a > 0, 1.0, 0.0)
        db = da
    elif RUNNING_SHIFT == 3:  # (shift 'log_abs_max') power: d|s|^p/ds = p |s|^p / s (0 at s = 0)
        mag = tl.abs(s)
        nz = keep & (mag >= TINY)
        pw = tl.abs(r)[:, None]
        a = tl.where(nz, tl.exp(tl.where(nz, pw * tl.log(tl.where(nz, mag, 1.0)) - shift[:, None], POW_NEG)), zero)
        da = tl.where(nz, a * pw / tl.where(nz, s, 1.0), zero)
        db = da
    elif RUNNING_SHIFT == 2:  # (shift 'max_score_below_zero') (softplus(s) e^-c)' = sigmoid(s) e^-c
        u = tl.exp(-tl.abs(s))
        w = 1.0 + u
        d = w - 1.0
        lp = tl.where(d == 0, u, tl.log(w) * (u / tl.where(d == 0, 1.0, d)))
        ratio = tl.where(u > 0, lp / tl.where(u > 0, u, 1.0), 1.0)
        e = tl.exp(tl.minimum(s - shift[:, None], 0.0))
        a = tl.where(keep, tl.where(s > 0, s + lp, e * ratio), zero)
        da = tl.where(keep, tl.where(s > 0, 1.0, e) / w, zero)
        db = da
    elif THRESHOLD_EXP == -1:  # alpha-entmax: g = d^(1/(alpha-1) - 1) = p^(2 - alpha) (unnormalised)
        d = tl.where(keep, s - shift[:, None], zero)
        pos = d > 0
        d1 = tl.where(pos, d, 1.0)
        a = tl.where(pos, tl.exp(tl.log(d1) / (r - 1.0)[:, None]), zero)
        da = tl.where(pos, a / d1, zero)
        db = da
    elif THRESHOLD_EXP == 2:  # entmax-1.5
        t = tl.where(keep, tl.maximum(s * 0.5 - shift[:, None], 0.0), zero)
        a = t * t
        da = t
        db = da
    else:  # the declared per-entry code (FusedMap.code; _map_weight / _map_slope are generated from it)
        w = _map_weight(s, r[:, None], MAP)  # noqa: F821  (generated: _compiled)
        a = tl.where(keep, w, zero)
        da = tl.where(keep, _map_slope(s, r[:, None], w, MAP), zero)  # noqa: F821
        db = da
    return a, da, db


def _tanh(x):
    """tanh in fp32 (Cephes tanhf: odd polynomial below 0.625, else from exp; triton 3.9 has no tl.tanh)."""
    ax = tl.abs(x)
    z = x * x
    p = -5.70498872745e-3 * z + 2.06390887954e-2
    p = p * z - 5.37397155531e-2
    p = p * z + 1.33314422036e-1
    p = p * z - 3.33332819422e-1
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    return tl.where(ax < 0.625, p * z * x + x, tl.where(x < 0, -big, big))


def _mods(s, b, h, offs_m, offs_n, m_valid, n_valid, BIAS, sbb, sbh, sbm, sbn, SLOPES, CAP, QOFF,
          HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_CAP: tl.constexpr):
    """Score modifiers on a block s [BM, BN] (fp32): CAP tanh(s / CAP), + BIAS (strides 0 on its broadcast dims),
    - SLOPES[h] |QOFF + i - j| (ALiBi). Returns (s, capd) with capd = 1 - tanh^2 (1.0 without a cap)."""
    capd = 1.0
    if HAS_CAP:
        t = _tanh(s / CAP)
        s = CAP * t
        capd = 1.0 - t * t
    if HAS_BIAS:
        s += tl.load(BIAS + b * sbb + h * sbh + offs_m[:, None] * sbm + offs_n[None, :] * sbn,
                     mask=m_valid[:, None] & n_valid[None, :], other=0.0).to(tl.float32)
    if HAS_ALIBI:
        slope = tl.load(SLOPES + h)
        s -= slope * tl.abs((offs_m[:, None] + QOFF - offs_n[None, :]).to(tl.float32))
    return s, capd


def _score_block(q, kt_ptrs, keep_ptrs, offs_m, offs_n, m_valid, d_valid, score_scale,
                                       LK,
                 CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                 b, h, BIAS, sbb, sbh, sbm, sbn, SLOPES, CAP, QOFF,
                 HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_CAP: tl.constexpr):
    """Scores s [BM, BN] = c_i (q_i . k_j) in fp32 with the score modifiers (``_mods``), the keep block, k^T
    [BD, BN] (input dtype) and the cap's derivative capd (``_mods``).

    q: [BM, BD] in the input dtype (fp16/bf16 products are exact in the fp32 accumulator, so the score dot runs on
    the inputs as they are; UPCAST: both in fp32 instead, for bf16 under the interpreter, whose bf16 dot is wrong
    in triton 3.9); kt_ptrs: [BD, BN] pointers to k^T of this key block; keep_ptrs: [BM, BN] (HAS_MASK)."""
    n_valid = offs_n < LK
    kt = tl.load(kt_ptrs, mask=d_valid[:, None] & n_valid[None, :], other=0.0)
    if UPCAST:
        kt = kt.to(tl.float32)
    s = tl.dot(q, kt, input_precision=PREC) * score_scale[:, None]
    s, capd = _mods(s, b, h, offs_m, offs_n, m_valid, n_valid, BIAS, sbb, sbh, sbm, sbn, SLOPES, CAP, QOFF,
                    HAS_BIAS, HAS_ALIBI, HAS_CAP)
    keep = m_valid[:, None] & n_valid[None, :]
    if CAUSAL:
        keep = keep & (offs_n[None, :] <= offs_m[:, None])
    if HAS_MASK:
        keep = keep & (tl.load(keep_ptrs, mask=keep, other=0) != 0)
    return s, keep, kt, capd


def _threshold_kernel(
    Q, K, SCORE_SCALE, KEEP, TABLE, TAU,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, scb, sch, scm,
    smb, smh, smm, smn, stb, sth, stm, stn,
    H, GROUPS, LQ, LK, DH, R, ROWMAX,
    BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_CAP: tl.constexpr,
    MAP: tl.constexpr, THRESHOLD_EXP: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
    STEPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Sparse maps: per-row threshold TAU [B, H, Lq] with sum_j [z_j - tau]_+^(1/(alpha-1)) = 1 (z = s or s/2).

    Pass 1 finds the row max m of z; tau lies in [m - 1, m] (the max alone has mass >= 1 at m - 1). Then Newton
    steps on f(tau) = mass(tau) - 1 from the left end (f is convex and decreasing, so they approach the root from
    below without overshooting; sparsemax's f is piecewise linear and Newton lands exactly once the support is
    found), safeguarded by the bracket (bisection if a step leaves it). Each step is one pass over the key blocks;
    a block stops when all its rows converged (|f| <= 1e-7 or a relative step below 2e-8), at most STEPS passes.
    Fully masked rows get tau = 0 (their p is 0 anyway).

    alpha-entmax (alpha_i = R, P = 1/(alpha - 1)): z = x = (s - M)(alpha - 1) with M the row max of s, stored in
    ROWMAX for the other kernels (shifted before scaling, as the reference: (alpha - 1) s would be rounded first and
    P amplifies that), tau in [-1, 0]. For alpha <= 2 the step is Newton's on h(tau) = mass^(1/P) (= ||[x - tau]_+||_P,
    convex and decreasing for P >= 1, so from below it never overshoots; nearly linear where mass is a high power,
    i.e. near-uniform rows and alpha -> 1); for alpha > 2 bisection (about 26 passes to fp32 precision).
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    hk = h // GROUPS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < LQ
    d_valid = offs_d < DH
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    score_scale = tl.load(SCORE_SCALE + b * scb + h * sch + offs_m * scm, mask=m_valid, other=0.0)
    kt_ptrs = K + b * skb + hk * skh + offs_n0[None, :] * skn + offs_d[:, None] * skd
    keep_ptrs = KEEP + b * smb + h * smh + offs_m[:, None] * smm + offs_n0[None, :] * smn
    t_ptr = TABLE + b * stb + h * sth + pid_m * stm
    hi = LK
    if CAUSAL:
        hi = tl.minimum(LK, (pid_m + 1) * BLOCK_M)
    zmax = tl.full([BLOCK_M], -float("inf"), tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        live = 1
        if HAS_MASK:
            live = tl.load(t_ptr + (start_n // BLOCK_N) * stn)
        if live != 0:
            s, keep, kt, capd = _score_block(q, kt_ptrs + start_n * skn, keep_ptrs + start_n * smn, offs_m,
                                       start_n + offs_n0, m_valid, d_valid, score_scale,
                                       LK, CAUSAL, HAS_MASK, PREC, UPCAST,
                b, h, BIAS, sbb, sbh, sbm, sbn, SLOPES, CAP, QOFF, HAS_BIAS, HAS_ALIBI, HAS_CAP)
            if THRESHOLD_EXP == 2:
                s = s * 0.5
            zmax = tl.maximum(zmax, tl.max(tl.where(keep, s, -float("inf")), 1))
    has_keys = zmax > -float("inf")
    hi_t = tl.where(has_keys, zmax, 0.0)
    lo_t = hi_t - 1.0
    if THRESHOLD_EXP == -1:
        am1 = tl.load(R + b * scb + h * sch + offs_m * scm, mask=m_valid, other=2.0) - 1.0
        pw = 1.0 / am1
        mrow = hi_t  # M (0 on fully masked rows)
        tl.store(ROWMAX + pid_bh * LQ + offs_m, mrow, mask=m_valid)
        hi_t = tl.zeros([BLOCK_M], tl.float32)
        lo_t = hi_t - 1.0
    tau = lo_t
    done = has_keys == 0  # fully masked rows: p = 0 whatever tau is (not ~has_keys: triton 3.2 cannot interpret it)
    for _ in range(STEPS):
        if tl.max(tl.where(done, 0, 1)) != 0:
            mass = tl.zeros([BLOCK_M], tl.float32)
            slope = tl.zeros([BLOCK_M], tl.float32)
            for start_n in range(0, hi, BLOCK_N):
                live = 1
                if HAS_MASK:
                    live = tl.load(t_ptr + (start_n // BLOCK_N) * stn)
                if live != 0:
                    s, keep, kt, capd = _score_block(q, kt_ptrs + start_n * skn, keep_ptrs + start_n * smn, offs_m,
                                               start_n + offs_n0, m_valid, d_valid, score_scale,
                                       LK, CAUSAL, HAS_MASK, PREC,
                                               UPCAST,
                        b, h, BIAS, sbb, sbh, sbm, sbn, SLOPES, CAP, QOFF, HAS_BIAS, HAS_ALIBI, HAS_CAP)
                    if THRESHOLD_EXP == 2:
                        s = s * 0.5
                    if THRESHOLD_EXP == -1:
                        s = (s - mrow[:, None]) * am1[:, None]
                    t = tl.where(keep, tl.maximum(s - tau[:, None], 0.0), 0.0)
                    if THRESHOLD_EXP == -1:  # mass = sum t^P, slope = sum t^(P-1) (-d mass/d tau = P slope)
                        pos = t > 0
                        t1 = tl.where(pos, t, 1.0)
                        e = tl.where(pos, tl.exp(tl.log(t1) * pw[:, None]), 0.0)
                        mass += tl.sum(e, 1)
                        slope += tl.sum(e / t1, 1)
                    elif THRESHOLD_EXP == 2:
                        mass += tl.sum(t * t, 1)
                        slope += 2.0 * tl.sum(t, 1)
                    elif THRESHOLD_EXP == 1:
                        mass += tl.sum(t, 1)
                        slope += tl.sum(tl.where(t > 0, 1.0, 0.0), 1)
                    else:
                        tl.static_assert(False, "hf_attnorm triton: no threshold search for this fused map MAP")
            f = mass - 1.0  # decreasing and convex in tau
            lo_t = tl.where(f >= 0, tau, lo_t)
            hi_t = tl.where(f >= 0, hi_t, tau)
            if THRESHOLD_EXP == -1:
                # h = mass^(1/P): tau + (h - 1) / -h' = tau + (mass - mass^(1 - 1/P)) / slope. alpha > 2: bisection
                # (-2 is outside the bracket), as the C++ kernel: there the slope is infinite at the support's edge,
                # so Newton's steps on mass shrink to nothing away from the root and stop the search early
                mpow = tl.exp(tl.log(tl.where(mass > 0, mass, 1.0)) * (1.0 - am1))
                newton = tl.where(pw >= 1.0, tau + (mass - mpow) / tl.where(slope > 0, slope, 1.0), -2.0)
                newton = tl.where(tl.abs(f) <= 1e-7, tau, newton)  # at the root (one candidate: tau = -1): stay
            else:
                newton = tau + f / tl.where(slope > 0, slope, 1.0)
            ok = (slope > 0) & (newton >= lo_t) & (newton <= hi_t)
            nxt = tl.where(ok, newton, 0.5 * (lo_t + hi_t))
            conv = (tl.abs(f) <= 1e-7) | (tl.abs(nxt - tau) <= 2e-8 * tl.maximum(tl.abs(tau), 1.0))
            tau = tl.where(done, tau, nxt)
            done = done | conv
    tau = tl.where(has_keys, tau, 0.0)
    tl.store(TAU + pid_bh * LQ + offs_m, tau, mask=m_valid)


def _fwd_kernel(
    Q, K, V, SCORE_SCALE, R, KEEP, TABLE, SHIFT_IN, OUT, DEN, SHIFT,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, scb, sch, scm,
    smb, smh, smm, smn, stb, sth, stm, stn,
    H, GROUPS, LQ, LK, DH, DV, ROWMAX,
    BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_CAP: tl.constexpr,
    MAP: tl.constexpr, NORMALISED: tl.constexpr, DEN_ADDS_ROW_VALUE: tl.constexpr, RUNNING_SHIFT: tl.constexpr,
    THRESHOLD_EXP: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One program per (query block, batch x head): OUT [B, H, Lq, Dv], DEN and SHIFT [B, H, Lq] (fp32).
    alpha-entmax: DEN = Z = sum_j [x_j - tau]_+^P, by which the row is renormalised as in the reference."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    hk = h // GROUPS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_valid = offs_m < LQ
    d_valid = offs_d < DH
    dv_valid = offs_dv < DV
    row = pid_bh.to(tl.int64) * LQ + offs_m
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    score_scale = tl.load(SCORE_SCALE + b * scb + h * sch + offs_m * scm, mask=m_valid, other=0.0)
    r = tl.load(R + b * scb + h * sch + offs_m * scm, mask=m_valid, other=0.0)
    kt_ptrs = K + b * skb + hk * skh + offs_n0[None, :] * skn + offs_d[:, None] * skd
    v_ptrs = V + b * svb + hk * svh + offs_n0[:, None] * svn + offs_dv[None, :] * svd
    keep_ptrs = KEEP + b * smb + h * smh + offs_m[:, None] * smm + offs_n0[None, :] * smn
    t_ptr = TABLE + b * stb + h * sth + pid_m * stm
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    if THRESHOLD_EXP != 0:
        shift = tl.load(SHIFT_IN + row, mask=m_valid, other=0.0)  # the sparse threshold tau
    elif (RUNNING_SHIFT == 2) | (RUNNING_SHIFT == 3):
        # power: running max of p ln|s| over visible s != 0; softplus: min(0, running max of visible s)
        shift = tl.full([BLOCK_M], POW_NEG, tl.float32)
    else:
        shift = tl.zeros([BLOCK_M], tl.float32)  # shift 1 (softpick): running max of (0, visible scores)
    if THRESHOLD_EXP == -1:
        mrow = tl.load(ROWMAX + row, mask=m_valid, other=0.0)
    hi = LK
    if CAUSAL:
        hi = tl.minimum(LK, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        live = 1
        if HAS_MASK:
            live = tl.load(t_ptr + (start_n // BLOCK_N) * stn)
        if live != 0:
            offs_n = start_n + offs_n0
            s, keep, kt, capd = _score_block(q, kt_ptrs + start_n * skn, keep_ptrs + start_n * smn, offs_m, offs_n,
                                       m_valid, d_valid, score_scale,
                                       LK, CAUSAL, HAS_MASK, PREC, UPCAST,
                b, h, BIAS, sbb, sbh, sbm, sbn, SLOPES, CAP, QOFF, HAS_BIAS, HAS_ALIBI, HAS_CAP)
            if THRESHOLD_EXP == -1:
                s = (s - mrow[:, None]) * (r - 1.0)[:, None]
            if RUNNING_SHIFT == 1:  # 'max_score'
                new = tl.maximum(shift, tl.max(tl.where(keep, s, 0.0), 1))
                alpha = tl.exp(shift - new)
                acc = acc * alpha[:, None]
                den = den * alpha
                shift = new
            if RUNNING_SHIFT == 3:  # 'log_abs_max'
                mag = tl.abs(s)
                nz = keep & (mag >= TINY)
                lmax = tl.max(tl.where(nz, tl.abs(r)[:, None] * tl.log(tl.where(nz, mag, 1.0)), POW_NEG), 1)
                new = tl.maximum(shift, lmax)
                alpha = tl.exp(shift - new)
                acc = acc * alpha[:, None]
                den = den * alpha
                shift = new
            if RUNNING_SHIFT == 2:  # 'max_score_below_zero'
                new = tl.maximum(shift, tl.minimum(tl.max(tl.where(keep, s, POW_NEG), 1), 0.0))
                alpha = tl.exp(shift - new)
                acc = acc * alpha[:, None]
                den = den * alpha
                shift = new
            a, bden = _entry(s, r, keep, shift, MAP, RUNNING_SHIFT, THRESHOLD_EXP)
            v = tl.load(v_ptrs + start_n * svn, mask=(offs_n[:, None] < LK) & dv_valid[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.dot(a, v, input_precision=PREC)
            den += tl.sum(bden, 1)
    if NORMALISED:
        if DEN_ADDS_ROW_VALUE:  # (maps.py: den_offset)
            den = den + r
        inv = tl.where(den != 0, 1.0 / tl.where(den != 0, den, 1.0), 0.0)
        acc = acc * inv[:, None]
    if THRESHOLD_EXP == -1:
        acc = acc * tl.where(den != 0, 1.0 / tl.where(den != 0, den, 1.0), 0.0)[:, None]
    tl.store(OUT + row[:, None] * DV + offs_dv[None, :], acc, mask=m_valid[:, None] & dv_valid[None, :])
    tl.store(DEN + row, den, mask=m_valid)
    if RUNNING_SHIFT != 0:
        tl.store(SHIFT + row, shift, mask=m_valid)


def _bwd_dq_kernel(
    Q, K, V, SCORE_SCALE, R, KEEP, TABLE, SHIFT, DEN, DELTA, DO, DQ, DSCORE_SCALE, DR,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, scb, sch, scm,
    smb, smh, smm, smn, stb, sth, stm, stn,
    H, GROUPS, LQ, LK, DH, DV, ROWMAX,
    BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF, DBIAS, sdb, sdh, sdm, sdn,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_CAP: tl.constexpr, HAS_DBIAS: tl.constexpr,
    DB_BM: tl.constexpr, DB_BN: tl.constexpr,
    MAP: tl.constexpr, NORMALISED: tl.constexpr, DEN_ADDS_ROW_VALUE: tl.constexpr, ROW_VALUE_FACTOR: tl.constexpr,
    RUNNING_SHIFT: tl.constexpr, THRESHOLD_EXP: tl.constexpr, ROW_VALUE_IN_SCORE: tl.constexpr,
    ROW_VALUE_EXPONENT: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One program per (query block, batch x head): DQ [B, H, Lq, D], DSCORE_SCALE and DR [B, H, Lq] (fp32).

    DELTA [B, H, Lq]: written here for the dk/dv kernel (normalised and sparse maps). DO: fp32 contiguous.
    alpha-entmax: DR = d alpha_i = sum_j dp_ij [(p - pt) / (alpha-1)^2 - (p ln p - pt H) / (alpha-1)]_ij
    (Correia et al. 2019, pt = g / sum g, H = sum p ln p), formed per entry in the second pass once G and H are
    known (no cancellation between row sums), with dp - delta for dp (allowed: the bracket sums to 0 over j).
    DBIAS (HAS_DBIAS): fp32 in the bias's own shape (strides 0 on its broadcast dims); dS w.r.t. the modified scores
    is summed over the block's broadcast dims (DB_BM: over queries, DB_BN: over keys) and added atomically, since
    programs of other batches / heads / query blocks may share the entries.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    hk = h // GROUPS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_valid = offs_m < LQ
    d_valid = offs_d < DH
    dv_valid = offs_dv < DV
    row = pid_bh.to(tl.int64) * LQ + offs_m
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    score_scale = tl.load(SCORE_SCALE + b * scb + h * sch + offs_m * scm, mask=m_valid, other=0.0)
    r = tl.load(R + b * scb + h * sch + offs_m * scm, mask=m_valid, other=0.0)
    shift = tl.load(SHIFT + row, mask=m_valid, other=0.0)
    den = tl.load(DEN + row, mask=m_valid, other=0.0)
    inv = tl.where(den != 0, 1.0 / tl.where(den != 0, den, 1.0), 0.0)
    delta = tl.zeros([BLOCK_M], tl.float32)
    do = tl.load(DO + row[:, None] * DV + offs_dv[None, :], mask=m_valid[:, None] & dv_valid[None, :], other=0.0)
    kt_ptrs = K + b * skb + hk * skh + offs_n0[None, :] * skn + offs_d[:, None] * skd
    vt_ptrs = V + b * svb + hk * svh + offs_n0[None, :] * svn + offs_dv[:, None] * svd
    keep_ptrs = KEEP + b * smb + h * smh + offs_m[:, None] * smm + offs_n0[None, :] * smn
    t_ptr = TABLE + b * stb + h * sth + pid_m * stm
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dr = tl.zeros([BLOCK_M], tl.float32)
    hi = LK
    if CAUSAL:
        hi = tl.minimum(LK, (pid_m + 1) * BLOCK_M)
    if THRESHOLD_EXP == -1:
        mrow = tl.load(ROWMAX + row, mask=m_valid, other=0.0)
        am1 = r - 1.0
        # g of the renormalised p = a / Z, as the reference: (a / Z)^(2 - alpha) = a^(2 - alpha) Z^(alpha - 2)
        # (Z - 1 is about P times tau's rounding: 6e-5 at alpha = 1.001)
        zg = tl.exp(tl.log(tl.where(den > 0, den, 1.0)) * (r - 2.0))
    if NORMALISED or (THRESHOLD_EXP != 0):
        # First pass: delta_i, stored for the dk/dv kernel. Normalised maps: sum_j w_ij dp_ij with w = a / D by
        # true division; sparse maps: the Jacobian's mean term sum_j g_ij dp_ij / sum_j g_ij. Computed from the
        # same dp as the second pass, a row with one visible key (or a one-key support) gets ds = 0 exactly.
        # Flash attention's shortcut do . out rounds out first, and squared, symax and softpick amplify that
        # rounding by up to 1/|s| when the scores are near 0.
        den1 = tl.where(den != 0, den, 1.0)
        delta = tl.zeros([BLOCK_M], tl.float32)
        gsum = tl.zeros([BLOCK_M], tl.float32)
        ent = tl.zeros([BLOCK_M], tl.float32)  # alpha-entmax: H = sum_j p_j ln p_j
        for start_n in range(0, hi, BLOCK_N):
            live = 1
            if HAS_MASK:
                live = tl.load(t_ptr + (start_n // BLOCK_N) * stn)
            if live != 0:
                offs_n = start_n + offs_n0
                s, keep, kt, capd = _score_block(q, kt_ptrs + start_n * skn, keep_ptrs + start_n * smn, offs_m, offs_n,
                                           m_valid, d_valid, score_scale,
                                       LK, CAUSAL, HAS_MASK, PREC, UPCAST,
                    b, h, BIAS, sbb, sbh, sbm, sbn, SLOPES, CAP, QOFF, HAS_BIAS, HAS_ALIBI, HAS_CAP)
                vt = tl.load(vt_ptrs + start_n * svn, mask=dv_valid[:, None] & (offs_n[None, :] < LK),
                             other=0.0).to(tl.float32)
                dp = tl.dot(do, vt, input_precision=PREC)
                if THRESHOLD_EXP == -1:
                    s = (s - mrow[:, None]) * am1[:, None]
                if NORMALISED:
                    a, _b = _entry(s, r, keep, shift, MAP, RUNNING_SHIFT, THRESHOLD_EXP)
                    delta += tl.sum(a / den1[:, None] * dp, 1)
                else:
                    a, g, _db = _slopes(s, r, keep, shift, MAP, RUNNING_SHIFT, THRESHOLD_EXP)
                    delta += tl.sum(g * dp, 1)
                    gsum += tl.sum(g, 1)
                    if THRESHOLD_EXP == -1:
                        pa = a * inv[:, None]
                        ent += tl.sum(tl.where(pa > 0, pa * tl.log(tl.where(pa > 0, pa, 1.0)), 0.0), 1)
        if THRESHOLD_EXP != 0:
            delta = tl.where(gsum > 0, delta / tl.where(gsum > 0, gsum, 1.0), 0.0)
        tl.store(DELTA + row, delta, mask=m_valid)
    for start_n in range(0, hi, BLOCK_N):
        live = 1
        if HAS_MASK:
            live = tl.load(t_ptr + (start_n // BLOCK_N) * stn)
        if live != 0:
            offs_n = start_n + offs_n0
            s, keep, kt, capd = _score_block(q, kt_ptrs + start_n * skn, keep_ptrs + start_n * smn, offs_m, offs_n,
                                       m_valid, d_valid, score_scale,
                                       LK, CAUSAL, HAS_MASK, PREC, UPCAST,
                b, h, BIAS, sbb, sbh, sbm, sbn, SLOPES, CAP, QOFF, HAS_BIAS, HAS_ALIBI, HAS_CAP)
            vt = tl.load(vt_ptrs + start_n * svn, mask=dv_valid[:, None] & (offs_n[None, :] < LK),
                         other=0.0).to(tl.float32)
            dp = tl.dot(do, vt, input_precision=PREC)
            if THRESHOLD_EXP == -1:
                s = (s - mrow[:, None]) * am1[:, None]
            a, da, db = _slopes(s, r, keep, shift, MAP, RUNNING_SHIFT, THRESHOLD_EXP)
            if NORMALISED:
                ds = (da * dp - db * delta[:, None]) * inv[:, None]
            elif (THRESHOLD_EXP == 1) | (THRESHOLD_EXP == 2):
                ds = da * (dp - delta[:, None])
            elif THRESHOLD_EXP == -1:
                ds = da * zg[:, None] * (dp - delta[:, None])
            else:
                ds = da * dp
            if ROW_VALUE_IN_SCORE:  # weight(s + r) (maps.py): d/dr = sum_j ds_j
                dr += tl.sum(ds, 1)
            if ROW_VALUE_FACTOR:  # weight(s, r) = r weight(s, 1) (maps.py): d/dr = sum_j weight(s_j, 1) dp_j
                a1, _b1 = _entry(s, r * 0.0 + 1.0, keep, shift, MAP, RUNNING_SHIFT, THRESHOLD_EXP)
                dr += tl.sum(a1 * dp, 1)
            if ROW_VALUE_EXPONENT:  # |s|^|r| (power): d/dp of a_j / D is a_j ln|s_j| (dp_j - delta) / D; ln|s|
                # centred at the row's largest (shift / p), which sum_j a_j (dp_j - delta) = 0 allows, against rounding
                mag = tl.abs(s)
                centre = shift / tl.maximum(tl.abs(r), 1.0)  # (|r| = p >= 1; 0 on rows past Lq)
                lg = tl.where(a > 0, tl.log(tl.where(a > 0, mag, 1.0)) - centre[:, None], 0.0)
                dr += tl.sum(a * lg * (dp - delta[:, None]), 1) * inv
            if THRESHOLD_EXP == -1:
                pa = a * inv[:, None]
                pt = da / tl.where(gsum > 0, gsum, 1.0)[:, None]
                plp = tl.where(pa > 0, pa * tl.log(tl.where(pa > 0, pa, 1.0)), 0.0)
                coef = ((pa - pt) / am1[:, None] - (plp - pt * ent[:, None])) / am1[:, None]
                dr += tl.sum(coef * (dp - delta[:, None]), 1)
            if HAS_DBIAS:
                ds = tl.where(keep, ds, 0.0)
                db_ptr = DBIAS + b * sdb + h * sdh
                if DB_BM and DB_BN:
                    tl.atomic_add(db_ptr, tl.sum(tl.sum(ds, 1), 0))
                elif DB_BM:
                    tl.atomic_add(db_ptr + offs_n * sdn, tl.sum(ds, 0), mask=offs_n < LK)
                elif DB_BN:
                    tl.atomic_add(db_ptr + offs_m * sdm, tl.sum(ds, 1), mask=m_valid)
                else:
                    tl.atomic_add(db_ptr + offs_m[:, None] * sdm + offs_n[None, :] * sdn, ds,
                                  mask=m_valid[:, None] & (offs_n[None, :] < LK))
            if HAS_CAP:
                ds = ds * capd  # w.r.t. the capped score -> w.r.t. score_scale q k^T
            acc += tl.dot(ds, tl.trans(kt).to(tl.float32), input_precision=PREC)
    if DEN_ADDS_ROW_VALUE:  # r is added to the denominator (maps.py: den_offset)
        dr = -delta * inv
    if ROW_VALUE_EXPONENT:  # r = +-p (the sign marks single-key rows; their gradient is 0 anyway)
        dr = tl.where(r < 0, -dr, dr)
    tl.store(DQ + row[:, None] * DH + offs_d[None, :], acc * score_scale[:, None],
             mask=m_valid[:, None] & d_valid[None, :])
    tl.store(DSCORE_SCALE + row, tl.sum(q.to(tl.float32) * acc, 1), mask=m_valid)
    tl.store(DR + row, dr, mask=m_valid)


def _bwd_dkdv_kernel(
    Q, K, V, SCORE_SCALE, R, KEEP, TABLE, SHIFT, DEN, DELTA, DO, DK, DV_OUT,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, scb, sch, scm,
    smb, smh, smm, smn, stb, sth, stm, stn,
    H, HKV, GROUPS, LQ, LK, DH, DV, ROWMAX,
    BIAS, SLOPES, sbb, sbh, sbm, sbn, CAP, QOFF,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_CAP: tl.constexpr,
    MAP: tl.constexpr, NORMALISED: tl.constexpr, RUNNING_SHIFT: tl.constexpr, THRESHOLD_EXP: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One program per (key block, batch x kv head), looping over the GROUPS query heads that share the kv head:
    DK [B, Hkv, Lk, D] and DV_OUT [B, Hkv, Lk, Dv] (fp32)."""
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1)
    b = (pid_bk // HKV).to(tl.int64)
    hk = pid_bk % HKV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_valid = offs_n < LK
    d_valid = offs_d < DH
    dv_valid = offs_dv < DV
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
                mask=n_valid[:, None] & d_valid[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                mask=n_valid[:, None] & dv_valid[None, :], other=0.0).to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M  # first query block holding a query i >= this block's keys
    for g in range(GROUPS):
        h = hk * GROUPS + g
        row0 = (b * H + h) * LQ
        q_ptrs = Q + b * sqb + h * sqh + offs_m0[:, None] * sqm + offs_d[None, :] * sqd
        keep_ptrs = KEEP + b * smb + h * smh + offs_m0[:, None] * smm + offs_n[None, :] * smn
        t_ptr = TABLE + b * stb + h * sth + pid_n * stn
        for start_m in range(lo, LQ, BLOCK_M):
            live = 1
            if HAS_MASK:
                live = tl.load(t_ptr + (start_m // BLOCK_M) * stm)
            if live != 0:
                offs_m = start_m + offs_m0
                m_valid = offs_m < LQ
                row = row0 + offs_m
                q = tl.load(q_ptrs + start_m * sqm, mask=m_valid[:, None] & d_valid[None, :],
                            other=0.0)
                if UPCAST:
                    q = q.to(tl.float32)
                score_scale = tl.load(SCORE_SCALE + b * scb + h * sch + offs_m * scm, mask=m_valid, other=0.0)
                r = tl.load(R + b * scb + h * sch + offs_m * scm, mask=m_valid, other=0.0)
                shift = tl.load(SHIFT + row, mask=m_valid, other=0.0)
                den = tl.load(DEN + row, mask=m_valid, other=0.0)
                inv = tl.where(den != 0, 1.0 / tl.where(den != 0, den, 1.0), 0.0)
                delta = tl.load(DELTA + row, mask=m_valid, other=0.0)
                do = tl.load(DO + row[:, None] * DV + offs_dv[None, :], mask=m_valid[:, None] & dv_valid[None, :],
                             other=0.0)
                s = tl.dot(q, tl.trans(k), input_precision=PREC) * score_scale[:, None]
                s, capd = _mods(s, b, h, offs_m, offs_n, m_valid, n_valid, BIAS, sbb, sbh, sbm, sbn, SLOPES, CAP,
                                QOFF, HAS_BIAS, HAS_ALIBI, HAS_CAP)
                keep = m_valid[:, None] & n_valid[None, :]
                if CAUSAL:
                    keep = keep & (offs_n[None, :] <= offs_m[:, None])
                if HAS_MASK:
                    keep = keep & (tl.load(keep_ptrs + start_m * smm, mask=keep, other=0) != 0)
                if THRESHOLD_EXP == -1:
                    s = (s - tl.load(ROWMAX + row, mask=m_valid, other=0.0)[:, None]) * (r - 1.0)[:, None]
                a, da, db = _slopes(s, r, keep, shift, MAP, RUNNING_SHIFT, THRESHOLD_EXP)
                dp = tl.dot(do, tl.trans(v), input_precision=PREC)
                if NORMALISED:
                    w = a * inv[:, None]
                    ds = (da * dp - db * delta[:, None]) * inv[:, None]
                elif THRESHOLD_EXP == -1:  # renormalised by Z, as the forward (and g, see the dq kernel)
                    w = a * inv[:, None]
                    ds = da * tl.exp(tl.log(tl.where(den > 0, den, 1.0)) * (r - 2.0))[:, None] * (dp - delta[:, None])
                elif (THRESHOLD_EXP == 1) | (THRESHOLD_EXP == 2):
                    w = a
                    ds = da * (dp - delta[:, None])
                else:
                    w = a
                    ds = da * dp
                dv += tl.dot(tl.trans(w), do, input_precision=PREC)
                if HAS_CAP:
                    ds = ds * capd
                dk += tl.dot(tl.trans(ds * score_scale[:, None]), q.to(tl.float32), input_precision=PREC)
    out_row = pid_bk.to(tl.int64) * LK + offs_n
    tl.store(DK + out_row[:, None] * DH + offs_d[None, :], dk, mask=n_valid[:, None] & d_valid[None, :])
    tl.store(DV_OUT + out_row[:, None] * DV + offs_dv[None, :], dv, mask=n_valid[:, None] & dv_valid[None, :])


_JIT_FUNCTIONS = ("_entry", "_slopes", "_tanh", "_mods", "_score_block", "_threshold_kernel", "_fwd_kernel",
                  "_bwd_dq_kernel", "_bwd_dkdv_kernel")
_HELPERS = ("_entry", "_slopes", "_tanh", "_mods", "_score_block")
_MAP_FUNCTIONS = ("_map_weight", "_map_slope")
_COMPILED: dict[tuple[bool, str], types.SimpleNamespace] = {}


def _map_functions(table: tuple[FusedMap, ...]) -> dict[str, Any]:
    """``_map_weight`` and ``_map_slope`` for the map table ``table``: the Python functions of
    ``maps.triton_source(table)``, compiled from a source registered with linecache (triton.jit reads a
    function's source through inspect)."""
    src = triton_source(table)
    filename = f"<hf_attnorm fused maps {hashlib.sha1(src.encode()).hexdigest()[:12]}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
    namespace: dict[str, Any] = {"tl": tl, "__name__": __name__}  # (the compiler reads a function's module)
    exec(compile(src, filename, "exec"), namespace)  # noqa: S102  (source generated from maps.py's declarations)
    return {name: namespace[name] for name in _MAP_FUNCTIONS}


def _compiled(table: tuple[FusedMap, ...] = MAPS) -> types.SimpleNamespace:
    """The jitted kernels for the current mode (compiled or interpreted) and the map table ``table`` (default
    ``maps.MAPS``), built once per mode and table.

    triton decides compiled vs interpreted when ``triton.jit`` runs, and the interpreter writes its helpers into the
    function's globals; so each mode gets its own namespace holding its own jitted copies, which resolve each
    other by name. The per-entry code of the table's maps comes in as ``_map_weight`` / ``_map_slope``
    (``_map_functions``), called by ``_entry`` and ``_slopes``.
    """
    _load_triton()
    mode = jit_interprets()
    key = (mode, table_key(table))
    if key not in _COMPILED:
        constants = dict(TINY=tl.constexpr(TINY), POW_NEG=tl.constexpr(POW_NEG))  # jitted code reads constexprs only
        source = {**globals(), **_map_functions(table)}
        _COMPILED[key] = jit_namespace(source, _MAP_FUNCTIONS + _JIT_FUNCTIONS, _MAP_FUNCTIONS + _HELPERS, mode,
                                       constants)
    return _COMPILED[key]


def jit_namespace(module_globals: dict[str, Any], names: tuple[str, ...], helpers: tuple[str, ...], mode: bool,
                  extra: dict[str, Any] | None = None) -> types.SimpleNamespace:
    """Jitted copies of the functions ``names`` of a kernel module (its ``globals()``, with ``tl`` bound), in one
    namespace of their own for ``mode`` (True: interpreted), where they resolve each other by name; ``extra``
    adds globals (constexprs). Shared by the Triton kernel modules (this one, stick-breaking, selective)."""
    ns: dict[str, Any] = dict(module_globals)
    ns.update(extra or {})
    for name in names:
        raw = module_globals[name]
        fn = types.FunctionType(raw.__code__, ns, name, raw.__defaults__)
        fn.__module__, fn.__qualname__, fn.__doc__ = raw.__module__, raw.__qualname__, raw.__doc__
        # the compiled launcher reads which parameters are tl.constexpr from the annotations (the interpreter does
        # not): a FunctionType built from the code object has none until they are copied
        fn.__annotations__ = dict(raw.__annotations__)
        fn.__kwdefaults__ = raw.__kwdefaults__
        ns[name] = triton.jit(fn)
        if mode and name in helpers:
            # interpreted: call device helpers as their rewritten Python functions; going through
            # InterpretedFunction.__call__ re-patches triton.language on every call (~2 ms each)
            ns[name] = ns[name].rewrite()
    return types.SimpleNamespace(**{name: ns[name] for name in names})


# ------------------------------------------------------------------------------------------------------ host code


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(x: int) -> int:
    return max(16, 1 << max(0, math.ceil(math.log2(max(x, 1)))))


def block_sizes(device: torch.device, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): 64 x 64 on GPUs (32 keys for head_dim > 64, to bound registers), 32 x 32 interpreted."""
    if BLOCK_OVERRIDE is not None:
        return BLOCK_OVERRIDE
    if device.type != "cuda":
        return 32, 32
    return 64, (32 if head_dim > 64 else 64)


def block_table(keep: torch.Tensor, lq: int, lk: int, bm: int, bn: int) -> torch.Tensor:
    """uint8 [Bm, Hm, ceil(Lq/bm), ceil(Lk/bn)]: 1 where a [query block, key block] has a visible key.

    keep: bool [Bm, Hm, Lq or 1, Lk]."""
    bsz, hsz = keep.shape[:2]
    full = keep.expand(bsz, hsz, lq, lk)
    nq, nk = _cdiv(lq, bm), _cdiv(lk, bn)
    padded = torch.nn.functional.pad(full, (0, nk * bn - lk, 0, nq * bm - lq))
    return padded.view(bsz, hsz, nq, bm, nk, bn).any(dim=5).any(dim=3).to(torch.uint8).contiguous()


def _strides4(t: torch.Tensor) -> list[int]:
    return [0 if t.shape[i] == 1 else t.stride(i) for i in range(4)]


class _Plan:
    """Everything about one call that is not a differentiable tensor: mask, sizes, launch constants."""

    def __init__(self, call: AttnCall, table: tuple[FusedMap, ...] = MAPS) -> None:
        q, k, v = call.q, call.k, call.v
        self.B, self.H, self.LQ, self.DH = q.shape
        self.HKV, self.LK, self.DV = k.shape[1], k.shape[2], v.shape[-1]
        self.groups = self.H // self.HKV
        self.name = call.normalizer.fused_map
        #: the map table the kernels are built for (``maps.MAPS``; tests pass others)
        self.maps = table
        by_name = {m.name: m for m in table}
        if self.name not in by_name:
            raise KeyError(f"no fused kernel map {self.name!r} (maps: {', '.join(by_name)})")
        self.fmap = by_name[self.name]
        self.map_id = self.fmap.kernel_id
        self.normalised = self.fmap.normalised
        #: the threshold search's form (FusedMap.threshold_exponent; -1: alpha-entmax's, from the row value)
        self.threshold_exp = -1 if self.fmap.dispatch == "alpha" else self.fmap.threshold_exponent
        self.bm, self.bn = block_sizes(q.device, self.DH)
        self.bd, self.bdv = _pow2(self.DH), _pow2(self.DV)
        keep = call.mask.keep
        self.causal = keep is None and call.mask.causal and self.LQ > 1
        if keep is None:
            self.keep = torch.zeros(1, dtype=torch.uint8, device=q.device)
            self.table = self.keep
            self.mask_strides = [0, 0, 0, 0]
            self.table_strides = [0, 0, 0, 0]
        else:
            k8 = keep.to(q.device).view(torch.uint8) if keep.dtype == torch.bool else keep.to(torch.uint8)
            self.keep = k8
            self.mask_strides = _strides4(k8)
            self.table = block_table(keep.to(q.device), self.LQ, self.LK, self.bm, self.bn)
            self.table_strides = _strides4(self.table)
        # fp32 inputs: exact fp32 products unless the user allowed TF32 for matmuls, as torch does
        self.prec = "tf32" if (q.is_cuda and torch.backends.cuda.matmul.allow_tf32) else "ieee"
        # triton 3.9's interpreter computes tl.dot on bf16 operands wrongly: upcast there (GPUs use bf16 as is)
        self.upcast = q.dtype == torch.bfloat16 and jit_interprets()
        # score modifiers (the bias itself is a differentiable input of _TritonAttention)
        self.cap = call.softcap
        self.slopes = (None if call.alibi_slopes is None
                       else call.alibi_slopes.detach().to(device=q.device, dtype=torch.float32).contiguous())

    def mods(self, kernel: Any, bias: torch.Tensor | None, dbias: torch.Tensor | None = None) -> dict[str, Any]:
        """The score-modifier arguments of ``kernel`` (by name; absent ones point at a dummy tensor)."""
        dummy = self.keep
        bs = _strides4(bias) if bias is not None else [0, 0, 0, 0]
        kw: dict[str, Any] = dict(
            BIAS=dummy if bias is None else bias, SLOPES=dummy if self.slopes is None else self.slopes,
            sbb=bs[0], sbh=bs[1], sbm=bs[2], sbn=bs[3], CAP=1.0 if self.cap is None else self.cap,
            QOFF=self.LK - self.LQ, HAS_BIAS=bias is not None, HAS_ALIBI=self.slopes is not None,
            HAS_CAP=self.cap is not None)
        if "DBIAS" in kernel.arg_names:
            ds = _strides4(dbias) if dbias is not None else [0, 0, 0, 0]
            kw.update(DBIAS=dummy if dbias is None else dbias, sdb=ds[0], sdh=ds[1], sdm=ds[2], sdn=ds[3],
                      HAS_DBIAS=dbias is not None, DB_BM=dbias is not None and dbias.shape[2] == 1,
                      DB_BN=dbias is not None and dbias.shape[3] == 1)
        return kw

    def common(self, q, k, v, score_scale) -> list:
        return [*_strides4(q), *_strides4(k), *_strides4(v), *score_scale.stride()[:3], *self.mask_strides,
                *self.table_strides]

    def consts(self) -> dict[str, Any]:
        return dict(map_constants(self.fmap), MAP=self.map_id, CAUSAL=self.causal, HAS_MASK=self.table.dim() == 4,
                    PREC=self.prec, UPCAST=self.upcast, BLOCK_M=self.bm, BLOCK_N=self.bn, BLOCK_D=self.bd,
                    BLOCK_DV=self.bdv)


def map_constants(fmap: FusedMap) -> dict[str, Any]:
    """The compile-time constants that carry map ``fmap``'s declaration (maps.py) into the kernels."""
    return dict(MAP=fmap.kernel_id, NORMALISED=fmap.normalised, DEN_ADDS_ROW_VALUE=fmap.den_offset is not None,
                ROW_VALUE_FACTOR=fmap.row_value_factor, RUNNING_SHIFT=SHIFT_IDS[fmap.shift],
                THRESHOLD_EXP=-1 if fmap.dispatch == "alpha" else fmap.threshold_exponent,
                ROW_VALUE_IN_SCORE=fmap.row_value_in_score, ROW_VALUE_EXPONENT=fmap.row_value_exponent)


def check_map(map_id: int, table: tuple[FusedMap, ...] = MAPS) -> None:
    """Refuses, before any launch, a map id that ``table`` (``maps.MAPS``) does not declare (ValueError naming the
    declared ids); the device code's generated per-entry chain ends in a ``static_assert`` as well."""
    if table is MAPS:
        lookup_id(map_id)
    elif map_id not in {m.kernel_id for m in table}:
        known = ", ".join(f"{m.kernel_id} ({m.name})" for m in table)
        raise ValueError(f"unknown fused map id {map_id!r}: the declared ids are {known}")


def _only(consts: dict[str, Any], kernel: Any) -> dict[str, Any]:
    """The compile-time constants ``kernel`` takes."""
    return {k: v for k, v in consts.items() if k in kernel.arg_names}


def _grid_q(p: _Plan) -> tuple[int, int]:
    return (_cdiv(p.LQ, p.bm), p.B * p.H)


class _TritonAttention(torch.autograd.Function):
    """(q, k, v, score_scale, row_value, bias) -> out [B, H, Lq, Dv] fp32; score_scale (the device code's
    SCORE_SCALE: base scaling x the per-query multiplier) and row_value (R: the map's per-row value,
    ``maps.FusedMap.row_value``): fp32 [B, H, Lq]; bias: fp32 [B|1, H|1, Lq|1, Lk|1] or None (its gradient comes
    back in that shape)."""

    @staticmethod
    def forward(ctx, q, k, v, score_scale, row_value, bias, plan: _Plan):
        check_map(plan.map_id, plan.maps)
        kern = _compiled(plan.maps)
        dev = q.device
        rows = (plan.B, plan.H, plan.LQ)
        out = torch.empty(*rows, plan.DV, dtype=torch.float32, device=dev)
        den = torch.empty(rows, dtype=torch.float32, device=dev)
        shift = torch.zeros(rows, dtype=torch.float32, device=dev)
        # alpha-entmax's row max M of the scores (written by the threshold kernel); other maps never read it and get
        # score_scale, which no kernel writes (Triton's interpreter copies each pointer argument back after a kernel,
        # so a dummy aliasing an output would overwrite it)
        rowmax = torch.zeros(rows, dtype=torch.float32, device=dev) if plan.threshold_exp == -1 else score_scale
        common = plan.common(q, k, v, score_scale)
        cst = plan.consts()
        grid = _grid_q(plan)
        if plan.name in THRESHOLD:
            # threshold kernel takes no V strides
            launch(kern._threshold_kernel, grid)(
                q, k, score_scale, plan.keep, plan.table, shift, *common[:8], *common[12:], plan.H, plan.groups,
                plan.LQ, plan.LK, plan.DH, row_value, rowmax, STEPS=THRESHOLD_STEPS,
                **_only(cst, kern._threshold_kernel), **plan.mods(kern._threshold_kernel, bias))
        launch(kern._fwd_kernel, grid)(q, k, v, score_scale, row_value, plan.keep, plan.table, shift, out, den, shift,
                                       *common, plan.H, plan.groups, plan.LQ, plan.LK, plan.DH, plan.DV, rowmax,
                                       **_only(cst, kern._fwd_kernel), **plan.mods(kern._fwd_kernel, bias))
        ctx.save_for_backward(q, k, v, score_scale, row_value, bias, den, shift, rowmax)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, score_scale, row_value, bias, den, shift, rowmax = ctx.saved_tensors
        plan: _Plan = ctx.plan
        kern = _compiled(plan.maps)
        dev = q.device
        do = dout.to(torch.float32).contiguous()
        common = plan.common(q, k, v, score_scale)
        cst = plan.consts()
        grid = _grid_q(plan)
        delta = torch.zeros_like(den)  # written by the dq kernel (normalised and sparse maps)
        dq = torch.empty(plan.B, plan.H, plan.LQ, plan.DH, dtype=torch.float32, device=dev)
        dscore_scale = torch.empty_like(den)
        drow_value = torch.empty_like(den)
        dbias = torch.zeros(bias.shape, dtype=torch.float32, device=dev) if ctx.needs_input_grad[5] else None
        launch(kern._bwd_dq_kernel, grid)(
            q, k, v, score_scale, row_value, plan.keep, plan.table, shift, den, delta, do, dq, dscore_scale,
            drow_value, *common, plan.H, plan.groups, plan.LQ, plan.LK, plan.DH, plan.DV, rowmax,
            **_only(cst, kern._bwd_dq_kernel), **plan.mods(kern._bwd_dq_kernel, bias, dbias))
        dk = torch.empty(plan.B, plan.HKV, plan.LK, plan.DH, dtype=torch.float32, device=dev)
        dv = torch.empty(plan.B, plan.HKV, plan.LK, plan.DV, dtype=torch.float32, device=dev)
        launch(kern._bwd_dkdv_kernel, (_cdiv(plan.LK, plan.bn), plan.B * plan.HKV))(
            q, k, v, score_scale, row_value, plan.keep, plan.table, shift, den, delta, do, dk, dv, *common,
            plan.H, plan.HKV, plan.groups, plan.LQ, plan.LK, plan.DH, plan.DV, rowmax,
            **_only(cst, kern._bwd_dkdv_kernel), **plan.mods(kern._bwd_dkdv_kernel, bias))
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dscore_scale if ctx.needs_input_grad[3] else None,
                drow_value if ctx.needs_input_grad[4] else None, dbias, None)


def _row_values(call: AttnCall, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """score_scale = base x multiplier and row_value = the normalizer's row value, both [B, H, Lq] fp32
    (autograd-connected to the per-head parameters and scale factors they come from)."""
    B, H, LQ = call.q.shape[:3]
    dev = call.q.device
    if call.multiplier is None:
        score_scale = torch.full((B, H, LQ), float(call.base), dtype=dtype, device=dev)
    else:
        score_scale = (call.multiplier.to(dtype) * call.base).expand(B, H, LQ).contiguous()
    row_value = call.row_value(dtype)
    if row_value is None:
        row_value = torch.zeros((), dtype=dtype, device=dev)
    return score_scale, row_value.expand(B, H, LQ).contiguous()


_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=4)


def takes(norm: Normalizer) -> str | None:
    """The normalizers with a fused map and no q/k transform (``maps.fused_takes``)."""
    reason = fused_takes(norm, "Triton")
    return reason


def accepts(call: AttnCall) -> str | None:
    """None, or why not: weights requested, dropout > 0 (the weights are never formed), fp64, empty inputs, CPU
    tensors without Triton's interpreter, triton missing (one-time warning on CUDA) or imported before
    ``TRITON_INTERPRET`` changed (one-time warning)."""
    q, k, v = call.q, call.k, call.v
    if call.sinks is not None:  # the chunked path applies them
        return "the Triton kernels do not apply attention sinks (s_aux)"
    if call.need_weights or call.dropout > 0:
        return "the Triton kernels never form the weights (no output_attentions, no dropout on weights)"
    if not (q.is_cuda or (q.device.type == "cpu" and interpreter_requested())):
        return (f"Triton kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter "
                f"(TRITON_INTERPRET=1, set before triton is imported); got device {q.device}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {q.dtype}: the Triton kernels take float32, float16 and bfloat16"
    if not (k.device == v.device == q.device) or q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return "q, k, v on different devices, or empty"
    if not triton_installed():
        _warn_once("no-triton", "hf_attnorm: triton is not installed, so the Triton fast path is unavailable "
                                "(pip install triton); another path is used")
        return "triton is not installed (pip install triton)"
    _load_triton()
    if not interpreter_consistent():
        msg = ("TRITON_INTERPRET changed after triton was imported (triton fixes interpreted vs compiled mode at "
               "import); set TRITON_INTERPRET=1 in the environment before anything imports triton")
        _warn_once("interp", f"hf_attnorm: {msg}; the Triton path is skipped")
        return msg
    return None


def triton_attention(call: AttnCall) -> tuple[torch.Tensor, None]:
    """out [B, H, Lq, Dv] (input dtype) for calls ``accepts`` takes."""
    q, k, v = call.q, call.k, call.v
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():  # launch on q's GPU
        plan = _Plan(call)
        score_scale, row_value = _row_values(call)
        bias = None if call.bias is None else compact_bias(call.bias.to(q.device), torch.float32)
        out = _TritonAttention.apply(q, k, v, score_scale, row_value, bias, plan)
    return out.to(q.dtype), None


from .. import register_path  # noqa: E402  (registration at import, like the normalizers)

# auto mode never tries this path on CPU tensors (the CPU paths own them); forced, it runs there under the
# interpreter
register_path("triton", triton_attention, takes=takes, accepts=accepts, priority=30, auto_exclude=("cpu",),
              traceable=False)  # (the host-side plan and the launches in an autograd.Function)
