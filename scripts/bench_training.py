#!/usr/bin/env python
"""Training throughput per attention implementation: tokens/s of the same short pretraining run (tiny Llama by
default, embedded Shakespeare, same seed and data), each implementation vs softmax, measured in one process.

    python scripts/bench_training.py --steps 30 --out bench/training.json

A benchmark, not a test: it measures and prints; the ratio column is tokens/s of softmax over tokens/s of the row
(> 1 = slower than softmax). tokens/s is the training script's own figure (training steps only, no evaluation).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import tempfile
import time
from pathlib import Path

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap.py"))  # offline; checkout


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from hf_attnorm.registry import PRESETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--implementations", nargs="+", default=list(PRESETS),
                   help="attn implementations to measure (default: every registered one; softmax is always added)")
    p.add_argument("--model_type", choices=["llama", "gpt2", "bert"], default="llama", help="model family")
    p.add_argument("--model_size", default="tiny", help="model_zoo size preset")
    p.add_argument("--block_size", type=int, default=128, help="tokens per training sequence")
    p.add_argument("--batch_size", type=int, default=4, help="sequences per step")
    p.add_argument("--steps", type=int, default=30, help="timed optimizer steps per implementation")
    p.add_argument("--out", type=Path, default=Path("bench/training.json"), help="where the JSON goes")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from hf_attnorm.lab.training import run_pretraining

    names = ["softmax"] + [n for n in args.implementations if n != "softmax"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            out = Path(tmp) / name
            t0 = time.time()
            summary = run_pretraining([
                "--model_type", args.model_type, "--model_size", args.model_size, "--attn_implementation", name,
                "--block_size", str(args.block_size), "--per_device_train_batch_size", str(args.batch_size),
                "--max_train_steps", str(args.steps), "--seed", "0", "--max_eval_samples", "4",
                "--model_card_dir", "none",
                "--output_dir", str(out), "--overwrite_output_dir"])
            rows.append({"implementation": name, "tokens_per_second": summary["tokens_per_second"],
                         "train_seconds": summary.get("train_seconds"), "wall_seconds": time.time() - t0})
    base = rows[0]["tokens_per_second"]
    print(f"\n{args.model_type} {args.model_size}, L={args.block_size}, batch {args.batch_size}, {args.steps} steps, "
          f"load average {os.getloadavg()}")
    print("| implementation | tokens/s | softmax tokens/s ÷ this |\n|---|---|---|")
    for r in rows:
        r["slowdown_vs_softmax"] = base / r["tokens_per_second"]
        print(f"| `{r['implementation']}` | {r['tokens_per_second']:,.0f} | {r['slowdown_vs_softmax']:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
