#!/usr/bin/env python
"""Rewrite the generated blocks of README.md and docs/*.md from the code and the measured JSON.

A generated block sits between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->``; everything between the
two markers is replaced by the output of generator NAME:

* implementations, options, learned, versions: ``python -m hf_attnorm --markdown NAME`` (the registries and
  ``hf_attnorm.hf.compat``);
* families: ``tests/family_zoo.py`` (the families the family matrix runs) and ``hf_attnorm.hf.families``
  (the refused ones);
* main-job: ``bench/compare/results.json`` re-rendered by ``hf_attnorm.lab.compare.report`` (the code that writes
  results.md);
* compare-mqar, compare-passkey, compare-lm: the main job's full table of one task, from the same records;
* compare-claims, compare-rerun, compare-second-run: the claims table with its rerun estimate, and the published run
  beside its second run in another floating-point order (``bench/compare/second-run/results.json``);
* claims-list: the published claims the main job tests (``hf_attnorm.lab.compare.report.CLAIMS``);
* kernels-run1, kernels-run3, kernels-run4: the tables of three earlier ``scripts/bench_kernels.py`` runs
  (bench/kernels/history/2026-11-22-first-run, 2026-11-23-added-kernels, 2026-11-27-attention-variants);
* performance: the published kernel benchmark run, ``bench/kernels/bench_kernels.json`` (``PERFORMANCE_RUN``);
* speed-goals: every implementation's prefill and decode ratios against its goal (``hf_attnorm.lab.speed.goals``),
  from the published kernel run and decode curve (``SPEED_RUNS``);
* serving: continuous batching's throughput per implementation, ``bench/serving/results.json``
  (``scripts/bench_serving.py``, whose results.md is written by the same functions);
* gpu-goals: every implementation's GPU goal (``hf_attnorm.lab.speed.goals.gpu_goal``) against the newest GPU check
  run that timed the anchors (``bench/gpu/<device>/results.json``, ``scripts/gpu_check.sh``), with the anchors' own
  rows;
* serve-endpoints: the routes of transformers serve's app as the installed transformers builds it
  (``hf_attnorm.hf.compat.serve_app_routes``) and what ``python -m hf_attnorm serve``'s guard does on each.

``python scripts/render_readme.py`` rewrites the files; ``--check`` writes nothing and exits 1 with a diff when a
file differs from what the generators print (tests/test_readme.py runs the same check).
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib.util
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: the documents that carry generated blocks, relative to the repository root
DOCUMENTS = ["README.md", "docs/options.md", "docs/architecture.md", "docs/benchmarks.md", "bench/compare/README.md",
             "docs/families.md", "bench/convert/README.md", "docs/evaluation.md", "docs/convert.md", "docs/clients.md",
             "docs/internals.md"]
BLOCK = re.compile(r"(<!-- generated:(?P<name>[a-z0-9_-]+) -->\n)(?P<body>.*?)(<!-- /generated:(?P=name) -->)", re.S)

#: the kernel benchmark run the README summarises (its JSON holds the numbers, the command, the date and the machine;
#: see bench/kernels/README.md)
PERFORMANCE_RUN = {"json": "bench/kernels/bench_kernels.json"}


def _family_zoo():
    spec = importlib.util.spec_from_file_location("family_zoo", ROOT / "tests" / "family_zoo.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules.setdefault("family_zoo", module)  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def families() -> str:
    """How many families the family matrix checks (tests/family_zoo.py) and which families are refused, and why."""
    from hf_attnorm.hf.families import REFUSED_FAMILIES

    zoo = _family_zoo()
    names = ", ".join(sorted(zoo.FAMILIES))
    refused = "\n".join(f"* `{name}`: {reason}" for name, reason in REFUSED_FAMILIES.items())
    return (f"**{len(zoo.FAMILIES)} families** are checked by `tests/test_families.py` on tiny random-init configs "
            f"(`tests/family_zoo.py`): {names}.\n\n"
            f"**Refused** at load and at `set_attn_implementation`, with an error naming the reason "
            f"({len(REFUSED_FAMILIES)} listed; any other family whose modeling file never calls the attention "
            f"interface is refused by the same rule):\n\n{refused}")


def main_job() -> str:
    """The main job's headline table, claim verdicts and plots, from bench/compare/results.json."""
    from hf_attnorm.lab.compare import report

    data = json.loads((ROOT / "bench" / "compare" / "results.json").read_text())
    res = _compare_results()
    rows, _ = report.claim_rows(res)
    plots = " ".join(f"![{name}](bench/compare/plots/{Path(p['path']).name})" for name, p in data["plots"].items())
    sets = " and ".join(f"{s[0]}–{s[-1]}" for s in res.sets)
    return (f"{len(data['implementations'])} implementations, seeds {sets}, from "
            f"[bench/compare/results.json](bench/compare/results.json) (`{data['command']}`, aggregated "
            f"{data['date'][:10]}; how the rows were trained: [bench/compare/README.md](bench/compare/README.md)). "
            f"Every implementation runs seeds {res.sets[0][0]}–{res.sets[0][-1]}; the reference and the claimed "
            f"implementations run the second set where a claim check needs it. Cells: mean ± 95% CI over the seeds "
            f"run; ▲/▼: significantly higher/lower than `{data['reference']}` (paired t-test by seed, 5%).\n\n"
            f"{report.headline_sentence(res)}\n\n{report.headline_table(res)}\n\n"
            f"Published claims checked at this scale: a verdict only where both seed sets agree and the effect clears "
            f"the stated margin ([protocol](docs/evaluation.md#claim-verdicts); —: the second set was not needed). "
            f"{report.rerun_summary(res)} {_second_run_sentence()}\n\n{report.verdicts_table(rows)}\n\n{plots}")


def _second_run_sentence() -> str:
    from hf_attnorm.lab.compare import report

    n = report.second_run_summary(_compare_results(), _second_run_results())
    return (f"A second run in another floating-point order kept {n['same']} of the {n['checks']} verdicts, "
            f"{n['contradicted']} turned into another verdict "
            f"([details](bench/compare/README.md#a-second-run-in-another-floating-point-order)).")


def _conversion_results() -> dict:
    return json.loads((ROOT / "bench" / "convert" / "results.json").read_text())


def _curve_results() -> dict | None:
    """bench/convert/curve.json (the budget curve), or None before it is published."""
    path = ROOT / "bench" / "convert" / "curve.json"
    return json.loads(path.read_text()) if path.is_file() else None


def conversion() -> str:
    """The conversion study's two verdicts per normalizer (recovered, adapted) with the budget curve's answer, the
    goals and the claim, from bench/convert/results.json and bench/convert/curve.json."""
    from hf_attnorm.lab.convert import study

    data, curve = _conversion_results(), _curve_results()
    s = data["settings"]
    lengths = " / ".join(str(n) for n in s["eval_lengths"])
    other = data.get("other_text", "the second text")
    source = (f"[bench/convert/results.json](bench/convert/results.json) (`{study.published_command(data['command'])}`"
              f", {data['date'][:10]})")
    if curve is not None:
        source += (f" and the budget curve, [bench/convert/curve.json](bench/convert/curve.json) "
                   f"(`{study.published_command(curve['commands']['default'])}`)")
    return (f"{data['model']}, {s['seeds']} seeds at the default budget ({s['transfer_steps']} + "
            f"{s['finetune_steps']} steps of {s['block_size']} tokens); cells: the mean over seeds at {lengths} "
            "tokens, each verdict the worst seed and context. **Recovered**: stage 2 distilled from the original "
            f"model, perplexity over the original model's on {other} (never trained on: what the conversion keeps "
            "of the model). **Adapted**: stage 2 on the next-token loss, perplexity over the softmax model "
            f"fine-tuned as long, on the training text's held-out part ({data['data']}). From {source}; "
            f"{data['machine']['cpus']}-core CPU, shared with other work; every run's command, time and load, the "
            "perplexities, the curve's runs and its plots: [bench/convert/README.md](bench/convert/README.md).\n\n"
            f"{study.verdict_table(data, curve)}\n\n"
            f"Goals of the study (reported, not tested):\n\n{study.goals_markdown(data, curve)}\n\n"
            f"The claim beside it: {data['claim']}. Here: {study.claim_finding(data)}.")


def conversion_curve() -> str:
    """The budget curve (bench/convert/curve.json): its table at each context, the plots, each lever against the
    default, and every curve run with its minutes, CPU time and the machine's load."""
    from hf_attnorm.lab.convert import study

    curve = _curve_results()
    if curve is None:
        return "Not measured yet: no bench/convert/curve.json."
    parts = [study.curve_markdown(curve).rstrip("\n")]
    parts.append(" ".join(f"![recovered at {n} tokens](curve_{n}.png)" for n in curve["settings"]["eval_lengths"]))
    lines = ["| implementation | recipe | budget | seed | minutes | CPU minutes | load average: start / mean over "
             "the steps / end |", "|---|---|---|---|---|---|---|"]
    wall, cpu, loads = 0.0, 0.0, []
    for variant, rows in curve["curves"].items():
        for impl, row in rows.items():
            for budget, cell in sorted(row["budgets"].items(), key=lambda kv: int(kv[0])):
                for seed, run in cell["runs"].items():
                    load = " / ".join("—" if x is None else f"{x:g}" for x in run["load_average"])
                    cpu_min = "—" if run["cpu_seconds"] is None else f"{run['cpu_seconds'] / 60:.0f}"
                    lines.append(f"| `{impl}` | {variant} | {budget}x | {seed} | {run['wall_seconds'] / 60:.0f} | "
                                 f"{cpu_min} | {load} |")
                    wall += run["wall_seconds"]
                    cpu += run["cpu_seconds"] or 0.0
                    loads += [x for x in run["load_average"] if x is not None]
    parts.append("\n".join(lines))
    parts.append(f"{len(lines) - 2} runs, {wall / 3600:.1f} h of wall time and {cpu / 3600:.1f} h of CPU time "
                 f"recorded (runs without a CPU time predate its recording); the machine's load average "
                 f"{min(loads):g} to {max(loads):g} over them (2 cores, shared with other work: above 2 the runs "
                 "waited for the cores, and their minutes are upper bounds). Commands: " +
                 "; ".join(f"{name}: `{study.published_command(cmd)}`" for name, cmd in curve["commands"].items()) +
                 ". Each run's own command is in its conversion.json.")
    parts.append(_curve_not_measured(curve))
    return "\n\n".join(parts)


#: the budgets and implementations a lever's curve is planned at (bench/convert/README.md's commands)
LEVER_BUDGETS = (1, 4)
LEVER_IMPLEMENTATIONS = ("entmax15", "stickbreaking")


def _curve_not_measured(curve: dict) -> str:
    """The curve's runs not measured yet, the commands that measure them (each runs only what has no
    conversion.json) and their cost: the implementation's 1x runs' wall time times the budget, on 2 threads (an
    upper bound: the evaluations do not grow with the budget)."""
    from hf_attnorm.lab.convert import study

    missing: dict[str, list[tuple[str, int, int]]] = {}
    planned = {"default": (study.CURVE_IMPLEMENTATIONS, study.CURVE_BUDGETS)}
    planned.update({v: ((*LEVER_IMPLEMENTATIONS, *(i for i in rows if i not in LEVER_IMPLEMENTATIONS)), LEVER_BUDGETS)
                    for v, rows in curve["curves"].items() if v != "default"})
    hours = 0.0
    for variant, (impls, budgets) in planned.items():
        rows = curve["curves"].get(variant, {})
        for impl in impls:
            cells = rows.get(impl, {}).get("budgets", {})
            base = curve["curves"].get("default", {}).get(impl, {}).get("budgets", {}).get("1", {}).get("runs", {})
            wall = [r["wall_seconds"] for r in base.values() if r.get("wall_seconds")]
            for b in budgets:
                for seed in range(study.curve_seeds(b)):
                    if str(seed) not in {str(s) for s in cells.get(str(b), {}).get("runs", {})}:
                        missing.setdefault(variant, []).append((impl, b, seed))
                        hours += (sum(wall) / len(wall) if wall else 0.0) * b * 2 / 3600
    if not missing:
        return "Every point of the curve is measured."
    said = "; ".join(f"{variant}: " + ", ".join(f"`{i}` {b}x seed {s}" for i, b, s in runs)
                     for variant, runs in missing.items())
    commands = [f"`python scripts/convert_study.py --budgets {' '.join(map(str, study.CURVE_BUDGETS))}`"]
    commands += [f"`python scripts/convert_study.py --budgets {' '.join(map(str, LEVER_BUDGETS))} --lever {v} "
                 f"--implementations {' '.join(planned[v][0])}`" for v in missing if v != "default"]
    return (f"**Not measured yet** ({sum(map(len, missing.values()))} runs, shown as not measured above): {said}. "
            f"They run with {' and '.join(commands)} (after copying the published runs, above: a run with a "
            f"conversion.json is not run again), in about {hours:.0f} CPU hours (each run: its implementation's "
            "1x runs' wall time times the budget on 2 threads, an upper bound on idle cores).")


def conversion_levers() -> str:
    """Each lever of the budget curve against the default recipe (bench/convert/curve.json): per implementation and
    context, the paired ratios to the original and whether the lever moved the curve left."""
    from hf_attnorm.lab.convert import study

    curve = _curve_results()
    levers = [v for v in (curve or {}).get("curves", {}) if v != "default"]
    if not levers:
        return "No lever measured yet."
    lengths = [str(n) for n in curve["settings"]["eval_lengths"]]
    lines = ["| lever | implementation | tokens | paired runs (budget, seed: the lever's ratio to the original "
             "against the default's) | moves the curve left |", "|---|---|---|---|---|"]
    for n in lengths:
        for lever, impl, left, words in study.lever_findings(curve, n):
            lines.append(f"| `{lever}` | `{impl}` | {n} | {words} | "
                         f"{'**yes**' if left else 'no' if left is False else 'not decided'} |")
    described, decided = [], []
    for name in levers:
        lever = curve["levers"][name]
        flags = f" (`{' '.join(lever['flags'])}`)" if lever["flags"] else ""
        described.append(f"`{name}`: {lever['description']}{flags}")
        # kept only where it moves the curve left for every implementation it ran on, at every context
        lefts = [left for n in lengths for lv, _, left, _ in study.lever_findings(curve, n) if lv == name]
        budgets = sorted({int(b) for row in curve["curves"][name].values() for b in row["budgets"]})
        verdict = "**kept**" if lefts and all(x is True for x in lefts) else \
            "not kept" if False in lefts or not lefts else "not decided yet"
        decided.append(f"`{name}` {verdict}: it moves "
                       f"the curve left in {sum(x is True for x in lefts)} of {len(lefts)} implementation and "
                       f"context pairs (measured at {', '.join(f'{b}x' for b in budgets)})")
    return f"{'; '.join(described)}.\n\n" + "\n".join(lines) + f"\n\n{'; '.join(decided)}."


def conversion_longer() -> str:
    """The conversion study at each context longer than the training blocks, from bench/convert/results.json."""
    from hf_attnorm.lab.convert import study

    data = _conversion_results()
    longer = data.get("longer", {})
    if not longer:
        return f"Not measured: the study scored {data['settings']['eval_lengths'][0]}-token contexts only."
    return "\n\n".join(f"{study.summary_sentence(data, length)}\n\n{study.table(data, length)}" for length in longer)


def conversion_texts() -> str:
    """The conversion study on its second held-out text, at each context, from bench/convert/results.json."""
    from hf_attnorm.lab.convert import study

    tables = study.text_tables(_conversion_results())
    return "\n\n".join(tables) if tables else "Not measured: the study scored the held-out Shakespeare only."


def conversion_runs() -> str:
    """Every run of the conversion study (its command, seconds per stage, the machine's load), then the default
    conversion measured alone in a fresh process (time and peak memory per phase)."""
    lines = ["| implementation | run | seed | seconds: stage 1 / stage 2 / whole run with evaluation | peak memory "
             "(MB): stage 1 / stage 2 | load average at start → end |", "|---|---|---|---|---|---|"]
    from hf_attnorm.lab.convert import study

    commands, loads = [], []
    for path in sorted((ROOT / "bench" / "convert" / "runs").glob("*/*/conversion.json")):
        parsed = study.parse_run_name(path.parent.name)
        if parsed is None or parsed[1] is not None or parsed[2] != 1:
            continue  # (the budget curve's runs: their own block)
        run = json.loads(path.read_text())
        kind, seed = parsed[0], parsed[3]
        sec, peak = run["seconds"], run.get("peak_rss_mb", {})
        stage1 = f"{sec['transfer']:.0f}" if run["steps"]["transfer"] else "—"
        memory = " / ".join(f"{peak[k]:.0f}" if k in peak else "—" for k in ("transfer", "finetune"))
        lines.append(f"| `{run['implementation']}` | {kind} | {seed} | {stage1} / {sec['finetune']:.0f} / "
                     f"{run['wall_seconds']:.0f} | {memory} | {run['load_average_start']} → "
                     f"{run['load_average_end']} |")
        commands.append(f"* `{study.published_command(run['command'])}`")
        loads += [run["load_average_start"], run["load_average_end"]]
    if loads:
        lines.append(f"\nLoad average over the runs: {min(loads)} to {max(loads)} (the study's own 2 threads give "
                     f"about 2; above that, something else shared the cores and the seconds are upper bounds).")
    alone = json.loads((ROOT / "bench" / "convert" / "default_run" / "conversion.json").read_text())
    peaks = ", ".join(f"{k} {v:.0f}" for k, v in alone["peak_rss_mb"].items())
    sec = alone["seconds"]
    return ("\n".join(lines) + "\n\nCommands:\n\n" + "\n".join(commands) +
            f"\n\n**One conversion at the default budget, alone in a fresh process** "
            f"(`{study.published_command(alone['command'])}`, load "
            f"average {alone['load_average_start']} at its start; [default_run/conversion.json]"
            f"(default_run/conversion.json)): stage 1 {sec['transfer']:.0f} s, stage 2 {sec['finetune']:.0f} s, "
            f"{alone['wall_seconds'] / 60:.1f} min in all with loading and its evaluations "
            f"({', '.join(alone['perplexity'])}). Peak resident "
            f"memory (MB) during each phase: {peaks}.")


def transfer_learning_rates() -> str:
    """Stage 1 alone at several peak learning rates (bench/convert/learning_rates/*/conversion.json): per
    implementation and rate, the held-out layer error at the start and every 5 steps, the best, and which rate
    convert.py now uses by default (``hf_attnorm.lab.convert.args.transfer_learning_rate``)."""
    from hf_attnorm.lab.convert.args import transfer_learning_rate
    from hf_attnorm.lab.convert.continuation import plan_continuation
    from hf_attnorm.settings import AttnormSettings

    runs = [json.loads(p.read_text()) for p in sorted((ROOT / "bench" / "convert" / "learning_rates").glob(
        "*/conversion.json"))]
    runs.sort(key=lambda r: (r["implementation"], -r["args"]["transfer_learning_rate"],
                             bool(r["continuation"].get("ran"))))
    steps = sorted({step for r in runs for step, _ in r["transfer_check"]["measured"]})
    head = ["implementation", "stage-1 rate", "continuation", "start", *[f"step {s}" for s in steps], "best (step)",
            "perplexity after stage 1", "default now"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        impl, rate, check = r["implementation"], r["args"]["transfer_learning_rate"], r["transfer_check"]
        settings = AttnormSettings.from_dict(r["settings"])
        default, _ = transfer_learning_rate(settings)
        walks = bool(r["continuation"].get("ran"))
        walks_by_default = plan_continuation(impl, settings.options, r["args"]["continuation_fraction"])[0] is not None
        length = str(r["args"]["eval_lengths"][0])
        measured = dict(check["measured"])
        flags = f" ({', '.join(r['args']['attnorm'])})" if r["args"]["attnorm"] else ""
        cells = [f"`{impl}`{flags}", f"{rate:g}", "yes" if walks else "no", f"{check['start']:.3f}",
                 *[f"{measured[s]:.3f}" if s in measured else "—" for s in steps],
                 f"{check['best']:.3f} ({check['best_step']})",
                 f"{r['perplexity']['transfer'][length]:,.1f}",
                 "**yes**" if rate == default and walks == walks_by_default else ""]
        lines.append("| " + " | ".join(cells) + " |")
    if not runs:
        return "\n".join(lines) + "\n\nNo runs in bench/convert/learning_rates."
    loads = [x for r in runs for x in (r["load_average_start"], r["load_average_end"])]
    seeds = sorted({r["seed"] for r in runs})
    a = runs[0]["args"]  # (the runs share their evaluation flags; the command of each is in its conversion.json)
    from hf_attnorm.lab.convert.study import published_command

    return ("\n".join(lines) + f"\n\n{len(runs)} runs, seed {', '.join(map(str, seeds))}, each "
            f"`{published_command(runs[0]['command'])}` with its implementation, rate and flags (every run's command "
            "is in its conversion.json); the error is the mean held-out per-layer error against the original model "
            f"on the {a['error_blocks']} error blocks, what keep-best compares (\"—\": not measured, during a "
            f"continuation's ramp); perplexity on {a['eval_tokens']:,} held-out Shakespeare tokens at "
            f"{a['eval_lengths'][0]}. Load average over the runs {min(loads)} to {max(loads)}.")


#: the second run of the published main job, in another floating-point order (bench/compare/README.md)
SECOND_RUN = ROOT / "bench" / "compare" / "second-run"


@functools.cache
def _compare_results():
    from hf_attnorm.lab.compare import report

    return report.results_from_json(json.loads((ROOT / "bench" / "compare" / "results.json").read_text()))


@functools.cache
def _second_run_results():
    from hf_attnorm.lab.compare import report

    return report.results_from_json(json.loads((SECOND_RUN / "results.json").read_text()))


def task_table(task: str) -> Callable[[], str]:
    """The main job's full table of one task (every length), rendered as results.md renders it."""

    def render() -> str:
        from hf_attnorm.lab.compare import report

        res = _compare_results()
        rec = res.first_ok(task)
        cols = report.lm_columns(rec) if task == "lm" else report.probe_columns(rec)
        return res.table(task, cols)

    return render


def claims() -> str:
    """The main job's full published-claims table (claim text, both means, paired difference per seed set, verdict,
    rerun estimate) and the rerun estimate over the table."""
    from hf_attnorm.lab.compare import report

    res = _compare_results()
    return report.claims_table(res)[0] + "\n\n" + report.rerun_summary(res)


def _second_run_words() -> str:
    from hf_attnorm.lab.compare import report

    first, second = _compare_results(), _second_run_results()
    data = json.loads((SECOND_RUN / "results.json").read_text())
    n = report.second_run_summary(first, second)
    return (f"The same seeds trained again with {data['jobs']} process(es) × {data['threads']} torch threads, where "
            f"the published run used {_published()['jobs']} × {_published()['threads']}: another order of "
            f"floating-point sums (tables: `{data['command']}`, {data['date'][:10]}). {n['runs_differing']} of the "
            f"{n['runs_in_both']} runs both hold ended training with a different loss (under one order they are "
            f"bit-identical), and the test measurements moved in "
            + ", ".join(f"{m['changed']} of {m['runs']} {task} runs (by up to "
                        + (f"{m['largest']:.3f} nats/char)" if task == "lm" else f"{m['largest']:.1f} points)")
                        for task, m in n["measurements_moved"].items())
            + f". Of the {n['checks']} claim checks, {n['same']} kept their verdict, "
            f"{n['to or from inconclusive']} moved between a verdict and \"inconclusive\", {n['contradicted']} "
            f"turned into another verdict" + (f", {n['missing']} were not checked" if n["missing"] else "") + ".")


def _published() -> dict:
    return json.loads((ROOT / "bench" / "compare" / "results.json").read_text())


def second_run() -> str:
    """The published run and its second run side by side, claim check by claim check (bench/compare/second-run)."""
    from hf_attnorm.lab.compare import report

    return _second_run_words() + "\n\n" + report.second_run_table(_compare_results(), _second_run_results())


#: the published run before the seed sets (3 seeds, one t-test per claim, the longer default budget)
EARLIER_RUN = ROOT / "bench" / "compare" / "2026-11-27-three-seeds"


def _mean_over(records: dict, task: str, spec: str, seeds: list[int], get) -> float | None:
    vals = [get(records[f"{task}/{spec}/seed{k}"]) for k in seeds if f"{task}/{spec}/seed{k}" in records]
    vals = [v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else None


def budget_curves() -> str:
    """From the earlier run's training curves (3 seeds): where each task's curve stands at the steps the default
    budget now stops at, against its end, per implementation."""
    data = json.loads((EARLIER_RUN / "results.json").read_text())
    recs = {r["id"]: r for r in data["runs"] if r.get("status") == "ok"}
    seeds = list(range(int(data["settings"]["seeds"])))
    impls = data["implementations"]

    def at(task: str, step: int, key: str):
        return lambda r: next((p[key] for p in r["curve"] if p["step"] == step), None)

    pk, mq, lm = (data["settings"][k] for k in ("passkey_steps", "mqar_steps", "lm_steps"))
    pk_steps = sorted({p["step"] for p in recs[f"passkey/{impls[0]}/seed0"]["curve"]})
    lm_steps = sorted({p["step"] for p in recs[f"lm/{impls[0]}/seed0"]["curve"]})
    mq_steps = sorted({p["step"] for p in recs[f"mqar/{impls[0]}/seed0"]["curve"]})
    head = ([f"passkey % @ L, step {k}" for k in pk_steps[1:]]
            + [f"LM Δ vs {data['reference']} @ L, step {k}" for k in lm_steps[2:]]
            + [f"mqar % @ L, step {k}" for k in mq_steps[-2:]])
    lines = ["| implementation | " + " | ".join(head) + " |", "|" + "---|" * (len(head) + 1)]
    for spec in impls:
        cells = []
        for k in pk_steps[1:]:
            v = _mean_over(recs, "passkey", spec, seeds, at("passkey", k, "accuracy"))
            cells.append("—" if v is None else f"{100 * v:.0f}")
        for k in lm_steps[2:]:
            mine = _mean_over(recs, "lm", spec, seeds, at("lm", k, "val_loss"))
            ref = _mean_over(recs, "lm", data["reference"], seeds, at("lm", k, "val_loss"))
            cells.append("—" if mine is None or ref is None else f"{mine - ref:+.3f}")
        for k in mq_steps[-2:]:
            v = _mean_over(recs, "mqar", spec, seeds, at("mqar", k, "accuracy"))
            cells.append("—" if v is None else f"{100 * v:.0f}")
        lines.append(f"| `{spec}` | " + " | ".join(cells) + " |")
    return (f"Mean over seeds 0–{seeds[-1]} of the earlier run ([{EARLIER_RUN.name}]({EARLIER_RUN.name}/README.md): "
            f"passkey {pk}, LM {lm}, MQAR {mq} steps), from the curves each run records during training (probe "
            f"accuracy on the test sequences at L; the LM's validation loss in nats/token at L, as a difference from "
            f"{data['reference']}'s at the same step):\n\n" + "\n".join(lines))


def budget_change() -> str:
    """The same seeds at the earlier and the current default budget: each implementation's claim measurements."""
    from hf_attnorm.lab.compare import report

    old, new = report.results_from_json(json.loads((EARLIER_RUN / "results.json").read_text())), _compare_results()
    seeds = [s for s in range(len(next(iter(next(iter(old.ids.values())).values()))))]
    cols = []
    for task in ("mqar", "passkey", "lm"):
        rec = old.first_ok(task)
        if task == "lm":
            L, ctx = rec["train_length"], rec["contexts"]
            cols += [(task, f"LM @ {c // L}x L", ["val_loss_per_char", str(c)], 1.0, 3) for c in (ctx[0], ctx[-1])]
        else:
            L, n = rec["train_length"], rec["lengths"]
            cols += [(task, f"{task} % @ {m // L}x L", ["accuracy", str(m)], 100.0, 1) for m in (n[0], n[-1])]
    lines = ["| implementation | " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for spec in new.ids["mqar"]:
        cells = []
        for task, _, path, scale, digits in cols:
            a = [v for v in old.values(task, spec, path, scale)[:len(seeds)] if v is not None]
            b = [v for v in new.values(task, spec, path, scale)[:len(seeds)] if v is not None]
            cells.append(f"{sum(a) / len(a):.{digits}f} → {sum(b) / len(b):.{digits}f}" if a and b else "—")
        lines.append(f"| `{spec}` | " + " | ".join(cells) + " |")
    return (f"Seeds 0–{seeds[-1]}, mean, earlier budget → current (the same seeds: same initial weights and data "
            f"order):\n\n" + "\n".join(lines))


def earlier_verdicts() -> str:
    """The earlier run's verdicts (3 seeds, one t-test at 5%) beside the current ones, claim check by claim check."""
    from hf_attnorm.lab.compare import report

    old = json.loads((EARLIER_RUN / "results.json").read_text())["claims"]
    rows, _ = report.claim_rows(_compare_results())
    now = {(r["implementation"], r["measurement"]): r for r in rows}
    lines = ["| implementation | measurement | earlier: Δ seeds 0–2 (95% CI) | earlier verdict | now: Δ per seed "
             "set | verdict now |", "|---|---|---|---|---|---|"]
    for o in old:
        n = now.get((o["implementation"], o["measurement"]))
        d = n["digits"] if n else 3
        earlier = report.fmt_diff(o["paired"], d) if o.get("paired") else "—"
        sets = "; ".join(report.fmt_diff(x["paired"], d) if x["paired"] else "—" for x in n["sets"]) if n else "—"
        lines.append(f"| `{o['implementation']}` | {o['measurement']} | {earlier} | {o['verdict']} | {sets} | "
                     f"{n['verdict'] if n else '—'} |")
    return "\n".join(lines)


def rerun_estimate() -> str:
    """How stable the published verdicts are: the estimate from the published runs and the second run's outcome."""
    from hf_attnorm.lab.compare import report

    return (f"{report.rerun_summary(_compare_results())}\n\nChecked by a second run "
            f"([bench/compare/second-run](../bench/compare/second-run/results.md)): {_second_run_words()}")


def claims_list() -> str:
    """The published claims the main job tests, from ``hf_attnorm.lab.compare.report.CLAIMS``."""
    from hf_attnorm.lab.compare import report

    return report.claims_list()


def kernel_table(json_path: str) -> Callable[[], str]:
    """The table of one ``scripts/bench_kernels.py`` run: per row its fast path, fwd+bwd time as a ratio to SDPA
    softmax at each length, the reference path's ratio, and the max error vs float64 (the reference's in brackets)."""

    def render() -> str:
        data = json.loads((ROOT / json_path).read_text())
        rows = data["rows"]
        fast_lengths = sorted({r["n"] for r in rows if r["path"] != "reference"})
        ref_lengths = sorted({r["n"] for r in rows if r["path"] == "reference"})
        head = (["implementation", "fast path"] + [f"fast ratio n={n}" for n in fast_lengths]
                + [f"reference ratio n={n}" for n in ref_lengths] + ["max err (reference's)"])
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name in dict.fromkeys(r["row"] for r in rows):
            fast = {r["n"]: r for r in rows if r["row"] == name and r["path"] != "reference"}
            ref = {r["n"]: r for r in rows if r["row"] == name and r["path"] == "reference"}
            if not fast:
                continue
            path = " / ".join(dict.fromkeys(r["path"] for r in fast.values()))  # by length when it changes
            cells = [f"`{name}`", path]
            cells += [f"{fast[n]['fwd_bwd_ratio']:.2f}" if n in fast else "-" for n in fast_lengths]
            cells += [f"{ref[n]['fwd_bwd_ratio']:.1f}" if n in ref else "-" for n in ref_lengths]
            err = next(iter(fast.values())).get("max_err_vs_fp64")
            ref_err = next(iter(ref.values())).get("max_err_vs_fp64") if ref else None
            cells.append(f"{err:.1e}" + (f" ({ref_err:.1e})" if ref_err is not None else ""))
            lines.append("| " + " | ".join(cells) + " |")
        base = data["sdpa_softmax"]
        meta = data["meta"]
        load = ", ".join(f"{x:.1f}" for x in meta.get("load_average_start", []))
        lines += ["", "SDPA softmax forward+backward in this run: "
                  + ", ".join(f"{v['fwd_bwd_ms']:.1f} ms at n = {k}" for k, v in base.items())
                  + f"; {meta['threads']} threads, median of {meta['repeats']}, load average at the start {load} "
                    f"([{json_path}](../{json_path}))."]
        return "\n".join(lines)

    return render


def performance() -> str:
    """Five lines on speed and error from one kernel benchmark run (fwd+bwd time as a ratio to SDPA softmax)."""
    run = PERFORMANCE_RUN
    data = json.loads((ROOT / run["json"]).read_text())
    meta, rows = data["meta"], data["rows"]
    lengths = sorted({r["n"] for r in rows if r["path"] != "reference"})
    n = lengths[-1]
    fast = [r for r in rows if r["n"] == n and r["path"] != "reference"]

    def span(rs: list[dict]) -> str:
        ratios = sorted(r["fwd_bwd_ratio"] for r in rs)
        return f"{ratios[0]:.2f}-{ratios[-1]:.2f}" if len(ratios) > 1 else f"{ratios[0]:.2f}"

    fused = [r for r in fast if r["path"] == "fused_cpu"]
    sdpa = [r for r in fast if r["path"] == "sdpa"]
    others = [r for r in fast if r["path"] not in ("fused_cpu", "sdpa")]
    ref = [r for r in rows if r["path"] == "reference"]
    ref_n = ref[0]["n"] if ref else None
    errs = [r["max_err_vs_fp64"] for r in rows if r["path"] != "reference"]
    base = data["sdpa_softmax"]
    load = meta.get("load_average_start", [0.0])[0]
    lines = [
        "* SDPA softmax, the baseline: forward+backward "
        + ", ".join(f"{v['fwd_bwd_ms']:.1f} ms at n = {k}" for k, v in base.items())
        + f" ({meta['dtype']}, causal, B = {meta['B']}, H = {meta['H']}, d = {meta['d']}, {meta['threads']} threads, "
          f"torch {meta['torch']}).",
        f"* Fused C++ maps (`fused_cpu`, {len(fused)} normalizers): {span(fused)}x SDPA's time at n = {n}.",
        f"* Softmax family and length-aware scales on SDPA ({len(sdpa)} rows): {span(sdpa)}x at n = {n}.",
        "* " + "; ".join(f"`{r['row']}` on `{r['path']}`: {r['fwd_bwd_ratio']:.2f}x" for r in others)
        + f" at n = {n}.",
        (f"* The materialised reference: {span([r for r in ref])}x at n = {ref_n}; every fast path within "
         f"{max(errs):.1e} of a float64 reference."),
    ]
    return ("\n".join(lines) + f"\n\n`{meta['command']}`, {meta['date']}, 2-core CPU, load average {load:.1f} at the "
            f"start ([{run['json']}]({run['json']}); every implementation against its speed goal, with decoding, and "
            f"every other run: [docs/benchmarks.md](docs/benchmarks.md#every-implementation-against-its-speed-goal)).")


#: the serving benchmark run shown in docs/benchmarks.md
SERVING_RUN = "bench/serving/results.json"


def serving_table(result: dict) -> str:
    """The rows of a ``scripts/bench_serving.py`` run: per implementation and mode the attention paths that ran,
    requests/s, tokens/s, the time ratio to sdpa under continuous batching, whether it is within the goal, and
    whether its continuous-batching tokens equal per-request greedy ``generate``'s."""
    goal = result["meta"]["goal_time_ratio"]
    lines = ["| implementation | mode | attention path | requests/s | tokens/s | time / sdpa continuous batching | "
             f"within {goal}x | tokens equal generate |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        check = r.get("tokens_equal_generate")
        if check is None:
            equal = "(the reference)"
        elif not check["requests_checked"]:
            equal = "not checked"
        elif check["equal"]:
            equal = f"yes ({check['requests_checked']} requests)"
        else:
            equal = f"**no**: {len(check['requests_differing'])} of {check['requests_checked']} differ"
        within = r.get("within_goal")
        within = ("(baseline)" if r["mode"] != "continuous batching" else "(the reference)") if within is None \
            else ("yes" if within else "**no**")
        lines.append(f"| `{r['implementation']}` | {r['mode']} | {r['path']} | {r['requests_per_s']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {r['time_ratio_to_sdpa_cb']:.2f} | {within} | {equal} |")
    return "\n".join(lines)


def serving_summary(result: dict) -> str:
    """The workload, the model, the measurement and the machine of a ``scripts/bench_serving.py`` run."""
    m = result["meta"]
    w, mo, cb, v = m["workload"], m["model"], m["continuous_batching"], m["versions"]
    load = ", ".join(f"{x:.1f}" for x in m["load_average_start"])
    load_end = ", ".join(f"{x:.1f}" for x in m["load_average_end"])
    return (f"{w['requests']} requests (prompts of {', '.join(map(str, w['prompt_lengths']))} tokens in turn, "
            f"{w['prompt_tokens']} in all), {w['new_tokens']} greedy new tokens each; random-init Llama, "
            f"{mo['layers']} layers, hidden {mo['hidden']}, heads {mo['heads']}/{mo['kv_heads']}, MLP {mo['mlp']}; "
            f"continuous batching with pages of {cb['page_size']} tokens, at most {cb['max_batch_tokens']} tokens and "
            f"{cb['max_requests_per_batch']} requests per forward. Median of {m['repeats']} interleaved repeats; the "
            f"ratio is the median over repeats of the row's time over sdpa's continuous-batching time in the same "
            f"repeat (> 1: slower). `{m['command']}`, {m['date']}, {m['machine']['cpus']}-core {m['machine']['cpu']} "
            f"CPU, {m['threads']} thread(s), torch {v['torch']}, transformers {v['transformers']}, commit "
            f"{v.get('commit')}; load average {load} at the start, {load_end} at the end.")


def serving() -> str:
    """docs/benchmarks.md's serving table, from ``SERVING_RUN``."""
    result = json.loads((ROOT / SERVING_RUN).read_text())
    return (f"{serving_summary(result)}\n\n{serving_table(result)}\n\n"
            f"([{SERVING_RUN}](../{SERVING_RUN}), [bench/serving/README.md](../bench/serving/README.md))")


def _main_section(name: str) -> Callable[[], str]:
    def render() -> str:
        from hf_attnorm.__main__ import SECTIONS

        return SECTIONS[name]()

    return render


#: the published runs the speed-goal table joins: the kernel benchmark (prefill) and the decode curve
SPEED_RUNS = {"kernels": "bench/kernels/bench_kernels.json", "decode": "bench/decode/curve.json",
              "kernels_recheck": "bench/kernels/recheck/bench_kernels.json",
              "kernels_added": "bench/kernels/added/bench_kernels.json",
              "decode_added": "bench/decode/added/curve.json"}
#: what must agree between a published run and a run of the implementations added after it (same command, --only)
_KERNEL_SHAPE = ("B", "H", "Hkv", "d", "dtype", "causal", "threads", "repeats")
_DECODE_SHAPE = ("model", "steps", "repeats", "threads")


def _added_rows(published: dict, key: str, shape: tuple[str, ...], by: str) -> tuple[list[dict], dict | None]:
    """Rows of implementations registered after a published run, timed later by the same command restricted to
    them (each ratio against SDPA measured in that run's own process): only rows the published run lacks, and only
    from a run of the same shape started after it."""
    path = ROOT / SPEED_RUNS[key]
    if not path.exists():
        return [], None
    added = json.loads(path.read_text())
    pm, am = published["meta"], added["meta"]
    if any(pm.get(f) != am.get(f) for f in shape) or am.get("date", "") < pm.get("date", ""):
        return [], None
    have = {r[by] for r in published["rows"]}
    return [r for r in added["rows"] if r[by] not in have], am


def _rechecked_rows(kern: dict) -> tuple[dict[tuple[str, int], dict], dict | None]:
    """The recheck of the published kernel run ((row, n) -> its fast-path record, and the recheck's meta): rows that
    missed their goal by a small margin, timed again right after with more pairs. Only a recheck of the same shape,
    dtype and threads started after the published run counts (an older one belongs to an earlier run)."""
    path = ROOT / SPEED_RUNS["kernels_recheck"]
    if not path.exists():
        return {}, None
    rk = json.loads(path.read_text())
    km, rm = kern["meta"], rk["meta"]
    same = all(km.get(f) == rm.get(f) for f in ("B", "H", "Hkv", "d", "dtype", "causal", "threads"))
    if not same or rm.get("date", "") < km.get("date", ""):
        return {}, None
    return {(r["row"], r["n"]): r for r in rk["rows"] if r["path"] != "reference"}, rm


def speed_goals() -> str:
    """Every implementation (``hf_attnorm.available()``) with its forward and forward+backward ratios to SDPA softmax
    at each length, its decode-step ratio to sdpa at each context, its goal and whether it meets it, and the reason
    (``hf_attnorm.lab.speed.goals.why``) where it does not."""
    import hf_attnorm
    from hf_attnorm.lab.speed import goals as goals

    kern = json.loads((ROOT / SPEED_RUNS["kernels"]).read_text())
    dec = json.loads((ROOT / SPEED_RUNS["decode"]).read_text())
    rechecked, recheck_meta = _rechecked_rows(kern)
    kern_added, kern_added_meta = _added_rows(kern, "kernels_added", _KERNEL_SHAPE, "row")
    dec_added, dec_added_meta = _added_rows(dec, "decode_added", _DECODE_SHAPE, "implementation")
    added_names = {r["row"] for r in kern_added} | {r["implementation"] for r in dec_added}
    fast = [rechecked.get((r["row"], r["n"]), r) for r in [*kern["rows"], *kern_added] if r["path"] != "reference"]
    lengths = sorted({r["n"] for r in fast})
    contexts = sorted({r["context"] for r in dec["rows"]})
    head = (["implementation", "prefill path"] + [f"fwd n={n}" for n in lengths]
            + [f"fwd+bwd n={n}" for n in lengths] + ["decode path"] + [f"decode L={c}" for c in contexts]
            + ["goal (prefill / decode)", "at goal", "why not"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    met = prefill_met = decode_met = 0
    for name in hf_attnorm.available():
        k = {r["n"]: r for r in fast if r["row"] == name}
        d = {r["context"]: r for r in [*dec["rows"], *dec_added] if r["implementation"] == name}
        if len(k) < len(lengths) or len(d) < len(contexts):
            lines.append("| " + " | ".join([f"`{name}`"] + ["not measured in this run"] * (len(head) - 1)) + " |")
            continue
        prefill = {**{("fwd", n): k[n]["fwd_ratio"] for n in lengths},
                   **{("fwd+bwd", n): k[n]["fwd_bwd_ratio"] for n in lengths}}
        decode = {c: d[c]["ratio_to_sdpa"] for c in contexts}
        miss = goals.misses(name, prefill, decode)
        met += not miss
        prefill_met += not any(not m.startswith("decode") for m in miss)
        decode_met += not any(m.startswith("decode") for m in miss)
        paths = " / ".join(dict.fromkeys(p for r in k.values() for p in (r.get("path_fwd", r["path"]), r["path"])))
        goal = (f"< 1 from n = {goals.LINEAR_FROM}" if goals.is_linear(name)
                else f"≤ {goals.prefill_goal(name):.2f} / ≤ {goals.DECODE_GOAL:.2f}")
        marked = f"`{name}` †" if any((name, n) in rechecked for n in lengths) else f"`{name}`"
        marked += " ‡" if name in added_names else ""
        cells = ([marked, paths] + [f"{k[n]['fwd_ratio']:.2f}" for n in lengths]
                 + [f"{k[n]['fwd_bwd_ratio']:.2f}" for n in lengths] + [d[contexts[-1]]["path"]]
                 + [f"{d[c]['ratio_to_sdpa']:.2f}" for c in contexts]
                 + [goal, "yes" if not miss else "no: " + ", ".join(miss),
                    "" if not miss else goals.why(name, miss) or "NO REASON RECORDED"])
        lines.append("| " + " | ".join(cells) + " |")
    km, dm = kern["meta"], dec["meta"]
    load = ", ".join(f"{x:.1f}" for x in km.get("load_average_start", []))
    base = ", ".join(f"{v['fwd_ms']:.1f} / {v['fwd_bwd_ms']:.1f} ms at n = {n}"
                     for n, v in kern["sdpa_softmax"].items())
    total = len(hf_attnorm.available())
    recheck = "" if recheck_meta is None else (
        f" † prefill ratios from the recheck right after the run (rows that missed by a small margin, timed again "
        f"with {recheck_meta['repeats']} pairs: `{recheck_meta['command']}`, load average at the start "
        f"{recheck_meta['load_average_start'][0]:.1f}; [{SPEED_RUNS['kernels_recheck']}]"
        f"(../{SPEED_RUNS['kernels_recheck']}); the run's own ratios are in its JSON).")
    if kern_added_meta is not None or dec_added_meta is not None:
        runs = [f"`{m['command']}` ([{SPEED_RUNS[key]}](../{SPEED_RUNS[key]}))"
                for m, key in ((kern_added_meta, "kernels_added"), (dec_added_meta, "decode_added")) if m]
        recheck += (" ‡ implementations registered after the run, timed later by the same command restricted to "
                    f"them, each against SDPA in its own process: {'; '.join(runs)}.")
    return ("\n".join(lines) + f"\n\n{met} of {total} implementations at every goal; {prefill_met} at the prefill "
            f"goal, {decode_met} at the decode goal. The per-step overhead shared by every decode row: "
            f"{goals.DECODE_SHARED}.\n\nPrefill: "
            f"`{km.get('command', 'scripts/bench_kernels.py')}` ({km['dtype']}, causal, B = {km['B']}, H = {km['H']}, "
            f"d = {km['d']}, {km['threads']} threads, median of {km['repeats']} paired ratios, torch {km['torch']}, "
            f"load average at the start {load}; SDPA softmax forward / forward+backward {base}; "
            f"[{SPEED_RUNS['kernels']}](../{SPEED_RUNS['kernels']})). Decode: `{dm['command']}` (one cached step of a "
            f"tiny Llama, {dm['model']['layers']} layers, hidden {dm['model']['hidden']}, "
            f"{dm['model']['heads']}/{dm['model']['kv_heads']} heads, against transformers' sdpa on "
            + ("a twin of the model (the same weights), their steps alternating one by one, median ratio of "
               if any("sdpa_step_ms" in r for r in dec["rows"]) else "the same model, median of ")
            + f"{dm['repeats']} interleaved repeats of {dm['steps']} steps, {dm['threads']} threads, load "
            f"average at the start {dm['load_average_at_start']:.1f}; [{SPEED_RUNS['decode']}]"
            f"(../{SPEED_RUNS['decode']})).{recheck}")


def _gpu_run() -> tuple[Path, dict] | None:
    """The newest GPU check run under bench/gpu/ whose benchmark timed the anchors (by its start time)."""
    runs = []
    for path in sorted((ROOT / "bench" / "gpu").glob("*/results.json")):
        result = json.loads(path.read_text())
        if (result.get("bench") or {}).get("anchors") is not None:
            runs.append((result.get("started_utc", ""), path, result))
    if not runs:
        return None
    _, path, result = max(runs, key=lambda r: r[0])
    return path, result


def gpu_goals() -> str:
    """Every implementation's GPU goal and, from the newest GPU run with the anchors, its ratios at n >= the goal's
    length, whether it meets the goal and the reason where not; then the anchors' own rows."""
    import hf_attnorm
    from hf_attnorm.lab.speed import goals as goals
    from hf_attnorm.lab.speed import gpu_anchors

    found = _gpu_run()
    if found is None:
        lines = ["| implementation | GPU goal (bf16, causal, n ≥ "
                 f"{goals.GPU_GOAL_FROM}: forward / forward+backward) |", "|---|---|"]
        lines += [f"| `{name}` | {goals.gpu_goal(name).text()} |" for name in hf_attnorm.available()]
        return ("\n".join(lines) + "\n\nNo GPU check run with the anchors yet: the prepared command in "
                "[triton.md](triton.md#the-gpu-machine-this-project-is-checked-on) writes bench/gpu/<device>/ and "
                "this table is then generated from its results.json.")
    path, result = found
    recs = [r for r in result["bench"]["records"] if r.get("status") == "ok"]
    shapes = sorted({(r["n"], r["B"], r["H"], r["d"]) for r in result["bench"]["records"]
                     if r["n"] >= goals.GPU_GOAL_FROM})
    ns = [n for n, *_ in shapes]
    by = {(r["row"], r["n"]): r for r in recs}

    def ratio(row: str, n: int, key: str) -> float | None:
        rec = by.get((row, n))
        return None if rec is None else rec.get(f"{key}_vs_sdpa")

    head = (["implementation", "path"] + [f"{m} n={n}" for n in ns for m in ("fwd", "fwd+bwd")]
            + ["over its anchor (fwd / fwd+bwd)", "goal", "at goal", "why not"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    met = measured = 0
    for name in hf_attnorm.available():
        goal = goals.gpu_goal(name)
        cells = [f"`{name}`", " / ".join(dict.fromkeys(str(by[(name, n)].get("path")) for n in ns
                                                       if (name, n) in by)) or "—"]
        values = {}
        for n in ns:
            for key, label in (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd")):
                value = ratio(name, n, key)
                cells.append("—" if value is None else f"{value:.2f}")
                if value is not None:
                    values[label, n] = value
        anchor_values, anchor_cells = {}, []
        for anchor in gpu_anchors.anchors_for(name):
            row = gpu_anchors.row_name(anchor)
            parts = []
            for n in ns:
                mine, theirs = by.get((name, n)), by.get((row, n))
                if mine is None or theirs is None:
                    continue
                pair = []
                for key, label in (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd")):
                    value = mine[f"{key}_ms"] / theirs[f"{key}_ms"]
                    anchor_values[anchor.name, label, n] = value
                    pair.append(f"{value:.2f}")
                parts.append(f"n={n} {' / '.join(pair)}")
            if parts:
                anchor_cells.append(f"{anchor.name}: {'; '.join(parts)}")
        cells.append("; ".join(anchor_cells) or "—")
        miss = goals.gpu_misses(name, values, anchor_values)
        complete = len(values) == 2 * len(ns)
        measured += complete
        met += complete and not miss
        cells += [goal.text(), "not measured" if not complete else "yes" if not miss else "no: " + ", ".join(miss),
                  "" if not miss else goals.GPU_REASONS.get(name, "NO REASON RECORDED")]
        lines.append("| " + " | ".join(cells) + " |")
    anchor_lines = ["| anchor | of | source | " + " | ".join(f"{m} n={n}" for n in ns for m in ("fwd", "fwd+bwd"))
                    + " | status |", "|" + "---|" * (4 + 2 * len(ns))]
    for anchor in gpu_anchors.ANCHORS.values():
        row = gpu_anchors.row_name(anchor)
        status = sorted({r["status"] for r in result["bench"]["records"] if r["row"] == row and r["n"] in ns})
        cells = [anchor.name, ", ".join(f"`{o}`" for o in anchor.of), anchor.source]
        cells += ["—" if ratio(row, n, key) is None else f"{ratio(row, n, key):.2f}"
                  for n in ns for key in ("fwd", "fwd_bwd")]
        anchor_lines.append("| " + " | ".join(cells + ["; ".join(status)]) + " |")
    dev, ver = result["device"], result["versions"]
    rel = path.relative_to(ROOT)
    return ("\n".join(lines) + f"\n\n{met} of {measured} measured implementations at their GPU goal. The anchors in "
            "the same run (time over SDPA flash):\n\n" + "\n".join(anchor_lines)
            + f"\n\n`{result['command']}` on {dev['name']}, {result['started_utc']} UTC, commit "
            f"{ver.get('git_commit')}, torch {ver.get('torch')}, triton {ver.get('triton')}; shapes "
            + ", ".join(f"B{b} H{h} n{n} d{d}" for n, b, h, d in shapes)
            + f" (bf16, causal); [{rel}](../{rel}).")


def keyword_scan() -> str:
    """The keyword scan of transformers' attention classes (bench/families/keywords.json, scripts/scan_keywords.py)."""
    scan = json.loads((ROOT / "bench" / "families" / "keywords.json").read_text())
    by_keyword: dict[str, list[str]] = {}
    for row in scan["classes"]:
        for k in row["refused"]:
            by_keyword.setdefault(k, []).append(row["folder"])
    refused = "; ".join(f"`{k}` ({', '.join(sorted(set(v)))})" for k, v in sorted(by_keyword.items()))
    return (f"`{scan['command']}` on transformers {scan['transformers']}, {scan['date']} ([bench/families/keywords.md]"
            f"(../bench/families/keywords.md)): {scan['attention_classes']} attention classes in {scan['folders']} "
            f"model folders call the interface; {scan['refused_classes']} pass a keyword hf_attnorm refuses, and "
            f"their families are refused at load naming it: {refused}.")


#: what each route of transformers serve's app does (a route missing here is listed by its endpoint function's name)
SERVE_ROUTES = {
    "/v1/chat/completions": "chat completions, streamed or not",
    "/v1/completions": "legacy completions of a text prompt",
    "/v1/responses": "OpenAI's Responses API (streamed unless `stream` is false)",
    "/v1/systemone": "typed decisions (choice, score, yes/no) with a probability per answer; no text generated",
    "/v1/audio/transcriptions": "speech to text (speech models only)",
    "/v1/models": "the served model",
    "/health": "200 while serving; 503 while continuous batching's worker is dead (the command replaces it)",
    "/load_model": "loads a model by name, streaming its progress",
    "/reset": "unloads the model (the next request loads it again)",
    "/openapi.json": "FastAPI's description of the API",
    "/docs": "FastAPI's pages for it",
    "/docs/oauth2-redirect": "FastAPI's pages for it",
    "/redoc": "FastAPI's pages for it",
}


def serve_endpoints() -> str:
    """transformers serve's routes, read from the app the installed transformers builds, with the guard's part."""
    from hf_attnorm.hf import compat
    from hf_attnorm.serve_guard import ROUTES

    if compat.serve_missing() or not compat.serve_extra_installed():
        raise SystemExit("render_readme.py: error: the serve-endpoints block needs transformers serve and its extra "
                         "(pip install -e '.[serve]')")
    rows = ["| route | methods | what it does | the guard |", "|---|---|---|---|"]
    routes = compat.serve_app_routes()
    fastapi_own = [r for r in routes if r[2] in ("openapi", "swagger_ui_html", "swagger_ui_redirect", "redoc_html")]
    for path, methods, endpoint in [*(r for r in routes if r not in fastapi_own), *fastapi_own]:
        guard = ("checked (fields, prompt, new tokens); stopped when its client leaves" if path in ROUTES else
                 "errors in OpenAI's shape" if path.startswith("/v1/") else "passed through")
        rows.append(f"| `{path}` | {', '.join(methods)} | {SERVE_ROUTES.get(path, f'`{endpoint}`')} | {guard} |")
    return "\n".join(rows)


GENERATORS: dict[str, Callable[[], str]] = {
    **{name: _main_section(name) for name in ("implementations", "options", "learned", "versions", "torch-features")},
    "families": families,
    "main-job": main_job,
    "conversion": conversion,
    "conversion-runs": conversion_runs,
    "conversion-curve": conversion_curve,
    "conversion-levers": conversion_levers,
    "conversion-longer": conversion_longer,
    "conversion-texts": conversion_texts,
    "transfer-learning-rates": transfer_learning_rates,
    "performance": performance,
    "serving": serving,
    "serve-endpoints": serve_endpoints,
    **{f"compare-{task}": task_table(task) for task in ("mqar", "passkey", "lm")},
    "compare-claims": claims,
    "compare-second-run": second_run,
    "compare-rerun": rerun_estimate,
    "compare-budget-curves": budget_curves,
    "compare-budget-change": budget_change,
    "compare-earlier-verdicts": earlier_verdicts,
    "claims-list": claims_list,
    "keyword-scan": keyword_scan,
    "speed-goals": speed_goals,
    "gpu-goals": gpu_goals,
    "kernels-run1": kernel_table("bench/kernels/history/2026-11-22-first-run/bench_kernels.json"),
    "kernels-run3": kernel_table("bench/kernels/history/2026-11-23-added-kernels/bench_kernels.json"),
    "kernels-run4": kernel_table("bench/kernels/history/2026-11-27-attention-variants/bench_kernels.json"),
}


def render(text: str, cache: dict[str, str] | None = None) -> str:
    """``text`` with every generated block replaced by its generator's output; unknown block names raise."""
    cache = {} if cache is None else cache

    def replace(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in GENERATORS:
            raise SystemExit(f"render_readme.py: error: unknown generated block {name!r}; known: "
                             f"{', '.join(GENERATORS)}")
        if name not in cache:
            cache[name] = GENERATORS[name]().rstrip("\n")
        return m.group(1) + cache[name] + "\n" + m.group(4)

    opened = text.count("<!-- generated:")
    if opened != len(BLOCK.findall(text)):
        raise SystemExit(f"render_readme.py: error: {opened} '<!-- generated:NAME -->' markers but only "
                         f"{len(BLOCK.findall(text))} blocks closed by '<!-- /generated:NAME -->' (same NAME)")
    return BLOCK.sub(replace, text)


def check(paths: list[Path]) -> list[str]:
    """A unified diff per document that differs from its rendering (empty: all up to date)."""
    cache: dict[str, str] = {}
    diffs = []
    for path in paths:
        text = path.read_text()
        new = render(text, cache)
        if new != text:
            diffs.append("".join(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                      f"{path.name} (on disk)", f"{path.name} (generated)")))
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; print a diff and exit 1 when a document differs from the generators")
    parser.add_argument("files", nargs="*", type=Path,
                        help=f"documents to render (default: {', '.join(DOCUMENTS)}, relative to the repository)")
    args = parser.parse_args(argv)
    paths = args.files or [ROOT / d for d in DOCUMENTS]
    if args.check:
        diffs = check(paths)
        for d in diffs:
            print(d)
        return 1 if diffs else 0
    cache: dict[str, str] = {}
    for path in paths:
        text = path.read_text()
        new = render(text, cache)
        if new != text:
            path.write_text(new)
            print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
