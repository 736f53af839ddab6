"""max_gradient: alpha*(n), the scale that maximises alpha * (1 - sum_i p_i^2) with p = softmax(alpha s).

Su Jianlin (kexue.fm/archives/9812): the softmax gradient is largest, on average, when alpha (1 - sum p^2) is.
For n i.i.d. scores with moment generating function M, sum p^2 ~ M(2 alpha) / (n M(alpha)^2), so alpha* solves

    d/dalpha [alpha (1 - R(alpha)/n)] = 0,  R(alpha) = M(2 alpha)/M(alpha)^2
    <=>  h(alpha) := R(alpha) (1 + alpha R'(alpha)/R(alpha)) = n.

* normal scores s ~ N(0, 1): R = e^{alpha^2}, h = e^{alpha^2}(1 + 2 alpha^2); fitted by 0.84 sqrt(ln n).
* cosine scores (unit q, k uniform on the sphere in d dims): s = cos(theta) with density proportional to
  sin^{d-2}(theta) on [0, pi]; M, R and R' are computed by Gauss-Legendre quadrature in theta (smooth for every
  d >= 2), R'/R = 2 (E_{2 alpha}[s] - E_alpha[s]) with E_a the mean under the a-tilted density. Fitted by about
  3.5 ln n at d = 128.

h is increasing in alpha (h(0) = 1), so alpha*(n) = 0 for n <= 1 and is unique for n > 1; it is solved to machine
precision (Newton from a bracketing grid, then bisection where Newton did not settle), not read off a fitted curve.
Results for integer n are cached in a growing table per (dist, d).
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np
import torch

from ..normalizers.base import Ctx
from ..registry import register_scale
from ..settings import AttnormError, AttnormSettings, declare_option
from .base import Scale

DIST = declare_option("max_gradient_dist", str, "normal", "max_gradient: score model, normal (s ~ N(0,1)) or "
                      "cosine (unit q, k in head_dim dimensions)", choices=("normal", "cosine"))
HEAD_DIM = declare_option("head_dim", int, None, "max_gradient (cosine): dimension d of the cosine score model; "
                          "null = the attention head dimension", optional=True,
                          check=lambda v: "must be >= 2" if v < 2 else None)

_QUAD_NODES = 256  # converged: 256 and 4096 nodes agree to 1e-15 for d in [2, 256], alpha <= 60
_lock = threading.Lock()
_TABLES: dict[tuple[str, int], np.ndarray] = {}
_TORCH_TABLES: dict[tuple[str, int, str], torch.Tensor] = {}


@functools.lru_cache(maxsize=64)
def _cosine_quadrature(d: int) -> tuple[np.ndarray, np.ndarray]:
    """Nodes cos(theta) and log-weights (GL weight x sin^{d-2} theta) on [0, pi]."""
    x, w = np.polynomial.legendre.leggauss(_QUAD_NODES)
    theta = (x + 1.0) * (math.pi / 2.0)
    logw = np.log(w * (math.pi / 2.0)) + (d - 2) * np.log(np.sin(theta))
    return np.cos(theta), logw


def _logsumexp(a: np.ndarray, axis: int = -1) -> np.ndarray:
    m = a.max(axis=axis, keepdims=True)
    return (m + np.log(np.exp(a - m).sum(axis=axis, keepdims=True))).squeeze(axis)


def _cosine_log_m_and_mean(alpha: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """log E[e^{alpha s}] and the alpha-tilted mean E_alpha[s] for the cosine model; alpha: [N]."""
    c, logw = _cosine_quadrature(d)
    z = alpha[:, None] * c[None, :] + logw[None, :]
    lse = _logsumexp(z)
    p = np.exp(z - lse[:, None])
    return lse - _logsumexp(logw[None, :]), (p * c[None, :]).sum(axis=-1)


def log_h(alpha: np.ndarray | float, dist: str = "normal", head_dim: int | None = None) -> np.ndarray:
    """log h(alpha); alpha* solves log h(alpha) = log n. Vectorised over alpha."""
    a = np.atleast_1d(np.asarray(alpha, dtype=np.float64))
    if dist == "normal":
        return a * a + np.log1p(2 * a * a)
    if dist == "cosine":
        d = _check_dim(head_dim)
        lm1, e1 = _cosine_log_m_and_mean(a, d)
        lm2, e2 = _cosine_log_m_and_mean(2 * a, d)
        log_r = lm2 - 2 * lm1
        return log_r + np.log1p(2 * a * (e2 - e1))
    raise ValueError(f"max_gradient: dist must be 'normal' or 'cosine', got {dist!r}")


def sum_p2_model(alpha: np.ndarray | float, n: float, dist: str = "normal", head_dim: int | None = None) -> np.ndarray:
    """The approximation sum p^2 ~ M(2 alpha) / (n M(alpha)^2) = R(alpha)/n."""
    a = np.atleast_1d(np.asarray(alpha, dtype=np.float64))
    if dist == "normal":
        return np.exp(a * a) / n
    d = _check_dim(head_dim)
    lm1, _ = _cosine_log_m_and_mean(a, d)
    lm2, _ = _cosine_log_m_and_mean(2 * a, d)
    return np.exp(lm2 - 2 * lm1) / n


def max_gradient_objective(alpha, n, dist: str = "normal", head_dim: int | None = None) -> np.ndarray:
    """alpha (1 - R(alpha)/n), the quantity alpha* maximises."""
    a = np.atleast_1d(np.asarray(alpha, dtype=np.float64))
    return a * (1.0 - sum_p2_model(a, n, dist, head_dim))


def max_gradient_condition(alpha, n, dist: str = "normal", head_dim: int | None = None) -> np.ndarray:
    """The first-order condition d/dalpha [alpha (1 - R/n)] = 1 - h(alpha)/n; zero at alpha*."""
    return 1.0 - np.exp(log_h(alpha, dist, head_dim)) / np.asarray(n, dtype=np.float64)


def _check_dim(head_dim: int | None) -> int:
    if head_dim is None:
        raise ValueError("max_gradient with dist='cosine' needs head_dim (the dimension d of q and k)")
    if int(head_dim) != head_dim or head_dim < 2:
        raise ValueError(f"max_gradient: head_dim must be an integer >= 2, got {head_dim!r}")
    return int(head_dim)


def _solve(n: np.ndarray, dist: str, head_dim: int | None) -> np.ndarray:
    """alpha* for each n (float64 array, n >= 1): invert log h on a dense grid, then Newton to |log h - log n|
    below 1e-13 (bisection inside the grid bracket whenever a Newton step would leave it)."""
    n = np.asarray(n, dtype=np.float64)
    out = np.zeros_like(n)
    todo = n > 1.0
    if not todo.any():
        return out
    target = np.log(n[todo])
    top = float(target.max())
    hi = 1.0
    while log_h(hi, dist, head_dim)[0] < top:
        hi *= 2.0
    grid = np.linspace(0.0, hi, 4097)
    lh = log_h(grid, dist, head_dim)
    pos = np.clip(np.searchsorted(lh, target), 1, len(grid) - 1)
    lo_b, hi_b = grid[pos - 1], grid[pos]
    a = np.interp(target, lh, grid)
    slope = np.gradient(lh, grid)
    for _ in range(50):
        f = log_h(a, dist, head_dim) - target
        if np.all(np.abs(f) < 1e-13):
            break
        lo_b = np.where(f < 0, a, lo_b)
        hi_b = np.where(f > 0, a, hi_b)
        df = np.interp(a, grid, slope)
        newton = a - f / np.where(df > 0, df, np.inf)
        inside = (newton > lo_b) & (newton < hi_b)
        a = np.where(inside, newton, 0.5 * (lo_b + hi_b))
    out[todo] = a
    return out


def max_gradient_alpha(n, dist: str = "normal", head_dim: int | None = None, *, cache: bool = True):
    """alpha*(n): the scale maximising alpha (1 - sum p^2) under the score model ``dist``.

    n: number of keys (>= 1; scalar, sequence, numpy array or tensor). dist: ``"normal"`` or ``"cosine"``
    (then ``head_dim`` is the dimension d). Returns a float for scalar n, else a float64 numpy array.
    Integer n are cached per (dist, d) (a table of every integer up to the next power of two above max n);
    ``cache=False`` solves exactly the given n instead (cheaper for a few large n, e.g. in an analysis).

    >>> round(max_gradient_alpha(1000), 2)
    2.14
    """
    if dist not in ("normal", "cosine"):
        raise ValueError(f"max_gradient_alpha: dist must be 'normal' or 'cosine', got {dist!r}")
    d = _check_dim(head_dim) if dist == "cosine" else 0
    if isinstance(n, torch.Tensor):
        n = n.detach().cpu().double().numpy()
    arr = np.asarray(n, dtype=np.float64)
    if np.any(~np.isfinite(arr)) or np.any(arr < 1):
        raise ValueError(f"max_gradient_alpha: n must be >= 1 (number of keys), got {n!r}")
    integer = cache and np.all(arr == np.round(arr)) and arr.size > 0 and arr.max() <= 1 << 22
    if integer:
        table = _table(dist, d, int(arr.max()))
        res = table[arr.astype(np.int64)]
    else:
        res = _solve(arr.reshape(-1), dist, d or None).reshape(arr.shape)
    return float(res) if np.ndim(n) == 0 else res


def _table(dist: str, d: int, n_max: int) -> np.ndarray:
    """Cached alpha*(n) for n = 0..>= n_max (index = n; n = 0 maps to 0)."""
    key = (dist, d)
    with _lock:
        table = _TABLES.get(key)
        if table is None or len(table) <= n_max:
            size = max(64, 1 << int(math.ceil(math.log2(n_max + 1))))
            new = np.zeros(size + 1)
            start = 0
            if table is not None:
                new[: len(table)] = table
                start = len(table)
            idx = np.arange(start, size + 1, dtype=np.float64)
            new[start:] = _solve(np.maximum(idx, 1.0), dist, d or None)
            _TABLES[key] = table = new
        return table


def max_gradient_alpha_torch(n: torch.Tensor, dist: str, head_dim: int | None, n_max: int = 0) -> torch.Tensor:
    """alpha*(n) for an integer-valued float tensor n, looked up in the cached table on n's device.

    n_max: an upper bound of n known without reading n (the call's key count); 0 = read it from n. With the bound
    and a table that already covers it, the lookup is pure tensor indexing (no host sync, compile-friendly)."""
    d = _check_dim(head_dim) if dist == "cosine" else 0
    if n_max <= 0:
        n_max = int(n.max().item()) if n.numel() else 1
    key = (dist, d, str(n.device))
    t = _TORCH_TABLES.get(key)
    if t is None or t.shape[0] <= n_max:
        table = _table(dist, d, n_max)
        t = torch.from_numpy(table).to(device=n.device, dtype=torch.float32)
        _TORCH_TABLES[key] = t
    return t[n.long().clamp_min(0)].to(n.dtype)


def warm_table(dist: str, head_dim: int | None, n_max: int, device: torch.device | str = "cpu") -> None:
    """Solve and cache alpha*(n) for n <= n_max ahead of time (models do this for their context length)."""
    max_gradient_alpha_torch(torch.ones(1, device=device), dist, head_dim, n_max)


@register_scale
class MaxGradient(Scale):
    name = "max_gradient"
    paper = "Su 2023, https://kexue.fm/archives/9812"
    description = "scaling * alpha*(n), the gradient-maximising scale (normal or cosine score model)"
    options = (DIST, HEAD_DIM)

    def validate(self, settings: AttnormSettings) -> None:
        if settings.max_gradient_dist == "normal" and settings.head_dim is not None:
            raise AttnormError("attnorm option 'head_dim' is only used with max_gradient_dist='cosine'; "
                               f"got head_dim={settings.head_dim} with the normal score model")

    def prepare(self, settings: AttnormSettings, module_info: dict) -> None:
        dist = settings.max_gradient_dist
        d = settings.head_dim or module_info.get("head_dim")
        length = module_info.get("max_positions")
        if length and (dist == "normal" or d):
            warm_table(dist, d if dist == "cosine" else None, min(int(length), 16384))

    def multiplier(self, n: torch.Tensor, ctx: Ctx) -> torch.Tensor | None:
        s = ctx.settings
        d = s.head_dim or ctx.head_dim
        return max_gradient_alpha_torch(n, s.max_gradient_dist, d if s.max_gradient_dist == "cosine" else None,
                                        n_max=ctx.lk)
