"""empirical_max_gradient: alpha*(n) read from a table measured on a model's own scores (``hf_attnorm.lab.analysis``).

``max_gradient`` solves alpha*(n) for a score MODEL (normal or cosine). This scale takes the optimum measured on a
model's real pre-scale scores q.k*scaling instead: ``scripts/scale_analysis.py --model DIR`` writes the table,
and since it is an attnorm option it is saved in config.json with the checkpoint and comes back on load.

Table (option ``empirical_alpha_table``, plain JSON)::

    {"n":     [n_1, ..., n_K],          # K >= 1 key counts, strictly increasing, each > 1
     "alpha": [a_1, ..., a_K]           # one curve for every layer and head, or
              [[a_1..a_K], ...]         #   one curve per layer (indexed by the attention module's layer_idx), or
              [[[a_1..a_K], ...], ...]  #   one curve per layer and query head
     "source": "..."}                   # optional free text: where the table was measured

Between table points the multiplier is linear in ln n. Outside [n_1, n_K] option ``empirical_extrapolation``
decides: ``normal`` (default) follows the shape of the normal-model optimum, a_K * alpha*_N(n) / alpha*_N(n_K)
above the table and a_1 * alpha*_N(n) / alpha*_N(n_1) below it (so a single point is a scaled normal curve);
``clamp`` holds the end values. With no table the multiplier is the analytic normal-model alpha*(n), identical to
``max_gradient`` with ``max_gradient_dist='normal'``.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from ..normalizers.base import Ctx
from ..registry import register_scale
from ..settings import AttnormSettings, declare_option
from .base import Scale
from .max_gradient import max_gradient_alpha, max_gradient_alpha_torch, warm_table

_TABLE_KEYS = ("n", "alpha", "source")


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _curve_problem(curve: Any, k: int, where: str) -> str | None:
    if not isinstance(curve, list) or len(curve) != k:
        got = f"a list of {len(curve)}" if isinstance(curve, list) else f"a {type(curve).__name__}"
        return f"needs {where} to be a list of {k} numbers (one per entry of 'n'), not {got}"
    bad = [a for a in curve if not _is_number(a) or a < 0]
    if bad:
        return f"needs finite alpha values >= 0 in {where}, found {bad[:3]}"
    return None


def table_depth(alpha: Any) -> int:
    """1: one global curve, 2: per layer, 3: per layer and head (of a validated table's ``alpha``)."""
    depth = 1
    while isinstance(alpha, list) and alpha and isinstance(alpha[0], list):
        alpha, depth = alpha[0], depth + 1
    return depth


def check_table(table: dict) -> str | None:
    """The structural problem of an ``empirical_alpha_table`` (None if it is well formed)."""
    unknown = sorted(set(table) - set(_TABLE_KEYS))
    if unknown:
        return f"has unknown key(s) {unknown}; allowed keys: n, alpha, source"
    if "n" not in table or "alpha" not in table:
        return "needs keys 'n' (list of key counts) and 'alpha' (curve, per-layer or per-layer-per-head curves)"
    if "source" in table and not isinstance(table["source"], str):
        return "needs 'source' to be a string"
    n = table["n"]
    if not isinstance(n, list) or not n or not all(_is_number(x) for x in n):
        return "needs 'n' to be a non-empty list of finite numbers"
    if n[0] <= 1 or any(b <= a for a, b in zip(n, n[1:])):
        return "needs 'n' strictly increasing with every entry > 1"
    alpha, k = table["alpha"], len(n)
    if not isinstance(alpha, list) or not alpha:
        return "needs 'alpha' to be a non-empty list"
    depth = table_depth(alpha)
    if depth == 1:
        return _curve_problem(alpha, k, "'alpha'")
    if depth == 2:
        for i, curve in enumerate(alpha):
            if (problem := _curve_problem(curve, k, f"alpha[{i}]")) is not None:
                return problem
        return None
    if depth == 3:
        heads = len(alpha[0])
        for i, layer in enumerate(alpha):
            if not isinstance(layer, list) or len(layer) != heads or not heads:
                return f"needs every layer of a per-head table to list the same number of heads ({heads}); " \
                       f"alpha[{i}] does not"
            for h, curve in enumerate(layer):
                if (problem := _curve_problem(curve, k, f"alpha[{i}][{h}]")) is not None:
                    return problem
        return None
    return "needs 'alpha' nested at most 3 deep (global curve, per layer, per layer and head)"


TABLE = declare_option(
    "empirical_alpha_table", dict, None,
    "empirical_max_gradient: fitted alpha*(n) table {'n': [...], 'alpha': curve | per-layer curves | per-layer "
    "per-head curves, 'source': str} as written by scripts/scale_analysis.py (linear in ln n between points); "
    "null = the analytic normal-model alpha*(n) of max_gradient",
    optional=True, check=check_table,
)
EXTRAPOLATION = declare_option(
    "empirical_extrapolation", str, "normal",
    "empirical_max_gradient: outside the table's n range, 'normal' follows the normal-model alpha*(n) scaled to "
    "the end point, 'clamp' holds the end values", choices=("normal", "clamp"),
)


class _Compiled:
    """A validated table as tensors: log n [K], alpha [L, H, K] (L, H = 1 when shared), end ratios."""

    def __init__(self, table: dict) -> None:
        n = [float(x) for x in table["n"]]
        alpha = table["alpha"]
        depth = table_depth(alpha)
        if depth == 1:
            alpha = [[alpha]]
        elif depth == 2:
            alpha = [[curve] for curve in alpha]
        self.depth = depth
        self.n = n
        # explicit cpu: prepare() may run while a model is built under torch.device("meta")
        self.log_n = torch.tensor([math.log(x) for x in n], dtype=torch.float64, device="cpu")
        self.alpha = torch.tensor(alpha, dtype=torch.float64, device="cpu")  # [L, H, K]
        self.normal_ends = (max_gradient_alpha(n[0], cache=False), max_gradient_alpha(n[-1], cache=False))

    def curves(self, layer_idx: int | None, num_heads: int | None) -> torch.Tensor:
        """The curves for one attention module: [1 or H, K]."""
        if self.depth >= 2:
            layers = self.alpha.shape[0]
            if layer_idx is None:
                raise ValueError(
                    f"empirical_max_gradient: the table has per-layer curves ({layers} layers) but this attention "
                    "call has no layer index (module_info['layer_idx']); pass module_info={'layer_idx': i} to "
                    "attention() or use a global table")
            if not 0 <= layer_idx < layers:
                raise ValueError(f"empirical_max_gradient: the table has curves for {layers} layers but this "
                                 f"attention module is layer {layer_idx}; measure the table on this model")
        a = self.alpha[layer_idx if self.depth >= 2 else 0]
        if self.depth == 3 and num_heads is not None and a.shape[0] != num_heads:
            raise ValueError(f"empirical_max_gradient: the table has per-head curves for {a.shape[0]} heads but this "
                             f"attention has {num_heads} query heads; measure the table on this model")
        return a


_lock = threading.Lock()
_COMPILED: dict[int, tuple[dict, _Compiled]] = {}


def _compiled(table: dict) -> _Compiled:
    # keyed on the (immutable-by-contract) settings object; the stored reference keeps the id from being reused
    with _lock:
        hit = _COMPILED.get(id(table))
        if hit is not None and hit[0] is table:
            return hit[1]
        if len(_COMPILED) > 64:
            _COMPILED.clear()
        comp = _Compiled(table)
        _COMPILED[id(table)] = (table, comp)
        return comp


def empirical_alpha(n: torch.Tensor, table: dict | None, extrapolation: str = "normal",
                    layer_idx: int | None = None, num_heads: int | None = None, n_max: int = 0) -> torch.Tensor:
    """The multiplier for key counts n (float, >= 1, integer-valued; any shape [B, 1 or H, Lq]).

    Returns n's shape for a global or per-layer table, [B, H, Lq] for a per-head one (n: [B, 1 or H, Lq]).
    layer_idx selects the curve of a per-layer table; num_heads (query heads), when known, is checked against a
    per-head table; n_max: an upper bound of n known from shapes (the call's key count), so the normal-model
    lookup needs no host sync (see ``max_gradient_alpha_torch``).
    """
    if table is None:
        return max_gradient_alpha_torch(n, "normal", None, n_max)
    if extrapolation not in ("normal", "clamp"):
        raise ValueError(f"empirical_extrapolation must be 'normal' or 'clamp', got {extrapolation!r}")
    comp = _compiled(table)
    curves = comp.curves(layer_idx, num_heads).to(n.device)  # [Hc, K]
    hc, k = curves.shape
    t = torch.log(n.double())
    if hc > 1:
        if n.dim() != 3 or n.shape[1] not in (1, hc):
            raise ValueError(f"empirical_max_gradient: per-head tables need n of shape [B, 1 or H, Lq], got "
                             f"{list(n.shape)}")
        t = t.expand(n.shape[0], hc, n.shape[2])

    def column(j: int) -> torch.Tensor:  # curve values at table index j, broadcastable against t
        return curves[:, j].view(1, hc, 1) if hc > 1 else curves[0, j]

    log_n = comp.log_n.to(n.device)
    if k == 1:
        value = column(0).expand_as(t)
    else:
        idx = torch.searchsorted(log_n, t.contiguous()).clamp(1, k - 1)
        if hc > 1:
            c = curves.view(1, hc, 1, k).expand(*t.shape, k)
            lo_y = c.gather(-1, (idx - 1).unsqueeze(-1)).squeeze(-1)
            hi_y = c.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
        else:
            lo_y, hi_y = curves[0][idx - 1], curves[0][idx]
        lo_x, hi_x = log_n[idx - 1], log_n[idx]
        w = ((t - lo_x) / (hi_x - lo_x)).clamp(0.0, 1.0)  # the clamp holds the end values outside the table
        value = lo_y + w * (hi_y - lo_y)
    if extrapolation == "normal":
        normal = max_gradient_alpha_torch(n, "normal", None, n_max).double().expand_as(t)
        value = torch.where(t < log_n[0], column(0) * normal / comp.normal_ends[0], value)
        value = torch.where(t > log_n[-1], column(k - 1) * normal / comp.normal_ends[1], value)
    return value.to(n.dtype)


@register_scale
class EmpiricalMaxGradient(Scale):
    name = "empirical_max_gradient"
    paper = "Su 2023, https://kexue.fm/archives/9812 (alpha*(n) measured on the model's scores)"
    description = ("scaling * alpha*(n) measured on a model's own scores (table in the settings); analytic "
                   "normal-model alpha*(n) without a table")
    options = (TABLE, EXTRAPOLATION)

    def prepare(self, settings: AttnormSettings, module_info: dict) -> None:
        length = module_info.get("max_positions")
        if length and (settings.empirical_alpha_table is None or settings.empirical_extrapolation == "normal"):
            warm_table("normal", None, min(int(length), 16384))
        if settings.empirical_alpha_table is not None:
            _compiled(settings.empirical_alpha_table)

    def multiplier(self, n: torch.Tensor, ctx: Ctx) -> torch.Tensor | None:
        s = ctx.settings
        num_heads = ctx.module_info.get("num_heads")
        if num_heads is None and ctx.heads:
            num_heads = next(iter(ctx.heads.values())).shape[0]
        if num_heads is None and n.shape[1] > 1:
            num_heads = n.shape[1]
        return empirical_alpha(n, s.empirical_alpha_table, s.empirical_extrapolation,
                               ctx.module_info.get("layer_idx"), num_heads, n_max=ctx.lk)
