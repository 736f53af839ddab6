"""hf_attnorm.lab.compare.stats against hand-computed values, and the claims verdicts of hf_attnorm.lab.compare.report
on one seed set (the seed-set protocol itself: tests/test_verdicts.py)."""

from __future__ import annotations

import math

import pytest

from hf_attnorm.lab.compare import report
from hf_attnorm.lab.compare.stats import betainc, mean_ci, paired, significance_mark, t_cdf, t_ppf


def test_t_distribution_against_tables():
    # two-sided 95% critical values from any t table
    for df, crit in [(1, 12.706205), (2, 4.302653), (4, 2.776445), (10, 2.228139), (30, 2.042272)]:
        assert t_ppf(0.975, df) == pytest.approx(crit, abs=1e-5)
    assert t_ppf(0.025, 4) == pytest.approx(-2.776445, abs=1e-5)
    assert t_cdf(1.0, 1) == pytest.approx(0.75)  # Cauchy: 1/2 + atan(1)/pi
    # df = 2 has a closed form: F(t) = 1/2 + t / (2 sqrt(t^2 + 2))
    for t in (-3.0, 0.5, 2.0):
        assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(t * t + 2)), abs=1e-12)
    assert t_cdf(0.0, 7) == pytest.approx(0.5)
    assert betainc(1.0, 1.0, 0.3) == pytest.approx(0.3)  # uniform
    assert betainc(2.0, 1.0, 0.5) == pytest.approx(0.25)  # x^a


def test_mean_ci_by_hand():
    s = mean_ci([1.0, 2.0, 3.0])
    assert s["n"] == 3 and s["mean"] == 2.0 and s["std"] == pytest.approx(1.0)
    assert s["half"] == pytest.approx(4.302653 / math.sqrt(3), abs=1e-5)  # 2.48414
    assert s["lo"] == pytest.approx(2.0 - s["half"]) and s["hi"] == pytest.approx(2.0 + s["half"])
    # missing and non-finite values are dropped, not counted as zeros
    assert mean_ci([1.0, None, 3.0, math.nan])["n"] == 2
    one = mean_ci([5.0])
    assert one["mean"] == 5.0 and math.isnan(one["half"])
    assert mean_ci([])["n"] == 0 and math.isnan(mean_ci([])["mean"])


def test_paired_by_hand():
    # differences 1, 2, 3: mean 2, sd 1, t = 2 sqrt(3) = 3.4641 on 2 df; p = 1 - t / sqrt(t^2 + 2) = 0.074180
    c = paired([1.0, 2.0, 4.0], [0.0, 0.0, 1.0])
    assert c["diff"] == pytest.approx(2.0) and c["p"] == pytest.approx(1 - 3.4641016 / math.sqrt(14), abs=1e-6)
    assert not c["significant"] and c["wins"] == 3 and significance_mark(c) == ""
    # a consistent difference: 10, 11, 12 -> t = 11 sqrt(3) = 19.05, p = 0.00274
    c = paired([10.0, 11.0, 12.0], [0.0, 0.0, 0.0])
    assert c["significant"] and c["p"] == pytest.approx(1 - 19.0525589 / math.sqrt(19.0525589 ** 2 + 2), rel=1e-5)
    assert significance_mark(c) == "+*"
    assert significance_mark(paired([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])) == "-*"  # zero spread, non-zero shift
    same = paired([1.0, 1.0], [1.0, 1.0])
    assert same["p"] == 1.0 and not same["significant"]
    # a missing seed on either side drops that pair only
    assert paired([1.0, None, 3.0], [0.0, 5.0, 1.0])["n"] == 2
    with pytest.raises(ValueError, match="one value per seed"):
        paired([1.0, 2.0], [1.0])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="quantile level"):
        t_ppf(1.0, 3)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_cdf(1.0, 0)
    with pytest.raises(ValueError, match="0 <= x <= 1"):
        betainc(1.0, 1.0, 1.5)


def _records(task: str, values: dict[str, list[float]], path: list[str]) -> tuple[dict, dict]:
    records, ids = {}, {task: {}}
    for spec, vals in values.items():
        ids[task][spec] = []
        for seed, v in enumerate(vals):
            rid = f"{task}/{spec}/seed{seed}"
            rec: dict = {"status": "ok", "train_length": 8, "contexts": [8, 64], "lengths": [8, 64]}
            node = rec
            for p in path[:-1]:
                node = node.setdefault(p, {})
            node[path[-1]] = v
            records[rid] = rec
            ids[task][spec].append(rid)
    return records, ids


def test_claim_verdicts():
    # ssmax better than softmax on every seed at the longest MQAR length: the claim holds
    records, ids = _records("mqar", {"softmax": [0.50, 0.52, 0.55], "ssmax": [0.70, 0.71, 0.75],
                                     "sigmoid": [0.30, 0.31, 0.35]}, ["accuracy", "64"])
    # 1x accuracies for the sigmoid "matches softmax" check
    for rid, rec in records.items():
        rec["accuracy"]["8"] = 1.0 if "sigmoid" not in rid else 0.99 + 0.01 * (rid.endswith("1"))
    res = report.Results(records, ids, "softmax", draws=200)
    md, rows = report.claims_table(res)
    by = {(r["implementation"], r["measurement"]): r["verdict"] for r in rows}
    assert by[("ssmax", "mqar accuracy % @ 8x L")] == "holds"
    assert by[("sigmoid", "mqar accuracy % @ 1x L")] == "holds"  # within the 5-point margin of softmax
    assert len(rows) == 2 and md.count("\n") == 3  # header, separator, two rows
    # the opposite direction is named as such
    records, ids = _records("mqar", {"softmax": [0.70, 0.71, 0.75], "ssmax": [0.50, 0.52, 0.55]},
                            ["accuracy", "64"])
    for rec in records.values():
        rec["accuracy"]["8"] = 1.0
    _, rows = report.claims_table(report.Results(records, ids, "softmax", draws=200))
    assert rows[0]["verdict"] == "refuted (opposite direction)"
    assert rows[0]["paired"]["diff"] == pytest.approx(-100 * (0.20 + 0.19 + 0.20) / 3)


def test_claim_about_an_absent_phenomenon_is_not_testable():
    # softpick "lower sink rate" when softmax itself has no sink head: not testable, not "not reproduced"
    records, ids = _records("lm", {"softmax": [0.0, 0.0, 0.0], "softpick": [0.0, 0.0, 0.0]}, ["sink_rate"])
    for rec in records.values():
        rec.update(sink_share=0.01, kurtosis_max_layer=3.0, val_loss_per_char={"8": 2.0, "64": 2.5})
    _, rows = report.claims_table(report.Results(records, ids, "softmax", draws=200))
    verdicts = {r["measurement"]: r["verdict"] for r in rows}
    assert verdicts["LM sink rate (% heads, first-token weight > 0.3)"] == (
        "not testable at this scale (no softmax head has a sink)")
    assert verdicts["LM max hidden-state kurtosis"].startswith("not testable")
    # with a real sink in softmax, the same comparison is a test
    for rid, rec in records.items():
        rec["sink_rate"] = 0.5 if "/softmax/" in rid else 0.0
    _, rows = report.claims_table(report.Results(records, ids, "softmax", draws=200))
    verdicts = {r["measurement"]: r["verdict"] for r in rows}
    assert verdicts["LM sink rate (% heads, first-token weight > 0.3)"] == "holds"
