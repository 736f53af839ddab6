"""Tables, published-claim checks and plots of the main job, from the sweep's records.

Every number in a table is a mean over seeds with its 95% confidence interval (Student t); every comparison with
the reference implementation is paired by seed (same initial weights, same data). A mark says the paired
difference is significant at 5% (the CI of the mean difference excludes 0): ▲ higher than the reference, ▼ lower.
Claim verdicts follow the seed-set protocol of ``verdicts`` (each set compared on its own, a verdict only where the
sets agree), with an estimate of how often a rerun would change them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import verdicts
from .stats import mean_ci, paired
from .sweep import label_of


def _mark(comp: Mapping[str, Any] | None) -> str:
    if not comp or not comp.get("significant"):
        return ""
    return " ▲" if comp["diff"] > 0 else " ▼"


def fmt_ci(s: Mapping[str, Any], digits: int) -> str:
    if s["n"] == 0:
        return "—"
    if s["n"] == 1 or not math.isfinite(s["half"]):
        return f"{s['mean']:.{digits}f}"
    return f"{s['mean']:.{digits}f} ± {s['half']:.{digits}f}"


def fmt_diff(c: Mapping[str, Any], digits: int) -> str:
    if c["n"] == 0:
        return "—"
    if c["n"] == 1 or not math.isfinite(c["half"]):
        return f"{c['diff']:+.{digits}f}"
    return f"{c['diff']:+.{digits}f} [{c['lo']:+.{digits}f}, {c['hi']:+.{digits}f}]" + ("*" if c["significant"]
                                                                                        else "")


def metric_values(records: Mapping[str, Mapping[str, Any]], run_ids: Sequence[str], path: Sequence[str],
                  scale: float = 1.0) -> list[float | None]:
    """One value per run id (None where the run is missing or failed): ``record[path[0]][path[1]]...``."""
    out: list[float | None] = []
    for rid in run_ids:
        rec = records.get(rid) if rid else None
        if not rec or rec.get("status") != "ok":
            out.append(None)
            continue
        v: Any = rec
        for p in path:
            v = v.get(p) if isinstance(v, Mapping) else None
        out.append(None if v is None else float(v) * scale)
    return out


class Results:
    """The sweep's records arranged as task -> implementation -> one record id per seed (None where that seed was
    not planned for that cell: the seeds past the first set run only where a claim check needs them), with the
    seed sets of the claim verdicts (default: one set of every seed)."""

    def __init__(self, records: Mapping[str, Mapping[str, Any]], ids: Mapping[str, Mapping[str, list[str | None]]],
                 reference: str, sets: Sequence[Sequence[int]] | None = None, draws: int = 2000) -> None:
        self.records, self.ids, self.reference = records, ids, reference
        seeds = max((len(v) for per in ids.values() for v in per.values()), default=0)
        self.sets = [list(x) for x in sets] if sets else [list(range(seeds))]
        self.seeds = sum(len(x) for x in self.sets)
        self.draws = draws
        self._claims: tuple[list[dict[str, Any]], dict[str, Any]] | None = None

    def values(self, task: str, spec: str, path: Sequence[str], scale: float = 1.0) -> list[float | None]:
        return metric_values(self.records, self.ids[task][spec], path, scale)

    def stat(self, task: str, spec: str, path: Sequence[str], scale: float = 1.0) -> dict[str, Any]:
        return mean_ci(self.values(task, spec, path, scale))

    def versus(self, task: str, spec: str, path: Sequence[str], scale: float = 1.0) -> dict[str, Any] | None:
        if spec == self.reference or self.reference not in self.ids[task]:
            return None
        return paired(self.values(task, spec, path, scale), self.values(task, self.reference, path, scale))

    def set_versus(self, task: str, spec: str, path: Sequence[str], scale: float, seeds: Sequence[int]
                   ) -> dict[str, Any] | None:
        """The paired comparison with the reference on the given seeds only (None when there are no pairs)."""
        mine, ref = self.values(task, spec, path, scale), self.values(task, self.reference, path, scale)
        pick = [i for i in seeds if i < len(mine) and i < len(ref)]
        comp = paired([mine[i] for i in pick], [ref[i] for i in pick])
        return comp if comp["n"] else None

    def planned(self, task: str, spec: str) -> list[str]:
        return [rid for rid in self.ids[task][spec] if rid]

    def first_ok(self, task: str) -> Mapping[str, Any] | None:
        for per_spec in self.ids.get(task, {}).values():
            for rid in per_spec:
                rec = self.records.get(rid) if rid else None
                if rec and rec.get("status") == "ok":
                    return rec
        return None

    def table(self, task: str, columns: Sequence[tuple[str, Sequence[str], float, int]]) -> str:
        """A markdown table: one row per implementation, one column per (header, path, scale, digits); cells are
        mean ± CI half-width with the significance mark against the reference."""
        head = ["implementation", *[c[0] for c in columns]]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for spec in self.ids[task]:
            cells = [f"`{spec}`"]
            for _, path, scale, digits in columns:
                cells.append(fmt_ci(self.stat(task, spec, path, scale), digits)
                             + _mark(self.versus(task, spec, path, scale)))
            planned = self.planned(task, spec)
            failed = [rid for rid in planned if (self.records.get(rid) or {}).get("status") != "ok"]
            if failed:
                cells[0] += f" ({len(failed)} of {len(planned)} runs missing/failed)"
            elif len(planned) < len(self.ids[task][spec]):
                cells[0] += f" ({len(planned)} seeds)"
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def diff_table(self, task: str, columns: Sequence[tuple[str, Sequence[str], float, int]]) -> str:
        """Paired differences against the reference: mean [95% CI], * = significant, one row per implementation."""
        head = ["Δ vs " + self.reference, *[c[0] for c in columns]]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for spec in self.ids[task]:
            if spec == self.reference:
                continue
            cells = [f"`{spec}`"] + [fmt_diff(self.versus(task, spec, path, scale), digits)
                                     for _, path, scale, digits in columns]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def probe_columns(rec: Mapping[str, Any]) -> list[tuple[str, list[str], float, int]]:
    L = rec["train_length"]
    return [(f"{n // L}x ({n})", ["accuracy", str(n)], 100.0, 1) for n in rec["lengths"]]


def lm_columns(rec: Mapping[str, Any]) -> list[tuple[str, list[str], float, int]]:
    L = rec["train_length"]
    cols: list[tuple[str, list[str], float, int]] = [
        (f"loss @ {c // L}x ({c})", ["val_loss_per_char", str(c)], 1.0, 3) for c in rec["contexts"]]
    cols += [("sink share", ["sink_share"], 1.0, 3), ("sink rate %", ["sink_rate"], 100.0, 0),
             ("max kurtosis", ["kurtosis_max_layer"], 1.0, 1)]
    return cols


#: published claims: implementation, claim, source, checks (task, metric label, path builder, expected direction)
CLAIMS: list[dict[str, Any]] = [
    {"implementation": "ssmax",
     "claim": "Scalable-Softmax (s·ln n · scores) keeps attention focused past the training length: better "
              "key retrieval and lower loss than softmax at long contexts",
     "source": "Nakanishi 2025, arXiv:2501.19399",
     "checks": [("mqar", "longest", "higher"), ("passkey", "longest", "higher"), ("lm", "longest", "lower")]},
    {"implementation": "softmax1",
     "claim": "softmax_1 (1 + Σ exp in the denominator) lets heads attend to nothing: smaller outlier activations "
              "(kurtosis) and less forced attention to the first token",
     "source": "Miller 2023, 'Attention Is Off By One' (blog)",
     "checks": [("lm", "kurtosis", "lower"), ("lm", "sink", "lower")]},
    {"implementation": "softpick",
     "claim": "softpick removes the attention sink (0% sink rate) and massive activations (kurtosis 340 vs "
              "33,510 for softmax at 340M parameters)",
     "source": "Zuhri et al. 2025, arXiv:2504.20966",
     "checks": [("lm", "sink_rate", "lower"), ("lm", "sink", "lower"), ("lm", "kurtosis", "lower")]},
    {"implementation": "sink",
     "claim": "a learnable sink logit per head absorbs the attention sink: less mass on the first token",
     "source": "gpt-oss model card (OpenAI 2025); sinks: Xiao et al. 2023, arXiv:2309.17453",
     "checks": [("lm", "sink", "lower"), ("lm", "kurtosis", "lower")]},
    {"implementation": "sigmoid",
     "claim": "sigmoid attention with bias b = -ln n matches softmax",
     "source": "Ramapuram et al. 2024, arXiv:2409.04431 (ICLR 2025)",
     "checks": [("lm", "first", "equal"), ("mqar", "first", "equal"), ("passkey", "first", "equal")]},
    {"implementation": "stickbreaking",
     "claim": "stick-breaking attention generalises past the training length (trained at 2^11 tokens, good "
              "perplexity at 2^14 without position embeddings); here with the model's RoPE kept",
     "source": "Tan et al. 2024, arXiv:2410.17980",
     "checks": [("mqar", "longest", "higher"), ("passkey", "longest", "higher"), ("lm", "longest", "lower")]},
    {"implementation": "lssa",
     "claim": "softplus attention with an entropy-invariant length scale (LSSA, without the paper's re-weighting "
              "stage) keeps the loss nearly constant far past the training length (16x in the paper)",
     "source": "Gao et al. 2025, arXiv:2501.13428; our scale: log_{L_train} n (see normalizers/softplus.py)",
     "checks": [("lm", "longest", "lower"), ("passkey", "longest", "higher")]},
    {"implementation": "asentmax",
     "claim": "adaptive-scalable entmax: higher retrieval accuracy far past the training length (8x in the paper) "
              "and a better long-context perplexity trend than softmax (and SSMax)",
     "source": "Vasylenko et al. 2025, arXiv:2506.16640 (ICLR 2026)",
     "checks": [("mqar", "longest", "higher"), ("passkey", "longest", "higher"), ("lm", "longest", "lower")]},
    {"implementation": "fox",
     "claim": "forgetting attention (a data-dependent forget gate as an additive bias) extrapolates in length: "
              "lower loss than the RoPE Transformer past the training context",
     "source": "Lin et al. 2025, arXiv:2503.02130 (ICLR 2025); here the gate reads the value vector and the "
               "model keeps its RoPE",
     "checks": [("lm", "longest", "lower"), ("passkey", "longest", "higher")]},
    {"implementation": "gated",
     "claim": "a sigmoid gate per head after attention removes the attention sink and massive activations, and "
              "extrapolates in length better than plain softmax attention",
     "source": "Qiu et al. 2025, arXiv:2505.06708 (NeurIPS 2025); here the gate reads the query, not the hidden state",
     "checks": [("lm", "sink", "lower"), ("lm", "kurtosis", "lower"), ("lm", "longest", "lower")]},
    {"implementation": "diff",
     "claim": "differential attention (the difference of two softmax maps) cancels attention noise: better key "
              "information retrieval and fewer activation outliers than the Transformer",
     "source": "Ye et al. 2025, arXiv:2410.05258 (ICLR 2025)",
     "checks": [("mqar", "first", "higher"), ("passkey", "longest", "higher"), ("lm", "kurtosis", "lower")]},
]


#: a "lower than softmax" claim about a phenomenon can only be tested where softmax shows it: metric -> (the
#: reference mean must exceed this, what is missing otherwise). Kurtosis 3 is Gaussian; the softpick paper's
#: softmax has 33,510.
PHENOMENA: dict[str, tuple[float, str]] = {
    "sink_rate": (0.0, "no softmax head has a sink"),
    "sink": (0.1, "softmax puts little weight on the first token"),
    "kurtosis": (10.0, "softmax's hidden states have no outliers"),
}


#: how a claim check reads in words (docs/evaluation.md's list of claims)
_CHECK_WORDS = {"first": "at L", "longest": "at the longest test", "sink": "first-token (sink) share",
                "sink_rate": "sink rate", "kurtosis": "max hidden-state kurtosis"}


def _margin_kind(task: str, which: str) -> str:
    return "accuracy" if task != "lm" else ("loss" if which in ("first", "longest") else which)


def _margin_words(task: str, which: str) -> str:
    m = verdicts.MARGINS[_margin_kind(task, which)]
    unit = {"accuracy": " points", "loss": " nats/char", "sink_rate": " points"}.get(_margin_kind(task, which), "")
    return f"{m:g}{unit}"


def claims_list() -> str:
    """Every published claim the main job tests (``CLAIMS``): implementation, claim, source and what measures it,
    with the margin the verdict counts."""
    def words(task: str, which: str, expect: str) -> str:
        what = "LM loss" if which in ("first", "longest") else "LM"
        return (f"{what if task == 'lm' else task + ' accuracy'} {_CHECK_WORDS[which]} ({expect}, margin "
                f"{_margin_words(task, which)})")

    lines = ["| implementation | claim | source | measured by (expected vs softmax, margin) |", "|---|---|---|---|"]
    for claim in CLAIMS:
        checks = "; ".join(words(*check) for check in claim["checks"])
        lines.append(f"| `{claim['implementation']}` | {claim['claim']} | {claim['source']} | {checks} |")
    return "\n".join(lines)


def _check_path(res: Results, task: str, which: str) -> tuple[str, list[str], float, int] | None:
    rec = res.first_ok(task)
    if rec is None:
        return None
    if task == "lm":
        L = rec["train_length"]
        if which in ("first", "longest"):
            c = rec["contexts"][0 if which == "first" else -1]
            return (f"LM val loss (nats/char) @ {c // L}x L", ["val_loss_per_char", str(c)], 1.0, 3)
        return {"sink": ("LM first-token (sink) share", ["sink_share"], 1.0, 3),
                "sink_rate": ("LM sink rate (% heads, first-token weight > 0.3)", ["sink_rate"], 100.0, 0),
                "kurtosis": ("LM max hidden-state kurtosis", ["kurtosis_max_layer"], 1.0, 1)}[which]
    n = rec["lengths"][0 if which == "first" else -1]
    return (f"{task} accuracy % @ {n // rec['train_length']}x L", ["accuracy", str(n)], 100.0, 1)


def claim_checks(res: Results) -> list[dict[str, Any]]:
    """Every (claim, measurement) whose implementation, reference and task were run, with what its verdict needs:
    the per-seed values of both sides (index = seed), the expected direction, the margin and, for a claim about a
    phenomenon, the floor the reference must exceed."""
    out = []
    for claim in CLAIMS:
        spec = claim["implementation"]
        for task, which, expect in claim["checks"]:
            if task not in res.ids or spec not in res.ids[task] or res.reference not in res.ids[task]:
                continue
            col = _check_path(res, task, which)
            if col is None:
                continue
            label, path, scale, digits = col
            floor, missing = PHENOMENA.get(which, (None, ""))
            out.append({"claim": claim, "implementation": spec, "task": task, "which": which, "expect": expect,
                        "measurement": label, "path": path, "scale": scale, "digits": digits,
                        "margin": verdicts.MARGINS[_margin_kind(task, which)], "floor": floor, "untestable": missing,
                        "ref": res.values(task, res.reference, path, scale),
                        "imp": res.values(task, spec, path, scale)})
    return out


def cells_for_set(res: Results, k: int, adaptive: bool = True) -> set[tuple[str, str]]:
    """The (task, implementation) cells whose runs of seed set ``k`` (k >= 1) a claim verdict needs: the claimed
    implementation and the reference of every check whose sets before ``k`` can still agree on a verdict
    (``verdicts.still_decidable``; a check that can only be "not testable" needs the reference alone). With
    ``adaptive`` False: every claimed implementation and the reference on every task a claim is checked on."""
    cells: set[tuple[str, str]] = set()
    for c in claim_checks(res):
        if not adaptive:
            cells |= {(c["task"], c["implementation"]), (c["task"], res.reference)}
            continue
        _, outcomes = verdicts.check_verdict(c["ref"], c["imp"], res.sets[:k], c["expect"], c["margin"])
        testable = None
        if c["floor"] is not None:
            testable = [_testable(c, s) for s in res.sets[:k]]
        if not verdicts.still_decidable(outcomes, c["expect"], testable):
            continue
        cells.add((c["task"], res.reference))
        if not (testable is not None and not any(testable)):
            cells.add((c["task"], c["implementation"]))
    return cells


def _testable(c: Mapping[str, Any], seeds: Sequence[int]) -> bool | None:
    refs = [c["ref"][i] for i in seeds if i < len(c["ref"]) and c["ref"][i] is not None]
    return sum(refs) / len(refs) / c["scale"] > c["floor"] if refs else None


def _set_name(seeds: Sequence[int]) -> str:
    return f"seeds {seeds[0]}–{seeds[-1]}" if len(seeds) > 1 else f"seed {seeds[0]}"


def claim_rows(res: Results) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The claim checks with their verdicts under the seed-set protocol (``verdicts.check_verdict``), each with
    the paired comparison per seed set and the estimated rerun rates (``verdicts.rerun_rates``), and the rerun
    summary over the table: this protocol's and, on the same runs, the earlier single-test rule's on one set
    (cached on ``res``)."""
    if res._claims is not None:
        return res._claims
    checks = claim_checks(res)
    rows = []
    for c in checks:
        v, outcomes = verdicts.check_verdict(c["ref"], c["imp"], res.sets, c["expect"], c["margin"], c["floor"],
                                             c["untestable"], c["scale"])
        seeds = sorted({i for s in res.sets for i in s})
        rows.append({"implementation": c["implementation"], "claim": c["claim"]["claim"],
                     "source": c["claim"]["source"], "task": c["task"], "measurement": c["measurement"],
                     "expect": c["expect"], "margin": c["margin"], "digits": c["digits"],
                     "reference": res.stat(c["task"], res.reference, c["path"], c["scale"]),
                     "value": res.stat(c["task"], c["implementation"], c["path"], c["scale"]),
                     "paired": res.set_versus(c["task"], c["implementation"], c["path"], c["scale"], seeds),
                     "sets": [{"seeds": s, "paired": res.set_versus(c["task"], c["implementation"], c["path"],
                                                                    c["scale"], s), "outcome": o}
                              for s, o in zip(res.sets, outcomes)],
                     "verdict": v})
        c["verdict"] = v
        c["earlier_verdict"] = verdicts.single_test_verdict(c["ref"], c["imp"], res.sets[0], c["expect"],
                                                            c["floor"], c["scale"])
    summary: dict[str, Any] = {"sets": res.sets, "margins": dict(verdicts.MARGINS)}
    if checks and res.seeds >= 2 * len(res.sets) and all(len(s) >= 2 for s in res.sets):
        rates = verdicts.rerun_rates(checks, res.seeds, len(res.sets), draws=res.draws)
        for row, r in zip(rows, rates.pop("checks")):
            row["rerun"] = r
        summary["rerun"] = rates
        earlier = [{**c, "verdict": c["earlier_verdict"]} for c in checks]
        summary["earlier_rule"] = {k: v for k, v in verdicts.rerun_rates(
            earlier, res.seeds, len(res.sets), draws=res.draws, single_test=True).items() if k != "checks"}
        if len(res.sets) > 1:  # the earlier rule on each set alone, where both sets were measured
            both = [c for c in checks if all(len(verdicts.pairs(c["ref"], c["imp"], s)) >= 2 for s in res.sets[:2])]
            summary["earlier_rule"]["measured_on_both_sets"] = len(both)
            summary["earlier_rule"]["changed_on_second_set"] = sum(
                verdicts.single_test_verdict(c["ref"], c["imp"], res.sets[1], c["expect"], c["floor"], c["scale"])
                != c["earlier_verdict"] for c in both)
    res._claims = (rows, summary)
    return res._claims


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if x >= 0.01 or x == 0 else f"{100 * x:.1f}%"


def rerun_words(row: Mapping[str, Any]) -> str:
    """A claim row's estimated rerun rates in words: the share of reruns giving the same verdict, and (for a
    conclusive one) the share giving a different conclusive verdict."""
    r = row.get("rerun")
    if not r:
        return "—"
    if verdicts.conclusive(row["verdict"]):
        return f"same {_pct(r['same'])}, other verdict {_pct(r['contradicted'])}"
    return f"same {_pct(r['same'])}"


def claims_table(res: Results) -> tuple[str, list[dict[str, Any]]]:
    """One row per (claim, measurement) whose implementation and task were run: reference and claimed
    implementation (mean ± CI over every seed measured), the paired difference in each seed set, the verdict and
    how often a rerun is estimated to give the same verdict (and another conclusive one)."""
    rows, _ = claim_rows(res)
    set_heads = [f"Δ {_set_name(s)} (95% CI)" for s in res.sets]
    head = ["claim (source)", "measurement (margin)", res.reference, "implementation", *set_heads, "verdict",
            "rerun (estimated)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    last = None
    for r in rows:
        said = f"{r['claim']} ({r['source']})" if r["claim"] != last else "〃"
        last = r["claim"]
        d = r["digits"]
        per_set = [fmt_diff(x["paired"], d) if x["paired"] else "—" for x in r["sets"]]
        lines.append(f"| {said} | {r['measurement']} (margin {r['margin']:g}) | {fmt_ci(r['reference'], d)} | "
                     f"`{r['implementation']}` {fmt_ci(r['value'], d)} | " + " | ".join(per_set)
                     + f" | {r['verdict']} | {rerun_words(r)} |")
    return "\n".join(lines), rows


def rerun_summary(res: Results) -> str:
    """How often a rerun is estimated to change the claims table (``claim_rows``), in words, next to the earlier
    single-test rule on the same runs."""
    rows, summary = claim_rows(res)
    rates = summary.get("rerun")
    if not rates:
        return "No rerun estimate: it needs at least two seeds in every seed set."
    conclusive = [r for r in rows if verdicts.conclusive(r["verdict"])]
    worst = max(conclusive, key=lambda r: r["rerun"]["contradicted"], default=None)
    e = summary["earlier_rule"]
    sets = ", ".join(_set_name(s) for s in res.sets)
    text = (f"Estimated from the runs ({rates['draws']:,} reruns drawn with replacement from the {rates['seeds']} "
            f"seeds, split into sets as the job splits them ({sets}), every verdict recomputed): "
            f"{len(conclusive)} of {len(rows)} checks have a verdict; a rerun leaves every verdict standing (none "
            f"turned into another verdict) in {_pct(rates['none_contradicted'])} of draws, with "
            f"{rates['mean_contradicted']:.2f} verdicts turned per rerun on average")
    if worst is not None and worst["rerun"]["contradicted"] > 0:
        text += (f" (the most fragile: `{worst['implementation']}` {worst['measurement']}, "
                 f"{_pct(worst['rerun']['contradicted'])})")
    text += (f"; it changes some row between a verdict and \"inconclusive\" in {_pct(1 - rates['none_changed'])} "
             f"of draws ({rates['mean_changed']:.2f} rows per rerun). The earlier rule (one paired t-test at 5% on "
             f"one set of {e['set_size']} seeds, no margin) on the same runs changes at least one of its verdicts "
             f"in {_pct(1 - e['none_changed'])} of draws ({e['mean_changed']:.2f} rows per rerun)")
    if e.get("measured_on_both_sets"):
        text += (f"; on the {e['measured_on_both_sets']} checks measured on both sets it gives a different verdict "
                 f"on {_set_name(res.sets[0])} than on {_set_name(res.sets[1])} for {e['changed_on_second_set']}")
    return text + "."


def second_run_rows(first: Results, second: Results) -> list[dict[str, Any]]:
    """The claim checks of two runs of the job side by side (matched by implementation and measurement), each
    classified: ``same`` verdict, ``to or from inconclusive`` (a verdict in one run, none in the other: the change
    the protocol allows), ``contradicted`` (two different verdicts) or ``missing`` (not checked in the second)."""
    rows_b = {(r["implementation"], r["measurement"]): r for r in claim_rows(second)[0]}
    out = []
    for a in claim_rows(first)[0]:
        b = rows_b.get((a["implementation"], a["measurement"]))
        if b is None:
            change = "missing"
        elif b["verdict"] == a["verdict"]:
            change = "same"
        elif verdicts.contradicts(a["verdict"], b["verdict"]):
            change = "contradicted"
        else:
            change = "to or from inconclusive"
        out.append({"first": a, "second": b, "change": change})
    return out


def second_run_table(first: Results, second: Results) -> str:
    """Markdown: each claim check's per-set differences and verdict in both runs, and what changed."""
    rows = second_run_rows(first, second)
    lines = ["| implementation | measurement | Δ per seed set, this run | verdict | Δ per seed set, second run | "
             "verdict | change |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        a, b = r["first"], r["second"]

        def sets(x: Mapping[str, Any] | None) -> str:
            if x is None:
                return "—"
            return "; ".join(fmt_diff(s["paired"], x["digits"]) if s["paired"] else "—" for s in x["sets"])

        lines.append(f"| `{a['implementation']}` | {a['measurement']} | {sets(a)} | {a['verdict']} | {sets(b)} | "
                     f"{b['verdict'] if b else '—'} | {r['change']} |")
    return "\n".join(lines)


def second_run_summary(first: Results, second: Results) -> dict[str, Any]:
    """Counts of ``second_run_rows``' changes, how many runs both hold ended training differently (evidence that the
    second run's floating-point order differed: runs are bit-identical under the same order) and, per task, how many
    runs' test measurements moved and by how much at most (accuracy points; LM nats/char)."""
    rows = second_run_rows(first, second)
    counts = {k: sum(r["change"] == k for r in rows) for k in ("same", "to or from inconclusive", "contradicted",
                                                                 "missing")}
    both = [rid for rid, rec in first.records.items() if rec.get("status") == "ok"
            and (second.records.get(rid) or {}).get("status") == "ok"]
    differ = [rid for rid in both if first.records[rid].get("final_train_loss")
              != second.records[rid].get("final_train_loss")]
    moved: dict[str, dict[str, Any]] = {}
    for rid in both:  # the test measurements: accuracy points per length, LM nats/char per context
        a, b = first.records[rid], second.records[rid]
        x, y = (a["accuracy"], b["accuracy"]) if "accuracy" in a else (a["val_loss_per_char"], b["val_loss_per_char"])
        scale = 100.0 if "accuracy" in a else 1.0
        d = max((abs(x[k] - y[k]) * scale for k in x if k in y), default=0.0)
        m = moved.setdefault(rid.split("/")[0], {"runs": 0, "changed": 0, "largest": 0.0})
        m["runs"] += 1
        m["changed"] += d > 0
        m["largest"] = max(m["largest"], d)
    return {"checks": len(rows), **counts, "runs_in_both": len(both), "runs_differing": len(differ),
            "measurements_moved": moved}


# ------------------------------------------------------------------------------------------------------------ plots

def _band(ax, xs: Sequence[float], stats: Sequence[Mapping[str, Any]], label: str) -> None:
    ms = [s["mean"] for s in stats]
    line, = ax.plot(xs, ms, marker="o", markersize=3, label=label)
    lo = [s["lo"] if math.isfinite(s["lo"]) else s["mean"] for s in stats]
    hi = [s["hi"] if math.isfinite(s["hi"]) else s["mean"] for s in stats]
    ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)


def plot_bands(res: Results, task: str, xs: Sequence[float], paths: Sequence[Sequence[str]], scale: float,
               path: Path, title: str, xlabel: str, ylabel: str, logx: bool = True,
               hline: float | None = None, hline_label: str = "") -> dict[str, Any]:
    """One line per implementation (mean over seeds) with its 95% CI as a band; returns {path, series}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = []
    for spec in res.ids[task]:
        stats = [res.stat(task, spec, p, scale) for p in paths]
        if all(s["n"] == 0 for s in stats):
            continue
        _band(ax, xs, stats, spec)
        series.append(spec)
    if hline is not None:
        ax.axhline(hline, color="gray", linestyle="--", linewidth=1, label=hline_label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"path": str(path), "series": series}


# ------------------------------------------------------------------------------- README summary (results.json)

def results_from_json(data: Mapping[str, Any]) -> Results:
    """The ``Results`` of a written ``results.json`` (scripts/compare.py): its per-run records, arranged as the sweep
    arranged them (which seeds each configuration ran, the seed sets), so every table is re-rendered from the raw
    records with the code that rendered results.md."""
    records = {r["id"]: r for r in data["runs"]}
    if "run_ids" in data:
        return Results(records, data["run_ids"], data["reference"], data["seed_sets"])
    seeds = int(data["settings"]["seeds"])
    ids = {task: {spec: [f"{task}/{label_of(spec)}/seed{s}" for s in range(seeds)] for spec in data["implementations"]}
           for task in data["tasks"]}
    return Results(records, ids, data["reference"])


def headline_table(res: Results) -> str:
    """One row per implementation: each probe's accuracy at the training length and the longest test length, and the
    LM loss at both (mean ± 95% CI, ▲/▼ = significant paired difference from the reference)."""
    columns: list[tuple[str, str, list[str], float, int]] = []
    for task in ("mqar", "passkey"):
        rec = res.first_ok(task) if task in res.ids else None
        if rec is not None:
            L, lengths = rec["train_length"], rec["lengths"]
            columns += [(task, f"{task} % @ {n // L}x L", ["accuracy", str(n)], 100.0, 1)
                        for n in (lengths[0], lengths[-1])]
    rec = res.first_ok("lm") if "lm" in res.ids else None
    if rec is not None:
        L, ctx = rec["train_length"], rec["contexts"]
        columns += [("lm", f"LM nats/char @ {c // L}x L", ["val_loss_per_char", str(c)], 1.0, 3)
                    for c in (ctx[0], ctx[-1])]
    specs = list(next(iter(res.ids.values()))) if res.ids else []
    lines = ["| implementation | " + " | ".join(c[1] for c in columns) + " |", "|" + "---|" * (len(columns) + 1)]
    for spec in specs:
        cells = [fmt_ci(res.stat(task, spec, path, scale), digits) + _mark(res.versus(task, spec, path, scale))
                 for task, _, path, scale, digits in columns]
        lines.append(f"| `{spec}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def headline_sentence(res: Results) -> str:
    """Which implementations differ significantly from the reference at the longest test length of each task,
    better and worse (higher accuracy / lower loss is better)."""
    parts = []
    for task in ("mqar", "passkey", "lm"):
        rec = res.first_ok(task) if task in res.ids else None
        if rec is None:
            continue
        if task == "lm":
            n, path, label, lower_is_better = rec["contexts"][-1], ["val_loss_per_char", str(rec["contexts"][-1])], \
                "LM loss", True
        else:
            n, path, label, lower_is_better = rec["lengths"][-1], ["accuracy", str(rec["lengths"][-1])], task, False
        better, worse = [], []
        for spec in res.ids[task]:
            comp = res.versus(task, spec, path)
            if comp and comp.get("significant"):
                (better if (comp["diff"] < 0) == lower_is_better else worse).append(f"`{spec}`")
        parts.append(f"* {label} at {n // rec['train_length']}x L: better {', '.join(better) or 'none'}; "
                     f"worse {', '.join(worse) or 'none'}")
    return (f"Significantly different from `{res.reference}` at the longest test length (paired by seed, 5%):\n\n"
            + "\n".join(parts))


def verdicts_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The published-claim checks of ``claims_table`` in short, one row per claim: its implementation and source,
    then per measurement the paired difference from the reference in each seed set (95% CI, * = significant) and
    the verdict (the claims' full text is in results.md)."""
    lines = ["| implementation | source | measurement: Δ vs reference per seed set (95% CI) → verdict |",
             "|---|---|---|"]
    grouped: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        per_set = "; ".join(fmt_diff(x["paired"], r["digits"]) if x["paired"] else "—" for x in r["sets"])
        grouped.setdefault((r["implementation"], r["source"].split(";")[0]), []).append(
            f"{r['measurement']}: {per_set} → **{r['verdict']}**")
    for (spec, source), checks in grouped.items():
        lines.append(f"| `{spec}` | {source} | " + "<br>".join(checks) + " |")
    return "\n".join(lines)
