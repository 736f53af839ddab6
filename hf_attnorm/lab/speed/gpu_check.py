"""One GPU check: the ``gpu`` test suite, a benchmark against SDPA (flash backend) with the field's own kernels
timed beside (the anchors: ``gpu_anchors.py``), and the results under ``bench/gpu/<device name>/`` (results.json,
results.md, command.txt). Entry point: ``scripts/gpu_check.sh`` (which first runs scripts/gpu_setup.py) or
``python -m hf_attnorm.lab.speed.gpu_check``.

Modes: ``--quick`` (default: the suite's ``gpu and not slow`` subset, then the benchmark of every implementation
and anchor at bf16 causal B8 H32 n1024/2048 d64 and B4 H16 n4096 d128), ``--full`` (every gpu test and the grid
B 1-8, H 8-32, d 64/128, n 1k-16k, causal and not) and ``--dry-run`` (CPU: collects the suite and lists its skip
reasons, runs the benchmark machinery at a toy size on the CPU, writes the same files; no CUDA needed).

Benchmark: per row (SDPA's flash backend, an anchor, or an implementation: its preset on the path the automatic
rule picks) and per shape, forward (no grad) and forward + backward; times are medians over ``--repeats`` after
``--warmup`` (CUDA events on a GPU). FLOPs as FlashAttention's benchmarks count them: forward 4 B H n^2 d (halved
when causal), forward + backward 3.5 x that; ``/ sdpa`` is the time ratio to SDPA on the same inputs (above 1:
slower). Peak memory: the peak allocated bytes of forward + backward above what was allocated before. Before the
timed pass, a warm-up phase runs every point once in ``--warm-workers`` processes (Triton and flex_attention
compile their kernels into their on-disk caches in parallel; the timed pass then autotunes from that cache). The
autotuner's choices are saved (``tuned_configs``). A measurement that fails records its error; points not reached
within ``--bench-budget`` seconds are listed as not run. Nothing is dropped silently.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ...attention import constant_heads, make_call
from ...kernels import attend
from ...kernels.fused import triton as fused_triton
from ...registry import NORMALIZERS
from ...settings import resolve_settings
from ...version import __version__
from . import gpu_anchors

ROOT = Path(__file__).resolve().parents[3]
SUITE = "tests/test_gpu.py"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: paths that mean no fast path took the call (flagged in the table)
FALLBACKS = ("chunked", "reference")
#: the materialised reference is not timed above this n (its n x n weights)
MAX_REFERENCE_N = 4096


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark point: q, k, v are [B, H, n, d] (no GQA: the baselines' layout)."""

    B: int
    H: int
    n: int
    d: int
    causal: bool
    dtype: str

    @property
    def label(self) -> str:
        return f"B{self.B} H{self.H} n{self.n} d{self.d} {'causal' if self.causal else 'bidir'} {self.dtype}"

    def flops(self, backward: bool) -> float:
        fwd = 4.0 * self.B * self.H * self.n * self.n * self.d * (0.5 if self.causal else 1.0)
        return fwd * (3.5 if backward else 1.0)


def grid(mode: str) -> list[Shape]:
    """The benchmark shapes of a mode. full: FlashAttention's convention of a fixed token and width budget
    (B x n = 16k tokens capped to B 1-8, H x d = 2048), n 1k-16k, d 64 and 128, causal and bidirectional, bf16."""
    if mode == "dry-run":
        return [Shape(1, 2, 64, 16, True, "fp32"), Shape(1, 2, 96, 16, False, "fp32")]
    if mode == "quick":
        return [Shape(8, 32, 1024, 64, True, "bf16"), Shape(8, 32, 2048, 64, True, "bf16"),
                Shape(4, 16, 4096, 128, True, "bf16")]
    shapes = []
    for d in (64, 128):
        for causal in (True, False):
            for n in (1024, 2048, 4096, 8192, 16384):
                shapes.append(Shape(max(1, min(8, 16384 // n)), 2048 // d, n, d, causal, "bf16"))
    return shapes


# ------------------------------------------------------------------------------------------------ environment


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "hf_attnorm": __version__,
                           "platform": platform.platform()}
    for dist in ("transformers", "triton", "flash-attn"):
        try:
            from importlib.metadata import version

            out[dist] = version(dist)
        except Exception:  # noqa: BLE001  (not installed)
            out[dist] = None
    try:
        out["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                           timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["git_commit"] = None
    return out


def device_info() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"name": "cpu", "cuda": False, "cpu": platform.processor() or platform.machine(),
                "cpu_count": os.cpu_count()}
    props = torch.cuda.get_device_properties(0)
    return {"name": torch.cuda.get_device_name(0), "cuda": True,
            "capability": list(torch.cuda.get_device_capability(0)),
            "memory_gib": round(props.total_memory / 2**30, 1), "multiprocessors": props.multi_processor_count,
            "device_count": torch.cuda.device_count(), "cpu_count": os.cpu_count()}


def device_dir_name(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3' (a folder name)."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", name).strip("_") or "unknown"


# ------------------------------------------------------------------------------------------------ suite


def suite_command(mode: str, out_dir: Path, workers: int) -> list[str]:
    marker = "gpu" if mode == "full" else "gpu and not slow"
    cmd = [sys.executable, "-m", "pytest", SUITE, "-m", marker, "-v", "-rs", "-p", "no:cacheprovider",
           f"--junitxml={out_dir / 'suite.xml'}"]
    if workers > 1:
        cmd += ["-n", str(workers)]
    return cmd


_LINE = re.compile(r"(tests/\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)"
                   r"|(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\s+(tests/\S+::\S+)")
_SKIP = re.compile(r"^SKIPPED \[(\d+)\] ([^:]+:\d+): (.*)$", re.M)


def parse_suite(stdout: str, junit: Path | None) -> dict[str, Any]:
    """Outcome counts, failures (test id and message) and skip reasons, from the JUnit XML when pytest finished,
    else from its verbose lines (a run cut by the timeout)."""
    outcomes: dict[str, str] = {}
    failures: list[dict[str, str]] = []
    if junit is not None and junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            tid = f"{case.get('classname', '')}::{case.get('name', '')}"
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                outcomes[tid] = "failed" if bad.tag == "failure" else "error"
                failures.append({"test": tid, "message": (bad.get("message") or "")[:800]})
            elif case.find("skipped") is not None:
                outcomes[tid] = "skipped"
            else:
                outcomes[tid] = "passed"
    else:
        for m in _LINE.finditer(stdout):
            tid, word = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
            outcomes[tid] = word.lower()
            if word in ("FAILED", "ERROR"):
                failures.append({"test": tid, "message": "(see the log: the run did not finish)"})
    counts: dict[str, int] = {}
    for word in outcomes.values():
        counts[word] = counts.get(word, 0) + 1
    skips = [{"count": int(c), "where": w, "reason": r.strip()} for c, w, r in _SKIP.findall(stdout)]
    return {"counts": counts, "failures": failures, "skip_reasons": skips}


def run_suite(mode: str, out_dir: Path, timeout_s: float, workers: int) -> dict[str, Any]:
    cmd = suite_command(mode, out_dir, workers)
    t0 = time.perf_counter()
    timed_out = False
    # a process group of its own: on timeout the pytest-xdist workers are stopped too (they hold the GPU)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, _ = proc.communicate()
        rc, timed_out = None, True
    (out_dir / "suite.log").write_text(stdout)
    result = parse_suite(stdout, None if timed_out else out_dir / "suite.xml")
    result.update(command=shlex.join(cmd), returncode=rc, timed_out=timed_out,
                  seconds=round(time.perf_counter() - t0, 1), timeout_s=timeout_s)
    return result


# ------------------------------------------------------------------------------------------------ benchmark


def _timer(device: torch.device):
    """fn -> milliseconds of one run (CUDA events on a GPU)."""
    if device.type == "cuda":
        def cuda_ms(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
        return cuda_ms

    def cpu_ms(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1000.0
    return cpu_ms


def _inputs(shape: Shape, device: torch.device, grad: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape.B, shape.H, shape.n, shape.d, generator=g).to(device, DTYPES[shape.dtype])
            .requires_grad_(grad) for _ in range(3)]


def _row_fns(row: str, shape: Shape, device: torch.device) -> tuple[Any, Any, list[str]]:
    """(forward, forward + backward, [path that ran]) for a row: a normalizer (its preset, automatic path),
    ``sdpa`` (flash backend on CUDA), ``flash_attn2`` or an anchor (``anchor:<name>``)."""
    q, k, v = _inputs(shape, device, True)
    grad_out = torch.randn_like(q)
    ran: list[str] = []
    anchor = gpu_anchors.anchor_of_row(row)
    if anchor is not None:
        call = gpu_anchors.build(anchor, q, k, v, shape.causal)
        ran.append(anchor.name)

        def attn():
            out = call()
            return out if out.shape == q.shape else out.transpose(1, 2)  # ([B, T, H, D] layouts back)
    elif row == "sdpa":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        cuda = device.type == "cuda"
        ran.append("sdpa_flash" if cuda else "sdpa")  # (the flash backend needs CUDA: torch's choice on a CPU)

        def attn():
            if not cuda:
                return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)
    elif row == "flash_attn2":
        from flash_attn import flash_attn_func

        ran.append("flash_attn2")
        q, k, v = (t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v))
        grad_out = torch.randn_like(q)

        def attn():
            return flash_attn_func(q, k, v, causal=shape.causal)
    else:
        settings = resolve_settings(row)
        heads = constant_heads(settings, shape.H, device, shape.d, shape.H)

        def attn():
            call = make_call(q, k, v, settings, heads, None, shape.causal, None,
                             module_info={"max_positions": max(4096, shape.n)})
            out, _, path = attend(call)
            if not ran:
                ran.append(path)
            return out

    def fwd():
        with torch.no_grad():
            attn()

    def fwd_bwd():
        out = attn()
        out.backward(grad_out)
        q.grad = k.grad = v.grad = None

    return fwd, fwd_bwd, ran


def _measure(fn, device: torch.device, repeats: int, warmup: int) -> float:
    timer = _timer(device)
    for _ in range(warmup):
        timer(fn)
    return statistics.median(timer(fn) for _ in range(repeats))


def _peak_mb(fn, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None  # (CPU: not measured here; scripts/bench_kernels.py --memory measures RSS)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)


def bench_rows(flash_attn: bool, only: list[str] | None = None) -> list[str]:
    """Baselines first (SDPA's flash backend, FlashAttention-2, the anchors), then every registered normalizer (its
    preset: the normalizer's own name); ``only`` restricts them (an unknown name is an error listing the known
    ones)."""
    anchors = [gpu_anchors.row_name(a) for a in gpu_anchors.ANCHORS.values()]
    rows = ["sdpa", *(["flash_attn2"] if flash_attn else []), *anchors, *NORMALIZERS]
    if only:
        unknown = sorted(set(only) - set(rows))
        if unknown:
            raise ValueError(f"--rows: unknown rows {unknown}; available: {', '.join(rows)}")
        rows = [r for r in rows if r in only]
    return rows


def _warm_point(args: tuple[str, dict[str, Any]]) -> str | None:
    """One (row, shape) forward and forward + backward in a worker process (``warm``): None, or the error."""
    row, shape = args
    try:
        fwd, fwd_bwd, _ = _row_fns(row, Shape(**shape), torch.device("cuda"))
        fwd()
        fwd_bwd()
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # noqa: BLE001  (the timed pass records it properly)
        return f"{row} {Shape(**shape).label}: {type(exc).__name__}"


def warm(shapes: list[Shape], rows: list[str], workers: int, budget_s: float) -> dict[str, Any]:
    """Every (row, shape) point run once in ``workers`` processes, so Triton's and flex_attention's compiles fill
    their on-disk caches in parallel before the timed pass (whose autotuning then compiles nothing). Anchors whose
    package is missing are skipped. Returns {"points", "seconds", "errors", "cut"}."""
    import concurrent.futures
    import multiprocessing

    device = torch.device("cuda")
    todo = [(row, dataclasses.asdict(shape)) for shape in shapes for row in rows
            if not (gpu_anchors.anchor_of_row(row) and gpu_anchors.anchor_of_row(row).missing(device))]
    t0 = time.perf_counter()
    errors: list[str] = []
    cut = False
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = [pool.submit(_warm_point, item) for item in todo]
        try:
            for fut in concurrent.futures.as_completed(futures, timeout=budget_s):
                if fut.result():
                    errors.append(fut.result())
        except concurrent.futures.TimeoutError:
            cut = True
            for fut in futures:
                fut.cancel()
    return {"points": len(todo), "seconds": round(time.perf_counter() - t0, 1), "errors": errors, "cut": cut}


def run_bench(shapes: list[Shape], rows: list[str], device: torch.device, repeats: int, warmup: int,
              budget_s: float, records: list[dict[str, Any]] | None = None,
              on_record: Any = None) -> list[dict[str, Any]]:
    """One record per (row, shape), appended to ``records`` as each finishes (``on_record()`` is called then, so a
    run cut short keeps what finished); row by row (SDPA first), each over every shape, so a run cut by its budget
    leaves whole rows; see the module docstring."""
    t0 = time.perf_counter()
    records = [] if records is None else records
    base: dict[tuple[str, str], float] = {}
    for row in rows:
        for shape in shapes:
            rec: dict[str, Any] = {"row": row, **dataclasses.asdict(shape), "status": "ok"}
            records.append(rec)
            if time.perf_counter() - t0 > budget_s:
                rec["status"] = f"not run: the benchmark budget of {budget_s:.0f} s was spent"
                continue
            anchor = gpu_anchors.anchor_of_row(row)
            if anchor is not None:
                rec["anchor_of"] = list(anchor.of)
                missing = anchor.missing(device) or (f"not run: {anchor.name} is a causal kernel"
                                                     if anchor.causal_only and not shape.causal else None)
                if missing:
                    rec["status"] = missing
                    if on_record is not None:
                        on_record()
                    continue
            try:
                fwd, fwd_bwd, ran = _row_fns(row, shape, device)
                fwd()  # the first call compiles and tells the path
                rec["path"] = ran[0] if ran else None
                if rec["path"] == "reference" and shape.n > MAX_REFERENCE_N:
                    rec["status"] = f"not run: only the materialised reference takes it (n > {MAX_REFERENCE_N})"
                    continue
                rec["fallback"] = rec["path"] in FALLBACKS and device.type == "cuda"
                for key, fn, backward in (("fwd", fwd, False), ("fwd_bwd", fwd_bwd, True)):
                    ms = _measure(fn, device, repeats, warmup)
                    rec[f"{key}_ms"] = round(ms, 4)
                    rec[f"{key}_tflops"] = float(f"{shape.flops(backward) / (ms * 1e-3) / 1e12:.4g}")
                    if row == "sdpa":
                        base[key, shape.label] = ms
                    ref = base.get((key, shape.label))
                    rec[f"{key}_vs_sdpa"] = round(ms / ref, 3) if ref else None
                rec["peak_mb"] = _peak_mb(fwd_bwd, device)
            except Exception as exc:  # noqa: BLE001  (recorded in the results, with its type and first line)
                rec["status"] = f"error: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if on_record is not None:
                    on_record()
    return records


# ------------------------------------------------------------------------------------------------ output


def _fmt(x: Any) -> str:
    return "" if x is None else (f"{x:.3g}" if isinstance(x, float) else str(x))


def markdown(result: dict[str, Any]) -> str:
    dev, ver, suite = result["device"], result["versions"], result.get("suite")
    lines = [f"# GPU check: {dev['name']}", "",
             f"Command: `{result['command']}` ({result['mode']}), {result['started_utc']} UTC, "
             f"total {result['seconds']} s.", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in ver.items() if k != "platform"), ""]
    setup = result.get("setup")
    if setup:
        lines += ["## Setup", "", "| step | ran | seconds | exit | why |", "|---|---|---|---|---|"]
        lines += [f"| `{s['command']}` | {s['ran']} | {s['seconds']} | {_fmt(s['returncode'])} | {s['why']} |"
                  for s in setup.get("steps", [])] or ["| (nothing to install) | | | | |"]
        lines.append("")
        lines += [f"- {'ok' if c['ok'] else 'REQUIRED' if c['required'] else 'warning'}: {c['message']}"
                  for c in setup.get("checks", [])]
        lines.append("")
    if suite:
        lines += ["## Test suite", "", f"`{suite['command']}`: " + ", ".join(
            f"{n} {k}" for k, n in sorted(suite["counts"].items())) + f" in {suite['seconds']} s"
            + (" (cut by the timeout)" if suite["timed_out"] else ""), ""]
        for f in suite["failures"]:
            lines.append(f"- FAILED `{f['test']}`: {f['message'].splitlines()[0] if f['message'] else ''}")
        for s in suite["skip_reasons"]:
            lines.append(f"- skipped {s['count']} at {s['where']}: {s['reason']}")
        lines.append("")
    bench = result.get("bench")
    if bench:
        lines += ["## Benchmark", "", "Forward (no grad) and forward + backward; TFLOPS counted as FlashAttention's "
                  "benchmarks (4 B H n^2 d, halved when causal; backward 2.5 x forward); `/ sdpa`: time ratio to "
                  "SDPA on the same inputs (above 1: slower); peak: allocated MB of forward + backward.", "",
                  "| shape | row | path | fwd ms | fwd TFLOPS | fwd / sdpa | fwd+bwd ms | fwd+bwd TFLOPS | "
                  "fwd+bwd / sdpa | peak MB | status |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in bench["records"]:
            shape = Shape(r["B"], r["H"], r["n"], r["d"], r["causal"], r["dtype"]).label
            path = _fmt(r.get("path")) + (" (fallback)" if r.get("fallback") else "")
            lines.append(f"| {shape} | {r['row']} | {path} | {_fmt(r.get('fwd_ms'))} | {_fmt(r.get('fwd_tflops'))} | "
                         f"{_fmt(r.get('fwd_vs_sdpa'))} | {_fmt(r.get('fwd_bwd_ms'))} | "
                         f"{_fmt(r.get('fwd_bwd_tflops'))} | {_fmt(r.get('fwd_bwd_vs_sdpa'))} | "
                         f"{_fmt(r.get('peak_mb'))} | {r['status']} |")
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the default: the quick suite subset and a small grid")
    mode.add_argument("--full", action="store_true", help="every gpu test and the full grid (~30 min on an H100)")
    mode.add_argument("--dry-run", action="store_true",
                      help="no CUDA needed: collect the suite (skip reasons), run the benchmark at a toy size on "
                           "the CPU, write the files")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="output directory (default: bench/gpu/<device name>/ in the repository; a new temporary "
                        "directory in a dry run)")
    p.add_argument("--phases", default="suite,bench", help="comma-separated phases to run: suite, bench")
    p.add_argument("--suite-timeout", type=float, default=None,
                   help="seconds before the suite is stopped (default: 240 quick, 1500 full, 300 dry run)")
    p.add_argument("--bench-budget", type=float, default=None,
                   help="seconds after which no new benchmark point starts (default: 240 quick, 1200 full, 300 dry)")
    p.add_argument("--workers", type=int, default=None,
                   help="pytest-xdist processes for the suite (Triton compiles on the CPU; default: min(12, CPUs), "
                        "1 without pytest-xdist or in a dry run)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (default 10, dry run 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs before timing (default 3, dry run 1)")
    p.add_argument("--warm-workers", type=int, default=None,
                   help="processes that compile every benchmark point before the timed pass (default: min(12, CPUs) "
                        "on a GPU, 0 in a dry run; 0: no warm-up phase)")
    p.add_argument("--warm-budget", type=float, default=240.0,
                   help="seconds after which the warm-up phase stops (default 240; the timed pass compiles the rest)")
    p.add_argument("--rows", nargs="+", default=None,
                   help="benchmark only these rows (sdpa, flash_attn2, normalizer names; default: all)")
    p.add_argument("--flash-attn", action="store_true",
                   help="add FlashAttention-2 as a baseline row (its absence is recorded, not an error)")
    p.add_argument("--setup-record", type=Path, default=None,
                   help="JSON written by scripts/gpu_setup.py (merged into the results)")
    p.add_argument("--no-setup", action="store_true", help="(for scripts/gpu_setup.py: install nothing)")
    p.add_argument("--wheels", type=Path, default=None,
                   help="(for scripts/gpu_setup.py: a folder of wheels installed first, offline)")
    args = p.parse_args(argv)
    args.mode = "full" if args.full else "dry-run" if args.dry_run else "quick"
    phases = [x for x in args.phases.split(",") if x]
    if not phases or set(phases) - {"suite", "bench"}:
        p.error(f"--phases takes suite and/or bench separated by commas; got {args.phases!r}")
    args.phase_list = phases
    try:
        bench_rows(True, args.rows)
    except ValueError as exc:
        p.error(str(exc))
    defaults = {"quick": (240, 240, 10, 3), "full": (1500, 1200, 10, 3), "dry-run": (300, 300, 1, 1)}[args.mode]
    for name, value in zip(("suite_timeout", "bench_budget", "repeats", "warmup"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.repeats < 1 or args.warmup < 0:
        p.error(f"--repeats must be >= 1 and --warmup >= 0; got {args.repeats}, {args.warmup}")
    return args


def _xdist_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("xdist") is not None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    if not cuda and args.mode != "dry-run":
        print(f"gpu_check: no CUDA device: torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees none. "
              "Run on a GPU machine, or use --dry-run to check the machinery on the CPU.", file=sys.stderr)
        return 2
    dev = device_info()
    if args.out_dir is None and args.mode == "dry-run":  # CPU results are not for bench/gpu/
        args.out_dir = Path(tempfile.mkdtemp(prefix="hf_attnorm_gpu_dry_run_"))
    out_dir = args.out_dir or ROOT / "bench" / "gpu" / device_dir_name(dev["name"])
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "scripts/gpu_check.sh " + shlex.join(argv if argv is not None else sys.argv[1:])
    result: dict[str, Any] = {"command": command.strip(), "mode": args.mode,
                              "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                              "device": dev, "versions": versions()}
    if args.setup_record and args.setup_record.exists():
        result["setup"] = json.loads(args.setup_record.read_text())

    def save() -> None:
        """Write the results so far (called after each phase and each benchmark point)."""
        result["seconds"] = round(time.perf_counter() - t0, 1)
        (out_dir / "results.json").write_text(json.dumps(result, indent=1))
        (out_dir / "results.md").write_text(markdown(result))
        (out_dir / "command.txt").write_text(result["command"] + "\n")

    save()
    if "suite" in args.phase_list:
        workers = args.workers or (min(12, os.cpu_count() or 1) if cuda and _xdist_available() else 1)
        print(f"gpu_check: test suite ({args.mode}, {workers} worker(s), timeout {args.suite_timeout:.0f} s)",
              flush=True)
        result["suite"] = run_suite(args.mode, out_dir, args.suite_timeout, workers)
        print(f"gpu_check: suite {result['suite']['counts']} in {result['suite']['seconds']} s", flush=True)
        for failure in result["suite"]["failures"]:
            print(f"gpu_check: FAILED {failure['test']}: {failure['message'][:300]}", flush=True)
        save()
    if "bench" in args.phase_list:
        device = torch.device("cuda" if cuda else "cpu")
        flash = args.flash_attn
        note = None
        if flash:
            try:
                import flash_attn  # noqa: F401
            except ImportError as exc:
                flash, note = False, f"FlashAttention-2 row left out: flash_attn does not import ({exc})"
                print(f"gpu_check: {note}", flush=True)
        shapes = grid(args.mode)
        rows = bench_rows(flash, args.rows)
        print(f"gpu_check: benchmark, {len(shapes)} shapes x {len(rows)} rows, budget {args.bench_budget:.0f} s",
              flush=True)
        records: list[dict[str, Any]] = []
        result["bench"] = {"rows": rows, "shapes": [dataclasses.asdict(s) for s in shapes],
                           "anchors": {a.name: {"of": list(a.of), "source": a.source}
                                       for a in gpu_anchors.ANCHORS.values()}, "repeats": args.repeats,
                           "warmup": args.warmup, "budget_s": args.bench_budget, "flash_attn_note": note,
                           "records": records}
        workers = args.warm_workers if args.warm_workers is not None else (min(12, os.cpu_count() or 1) if cuda else 0)
        if workers > 0 and cuda:
            print(f"gpu_check: warm-up compile of every point on {workers} processes "
                  f"(budget {args.warm_budget:.0f} s)", flush=True)
            result["bench"]["warm"] = warm(shapes, rows, workers, args.warm_budget)
            print(f"gpu_check: warm-up {result['bench']['warm']}", flush=True)
            save()
        run_bench(shapes, rows, device, args.repeats, args.warmup, args.bench_budget, records, save)
        result["bench"]["tuned_configs"] = fused_triton.tuned_configs()
        for kernel, chosen in result["bench"]["tuned_configs"].items():
            for key, config in chosen.items():
                print(f"gpu_check: autotune {kernel} {key}: {config}", flush=True)
        for rec in records:
            if rec["status"].startswith("error"):
                label = Shape(rec["B"], rec["H"], rec["n"], rec["d"], rec["causal"], rec["dtype"]).label
                print(f"gpu_check: benchmark {rec['row']} {label}: {rec['status']}", flush=True)
    save()
    print(f"gpu_check: wrote {out_dir}/results.json, results.md, command.txt", flush=True)
    return 1 if failed_parts(result) else 0


def failed_parts(result: dict[str, Any]) -> list[str]:
    """What went wrong in ``result``: a failed or cut suite, a benchmark point that raised (empty: all good)."""
    out = []
    suite = result.get("suite")
    if suite and (suite["failures"] or suite["timed_out"] or suite["returncode"] not in (0, 5)):
        out.append("suite")
    if any(r["status"].startswith("error") for r in (result.get("bench") or {}).get("records", [])):
        out.append("bench")
    return out


if __name__ == "__main__":
    sys.exit(main())
