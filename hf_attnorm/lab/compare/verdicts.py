"""Verdicts on published claims that a rerun does not overturn, and how often one would.

A claim check compares an implementation with the reference seed by seed on one measurement (``report.CLAIMS``).
The seeds are split into disjoint sets (``seed_sets``: the main job's six seeds as 0-2 and 3-5), and each set gives
its own paired comparison: the mean difference and its 95% confidence interval (Student t). Each set's comparison
is read against the measurement's margin m (``MARGINS``: the smallest difference the verdicts count), with the
difference oriented so that positive is the claimed direction:

* ``for``: the CI excludes 0 and the mean difference is at least m;
* ``against``: the CI excludes 0 on the other side and the mean difference is at least m the other way;
* ``short``: the CI's upper end is below m, so an effect of the claimed size is ruled out (a small effect either
  way included);
* ``open``: none of these.

A verdict needs every set to agree, otherwise it is *inconclusive at this scale*: *holds* (every set ``for``),
*refuted* (every set ``against``), *not reproduced* (every set ``short`` or ``against``, not all ``against``). A claim
that an implementation *matches* the reference: ``for`` when the CI lies inside (-m, m), ``against`` when the
difference is significant and at least m; *holds* / *refuted* when every set agrees. A claim of less of a phenomenon
(sink, outliers) is *not testable at this scale* where the reference does not show it in any set, inconclusive
where only some sets do.

``rerun_rates`` estimates from the runs themselves how often a rerun would change the verdicts: it draws seeds with
replacement from all seeds measured (jointly for every check, a seed's runs staying together), splits them into sets
as the job does, and recomputes every verdict.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from .stats import t_ppf

__all__ = ["INCONCLUSIVE", "MARGINS", "check_verdict", "conclusive", "contradicts", "paired_ci", "rerun_rates",
           "pairs", "seed_sets", "set_outcome", "single_test_verdict", "still_decidable", "verdict"]

#: the smallest difference from the reference a verdict counts, per kind of measurement (in the table's units):
#: probe accuracy in percentage points, LM loss in nats/char, first-token share, sink rate in percentage points of
#: heads, max kurtosis
MARGINS: dict[str, float] = {"accuracy": 5.0, "loss": 0.02, "sink": 0.02, "sink_rate": 5.0, "kurtosis": 1.0}

INCONCLUSIVE = "inconclusive at this scale"
HOLDS = "holds"
REFUTED = {"higher": "refuted (opposite direction)", "lower": "refuted (opposite direction)",
           "equal": "refuted (differs)"}
NOT_REPRODUCED = "not reproduced (effect below the margin)"
FEW_SEEDS = "not enough seeds"
OUTCOMES = ("for", "against", "short", "open")


def seed_sets(seeds: int, sets: int) -> list[list[int]]:
    """Seeds 0 .. ``seeds`` - 1 as ``sets`` disjoint consecutive sets of equal size (6, 2 -> [[0, 1, 2], [3, 4, 5]]).
    Raises ``ValueError`` unless ``seeds`` is a multiple of ``sets`` with at least 2 seeds a set."""
    if sets < 1 or seeds % sets or seeds // sets < 2:
        raise ValueError(f"seeds must split into {sets} set(s) of at least 2 seeds each (a multiple of {sets}, "
                         f">= {2 * sets}), got {seeds}")
    size = seeds // sets
    return [list(range(i * size, (i + 1) * size)) for i in range(sets)]


@cache
def _t_crit(df: int) -> float:
    return t_ppf(0.975, df)


def paired_ci(diffs: Sequence[float]) -> tuple[float, float, float]:
    """(mean, lo, hi) of the 95% CI (Student t) of the mean of ``diffs`` (at least 2 values); zero spread gives a
    zero-width interval, as ``stats.paired`` does."""
    n = len(diffs)
    m = sum(diffs) / n
    sd = math.sqrt(sum((d - m) ** 2 for d in diffs) / (n - 1))
    half = _t_crit(n - 1) * sd / math.sqrt(n)
    return m, m - half, m + half


def set_outcome(diffs: Sequence[float], expect: str, margin: float) -> str:
    """The outcome of one seed set: ``for``, ``against``, ``short`` or ``open`` (module docstring); ``diffs`` are the
    set's paired differences implementation - reference, ``expect`` is higher / lower / equal. Fewer than two
    differences: ``few``."""
    if len(diffs) < 2:
        return "few"
    m, lo, hi = paired_ci(diffs)
    if expect == "equal":
        if -margin < lo and hi < margin:
            return "for"
        return "against" if (lo > 0 or hi < 0) and abs(m) >= margin else "open"
    if expect == "lower":
        m, lo, hi = -m, -hi, -lo
    elif expect != "higher":
        raise ValueError(f"expected direction must be higher, lower or equal, got {expect!r}")
    if lo > 0 and m >= margin:
        return "for"
    if hi < 0 and m <= -margin:
        return "against"
    return "short" if hi < margin else "open"


def verdict(outcomes: Sequence[str], expect: str, testable: Sequence[bool | None] | None = None,
            untestable: str = "") -> str:
    """The verdict of a check from its sets' outcomes (``set_outcome``). ``testable``: per set, whether the
    reference shows the phenomenon the claim is about (None for the whole list: a claim about no phenomenon; None
    for a set: the reference has no value there); ``untestable`` says what is missing."""
    if testable is not None:
        known = [t for t in testable if t is not None]
        if any(known) and not all(known):
            return INCONCLUSIVE
        if len(known) < len(testable):  # a set without the reference's runs
            return FEW_SEEDS
        if not any(known):
            return f"not testable at this scale ({untestable})"
    if not outcomes:
        return FEW_SEEDS
    if "few" in outcomes:  # a set without its runs: inconclusive all the same if the sets before cannot agree
        before = list(outcomes[:outcomes.index("few")])
        return INCONCLUSIVE if before and not still_decidable(before, expect) else FEW_SEEDS
    if all(o == "for" for o in outcomes):
        return HOLDS
    if all(o == "against" for o in outcomes):
        return REFUTED[expect]
    if expect != "equal" and all(o in ("short", "against") for o in outcomes):
        return NOT_REPRODUCED
    return INCONCLUSIVE


def conclusive(v: str) -> bool:
    """Whether a verdict says something (holds, refuted, not reproduced, not testable) rather than nothing."""
    return v not in (INCONCLUSIVE, FEW_SEEDS)


def contradicts(a: str, b: str) -> bool:
    """Two verdicts contradict each other when both are conclusive and differ; a verdict and "inconclusive" never
    do."""
    return conclusive(a) and conclusive(b) and a != b


def pairs(ref: Sequence[float | None], imp: Sequence[float | None], seeds: Sequence[int]
           ) -> list[tuple[float, float]]:
    return [(imp[i], ref[i]) for i in seeds if i < len(ref) and i < len(imp) and ref[i] is not None
            and imp[i] is not None]


def check_verdict(ref: Sequence[float | None], imp: Sequence[float | None], sets: Sequence[Sequence[int]],
                  expect: str, margin: float, floor: float | None = None, untestable: str = "",
                  scale: float = 1.0) -> tuple[str, list[str]]:
    """(verdict, per-set outcomes) of one check from per-seed values (index = seed; None = no value) of the
    reference and the implementation. ``floor``: the reference's mean in a set must exceed it (in unscaled units:
    values / ``scale``) for the check to be testable there."""
    outcomes, testable = [], []
    for s in sets:
        both = pairs(ref, imp, s)
        outcomes.append(set_outcome([a - b for a, b in both], expect, margin))
        if floor is not None:
            refs = [ref[i] for i in s if i < len(ref) and ref[i] is not None]
            testable.append(sum(refs) / len(refs) / scale > floor if refs else None)
    return verdict(outcomes, expect, testable if floor is not None else None, untestable), outcomes


def still_decidable(outcomes: Sequence[str], expect: str, testable: Sequence[bool | None] | None = None) -> bool:
    """Whether the first sets' outcomes (and, for a claim about a phenomenon, whether the reference showed it in
    each) can still end in a conclusive verdict, so that the next set is worth running. A set that cannot tell
    (``open``, or too few seeds) makes the check inconclusive whatever the others show."""
    if testable:
        if any(t is None for t in testable) or (any(testable) and not all(testable)):
            return False
        if not any(testable):
            return True  # "not testable" is still possible
    if not outcomes or any(o in ("open", "few") for o in outcomes):
        return False
    if all(o == "for" for o in outcomes) or all(o == "against" for o in outcomes):
        return True
    return expect != "equal" and all(o in ("short", "against") for o in outcomes)


#: the rule used before the seed sets: one paired t-test at 5% on all seeds, no margin (kept to compare stability)
def single_test_verdict(ref: Sequence[float | None], imp: Sequence[float | None], seeds: Sequence[int],
                        expect: str, floor: float | None = None, scale: float = 1.0) -> str:
    """The verdict of one check under the earlier rule: significant in the claimed direction = holds, else not
    reproduced (no significant difference / opposite direction); "matches" = not contradicted unless significant;
    not testable where the reference's mean is at or below ``floor``."""
    both = pairs(ref, imp, seeds)
    if len(both) < 2:
        return FEW_SEEDS
    if floor is not None and not sum(b for _, b in both) / len(both) / scale > floor:
        return "not testable"
    m, lo, hi = paired_ci([a - b for a, b in both])
    significant = lo > 0 or hi < 0
    if expect == "equal":
        return "does not hold (differs)" if significant else "not contradicted"
    if not significant:
        return "not reproduced (no significant difference)"
    return "holds" if (m > 0) == (expect == "higher") else "not reproduced (opposite direction)"


def _draw(rng: random.Random, pool: Sequence[int], k: int) -> list[int]:
    return [pool[int(rng.random() * len(pool))] for _ in range(k)]


def rerun_rates(checks: Sequence[Mapping[str, Any]], seeds: int, sets: int, draws: int = 2000,
                rng_seed: int = 0, single_test: bool = False) -> dict[str, Any]:
    """How often a rerun would change the verdicts, estimated by drawing seeds with replacement from those measured
    and splitting them into ``sets`` sets of ``seeds // sets`` as the job does; the same draw serves every check
    measured on all ``seeds`` (a seed's runs stay together), a check measured on fewer seeds draws from its own.

    ``checks``: dicts with ``ref`` and ``imp`` (per-seed values), ``expect``, ``margin``, ``verdict`` (the published
    one) and optionally ``floor``, ``untestable``, ``scale`` (``check_verdict``). ``single_test``: the earlier rule
    instead (one set of ``seeds // sets`` seeds, ``single_test_verdict``; ``verdict`` must then be that rule's
    verdict). Returns per check the shares of draws that gave the same verdict (``same``), a contradicting one
    (``contradicted``: both conclusive and different; under the earlier rule every change) and any other
    (``changed``); over the table, the share of draws where no verdict was contradicted (``none_contradicted``) and
    the mean number contradicted per draw (``mean_contradicted``), the same for any change. Deterministic for a
    given ``rng_seed``."""
    size = seeds // sets
    k = size * (1 if single_test else sets)
    positions = [list(range(g * size, (g + 1) * size)) for g in range(k // size)]
    rng = random.Random(rng_seed)
    pools = [[i for i in range(seeds) if len(pairs(c["ref"], c["imp"], [i])) == 1] for c in checks]
    per = [{"same": 0, "contradicted": 0, "changed": 0} for _ in checks]
    no_contradiction = no_change = contradicted_total = changed_total = 0
    for _ in range(draws):
        joint = _draw(rng, list(range(seeds)), k)
        n_contra = n_changed = 0
        for c, pool, tally in zip(checks, pools, per):
            drawn = joint if len(pool) == seeds else _draw(rng, pool, k) if pool else []
            ref = [c["ref"][i] for i in drawn]
            imp = [c["imp"][i] for i in drawn]
            if single_test:
                v = single_test_verdict(ref, imp, range(len(drawn)), c["expect"], c.get("floor"), c.get("scale", 1.0))
            else:
                v, _ = check_verdict(ref, imp, positions, c["expect"], c["margin"], c.get("floor"),
                                     c.get("untestable", ""), c.get("scale", 1.0))
            if v == c["verdict"]:
                tally["same"] += 1
                continue
            tally["changed"] += 1
            n_changed += 1
            if contradicts(v, c["verdict"]) or single_test:
                tally["contradicted"] += 1
                n_contra += 1
        no_contradiction += n_contra == 0
        no_change += n_changed == 0
        contradicted_total += n_contra
        changed_total += n_changed
    return {"draws": draws, "seeds": seeds, "sets": 1 if single_test else sets, "set_size": size,
            "rng_seed": rng_seed, "rule": "single test" if single_test else "seed sets",
            "checks": [{key: v / draws for key, v in t.items()} for t in per],
            "none_contradicted": no_contradiction / draws, "mean_contradicted": contradicted_total / draws,
            "none_changed": no_change / draws, "mean_changed": changed_total / draws}
