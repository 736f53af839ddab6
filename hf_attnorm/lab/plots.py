"""PNG plots of a comparison: validation loss vs step, perplexity vs context, loss per position bucket, entropy vs n.

Each function draws one figure with one line per run, saves it, closes it, and returns a ``PlotInfo`` whose
``series`` are the labels of the lines actually drawn in the figure (read back from the axes), so callers and tests
can check what is in the picture. Reference lines (training length, ln n) are drawn unlabelled, except the ln n
line of the entropy plot, which is a series of its own ("uniform: ln n").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["PlotInfo", "plot_entropy_vs_n", "plot_perplexity_vs_context", "plot_position_buckets",
           "plot_validation_loss"]


@dataclasses.dataclass
class PlotInfo:
    """A saved figure: its path and the labels of its data series (in drawing order)."""

    path: str
    series: list[str]


def _save(fig, ax, path: str | Path, legend: bool = True) -> PlotInfo:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    series = [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]
    if legend and series:
        ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return PlotInfo(str(path), series)


def _check_runs(runs: Mapping[str, object], what: str) -> None:
    if not runs:
        raise ValueError(f"{what}: nothing to plot (no runs given)")


def plot_validation_loss(runs: Mapping[str, Sequence[Sequence[float]]], path: str | Path,
                         title: str = "Validation loss") -> PlotInfo:
    """runs: name -> [[step, val_loss], ...]. One line per run."""
    _check_runs(runs, "plot_validation_loss")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in runs.items():
        if not points:
            raise ValueError(f"plot_validation_loss: run {name!r} has no validation points")
        steps, losses = zip(*[(p[0], p[1]) for p in points])
        ax.plot(steps, losses, marker="o", markersize=3, label=name)
    ax.set_xlabel("training step")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(title)
    return _save(fig, ax, path)


def plot_perplexity_vs_context(runs: Mapping[str, Sequence[tuple[int, float | None]]], path: str | Path,
                               train_length: int | None = None,
                               title: str = "Perplexity vs evaluation context") -> PlotInfo:
    """runs: name -> [(context, perplexity or None when skipped), ...]. Log2 x axis; dotted line at the training
    length. A run with no finite point is still drawn (empty) so the legend lists it."""
    _check_runs(runs, "plot_perplexity_vs_context")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in runs.items():
        pts = [(c, p) for c, p in points if p is not None and math.isfinite(p)]
        xs, ys = (zip(*pts) if pts else ((), ()))
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    if train_length:
        ax.axvline(train_length, color="gray", linestyle=":", label="_training length")
    ax.set_xlabel("evaluation context (tokens)")
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title(title)
    return _save(fig, ax, path)


def plot_position_buckets(runs: Mapping[str, Sequence[Mapping[str, float]]], path: str | Path,
                          train_length: int | None = None,
                          title: str = "Loss by position in the window") -> PlotInfo:
    """runs: name -> buckets ``{"start", "end", "mean_nll"}`` of one context. x = bucket midpoint."""
    _check_runs(runs, "plot_position_buckets")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, buckets in runs.items():
        xs = [(b["start"] + b["end"]) / 2 for b in buckets]
        ax.plot(xs, [b["mean_nll"] for b in buckets], marker="o", label=name)
    if train_length:
        ax.axvline(train_length, color="gray", linestyle=":", label="_training length")
    ax.set_xlabel("target position in the window (bucket midpoint)")
    ax.set_ylabel("mean NLL (nats/token)")
    ax.set_title(title)
    return _save(fig, ax, path)


def plot_entropy_vs_n(runs: Mapping[str, tuple[Sequence[float], Sequence[float]]], path: str | Path,
                      train_length: int | None = None,
                      title: str = "Attention entropy vs visible keys n (mean over layers and heads)") -> PlotInfo:
    """runs: name -> (n values, mean entropy) (n may be bin means, not integers). Adds the uniform-attention curve
    ln n as its own series."""
    _check_runs(runs, "plot_entropy_vs_n")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    n_max = 1
    for name, (ns, ent) in runs.items():
        ax.plot(ns, ent, label=name, linewidth=1.2)
        n_max = max(n_max, math.ceil(max(ns)) if len(ns) else 1)
    grid = list(range(1, n_max + 1))
    ax.plot(grid, [math.log(n) for n in grid], color="black", linestyle="--", linewidth=0.8,
            label="uniform: ln n")
    if train_length:
        ax.axvline(train_length, color="gray", linestyle=":", label="_training length")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("visible keys n")
    ax.set_ylabel("entropy (nats)")
    ax.set_title(title)
    return _save(fig, ax, path)


def plot_budget_curve(curves: Mapping[str, Sequence[tuple[float, Sequence[float]]]], path: str | Path,
                      threshold: float | None = None, title: str = "Recovered perplexity against training tokens"
                      ) -> PlotInfo:
    """curves: name -> [(tokens, [perplexity / original, one per seed]), ...] in increasing tokens. One line per
    curve through the seeds' means, each seed a marker; log-log axes; ``threshold`` a dotted horizontal line."""
    _check_runs(curves, "plot_budget_curve")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in curves.items():
        if not points:
            raise ValueError(f"plot_budget_curve: curve {name!r} has no points")
        tokens = [p[0] for p in points]
        means = [math.exp(sum(math.log(v) for v in p[1]) / len(p[1])) for p in points]  # geometric: a ratio
        line, = ax.plot(tokens, means, marker="o", markersize=4, label=name,
                        linestyle="--" if " (" in name else "-")
        for t, seeds in points:
            ax.plot([t] * len(seeds), seeds, linestyle="none", marker=".", color=line.get_color(), alpha=0.6,
                    label="_seed")
    if threshold is not None:
        ax.axhline(threshold, color="gray", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training tokens (both stages)")
    ax.set_ylabel("perplexity / original model's")
    ax.set_title(title, fontsize=10)
    return _save(fig, ax, path)
