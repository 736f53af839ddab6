"""Length-aware scales: values, worked numbers and the numerically solved alpha*(n)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hf_attnorm.attention import attention
from hf_attnorm.scales import (
    llama4_scale,
    max_gradient_alpha,
    max_gradient_condition,
    max_gradient_objective,
    qwen_logn_scale,
    sparse_target_k,
    sparse_target_scale,
)


def test_sparse_target_k_inverts_the_mass_exactly():
    # m = 10 scores of +1, n - m = 190 of -1: softmax(k s) puts exactly eps on the -1s
    for eps in (0.01, 0.1, 0.25, 0.72):
        k = sparse_target_k(200, 10, eps)
        s = torch.cat([torch.ones(10), -torch.ones(190)]).double()
        p = torch.softmax(k * s, 0)
        assert abs(p[10:].sum().item() - eps) < 1e-12
    # at eps = 0.72 (the mass at scale 1) k is 1; at 0.2582 it is 2
    assert abs(sparse_target_k(200, 10, 190 * math.exp(-1) / (190 * math.exp(-1) + 10 * math.e)) - 1) < 1e-12
    assert abs(sparse_target_k(200, 10, 190 * math.exp(-2) / (190 * math.exp(-2) + 10 * math.exp(2))) - 2) < 1e-12


def test_sparse_target_scale_rule_where_the_formula_has_no_positive_value():
    n = torch.arange(1, 10001, dtype=torch.float64)
    for rule, c in (("sqrt", 1.0), ("const", 4.0), ("fraction", 0.3)):
        s = sparse_target_scale(n, 0.1, rule, c, floor=1.0)
        assert torch.isfinite(s).all() and (s >= 1.0).all()
        m = {"sqrt": c * n.sqrt(), "const": torch.full_like(n, c), "fraction": c * n}[rule]
        raw = 0.5 * torch.log((0.9 * (n - m) / (0.1 * m)).clamp_min(1e-300))
        big = (n > m) & (raw > 1.0)
        torch.testing.assert_close(s[big], raw[big])
        assert (s[~big] == 1.0).all()
    # n <= m (nothing to suppress): the floor
    assert sparse_target_scale(torch.tensor([3.0]), 0.1, "const", 5.0, floor=0.5).item() == 0.5


@pytest.mark.parametrize("n", [2, 3, 10, 100, 1000, 4096, 20000])
def test_max_gradient_normal_solves_its_optimality_condition(n):
    a = max_gradient_alpha(n)
    assert abs(max_gradient_condition(a, n)[0]) < 1e-6
    # it is a maximum: the objective is lower on both sides
    obj = max_gradient_objective(np.array([a - 1e-3, a, a + 1e-3]), n)
    assert obj[1] > obj[0] and obj[1] > obj[2]


def test_max_gradient_normal_values_and_fit():
    assert abs(max_gradient_alpha(1000) - 2.14) < 0.01
    ns = np.unique(np.geomspace(100, 20000, 60).round())
    alphas = max_gradient_alpha(ns)
    fit = 0.84 * np.sqrt(np.log(ns))
    assert np.all(np.abs(alphas - fit) / alphas < 0.10)
    assert max_gradient_alpha(1) == 0.0


@pytest.mark.parametrize("d", [64, 128, 256])
def test_max_gradient_cosine(d):
    for n in (40, 1000, 20000):
        a = max_gradient_alpha(n, dist="cosine", head_dim=d)
        assert abs(max_gradient_condition(a, n, "cosine", d)[0]) < 1e-6
    if d == 128:
        assert 25 <= max_gradient_alpha(1000, dist="cosine", head_dim=128) <= 27
    with pytest.raises(ValueError, match="head_dim"):
        max_gradient_alpha(100, dist="cosine")


def test_table_lookup_equals_direct_solve():
    n = np.array([5, 77, 513, 1023])
    direct = max_gradient_alpha(n.astype(float) + 0.0)  # integers: cached table
    solved = np.array([max_gradient_alpha(float(x) + 1e-12) for x in n])  # non-integers: direct solve
    np.testing.assert_allclose(direct, solved, rtol=1e-9)


def test_other_scale_formulas():
    n = torch.tensor([1.0, 8.0, 100.0, 5000.0])
    torch.testing.assert_close(qwen_logn_scale(n, 100), torch.tensor([1.0, 1.0, 1.0, math.log(5000) / math.log(100)]))
    torch.testing.assert_close(llama4_scale(n, 0.1, 8.0), 1 + 0.1 * torch.log1p(torch.floor(n / 8.0)))


def test_ssmax_anchored_at_1_is_softmax_whatever_its_per_head_values():
    """ssmax_anchor = 1 (a conversion's continuation starts there) is softmax for any s_h and b_h; between 0 and 1 the
    multiplier is the mix (1 - a)(s_h ln n + b_h) + a, so the output differs from both ends."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=g, dtype=torch.float64) for _ in range(3))
    heads = {"ssmax_s": torch.tensor([0.3, 1.7], dtype=torch.float64),
             "ssmax_bias": torch.tensor([-0.4, 0.9], dtype=torch.float64)}
    plain, _ = attention(q, k, v, "softmax", causal=True)
    anchored, _ = attention(q, k, v, "ssmax", causal=True, heads=heads, ssmax_anchor=1.0)
    torch.testing.assert_close(anchored, plain)
    free, _ = attention(q, k, v, "ssmax", causal=True, heads=heads)
    half, _ = attention(q, k, v, "ssmax", causal=True, heads=heads, ssmax_anchor=0.5)
    assert (half - plain).abs().max() > 1e-3 and (half - free).abs().max() > 1e-3


def test_scales_act_per_query_in_attention():
    """ssmax with s*ln n == 1 for every query equals plain softmax; log_n differs."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=g, dtype=torch.float64) for _ in range(3))
    ref, _ = attention(q, k, v, "softmax", causal=True)
    n = torch.arange(1, 10, dtype=torch.float64).clamp_min(2)  # query 0 sees 1 key: any scale gives weight 1
    # a single query row sees n keys; make s_h * ln n = 1 for a bidirectional call with n = 9
    s = torch.full((2,), 1 / math.log(9), dtype=torch.float64)
    out, _ = attention(q, k, v, "ssmax", heads={"ssmax_s": s})
    plain, _ = attention(q, k, v, "softmax")
    torch.testing.assert_close(out, plain)
    out2, _ = attention(q, k, v, "log_n", causal=True)
    assert not torch.allclose(out2, ref)
    del n
