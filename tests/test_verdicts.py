"""The claim-verdict protocol of the main job (hf_attnorm.lab.compare.verdicts): each seed set's outcome against the
margin, verdicts only where the sets agree, which configurations the later sets need, and the rerun estimate; and the
claims table built on it (hf_attnorm.lab.compare.report) from constructed records."""

from __future__ import annotations

import pytest

from hf_attnorm.lab.compare import report, verdicts
from hf_attnorm.lab.compare.verdicts import INCONCLUSIVE, check_verdict, set_outcome, verdict

SETS = [[0, 1, 2], [3, 4, 5]]


def test_seed_sets_are_disjoint_and_consecutive():
    assert verdicts.seed_sets(6, 2) == SETS
    assert verdicts.seed_sets(4, 1) == [[0, 1, 2, 3]]
    for seeds, sets in [(5, 2), (6, 4), (0, 1)]:
        with pytest.raises(ValueError, match="multiple"):
            verdicts.seed_sets(seeds, sets)


def test_set_outcome_against_the_margin_by_hand():
    # differences 6, 7, 8: mean 7, sd 1, half-width 4.3027 / sqrt(3) = 2.484 -> CI [4.52, 9.48]
    assert verdicts.paired_ci([6.0, 7.0, 8.0]) == pytest.approx((7.0, 4.5159, 9.4841), abs=1e-4)
    assert set_outcome([6.0, 7.0, 8.0], "higher", 5.0) == "for"
    assert set_outcome([6.0, 7.0, 8.0], "higher", 8.0) == "open"  # significant, but the mean is below the margin
    assert set_outcome([-6.0, -7.0, -8.0], "higher", 5.0) == "against"
    assert set_outcome([-6.0, -7.0, -8.0], "lower", 5.0) == "for"  # "lower" claims read the difference negated
    assert set_outcome([-3.0, -4.0, -5.0], "higher", 5.0) == "short"  # worse, but by less than the margin
    assert set_outcome([0.0, 1.0, 2.0], "higher", 5.0) == "short"  # CI [-1.48, 3.48]: a gain of 5 is ruled out
    assert set_outcome([-10.0, 0.0, 10.0], "higher", 5.0) == "open"  # CI [-24.8, 24.8]: cannot tell
    assert set_outcome([1.0], "higher", 5.0) == "few"
    # "matches the reference": the CI inside (-m, m), or a significant difference of at least m
    assert set_outcome([0.5, 1.0, 1.5], "equal", 5.0) == "for"
    assert set_outcome([20.0, 21.0, 22.0], "equal", 5.0) == "against"
    assert set_outcome([-10.0, 0.0, 10.0], "equal", 5.0) == "open"
    with pytest.raises(ValueError, match="higher, lower or equal"):
        set_outcome([1.0, 2.0], "sideways", 1.0)


def test_set_outcome_equal_small_significant_difference_is_not_against():
    # a significant difference smaller than the margin: neither equivalent (CI reaches the margin) nor "differs"
    assert set_outcome([4.0, 4.5, 5.0], "equal", 5.0) == "open"
    assert set_outcome([5.5, 6.0, 6.5], "equal", 5.0) == "against"


def test_verdict_needs_every_set_to_agree():
    assert verdict(["for", "for"], "higher") == "holds"
    assert verdict(["against", "against"], "higher") == "refuted (opposite direction)"
    assert verdict(["against", "against"], "equal") == "refuted (differs)"
    assert verdict(["short", "short"], "higher") == verdicts.NOT_REPRODUCED
    assert verdict(["short", "against"], "lower") == verdicts.NOT_REPRODUCED  # both rule the claimed effect out
    for outcomes in (["for", "against"], ["for", "short"], ["for", "open"], ["open", "open"], ["short", "open"]):
        assert verdict(outcomes, "higher") == INCONCLUSIVE, outcomes
    assert verdict(["short", "short"], "equal") == INCONCLUSIVE  # "short" says nothing about a match
    # a set without runs: inconclusive if the sets before already disagree or cannot tell, else not enough seeds
    assert verdict(["open", "few"], "higher") == INCONCLUSIVE
    assert verdict(["for", "few"], "higher") == verdicts.FEW_SEEDS
    # claims about a phenomenon the reference must show in every set
    assert verdict(["short", "short"], "lower", [False, False], "no sink").startswith("not testable at this scale")
    assert verdict(["for", "for"], "lower", [True, False]) == INCONCLUSIVE
    assert verdict(["for", "for"], "lower", [True, True]) == "holds"
    assert verdict(["for", "for"], "lower", [True, None]) == verdicts.FEW_SEEDS


def test_contradiction_is_between_two_verdicts_only():
    assert verdicts.contradicts("holds", verdicts.NOT_REPRODUCED)
    assert verdicts.contradicts("refuted (opposite direction)", verdicts.NOT_REPRODUCED)
    assert not verdicts.contradicts("holds", INCONCLUSIVE) and not verdicts.contradicts(INCONCLUSIVE, "holds")
    assert not verdicts.contradicts("holds", "holds")


def test_check_verdict_splits_the_seeds():
    ref = [30.0, 31.0, 32.0, 30.0, 31.0, 33.0]
    # every seed 10 points better: holds; better only in the second set: inconclusive
    assert check_verdict(ref, [r + 10 + 0.5 * i for i, r in enumerate(ref)], SETS, "higher", 5.0)[0] == "holds"
    mixed = ref[:3] + [r + 10 + 0.5 * i for i, r in enumerate(ref[3:])]
    v, outcomes = check_verdict(ref, mixed, SETS, "higher", 5.0)
    assert v == INCONCLUSIVE and outcomes == ["short", "for"]
    # a seed missing on one side drops that pair only
    v, outcomes = check_verdict(ref, [None, *[r + 10 + 0.5 * i for i, r in enumerate(ref)][1:]], SETS, "higher", 5.0)
    assert outcomes[1] == "for" and outcomes[0] in ("for", "open")


def test_still_decidable_says_whether_the_next_set_can_matter():
    assert verdicts.still_decidable(["for"], "higher") and verdicts.still_decidable(["short"], "higher")
    assert verdicts.still_decidable(["against"], "equal") and not verdicts.still_decidable(["short"], "equal")
    assert not verdicts.still_decidable(["open"], "higher") and not verdicts.still_decidable(["few"], "higher")
    assert not verdicts.still_decidable(["for", "short"], "higher")
    assert verdicts.still_decidable(["short"], "lower", [False])  # "not testable" needs the next set's reference
    assert not verdicts.still_decidable(["short"], "lower", [None])


def _checks(n_borderline: int = 1) -> list[dict]:
    """A clear effect and ``n_borderline`` effects at the edge of significance, 6 seeds each."""
    clear = {"ref": [30.0, 31.0, 32.0, 30.0, 31.0, 33.0], "imp": [45.0, 47.0, 46.0, 44.0, 48.0, 47.0],
             "expect": "higher", "margin": 5.0}
    edge = {"ref": [30.0, 32.0, 31.0, 30.0, 33.0, 31.0], "imp": [38.0, 31.0, 40.0, 29.0, 41.0, 36.0],
            "expect": "higher", "margin": 5.0}
    out = [clear] + [dict(edge) for _ in range(n_borderline)]
    for c in out:
        c["verdict"] = check_verdict(c["ref"], c["imp"], SETS, c["expect"], c["margin"])[0]
        c["earlier"] = verdicts.single_test_verdict(c["ref"], c["imp"], SETS[0], c["expect"])
    return out


def test_rerun_rates_are_deterministic_and_see_what_is_fragile():
    checks = _checks()
    assert [c["verdict"] for c in checks] == ["holds", INCONCLUSIVE]
    a = verdicts.rerun_rates(checks, 6, 2, draws=400, rng_seed=3)
    assert a == verdicts.rerun_rates(checks, 6, 2, draws=400, rng_seed=3)
    assert a != verdicts.rerun_rates(checks, 6, 2, draws=400, rng_seed=4)
    clear, edge = a["checks"]
    assert clear["same"] > 0.95 and clear["contradicted"] == 0  # every seed is 13+ points better
    assert edge["contradicted"] == 0 and 0 < edge["same"] < 1  # inconclusive is never contradicted
    assert a["none_contradicted"] == 1.0 and a["mean_changed"] > 0
    # the earlier rule (one t-test on 3 seeds, no margin) changes its verdict on the borderline check far more often
    earlier = [{**c, "verdict": c["earlier"]} for c in checks]
    e = verdicts.rerun_rates(earlier, 6, 2, draws=400, rng_seed=3, single_test=True)
    assert e["checks"][1]["changed"] > 0.2 and e["none_changed"] < a["none_contradicted"]


def _records(task: str, values: dict[str, list[float]], path: list[str], seeds: int) -> tuple[dict, dict]:
    records, ids = {}, {task: {}}
    for spec, vals in values.items():
        ids[task][spec] = []
        for seed in range(seeds):
            rid = f"{task}/{spec}/seed{seed}"
            ids[task][spec].append(rid if seed < len(vals) else None)
            if seed >= len(vals):
                continue
            rec: dict = {"status": "ok", "train_length": 8, "contexts": [8, 64], "lengths": [8, 64]}
            node = rec
            for p in path[:-1]:
                node = node.setdefault(p, {})
            node[path[-1]] = vals[seed]
            records[rid] = rec
    return records, ids


def test_cells_for_the_second_set_follow_the_first_sets_outcomes():
    # first set only: asentmax clearly better (a verdict is possible), ssmax cannot tell (open: no second set)
    records, ids = _records("mqar", {"softmax": [0.30, 0.31, 0.32], "asentmax": [0.50, 0.52, 0.51],
                                     "ssmax": [0.10, 0.60, 0.35]}, ["accuracy", "64"], 6)
    for rec in records.values():
        rec["accuracy"]["8"] = 1.0
    res = report.Results(records, ids, "softmax", SETS)
    assert report.cells_for_set(res, 1) == {("mqar", "softmax"), ("mqar", "asentmax")}
    assert report.cells_for_set(res, 1, adaptive=False) == {("mqar", "softmax"), ("mqar", "asentmax"),
                                                           ("mqar", "ssmax")}
    rows, _ = report.claim_rows(res)
    by = {r["implementation"]: r for r in rows}
    assert by["ssmax"]["verdict"] == INCONCLUSIVE  # open in the first set: its second set cannot help
    assert by["asentmax"]["verdict"] == verdicts.FEW_SEEDS  # the second set it needs is not there yet
    # an LM claim about a sink softmax does not form: the second set needs softmax alone
    records, ids = _records("lm", {"softmax": [0.01, 0.01, 0.01], "softpick": [0.01, 0.01, 0.01]}, ["sink_share"], 6)
    for rec in records.values():
        rec.update(sink_rate=0.0, kurtosis_max_layer=3.0, val_loss_per_char={"8": 2.0, "64": 2.5})
    assert report.cells_for_set(report.Results(records, ids, "softmax", SETS), 1) == {("lm", "softmax")}


def test_claims_table_reports_each_set_the_verdict_and_the_rerun_estimate():
    values = {"softmax": [0.50, 0.52, 0.55, 0.51, 0.50, 0.53], "ssmax": [0.70, 0.71, 0.75, 0.72, 0.74, 0.70],
              "sigmoid": [0.30, 0.31, 0.35, 0.30, 0.32, 0.33]}
    records, ids = _records("mqar", values, ["accuracy", "64"], 6)
    for rid, rec in records.items():  # 1x accuracies for sigmoid's "matches softmax" check
        rec["accuracy"]["8"] = 1.0 if "sigmoid" not in rid else 0.99 + 0.01 * rid.endswith(("1", "4"))
    res = report.Results(records, ids, "softmax", SETS, draws=300)
    md, rows = report.claims_table(res)
    by = {(r["implementation"], r["measurement"]): r for r in rows}
    assert by[("ssmax", "mqar accuracy % @ 8x L")]["verdict"] == "holds"
    assert by[("sigmoid", "mqar accuracy % @ 1x L")]["verdict"] == "holds"  # within 5 points of softmax in both sets
    assert [s["seeds"] for s in by[("ssmax", "mqar accuracy % @ 8x L")]["sets"]] == SETS
    assert by[("ssmax", "mqar accuracy % @ 8x L")]["sets"][1]["paired"]["diff"] == pytest.approx(
        100 * (0.21 + 0.24 + 0.17) / 3)
    head = md.splitlines()[0]
    assert "Δ seeds 0–2 (95% CI)" in head and "Δ seeds 3–5 (95% CI)" in head and "rerun (estimated)" in head
    assert len(md.splitlines()) == 2 + len(rows) == 4
    assert all(r["rerun"]["same"] > 0.9 for r in rows)  # large, consistent effects
    summary = report.rerun_summary(res)
    assert "2 of 2 checks have a verdict" in summary and "300 reruns" in summary
    # the opposite direction, clear in both sets: refuted
    records, ids = _records("mqar", {"softmax": values["ssmax"], "ssmax": values["softmax"]}, ["accuracy", "64"], 6)
    for rec in records.values():
        rec["accuracy"]["8"] = 1.0
    rows, _ = report.claim_rows(report.Results(records, ids, "softmax", SETS, draws=50))
    assert rows[0]["verdict"] == "refuted (opposite direction)"


def test_second_run_changes_are_classified():
    """Two runs of the job side by side: the same verdict, a move to or from "inconclusive", a contradiction."""
    ref = [0.50, 0.52, 0.55, 0.51, 0.50, 0.53]
    first = {"softmax": ref, "ssmax": [0.70, 0.71, 0.75, 0.72, 0.74, 0.70], "stickbreaking": [x + 0.2 for x in ref],
             "asentmax": [0.50, 0.53, 0.54, 0.52, 0.49, 0.53]}
    second = {**first, "stickbreaking": [0.50, 0.95, 0.30, 0.52, 0.40, 0.80],  # holds -> inconclusive
              "asentmax": [x + 0.2 for x in ref]}  # not reproduced -> holds
    results = []
    for values in (first, second):
        records, ids = _records("mqar", values, ["accuracy", "64"], 6)
        for rid, rec in records.items():
            rec["accuracy"]["8"] = 1.0
            rec["final_train_loss"] = 1.0 if "ssmax" in rid and values is second else 0.5
        results.append(report.Results(records, ids, "softmax", SETS, draws=50))
    changes = {r["first"]["implementation"]: r["change"] for r in report.second_run_rows(*results)
               if r["first"]["measurement"] == "mqar accuracy % @ 8x L"}
    assert changes == {"ssmax": "same", "stickbreaking": "to or from inconclusive", "asentmax": "contradicted"}
    summary = report.second_run_summary(*results)
    assert summary["checks"] == 3 and summary["contradicted"] == 1 and summary["same"] == 1
    assert summary["runs_in_both"] == 24 and summary["runs_differing"] == 6  # ssmax's runs ended differently
    # stickbreaking's and asentmax's 6 runs each moved (stickbreaking's seed 2 by 45 points), the others' did not
    assert summary["measurements_moved"] == {"mqar": {"runs": 24, "changed": 12, "largest": pytest.approx(45.0)}}
    table = report.second_run_table(*results)
    assert table.count("\n") == 2 + 3 - 1 and "| contradicted |" in table
