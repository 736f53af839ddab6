"""Benchmark the fused CPU kernels with score modifiers (ALiBi slopes, soft-cap, a bias tensor) against SDPA softmax.

Rows: fused_cpu with a fused-map normalizer (default symax and entmax15) under each modifier, forward + backward,
timed alternately with SDPA softmax on the same inputs (so load changes on a shared machine hit both alike): with
ALiBi or a bias, SDPA gets the same bias materialised as its float mask ([1, H, n, n], -inf above the diagonal,
built once outside the timing); with a soft-cap, which SDPA cannot apply, plain causal SDPA. The ``chunked`` row
(what ran these calls before the kernels took modifiers) is timed once for ALiBi up to --chunked-max-length. Writes
``<out-dir>/bench_score_mods.json`` and ``.md``.

    python scripts/bench_score_mods.py --lengths 1024 4096
    python scripts/bench_score_mods.py --memory     # peak extra RSS at n = 8192, fresh process per row
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_attnorm.attention import alibi_bias, constant_heads, make_call
from hf_attnorm.kernels import attend
from hf_attnorm.settings import resolve_settings

MODS = ("none", "alibi", "softcap", "bias")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--normalizers", nargs="+", default=["symax", "entmax15"])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--softcap", type=float, default=50.0, help="Gemma2's attention soft-cap")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--chunked-max-length", type=int, default=1024,
                   help="time the chunked ALiBi row up to this n (one run: 9-22 s at n = 1024 on 2 cores)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out-dir", type=Path, default=Path("bench/score_mods"))
    p.add_argument("--memory", action="store_true",
                   help="instead: peak extra RSS of one forward+backward per (normalizer, modifier), fresh process")
    p.add_argument("--memory-length", type=int, default=8192)
    p.add_argument("--memory-heads", type=int, default=2)
    p.add_argument("--memory-child", nargs=4, metavar=("NORMALIZER", "MODIFIER", "N", "H"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def mod_kwargs(mod: str, h: int, n: int, softcap: float) -> dict:
    if mod == "alibi":
        return dict(alibi_slopes=slopes(h))
    if mod == "bias":
        return dict(bias=alibi_bias(slopes(h), n, n))
    return dict(softcap=softcap) if mod == "softcap" else {}


def memory_child(name: str, mod: str, n: int, h: int, softcap: float) -> None:
    """Prints the peak RSS growth (MB) of one causal forward+backward on fused_cpu, after a small warm-up call."""
    from hf_attnorm.kernels.fused import cpu as fused_cpu

    fused_cpu.native_ops()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 64, generator=g).requires_grad_() for _ in range(3))
    settings = resolve_settings(name, {})
    heads = constant_heads(settings, h, head_dim=64)
    small = make_call(q[:, :, :64], k[:, :, :64], v[:, :, :64], settings, heads, None, True,
                      **mod_kwargs(mod, h, 64, softcap))
    attend(small, "fused_cpu")[0].sum().backward()
    kw = mod_kwargs(mod, h, n, softcap)
    q.grad = k.grad = v.grad = None
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out, _, ran = attend(make_call(q, k, v, settings, heads, None, True, **kw), "fused_cpu")
    out.pow(2).mean().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"normalizer": name, "modifier": mod, "path": ran, "extra_mb": round((peak - base) / 1024, 1)}))


def measure_memory(args) -> int:
    n, h = args.memory_length, args.memory_heads
    rows = []
    for name in args.normalizers:
        for mod in ("none", "alibi", "softcap"):  # a bias row's input is [1, H, n, n] itself: nothing to show
            cmd = [sys.executable, __file__, "--memory-child", name, mod, str(n), str(h),
                   "--softcap", str(args.softcap)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            row = json.loads(res.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"meta": {"n": n, "H": h, "d": 64, "dtype": "fp32", "causal": True,
                       "one_H_n_n_fp32_mb": h * n * n * 4 / 2**20}, "rows": rows}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "memory.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out_dir}/memory.json")
    return 0


def _ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000.0


def paired(fn, base_fn, repeats: int, warmup: int) -> tuple[float, float, float]:
    """(median ms of fn, median ms of the baseline, median of the per-pair ratios), timed alternately."""
    for _ in range(warmup):
        fn()
        base_fn()
    pairs = [(_ms(fn), _ms(base_fn)) for _ in range(repeats)]
    return (statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs),
            statistics.median(a / b for a, b in pairs))


def slopes(h: int) -> torch.Tensor:
    """ALiBi's geometric slopes 2^(-8 i / H), i = 1..H (Press et al.)."""
    return 2.0 ** (-8.0 * torch.arange(1, h + 1, dtype=torch.float32) / h)


def sdpa_fn(q, k, v, mask: torch.Tensor | None):
    """SDPA softmax forward + backward: causal, or with ``mask`` (a float mask holding the causal -inf)."""
    def fn():
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out.pow(2).mean().backward()
    return fn


def fused_fn(q, k, v, settings, heads, kw: dict, path: str, ran: list[str]):
    """Forward + backward of one causal call with the modifiers ``kw`` on ``path`` (appends the path that ran)."""
    def fn():
        call = make_call(q, k, v, settings, heads, None, True, **kw)
        out, _, name_ran = attend(call, path)
        ran.append(name_ran)
        out.pow(2).mean().backward()
    return fn


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        name, mod, n, h = args.memory_child
        memory_child(name, mod, int(n), int(h), args.softcap)
        return 0
    if args.memory:
        return measure_memory(args)
    H, D = args.heads, args.head_dim
    meta = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "B": 1, "H": H, "d": D, "dtype": "fp32", "causal": True,
            "softcap": args.softcap, "repeats": args.repeats, "load_average_start": os.getloadavg()}
    rows = []
    for n in args.lengths:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, H, n, D, generator=g).requires_grad_() for _ in range(3))
        m = slopes(H)
        alibi = alibi_bias(m, n, n)  # [1, H, n, n]
        causal_keep = torch.ones(n, n, dtype=torch.bool).tril()
        sdpa_mask = alibi.masked_fill(~causal_keep, float("-inf"))

        for name in args.normalizers:
            settings = resolve_settings(name, {})
            heads = constant_heads(settings, H, head_dim=D)
            for mod in MODS:
                kw = {"alibi": dict(alibi_slopes=m), "softcap": dict(softcap=args.softcap),
                      "bias": dict(bias=alibi), "none": {}}[mod]  # the bias row reuses the timed alibi tensor
                paths = ["fused_cpu"] + (["chunked"] if mod == "alibi" and n <= args.chunked_max_length else [])
                for path in paths:
                    ran: list[str] = []
                    fused = fused_fn(q, k, v, settings, heads, kw, path, ran)
                    base = sdpa_fn(q, k, v, sdpa_mask if mod in ("alibi", "bias") else None)
                    reps = args.repeats if path == "fused_cpu" else 1
                    t, tb, ratio = paired(fused, base, reps, args.warmup if path == "fused_cpu" else 0)
                    assert set(ran) == {path}, ran
                    row = {"n": n, "normalizer": name, "modifier": mod, "path": path, "ms": round(t, 1),
                           "sdpa_ms": round(tb, 1), "ratio": round(ratio, 2),
                           "sdpa_with": "the same bias as float mask" if mod in ("alibi", "bias") else "is_causal"}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    meta["load_average_end"] = os.getloadavg()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "rows": rows}
    (args.out_dir / "bench_score_mods.json").write_text(json.dumps(result, indent=1))
    (args.out_dir / "bench_score_mods.md").write_text(markdown(result))
    print(f"wrote {args.out_dir}/bench_score_mods.json, .md")
    return 0


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"fp32, causal, forward + backward, B=1, H={m['H']}, d={m['d']}, {m['threads']} threads, "
             f"soft-cap {m['softcap']}; load average {m['load_average_start'][0]:.1f} -> "
             f"{m['load_average_end'][0]:.1f} (shared machine: ratios are paired, absolute times rough)", "",
             "| n | normalizer | modifier | path | ms | SDPA softmax ms | ratio | SDPA with |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['n']} | {r['normalizer']} | {r['modifier']} | {r['path']} | {r['ms']:.0f} | "
                     f"{r['sdpa_ms']:.0f} | {r['ratio']:.2f} | {r['sdpa_with']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
