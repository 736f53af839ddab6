"""Small-sample statistics for the main job: mean, 95% confidence interval (Student t), and a paired comparison
of each configuration against the reference per seed. Pure Python (no scipy): the t distribution's CDF through
the regularised incomplete beta function (continued fraction, Numerical Recipes 6.4), its quantile by bisection.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["betainc", "mean_ci", "paired", "significance_mark", "t_cdf", "t_ppf"]


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b), a, b > 0, 0 <= x <= 1."""
    if a <= 0 or b <= 0:
        raise ValueError(f"betainc needs a, b > 0, got a={a}, b={b}")
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc needs 0 <= x <= 1, got {x}")
    if x in (0.0, 1.0):
        return x
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` > 0 degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_ppf(p: float, df: float) -> float:
    """The p-quantile of Student's t with ``df`` degrees of freedom, 0 < p < 1 (bisection to 1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"quantile level must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_ppf(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return 0.5 * (lo + hi)


def _clean(values: Sequence[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def mean_ci(values: Sequence[float | None], level: float = 0.95) -> dict[str, Any]:
    """Mean, sample standard deviation and the two-sided ``level`` confidence interval of the mean (Student t,
    n - 1 degrees of freedom) of the finite values; ``half`` is the half-width. With one value the interval is
    undefined (NaN); with none everything is NaN and n = 0."""
    xs = _clean(values)
    n = len(xs)
    if n == 0:
        return {"n": 0, "mean": math.nan, "std": math.nan, "half": math.nan, "lo": math.nan, "hi": math.nan}
    m = sum(xs) / n
    if n == 1:
        return {"n": 1, "mean": m, "std": math.nan, "half": math.nan, "lo": math.nan, "hi": math.nan}
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    half = t_ppf(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": m, "std": sd, "half": half, "lo": m - half, "hi": m + half}


def paired(values: Sequence[float | None], reference: Sequence[float | None], level: float = 0.95) -> dict[str, Any]:
    """Paired comparison of ``values`` against ``reference`` seed by seed (same index = same seed): the mean
    difference values - reference, its ``level`` CI (Student t on the n differences), the two-sided p-value of the
    paired t-test, and ``significant`` (the CI excludes 0). Pairs where either side is missing are dropped.
    Identical differences on every seed (zero spread) count as significant when they are not zero."""
    if len(values) != len(reference):
        raise ValueError(f"paired comparison needs one value per seed on both sides, got {len(values)} and "
                         f"{len(reference)}")
    diffs = [float(a) - float(b) for a, b in zip(values, reference)
             if a is not None and b is not None and math.isfinite(float(a)) and math.isfinite(float(b))]
    s = mean_ci(diffs, level)
    n = s["n"]
    if n < 2:
        p = math.nan
    elif s["std"] == 0:
        p = 1.0 if s["mean"] == 0 else 0.0
    else:
        t = s["mean"] / (s["std"] / math.sqrt(n))
        p = 2.0 * (1.0 - t_cdf(abs(t), n - 1))
    significant = bool(n >= 2 and p < 1.0 - level)
    return {"n": n, "diff": s["mean"], "lo": s["lo"], "hi": s["hi"], "half": s["half"], "p": p,
            "significant": significant, "wins": sum(d > 0 for d in diffs), "losses": sum(d < 0 for d in diffs)}


def significance_mark(comparison: dict[str, Any]) -> str:
    """``+*`` / ``-*`` when the paired difference is significant (its sign), else ``""``."""
    if not comparison.get("significant"):
        return ""
    return "+*" if comparison["diff"] > 0 else "-*"
