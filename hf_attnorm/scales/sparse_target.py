"""sparse_target: k(n) = 0.5 ln((1 - eps)(n - m) / (eps m)), the scale at which m keys scored +1 hold 1 - eps of
the softmax mass against n - m keys scored -1 (so the irrelevant mass stays at eps as n grows).

m is a function of n: ``sqrt`` (m = c sqrt n, default c = 1), ``const`` (m = c) or ``fraction`` (m = c n, 0<c<1).

Rule where the formula has no positive value: when n <= m (nothing to suppress) or k(n) < ``sparse_floor``, the
multiplier is ``sparse_floor`` (default 1, i.e. the standard scale). So the scale is defined for every n >= 1,
continuous wherever k(n) crosses the floor, and never weaker than the floor.
"""

from __future__ import annotations

import math

import torch

from ..normalizers.base import Ctx
from ..registry import AttnormError, register_scale
from ..settings import AttnormSettings, declare_option, nonnegative, open_unit, positive
from .base import Scale

EPS = declare_option("sparse_eps", float, 0.1, "sparse_target: target mass eps on irrelevant keys, in (0, 1)",
                     check=open_unit)
M_RULE = declare_option("sparse_m_rule", str, "sqrt", "sparse_target: how m grows with n: sqrt (c*sqrt n), "
                        "const (c) or fraction (c*n)", choices=("sqrt", "const", "fraction"))
M_C = declare_option("sparse_m", float, 1.0, "sparse_target: the constant c of sparse_m_rule (> 0; < 1 for "
                     "fraction)", check=positive)
FLOOR = declare_option("sparse_floor", float, 1.0, "sparse_target: lower bound of the multiplier, used where "
                       "k(n) is below it or undefined (n <= m)", check=nonnegative)


def sparse_target_k(n: float, m: float, eps: float) -> float:
    """k = 0.5 ln((1 - eps)(n - m) / (eps m)): with m scores of +1 and n - m of -1, softmax(k s) puts exactly eps of
    the mass on the -1s. Needs 0 < m < n and 0 < eps < 1."""
    if not 0.0 < eps < 1.0:
        raise ValueError(f"sparse_target_k: eps must lie strictly between 0 and 1, got {eps!r}")
    if not m > 0:
        raise ValueError(f"sparse_target_k: m must be > 0, got {m!r}")
    if not m < n:
        raise ValueError(f"sparse_target_k: m must be < n (some keys must be irrelevant), got m={m!r}, n={n!r}")
    return 0.5 * math.log((1.0 - eps) * (n - m) / (eps * m))


def sparse_target_m(n: torch.Tensor, rule: str, c: float) -> torch.Tensor:
    """m(n) for a rule: sqrt -> c sqrt(n), const -> c, fraction -> c n."""
    if rule == "sqrt":
        return c * torch.sqrt(n)
    if rule == "const":
        return torch.full_like(n, c)
    if rule == "fraction":
        return c * n
    raise ValueError(f"sparse_m_rule must be one of sqrt, const, fraction; got {rule!r}")


def sparse_target_scale(n: torch.Tensor, eps: float, rule: str = "sqrt", c: float = 1.0,
                        floor: float = 1.0) -> torch.Tensor:
    """The multiplier used in attention: max(floor, k(n, m(n))) where n > m, else floor."""
    m = sparse_target_m(n, rule, c)
    valid = n > m
    ratio = (1.0 - eps) * (n - m) / (eps * m)
    k = 0.5 * torch.log(torch.where(valid, ratio, torch.ones_like(ratio)))
    return torch.where(valid, torch.clamp(k, min=floor), torch.full_like(k, floor))


@register_scale
class SparseTarget(Scale):
    name = "sparse_target"
    paper = "no paper: derived in docs/scale_analysis.md (mass eps on n - m irrelevant keys)"
    description = "scaling * max(floor, 0.5 ln((1-eps)(n-m)/(eps m))), m = f(n)"
    options = (EPS, M_RULE, M_C, FLOOR)

    def validate(self, settings: AttnormSettings) -> None:
        if settings.sparse_m_rule == "fraction" and not settings.sparse_m < 1.0:
            raise AttnormError(f"attnorm option 'sparse_m' must be < 1 with sparse_m_rule='fraction' (m = c*n must "
                             f"leave irrelevant keys), got {settings.sparse_m!r}")

    def multiplier(self, n: torch.Tensor, ctx: Ctx) -> torch.Tensor | None:
        s = ctx.settings
        return sparse_target_scale(n, s.sparse_eps, s.sparse_m_rule, s.sparse_m, s.sparse_floor)
