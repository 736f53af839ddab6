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
}
REFERENCE = "softmax"
#: the published claim the study tests, per method family
CLAIM = ("LoLCATs (Zhang et al. 2024, arXiv:2410.10254) and Hedgehog (Zhang et al. 2024, arXiv:2402.04347): "
         "attention transfer (matching the softmax attention outputs layer by layer) recovers most of the quality "
         "of a linearised model with a small training budget, better than fine-tuning alone")


def _ppl(summary: Mapping[str, Any], point: str, length: str) -> float | None:
    value = summary.get("perplexity", {}).get(point, {}).get(length)
    return None if value is None else float(value)


def _spread(values: Sequence[float]) -> str:
    """mean [min, max] of the seeds (perplexity: 3 significant digits)."""
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


def aggregate(runs: Mapping[str, Mapping[str, Mapping[int, Mapping[str, Any]]]], length: str) -> dict[str, Any]:
    """runs[implementation][kind][seed] = conversion.json summary (kind: "convert" or "control") -> per
    implementation the perplexities by seed, layer errors, seconds and the paired verdict."""
    rows: dict[str, Any] = {}
    for impl, kinds in runs.items():
        conv, ctrl = kinds.get("convert", {}), kinds.get("control", {})
        seeds = sorted(set(conv) | set(ctrl))
        swapped = next((p for p in (_ppl(s, "swapped", length) for s in (*conv.values(), *ctrl.values()))
                        if p is not None), None)
        errors = next((s["layer_errors"] for s in conv.values() if "swapped" in s.get("layer_errors", {})), {})
        after = [statistics.fmean(s["layer_errors"]["transfer"]) for s in conv.values()
                 if "transfer" in s.get("layer_errors", {})]
        row = {
            "seeds": seeds,
            "swapped": swapped,
            "transfer": {seed: _ppl(conv[seed], "transfer", length) for seed in conv},
            "convert": {seed: _ppl(conv[seed], "finetune", length) for seed in conv},
            "control": {seed: _ppl(ctrl[seed], "finetune", length) for seed in ctrl},
            "layer_error_swapped": statistics.fmean(errors["swapped"]) if errors else None,
            "layer_error_transfer": statistics.fmean(after) if after else None,
            "convert_seconds": {seed: conv[seed]["wall_seconds"] for seed in conv if "wall_seconds" in conv[seed]},
            "control_seconds": {seed: ctrl[seed]["wall_seconds"] for seed in ctrl if "wall_seconds" in ctrl[seed]},
        }
        row["verdict"] = verdict(row)
        rows[impl] = row
    return rows


def verdict(row: Mapping[str, Any]) -> str:
    """Transfer + fine-tune vs fine-tune alone, paired by seed: better/worse only when every seed agrees."""
    if not row["convert"] or not row["control"]:
        return "no stage 1 (reference)" if row["control"] else "incomplete"
    paired = [(row["convert"][s], row["control"][s]) for s in row["convert"] if s in row["control"]]
    if not paired:
        return "incomplete"
    ratios = [c / f for c, f in paired]
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
    head = ("| implementation | swapped, no training | after stage 1 | stage 1 + stage 2 | stage 2 alone (control) "
            "| layer error: swapped → stage 1 | minutes per conversion | finding |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    order = [REFERENCE] + [i for i in rows if i != REFERENCE]
    for impl in order:
        if impl not in rows:
            continue
        r = rows[impl]
        err = ("—" if r["layer_error_swapped"] is None else
               f"{r['layer_error_swapped']:.3g} → {r['layer_error_transfer']:.3g}"
               if r["layer_error_transfer"] is not None else f"{r['layer_error_swapped']:.3g}")
        secs = list(r["convert_seconds"].values()) or list(r["control_seconds"].values())
        minutes = f"{statistics.fmean(secs) / 60:.1f}" if secs else "—"
        swapped = "—" if r["swapped"] is None else _num(r["swapped"])
        lines.append(f"| `{impl}` | {swapped} | {_spread(list(r['transfer'].values()))} | "
                     f"{_spread(list(r['convert'].values()))} | {_spread(list(r['control'].values()))} | {err} | "
                     f"{minutes} | {r['verdict'] if impl != REFERENCE else 'the original model and its fine-tune'} |")
    return "\n".join(lines)


def markdown(results: Mapping[str, Any]) -> str:
    """``results.md``: the summary and table at each evaluated context, the first (the training block) first."""
    parts = [f"{summary_sentence(results)}\n\n{table(results)}\n"]
    for length in results.get("longer", {}):
        parts.append(f"{summary_sentence(results, length)}\n\n{table(results, length)}\n")
    return "\n".join(parts)


#: the implementation the claim is about (a linearised model)
CLAIM_SUBJECT = "linear"


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


def summary_sentence(results: Mapping[str, Any], length: int | str | None = None) -> str:
    """Which normalizers transfer helped, hurt, or neither; and how close the best conversions come to softmax."""
    rows = rows_at(results, length)
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
    s = results["settings"]
    parts = [f"At {s['transfer_steps']} + {s['finetune_steps']} steps of {s['block_size']} tokens "
             f"(control: {s['transfer_steps'] + s['finetune_steps']} fine-tuning steps), attention transfer before "
             f"fine-tuning gave lower perplexity than fine-tuning alone, on every seed, for "
             f"{', '.join(groups['helps']) or 'no normalizer'}; higher for {', '.join(groups['hurts']) or 'none'}; "
             f"no consistent difference for {', '.join(groups['neither']) or 'none'}."]
    if ref_mean:
        parts.append(f"Within 25% of the softmax model fine-tuned as long ({_num(ref_mean)}): "
                     f"{', '.join(close) or 'none'}.")
    if _is_longer(results, length):
        parts.insert(0, f"Scored at {length} tokens ({int(length) / s['block_size']:g}x the blocks trained on).")
    return " ".join(parts)
