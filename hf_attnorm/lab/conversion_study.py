"""The conversion study (``scripts/convert_study.py``): which normalizers can the real SmolLM2-135M be converted to
cheaply, and does attention transfer beat plain fine-tuning at the same number of steps?

For each normalizer and seed: ``scripts/convert.py`` at its default budget (stage 1 then stage 2), and the control,
stage 2 alone with as many steps as both stages together. Perplexity on held-out Shakespeare: swapped with no
training, after stage 1, after stages 1 + 2, and the control. ``softmax`` is the reference: the original model
(swapped = unchanged) and its own fine-tune with the control's steps (what the text alone does to perplexity).
This module holds the plan and turns the runs' ``conversion.json`` files into ``results.json`` and its table;
``conversion_study_cli`` runs the study.
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


#: the goal the study reports against: at least this many of ``NEAR_SOFTMAX`` within ``NEAR`` of the softmax
#: fine-tune at every context on every seed
NEAR_SOFTMAX, NEAR, NEAR_COUNT = ("softmax1", "ssmax", "entmax15", "stickbreaking", "sigmoid"), 1.15, 4
#: the two conversion recipes of the study, in words
RECIPES = {"convert": "stage 2 on the next-token loss", "distill": "stage 2 distilled"}


def goals(results: Mapping[str, Any]) -> list[tuple[str, bool | None, str]]:
    """(goal, met: True / False / None when not measured, what was measured) for each goal of the study."""
    lengths = [str(n) for n in results["settings"]["eval_lengths"]]
    at = {n: rows_at(results, n) for n in lengths}
    out: list[tuple[str, bool | None, str]] = []

    def finals(rows: Mapping[str, Any], impl: str, recipe: str) -> dict:
        return {int(s): v for s, v in rows.get(impl, {}).get(recipe, {}).items() if v is not None}

    # each recipe on its own (stage 2 on the next-token loss; distilled): the goal is met when one of them meets it
    counts, said = {}, []
    for recipe in ("convert", "distill"):
        near, detail = [], []
        for impl in NEAR_SOFTMAX:
            ratios = []
            for n in lengths:
                ref = {int(s): v for s, v in at[n].get(REFERENCE, {}).get("control", {}).items()}
                got = finals(at[n], impl, recipe)
                ratios += [got[s] / ref[s] for s in got if s in ref]
            if ratios and len(ratios) == len(lengths) * len(finals(at[lengths[0]], impl, recipe)):
                detail.append(f"`{impl}` {max(ratios):.2f}x")
                if max(ratios) <= NEAR:
                    near.append(impl)
        if detail:
            counts[recipe] = len(near)
            said.append(f"{RECIPES[recipe]}: {len(near)} (worst seed and context: {', '.join(detail)})")
    out.append((f"at least {NEAR_COUNT} of {', '.join(NEAR_SOFTMAX)} within {100 * (NEAR - 1):.0f}% of the softmax "
                f"fine-tune at {' and '.join(lengths)} tokens on every seed",
                max(counts.values()) >= NEAR_COUNT if counts else None, "; ".join(said) or "not measured"))
    first = at[lengths[0]]
    original = first.get(REFERENCE, {}).get("swapped")
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


def goals_markdown(results: Mapping[str, Any]) -> str:
    return "\n".join(f"* {'**met**' if met else 'not met' if met is False else 'not measured'}: {goal} ({detail})"
                      for goal, met, detail in goals(results))


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
