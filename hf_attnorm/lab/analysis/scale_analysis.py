"""Scale analysis: the two length-scaling arguments behind hf_attnorm's length-aware scales, checked numerically and
against the scores of a real model (``scripts/scale_analysis.py`` is the command line around this module).

1. Irrelevant-key mass (``irrelevant_mass``, ``mass_table``): with m keys scored +1 and l - m scored -1, a fixed
   scale k leaves (l - m) e^{-k} / (m e^{k} + (l - m) e^{-k}) of the softmax mass on the -1s, which grows with l;
   k(l) = 0.5 ln((1 - eps)(l - m) / (eps m)) (``hf_attnorm.scales.sparse_target_k``) holds it at eps.
2. Gradient-maximising scale (``analytic_alpha``): alpha*(n) maximises alpha (1 - sum p^2), p = softmax(alpha s),
   solved exactly from the approximation sum p^2 ~ M(2 alpha) / (n M(alpha)^2) for normal and cosine scores
   (``hf_attnorm.scales.max_gradient_alpha``) and fitted with c sqrt(ln n) / c_d ln n (``fit_constant``).
3. ``mc_check``: that approximation against sum p^2 simulated directly. It converges as n grows at a FIXED alpha
   but not at alpha*(n) itself, where it overestimates sum p^2 by 50% (n = 10) to 240% (n = 30000).
   ``mc_optimal_alpha``: the optimum of the EXACT objective alpha (1 - mean_rows sum p^2) over sampled rows; for
   i.i.d. normal rows it has no interior maximum (it keeps growing with alpha), see ``objective_profiles``.
4. Empirical optimum (``collect_score_rows`` + ``empirical_alpha``): the pre-scale scores s = q.k * scaling of a
   model (q after RoPE, captured in the attention function) per layer and head, and alpha*(n) of each head with
   two estimators: ``mgf`` — the analytic criterion with the head's own score distribution plugged in
   (``mgf_optimal_alpha``), and ``mc`` — the exact objective over rows of length n sampled from real query rows.
   ``EmpiricalAlpha.table`` turns the result into the option of the ``empirical_max_gradient`` scale.

Shapes are written [G, R, n]: G independent groups (heads), R sampled rows, n keys per row.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ...scales import max_gradient_alpha, max_gradient_objective, sparse_target_k, sum_p2_model
from .capture import capture_attention

# ------------------------------------------------------------------------------------------ 1. irrelevant-key mass


def irrelevant_mass(l, m, scale) -> np.ndarray:  # noqa: E741 (l is the paper's name for the length)
    """Softmax mass on the l - m keys scored -1 when m keys score +1, scores multiplied by ``scale``.

    Closed form 1 / (1 + m/(l - m) e^{2 scale}); l, m, scale broadcast (m may be fractional, e.g. sqrt l).
    NaN where m >= l or m <= 0 (no irrelevant or no relevant key).
    """
    l_, m_, k_ = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (l, m, scale)))
    ok = (m_ > 0) & (m_ < l_)
    with np.errstate(divide="ignore", invalid="ignore"):
        x = 2.0 * k_ + np.log(m_) - np.log(l_ - m_)
        mass = np.exp(-np.logaddexp(0.0, x))
    return np.where(ok, mass, np.nan)


def softmax_row(l: int, m: int, scale: float) -> torch.Tensor:  # noqa: E741
    """softmax(scale * s) of the explicit row s = [-1]*(l - m) + [+1]*m (first the irrelevant keys): [l] float64."""
    s = torch.cat([-torch.ones(l - m, dtype=torch.float64), torch.ones(m, dtype=torch.float64)])
    return torch.softmax(scale * s, dim=0)


def worked_examples() -> dict[str, Any]:
    """The worked numbers, computed with an explicit softmax: softmax([-1, 1, -1]) and x2; 200 keys, ten +1s."""
    row3 = [-1.0, 1.0, -1.0]
    s3 = torch.tensor(row3, dtype=torch.float64)
    return {
        "l3_scale1": torch.softmax(s3, 0).tolist(),
        "l3_scale2": torch.softmax(2 * s3, 0).tolist(),
        "l200_m10_scale1_mass": float(softmax_row(200, 10, 1.0)[:190].sum()),
        "l200_m10_scale2_mass": float(softmax_row(200, 10, 2.0)[:190].sum()),
    }


def m_of(l, rule: str, m_const: float) -> np.ndarray:  # noqa: E741
    """m(l) for rule ``const`` (m_const) or ``sqrt`` (sqrt l)."""
    l_ = np.asarray(l, dtype=np.float64)
    if rule == "const":
        return np.full_like(l_, float(m_const))
    if rule == "sqrt":
        return np.sqrt(l_)
    raise ValueError(f"m rule must be 'const' or 'sqrt', got {rule!r}")


def sparse_k(l, m, eps: float) -> np.ndarray:  # noqa: E741
    """k(l) = 0.5 ln((1 - eps)(l - m)/(eps m)) elementwise (``sparse_target_k``); NaN where m >= l."""
    l_, m_ = np.broadcast_arrays(np.asarray(l, dtype=np.float64), np.asarray(m, dtype=np.float64))
    out = np.full(l_.shape, np.nan)
    for i in np.ndindex(l_.shape):
        if 0 < m_[i] < l_[i]:
            out[i] = sparse_target_k(float(l_[i]), float(m_[i]), eps)
    return out


def mass_table(lengths: Sequence[float], m_const: float = 10.0, eps: float = 0.1) -> list[dict[str, float]]:
    """One row per length l: for m = m_const and m = sqrt l, the mass on the -1 keys at scale 1, scale 2 and k(l)
    (k(l) and its mass too). NaN where l <= m."""
    rows = []
    for l in lengths:  # noqa: E741
        row: dict[str, float] = {"l": float(l)}
        for rule in ("const", "sqrt"):
            m = float(m_of(l, rule, m_const))
            k = float(sparse_k(l, m, eps))
            row[f"m_{rule}"] = m
            row[f"mass_scale1_{rule}"] = float(irrelevant_mass(l, m, 1.0))
            row[f"mass_scale2_{rule}"] = float(irrelevant_mass(l, m, 2.0))
            row[f"k_{rule}"] = k
            row[f"mass_k_{rule}"] = float(irrelevant_mass(l, m, k))
        rows.append(row)
    return rows


# -------------------------------------------------------------------------------- 2. analytic alpha*(n) and its fit

#: fitted form per score model: normal -> c sqrt(ln n), cosine -> c_d ln n
FORMS = {"sqrt_log": lambda n: np.sqrt(np.log(n)), "log": np.log}


@dataclasses.dataclass
class CurveFit:
    """alpha*(n) ~ constant * f(n) fitted by least squares over ``weighting`` points of [n_min, n_max].

    weighting: ``integer`` (every integer n, i.e. uniform in n) or ``log`` (log-spaced n, every decade equal);
    max_rel_error / rms_rel_error: of the fitted curve against the exact alpha*(n) over the same points."""

    name: str
    form: str
    constant: float
    max_rel_error: float
    rms_rel_error: float
    n_min: float
    n_max: float
    weighting: str


def fit_constant(n: np.ndarray, alpha: np.ndarray, form: str, name: str = "", weighting: str = "") -> CurveFit:
    """Least-squares c minimising sum (alpha - c f(n))^2 with f = ``FORMS[form]``."""
    f = FORMS[form](np.asarray(n, dtype=np.float64))
    a = np.asarray(alpha, dtype=np.float64)
    c = float((a * f).sum() / (f * f).sum())
    rel = c * f / a - 1.0
    return CurveFit(name, form, c, float(np.abs(rel).max()), float(np.sqrt((rel**2).mean())), float(n.min()),
                    float(n.max()), weighting)


def log_subset(n: np.ndarray, points: int = 200) -> np.ndarray:
    """Indices of ~``points`` log-spaced entries of the sorted integer grid ``n``."""
    target = np.logspace(np.log10(n[0]), np.log10(n[-1]), points)
    return np.unique(np.clip(np.searchsorted(n, target), 0, len(n) - 1))


@dataclasses.dataclass
class AnalyticAlpha:
    """Exact alpha*(n) on every integer n in [n_min, n_max] for each score model, with fits.

    curves: name -> alpha [N] (names ``normal``, ``cosine_d64`` ...); fits: name -> {weighting: CurveFit}."""

    n: np.ndarray
    curves: dict[str, np.ndarray]
    fits: dict[str, dict[str, CurveFit]]

    def fit(self, name: str, weighting: str = "integer") -> CurveFit:
        return self.fits[name][weighting]


def analytic_alpha(n_min: int = 40, n_max: int = 20000, dims: Sequence[int] = (64, 128, 256)) -> AnalyticAlpha:
    """Solve alpha*(n) for n = n_min..n_max (every integer) for the normal model and the cosine model in each d,
    and fit c sqrt(ln n) (normal) / c_d ln n (cosine) with both weightings."""
    if not 1 < n_min < n_max:
        raise ValueError(f"need 1 < n_min < n_max, got n_min={n_min}, n_max={n_max}")
    n = np.arange(int(n_min), int(n_max) + 1, dtype=np.float64)
    curves = {"normal": max_gradient_alpha(n, "normal", cache=False)}
    for d in dims:
        curves[f"cosine_d{d}"] = max_gradient_alpha(n, "cosine", head_dim=int(d), cache=False)
    sub = log_subset(n)
    fits: dict[str, dict[str, CurveFit]] = {}
    for name, a in curves.items():
        form = "sqrt_log" if name == "normal" else "log"
        fits[name] = {"integer": fit_constant(n, a, form, name, "integer"),
                      "log": fit_constant(n[sub], a[sub], form, name, "log")}
    return AnalyticAlpha(n, curves, fits)


# ------------------------------------------------------------------------------- 3. Monte-Carlo sum p^2 and alpha*


def sample_model_scores(dist: str, size: Sequence[int], head_dim: int | None = None,
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """i.i.d. scores of a score model, float64 of shape ``size``: ``normal`` N(0, 1), or ``cosine``: the cosine of
    two independent uniform directions in head_dim dimensions, s = 2 B - 1 with B ~ Beta((d-1)/2, (d-1)/2)."""
    if dist == "normal":
        return torch.randn(*size, generator=generator, dtype=torch.float64)
    if dist == "cosine":
        if head_dim is None or head_dim < 2:
            raise ValueError(f"cosine scores need head_dim >= 2, got {head_dim!r}")
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        rng = np.random.default_rng(seed)
        return torch.from_numpy(2.0 * rng.beta((head_dim - 1) / 2, (head_dim - 1) / 2, size=tuple(size)) - 1.0)
    raise ValueError(f"dist must be 'normal' or 'cosine', got {dist!r}")


def rows_for(n: int, budget: int, min_rows: int) -> int:
    """Rows R of length n so that R * n is about ``budget`` scores, at least ``min_rows``."""
    return max(int(min_rows), math.ceil(budget / n))


def sum_p2_rows(scores: torch.Tensor, alpha: float | torch.Tensor) -> torch.Tensor:
    """sum_i p_i^2 per row, p = softmax(alpha * s). scores [..., n] -> [...]; alpha scalar or broadcastable to
    scores[..., :1]."""
    p = torch.softmax(scores * alpha, dim=-1)
    return (p * p).sum(-1)


@dataclasses.dataclass
class McRow:
    """One point of the Monte-Carlo check: direct mean sum p^2 over ``rows`` rows (with its standard error) vs the
    approximation R(alpha)/n; rel_error = approx / direct - 1."""

    dist: str
    head_dim: int | None
    n: int
    alpha_label: str
    alpha: float
    rows: int
    direct: float
    stderr: float
    approx: float
    rel_error: float
    rel_stderr: float


def mc_check(ns: Sequence[int], dist: str = "normal", head_dim: int | None = None,
             alphas: Sequence[float | str] = ("star", 1.0), budget: int = 1 << 22, min_rows: int = 256,
             seed: int = 0) -> list[McRow]:
    """Compare sum p^2 ~ E[e^{2 alpha s}] / (n E[e^{alpha s}]^2) with the directly simulated mean sum p^2.

    alphas: fixed scales in the model's own units (for cosine, multiply a normal-scale alpha by sqrt(d) to compare
    like with like), or ``"star"`` for alpha*(n) itself. Scores are fresh i.i.d. draws per (n, alpha)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in ns:
        for a in alphas:
            alpha = max_gradient_alpha(float(n), dist, head_dim, cache=False) if a == "star" else float(a)
            r = rows_for(int(n), budget, min_rows)
            s = sample_model_scores(dist, (r, int(n)), head_dim, gen)
            g = sum_p2_rows(s, alpha)
            direct, se = float(g.mean()), float(g.std() / math.sqrt(r))
            approx = float(sum_p2_model(alpha, float(n), dist, head_dim)[0])
            out.append(McRow(dist, head_dim, int(n), str(a), alpha, r, direct, se, approx, approx / direct - 1.0,
                             se / direct))
    return out


def _rows_sum_p2(scores: torch.Tensor, alpha: torch.Tensor, chunk: int = 1 << 22) -> torch.Tensor:
    """sum p^2 of every row, p = softmax(alpha s): scores [G, R, n], alpha [G] -> [G, R] float64, in chunks of
    ~``chunk`` scores so memory stays bounded for long rows."""
    g_, r_, n_ = scores.shape
    step = max(1, chunk // max(1, g_ * n_))
    a = alpha.to(scores.dtype).view(-1, 1, 1)
    return torch.cat([sum_p2_rows(scores[:, i:i + step], a).double() for i in range(0, r_, step)], dim=1)


def mc_objective(scores: torch.Tensor, alpha: torch.Tensor | float) -> torch.Tensor:
    """alpha (1 - mean_rows sum p^2), p = softmax(alpha s), per group: the exact Monte-Carlo objective.

    scores: [G, R, n]; alpha: [G] or scalar. Returns [G] float64."""
    a = torch.as_tensor(alpha, dtype=torch.float64).expand(scores.shape[0]).clone()
    return a * (1.0 - _rows_sum_p2(scores, a).mean(-1))


def golden_max(fn: Callable[[torch.Tensor], torch.Tensor], lo: torch.Tensor, hi: torch.Tensor,
               iters: int = 30) -> torch.Tensor:
    """Golden-section search for the maximum of ``fn`` ([G] -> [G]) on [lo, hi] per group, in log alpha
    (lo > 0). Returns [G]."""
    inv = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = torch.log(lo), torch.log(hi)
    c, d = b - inv * (b - a), a + inv * (b - a)
    fc, fd = fn(torch.exp(c)), fn(torch.exp(d))
    for _ in range(iters):
        left = fc >= fd  # the maximum lies in [a, d]
        a, b = torch.where(left, a, c), torch.where(left, d, b)
        c_new = torch.where(left, b - inv * (b - a), d)
        d_new = torch.where(left, c, a + inv * (b - a))
        f_new = fn(torch.exp(torch.where(left, c_new, d_new)))
        fc, fd = torch.where(left, f_new, fd), torch.where(left, fc, f_new)
        c, d = c_new, d_new
    return torch.exp(0.5 * (a + b))


def grid_max(fn: Callable[[torch.Tensor], torch.Tensor], lo: torch.Tensor, hi: torch.Tensor, points: int = 36,
             iters: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """Global maximum of ``fn`` ([G] -> [G]) over a log-spaced grid of ``points`` alphas in [lo, hi] per group,
    refined by golden-section search between the best point's neighbours. Returns (alpha [G], at_top [G] bool:
    the best grid point is the top of the range, i.e. the objective still grows there)."""
    t = torch.linspace(0.0, 1.0, points, dtype=torch.float64)
    grid = torch.exp(torch.log(lo)[:, None] + t[None, :] * (torch.log(hi) - torch.log(lo))[:, None])  # [G, P]
    values = torch.stack([fn(grid[:, k]) for k in range(points)], dim=1)  # [G, P]
    j = values.argmax(dim=1)
    rows = torch.arange(grid.shape[0])
    left = grid[rows, (j - 1).clamp_min(0)]
    right = grid[rows, (j + 1).clamp_max(points - 1)]
    return golden_max(fn, left, right, iters), j == points - 1


def _row_std(scores: torch.Tensor) -> torch.Tensor:
    """std of the row-centred scores per group: [G, R, n] -> [G] float64 (1 where it is 0)."""
    centred = scores.double() - scores.double().mean(-1, keepdim=True)
    std = centred.pow(2).mean(dim=(1, 2)).sqrt()
    return torch.where(std > 0, std, torch.ones_like(std))


def mc_optimal_alpha(scores: torch.Tensor, span: tuple[float, float] = (0.05, 100.0), points: int = 36,
                     iters: int = 24, margin: float = 0.01, z: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha maximising the exact objective alpha (1 - mean_rows sum p^2) over the given rows (the same rows for
    every alpha), per group, searched over alpha * std in ``span`` (std of the row-centred scores).

    This objective need not have an interior maximum: as alpha -> inf it tends to 2 x (density at 0 of the gap
    between the two largest scores of a row) > 0; for n = 2 i.i.d. N(0, 1) scores it is 2 alpha E[sigma(alpha D)
    sigma(-alpha D)], increasing all the way to 1/sqrt(pi). So a maximum counts only when it beats the objective
    at the top of the span by more than ``z`` standard errors (of the paired per-row difference) and by more than
    ``margin`` relative; otherwise alpha is NaN.

    scores: [G, R, n] (or [R, n]). Returns (alpha [G], peak_ratio [G] = objective at the maximum / objective at
    the top of the span), float64 (0-d each for [R, n] input).
    """
    squeeze = scores.dim() == 2
    if squeeze:
        scores = scores.unsqueeze(0)
    if scores.dim() != 3 or scores.shape[-1] < 2:
        raise ValueError(f"scores must be [G, R, n] with n >= 2, got {list(scores.shape)}")
    std = _row_std(scores)
    top = span[1] / std
    alpha, _ = grid_max(lambda a: mc_objective(scores, a), span[0] / std, top, points, iters)
    at_max = alpha[:, None] * (1.0 - _rows_sum_p2(scores, alpha))  # [G, R] per-row objective
    at_top = top[:, None] * (1.0 - _rows_sum_p2(scores, top))
    diff = at_max - at_top
    se = diff.std(-1) / math.sqrt(diff.shape[-1])
    ratio = at_max.mean(-1) / at_top.mean(-1)
    interior = (diff.mean(-1) > z * se) & (ratio >= 1.0 + margin)
    alpha = torch.where(interior, alpha, torch.full_like(alpha, float("nan")))
    return (alpha[0], ratio[0]) if squeeze else (alpha, ratio)


def _log_mgf(xt: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """log E[e^{alpha s}] of the empirical distribution of each row of xt [G, P]; alpha [G] -> [G] float64."""
    z = xt * alpha.to(xt.dtype)[:, None]
    top = z.amax(dim=1, keepdim=True)  # by hand: torch.logsumexp was ~10x slower here (torch 2.13 CPU)
    return (z - top).exp_().sum(1).log_() + top.squeeze(1) - math.log(xt.shape[1])


def mgf_objective(x: torch.Tensor, alpha: torch.Tensor, n: float) -> torch.Tensor:
    """The analytic models' objective alpha (1 - M(2 alpha) / (n M(alpha)^2)) with M the empirical moment
    generating function of each column of x [P, G] (float64). alpha [G] -> [G]."""
    return _mgf_objective_t(x.double().t().contiguous(), alpha, n)


def _mgf_objective_t(xt: torch.Tensor, alpha: torch.Tensor, n: float) -> torch.Tensor:
    """``mgf_objective`` on the transposed scores xt [G, P] (a contiguous reduction axis is much faster)."""
    log_r = _log_mgf(xt, 2 * alpha) - 2 * _log_mgf(xt, alpha)
    return alpha * (1.0 - torch.exp(log_r) / n)


def mgf_optimal_alpha(x: torch.Tensor, n: float | Sequence[float], span: tuple[float, float] = (0.05, 20.0),
                      per_octave: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha*(n) of the analytic criterion (the one ``max_gradient`` solves for normal/cosine scores) with the
    empirical distribution of each column of x [P, G] plugged in, searched over alpha * std in ``span``.

    R(alpha) = M(2 alpha)/M(alpha)^2 does not depend on n, so log M is computed once on a geometric grid of
    ``per_octave`` points per doubling (then M(2 alpha) is on the grid too); the maximum of alpha (1 - R/n) on the
    grid is refined by a parabola through its neighbours in log alpha (scale-equivariant: scores x c give
    alpha / c exactly). Returns (alpha, ess), each [G] for a scalar n or [G, len(n)]: ess = effective sample
    size 1/sum w^2 of the 2 alpha-tilted weights w ~ e^{2 alpha s} at the optimum — how many scores M(2 alpha)
    rests on (small = decided by a few extreme scores). Needs n < P (else unbounded); NaN where the maximum is at
    the top of the span."""
    scalar = np.ndim(n) == 0
    ns = np.atleast_1d(np.asarray(n, dtype=np.float64))
    if ns.max() >= x.shape[0]:
        raise ValueError(f"the plug-in estimate needs more pooled scores than n: {x.shape[0]} scores, n={ns.max():g}")
    if (ns < 2).any():
        raise ValueError(f"n must be >= 2, got {ns.tolist()}")
    xt = x.float().t().contiguous()  # [G, P]; float32 halves the cost, the sums are still accurate to ~1e-6
    std = xt.double().std(1)
    std = torch.where(std > 0, std, torch.ones_like(std))
    steps = int(math.ceil(math.log2(span[1] / span[0]) * per_octave))
    t = torch.arange(steps + 1 + per_octave, dtype=torch.float64)
    alphas = (span[0] / std)[:, None] * torch.pow(2.0, t / per_octave)[None, :]  # [G, S + 1 + per_octave]
    log_m = torch.stack([_log_mgf(xt, alphas[:, i]).double() for i in range(alphas.shape[1])], dim=1)
    grid = alphas[:, : steps + 1]
    log_r = log_m[:, per_octave:] - 2 * log_m[:, : steps + 1]  # log M(2 a) - 2 log M(a), [G, S + 1]
    out_a = torch.full((xt.shape[0], len(ns)), float("nan"), dtype=torch.float64)
    out_e = torch.full_like(out_a, float("nan"))
    rows = torch.arange(xt.shape[0])
    for j, nj in enumerate(ns):
        obj = grid * (1.0 - torch.exp(log_r) / nj)
        k = obj.argmax(dim=1)
        inside = (k > 0) & (k < steps)
        kc = k.clamp(1, steps - 1)
        f0, f1, f2 = obj[rows, kc - 1], obj[rows, kc], obj[rows, kc + 1]
        denom = f0 - 2 * f1 + f2
        shift = torch.where(denom < 0, 0.5 * (f0 - f2) / torch.where(denom < 0, denom, -1.0), 0.0).clamp(-1, 1)
        a = grid[rows, kc] * torch.pow(2.0, shift / per_octave)
        w = torch.softmax(xt.double() * (2 * a)[:, None], dim=1)
        out_a[:, j] = torch.where(inside, a, torch.full_like(a, float("nan")))
        out_e[:, j] = 1.0 / (w * w).sum(1)
    return (out_a[:, 0], out_e[:, 0]) if scalar else (out_a, out_e)


def objective_profiles(ns: Sequence[int], alphas: Sequence[float], budget: int = 1 << 21, min_rows: int = 256,
                       seed: int = 0) -> dict[int, dict[str, list[float]]]:
    """For i.i.d. N(0, 1) rows: the exact objective alpha (1 - mean sum p^2) and the approximate one
    alpha (1 - e^{alpha^2} / n) at each alpha, per n: {n: {"exact": [...], "approx": [...]}}."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for n in ns:
        s = sample_model_scores("normal", (1, rows_for(int(n), budget, min_rows), int(n)), None, gen).float()
        exact = [float(mc_objective(s, a)[0]) for a in alphas]
        with np.errstate(over="ignore"):  # e^{alpha^2} overflows for large alpha: the approximation is -inf there
            approx = max_gradient_objective(np.asarray(alphas), float(n))
        out[int(n)] = {"exact": exact, "approx": approx.tolist()}
    return out


def model_mc_alpha(ns: Sequence[int], dist: str = "normal", head_dim: int | None = None, budget: int = 1 << 20,
                   min_rows: int = 64, seed: int = 0) -> np.ndarray:
    """alpha* of the exact Monte-Carlo objective for i.i.d. model scores, one value per n (float64 [len(ns)];
    NaN where the objective still grows at the top of the search span)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in ns:
        s = sample_model_scores(dist, (1, rows_for(int(n), budget, min_rows), int(n)), head_dim, gen)
        out.append(float(mc_optimal_alpha(s.float())[0][0]))
    return np.array(out)


# ------------------------------------------------------------------------------- 4. empirical scores of a model


@dataclasses.dataclass
class ScoreRows:
    """Pre-scale score rows of one attention layer for a subset of queries.

    scores: float32 [N, H, Lk] (s = q.k * scaling, q after RoPE, per query head); valid: bool [N, Lk] (the keys
    each query sees); position: long [N] (query position); scaling: the model's base scaling of this layer."""

    layer: int
    scores: torch.Tensor
    valid: torch.Tensor
    position: torch.Tensor
    head_dim: int
    scaling: float

    @property
    def heads(self) -> int:
        return self.scores.shape[1]

    def counts(self) -> torch.Tensor:
        """Visible keys per stored row: long [N]."""
        return self.valid.sum(-1)


def _query_positions(counts: torch.Tensor, per_seq: int) -> torch.Tensor:
    """Evenly spaced query indices (always including the last) among queries with >= 2 visible keys; [<= per_seq]."""
    usable = (counts >= 2).nonzero().squeeze(-1)
    if usable.numel() == 0:
        return usable
    pick = torch.linspace(0, usable.numel() - 1, min(per_seq, usable.numel())).round().long().unique()
    return usable[pick]


@torch.no_grad()
def collect_score_rows(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       queries_per_seq: int = 32, batch_size: int = 4) -> list[ScoreRows]:
    """Run ``model`` on ``input_ids`` [B, L] and keep, for every attention layer, the full pre-scale score rows
    of ``queries_per_seq`` evenly spaced queries per sequence (the last one included). Returns one ScoreRows per
    layer, in layer order. The model's outputs are not changed by the capture."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, L], got {list(input_ids.shape)}")
    store: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    facts: dict[int, tuple[int, float]] = {}

    def callback(module, layer, q, k, keep, scaling):
        b, h, lq, d = q.shape
        groups = h // k.shape[1]
        keep = keep.expand(b, -1, lq, k.shape[2])
        if keep.shape[1] != 1 and not bool((keep == keep[:, :1]).all()):
            raise ValueError("collect_score_rows needs the same key visibility for every head")
        keep = keep[:, 0]  # [B, Lq, Lk]
        k_rep = k.repeat_interleave(groups, dim=1) if groups > 1 else k
        for bi in range(b):
            sel = _query_positions(keep[bi].sum(-1), queries_per_seq)
            if sel.numel() == 0:
                continue
            s = torch.einsum("hqd,hkd->qhk", q[bi][:, sel].float(), k_rep[bi].float()) * scaling
            store.setdefault(layer, []).append((s, keep[bi, sel], sel))
        facts[layer] = (d, scaling)

    was_training = model.training
    model.eval()
    try:
        with capture_attention(model, callback) as layers:
            for i in range(0, input_ids.shape[0], batch_size):
                mask = None if attention_mask is None else attention_mask[i:i + batch_size]
                kwargs = {"attention_mask": mask} if mask is not None else {}
                model(input_ids=input_ids[i:i + batch_size], use_cache=False, **kwargs)
    finally:
        model.train(was_training)
    missing = sorted(set(layers.values()) - set(store))
    if missing:
        raise RuntimeError(f"attention layers {missing} never reached the attention interface (or saw no query with "
                           "two visible keys); cannot collect their scores")
    out = []
    for layer in sorted(store):
        parts = store[layer]
        lk = max(p[0].shape[-1] for p in parts)
        if any(p[0].shape[-1] != lk for p in parts):
            raise ValueError("collect_score_rows needs every batch to have the same key length")
        out.append(ScoreRows(layer, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                             torch.cat([p[2] for p in parts]), *facts[layer]))
    return out


def centred_pool(rows: ScoreRows) -> torch.Tensor:
    """Every visible score, minus the mean of its row (softmax ignores a per-row shift, so between-query offsets
    are not spread): [P, H] float32."""
    v = rows.valid.unsqueeze(1)  # [N, 1, Lk]
    mean = torch.where(v, rows.scores, 0.0).sum(-1, keepdim=True) / v.sum(-1, keepdim=True).clamp_min(1)
    centred = rows.scores - mean  # [N, H, Lk]
    return centred.permute(0, 2, 1)[rows.valid]  # [P, H]


def sample_rows(rows: ScoreRows, n: int, count: int, mode: str, generator: torch.Generator,
                pool: torch.Tensor | None = None) -> tuple[torch.Tensor | None, int]:
    """``count`` score rows of length n for every head: [H, count, n] float32, and the number of distinct source
    rows they come from.

    mode ``rows``: each row is n keys drawn without replacement from the visible keys of one stored query with at
    least n visible keys (the query drawn uniformly with replacement), so within-row structure is kept; None if no
    stored query sees n keys. mode ``iid``: n scores drawn independently from the head's row-centred pool (the
    i.i.d. assumption of the analytic models; any n)."""
    if mode == "iid":
        pool = centred_pool(rows) if pool is None else pool
        idx = torch.randint(pool.shape[0], (count, n), generator=generator)
        return pool[idx].permute(2, 0, 1).contiguous(), pool.shape[0]
    if mode != "rows":
        raise ValueError(f"mode must be 'rows' or 'iid', got {mode!r}")
    cand = (rows.counts() >= n).nonzero().squeeze(-1)
    if cand.numel() == 0:
        return None, 0
    out = torch.empty(rows.heads, count, n, dtype=torch.float32)
    step = max(1, (1 << 22) // rows.scores.shape[-1])
    for i in range(0, count, step):
        m = min(step, count - i)
        pick = cand[torch.randint(cand.numel(), (m,), generator=generator)]
        r = torch.rand(m, rows.scores.shape[-1], generator=generator)
        r = torch.where(rows.valid[pick], r, -1.0)
        keys = r.topk(n, dim=-1).indices  # [m, n] visible keys, without replacement
        out[:, i:i + m] = rows.scores[pick[:, None], :, keys].permute(2, 0, 1)  # [m, n, H] -> [H, m, n]
    return out, int(cand.numel())


@dataclasses.dataclass
class EmpiricalAlpha:
    """alpha*(n) per layer and head of a model's score distribution.

    estimator: ``mgf`` (the analytic criterion with the head's pooled row-centred scores as the distribution) or
    ``mc`` (the exact Monte-Carlo objective over rows sampled in ``mode`` rows/iid). alpha: float64
    [layers, heads, len(ns)], NaN where not measurable (no stored query sees n keys in rows mode, or no interior
    maximum in the search span); score_std: [layers, heads] std of the row-centred scores; sources: [layers,
    len(ns)] distinct source rows (rows mode) or pooled scores; ess: [layers, heads, len(ns)] effective sample size
    of the 2 alpha-tilted scores (mgf only); peak_ratio: [layers, heads, len(ns)] objective at the maximum / at
    the top of the search span (mc only; alpha is NaN below 1 + margin)."""

    ns: list[int]
    estimator: str
    mode: str
    alpha: np.ndarray
    score_std: np.ndarray
    sources: np.ndarray
    head_dim: int
    rows_per_n: list[int] | None = None
    ess: np.ndarray | None = None
    peak_ratio: np.ndarray | None = None

    @property
    def layers(self) -> int:
        return self.alpha.shape[0]

    @property
    def heads(self) -> int:
        return self.alpha.shape[1]

    @property
    def label(self) -> str:
        return "mgf" if self.estimator == "mgf" else f"mc-{self.mode}"

    def measured(self) -> np.ndarray:
        """bool [len(ns)]: n where every head has a finite alpha*."""
        return np.isfinite(self.alpha).all(axis=(0, 1))

    def table(self, per: str = "layer", source: str | None = None, digits: int = 5) -> dict[str, Any]:
        """The ``empirical_alpha_table`` option of the ``empirical_max_gradient`` scale: a ``global`` curve (median
        over every head), one curve per ``layer`` (median over its heads) or per ``head``; only the n measured for
        every head; values rounded to ``digits`` significant digits."""
        ok = self.measured()
        if not ok.any():
            raise ValueError(f"no n of {self.ns} has a finite alpha* for every head ({self.label}); lower the n "
                             "values, collect longer sequences or use the mgf estimator")
        a = self.alpha[:, :, ok]

        def r(x: np.ndarray) -> list:
            return np.vectorize(lambda v: float(f"{v:.{digits}g}"), otypes=[float])(x).tolist()

        if per == "global":
            alpha: list = r(np.median(a.reshape(-1, a.shape[-1]), axis=0))
        elif per == "layer":
            alpha = r(np.median(a, axis=1))
        elif per == "head":
            alpha = r(a)
        else:
            raise ValueError(f"per must be 'global', 'layer' or 'head', got {per!r}")
        table: dict[str, Any] = {"n": [int(n) for n, k in zip(self.ns, ok) if k], "alpha": alpha}
        if source:
            table["source"] = source
        return table

    def summary(self) -> list[dict[str, float]]:
        """Per n: how many heads were measured, quartiles of alpha* over heads, the median standardised
        std x alpha*, and (mgf) the median effective sample size."""
        out = []
        for j, n in enumerate(self.ns):
            a = self.alpha[:, :, j].ravel()
            z = (self.alpha[:, :, j] * self.score_std).ravel()
            fin = np.isfinite(a)
            row: dict[str, float] = {"n": n, "heads": int(fin.sum()), "of": int(a.size),
                                     "sources_min": int(self.sources[:, j].min())}
            if fin.any():
                q = np.percentile(a[fin], [0, 25, 50, 75, 100])
                row.update(min=q[0], q25=q[1], median=q[2], q75=q[3], max=q[4],
                           std_x_alpha_median=float(np.median(z[fin])))
            if self.ess is not None:
                row["ess_median"] = float(np.nanmedian(self.ess[:, :, j]))
            if self.peak_ratio is not None:
                row["peak_ratio_median"] = float(np.nanmedian(self.peak_ratio[:, :, j]))
            out.append(row)
        return out

    def to_dict(self) -> dict[str, Any]:
        def clean(x: np.ndarray | None):
            return None if x is None else np.where(np.isfinite(x), x, None).tolist()

        return {"ns": self.ns, "estimator": self.estimator, "mode": self.mode, "head_dim": self.head_dim,
                "rows_per_n": self.rows_per_n, "alpha": clean(self.alpha), "score_std": self.score_std.tolist(),
                "sources": self.sources.tolist(), "ess": clean(self.ess), "peak_ratio": clean(self.peak_ratio),
                "summary": self.summary()}


def empirical_alpha(score_rows: Sequence[ScoreRows], ns: Sequence[int], estimator: str = "mgf", mode: str = "rows",
                    budget: int = 1 << 18, min_rows: int = 64, seed: int = 0) -> EmpiricalAlpha:
    """alpha*(n) of every layer and head.

    estimator ``mgf``: ``mgf_optimal_alpha`` on the head's pooled row-centred scores (directly comparable with the
    analytic normal/cosine curves: same criterion, empirical distribution). ``mc``: ``mc_optimal_alpha`` over
    ``rows_for(n, budget, min_rows)`` rows of length n sampled with ``sample_rows(mode)`` (rows: real query rows,
    n up to the stored row length; iid: pooled scores)."""
    if not score_rows:
        raise ValueError("no score rows: collect_score_rows returned nothing")
    if any(int(n) < 2 for n in ns):
        raise ValueError(f"every n must be >= 2, got {list(ns)}")
    if estimator not in ("mgf", "mc"):
        raise ValueError(f"estimator must be 'mgf' or 'mc', got {estimator!r}")
    gen = torch.Generator().manual_seed(seed)
    layers, heads = len(score_rows), score_rows[0].heads
    alpha = np.full((layers, heads, len(ns)), np.nan)
    ess = np.full((layers, heads, len(ns)), np.nan) if estimator == "mgf" else None
    peak = np.full((layers, heads, len(ns)), np.nan) if estimator == "mc" else None
    sources = np.zeros((layers, len(ns)), dtype=np.int64)
    std = np.zeros((layers, heads))
    rows_per_n = [rows_for(int(n), budget, min_rows) for n in ns] if estimator == "mc" else None
    for li, rows in enumerate(score_rows):
        pool = centred_pool(rows)
        std[li] = pool.double().std(0).numpy()
        if estimator == "mgf":
            sources[li] = pool.shape[0]
            fit = [j for j, n in enumerate(ns) if int(n) < pool.shape[0]]  # n >= pooled scores: not measurable
            if fit:
                a, e = mgf_optimal_alpha(pool, [float(ns[j]) for j in fit])
                alpha[li][:, fit], ess[li][:, fit] = a.numpy(), e.numpy()
        for j, n in enumerate(ns):
            if estimator == "mgf":
                continue
            s, src = sample_rows(rows, int(n), rows_per_n[j], mode, gen, pool)
            sources[li, j] = src
            if s is not None:
                a, ratio = mc_optimal_alpha(s)
                alpha[li, :, j], peak[li, :, j] = a.numpy(), ratio.numpy()
    return EmpiricalAlpha([int(n) for n in ns], estimator, mode if estimator == "mc" else "pooled", alpha, std,
                          sources, score_rows[0].head_dim, rows_per_n, ess, peak)


# ------------------------------------------------------------------------------------------------------- text


def token_windows(tokenizer: Any, text: str, seq_len: int, num_seqs: int) -> torch.Tensor:
    """``num_seqs`` windows of ``seq_len`` tokens starting at evenly spaced offsets of ``text``: long [S, L]."""
    if seq_len < 2 or num_seqs < 1:
        raise ValueError(f"need seq_len >= 2 and num_seqs >= 1, got {seq_len}, {num_seqs}")
    chars = seq_len * 12  # generous: English BPE averages 3-5 characters per token
    starts = np.linspace(0, max(0, len(text) - chars), num_seqs).astype(int)
    out = []
    for s in starts:
        ids = tokenizer(text[s:s + chars], add_special_tokens=False)["input_ids"]
        if len(ids) < seq_len:
            raise ValueError(f"text too short: {len(ids)} tokens at offset {s}, need {seq_len}")
        out.append(ids[:seq_len])
    return torch.tensor(out, dtype=torch.long)
