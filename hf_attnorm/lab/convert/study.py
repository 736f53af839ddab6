"""The conversion study (``scripts/convert_study.py``): which normalizers can the real SmolLM2-135M be converted to
cheaply, and does attention transfer beat plain fine-tuning at the same number of steps?

For each normalizer and seed: ``scripts/convert.py`` at its default budget (stage 1 then stage 2), and the control,
stage 2 alone with as many steps as both stages together. Perplexity on held-out Shakespeare: swapped with no
training, after stage 1, after stages 1 + 2, and the control. ``softmax`` is the reference: the original model
(swapped = unchanged) and its own fine-tune with the control's steps (what the text alone does to perplexity).
This module holds the plan and turns the runs' ``conversion.json`` files into ``results.json`` and its table;
``study_cli`` runs the study.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

#: implementation -> attnorm options of the study (learnable values switched on where the normalizer has one)
PLAN: dict[str, dict[str, Any]] = {
    "softmax1": {},
    "sigmoid": {"sigmoid_bias_learnable": True},
    "symax": {"eta_learnable": True},
    "linear": {},
    "entmax15": {},
    "ssmax": {},
    "stickbreaking": {},
    "hedgehog": {},
}
REFERENCE = "softmax"
#: the runs per implementation and seed: stage 1 + stage 2 on the next-token loss, the same with stage 2 on the KL to
#: the original model (--distill), and stage 2 alone with as many steps (the control)
KINDS = ("convert", "distill", "control")
#: the second held-out text (of another kind than the Shakespeare the runs train on)
OTHER_TEXT = "kjv"
#: the budget curve: each implementation's distilled conversion at these multiples of convert.py's default steps
#: (both stages scaled alike; 1 is the study's own ``distill`` runs), scored against the original model on the
#: second text
CURVE_IMPLEMENTATIONS = ("ssmax", "entmax15", "stickbreaking", "sigmoid", "symax", "hedgehog")
CURVE_BUDGETS = (1, 4, 16, 64)
#: recovered: within this factor of the original model's perplexity (the curve's threshold)
CURVE_NEAR = 1.10
#: levers measured against the curve's default recipe: name -> (what it changes, convert.py's flags)
LEVERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "full": ("stage 2 fine-tunes every weight (--finetune_mode full, its default rate 5e-5) instead of LoRA rank 8 on "
             "q/k/v/o", ("--finetune_mode", "full")),
    "stage1-3of4": ("three quarters of the steps in stage 1 instead of half (the same total)", ()),
}


def curve_seeds(budget: int) -> int:
    """Seeds per budget multiple: two where runs are short (up to 4x), one above."""
    return 2 if budget <= 4 else 1


def run_name(kind: str, seed: int, budget: int = 1, lever: str | None = None) -> str:
    """The folder of one run under runs/<implementation>/: ``<kind>[-<lever>][-x<budget>]-seed<N>`` (budget 1 and
    no lever: the study's own runs)."""
    return f"{kind}{f'-{lever}' if lever else ''}{f'-x{budget}' if budget != 1 else ''}-seed{seed}"


def curve_steps(steps: tuple[int, int], budget: int, lever: str | None = None) -> tuple[int, int]:
    """(stage-1, stage-2) steps of a curve run: the default's ``steps`` times ``budget``; the ``stage1-3of4`` lever
    moves a quarter of the total into stage 1."""
    transfer, finetune = steps[0] * budget, steps[1] * budget
    if lever == "stage1-3of4":
        total = transfer + finetune
        transfer = round(0.75 * total)
        finetune = total - transfer
    return transfer, finetune


#: the published claim the study tests, per method family
CLAIM = ("LoLCATs (Zhang et al. 2024, arXiv:2410.10254) and Hedgehog (Zhang et al. 2024, arXiv:2402.04347): "
         "attention transfer (matching the softmax attention outputs layer by layer) recovers most of the quality "
         "of a linearised model with a small training budget, better than fine-tuning alone")


def _ppl(summary: Mapping[str, Any], point: str, length: str, text: str | None = None) -> float | None:
    """Perplexity of a run at an evaluation point and context, on the validation text (``text`` None) or on one of
    its --eval_texts."""
    scored = summary.get("perplexity", {}) if text is None else \
        summary.get("eval_texts", {}).get(text, {}).get("perplexity", {})
    value = scored.get(point, {}).get(length)
    return None if value is None else float(value)


def _spread(values: Sequence[float]) -> str:
    """mean [min, max] of the seeds (perplexity: 3 significant digits); seeds without the point (a skipped stage 1)
    are left out."""
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    if any(not math.isfinite(v) for v in values):
        return "inf"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return _num(mean)
    return f"{_num(mean)} [{_num(min(values))}, {_num(max(values))}]"


def _num(x: float) -> str:
    if x >= 1e5:
        return f"{x:.2e}"
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def aggregate(runs: Mapping[str, Mapping[str, Mapping[int, Mapping[str, Any]]]], length: str,
              text: str | None = None) -> dict[str, Any]:
    """runs[implementation][kind][seed] = conversion.json summary (kind: one of ``KINDS``) -> per implementation the
    perplexities by seed (on the validation text, or on ``text`` of the runs' --eval_texts), layer errors, seconds,
    peak memory and the paired verdict."""
    rows: dict[str, Any] = {}
    for impl, kinds in runs.items():
        conv, ctrl, dist = kinds.get("convert", {}), kinds.get("control", {}), kinds.get("distill", {})
        seeds = sorted(set(conv) | set(ctrl) | set(dist))
        every = (*conv.values(), *dist.values(), *ctrl.values())
        swapped = next((p for p in (_ppl(s, "swapped", length, text) for s in every) if p is not None), None)
        calibrated = next((p for p in (_ppl(s, "calibrated", length, text) for s in every) if p is not None), None)
        errors = next((s["layer_errors"] for s in conv.values() if "swapped" in s.get("layer_errors", {})), {})
        after = [statistics.fmean(s["layer_errors"]["transfer"]) for s in conv.values()
                 if "transfer" in s.get("layer_errors", {})]
        row = {
            "seeds": seeds,
            "swapped": swapped,
            "transfer": {seed: _ppl(conv[seed], "transfer", length, text) for seed in conv},
            "convert": {seed: _ppl(conv[seed], "finetune", length, text) for seed in conv},
            "control": {seed: _ppl(ctrl[seed], "finetune", length, text) for seed in ctrl},
            "layer_error_swapped": statistics.fmean(errors["swapped"]) if errors else None,
            "layer_error_transfer": statistics.fmean(after) if after else None,
            "convert_seconds": {seed: conv[seed]["wall_seconds"] for seed in conv if "wall_seconds" in conv[seed]},
            "control_seconds": {seed: ctrl[seed]["wall_seconds"] for seed in ctrl if "wall_seconds" in ctrl[seed]},
        }
        if any("eval_texts" in s for s in every):  # (a study with calibrated starts, --distill, a second text)
            row["calibrated"] = calibrated
            row["distill"] = {seed: _ppl(dist[seed], "finetune", length, text) for seed in dist}
            row["peak_memory_mb"] = max((max(s.get("peak_rss_mb", {}).values(), default=0.0) for s in every),
                                        default=0.0)
        row["verdict"] = verdict(row)
        if row.get("distill"):
            row["distill_verdict"] = verdict({"convert": row["distill"], "control": row["control"]})
        rows[impl] = row
    return rows


def _paired_ratios(row: Mapping[str, Any]) -> list[float]:
    """Per seed that has both, the conversion's perplexity over the control's (empty when none has both)."""
    convert, control = row.get("convert", {}), row.get("control", {})
    return [convert[s] / control[s] for s in convert if s in control]


def verdict(row: Mapping[str, Any]) -> str:
    """Transfer + fine-tune vs fine-tune alone, paired by seed: better/worse only when every seed agrees."""
    if not row["convert"] or not row["control"]:
        return "no stage 1 (reference)" if row["control"] else "incomplete"
    ratios = _paired_ratios(row)
    if not ratios:
        return "incomplete"
    mean = statistics.fmean(ratios)
    if all(r < 1 for r in ratios):
        return f"transfer helps: {100 * (1 - mean):.0f}% lower perplexity than fine-tuning alone (every seed)"
    if all(r > 1 for r in ratios):
        return f"transfer hurts: {100 * (mean - 1):.0f}% higher perplexity than fine-tuning alone (every seed)"
    return "no consistent difference between the seeds"


def _is_longer(results: Mapping[str, Any], length: int | str | None) -> bool:
    """Whether ``length`` names a context other than the first evaluated one (None: the first)."""
    return length is not None and str(length) != str(results["settings"]["eval_lengths"][0])


def rows_at(results: Mapping[str, Any], length: int | str | None = None) -> Mapping[str, Any]:
    """The rows of ``results.json`` at one evaluated context: ``rows`` for the first (the training block), and
    ``longer[length]`` for each longer one."""
    if not _is_longer(results, length):
        return results["rows"]
    longer = results.get("longer", {})
    if str(length) not in longer:
        raise KeyError(f"no perplexity at {length} tokens in results.json; evaluated: "
                       f"{results['settings']['eval_lengths']}")
    return longer[str(length)]


def table(results: Mapping[str, Any], length: int | str | None = None) -> str:
    """The markdown table of ``results.json`` at one evaluated context (default: the first)."""
    rows = rows_at(results, length)
    if any("calibrated" in r for r in rows.values()):  # a study with calibrated starts and distillation
        return _full_table(rows)
    lines = ["| implementation | swapped, no training | after stage 1 | stage 1 + stage 2 | stage 2 alone (control) "
             "| layer error: swapped → stage 1 | minutes per conversion | finding |",
             "|---|---|---|---|---|---|---|---|"]
    for impl, r in _reference_first(rows):
        err = ("—" if r["layer_error_swapped"] is None else
               f"{r['layer_error_swapped']:.3g} → {r['layer_error_transfer']:.3g}"
               if r["layer_error_transfer"] is not None else f"{r['layer_error_swapped']:.3g}")
        swapped = "—" if r["swapped"] is None else _num(r["swapped"])
        lines.append(f"| `{impl}` | {swapped} | {_spread(list(r['transfer'].values()))} | "
                     f"{_spread(list(r['convert'].values()))} | {_spread(list(r['control'].values()))} | {err} | "
                     f"{_minutes(r)} | {_finding(impl, r)} |")
    return "\n".join(lines)


def _reference_first(rows: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """(implementation, row) with the reference first, the others in their order."""
    return [(impl, rows[impl]) for impl in [REFERENCE, *(i for i in rows if i != REFERENCE)] if impl in rows]


def _minutes(row: Mapping[str, Any]) -> str:
    """Mean minutes of a row's conversions (the reference: of its controls)."""
    secs = list(row["convert_seconds"].values()) or list(row["control_seconds"].values())
    return f"{statistics.fmean(secs) / 60:.1f}" if secs else "—"


def _finding(impl: str, row: Mapping[str, Any]) -> str:
    if impl == REFERENCE:
        return "the original model and its fine-tune"
    distilled = row.get("distill_verdict")
    if not distilled:
        return row["verdict"]
    return f"{row['verdict']}; distilled: {distilled.removeprefix('transfer ')}"


def _full_table(rows: Mapping[str, Any]) -> str:
    """The table of a study with calibrated starts and distillation runs."""
    lines = ["| implementation | swapped | calibrated | after stage 1 | final | final, stage 2 distilled | control "
             "(stage 2 alone) | minutes per conversion | peak memory (GB) | finding |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for impl, r in _reference_first(rows):
        memory = f"{r['peak_memory_mb'] / 1024:.1f}" if r.get("peak_memory_mb") else "—"
        cells = ["—" if r.get(k) is None else _num(r[k]) for k in ("swapped", "calibrated")]
        cells += [_spread(list(r.get(k, {}).values())) for k in ("transfer", "convert", "distill", "control")]
        lines.append(f"| `{impl}` | {' | '.join(cells)} | {_minutes(r)} | {memory} | {_finding(impl, r)} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------- the two verdicts a user asks for
#
# recovered: how much of the original model a conversion keeps: the distilled conversion (stage 2 on the original
# model's distributions) against the original model itself, on the second text (never trained on, so adapting to
# the training text neither helps nor hurts); adapted: what it gives on the training text's kind: the conversion
# with stage 2 on the next-token loss against the softmax model fine-tuned as long, in domain.

#: recovered / adapted: within these factors (the strict one first) on every seed and context
RECOVERED_NEAR = (1.05, CURVE_NEAR)


def recovered(results: Mapping[str, Any], impl: str) -> dict[str, dict[int, float]]:
    """Per context and seed: the distilled conversion's perplexity on the second text over the original model's
    (the reference's swapped point); empty where either is missing."""
    out: dict[str, dict[int, float]] = {}
    for length, rows in results.get("texts", {}).get(OTHER_TEXT, {}).items():
        original = rows.get(REFERENCE, {}).get("swapped")
        finals = rows.get(impl, {}).get("distill", {})
        if original:
            out[length] = {int(s): v / original for s, v in finals.items() if v is not None}
    return {n: r for n, r in out.items() if r}


def adapted(results: Mapping[str, Any], impl: str) -> dict[str, dict[int, float]]:
    """Per context and seed: the conversion's perplexity (stage 2 on the next-token loss) on the held-out training
    text over the softmax fine-tune's of the same seed."""
    out: dict[str, dict[int, float]] = {}
    for length in (str(n) for n in results["settings"]["eval_lengths"]):
        rows = rows_at(results, length)
        ref = {int(s): v for s, v in rows.get(REFERENCE, {}).get("control", {}).items()}
        got = {int(s): v for s, v in rows.get(impl, {}).get("convert", {}).items() if v is not None}
        ratios = {s: v / ref[s] for s, v in got.items() if s in ref}
        if ratios:
            out[length] = ratios
    return out


def verdict_words(ratios: Mapping[str, Mapping[int, float]], lengths: Sequence[str], what: str) -> str:
    """The worst seed and context against ``RECOVERED_NEAR``, in words (``what``: "the original", ...)."""
    got = [r for n in lengths for r in ratios.get(n, {}).values()]
    if not got or any(n not in ratios for n in lengths):
        return "not measured"
    worst = max(got)
    for near in RECOVERED_NEAR:
        if worst <= near:
            return f"within {100 * (near - 1):.0f}% of {what}"
    return f"{worst:.3g}× {what} at worst"


def _ratios_cell(ratios: Mapping[str, Mapping[int, float]], lengths: Sequence[str]) -> str:
    """The mean over seeds at each context, "a / b"."""
    cells = [_ratio(statistics.fmean(ratios[n].values())) if ratios.get(n) else "—" for n in lengths]
    return " / ".join(cells)


def verdict_table(results: Mapping[str, Any], curve: Mapping[str, Any] | None = None) -> str:
    """Per implementation the two verdicts (recovered, adapted) at every context, mean over seeds, with the worst
    seed and context in words; with the budget curve (``curve.json``), the tokens at which the distilled conversion
    first came within ``CURVE_NEAR`` of the original."""
    lengths = [str(n) for n in results["settings"]["eval_lengths"]]
    rows = results["rows"]
    at = " / ".join(lengths)
    curve_rows_ = (curve or {}).get("curves", {}).get("default", {})
    head = (f"| implementation | swapped | calibrated | recovered: distilled, × the original on {OTHER_TEXT_NAME} "
            f"({at} tokens) | recovered | adapted: next-token, × the softmax fine-tune on Shakespeare ({at}) | "
            "adapted |")
    sep = "|---|---|---|---|---|---|---|"
    if curve is not None:
        head += f" first within {100 * (CURVE_NEAR - 1):.0f}% of the original on the budget curve ({at}) |"
        sep += "---|"
    head += " minutes per conversion | peak memory (GB) |"
    sep += "---|---|"
    lines = [head, sep]
    for impl, r in _reference_first(rows):
        cells = ["—" if r.get(k) is None else _num(r[k]) for k in ("swapped", "calibrated")]
        if impl == REFERENCE:
            ref = [_num(statistics.fmean(rows_at(results, n)[REFERENCE]["control"].values())) for n in lengths]
            cells += ["1 / 1", "the original model", f"1 / 1 (its fine-tune: {' / '.join(ref)})", "—"]
        else:
            rec, ada = recovered(results, impl), adapted(results, impl)
            cells += [_ratios_cell(rec, lengths), verdict_words(rec, lengths, "the original"),
                      _ratios_cell(ada, lengths), verdict_words(ada, lengths, "the fine-tune")]
        if curve is not None:
            row = curve_rows_.get(impl)
            cells.append("—" if row is None or impl == REFERENCE else
                         " / ".join(_first_within_text(row, n, short=True) for n in lengths))
        memory = f"{r['peak_memory_mb'] / 1024:.1f}" if r.get("peak_memory_mb") else "—"
        lines.append(f"| `{impl}` | {' | '.join(cells)} | {_minutes(r)} | {memory} |")
    return "\n".join(lines)


#: the second text's name in a table's header
OTHER_TEXT_NAME = "King James"
#: the adapted goal: at least this many of ``NEAR_SOFTMAX`` within ``NEAR`` of the softmax fine-tune at every
#: context on every seed
NEAR_SOFTMAX, NEAR, NEAR_COUNT = ("softmax1", "ssmax", "entmax15", "stickbreaking", "sigmoid"), 1.15, 4
#: the two conversion recipes of the study, in words
RECIPES = {"convert": "stage 2 on the next-token loss", "distill": "stage 2 distilled"}
#: the recovered goal at the default budget: these within the strict ``RECOVERED_NEAR`` of the original
RECOVERED_AT_DEFAULT = ("softmax1", "ssmax")
#: the curve's goal: at least ``CURVE_COUNT`` of these within ``CURVE_NEAR`` of the original at some budget
CURVE_GOAL, CURVE_COUNT = ("entmax15", "stickbreaking", "sigmoid", "symax"), 2
#: sigmoid's start: below this factor of the original model before stage 2 (after calibration and stage 1)
SIGMOID_START = 100.0


def goals(results: Mapping[str, Any], curve: Mapping[str, Any] | None = None) -> list[tuple[str, bool | None, str]]:
    """(goal, met: True / False / None when not measured, what was measured) for each goal of the study; the
    curve's goals read ``curve`` (``curve.json``), not measured without it."""
    lengths = [str(n) for n in results["settings"]["eval_lengths"]]
    at = {n: rows_at(results, n) for n in lengths}
    out: list[tuple[str, bool | None, str]] = []

    # recovered, at the default budget
    said, met = [], []
    for impl in RECOVERED_AT_DEFAULT:
        rec = recovered(results, impl)
        got = [r for n in lengths for r in rec.get(n, {}).values()]
        if got and all(n in rec for n in lengths):
            met.append(max(got) <= RECOVERED_NEAR[0])
            said.append(f"`{impl}` " + ", ".join(f"{_ratio(max(rec[n].values()))}x at {n}" for n in lengths))
    out.append((f"recovered: {' and '.join(RECOVERED_AT_DEFAULT)} distilled within "
                f"{100 * (RECOVERED_NEAR[0] - 1):.0f}% of the original model on {OTHER_TEXT_NAME} at "
                f"{' and '.join(lengths)} tokens on every seed, at the default budget",
                all(met) if len(met) == len(RECOVERED_AT_DEFAULT) else None,
                "worst seed: " + "; ".join(said) if said else "not measured"))

    # adapted: stage 2 on the next-token loss against the softmax fine-tune
    near, detail = [], []
    for impl in NEAR_SOFTMAX:
        ada = adapted(results, impl)
        got = [r for n in lengths for r in ada.get(n, {}).values()]
        if got and all(n in ada for n in lengths):
            detail.append(f"`{impl}` {max(got):.2f}x")
            if max(got) <= NEAR:
                near.append(impl)
    out.append((f"adapted: at least {NEAR_COUNT} of {', '.join(NEAR_SOFTMAX)} within {100 * (NEAR - 1):.0f}% of the "
                f"softmax fine-tune at {' and '.join(lengths)} tokens on every seed",
                len(near) >= NEAR_COUNT if detail else None,
                f"{len(near)} (worst seed and context: {', '.join(detail)})" if detail else "not measured"))

    # the budget curve
    rows = (curve or {}).get("curves", {}).get("default", {})
    curve_goal = (f"recovered on the budget curve: at least {CURVE_COUNT} of {', '.join(CURVE_GOAL)} within "
                  f"{100 * (CURVE_NEAR - 1):.0f}% of the original at {' and '.join(lengths)} tokens on every seed "
                  f"at some budget up to {CURVE_BUDGETS[-1]}x")
    if curve is None:
        out.append((curve_goal, None, "not measured"))
        out.append(("every curve published", None, "not measured"))
    else:
        reached, said = [], []
        for impl in CURVE_GOAL:
            row = rows.get(impl)
            if row is None:
                said.append(f"`{impl}` not run")
                continue
            tokens = [row["first_within"].get(n) for n in lengths]
            # (within at every context from one budget on: the later of the two first budgets)
            if all(t is not None for t in tokens):
                reached.append(impl)
                said.append(f"`{impl}` at {_tokens_text(max(tokens))} tokens")
            else:
                said.append(f"`{impl}` " + " / ".join(_first_within_text(row, n, short=True) for n in lengths))
        largest = max((int(b) for r in rows.values() for b in r["budgets"]), default=0)
        complete = largest >= CURVE_BUDGETS[-1] and all(
            rows.get(i) and str(CURVE_BUDGETS[-1]) in rows[i]["budgets"] for i in CURVE_GOAL)
        out.append((curve_goal, True if len(reached) >= CURVE_COUNT else (False if complete else None),
                    ", ".join(said) + ("" if complete else
                                       f" (the curve is measured up to {largest}x only: not yet decided)")))
        missing = [f"`{impl}` {b}x" for impl in CURVE_IMPLEMENTATIONS for b in CURVE_BUDGETS
                   if str(b) not in rows.get(impl, {}).get("budgets", {})
                   or len(rows[impl]["budgets"][str(b)]["final"][lengths[0]]) < curve_seeds(b)]
        out.append((f"every curve published: {', '.join(CURVE_IMPLEMENTATIONS)} at "
                    f"{', '.join(f'{b}x' for b in CURVE_BUDGETS)}", not missing,
                    "all measured" if not missing else f"missing: {', '.join(missing)}"))

    # sigmoid's start
    first = at[lengths[0]]
    original = first.get(REFERENCE, {}).get("swapped")
    sig = first.get("sigmoid", {})
    after = [v for v in sig.get("transfer", {}).values() if v is not None]
    out.append((f"sigmoid's start below {SIGMOID_START:g}x the original model before stage 2 (calibrated, then stage "
                f"1) on every seed at {lengths[0]} tokens",
                None if not after or not original else max(after) / original < SIGMOID_START,
                "not measured" if not after or not original else
                f"calibrated {_ratio(sig['calibrated'] / original)}x, after stage 1 "
                f"{_ratio(max(after) / original)}x at worst" if sig.get("calibrated") else
                f"after stage 1 {_ratio(max(after) / original)}x at worst"))

    cal = first.get("ssmax", {}).get("calibrated")
    out.append(("ssmax calibrated within 10% of the original model with no training",
                None if cal is None or original is None else cal <= 1.1 * original,
                "not measured" if cal is None or original is None else
                f"{_num(cal)} against the original's {_num(original)} ({cal / original:.2f}x)"))
    before = []
    for impl in ("sigmoid", "stickbreaking"):
        r = first.get(impl, {})
        start = r.get("calibrated") if r.get("calibrated") is not None else r.get("swapped")
        if start is not None and original:
            before.append((impl, start / original))
    out.append(("sigmoid and stickbreaking below 2x the original before training",
                None if len(before) < 2 or not original else all(x < 2 for _, x in before),
                ", ".join(f"`{i}` {x:.3g}x" for i, x in before) or "not measured"))
    beats, said = [], []
    for impl in ("hedgehog", "symax"):
        wins = {}
        for n in lengths:  # (every evaluated context, every seed)
            ratios = _paired_ratios(at[n].get(impl, {}))
            if ratios:
                wins[n] = all(r < 1 for r in ratios)
        if len(wins) == len(lengths):
            beats.append(all(wins.values()))
            said.append(f"`{impl}` " + ", ".join(f"{'every seed' if won else 'not every seed'} at {n}"
                                                  for n, won in wins.items()))
    out.append(("attention transfer beats the control for linear attention with a learned feature map (hedgehog) "
                f"and symax on every seed at {' and '.join(lengths)} tokens", all(beats) if len(beats) == 2 else
                None, ", ".join(said) or "not measured"))
    return out


def goals_markdown(results: Mapping[str, Any], curve: Mapping[str, Any] | None = None) -> str:
    return "\n".join(f"* {'**met**' if met else 'not met' if met is False else 'open'}: {goal} ({detail})"
                      for goal, met, detail in goals(results, curve))


def markdown(results: Mapping[str, Any]) -> str:
    """``results.md``: the summary and table at each evaluated context, the first (the training block) first."""
    parts = [f"{summary_sentence(results)}\n\n{table(results)}\n"]
    for length in results.get("longer", {}):
        parts.append(f"{summary_sentence(results, length)}\n\n{table(results, length)}\n")
    parts += [f"{t}\n" for t in text_tables(results)]
    if results.get("texts"):
        parts.append(f"Goals:\n\n{goals_markdown(results)}\n")
    return "\n".join(parts)


def text_tables(results: Mapping[str, Any]) -> list[str]:
    """``text_table`` for each held-out text of the runs' --eval_texts and each context, in their order."""
    texts = results.get("texts", {})
    return [text_table(results, text, length) for text in texts for length in texts[text]]


def text_table(results: Mapping[str, Any], text: str, length: str) -> str:
    """The runs scored on held-out ``text`` (one of the runs' --eval_texts) at one context: what the conversion
    gives back of the model apart from adapting to the training text."""
    return f"{summary_sentence(results, length, text)}\n\n{_full_table(results['texts'][text][length])}"


#: the implementation the claim is about (a linearised model with the learned feature map of both papers)
CLAIM_SUBJECT = "hedgehog"


def claim_finding(results: Mapping[str, Any]) -> str:
    """Our finding on the claim, for its own setting (``linear``): the paired verdict and how far the converted model
    stays from the softmax model fine-tuned as long ("recovered" = within 2x its perplexity)."""
    rows = results["rows"]
    row, ref = rows.get(CLAIM_SUBJECT), rows.get(REFERENCE)
    if not row or not row["convert"] or not ref or not ref["control"]:
        return f"not measured (`{CLAIM_SUBJECT}` or `{REFERENCE}` missing)"
    ratio = statistics.fmean(row["convert"].values()) / statistics.fmean(ref["control"].values())
    recovered = "recovered" if ratio <= 2 else "not recovered at this budget"
    return (f"for `{CLAIM_SUBJECT}`, {row['verdict']}; after both stages its perplexity is {ratio:.1f}x that of the "
            f"softmax model fine-tuned as long: the quality is {recovered}")


def summary_sentence(results: Mapping[str, Any], length: int | str | None = None, text: str | None = None) -> str:
    """Which normalizers transfer helped, hurt, or neither; and how close the best conversions come to softmax (on
    the validation text, or on ``text`` of the runs' --eval_texts)."""
    rows = rows_at(results, length) if text is None else results["texts"][text][str(length)]
    groups: dict[str, list[str]] = {"helps": [], "hurts": [], "neither": []}
    for impl, r in rows.items():
        if impl == REFERENCE:
            continue
        key = "helps" if r["verdict"].startswith("transfer helps") else (
            "hurts" if r["verdict"].startswith("transfer hurts") else "neither")
        groups[key].append(f"`{impl}`")
    ref = rows.get(REFERENCE, {}).get("control", {})
    ref_mean = statistics.fmean(ref.values()) if ref else None
    close = []
    if ref_mean:
        for impl, r in rows.items():
            values = list(r["convert"].values())
            if impl != REFERENCE and values and all(math.isfinite(v) for v in values) \
                    and statistics.fmean(values) <= 1.25 * ref_mean:
                close.append(f"`{impl}`")
    verdicts = [f"lower perplexity than fine-tuning alone, on every seed, for {', '.join(groups['helps']) or 'none'}"]
    if groups["hurts"]:
        verdicts.append(f"higher for {', '.join(groups['hurts'])}")
    if groups["neither"]:
        verdicts.append(f"no consistent difference for {', '.join(groups['neither'])}")
    s = results["settings"]
    where = (f"On {results.get('other_text', text)} (never trained on), at {length} tokens," if text is not None else
             f"At {s['transfer_steps']} + {s['finetune_steps']} steps of {s['block_size']} tokens (control: "
             f"{s['transfer_steps'] + s['finetune_steps']} fine-tuning steps),")
    parts = [f"{where} attention transfer before fine-tuning gave {'; '.join(verdicts)}."]
    if ref_mean:
        parts.append(f"Within 25% of the softmax model fine-tuned as long ({_num(ref_mean)}): "
                     f"{', '.join(close) or 'none'}.")
    if text is None and _is_longer(results, length):
        parts.insert(0, f"Scored at {length} tokens ({int(length) / s['block_size']:g}x the blocks trained on).")
    return " ".join(parts)


# ------------------------------------------------------------------------------------------------ the budget curve

#: the study's default output folder (``scripts/convert_study.py --output_dir``)
DEFAULT_OUTPUT = "runs/convert_study"


def published_command(command: str) -> str:
    """A recorded command as the documents show it: an absolute ``--output_dir`` (the folder of the machine that ran
    it) written relative, so that the command can be pasted: a study run's folder as under the study's default output
    folder (``runs/convert_study/runs/<implementation>/<run>``), a study's own folder as that default, any other
    folder as ``runs/<its name>``."""
    import re

    def relative(m: re.Match[str]) -> str:
        value = m.group(2)
        if not value.startswith("/"):
            return m.group(0)
        parts = value.rstrip("/").split("/")
        if len(parts) >= 4 and parts[-3] == "runs" and parse_run_name(parts[-1]) is not None:
            shown = f"{DEFAULT_OUTPUT}/runs/{parts[-2]}/{parts[-1]}"
        elif command.startswith("python scripts/convert_study.py"):
            shown = DEFAULT_OUTPUT
        else:
            shown = f"runs/{parts[-1]}"
        return f"{m.group(1)}{shown}"

    return re.sub(r"(--output_dir[ =])(\S+)", relative, command)



def parse_run_name(name: str) -> tuple[str, str | None, int, int] | None:
    """``run_name``'s inverse: (kind, lever or None, budget, seed), or None for a folder of another form."""
    head, sep, seed = name.rpartition("-seed")
    if not sep or not seed.isdigit():
        return None
    budget = 1
    stem, x, multiple = head.rpartition("-x")
    if x and multiple.isdigit():
        head, budget = stem, int(multiple)
    for kind in KINDS:
        if head == kind:
            return kind, None, budget, int(seed)
        for lever in LEVERS:
            if head == f"{kind}-{lever}":
                return kind, lever, budget, int(seed)
    return None


def collect_curve_runs(runs_dir: Any) -> dict[str, dict[str, dict[int, dict[int, dict]]]]:
    """Every distilled run under ``runs_dir`` (a Path: <implementation>/<run_name>/conversion.json) of the curve's
    implementations and of any implementation run at another budget or with a lever: variant ("default" or the
    lever) -> implementation -> budget -> seed -> its conversion.json."""
    import json
    from pathlib import Path

    found: dict[str, dict[str, dict[int, dict[int, dict]]]] = {}
    for path in sorted(Path(runs_dir).glob("*/*/conversion.json")):
        parsed = parse_run_name(path.parent.name)
        if parsed is None or parsed[0] != "distill":
            continue
        _, lever, budget, seed = parsed
        impl = path.parent.parent.name
        found.setdefault(lever or "default", {}).setdefault(impl, {}).setdefault(budget, {})[seed] = \
            json.loads(path.read_text())
    default = found.get("default", {})
    for impl in list(default):  # (a run at the default budget alone is the study's, not a curve)
        if impl not in CURVE_IMPLEMENTATIONS and set(default[impl]) == {1}:
            del default[impl]
    return found


def _tokens(summary: Mapping[str, Any]) -> int:
    """Training tokens of a run: both stages' steps times the tokens of one step."""
    steps = summary["steps"]
    return (int(steps["transfer"]) + int(steps["finetune"])) * int(summary["tokens_per_step"])


def curve_rows(found: Mapping[str, Mapping[str, Mapping[int, Mapping[int, Mapping[str, Any]]]]],
               original: Mapping[str, float | None], lengths: Sequence[str]) -> dict[str, Any]:
    """``collect_curve_runs``' runs -> per variant, implementation and budget: the training tokens, per context and
    seed the final perplexity on the second text and its ratio to the original model's (``original``: context ->
    perplexity), after stage 1 too, in domain (the training text's held-out part), and each run's seconds, CPU
    seconds and load; per implementation the budget at which every seed first came within ``CURVE_NEAR``."""
    out: dict[str, Any] = {}
    for variant, impls in found.items():
        rows = out.setdefault(variant, {})
        for impl, budgets in impls.items():
            row: dict[str, Any] = {"budgets": {}}
            for budget in sorted(budgets):
                seeds = budgets[budget]
                cell: dict[str, Any] = {"tokens": _tokens(next(iter(seeds.values()))),
                                        "steps": next(iter(seeds.values()))["steps"], "final": {}, "ratio": {},
                                        "transfer": {}, "in_domain": {}}
                for n in lengths:
                    final = {s: _ppl(r, "finetune", n, OTHER_TEXT) for s, r in sorted(seeds.items())}
                    cell["final"][n] = final
                    cell["ratio"][n] = {s: (None if v is None or not original.get(n) else v / original[n])
                                        for s, v in final.items()}
                    cell["transfer"][n] = {s: _ppl(r, "transfer", n, OTHER_TEXT) for s, r in sorted(seeds.items())}
                    cell["in_domain"][n] = {s: _ppl(r, "finetune", n) for s, r in sorted(seeds.items())}
                cell["runs"] = {s: {"wall_seconds": r.get("wall_seconds"),
                                    "cpu_seconds": r.get("cpu_seconds", {}).get("run"),
                                    "load_average": [r.get("load_average_start"),
                                                     (r.get("load_average_steps") or {}).get("mean"),
                                                     r.get("load_average_end")],
                                    "command": r.get("command")} for s, r in sorted(seeds.items())}
                row["budgets"][str(budget)] = cell
            row["first_within"] = {n: first_within(row, n) for n in lengths}
            rows[impl] = row
    return out


def first_within(row: Mapping[str, Any], length: str, near: float = CURVE_NEAR) -> int | None:
    """Training tokens of the smallest budget at which every seed's final perplexity is within ``near`` of the
    original's at ``length`` (None: at no budget measured)."""
    for budget in sorted(row["budgets"], key=int):
        cell = row["budgets"][budget]
        ratios = [r for r in cell["ratio"].get(length, {}).values() if r is not None]
        if ratios and all(r <= near for r in ratios):
            return int(cell["tokens"])
    return None


def _tokens_text(tokens: int) -> str:
    return f"{tokens / 1e6:.2g}M" if tokens >= 1e6 else f"{tokens / 1e3:.0f}k"


def _ratio_cell(ratios: Mapping[Any, float | None]) -> str:
    values = [r for r in ratios.values() if r is not None]
    if not values:
        return "—"
    if len(values) == 1:
        return f"{_ratio(values[0])}"
    return f"{_ratio(statistics.fmean(values))} [{_ratio(min(values))}, {_ratio(max(values))}]"


def _ratio(x: float) -> str:
    return f"{x:.3g}" if x < 1000 else f"{x:.2e}"


def curve_table(results: Mapping[str, Any], length: str, variant: str = "default") -> str:
    """The curve at one context: per implementation, the final perplexity over the original's at each budget
    (mean [min, max] over the seeds), and the budget at which it first came within ``CURVE_NEAR``. The default
    recipe's table has a column for every budget of ``CURVE_BUDGETS``: a budget or seed not run yet is said to be
    not measured."""
    rows = results["curves"].get(variant, {})
    measured = {int(b) for r in rows.values() for b in r["budgets"]}
    budgets = sorted(measured | (set(CURVE_BUDGETS) if variant == "default" else set()))
    # (an unmeasured budget's tokens: both stages scale with the budget, so tokens per multiple are the same)
    per_multiple = next((int(r["budgets"][b]["tokens"]) // int(b) for r in rows.values() for b in r["budgets"]), None)
    tokens = {b: next((int(r["budgets"][str(b)]["tokens"]) for r in rows.values() if str(b) in r["budgets"]),
                      None if per_multiple is None else per_multiple * b) for b in budgets}
    seeds = results["settings"]["seeds"]
    head = [f"{'' if tokens[b] is None else _tokens_text(tokens[b]) + ' tokens '}({b}x, {seeds.get(str(b), '?')} "
            f"seed{'s' * (seeds.get(str(b)) != 1)})" for b in budgets]
    lines = [f"| implementation | {' | '.join(head)} | first within {100 * (CURVE_NEAR - 1):.0f}% of the original |",
             "|---|" + "---|" * (len(budgets) + 1)]
    order = [i for i in CURVE_IMPLEMENTATIONS if i in rows] + [i for i in rows if i not in CURVE_IMPLEMENTATIONS]
    for impl in order:
        row = rows[impl]
        cells = []
        for b in budgets:
            cell = row["budgets"].get(str(b))
            if cell is None:
                cells.append("not measured")
                continue
            got, wanted = sum(r is not None for r in cell["ratio"][length].values()), seeds.get(str(b))
            cells.append(_ratio_cell(cell["ratio"][length]) +
                         (f" ({got} of {wanted} seeds)" if isinstance(wanted, int) and got < wanted else ""))
        lines.append(f"| `{impl}` | {' | '.join(cells)} | {_first_within_text(row, length)} |")
    return "\n".join(lines)


def _first_within_text(row: Mapping[str, Any], length: str, short: bool = False) -> str:
    got = row["first_within"].get(length)
    if got is not None:
        return f"{_tokens_text(got)}" if short else f"{_tokens_text(got)} tokens"
    largest = max(row["budgets"], key=int)
    above = [f"{b}x" for b in CURVE_BUDGETS if b > int(largest)]
    return (f"not within {_tokens_text(int(row['budgets'][largest]['tokens']))}" + ("" if short else " tokens") +
            (f" ({', '.join(above)} not measured)" if above else ""))


def lever_findings(results: Mapping[str, Any], length: str) -> list[tuple[str, str, bool | None, str]]:
    """(lever, implementation, moves the curve left: every budget and seed both measured lower than the default's
    (None: nothing to compare, or lower on every pair but a planned seed not measured), the paired ratios in
    words) per lever and implementation, at ``length``."""
    curves, out = results["curves"], []
    default = curves.get("default", {})
    for lever in (v for v in curves if v != "default"):
        for impl, row in curves[lever].items():
            pairs = []
            for budget, cell in sorted(row["budgets"].items(), key=lambda kv: int(kv[0])):
                base = default.get(impl, {}).get("budgets", {}).get(budget)
                if base is None:
                    continue
                for seed, got in cell["ratio"][length].items():
                    ref = base["ratio"][length].get(seed)
                    if got is not None and ref is not None:
                        pairs.append((int(budget), seed, got, ref))
            if not pairs:
                out.append((lever, impl, None, "no default run at the same budget and seed"))
                continue
            words = ", ".join(f"{b}x seed {s}: {_ratio(g)} against {_ratio(r)}" for b, s, g, r in pairs)
            # (lower on the pairs measured but a planned seed missing: not decided; higher on one: decided)
            short = sorted({b for b, *_ in pairs if sum(p[0] == b for p in pairs) < curve_seeds(b)})
            left = all(g < r for _, _, g, r in pairs)
            if short:
                words += f" (not every seed measured at {', '.join(f'{b}x' for b in short)})"
            out.append((lever, impl, None if left and short else left, words))
    return out


def curve_markdown(results: Mapping[str, Any]) -> str:
    """curve.md: the curve's table at each context, then each lever against the default."""
    lengths = [str(n) for n in results["settings"]["eval_lengths"]]
    original = results.get("original") or {}
    parts = []
    for n in lengths:
        parts.append(f"Recovered at {n} tokens: final perplexity (stage 2 distilled) on {results['text']} over the "
                     f"original model's ({_num(original[n]) if original.get(n) else '—'}):\n\n"
                     f"{curve_table(results, n)}\n")
    for lever in (v for v in results["curves"] if v != "default"):
        desc = results["levers"].get(lever, {}).get("description", lever)
        for n in lengths:
            parts.append(f"Lever `{lever}` ({desc}) at {n} tokens:\n\n{curve_table(results, n, lever)}\n")
    said = {True: "moves the curve left", False: "does not move the curve left", None: "not decided"}
    findings = [f"* `{lever}` on `{impl}` at {n} tokens: {said[left]} ({words})"
                for n in lengths for lever, impl, left, words in lever_findings(results, n)]
    if findings:
        parts.append("Levers against the default (final perplexity over the original's, paired by budget and "
                     "seed):\n\n" + "\n".join(findings) + "\n")
    return "\n".join(parts)
