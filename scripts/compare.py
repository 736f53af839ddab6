#!/usr/bin/env python
"""Compare attention normalizers: train the same tiny model with each, then measure how each extrapolates.

With no arguments: a tiny Llama (RoPE, 4 layers, hidden 128, real GPT-2 tokenizer) is pretrained on the embedded
Shakespeare corpus once per attention implementation (softmax, softmax1, ssmax, symax, sigmoid, max_gradient) with
the same seed (same initial weights and data order) and the same step budget at context L = 128; each model is then
evaluated on the same validation tokens at 1x, 4x and 8x L (perplexity per context and per position bucket), and
its attention is inspected at 8x L (entropy and max weight vs n, sink share, mass, hidden-state kurtosis).

Writes into --output_dir (default runs/compare): results.json (everything), results.md (the table),
plots/val_loss.png, plots/ppl_vs_context.png, plots/position_buckets.png, plots/entropy_vs_n.png, one folder per
run (the trained model), and a model card per run into --model_card_dir (default model_cards/). Prints the table.

Budgets: ``--budget default`` (the README's run, about 12 minutes on 2 idle CPU cores), ``quick`` (a few
minutes), ``micro`` (seconds; tests). Any budget value can be overridden by its flag.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

# nothing downloads from the hub at run time unless the user says otherwise
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
try:
    import hf_attnorm  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_IMPLEMENTATIONS = ["softmax", "softmax1", "ssmax", "symax", "sigmoid", "max_gradient"]

#: budget name -> training and evaluation settings (each overridable by the flag of the same name)
BUDGETS: dict[str, dict[str, Any]] = {
    "default": {"model_size": "tiny", "block_size": 128, "max_train_steps": 200, "batch_size": 4,
                "learning_rate": 2e-3, "warmup_steps": 20, "eval_steps": 40, "max_eval_samples": 16,
                "eval_tokens": 8192, "factors": [1, 4, 8]},
    "quick": {"model_size": "tiny", "block_size": 64, "max_train_steps": 50, "batch_size": 4,
              "learning_rate": 2e-3, "warmup_steps": 5, "eval_steps": 25, "max_eval_samples": 16,
              "eval_tokens": 2048, "factors": [1, 4, 8]},
    "micro": {"model_size": "micro", "block_size": 16, "max_train_steps": 4, "batch_size": 4,
              "learning_rate": 2e-3, "warmup_steps": 0, "eval_steps": 2, "max_eval_samples": 4,
              "eval_tokens": 256, "factors": [1, 4, 8]},
}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="compare.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--implementations", nargs="+", default=DEFAULT_IMPLEMENTATIONS,
                   help="attention implementations to compare: name or name:key=value,... (attnorm options), "
                        "e.g. symax:eta=0.5; see `python scripts/pretrain.py --list`")
    p.add_argument("--budget", choices=list(BUDGETS), default="default",
                   help="preset of the values below: " + "; ".join(
                       f"{k}: {v['model_size']} model, L={v['block_size']}, {v['max_train_steps']} steps"
                       for k, v in BUDGETS.items()))
    p.add_argument("--model_type", choices=["llama", "gpt2"], default="llama",
                   help="model family (llama: RoPE, runs at any context; gpt2: learned positions, cannot run past "
                        "--max_position_embeddings)")
    p.add_argument("--model_size", choices=["micro", "tiny", "small", "base"], default=None,
                   help="model_zoo size preset (default: the budget's)")
    p.add_argument("--block_size", type=_positive_int, default=None,
                   help="training context L in tokens (default: the budget's)")
    p.add_argument("--max_position_embeddings", type=_positive_int, default=None,
                   help="position table size (matters for gpt2 only; default max(L, 1024))")
    p.add_argument("--max_train_steps", type=_positive_int, default=None,
                   help="optimizer steps per run, the same for every run (default: the budget's)")
    p.add_argument("--batch_size", type=_positive_int, default=None, help="blocks per step (default: the budget's)")
    p.add_argument("--learning_rate", type=_positive_float, default=None,
                   help="peak AdamW learning rate, cosine schedule (default: the budget's)")
    p.add_argument("--warmup_steps", type=int, default=None, help="linear warm-up steps (default: the budget's)")
    p.add_argument("--eval_steps", type=_positive_int, default=None,
                   help="validation loss every N steps during training (default: the budget's)")
    p.add_argument("--max_eval_samples", type=_positive_int, default=None,
                   help="validation blocks used during training, spread over the split (default: the budget's)")
    p.add_argument("--eval_tokens", type=_positive_int, default=None,
                   help="validation tokens for the extrapolation evaluation, the same at every context "
                        "(rounded down to a multiple of the longest context; default: the budget's)")
    p.add_argument("--factors", type=_positive_float, nargs="+", default=None,
                   help="evaluation contexts as multiples of L (default: 1 4 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of every run: same initial weights and data order")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--output_dir", default="runs/compare", help="where runs, results and plots go")
    p.add_argument("--model_card_dir", default="model_cards", help="folder receiving one model card per run")
    p.add_argument("--reuse", action="store_true",
                   help="reuse a run folder whose finished training used exactly the same settings (only "
                        "evaluate it again) instead of training it again")
    return p


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """The budget's values with the flags given on top."""
    values = dict(BUDGETS[args.budget])
    for key in values:
        given = getattr(args, key, None)
        if given is not None:
            values[key] = given
    if values["warmup_steps"] < 0:
        raise SystemExit(f"compare.py: error: --warmup_steps must be >= 0, got {values['warmup_steps']}")
    values["factors"] = sorted(set(values["factors"]))
    return values


def label_of(spec: str) -> str:
    """A folder-safe name of an implementation spec: ``symax:eta=0.5`` -> ``symax-eta-0.5``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", spec).strip("-")


def training_argv(name: str, options: dict[str, Any], cfg: dict[str, Any], args: argparse.Namespace,
                  out: Path, card_name: str) -> list[str]:
    argv = ["--model_type", args.model_type, "--model_size", cfg["model_size"], "--attn_implementation", name,
            "--block_size", str(cfg["block_size"]), "--max_train_steps", str(cfg["max_train_steps"]),
            "--per_device_train_batch_size", str(cfg["batch_size"]), "--per_device_eval_batch_size", "8",
            "--learning_rate", str(cfg["learning_rate"]), "--num_warmup_steps", str(cfg["warmup_steps"]),
            "--lr_scheduler_type", "cosine", "--seed", str(args.seed), "--eval_steps", str(cfg["eval_steps"]),
            "--max_eval_samples", str(cfg["max_eval_samples"]), "--output_dir", str(out), "--overwrite_output_dir",
            "--model_card_dir", str(args.model_card_dir), "--model_card_name", card_name]
    for key, value in options.items():
        argv += ["--attnorm", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    if args.max_position_embeddings:
        argv += ["--max_position_embeddings", str(args.max_position_embeddings)]
    if args.threads:
        argv += ["--torch_threads", str(args.threads)]
    return argv


#: training flags that say where things go or how fast, not what is trained (ignored when deciding on --reuse)
PLACEMENT_FLAGS = {"--output_dir": 1, "--model_card_dir": 1, "--model_card_name": 1, "--torch_threads": 1,
                   "--overwrite_output_dir": 0}


def training_key(argv: list[str]) -> list[str]:
    """``argv`` without the placement flags: two runs with the same key train the same model."""
    key, i = [], 0
    while i < len(argv):
        if argv[i] in PLACEMENT_FLAGS:
            i += 1 + PLACEMENT_FLAGS[argv[i]]
            continue
        key.append(argv[i])
        i += 1
    return key


def train_or_reuse(argv: list[str], out: Path, reuse: bool) -> tuple[dict[str, Any], bool]:
    """Train (``run_pretraining``), or with ``reuse`` return the summary of a finished run in ``out`` that was
    trained with the same settings."""
    from hf_attnorm.lab.training import SUMMARY_FILE, run_pretraining

    marker = out / "compare_training_key.json"
    if reuse and (out / SUMMARY_FILE).is_file() and marker.is_file():
        if json.loads(marker.read_text()) == training_key(argv):
            return json.loads((out / SUMMARY_FILE).read_text()), True
        print(f"--reuse: {out} was trained with other settings; training again", flush=True)
    summary = run_pretraining(argv)
    marker.write_text(json.dumps(training_key(argv)))
    return summary, False


def attention_summary(diag, train_length: int) -> dict[str, Any]:
    """Numbers for the table from a ``Diagnostics``: entropy / ln n over queries that see more than L keys, the
    sink share and row mass (means over layers and heads), and the largest hidden-state kurtosis."""
    import torch

    ratios, weights = [], []
    for layer in diag.layers:
        n = torch.tensor(layer.n, dtype=torch.float64)
        ent = torch.tensor(layer.head_mean("entropy"), dtype=torch.float64)
        rows = torch.tensor(layer.rows, dtype=torch.float64)
        sel = (n > train_length) & ~torch.isnan(ent)
        if bool(sel.any()):
            ratios.append(float((ent[sel] / n[sel].log() * rows[sel]).sum() / rows[sel].sum()))
            weights.append(1.0)
    heads = [h for layer in diag.layers for h in layer.summary()]

    def mean(key: str) -> float:
        vals = [h[key] for h in heads if not math.isnan(h[key])]
        return sum(vals) / len(vals) if vals else math.nan

    return {
        "entropy_over_log_n_beyond_L": sum(ratios) / len(ratios) if ratios else math.nan,
        "sink_share": mean("sink_share"),
        "mass": mean("mass"),
        "max_weight": mean("max_weight"),
        "kurtosis_max_layer": max((h["kurtosis"] for h in diag.hidden), default=math.nan),
    }


def append_card_section(path: Path, text: str) -> None:
    """Add (or replace) compare.py's section at the end of a model card."""
    marker = "<!-- hf_attnorm compare.py -->"
    body = path.read_text(encoding="utf-8")
    if marker in body:
        body = body[:body.index(marker)].rstrip() + "\n"
    path.write_text(f"{body.rstrip()}\n\n{marker}\n{text}\n", encoding="utf-8")


def card_section(run: dict[str, Any]) -> str:
    ext = run["extrapolation"]
    lines = ["## Length extrapolation (scripts/compare.py)", "",
             f"Trained at L = {ext['train_length']} tokens; evaluated on the same {ext['tokens_used']} validation "
             f"tokens cut into windows of each context ({ext['position_encoding']} positions).", "",
             "| context | perplexity | " + " | ".join(f"pos {b['start']}–{b['end']}" for b in
                                                       ext["contexts"][-1]["buckets"]) + " |",
             "|---|---|" + "---|" * len(ext["contexts"][-1]["buckets"])]
    n_b = len(ext["contexts"][-1]["buckets"])
    for c in ext["contexts"]:
        if c["status"] != "ok":
            lines.append(f"| {c['context']} | skipped: {c['reason']} |" + " |" * n_b)
            continue
        cells = [f"{b['perplexity']:.2f}" for b in c["buckets"]] + [""] * (n_b - len(c["buckets"]))
        lines.append(f"| {c['context']} | {c['perplexity']:.2f} | " + " | ".join(cells) + " |")
    att = run["attention"]
    lines += ["", f"Attention at {run['diagnostics_context']} tokens: entropy / ln n beyond L "
                  f"{att['entropy_over_log_n_beyond_L']:.3f}, sink share {att['sink_share']:.3f}, mean row mass "
                  f"{att['mass']:.3f}, max hidden-state kurtosis {att['kurtosis_max_layer']:.1f}."]
    return "\n".join(lines)


def _fmt(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—" if x is None else str(x)
    return f"{x:.{digits}f}"


def markdown_table(runs: list[dict[str, Any]], cfg: dict[str, Any]) -> str:
    ok = [r for r in runs if r.get("status") == "ok"]
    contexts = [c["context"] for c in ok[0]["extrapolation"]["contexts"]] if ok else []
    head = (["implementation", "val loss @ L (training)"] + [f"ppl @ {c}" for c in contexts]
            + [f"ppl {contexts[-1]} / {contexts[0]}" if contexts else "ratio", "entropy / ln n (n > L)",
               "sink share", "max kurtosis", "train s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        if r.get("status") != "ok":
            lines.append(f"| `{r['implementation']}` | failed: {r.get('error', '?')[:80]} |" + " |" * (len(head) - 2))
            continue
        ppl = [c["perplexity"] for c in r["extrapolation"]["contexts"]]
        first = ppl[0]
        ratio = ppl[-1] / first if ppl[-1] is not None and first else None
        att = r["attention"]
        cells = [f"`{r['implementation']}`", _fmt(r["final_val_loss"], 3)] + [_fmt(p) for p in ppl] + [
            _fmt(ratio), _fmt(att["entropy_over_log_n_beyond_L"], 3), _fmt(att["sink_share"], 3),
            _fmt(att["kurtosis_max_layer"], 1), _fmt(r["train_seconds"], 0)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    cfg = resolve(args)
    import torch

    import hf_attnorm
    from hf_attnorm.lab import plots
    from hf_attnorm.lab.data import load_tokenizer, shakespeare_documents
    from hf_attnorm.lab.diagnostics import diagnose
    from hf_attnorm.lab.evaluation import (
        EvaluationError,
        extrapolation_contexts,
        length_extrapolation,
        load_model,
        parse_variant,
        spread_chunks,
    )

    try:
        specs = [(spec, *parse_variant(spec)) for spec in args.implementations]
    except (EvaluationError, hf_attnorm.AttnormError) as e:
        raise SystemExit(f"compare.py: error: {e}") from None
    bad = [s for s, name, _ in specs if name in ("sdpa", "eager")]
    if bad:
        raise SystemExit(f"compare.py: error: {bad}: compare trains hf_attnorm implementations (use softmax for "
                         "the standard attention)")
    labels = [label_of(s) for s, _, _ in specs]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"compare.py: error: --implementations repeats an entry: {args.implementations}")
    if args.threads:
        torch.set_num_threads(args.threads)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    L = cfg["block_size"]
    tokenizer = load_tokenizer(args.model_type)
    # tokenised exactly as the training data (speech by speech, then concatenated): tokenising the whole text at
    # once splits every "\n\n" between speeches into two tokens the models never saw in training
    encoded = tokenizer(shakespeare_documents("validation"), add_special_tokens=False, verbose=False)["input_ids"]
    val_ids = torch.tensor([t for ids in encoded for t in ids])
    # the extrapolation sample: chunks of the longest context spread evenly over the whole validation split (the
    # same tokens for every context and run); GPT-2 cannot run past its position table, so its chunks are shorter
    limit = (args.max_position_embeddings or max(L, 1024)) if args.model_type == "gpt2" else None
    contexts = [c for c, _ in extrapolation_contexts(L, cfg["factors"]) if limit is None or c <= limit]
    if not contexts:
        raise SystemExit(f"compare.py: error: no evaluation context fits gpt2's {limit} positions")
    try:
        eval_ids = spread_chunks(val_ids, contexts[-1], cfg["eval_tokens"])
    except EvaluationError as e:
        raise SystemExit(f"compare.py: error: --eval_tokens: {e}") from None
    started = time.time()
    runs: list[dict[str, Any]] = []
    entropy_curves: dict[str, tuple[list[int], list[float]]] = {}
    for i, ((spec, name, options), label) in enumerate(zip(specs, labels)):
        print(f"\n[{i + 1}/{len(specs)}] {spec}: training {cfg['max_train_steps']} steps at L={L}", flush=True)
        run_dir = out_dir / label
        card_name = f"compare-{args.model_type}-{cfg['model_size']}-{label}"
        t0 = time.time()
        try:
            summary, reused = train_or_reuse(training_argv(name, options, cfg, args, run_dir, card_name), run_dir,
                                             args.reuse)
            t_train = time.time() - t0
            if reused:  # training wrote its card where it ran then: write it here too
                from hf_attnorm.lab.cards import write_model_card

                write_model_card(run_dir, summary, card_dir=args.model_card_dir, name=card_name)
            model = load_model(run_dir)
            ext = length_extrapolation(model, eval_ids, L, cfg["factors"], batch_size=4, progress=True)
            longest = max(c.context for c in ext.contexts if c.status == "ok")
            # up to 4 windows of the longest context: 4 query rows per n for the curves (memory ~ 4 H n^2 floats)
            diag = diagnose(model, eval_ids[:longest * min(4, len(eval_ids) // longest)].view(-1, longest))
        except Exception as e:  # one failing implementation must not cost the others their results
            print(f"[{i + 1}/{len(specs)}] {spec} FAILED: {type(e).__name__}: {e}", flush=True)
            runs.append({"implementation": spec, "status": "failed", "error": f"{type(e).__name__}: {e}"})
            continue
        entropy_curves[spec] = diag.entropy_curve(per_octave=12)
        run = {
            "implementation": spec, "status": "ok", "label": label, "output_dir": str(run_dir),
            "attnorm": summary.get("attnorm"), "reused": reused, "steps": summary["steps"],
            "train_seconds": summary["seconds"], "tokens_per_second": summary["tokens_per_second"],
            "eval_seconds": round(time.time() - t0 - t_train, 1),
            "train_losses": summary["train_losses"], "val_losses": summary["val_losses"],
            "final_val_loss": summary["final_val_loss"], "final_val_perplexity": summary["final_val_perplexity"],
            "parameters": summary.get("parameters"), "extrapolation": ext.to_dict(),
            "diagnostics_context": longest, "attention": attention_summary(diag, L),
            "diagnostics": diag.summary(), "model_card": None,
        }
        card = Path(args.model_card_dir) / f"{card_name}.md"
        section = card_section(run)
        for target in (card, run_dir / "README.md"):
            if target.is_file():
                append_card_section(target, section)
        run["model_card"] = str(card) if card.is_file() else None
        runs.append(run)
        ppl = ", ".join(f"{c.context}: {_fmt(c.perplexity)}" for c in ext.contexts)
        print(f"[{i + 1}/{len(specs)}] {spec}: val loss {summary['final_val_loss']:.3f}; perplexity {ppl} "
              f"({time.time() - t0:.0f} s)", flush=True)

    ok = [r for r in runs if r["status"] == "ok"]
    plot_dir = out_dir / "plots"
    plot_info = {}
    if ok:
        plot_info["val_loss"] = plots.plot_validation_loss(
            {r["implementation"]: r["val_losses"] for r in ok}, plot_dir / "val_loss.png",
            title=f"Validation loss at L={L} ({args.model_type} {cfg['model_size']}, same seed and data)")
        plot_info["ppl_vs_context"] = plots.plot_perplexity_vs_context(
            {r["implementation"]: [(c["context"], c["perplexity"]) for c in r["extrapolation"]["contexts"]]
             for r in ok}, plot_dir / "ppl_vs_context.png", train_length=L,
            title=f"Perplexity vs context (trained at L={L})")
        plot_info["position_buckets"] = plots.plot_position_buckets(
            {r["implementation"]: [c for c in r["extrapolation"]["contexts"] if c["status"] == "ok"][-1]["buckets"]
             for r in ok}, plot_dir / "position_buckets.png", train_length=L,
            title=f"Loss by position in {max(r['diagnostics_context'] for r in ok)}-token windows (trained at {L})")
        plot_info["entropy_vs_n"] = plots.plot_entropy_vs_n(entropy_curves, plot_dir / "entropy_vs_n.png",
                                                            train_length=L)
    table = markdown_table(runs, cfg)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    result = {
        "command": " ".join(["python scripts/compare.py", *argv]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "seconds": round(time.time() - started, 1),
        "load_average": load,
        "torch_threads": torch.get_num_threads(),
        "model_type": args.model_type, "budget": args.budget, "settings": cfg, "seed": args.seed,
        "validation_tokens": int(len(val_ids)),
        "runs": runs,
        "plots": {k: {"path": v.path, "series": v.series} for k, v in plot_info.items()},
        "table": table,
    }
    (out_dir / "results.json").write_text(json.dumps(result, indent=1, allow_nan=True))
    header = (f"Command: `{result['command']}` ({result['date']}, {result['seconds'] / 60:.1f} min, "
              f"{result['torch_threads']} threads, load average {', '.join(f'{x:.1f}' for x in load or [])})\n\n"
              f"{args.model_type} {cfg['model_size']}, trained {cfg['max_train_steps']} steps x {cfg['batch_size']} "
              f"blocks of L={L} tokens (seed {args.seed}); perplexities on the same "
              f"{len(eval_ids)} Shakespeare validation tokens (Macbeth, Twelfth Night; {len(eval_ids) // contexts[-1]}"
              f" chunks of {contexts[-1]} spread over the split) in non-overlapping windows.\n\n")
    (out_dir / "results.md").write_text(header + table + "\n")
    print("\n" + header + table)
    print(f"\nresults: {out_dir / 'results.json'}, {out_dir / 'results.md'}; plots: {plot_dir}; "
          f"cards: {args.model_card_dir}/ ({result['seconds'] / 60:.1f} min)")
    failed = [r["implementation"] for r in runs if r["status"] != "ok"]
    if failed:
        print(f"FAILED runs: {', '.join(failed)} (see results.json)", file=sys.stderr)
    return result


if __name__ == "__main__":
    res = main()
    sys.exit(1 if any(r["status"] != "ok" for r in res["runs"]) else 0)
