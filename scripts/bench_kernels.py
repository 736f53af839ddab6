#!/usr/bin/env python
"""Benchmark every registered normalizer and scale through the reference path and the auto-selected fast path.

Measured side by side in one process against SDPA softmax (``torch.nn.functional.scaled_dot_product_attention``,
the same call shape): time of the forward pass (no grad), time of forward + backward, their ratio to SDPA (each run
paired with an SDPA run right after it; the median of the per-pair ratios), and the max error of each path against
a float64 reference (output and gradients of q, k, v and learnable per-head values, at ``--error-length``; the
reference row shows the materialised path's own fp32 error, for scale). Times are medians of ``--repeats`` runs
after ``--warmup``. With ``--memory`` the peak extra RSS of forward + backward is measured in a fresh subprocess
per (row, path) at ``--memory-length``.

Rows: every attn_implementation (``hf_attnorm.available()``: a new one is benchmarked with no edit); ``--rows``
normalizers / scales: every normalizer under its preset, or softmax under every other scale.
Writes a table (stdout and markdown), JSON and a log-log PNG of fwd+bwd time against n.

Example (the README table)::

    python scripts/bench_kernels.py --lengths 1024 4096 --out-dir bench/kernels --memory
    python scripts/bench_kernels.py --quick --out-dir /tmp/bench   # CI smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import hf_attnorm  # noqa: E402,F401  (registers everything)
from hf_attnorm.attention import constant_heads, make_call  # noqa: E402
from hf_attnorm.kernels import attend, candidate_paths, explain  # noqa: E402
from hf_attnorm.registry import NORMALIZERS, PRESETS, SCALES  # noqa: E402
from hf_attnorm.settings import GLOBAL_OPTIONS, resolve_settings  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096], help="sequence lengths n (Lq = Lk)")
    p.add_argument("--batch", type=int, default=1, help="batch size B")
    p.add_argument("--heads", type=int, default=8, help="query heads H")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA); default: --heads")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension d")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="input dtype")
    p.add_argument("--no-causal", action="store_true", help="bidirectional attention instead of causal")
    p.add_argument("--rows", choices=["all", "normalizers", "scales"], default="all",
                   help="which rows: every attn_implementation (hf_attnorm.available(): each normalizer's preset, "
                        "each scale's, learned memory), every normalizer (preset scale), or softmax under every scale")
    p.add_argument("--only", nargs="+", default=None,
                   help="restrict to these row names (a normalizer name, or softmax+<scale>)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (the median is reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before timing")
    p.add_argument("--reference-repeats", type=int, default=1,
                   help="timed runs of the (slow, materialised) reference path")
    p.add_argument("--max-reference-length", type=int, default=4096,
                   help="time the reference path only up to this n (it is quadratic in memory)")
    p.add_argument("--error-length", type=int, default=256, help="n at which the max error vs float64 is measured")
    p.add_argument("--memory", action="store_true", help="also measure peak extra RSS in fresh subprocesses")
    p.add_argument("--memory-length", type=int, default=8192, help="n of the memory measurement")
    p.add_argument("--memory-heads", type=int, default=None,
                   help="heads of the memory measurement (default --heads); the fast/reference ratio does not "
                        "depend on it, the absolute numbers do")
    p.add_argument("--memory-reference", nargs="*", default=["softmax", "symax", "entmax15"],
                   help="rows whose reference path is measured for memory (each needs several GB at n=8192)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--quick", action="store_true",
                   help="CI smoke mode: n = 128 256, B1 H2 d32, one repeat, no memory runs")
    p.add_argument("--out-dir", type=Path, default=Path("bench/kernels"), help="where JSON, markdown and PNG go")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--memory-child", type=str, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.heads, args.head_dim = [128, 256], 2, 32
        args.repeats, args.warmup, args.memory, args.error_length = 1, 1, False, 64
    for name in ("batch", "heads", "head_dim", "repeats", "error_length", "memory_length"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.lengths):
        p.error(f"--lengths must be >= 1, got {args.lengths}")
    if args.kv_heads is not None and (args.kv_heads < 1 or args.heads % args.kv_heads):
        p.error(f"--kv-heads must divide --heads ({args.heads}), got {args.kv_heads}")
    return args


# ------------------------------------------------------------------------------------------------ rows and calls


def rows(which: str, only: list[str] | None) -> list[tuple[str, dict]]:
    """(row name, settings overrides for the preset named by the first part)."""
    out = []
    if which == "all":
        out = [(name, {}) for name in hf_attnorm.available()]
    if which == "normalizers":
        out += [(name, {}) for name in NORMALIZERS]
        # presets that switch on an option every normalizer takes (learned memory key/values: memkv)
        out += [(name, {}) for name in PRESETS if name not in NORMALIZERS
                and any(k in GLOBAL_OPTIONS for k in PRESETS.get(name).settings)]
    if which == "scales":
        out += [(f"softmax+{s}", {"scale": s}) for s in SCALES if s != "standard"]
    if only:
        unknown = sorted(set(only) - {r for r, _ in out})
        if unknown:
            raise SystemExit(f"--only: unknown rows {unknown}; available: {', '.join(r for r, _ in out)}")
        out = [r for r in out if r[0] in only]
    return out


def settings_for(row: str, overrides: dict):
    return resolve_settings(row.split("+")[0], overrides)


def kv_heads_for(args, heads: int) -> int:
    """Key/value heads of a row with ``heads`` query heads (the --heads / --kv-heads ratio kept)."""
    return max(1, heads // (args.heads // (args.kv_heads or args.heads)))


def inputs(args, n: int, heads: int, dtype: torch.dtype, seed: int = 0, requires_grad: bool = True):
    g = torch.Generator().manual_seed(seed)
    hkv = kv_heads_for(args, heads)
    q = torch.randn(args.batch, heads, n, args.head_dim, generator=g).to(dtype)
    k = torch.randn(args.batch, hkv, n, args.head_dim, generator=g).to(dtype)
    v = torch.randn(args.batch, hkv, n, args.head_dim, generator=g).to(dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def learnable_heads(settings, heads: int, dtype=torch.float32, head_dim: int | None = None,
                    kv_heads: int | None = None) -> dict[str, torch.Tensor]:
    """head_dim: for per-head values shaped by it; kv_heads: for values per key/value head (learned memory
    key/values [Hkv, M, head_dim])."""
    return {n: t.to(dtype).requires_grad_(True)
            for n, t in constant_heads(settings, heads, None, head_dim, kv_heads).items()}


def run_once(q, k, v, settings, heads, causal: bool, path: str | None, backward: bool):
    """One attention call (and its backward); returns the path that ran."""
    call = make_call(q, k, v, settings, heads, None, causal, None, module_info={"max_positions": 2048})
    if backward:
        out, _, ran = attend(call, path)
        out.float().pow(2).mean().backward()
    else:
        with torch.no_grad():
            _, _, ran = attend(call, path)
    return ran


def _ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000.0


def paired(fn, base_fn, repeats: int, warmup: int) -> tuple[float, float, float]:
    """Time fn and the SDPA baseline alternately (so load changes on a shared machine hit both alike).
    Returns (median ms of fn, median ms of the baseline, median of the per-pair ratios)."""
    for _ in range(warmup):
        fn()
        base_fn()
    pairs = [(_ms(fn), _ms(base_fn)) for _ in range(repeats)]
    return (statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs),
            statistics.median(a / b for a, b in pairs))


def sdpa_fns(args, n: int, dtype: torch.dtype):
    """(forward, forward + backward) of SDPA softmax on inputs like the benchmark's."""
    q, k, v = inputs(args, n, args.heads, dtype)
    causal = not args.no_causal
    gqa = q.shape[1] != k.shape[1]

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    def fwd_bwd():
        F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa).float().pow(2).mean().backward()

    return fwd, fwd_bwd


def max_error(args, settings, path: str) -> float:
    """max |x - x64| over the output and every gradient, ``path`` in the benchmark dtype vs the float64 reference."""
    causal = not args.no_causal
    dtype = DTYPES[args.dtype]
    res = []
    for p, dt in ((path, dtype), ("reference", torch.float64)):
        q, k, v = inputs(args, args.error_length, args.heads, torch.float32, seed=1)
        q, k, v = (t.detach().to(dtype).to(dt).requires_grad_(True) for t in (q, k, v))
        heads = learnable_heads(settings, args.heads, torch.float64 if dt == torch.float64 else torch.float32,
                                 head_dim=args.head_dim, kv_heads=kv_heads_for(args, args.heads))
        call = make_call(q, k, v, settings, heads, None, causal, None, module_info={"max_positions": 2048})
        out, _, _ = attend(call, p)
        g = torch.Generator().manual_seed(5)
        out.backward(torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype))
        res.append([out.detach(), q.grad, k.grad, v.grad, *[h.grad for h in heads.values()]])
    err = 0.0
    for a, b in zip(*res):
        if a is not None and b is not None:
            err = max(err, (a.double() - b.double()).abs().max().item())
    return err


# ------------------------------------------------------------------------------------------------ memory


def _reset_peak_rss() -> bool:
    """Linux: writing 5 to /proc/self/clear_refs resets the peak RSS (VmHWM) to the current RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def memory_child(spec: str) -> None:
    """Runs in a fresh process: one forward + backward, prints the peak RSS increase in MB as JSON."""
    import psutil

    cfg = json.loads(spec)
    args = parse_args(cfg["argv"])
    torch.set_num_threads(cfg["threads"])
    settings = settings_for(cfg["row"], cfg["overrides"])
    n = args.memory_length
    heads = args.memory_heads or args.heads
    q, k, v = inputs(args, n, heads, DTYPES[args.dtype])
    hv = learnable_heads(settings, heads, head_dim=args.head_dim, kv_heads=kv_heads_for(args, heads))
    if cfg["path"] != "reference":  # build / load the native kernels before the baseline
        small = inputs(args, 8, heads, DTYPES[args.dtype])
        run_once(*small, settings, hv, not args.no_causal, cfg["path"], True)
    base = psutil.Process().memory_info().rss
    if not _reset_peak_rss():
        raise SystemExit("peak RSS measurement needs Linux /proc/self/clear_refs")
    ran = run_once(q, k, v, settings, hv, not args.no_causal, cfg["path"], True)
    print(json.dumps({"extra_mb": (_peak_rss() - base) / 2**20, "path": ran}))


def measure_memory(args, argv: list[str], row: str, overrides: dict, path: str) -> dict:
    spec = json.dumps({"argv": argv, "row": row, "overrides": overrides, "path": path,
                       "threads": torch.get_num_threads()})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--memory-child", spec],
                         capture_output=True, text=True, env=env)
    if res.returncode != 0:
        return {"error": (res.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def reference_bytes(args, n: int, heads: int) -> float:
    """Rough peak of the materialised path: about six [B, H, n, n] fp32 tensors alive in forward + backward."""
    return 6.0 * args.batch * heads * n * n * 4


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.memory_child:
        memory_child(args.memory_child)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    dtype = DTYPES[args.dtype]
    causal = not args.no_causal
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python scripts/bench_kernels.py " + " ".join(sys.argv[1:]),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "load_average_start": load, "B": args.batch, "H": args.heads, "Hkv": args.kv_heads or args.heads,
        "d": args.head_dim, "dtype": args.dtype, "causal": causal, "repeats": args.repeats,
    }
    print(f"# B={args.batch} H={args.heads} Hkv={meta['Hkv']} d={args.head_dim} {args.dtype} "
          f"{'causal' if causal else 'bidirectional'}; threads={meta['threads']}; load average {load}", flush=True)
    table = []
    baselines = {n: sdpa_fns(args, n, dtype) for n in args.lengths}
    sdpa_times: dict[int, dict[str, list[float]]] = {n: {"fwd_ms": [], "fwd_bwd_ms": []} for n in args.lengths}
    row_list = rows(args.rows, args.only)
    for row, overrides in row_list:
        settings = settings_for(row, overrides)
        probe_q = inputs(args, 16, args.heads, dtype)
        probe_h = learnable_heads(settings, args.heads, head_dim=args.head_dim,
                                  kv_heads=kv_heads_for(args, args.heads))
        probe = make_call(*probe_q, settings, probe_h, None, causal, None, module_info={"max_positions": 2048})
        fast = next((name for name, why in explain(probe) if why == "runs"), "reference")
        err = max_error(args, settings, fast) if fast != "reference" else 0.0
        ref_err = max_error(args, settings, "reference")  # the materialised path's own error, for scale
        for path in dict.fromkeys([fast, "reference"]):
            for n in args.lengths:
                if path == "reference" and n > args.max_reference_length:
                    continue
                q, k, v = inputs(args, n, args.heads, dtype)
                hv = learnable_heads(settings, args.heads, head_dim=args.head_dim,
                                     kv_heads=kv_heads_for(args, args.heads))
                reps = args.reference_repeats if path == "reference" else args.repeats
                warm = 0 if path == "reference" else args.warmup
                # the fast row runs what the rule picks at each length and direction (a path may take a call
                # without gradients and leave the training call to another, e.g. fox's large calls on sdpa)
                case = (q, k, v, settings, hv, causal, path if path == "reference" else None)
                ran = run_once(*case, False)
                ran_fb = run_once(*case, True)
                base_f, base_fb = baselines[n]
                t_f, b_f, r_f = paired(lambda case=case: run_once(*case, False), base_f, reps, warm)
                t_fb, b_fb, r_fb = paired(lambda case=case: run_once(*case, True), base_fb, reps, warm)
                sdpa_times[n]["fwd_ms"].append(b_f)
                sdpa_times[n]["fwd_bwd_ms"].append(b_fb)
                entry = {"row": row, "normalizer": settings.normalizer, "scale": settings.scale, "path": ran_fb,
                         "path_fwd": ran, "n": n,
                         "fwd_ms": t_f, "fwd_bwd_ms": t_fb, "fwd_ratio": r_f, "fwd_bwd_ratio": r_fb,
                         "sdpa_fwd_ms": b_f, "sdpa_fwd_bwd_ms": b_fb,
                         "max_err_vs_fp64": err if path != "reference" else ref_err}
                table.append(entry)
                print(f"{row:30s} {ran:14s} n={n:6d} fwd {t_f:9.1f} ms ({r_f:5.2f}x)  "
                      f"fwd+bwd {t_fb:9.1f} ms ({r_fb:5.2f}x)  [sdpa {b_f:.1f} / {b_fb:.1f} ms]"
                      + f"  max err {entry['max_err_vs_fp64']:.1e}", flush=True)
    baselines = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in sdpa_times.items() if d["fwd_ms"]}
    memory = []
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.memory:  # the timings are kept if the memory runs fail
        (args.out_dir / "bench_kernels.json").write_text(
            json.dumps({"meta": meta, "sdpa_softmax": baselines, "rows": table, "memory": []}, indent=1))
        import psutil

        avail = psutil.virtual_memory().available
        mheads = args.memory_heads or args.heads
        print(f"memory n={args.memory_length} H={mheads}", flush=True)
        for row, overrides in row_list:
            settings = settings_for(row, overrides)
            hv = learnable_heads(settings, args.heads, head_dim=args.head_dim, kv_heads=kv_heads_for(args, args.heads))
            fast = candidate_paths(make_call(*inputs(args, 4, args.heads, dtype), settings, hv, None, causal, None,
                                             module_info={"max_positions": 2048}))
            fast_res = measure_memory(args, argv, row, overrides, "auto") if fast else {}
            entry = {"row": row, "path": fast_res.get("path", "reference"), **fast_res}
            if row in args.memory_reference:
                need = reference_bytes(args, args.memory_length, mheads)
                if need < 0.7 * avail:
                    ref = measure_memory(args, argv, row, overrides, "reference")
                    entry["reference_extra_mb"] = ref.get("extra_mb")
                    if "extra_mb" in fast_res and ref.get("extra_mb"):
                        entry["fraction_of_reference"] = fast_res["extra_mb"] / ref["extra_mb"]
                else:
                    entry["reference_extra_mb"] = f"skipped: needs ~{need / 2**30:.1f} GB, {avail / 2**30:.1f} free"
            memory.append(entry)
            print(f"memory {row:28s} {entry}", flush=True)
        refs = [m["reference_extra_mb"] for m in memory if isinstance(m.get("reference_extra_mb"), float)]
        for m in memory:  # against the smallest reference measured: the conservative fraction for every row
            if refs and isinstance(m.get("extra_mb"), float):
                m["fraction_of_smallest_reference"] = m["extra_mb"] / min(refs)
    meta["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    meta["memory_length"], meta["memory_heads"] = args.memory_length, args.memory_heads or args.heads
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "sdpa_softmax": baselines, "rows": table, "memory": memory}
    (args.out_dir / "bench_kernels.json").write_text(json.dumps(result, indent=1))
    (args.out_dir / "bench_kernels.md").write_text(markdown(result))
    print(markdown(result))
    if not args.no_plot:
        plot(result, args.out_dir / "bench_kernels.png")
    print(f"wrote {args.out_dir}/bench_kernels.json, .md" + ("" if args.no_plot else ", .png"))
    return 0


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"`{meta['command']}`, {meta['date']}", ""] if "date" in meta else []  # (older runs recorded neither)
    lines += [f"B={meta['B']} H={meta['H']} Hkv={meta['Hkv']} d={meta['d']} {meta['dtype']} "
             f"{'causal' if meta['causal'] else 'bidirectional'}, torch {meta['torch']}, {meta['threads']} threads, "
             f"median of {meta['repeats']}; load average {meta['load_average_start']} -> "
             f"{meta.get('load_average_end')}", "",
             "ratios: median over repeats of (time / SDPA softmax time measured right after it)", "",
             "| n | SDPA softmax fwd ms | fwd+bwd ms |", "|---|---|---|"]
    for n, b in result["sdpa_softmax"].items():
        lines.append(f"| {n} | {b['fwd_ms']:.1f} | {b['fwd_bwd_ms']:.1f} |")
    lines += ["", "| row | path | n | fwd ms | fwd ratio | fwd+bwd ms | fwd+bwd ratio | max err vs fp64 |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        err = f"{r['max_err_vs_fp64']:.1e}"
        lines.append(f"| {r['row']} | {r['path']} | {r['n']} | {r['fwd_ms']:.1f} | {r['fwd_ratio']:.2f} | "
                     f"{r['fwd_bwd_ms']:.1f} | {r['fwd_bwd_ratio']:.2f} | {err} |")
    if result["memory"]:
        lines += ["", f"peak extra RSS of forward + backward, fresh process each, n={meta.get('memory_length')}, "
                      f"H={meta.get('memory_heads')}", "",
                  "| row | path | fast MB | reference MB | fast / own reference | fast / smallest reference |",
                  "|---|---|---|---|---|---|"]
        for m in result["memory"]:
            lines.append(f"| {m['row']} | {m.get('path', '')} | {_fmt(m.get('extra_mb', m.get('error')))} | "
                         f"{_fmt(m.get('reference_extra_mb', ''))} | {_fmt(m.get('fraction_of_reference', ''), 3)} | "
                         f"{_fmt(m.get('fraction_of_smallest_reference', ''), 3)} |")
    return "\n".join(lines) + "\n"


def _fmt(x, digits: int = 0) -> str:
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 6), sharey=True)
    ns = sorted(int(n) for n in result["sdpa_softmax"])
    by_row: dict[tuple[str, bool], list[tuple[int, float]]] = {}
    for r in result["rows"]:
        by_row.setdefault((r["row"], r["path"] == "reference"), []).append((r["n"], r["fwd_bwd_ms"]))
    for ax, ref in zip(axes, (False, True)):
        ax.plot(ns, [result["sdpa_softmax"][n]["fwd_bwd_ms"] if n in result["sdpa_softmax"] else
                     result["sdpa_softmax"][str(n)]["fwd_bwd_ms"] for n in ns], "k-", lw=3, label="SDPA softmax")
        for (row, is_ref), pts in by_row.items():
            if is_ref == ref and pts:
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", lw=1, label=row)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_title("reference (materialised)" if ref else "fast paths (auto rule)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    axes[0].set_ylabel("forward + backward time (ms)")
    meta = result["meta"]
    fig.suptitle(f"hf_attnorm kernels: B={meta['B']} H={meta['H']} d={meta['d']} {meta['dtype']}, "
                 f"{'causal' if meta['causal'] else 'bidirectional'}, {meta['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
