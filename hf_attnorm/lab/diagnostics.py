"""What the attention maps and hidden states of a model look like, per layer and head, on one batch.

Computed on demand from ``output_attentions=True`` (which runs hf_attnorm's reference path, the only one that
materialises the weights; models with transformers' own implementations are switched to ``eager`` for the call):

* attention entropy and max weight as functions of n, the number of keys a query sees (the "attention fading"
  curve: a softmax trained at length L spreads its mass as n grows past L, entropy -> ln n, max weight -> 0);
* mass on the first visible key (the attention sink) and the total row mass (1 for softmax; <= 1 for softmax_1,
  symax, sparse maps; anything for sigmoid / relu maps, which are not normalised);
* hidden-state kurtosis (outlier features; Bondarenko et al. 2023 tie them to heads that learn to "do nothing").

Conventions. A row's entropy is that of its weights renormalised to sum 1, p = w / sum(w), in nats
(0 log 0 = 0): it measures how spread the row is whatever its total mass; rows of zero mass (a rectified map can
put weight nowhere) have no entropy and are counted in ``zero_mass_rows`` instead. Kurtosis is Pearson's
m4 / m2^2 over the hidden dimension of each token (3 for Gaussian features, ~D for one outlier feature),
averaged over tokens; ``max_abs`` is the largest |activation|.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..hf.families import is_causal
from ..registry import canonical, is_ours
from .evaluation.perplexity import eval_mode

__all__ = [
    "AttentionCurves",
    "Diagnostics",
    "attention_curves",
    "diagnose",
    "hidden_state_kurtosis",
    "log2_bins",
    "log_bins",
    "row_statistics",
]


def row_statistics(weights: torch.Tensor, keep: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-row statistics of attention maps.

    weights: [B, H, Lq, Lk]; keep: bool [B or 1, Lq, Lk] (True = key visible to the query). Read by magnitude |w|,
    so signed weights (Cog attention, differential attention) give the statistics of where their mass goes.
    Returns float64 tensors [B, H, Lq]: ``entropy`` (NaN on zero-mass rows), ``max_weight``, ``first_mass``
    (weight on the first visible key), ``mass`` (row sum); and ``n`` [B or 1, Lq] (visible keys per query).
    """
    if weights.dim() != 4:
        raise ValueError(f"weights must be [B, H, Lq, Lk], got shape {list(weights.shape)}")
    if keep.dim() != 3 or keep.shape[-2:] != weights.shape[-2:] or keep.shape[0] not in (1, weights.shape[0]):
        raise ValueError(f"keep must be bool [B or 1, Lq, Lk] matching weights {list(weights.shape)}, got "
                         f"{list(keep.shape)}")
    w = weights.detach().double().abs()
    keep4 = keep.bool()[:, None]
    w = torch.where(keep4, w, torch.zeros((), dtype=w.dtype))
    mass = w.sum(-1)
    p = w / mass.clamp_min(1e-300)[..., None]
    entropy = -torch.xlogy(p, p).sum(-1)
    entropy = torch.where(mass > 0, entropy, torch.full_like(entropy, math.nan))
    first_idx = keep.int().argmax(-1)  # [B|1, Lq]: first visible key of each query
    idx = first_idx[:, None, :, None].expand(w.shape[0], w.shape[1], -1, 1)
    return {
        "entropy": entropy,
        "max_weight": w.amax(-1),
        "first_mass": w.gather(-1, idx).squeeze(-1),
        "mass": mass,
        "n": keep.sum(-1),
    }


@dataclasses.dataclass
class AttentionCurves:
    """Statistics of one layer as functions of n (keys visible to the query), per head.

    n: distinct n values [N], ascending; rows: how many query rows had each n (per batch, summed) [N];
    entropy, max_weight, first_mass, mass: [H][N] means over the rows with that n (entropy over rows with mass > 0;
    NaN where none had); zero_mass_rows: rows with no mass at all, per head [H].
    """

    n: list[int]
    rows: list[int]
    entropy: list[list[float]]
    max_weight: list[list[float]]
    first_mass: list[list[float]]
    mass: list[list[float]]
    zero_mass_rows: list[int]

    METRICS = ("entropy", "max_weight", "first_mass", "mass")

    @property
    def num_heads(self) -> int:
        return len(self.entropy)

    def head_mean(self, metric: str) -> list[float]:
        """``metric`` averaged over heads (ignoring NaN), [N]."""
        t = torch.tensor(getattr(self, metric), dtype=torch.float64)
        return torch.nanmean(t, 0).tolist()

    def summary(self) -> list[dict[str, float]]:
        """Per head: row-weighted means over all n, plus the sink share first_mass / mass and entropy / ln n."""
        rows = torch.tensor(self.rows, dtype=torch.float64)
        n = torch.tensor(self.n, dtype=torch.float64)
        out = []
        for h in range(self.num_heads):
            row: dict[str, float] = {}
            for metric in self.METRICS:
                v = torch.tensor(getattr(self, metric)[h], dtype=torch.float64)
                ok = ~torch.isnan(v)
                row[metric] = float((v[ok] * rows[ok]).sum() / rows[ok].sum()) if bool(ok.any()) else math.nan
            ent = torch.tensor(self.entropy[h], dtype=torch.float64)
            ok = ~torch.isnan(ent) & (n > 1)
            row["entropy_over_log_n"] = (float((ent[ok] / n[ok].log() * rows[ok]).sum() / rows[ok].sum())
                                         if bool(ok.any()) else math.nan)
            row["sink_share"] = row["first_mass"] / row["mass"] if row["mass"] > 0 else math.nan
            row["zero_mass_rows"] = self.zero_mass_rows[h]
            out.append(row)
        return out

    def binned(self, edges: Sequence[int]) -> dict[str, Any]:
        """Head-mean curves averaged in bins [edges[i], edges[i+1]) of n (row-weighted); empty bins dropped."""
        n = torch.tensor(self.n)
        rows = torch.tensor(self.rows, dtype=torch.float64)
        out: dict[str, Any] = {"n_lo": [], "n_hi": [], **{m: [] for m in self.METRICS}}
        curves = {m: torch.tensor(self.head_mean(m), dtype=torch.float64) for m in self.METRICS}
        for lo, hi in zip(edges[:-1], edges[1:]):
            sel = (n >= lo) & (n < hi)
            if not bool(sel.any()):
                continue
            out["n_lo"].append(int(lo))
            out["n_hi"].append(int(hi) - 1)
            for m, c in curves.items():
                ok = sel & ~torch.isnan(c)
                out[m].append(float((c[ok] * rows[ok]).sum() / rows[ok].sum()) if bool(ok.any()) else math.nan)
        return out


def log2_bins(n_max: int) -> list[int]:
    """Bin edges 1, 2, 3, 5, 9, 17, ... (n in [1], [2], [3, 4], [5, 8], ...) up to past n_max."""
    edges = [1, 2]
    while edges[-1] <= n_max:
        edges.append(2 * edges[-1] - 1)
    return edges


def log_bins(n_max: int, per_octave: int = 8) -> list[int]:
    """Integer bin edges about 2^(1/per_octave) apart (every integer where they would be closer), from 1 to past
    n_max."""
    if per_octave < 1:
        raise ValueError(f"per_octave must be >= 1, got {per_octave}")
    edges = [1]
    k = 0
    while edges[-1] <= n_max:
        k += 1
        edges.append(max(edges[-1] + 1, round(2 ** (k / per_octave))))
    return edges


def attention_curves(weights: torch.Tensor, keep: torch.Tensor) -> AttentionCurves:
    """Group the row statistics of weights [B, H, Lq, Lk] (keep: bool [B or 1, Lq, Lk]) by n, per head.
    Rows whose query sees no key (n = 0, e.g. padded queries) are left out."""
    stats = row_statistics(weights, keep)
    B, H = weights.shape[:2]
    n = stats.pop("n").expand(B, -1).reshape(-1)  # [B * Lq]
    valid = n > 0
    flat = {k: v.permute(1, 0, 2).reshape(H, -1)[:, valid] for k, v in stats.items()}  # [H, rows]
    values, inverse = torch.unique(n[valid], return_inverse=True)
    N = len(values)
    rows = torch.zeros(N, dtype=torch.float64).index_add_(0, inverse, torch.ones(len(inverse), dtype=torch.float64))
    out: dict[str, list[list[float]]] = {}
    for m in AttentionCurves.METRICS:
        v = flat[m]
        ok = ~torch.isnan(v)  # only entropy has NaN (zero-mass rows): a mean over the rows that have one
        sums = torch.zeros(H, N, dtype=torch.float64).index_add_(1, inverse, torch.where(ok, v, 0.0))
        counts = torch.zeros(H, N, dtype=torch.float64).index_add_(1, inverse, ok.double())
        out[m] = torch.where(counts > 0, sums / counts.clamp_min(1), math.nan).tolist()
    zero = (flat["mass"] <= 0).sum(1).tolist()
    values = values.tolist()
    rows = [int(r) for r in rows.tolist()]
    return AttentionCurves(values, rows, out["entropy"], out["max_weight"], out["first_mass"], out["mass"],
                           [int(z) for z in zero])


def hidden_state_kurtosis(hidden: torch.Tensor, token_mask: torch.Tensor | None = None) -> dict[str, float]:
    """Pearson kurtosis over the hidden dimension: hidden [B, L, D], token_mask bool [B, L] (True = real token).
    Returns ``{"kurtosis": mean over tokens, "kurtosis_max": max over tokens, "max_abs": max |x|}``."""
    x = hidden.detach().double()
    if token_mask is not None:
        x = x[token_mask.bool()]
    x = x.reshape(-1, x.shape[-1])
    c = x - x.mean(-1, keepdim=True)
    m2 = c.pow(2).mean(-1)
    m4 = c.pow(4).mean(-1)
    kurt = m4 / m2.clamp_min(1e-300).pow(2)
    kurt = kurt[m2 > 0]
    return {"kurtosis": float(kurt.mean()) if kurt.numel() else math.nan,
            "kurtosis_max": float(kurt.max()) if kurt.numel() else math.nan,
            "max_abs": float(x.abs().max())}


@dataclasses.dataclass
class Diagnostics:
    """Per-layer attention curves and per-hidden-state kurtosis (index 0 = embeddings) of one batch."""

    implementation: str
    layers: list[AttentionCurves]
    hidden: list[dict[str, float]]

    def entropy_curve(self, per_octave: int | None = None) -> tuple[list[float], list[float]]:
        """Entropy vs n averaged over layers and heads: (n [N], entropy [N]). With ``per_octave``, averaged
        (row-weighted) in log-spaced bins of n, each point at the bin's mean n: a readable curve when a batch
        holds few rows per n."""
        n = torch.tensor(self.layers[0].n, dtype=torch.float64)
        t = torch.tensor([layer.head_mean("entropy") for layer in self.layers], dtype=torch.float64)
        ent = torch.nanmean(t, 0)
        if per_octave is None:
            return n.tolist(), ent.tolist()
        rows = torch.tensor(self.layers[0].rows, dtype=torch.float64)
        edges = log_bins(int(n.max()), per_octave)
        xs, ys = [], []
        for lo, hi in zip(edges[:-1], edges[1:]):
            sel = (n >= lo) & (n < hi) & ~torch.isnan(ent)
            if bool(sel.any()):
                w = rows[sel] / rows[sel].sum()
                xs.append(float((n[sel] * w).sum()))
                ys.append(float((ent[sel] * w).sum()))
        return xs, ys

    def summary(self, bins: Sequence[int] | None = None) -> dict[str, Any]:
        """JSON-friendly: per layer the per-head summary and log2-binned head-mean curves; kurtosis per state."""
        n_max = max(self.layers[0].n) if self.layers and self.layers[0].n else 1
        edges = list(bins) if bins is not None else log2_bins(n_max)
        return {
            "implementation": self.implementation,
            "layers": [{"heads": layer.summary(), "curves": layer.binned(edges)} for layer in self.layers],
            "hidden_states": self.hidden,
        }


@contextlib.contextmanager
def _weights_available(model: nn.Module) -> Iterator[None]:
    """Switch a model running transformers' own fused attention (sdpa, flash) to eager for the call."""
    impl = model.config._attn_implementation
    if is_ours(impl) or impl == "eager":
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(impl)


def diagnose(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             causal: bool | None = None) -> Diagnostics:
    """Run ``model`` once on input_ids [B, L] (attention_mask [B, L], 1 = token) with attention weights and hidden
    states. ``causal`` defaults to the model kind (causal LM: True, encoders / masked LMs: False)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, L], got shape {list(input_ids.shape)}")
    if causal is None:
        causal = is_causal(model)
    B, L = input_ids.shape
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    token = torch.ones(B, L, dtype=torch.bool, device=device) if attention_mask is None else attention_mask.bool()
    keep = token[:, None, :] & token[:, :, None]  # padded keys and padded queries see nothing
    if causal:
        keep = keep & torch.ones(L, L, dtype=torch.bool, device=device).tril()[None]
    kwargs: dict[str, Any] = {"output_attentions": True, "output_hidden_states": True}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask.to(device)
    with _weights_available(model), eval_mode(model), torch.inference_mode():
        out = model(input_ids=input_ids, **kwargs)
    if not out.attentions:
        raise RuntimeError(f"{type(model).__name__} returned no attention weights with output_attentions=True")
    layers = [attention_curves(a, keep) for a in out.attentions]
    hidden = [hidden_state_kurtosis(h, token) for h in out.hidden_states]
    return Diagnostics(str(canonical(model.config._attn_implementation)), layers, hidden)
