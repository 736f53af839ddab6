"""Ahead-of-time checks of the Triton kernels for a GPU, on any machine: each kernel is compiled for an NVIDIA target
(default sm_90: H100/H200) with the installed triton and its bundled ptxas (no GPU, no driver), and its PTX is read:
every product must run on tensor cores (``wgmma`` on sm_90, ``mma`` on sm_80) and no dot may have fallen back to a
loop of fp32 FMAs; ptxas reports registers and spills.

A dot that falls back to FMAs unrolls into about M x N x K / (32 x warps) ``fma.rn.f32`` per thread (2,048 for a
64 x 64 x 64 product on 4 warps), while a kernel whose dots all run on tensor cores keeps its FMAs to the map's
elementwise code: the check fails a kernel with more FMAs than half of its smallest dot's fallback would need, or
with fewer tensor-core instructions than dots.

    python -m hf_attnorm.lab.speed.triton_ptx                  # the kernel forms, bf16, sm_90: a table
    python -m hf_attnorm.lab.speed.triton_ptx --json out.json  # also the records

tests/test_triton_ptx.py runs it (CI, in the main environment and on the GPU image's triton).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from ...kernels.fused import maps, triton_device
from ...kernels.fused import triton as ta

#: one map per kernel form: non-normalised (sigmoid, its fast tanh), normalised with delta from its own pass (symax),
#: normalised with delta from dO . O and a running shift (softplus), a threshold search (entmax15), alpha-entmax,
#: softmax with forgetting attention's decay (the only use of the softmax map: path triton_forget), signed weights
#: over a denominator term of their own with the running max of |s| (cog)
FORM_MAPS = ("sigmoid", "symax", "softplus", "entmax15", "entmax_alpha", "softmax", "cog")
#: maps compiled with a forget gate (HAS_FORGET): the softmax map runs only for forgetting attention
FORGET_MAPS = frozenset({"softmax"})
#: pointer arguments in the input dtype (the rest are fp32, the masks uint8)
_INPUT_DTYPE = {"Q", "K", "V", "OUT", "DO", "DQ", "DK", "DV_OUT"}
_INTS = {"H", "HKV", "GROUPS", "LQ", "LK", "DH", "DV", "QOFF", "LQ_KEY", "LK_KEY"}


@dataclasses.dataclass
class KernelReport:
    """What the compile of one kernel shows. ``dots``: the products in its source (``tl.dot`` calls reached from
    it); ``tensor_core``: wgmma (sm_90) or mma (sm_80) instructions in the PTX; ``fma``: ``fma.rn.f32``;
    ``fma_bound``: the most FMAs allowed (half of the smallest dot's FMA fallback)."""

    kernel: str
    map: str
    dtype: str
    head_dim: int
    config: str
    dots: int
    tensor_core: int
    fma: int
    fma_bound: int
    registers: int | None
    spill_stores: int | None
    spill_loads: int | None
    shared_bytes: int | None
    seconds: float
    problem: str | None = None


def _signature(fn: Any, consts: dict[str, Any], dtype: str) -> dict[str, str]:
    sig = {}
    for arg in fn.arg_names:
        if arg in consts:
            sig[arg] = "constexpr"
        elif arg in _INPUT_DTYPE:
            sig[arg] = f"*{dtype}"
        elif arg in ("KEEP", "TABLE"):
            sig[arg] = "*u8"
        elif arg == "CAP":
            sig[arg] = "fp32"
        elif arg in _INTS or not arg.isupper():
            sig[arg] = "i32"
        else:
            sig[arg] = "*fp32"
    return sig


def _dot_shapes(kernel: str, bm: int, bn: int, bd: int, bdv: int) -> list[tuple[int, int, int]]:
    """(M, N, K) of each product of a kernel at blocks (bm, bn) and head dims (bd, bdv)."""
    qk = (bm, bn, bd)
    return {"_fwd_kernel": [qk, (bm, bdv, bn)],
            "_threshold_kernel": [qk],
            "_bwd_dq_kernel": [qk, (bm, bn, bdv), (bm, bd, bn)],
            "_bwd_dkdv_kernel": [(bm, bn, bd), (bm, bn, bdv), (bn, bdv, bm), (bn, bd, bm)]}[kernel]


def _ptxas(ptx: str, arch: int) -> tuple[int | None, int | None, int | None]:
    """(registers, spill store bytes, spill load bytes) as triton's bundled ptxas reports them (-v)."""
    from triton.backends.nvidia import compiler as nv

    try:
        tool = nv.get_ptxas(arch)
    except TypeError:  # (older triton: no argument)
        tool = nv.get_ptxas()
    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([tool.path, f"-arch=sm_{arch}{suffix}", "-v", str(src), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True, timeout=600)
    text = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (int(regs.group(1)) if regs else None, int(spills.group(1)) if spills else None,
            int(spills.group(2)) if spills else None)


def check_kernel(kernel: str, map_name: str, dtype: str = "bf16", head_dim: int = 64, arch: int = 90,
                 causal: bool = True, masked: bool = False) -> KernelReport:
    """Compile one fused kernel for ``map_name`` with its first autotune config for ``head_dim`` (a keep-mask's
    blocks when ``masked``; the forget gate's decay for a map in ``FORGET_MAPS``) and read it. ``dtype``: "bf16" or
    "fp16" (the inputs; fp32 inputs run IEEE fp32 products, which the check must flag: it is how
    tests/test_triton_ptx.py shows that the check can fail)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    kern = ta._compiled()
    fn = getattr(kern, kernel)
    size = "small" if head_dim <= 64 else "large"
    bm, bn, warps, stages = ta.CONFIGS[kernel][size][0]
    if masked:
        bm, bn = ta.MASKED_BLOCKS[kernel]
    bd = ta._pow2(head_dim)
    consts = dict(**ta.map_constants(maps.BY_NAME[map_name]), CAUSAL=causal and not masked, HAS_MASK=masked,
                  PREC="ieee", UPCAST=False, FAST=dtype == "bf16", EVEN_D=True, EVEN_DV=True, BLOCK_M=bm, BLOCK_N=bn,
                  BLOCK_D=bd, BLOCK_DV=bd, STEPS=ta.THRESHOLD_STEPS, HAS_BIAS=False, HAS_ALIBI=False,
                  HAS_CAP=False, HAS_DBIAS=False, DB_BM=False, DB_BN=False, HAS_FORGET=map_name in FORGET_MAPS)
    consts = {a: v for a, v in consts.items() if a in fn.arg_names}
    src = ASTSource(fn=fn, signature=_signature(fn, consts, dtype),
                    constexprs={(fn.arg_names.index(a),): v for a, v in consts.items()})
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (triton 3.9's TRITON_DEFAULT_FP_FUSION notice)
        compiled = compile(src, target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": warps, "num_stages": stages})
    seconds = time.perf_counter() - t0
    ptx = compiled.asm["ptx"]
    tensor_core = len(re.findall(r"\bwgmma\.mma_async", ptx)) + len(re.findall(r"\bmma\.sync", ptx))
    fma = len(re.findall(r"\bfma\.rn\.f32", ptx))
    shapes = _dot_shapes(kernel, bm, bn, bd, bd)
    bound = min(m * n * k for m, n, k in shapes) // (32 * warps) // 2
    regs, stores, loads = _ptxas(ptx, arch)
    problems = []
    if tensor_core < len(shapes):
        problems.append(f"{tensor_core} tensor-core instructions for {len(shapes)} products")
    if fma > bound:
        problems.append(f"{fma} fp32 FMAs (a product on FMAs needs {2 * bound}; allowed {bound})")
    shared = getattr(compiled.metadata, "shared", None)
    return KernelReport(kernel, map_name, dtype, head_dim, f"{bm}x{bn} w{warps} s{stages}", len(shapes),
                        tensor_core, fma, bound, regs, stores, loads, shared, round(seconds, 1),
                        "; ".join(problems) or None)


def check_forms(maps_: tuple[str, ...] = FORM_MAPS, dtype: str = "bf16", head_dims: tuple[int, ...] = (64,),
                arch: int = 90) -> list[KernelReport]:
    """Every kernel of each map in ``maps_`` (the threshold kernel for the threshold maps), causal."""
    out = []
    for head_dim in head_dims:
        for name in maps_:
            kernels = [k for k in triton_device.KERNELS
                       if k != "_threshold_kernel" or maps.BY_NAME[name].form == "threshold"]
            out += [check_kernel(k, name, dtype, head_dim, arch) for k in kernels]
    return out


def markdown(reports: list[KernelReport]) -> str:
    import triton

    lines = [f"triton {triton.__version__}", "",
             "| kernel | map | dtype | d | config | products | tensor-core instr. | fp32 FMA (allowed) | registers | "
             "spill stores / loads (bytes) | shared (bytes) | compile s | problem |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in reports:
        lines.append(f"| {r.kernel} | {r.map} | {r.dtype} | {r.head_dim} | {r.config} | {r.dots} | {r.tensor_core} | "
                     f"{r.fma} ({r.fma_bound}) | {r.registers} | {r.spill_stores} / {r.spill_loads} | "
                     f"{r.shared_bytes} | {r.seconds} | {r.problem or ''} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--maps", nargs="+", default=list(FORM_MAPS), help="fused maps to compile (default: one per form)")
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128], help="head dims (default 64 128)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                   help="input dtype (default bf16; fp32 inputs run IEEE fp32 products, on FMAs)")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100/H200)")
    p.add_argument("--json", type=Path, default=None, help="also write the records as JSON")
    args = p.parse_args(argv)
    unknown = sorted(set(args.maps) - set(maps.BY_NAME))
    if unknown:
        p.error(f"--maps: unknown fused maps {unknown}; known: {', '.join(maps.BY_NAME)}")
    ta._load_triton()
    reports = check_forms(tuple(args.maps), args.dtype, tuple(args.head_dims), args.arch)
    print(markdown(reports))
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in reports], indent=1))
    return 1 if any(r.problem for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
