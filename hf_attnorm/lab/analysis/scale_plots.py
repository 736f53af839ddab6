"""PNG figures of the scale analysis (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from .scale_analysis import FORMS, AnalyticAlpha, EmpiricalAlpha, McRow, irrelevant_mass, m_of, sparse_k


def _plt():
    # matplotlib ([eval] extra) is imported on the first plot only: the analysis runs without it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def plot_irrelevant_mass(path: Path, l_min: float = 3, l_max: float = 10000, m_const: float = 10.0,
                         eps: float = 0.1) -> Path:
    """Mass on the -1 keys vs l at scale 1, scale 2 and k(l) (m = m_const solid, m = sqrt l dashed), and k(l)."""
    plt = _plt()
    lengths = np.logspace(np.log10(l_min), np.log10(l_max), 400)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = {"scale 1": "tab:blue", "scale 2": "tab:orange", "k(l)": "tab:green"}
    for rule, style in (("const", "-"), ("sqrt", "--")):
        m = m_of(lengths, rule, m_const)
        k = sparse_k(lengths, m, eps)
        label_m = f"m={m_const:g}" if rule == "const" else "m=sqrt(l)"
        for name, scale in (("scale 1", 1.0), ("scale 2", 2.0), ("k(l)", k)):
            ax.plot(lengths, irrelevant_mass(lengths, m, scale), style, color=colors[name], label=f"{name}, {label_m}")
        bx.plot(lengths, k, style, color="tab:green", label=f"k(l), {label_m}, eps={eps:g}")
    ax.plot([200, 200], [irrelevant_mass(200, 10, 1.0), irrelevant_mass(200, 10, 2.0)], "ko", ms=4,
            label="worked: l=200, m=10")
    ax.plot([3, 3], [irrelevant_mass(3, 1, 1.0), irrelevant_mass(3, 1, 2.0)], "k^", ms=5, label="worked: l=3, m=1")
    ax.axhline(eps, color="grey", lw=0.8, ls=":")
    ax.set(xscale="log", xlabel="keys l", ylabel="softmax mass on the l-m keys scored -1", ylim=(0, 1.02),
           title="irrelevant-key mass vs length")
    ax.legend(fontsize=7, loc="upper left")
    for c in (1.0, 2.0):
        bx.axhline(c, color="grey", lw=0.8, ls=":")
    bx.set(xscale="log", xlabel="keys l", ylabel="scale k", title="k(l) = 0.5 ln((1-eps)(l-m)/(eps m))")
    bx.legend(fontsize=8)
    return _save(fig, path)


def plot_alpha_curves(analytic: AnalyticAlpha, path: Path, weighting: str = "integer") -> Path:
    """alpha*(n) (solid) with the fitted c sqrt(ln n) / c_d ln n (dashed), and the fits' relative errors."""
    plt = _plt()
    n = analytic.n
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    colors = ["black", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    for i, (name, a) in enumerate(analytic.curves.items()):
        fit = analytic.fit(name, weighting)
        ax = axes[0] if name == "normal" else axes[1]
        approx = fit.constant * FORMS[fit.form](n)
        form = "sqrt(ln n)" if fit.form == "sqrt_log" else "ln n"
        color = colors[i % len(colors)]
        ax.plot(n, a, color=color, label=f"alpha*, {name}")
        ax.plot(n, approx, "--", color=color, label=f"{fit.constant:.3f} {form}")
        axes[2].plot(n, approx / a - 1.0, color=color, label=f"{name}: max {100 * fit.max_rel_error:.1f}%")
    axes[0].set(title="normal scores N(0,1)", ylabel="alpha*(n)")
    axes[1].set(title="cosine scores (unit q, k in d dims)", ylabel="alpha*(n)")
    axes[2].axhline(0, color="grey", lw=0.8)
    axes[2].set(title=f"relative error of the fit (least squares, {weighting} grid)", ylabel="fit / exact - 1")
    for ax in axes:
        ax.set(xscale="log", xlabel="keys n")
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_mc_check(rows: Sequence[McRow], path: Path,
                  profiles: Mapping[int, Mapping[str, Sequence[float]]] | None = None,
                  profile_alphas: Sequence[float] | None = None) -> Path:
    """Left: |approx / direct - 1| of sum p^2 vs n, one line per (model, alpha), bars = 2 standard errors.
    Right (with ``profiles``): the exact objective alpha (1 - mean sum p^2) of N(0,1) rows vs the approximate
    alpha (1 - e^{alpha^2}/n), per n."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2 if profiles else 1, figsize=(14 if profiles else 7.5, 4.8), squeeze=False)
    ax = axes[0, 0]
    keys = sorted({(r.dist, r.head_dim, r.alpha_label) for r in rows}, key=str)
    for dist, d, label in keys:
        sel = [r for r in rows if (r.dist, r.head_dim, r.alpha_label) == (dist, d, label)]
        n = [r.n for r in sel]
        err = [abs(r.rel_error) for r in sel]
        se = [2 * r.rel_stderr * (1 + r.rel_error) for r in sel]
        name = dist if d is None else f"{dist} d={d}"
        alpha = "alpha*(n)" if label == "star" else f"alpha={label}"
        ax.errorbar(n, err, yerr=se, marker="o", ms=3, capsize=2, label=f"{name}, {alpha}")
    ax.set(xscale="log", yscale="log", xlabel="keys n", ylabel="|approx / simulated - 1|",
           title="sum p^2 ~ E[e^{2as}] / (n E[e^{as}]^2) vs simulated")
    ax.legend(fontsize=7)
    if profiles:
        bx = axes[0, 1]
        for i, (n, prof) in enumerate(profiles.items()):
            color = f"C{i}"
            bx.plot(profile_alphas, prof["exact"], "-", color=color, label=f"exact (MC), n={n}")
            approx = np.asarray(prof["approx"], dtype=float)
            bx.plot(profile_alphas, np.where(approx > 0, approx, np.nan), "--", color=color,
                    label=f"approximate, n={n}")
        bx.set(xscale="log", xlabel="alpha", ylabel="alpha (1 - sum p^2)",
               title="objective for N(0,1) scores: exact vs approximation")
        bx.legend(fontsize=7)
    return _save(fig, path)


def plot_empirical(results: Mapping[str, EmpiricalAlpha], path: Path, normal_n: np.ndarray,
                   normal_alpha: np.ndarray, normal_mc: tuple[Sequence[int], np.ndarray] | None = None,
                   cosine_alpha: np.ndarray | None = None, title: str = "") -> Path:
    """Left: alpha*(n) of every head of the first result (thin, coloured by layer) and the median of each result,
    against the analytic N(0,1) optimum. Middle: plug-in (mgf) estimates standardised (score std x alpha*),
    median and quartiles over heads, against the analytic normal optimum and the cosine optimum / sqrt(d). Right
    (with an mc result): the exact-objective estimates standardised, against the exact Monte-Carlo N(0,1) optimum.
    """
    plt = _plt()
    has_mc = any(r.estimator == "mc" for r in results.values())
    fig, axes = plt.subplots(1, 3 if has_mc else 2, figsize=(19 if has_mc else 13, 4.8))
    ax, bx = axes[0], axes[1]
    cx = axes[2] if has_mc else None
    cmap = plt.get_cmap("viridis")
    colors = {"mgf": "tab:red", "mc-rows": "tab:purple", "mc-iid": "tab:brown"}
    for i, (label, res) in enumerate(results.items()):
        ns = np.array(res.ns, dtype=float)
        color = colors.get(label, f"C{i}")
        if i == 0:
            for li in range(res.layers):
                for h in range(res.heads):
                    ax.plot(ns, res.alpha[li, h], lw=0.5, alpha=0.35, color=cmap(li / max(1, res.layers - 1)))
        with warnings.catch_warnings():  # all-NaN columns (n not measurable) stay NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            ax.plot(ns, np.nanmedian(res.alpha.reshape(-1, len(ns)), axis=0), "-o", ms=3, color=color, lw=2,
                    label=f"median over heads ({label})")
            z = (res.alpha * res.score_std[:, :, None]).reshape(-1, len(ns))
            q25, med, q75 = np.nanpercentile(z, [25, 50, 75], axis=0)
        target = bx if res.estimator == "mgf" else cx
        target.plot(ns, med, "-o", ms=3, color=color, lw=2, label=f"std x alpha*, median ({label})")
        target.fill_between(ns, q25, q75, color=color, alpha=0.15)
    ax.plot(normal_n, normal_alpha, "k--", lw=1.2, label="analytic alpha*, N(0,1)")
    bx.plot(normal_n, normal_alpha, "k--", lw=1.2, label="analytic alpha*, N(0,1)")
    if cosine_alpha is not None:
        d = next(iter(results.values())).head_dim
        bx.plot(normal_n, cosine_alpha / np.sqrt(d), "b-.", lw=1, label=f"analytic cosine alpha* / sqrt({d})")
    ax.set(xscale="log", xlabel="keys n", ylabel="alpha*(n) (multiplier on q.k*scaling)",
           title=f"{title}: per head (colour = layer)")
    bx.set(xscale="log", xlabel="keys n", ylabel="score std x alpha*(n)",
           title="plug-in criterion, standardised (shaded: quartiles)")
    if cx is not None:
        if normal_mc is not None:
            cx.plot(normal_mc[0], normal_mc[1], "ks", ms=5, label="exact (MC) alpha*, N(0,1) rows")
        cx.set(xscale="log", xlabel="keys n", ylabel="score std x alpha*(n)",
               title="exact objective (heads with an interior maximum)")
    for axis in axes:
        axis.legend(fontsize=8)
    return _save(fig, path)
