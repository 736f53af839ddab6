"""GPU fast path ``triton``: flash-style Triton kernels (forward and backward) for the fused maps (symax, sigmoid,
squared, stablemax, softpick, softplus, relu_len, power, sparsemax, entmax-1.5, alpha-entmax). This module is the host
side; the device code is ``triton_device.py`` (its docstring says what the kernels compute and how they follow
FlashAttention-2) and the per-map entry code ``triton_maps.py`` (generated from ``maps.py``).

Per query row i the kernels take score_scale_i = base x multiplier (the per-query scale, with gradient) and r_i, the
map's row value (symax |eta_h|, sigmoid b_h - ln n_i, relu_len 1/n_i, alpha-entmax alpha_h ...). They never form an
n x n tensor: per query block they walk the key blocks, recompute s = score_scale_i (q_i . k_j) and accumulate

* sum-normalised maps: O_i = sum_j a(s_ij) v_j, D_i = r_i + sum_j b(s_ij), out = O / D (0 where D = 0); softpick,
  power and softplus keep a running shift and rescale O and D as flash attention does;
* non-normalised maps (sigmoid, relu_len): out_i = sum_j a(s_ij) v_j;
* threshold maps (sparsemax, entmax-1.5, alpha-entmax): a threshold kernel finds tau per row first (safeguarded
  Newton, one pass over the keys per step), then the forward accumulates the thresholded weights.

Backward (recompute): dp_ij = do_i . v_j; normalised ds = (a' dp - b' delta) / D, threshold ds = g (dp - delta),
non-normalised ds = a' dp; dq_i = score_scale_i sum_j ds_ij k_j, dk_j = sum_i score_scale_i ds_ij q_i,
dv_j = sum_i w_ij do_i, and the row value's and score scale's gradients per row. Two kernels: dq (per query block,
also writing delta where the map needs its own pass) and dk/dv (per key block and kv head, looping over the query
heads of its GQA group: no atomics).

Masks: none; causal (upper-left: key j visible to query i iff j <= i, MaskInfo's meaning of ``keep is None``); or a
boolean keep-mask of any pattern read blockwise with a block table (one byte per [query block, key block]) so blocks
without a visible key are skipped. Score modifiers: soft-cap, a bias read through its broadcast strides (gradient
summed into its own shape atomically), ALiBi slopes. Sinks are declined (``chunked`` applies them).

Launch configuration: on a GPU the kernels are autotuned over a small set of block sizes, warps and pipeline stages
per head size (``CONFIGS``; ``tuned_configs()`` lists what was chosen, the GPU check prints it); a keep-mask fixes
the blocks at ``MASKED_BLOCKS`` (the block tables are built for them) and tunes warps and stages only.
``HF_ATTNORM_TRITON_AUTOTUNE=0`` takes each kernel's first config without timing. Interpreted (CPU), 32 x 32 blocks;
``BLOCK_OVERRIDE`` sets (BLOCK_M, BLOCK_N) everywhere (the tests).

torch.compile: the launches are the custom ops ``hf_attnorm_triton::forward`` / ``backward`` (shape functions
registered, the backward wired by ``torch.library.register_autograd``), so a compiled model keeps this path; eager
calls take the same host code through an ``autograd.Function`` (no dispatcher round trip).

Dispatch: automatic on CUDA tensors. Forced (``path="triton"``), CPU tensors run too while Triton's interpreter is on
(``TRITON_INTERPRET=1``): that is how the tests run these kernels without a GPU. Triton is imported and the kernels
are jitted on first use (per interpreter mode), so importing this module needs no triton.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import sys
import tempfile
import types
import warnings
from pathlib import Path
from typing import Any

import torch

from ...normalizers.base import Normalizer
from .. import triton_common as tc
from ..base import AttnCall, compact_bias
from . import triton_device, triton_maps
from .maps import MAPS, FusedMap, fused_takes, lookup_id, table_key, triton_source

#: at most this many Newton passes for the sparse threshold (measured: sparsemax 3-5, entmax15 6-8, plus one max pass)
THRESHOLD_STEPS = 30

#: (BLOCK_M, BLOCK_N) override for every call (tests use small blocks so odd lengths cross block edges)
BLOCK_OVERRIDE: tuple[int, int] | None = None
#: (BLOCK_M, BLOCK_N) per kernel of calls with a keep-mask on a GPU: their block tables are built for these
#: (the dk/dv kernel's BLOCK_M is its inner query tile; 32 keeps its ptxas spills small at head dim 128)
MASKED_BLOCKS = {"_fwd_kernel": (64, 64), "_threshold_kernel": (64, 64), "_bwd_dq_kernel": (64, 64),
                 "_bwd_dkdv_kernel": (32, 64)}
#: interpreted (CPU) runs
INTERPRETED_BLOCKS = (32, 32)
#: the autotuned launch configurations per kernel and head size ("small": head dims <= 64, "large": above):
#: (BLOCK_M, BLOCK_N, num_warps, num_stages) (the dk/dv kernel: BLOCK_N keys per program, BLOCK_M queries per
#: step); the first is the default (HF_ATTNORM_TRITON_AUTOTUNE=0; a masked call keeps the warps and stages of every
#: config). Chosen from FlashAttention-2's and the Triton tutorial's Hopper settings by the registers and spills
#: that ptxas reports for sm_90 (docs/triton.md: ``python -m hf_attnorm.lab.speed.triton_ptx``): with a map's
#: elementwise work beside the products, the backward kernels keep smaller tiles than softmax's.
CONFIGS: dict[str, dict[str, tuple[tuple[int, int, int, int], ...]]] = {
    "_fwd_kernel": {"small": ((128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3), (128, 32, 4, 4)),
                    "large": ((128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3))},
    "_threshold_kernel": {"small": ((64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 4)),
                          "large": ((64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 3))},
    "_bwd_dq_kernel": {"small": ((64, 64, 8, 3), (128, 32, 8, 3), (64, 32, 4, 3), (128, 64, 8, 3)),
                       "large": ((64, 32, 8, 3), (64, 64, 8, 3), (32, 64, 4, 3))},
    "_bwd_dkdv_kernel": {"small": ((32, 128, 8, 3), (32, 64, 4, 3), (16, 64, 4, 3), (64, 128, 8, 3)),
                         "large": ((32, 32, 4, 3), (64, 64, 8, 3), (32, 64, 4, 3), (32, 128, 8, 3))},
}
#: the kernels' arguments the autotuner keys on beside the compile-time constants (lengths in powers of two)
TUNE_KEYS = ("DH", "DV", "LQ_KEY", "LK_KEY")
AUTOTUNE_ENV = "HF_ATTNORM_TRITON_AUTOTUNE"

#: the outputs and the gradients of q, k, v (and the score scale and row value) are bitwise reproducible: no
#: atomics outside the score-bias gradient (dk/dv: one program per key block and kv head). Read by
#: tests/test_gpu.py's determinism check (autotuning chooses once per shape, so repeated calls match).
DETERMINISTIC = True
# the shared Triton host helpers (re-exported: the tests and the other Triton modules read them here too)
TritonKernelError = tc.TritonKernelError
launch, describe_device, device_problem = tc.launch, tc.describe_device, tc.device_problem
kernel_name, triton_installed, interpreter_requested = tc.kernel_name, tc.triton_installed, tc.interpreter_requested
jit_interprets, interpreter_consistent, jit_namespace = tc.jit_interprets, tc.interpreter_consistent, tc.jit_namespace
_load_triton = tc.load
MIN_CAPABILITY, ESCAPE = tc.MIN_CAPABILITY, tc.ESCAPE
_cdiv, _pow2 = tc.cdiv, tc.pow2


def __getattr__(name: str) -> Any:
    """``triton`` / ``tl``: the modules ``triton_common.load()`` bound (None before it ran)."""
    if name in ("triton", "tl"):
        return getattr(tc, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------------------------- jitting


_MAP_FUNCTIONS = ("_map_weight", "_map_slope")
#: (interpreted, table key) -> the jitted kernels
_COMPILED: dict[tuple[bool, str], types.SimpleNamespace] = {}
#: table key -> the table (the custom ops name a table by its key)
_TABLES: dict[str, tuple[FusedMap, ...]] = {}


def _table_id(table: tuple[FusedMap, ...]) -> str:
    """A short name of ``table`` (its declarations' hash), registered so the custom ops can find it."""
    key = hashlib.sha1(table_key(table).encode()).hexdigest()[:16]
    _TABLES.setdefault(key, table)
    return key


def _map_module(table: tuple[FusedMap, ...]) -> Any:
    """The module holding ``_map_weight`` / ``_map_slope`` for ``table``: ``triton_maps`` for ``MAPS`` (checked
    in); for another table (tests declare maps of their own) its generated source written to a file in the temporary
    directory and imported from there, so the jitted code always has a file behind it."""
    if table is MAPS:
        return triton_maps
    src = triton_source(table)
    folder = Path(tempfile.gettempdir()) / "hf_attnorm_triton_maps"
    folder.mkdir(parents=True, exist_ok=True)
    name = f"hf_attnorm_triton_maps_{hashlib.sha1(src.encode()).hexdigest()[:16]}"
    path = folder / f"{name}.py"
    if not path.exists() or path.read_text() != src:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(src)
        tmp.replace(path)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def _autotune_on() -> bool:
    return os.environ.get(AUTOTUNE_ENV, "1").lower() not in ("0", "false", "no", "off")


def _prune(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    """Drop configs whose blocks are far larger than the call (a 128-row block for a 16-row call)."""
    args = {**named_args, **kwargs}
    lq, lk = args.get("LQ_KEY", 1 << 30), args.get("LK_KEY", 1 << 30)
    kept = [c for c in configs if c.kwargs.get("BLOCK_M", 0) <= max(16, lq) * 2
            and c.kwargs.get("BLOCK_N", 0) <= max(16, lk) * 2]
    return kept or [min(configs, key=lambda c: c.kwargs.get("BLOCK_M", 0) * c.kwargs.get("BLOCK_N", 0))]


def _tuned(kernel: Any, name: str, size: str, masked: bool) -> Any:
    """``kernel`` autotuned over ``CONFIGS[name][size]`` (masked: warps and stages only; the blocks are
    ``MASKED_BLOCKS``), keyed on the compile-time constants and ``TUNE_KEYS``."""
    consts = [p.name for p in kernel.params if p.is_constexpr and not p.name.startswith("BLOCK_")]
    key = [*(k for k in TUNE_KEYS if k in kernel.arg_names), *consts]
    configs = CONFIGS[name][size]
    if not _autotune_on():
        configs = configs[:1]
    if masked:
        pairs = list(dict.fromkeys((w, s) for _, _, w, s in configs))
        cfgs = [tc.triton.Config({}, num_warps=w, num_stages=s) for w, s in pairs]
        return tc.triton.autotune(cfgs, key=key, reset_to_zero=["DBIAS"] if "DBIAS" in kernel.arg_names else None)(
            kernel)
    cfgs = [tc.triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in configs]
    return tc.triton.autotune(cfgs, key=key, prune_configs_by={"early_config_prune": _prune},
                           reset_to_zero=["DBIAS"] if "DBIAS" in kernel.arg_names else None)(kernel)


def _compiled(table: tuple[FusedMap, ...] = MAPS) -> types.SimpleNamespace:
    """The jitted kernels for the current mode (compiled or interpreted) and the map table ``table`` (default
    ``maps.MAPS``), built once per mode and table: the device functions of ``triton_device`` and the table's
    per-entry functions, jitted into one namespace (``jit_namespace``); compiled kernels get their autotuned variants
    on first use (``tuned``)."""
    tc.load()
    mode = tc.jit_interprets()
    key = (mode, table_key(table))
    if key not in _COMPILED:
        triton_device.tl = tc.tl
        maps_module = _map_module(table)
        maps_module.tl = tc.tl
        functions = {**vars(triton_device), **{n: getattr(maps_module, n) for n in _MAP_FUNCTIONS}}
        ns = jit_namespace(functions, _MAP_FUNCTIONS + triton_device.JIT_FUNCTIONS,
                           _MAP_FUNCTIONS + tuple(n for n in triton_device.JIT_FUNCTIONS
                                                  if n not in triton_device.KERNELS), mode,
                           dict(TINY=tc.tl.constexpr(triton_device.TINY),
                                POW_NEG=tc.tl.constexpr(triton_device.POW_NEG)))
        ns.tuned = {}  # (kernel, head size, masked) -> its autotuner, built on first use (``tuned``)
        _COMPILED[key] = ns
    return _COMPILED[key]


def tuned(kern: types.SimpleNamespace, name: str, size: str, masked: bool) -> Any:
    """The autotuned variant of kernel ``name`` of a compiled namespace, built once (older triton sets up its GPU
    driver when an autotuner is made, so none is made before a GPU call needs it)."""
    key = (name, size, masked)
    if key not in kern.tuned:
        kern.tuned[key] = _tuned(getattr(kern, name), name, size, masked)
    return kern.tuned[key]


def tuned_configs() -> dict[str, dict[str, str]]:
    """What the autotuner chose so far, per kernel variant and key: {"_fwd_kernel small unmasked": {key: config}}
    (the GPU check prints and saves this, so good configs can be made the defaults in ``CONFIGS``)."""
    out: dict[str, dict[str, str]] = {}
    for ns in _COMPILED.values():
        for (name, size, masked), tuner in getattr(ns, "tuned", {}).items():
            cache = getattr(tuner, "cache", {})
            if cache:
                label = f"{name} {size} {'masked' if masked else 'unmasked'}"
                out.setdefault(label, {}).update({str(k): str(v) for k, v in cache.items()})
    return out


# ---------------------------------------------------------------------------------------------------- host code


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


def map_constants(fmap: FusedMap) -> dict[str, Any]:
    """The compile-time constants that carry map ``fmap``'s declaration (maps.py) into the kernels."""
    facts = fmap.facts()  # (maps.FACTS: the names the C++ header uses too)
    return dict(MAP=fmap.kernel_id, **{k: bool(v) if k == "NORMALISED" else v for k, v in facts.items()},
                DELTA_FROM_OUTPUT=fmap.delta_from_output)


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
    names = kernel.arg_names if hasattr(kernel, "arg_names") else kernel.fn.arg_names
    return {k: v for k, v in consts.items() if k in names}


class _Plan:
    """Everything about one call that is not a differentiable tensor: map, mask, sizes, launch constants.

    q, k, v: the call's tensors (shapes, dtype, device); keep: bool [B|1, H|1, Lq|1, Lk] or None; causal: no keep-mask
    and the call is causal; name: the fused map; table: the map table the kernels are built for (``maps.MAPS``;
    tests pass others); cap: the soft-cap or None; slopes: ALiBi slopes [H] or None; forget: the call adds forgetting
    attention's decay (its cumulative gates are differentiable inputs of the kernels)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, causal: bool,
                 name: str, table: tuple[FusedMap, ...] = MAPS, cap: float | None = None,
                 slopes: torch.Tensor | None = None, forget: bool = False) -> None:
        self.B, self.H, self.LQ, self.DH = q.shape
        self.HKV, self.LK, self.DV = k.shape[1], k.shape[2], v.shape[-1]
        self.groups = self.H // self.HKV
        self.name = name
        self.maps = table
        by_name = {m.name: m for m in table}
        if name not in by_name:
            raise KeyError(f"no fused kernel map {name!r} (maps: {', '.join(by_name)})")
        self.fmap = by_name[name]
        self.map_id = self.fmap.kernel_id
        self.normalised = self.fmap.normalised
        #: the threshold form's exponent (FusedMap.threshold_exponent: 1, 2, -1 for alpha-entmax's; 0 other forms)
        self.threshold_exp = self.fmap.threshold_exponent
        self.interpreted = not q.is_cuda
        self.size = "small" if max(self.DH, self.DV) <= 64 else "large"
        self.bd, self.bdv = _pow2(self.DH), _pow2(self.DV)
        self.causal = keep is None and causal and self.LQ > 1
        self.masked = keep is not None
        # blocks fixed for every kernel: the tests' override, the interpreter's (else per kernel: ``blocks``)
        self.fixed = BLOCK_OVERRIDE or (INTERPRETED_BLOCKS if self.interpreted else None)
        #: dummy tensor for absent pointer arguments (never written: the autotuner zeroes DBIAS between its runs)
        self.dummy = torch.zeros(1, dtype=torch.float32, device=q.device)
        #: block tables by (BLOCK_M, BLOCK_N), built on first use (``table``)
        self.tables: dict[tuple[int, int], torch.Tensor] = {}
        if keep is None:
            self.keep = torch.zeros(1, dtype=torch.uint8, device=q.device)
            self.mask_strides = [0, 0, 0, 0]
        else:
            k8 = keep.to(q.device).view(torch.uint8) if keep.dtype == torch.bool else keep.to(q.device, torch.uint8)
            if k8.stride(-1) != 1 and k8.shape[-1] != 1:
                k8 = k8.contiguous()
            self.keep = k8
            self.mask_strides = _strides4(k8)
        # fp32 inputs: exact fp32 products unless the user allowed TF32 for matmuls, as torch does
        self.prec = "tf32" if (q.is_cuda and torch.backends.cuda.matmul.allow_tf32) else "ieee"
        # triton 3.9's interpreter computes tl.dot on bf16 operands wrongly: upcast there (GPUs use bf16 as is)
        self.upcast = q.dtype == torch.bfloat16 and self.interpreted
        # bf16 on a GPU: a map's fast transcendental (triton_device: FAST); fp16 keeps the exact form, whose
        # rounding the fast one would double
        self.fast = q.dtype == torch.bfloat16 and not self.interpreted
        self.cap = cap
        self.slopes = None if slopes is None else slopes.detach().to(device=q.device,
                                                                      dtype=torch.float32).contiguous()
        self.forget = forget

    def mods(self, kernel: Any, bias: torch.Tensor | None, forget: tuple[torch.Tensor, torch.Tensor] | None,
             dbias: torch.Tensor | None = None) -> dict[str, Any]:
        """The score-modifier arguments of ``kernel`` (by name; absent ones point at a dummy tensor). forget: the
        cumulative log forget gates as (hi, lo) fp32 [B, H, Lk] contiguous, or None."""
        names = kernel.arg_names if hasattr(kernel, "arg_names") else kernel.fn.arg_names
        bs = _strides4(bias) if bias is not None else [0, 0, 0, 0]
        fhi, flo = forget if forget is not None else (self.dummy, self.dummy)
        kw: dict[str, Any] = dict(
            BIAS=self.dummy if bias is None else bias, SLOPES=self.dummy if self.slopes is None else self.slopes,
            sbb=bs[0], sbh=bs[1], sbm=bs[2], sbn=bs[3], CAP=1.0 if self.cap is None else self.cap,
            QOFF=self.LK - self.LQ, FHI=fhi, FLO=flo, sfb=self.H * self.LK, sfh=self.LK, sfn=1,
            HAS_BIAS=bias is not None, HAS_ALIBI=self.slopes is not None, HAS_CAP=self.cap is not None,
            HAS_FORGET=forget is not None, LQ_KEY=_pow2(self.LQ), LK_KEY=_pow2(self.LK))
        if "DBIAS" in names:
            ds = _strides4(dbias) if dbias is not None else [0, 0, 0, 0]
            kw.update(DBIAS=self.dummy if dbias is None else dbias, sdb=ds[0], sdh=ds[1], sdm=ds[2], sdn=ds[3],
                      HAS_DBIAS=dbias is not None, DB_BM=dbias is not None and dbias.shape[2] == 1,
                      DB_BN=dbias is not None and dbias.shape[3] == 1)
        return kw

    def table(self, blocks: dict[str, Any]) -> torch.Tensor:
        """The block table of the keep-mask for these blocks (a dummy without a mask)."""
        if not self.masked:
            return self.keep
        key = (blocks["BLOCK_M"], blocks["BLOCK_N"])
        if key not in self.tables:
            self.tables[key] = block_table(self.keep.bool(), self.LQ, self.LK, *key)
        return self.tables[key]

    def common(self, q, k, v, score_scale, table: torch.Tensor) -> list:
        return [*_strides4(q), *_strides4(k), *_strides4(v), *score_scale.stride()[:3], *self.mask_strides,
                *(_strides4(table) if self.masked else [0, 0, 0, 0])]

    def consts(self) -> dict[str, Any]:
        return dict(map_constants(self.fmap), MAP=self.map_id, CAUSAL=self.causal, HAS_MASK=self.masked,
                    PREC=self.prec, UPCAST=self.upcast, FAST=self.fast, EVEN_D=self.bd == self.DH,
                    EVEN_DV=self.bdv == self.DV, BLOCK_D=self.bd, BLOCK_DV=self.bdv)

    def kernel(self, kern: types.SimpleNamespace, name: str) -> tuple[Any, dict[str, Any], torch.Tensor]:
        """(the kernel to launch, the block sizes to pass, the block table for them): the plain jitted kernel with
        fixed blocks, or its autotuned variant (which sets the blocks itself, or, for a masked call whose blocks are
        ``MASKED_BLOCKS[name]``, warps and stages only)."""
        if self.fixed is not None:
            blocks = {"BLOCK_M": self.fixed[0], "BLOCK_N": self.fixed[1]}
            return getattr(kern, name), blocks, self.table(blocks)
        tuner = tuned(kern, name, self.size, self.masked)
        if not self.masked:
            return tuner, {}, self.keep
        blocks = {"BLOCK_M": MASKED_BLOCKS[name][0], "BLOCK_N": MASKED_BLOCKS[name][1]}
        return tuner, blocks, self.table(blocks)

    def grid(self, blocks: dict[str, Any], over_keys: bool = False) -> Any:
        """The launch grid: (query blocks, B x H), or (key blocks, B x Hkv) for the dk/dv kernel."""
        if over_keys:
            n, rows = self.LK, self.B * self.HKV
            return ((_cdiv(n, blocks["BLOCK_N"]), rows) if blocks
                    else lambda meta: (_cdiv(n, meta["BLOCK_N"]), rows))
        n, rows = self.LQ, self.B * self.H
        return (_cdiv(n, blocks["BLOCK_M"]), rows) if blocks else lambda meta: (_cdiv(n, meta["BLOCK_M"]), rows)


def _forward(plan: _Plan, q, k, v, score_scale, row_value, bias, forget=None):
    """(out [B, H, Lq, Dv] in q's dtype, den, shift, rowmax [B, H, Lq] fp32): the threshold kernel (threshold maps),
    then the forward kernel. forget: (hi, lo) of the cumulative log forget gates, or None."""
    check_map(plan.map_id, plan.maps)
    kern = _compiled(plan.maps)
    dev = q.device
    rows = (plan.B, plan.H, plan.LQ)
    out = torch.empty(*rows, plan.DV, dtype=q.dtype, device=dev)
    den = torch.empty(rows, dtype=torch.float32, device=dev)
    shift = torch.zeros(rows, dtype=torch.float32, device=dev)
    # alpha-entmax's row max M of the scores (written by the threshold kernel); other maps never read it. Its own
    # tensor either way (Triton's interpreter copies each pointer argument back after a kernel, so a dummy aliasing
    # an output would overwrite it)
    rowmax = torch.zeros(rows if plan.threshold_exp == -1 else (1,), dtype=torch.float32, device=dev)
    cst = plan.consts()
    if plan.fmap.form == "threshold":
        kernel, blocks, table = plan.kernel(kern, "_threshold_kernel")
        common = plan.common(q, k, v, score_scale, table)
        launch(kernel, plan.grid(blocks))(
            q, k, score_scale, plan.keep, table, shift, *common[:8], *common[12:], plan.H, plan.groups,
            plan.LQ, plan.LK, plan.DH, row_value, rowmax, STEPS=THRESHOLD_STEPS,
            **_only(cst, kernel), **plan.mods(kernel, bias, forget), **blocks)
    kernel, blocks, table = plan.kernel(kern, "_fwd_kernel")
    launch(kernel, plan.grid(blocks))(
        q, k, v, score_scale, row_value, plan.keep, table, shift, out, den, shift,
        *plan.common(q, k, v, score_scale, table), plan.H, plan.groups, plan.LQ, plan.LK, plan.DH, plan.DV, rowmax,
        **_only(cst, kernel), **plan.mods(kernel, bias, forget), **blocks)
    return out, den, shift, rowmax


def _backward(plan: _Plan, dout, q, k, v, score_scale, row_value, bias, out, den, shift, rowmax, bias_grad: bool,
              forget=None):
    """(dq, dk, dv in q's dtype, dscore_scale, drow_value [B, H, Lq] fp32, dbias fp32 in the bias's shape or None,
    dforget [B, H, Lk] fp32, the gradient of the cumulative log forget gates, or None)."""
    kern = _compiled(plan.maps)
    dev = q.device
    do = dout.to(q.dtype).contiguous()
    cst = plan.consts()
    if plan.fmap.delta_from_output:  # delta_i = dO_i . O_i (maps.py: delta_from_output)
        delta = (do.float() * out.float()).sum(-1).contiguous()
    else:  # written by the dq kernel (normalised and threshold maps)
        delta = torch.zeros_like(den)
    dq = torch.empty(plan.B, plan.H, plan.LQ, plan.DH, dtype=q.dtype, device=dev)
    dscore_scale = torch.empty_like(den)
    drow_value = torch.empty_like(den)
    dbias = torch.zeros(bias.shape, dtype=torch.float32, device=dev) if bias_grad else None
    dfrow = torch.empty_like(den) if forget is not None else plan.dummy
    dfcol = torch.empty(plan.B, plan.H, plan.LK, dtype=torch.float32, device=dev) if forget is not None else plan.dummy
    kernel, blocks, table = plan.kernel(kern, "_bwd_dq_kernel")
    launch(kernel, plan.grid(blocks))(
        q, k, v, score_scale, row_value, plan.keep, table, shift, den, delta, do, dq, dscore_scale, drow_value, dfrow,
        *plan.common(q, k, v, score_scale, table), plan.H, plan.groups, plan.LQ, plan.LK, plan.DH, plan.DV, rowmax,
        **_only(cst, kernel), **plan.mods(kernel, bias, forget, dbias), **blocks)
    dk = torch.empty(plan.B, plan.HKV, plan.LK, plan.DH, dtype=q.dtype, device=dev)
    dv = torch.empty(plan.B, plan.HKV, plan.LK, plan.DV, dtype=q.dtype, device=dev)
    kernel, blocks, table = plan.kernel(kern, "_bwd_dkdv_kernel")
    launch(kernel, plan.grid(blocks, over_keys=True))(
        q, k, v, score_scale, row_value, plan.keep, table, shift, den, delta, do, dk, dv, dfcol,
        *plan.common(q, k, v, score_scale, table), plan.H, plan.HKV, plan.groups, plan.LQ, plan.LK, plan.DH, plan.DV,
        rowmax, **_only(cst, kernel), **plan.mods(kernel, bias, forget), **blocks)
    dforget = None
    if forget is not None:  # each query's row sum goes to its own key p_i = clamp(Lk - Lq + i, 0, Lk - 1)
        pos = (torch.arange(plan.LQ, device=dev) + (plan.LK - plan.LQ)).clamp(0, plan.LK - 1)
        dforget = dfcol.index_add(-1, pos, dfrow)
    return dq, dk, dv, dscore_scale, drow_value, dbias, dforget


class _TritonAttention(torch.autograd.Function):
    """(q, k, v, score_scale, row_value, bias, plan, forget_hi, forget_lo) -> out [B, H, Lq, Dv] in q's dtype;
    score_scale (base scaling x the per-query multiplier) and row_value (the map's per-row value,
    ``maps.FusedMap.row_value``): fp32 [B, H, Lq]; bias: fp32 [B|1, H|1, Lq|1, Lk|1] or None (its gradient comes back
    in that shape); forget_hi / forget_lo: forgetting attention's cumulative log gates c [B, H, Lk] as an fp32 pair
    (hi = c rounded, lo = the rest; the gradient goes to hi) or None. The eager route; compiled models run the same
    ``_forward`` / ``_backward`` through the custom ops below."""

    @staticmethod
    def forward(ctx, q, k, v, score_scale, row_value, bias, plan: _Plan, forget_hi=None, forget_lo=None):
        forget = None if forget_hi is None else (forget_hi, forget_lo)
        out, den, shift, rowmax = _forward(plan, q, k, v, score_scale, row_value, bias, forget)
        ctx.save_for_backward(q, k, v, score_scale, row_value, bias, out, den, shift, rowmax, forget_hi, forget_lo)
        ctx.plan = plan
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, score_scale, row_value, bias, out, den, shift, rowmax, fhi, flo = ctx.saved_tensors
        forget = None if fhi is None else (fhi, flo)
        dq, dk, dv, dscore_scale, drow_value, dbias, dforget = _backward(
            ctx.plan, dout, q, k, v, score_scale, row_value, bias, out, den, shift, rowmax, ctx.needs_input_grad[5],
            forget)
        return (dq, dk, dv, dscore_scale if ctx.needs_input_grad[3] else None,
                drow_value if ctx.needs_input_grad[4] else None, dbias, None,
                dforget if forget is not None and ctx.needs_input_grad[7] else None, None)


# ----------------------------------------------------------------------------------------------- custom ops

OPS_NAMESPACE = "hf_attnorm_triton"


def _op_plan(q, k, v, keep, slopes, name: str, causal: bool, cap: float | None, table: str,
             forget: bool = False) -> _Plan:
    return _Plan(q, k, v, keep, causal, name, _TABLES[table], cap, slopes, forget)


@torch.library.custom_op(f"{OPS_NAMESPACE}::forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_scale: torch.Tensor,
                row_value: torch.Tensor, bias: torch.Tensor | None, keep: torch.Tensor | None,
                slopes: torch.Tensor | None, name: str, causal: bool, cap: float | None, table: str,
                forget_hi: torch.Tensor | None,
                forget_lo: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused Triton forward as one op: (out, den, shift, rowmax)."""
    plan = _op_plan(q, k, v, keep, slopes, name, causal, cap, table, forget_hi is not None)
    forget = None if forget_hi is None else (forget_hi, forget_lo)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        return _forward(plan, q, k, v, score_scale, row_value, bias, forget)


@_forward_op.register_fake
def _forward_fake(q, k, v, score_scale, row_value, bias, keep, slopes, name, causal, cap, table, forget_hi,
                  forget_lo):
    B, H, Lq = q.shape[:3]
    rows = q.new_empty((B, H, Lq), dtype=torch.float32)
    alpha = next(m for m in _TABLES[table] if m.name == name).threshold_exponent == -1
    return (q.new_empty((B, H, Lq, v.shape[-1])), rows, torch.empty_like(rows),
            torch.empty_like(rows) if alpha else q.new_empty((1,), dtype=torch.float32))


@torch.library.custom_op(f"{OPS_NAMESPACE}::backward", mutates_args=())
def _backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_scale: torch.Tensor,
                 row_value: torch.Tensor, bias: torch.Tensor | None, keep: torch.Tensor | None,
                 slopes: torch.Tensor | None, out: torch.Tensor, den: torch.Tensor, shift: torch.Tensor,
                 rowmax: torch.Tensor, name: str, causal: bool, cap: float | None, table: str,
                 bias_grad: bool, forget_hi: torch.Tensor | None,
                 forget_lo: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                          torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused Triton backward as one op: (dq, dk, dv, dscore_scale, drow_value, dbias, dforget; the last two
    empty tensors where absent)."""
    plan = _op_plan(q, k, v, keep, slopes, name, causal, cap, table, forget_hi is not None)
    forget = None if forget_hi is None else (forget_hi, forget_lo)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        dq, dk, dv, dscore, drow, dbias, dforget = _backward(plan, dout, q, k, v, score_scale, row_value, bias, out,
                                                             den, shift, rowmax, bias_grad, forget)
    empty = q.new_empty((0,), dtype=torch.float32)
    return (dq, dk, dv, dscore, drow, dbias if dbias is not None else empty,
            dforget if dforget is not None else empty)


@_backward_op.register_fake
def _backward_fake(dout, q, k, v, score_scale, row_value, bias, keep, slopes, out, den, shift, rowmax, name, causal,
                   cap, table, bias_grad, forget_hi, forget_lo):
    empty = q.new_empty((0,), dtype=torch.float32)
    dbias = q.new_empty(bias.shape, dtype=torch.float32) if bias_grad else empty
    dforget = torch.empty_like(forget_hi) if forget_hi is not None else empty
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), torch.empty_like(den),
            torch.empty_like(den), dbias, dforget)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, score_scale, row_value, bias, keep, slopes, name, causal, cap, table, fhi, flo = inputs
    out, den, shift, rowmax = output
    ctx.save_for_backward(q, k, v, score_scale, row_value, bias, keep, slopes, out, den, shift, rowmax, fhi, flo)
    ctx.facts = (name, causal, cap, table)


def _backward_autograd(ctx, dout, _dden, _dshift, _drowmax):
    q, k, v, score_scale, row_value, bias, keep, slopes, out, den, shift, rowmax, fhi, flo = ctx.saved_tensors
    bias_grad = bias is not None and ctx.needs_input_grad[5]
    dq, dk, dv, dscore, drow, dbias, dforget = _backward_op(dout, q, k, v, score_scale, row_value, bias, keep,
                                                            slopes, out, den, shift, rowmax, *ctx.facts, bias_grad,
                                                            fhi, flo)
    return (dq, dk, dv, dscore, drow, dbias if bias_grad else None, None, None, None, None, None, None,
            dforget if fhi is not None and ctx.needs_input_grad[12] else None, None)


torch.library.register_autograd(f"{OPS_NAMESPACE}::forward", _backward_autograd, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------------ the path


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
    return fused_takes(norm, "Triton")


def accepts(call: AttnCall) -> str | None:
    """None, or why not: weights requested, dropout > 0 (the weights are never formed), fp64, empty inputs, CPU
    tensors without Triton's interpreter, triton missing (one-time warning on CUDA) or imported before
    ``TRITON_INTERPRET`` changed (one-time warning)."""
    q, k, v = call.q, call.k, call.v
    if call.need_weights:
        return "the Triton kernels never form the weights (no output_attentions)"
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


#: the table id of ``MAPS`` (registered at import: the custom ops' callers pass it)
MAPS_ID = _table_id(MAPS)


def _forget_pair(call: AttnCall) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Forgetting attention's cumulative log gates c [B, H, Lk] (float64 in the call) as the kernels take them: hi =
    c in fp32 (autograd-connected to c), lo = c - hi in fp32 (a constant)."""
    if call.forget is None:
        return None
    c = call.forget.to(call.q.device)
    hi = c.to(torch.float32).contiguous()
    lo = (c.detach() - hi.detach().to(c.dtype)).to(torch.float32).contiguous()
    return hi, lo


def _attention(call: AttnCall, map_name: str) -> tuple[torch.Tensor, None]:
    """out [B, H, Lq, Dv] (input dtype) of a call on the map ``map_name``. Eager: ``_TritonAttention``; while
    torch.compile traces: the custom op ``hf_attnorm_triton::forward`` (the compiled graph calls the same kernels)."""
    q, k, v = call.q, call.k, call.v
    score_scale, row_value = _row_values(call)
    bias = None if call.bias is None else compact_bias(call.bias.to(q.device), torch.float32)
    keep = call.mask.keep
    causal = keep is None and call.mask.causal
    forget = _forget_pair(call)
    fhi, flo = forget if forget is not None else (None, None)
    if torch.compiler.is_compiling():
        out = _forward_op(q, k, v, score_scale, row_value, bias, keep, call.alibi_slopes, map_name, causal,
                          call.softcap, MAPS_ID, fhi, flo)[0]
        return out, None
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():  # launch on q's GPU
        plan = _Plan(q, k, v, keep, causal, map_name, MAPS, call.softcap, call.alibi_slopes, forget is not None)
        out = _TritonAttention.apply(q, k, v, score_scale, row_value, bias, plan, fhi, flo)
    return out, None


def triton_attention(call: AttnCall) -> tuple[torch.Tensor, None]:
    """out [B, H, Lq, Dv] (input dtype) for calls ``accepts`` takes, on the normalizer's fused map."""
    return _attention(call, call.normalizer.fused_map)


def takes_forget(norm: Normalizer) -> str | None:
    """Softmax with forget gates (forgetting attention's decay, ``Normalizer.forget_gates``), without a sink logit
    or a q/k transform: the kernels' "softmax" map with the decay in the score modifiers."""
    if norm.kernel_family != "softmax" or type(norm).forget_gates is Normalizer.forget_gates:
        return f"normalizer {norm.name!r} is not softmax with forget gates"
    if type(norm).sink_logit is not Normalizer.sink_logit:
        return f"normalizer {norm.name!r} has a sink logit, which the Triton kernels do not apply"
    if type(norm).transform_qk is not Normalizer.transform_qk or type(norm).feature_map is not Normalizer.feature_map:
        return f"normalizer {norm.name!r} transforms q/k, which the Triton kernels do not"
    return None


def accepts_forget(call: AttnCall) -> str | None:
    """``accepts``, for calls that carry forget gates (the others run SDPA)."""
    if call.forget is None:
        return "no forget gate on this call (softmax itself runs on SDPA)"
    return accepts(call)


def triton_forget_attention(call: AttnCall) -> tuple[torch.Tensor, None]:
    """out [B, H, Lq, Dv] (input dtype): softmax with forgetting attention's decay in the kernels, O(n) memory and no
    materialised bias, forward and backward (the gates' gradient from the row and column sums of dS)."""
    return _attention(call, "softmax")


from ..dispatch import register_path  # noqa: E402  (registration at import, like the normalizers)

# auto mode never tries this path on CPU tensors (the CPU paths own them); forced, it runs there under the
# interpreter
register_path("triton", triton_attention, takes=takes, accepts=accepts, priority=30, auto_exclude=("cpu",),
              supports=("softcap", "bias", "alibi"))
# before sdpa (10): SDPA's kernels take the decay only as a materialised bias; on a CPU its flash route is exact and
# O(n) already
register_path("triton_forget", triton_forget_attention, takes=takes_forget, accepts=accepts_forget, priority=8,
              auto_exclude=("cpu",), supports=("softcap", "bias", "alibi", "forget"))
