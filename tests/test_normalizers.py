"""Reference properties of every registered normalizer (generic over the registry: no edits for a new one)."""

from __future__ import annotations

import math

import pytest
import torch

from hf_attnorm.attention import attention, constant_heads, make_call
from hf_attnorm.kernels.variants import weights as reference_weights
from hf_attnorm.lab.convert.recipes import normalizer_recipe
from hf_attnorm.registry import NORMALIZERS
from hf_attnorm.settings import resolve_settings

NAMES = list(NORMALIZERS)


def _inputs(B=2, H=3, Lq=7, Lk=9, D=5, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g, dtype=dtype)
    k = torch.randn(B, H, Lk, D, generator=g, dtype=dtype)
    v = torch.randn(B, H, Lk, D, generator=g, dtype=dtype)
    keep = torch.rand(B, 1, Lq, Lk, generator=g) > 0.3
    if B > 1 and Lq > 5:
        keep[0, 0, 2, :] = False  # a fully masked row
        keep[1, 0, 4, :] = False
        keep[1, 0, 5, :] = False
        keep[1, 0, 5, 3] = True  # a row with a single visible key
    return q, k, v, keep


def _weights(name, q, k, keep, **opts):
    settings = resolve_settings(name, opts)
    call = make_call(q, k, k, settings, constant_heads(settings, q.shape[1], head_dim=q.shape[-1]), keep, False, None)
    return reference_weights(call)


@pytest.mark.parametrize("name", NAMES)
def test_row_sums_and_masked_zeros(name):
    q, k, v, keep = _inputs(dtype=torch.float32)
    w = _weights(name, q * 2, k, keep)
    assert w.shape == (2, 3, 7, 9)
    assert torch.isfinite(w).all()
    assert (w[~keep.expand_as(w)] == 0).all(), "masked keys must get exactly 0"
    assert (w[0, :, 2] == 0).all() and (w[1, :, 4] == 0).all(), "fully masked rows must give 0"
    kind = NORMALIZERS.get(name).row_sum
    rows = w.sum(-1)
    live = keep.any(-1).expand_as(rows)
    if NORMALIZERS.get(name).differential:  # A1 - lambda A2: rows sum to 1 - lambda, entries of either sign
        settings = resolve_settings(name)
        heads = constant_heads(settings, 3, head_dim=q.shape[-1])
        ctx = make_call(q, k, k, settings, heads, keep, False, None).ctx()
        ones = live.float().unsqueeze(-1)  # each half's rows sum to 1 (0 on a fully masked row)
        want = NORMALIZERS.get(name).halves_difference(ones, ones, ctx).squeeze(-1)
        assert not torch.allclose(want[live], torch.ones_like(want[live]))  # lambda is not 0 here
        torch.testing.assert_close(rows, want, atol=1e-5, rtol=0)
        assert (w < 0).any(), "a differential normalizer gave no negative weight on random scores"
        return
    if kind == "signed":  # negative weights allowed; their magnitudes sum to 1
        assert (w < 0).any(), "a signed normalizer gave no negative weight on random scores"
        magnitudes = w.abs().sum(-1)
        torch.testing.assert_close(magnitudes[live], torch.ones_like(magnitudes[live]), atol=1e-5, rtol=0)
        return
    assert (w >= 0).all()
    if kind == "one":
        torch.testing.assert_close(rows[live], torch.ones_like(rows[live]), atol=1e-5, rtol=0)
    elif kind == "at_most_one":
        assert (rows <= 1 + 1e-5).all()


@pytest.mark.parametrize("name", NAMES)
def test_fully_masked_rows_have_finite_gradients(name):
    q, k, v, keep = _inputs(dtype=torch.float32)
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)
    keep[:, :, :, :] = False
    keep[1, 0, 6, :4] = True
    out, _ = attention(q, k, v, name, attention_mask=keep, path="reference")
    assert (out[0] == 0).all() and (out[1, :, :6] == 0).all()
    out.pow(2).sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_float64(name):
    q, k, v, keep = _inputs(B=1, H=2, Lq=4, Lk=5, D=3, dtype=torch.float64, seed=1)
    keep = torch.ones_like(keep)
    keep[0, 0, 1, 3:] = False
    settings = resolve_settings(name)
    heads = {n: t.double().requires_grad_(True) for n, t in constant_heads(settings, 2, head_dim=3).items()}
    # stay away from kinks (|s| at 0, relu at 0, stablemax at 0) where finite differences are not derivatives
    q = (q + 0.1 * torch.sign(q)).requires_grad_(True)
    k = k.requires_grad_(True)
    v = v.requires_grad_(True)

    def f(q, k, v, *hv):
        h = dict(zip(heads, hv))
        return attention(q, k, v, name, attention_mask=keep, heads=h, path="reference")[0]

    assert torch.autograd.gradcheck(f, (q, k, v, *heads.values()), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_fp32(name, dtype):
    q, k, v, keep = _inputs(dtype=torch.float32)
    q = q * 30  # large scores: sum s^2, sum |s| and exp overflow in fp16 if computed there
    ref, _ = attention(q, k, v, name, attention_mask=keep, path="reference")
    out, _ = attention(q.to(dtype), k.to(dtype), v.to(dtype), name, attention_mask=keep, path="reference")
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    tol = 2e-2 if dtype == torch.float16 else 1e-1
    assert (out.float() - ref).abs().max() <= tol * ref.abs().max().clamp_min(1)


def test_softmax_worked_numbers():
    s = torch.tensor([[[[-1.0, 1.0, -1.0]]]])
    from hf_attnorm.normalizers.base import Ctx

    norm = NORMALIZERS.get("softmax")
    keep = torch.ones_like(s, dtype=torch.bool)
    ctx = Ctx(resolve_settings("softmax"), {}, 1, torch.full((1, 1, 1), 3.0), {})
    w = norm.reference(s, keep, ctx)[0, 0, 0]
    torch.testing.assert_close(w, torch.tensor([0.1065, 0.7870, 0.1065]), atol=5e-4, rtol=0)
    w2 = norm.reference(2 * s, keep, ctx)[0, 0, 0]
    torch.testing.assert_close(w2, torch.tensor([0.0177, 0.9647, 0.0177]), atol=5e-4, rtol=0)
    # 200 scores, ten +1 and 190 -1: the -1s hold 72% of the mass at scale 1, 25% at scale 2
    s = torch.cat([torch.ones(10), -torch.ones(190)]).view(1, 1, 1, -1)
    keep = torch.ones_like(s, dtype=torch.bool)
    for scale, quoted in ((1.0, 0.72), (2.0, 0.25)):
        w = norm.reference(scale * s, keep, ctx)[0, 0, 0]
        exact = 190 * math.exp(-scale) / (190 * math.exp(-scale) + 10 * math.exp(scale))
        assert abs(w[10:].sum().item() - exact) < 1e-6
        assert abs(exact - quoted) < 0.01  # the quoted 72% / 25% are rounded (exact: 0.7200 / 0.2582)


def test_sparse_normalizers_have_exact_zeros():
    s = torch.tensor([[[[3.0, 2.9, -1.0, -2.0, 0.0]]]])
    keep = torch.ones_like(s, dtype=torch.bool)
    for name in [n for n in NAMES if NORMALIZERS.get(n).sparse]:
        w = _weights(name, s.view(1, 1, 1, 5), torch.eye(5).view(1, 1, 5, 5), keep, )
        assert (w == 0).any(), name
        torch.testing.assert_close(w.sum(), torch.tensor(1.0))


def test_squared_all_zero_row_gives_zero():
    q = torch.zeros(1, 1, 2, 4)
    k = torch.randn(1, 1, 3, 4)
    out, w = attention(q, k, k, "squared", need_weights=True, path="reference")
    assert (w == 0).all() and (out == 0).all()


def test_sink_and_softmax_n_relations():
    q, k, v, keep = _inputs(dtype=torch.float64)
    keep = torch.ones_like(keep)
    # softmax_n with n_extra = e^sigma equals sink with logit sigma
    sigma = 0.7
    a, _ = attention(q, k, v, "sink", attention_mask=keep, sink_init=sigma, path="reference")
    b, _ = attention(q, k, v, "softmax_n", attention_mask=keep, n_extra=float(torch.tensor(sigma).exp()),
                     path="reference")
    torch.testing.assert_close(a, b)
    # softmax_n with n_extra = 0 is softmax
    c, _ = attention(q, k, v, "softmax_n", attention_mask=keep, n_extra=0.0, path="reference")
    d, _ = attention(q, k, v, "softmax", attention_mask=keep, path="reference")
    torch.testing.assert_close(c, d)


def test_linear_chunked_matches_reference():
    from hf_attnorm.normalizers.linear import linear_attention  # noqa: F401

    g = torch.Generator().manual_seed(3)
    for lq, lk, causal in [(1, 17, True), (17, 17, True), (300, 300, True), (5, 40, False), (130, 130, False)]:
        q = torch.randn(2, 4, lq, 8, generator=g, dtype=torch.float64)
        k = torch.randn(2, 2, lk, 8, generator=g, dtype=torch.float64)
        v = torch.randn(2, 2, lk, 8, generator=g, dtype=torch.float64)
        ref, _ = attention(q, k, v, "linear", causal=causal, path="reference")
        fast, _ = attention(q, k, v, "linear", causal=causal, path="linear_chunked")
        torch.testing.assert_close(fast, ref)
        pad = torch.ones(2, 1, lq, lk, dtype=torch.bool)
        if causal:
            pad = pad & torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        pad[0, :, :, : lk // 3] = False
        pad[0, :, : lq // 3] = False
        ref, _ = attention(q, k, v, "linear", attention_mask=pad, path="reference")
        fast, _ = attention(q, k, v, "linear", attention_mask=pad, path="linear_chunked")
        torch.testing.assert_close(fast, ref)


@pytest.mark.parametrize("name", [n for n in NAMES if NORMALIZERS.get(n).key_order])
def test_order_dependent_normalizers_say_what_happens_without_causality(name):
    """The warning on a bidirectional module quotes ``key_order_note``: each order-dependent normalizer says it."""
    assert NORMALIZERS.get(name).key_order_note.strip()


@pytest.mark.parametrize("name", [n for n in NAMES if normalizer_recipe(n).conversion_start])
def test_conversion_start_computes_softmax_attention(name):
    """The conversion start its recipe declares (lab/convert/recipes.py) reproduces softmax attention (to 1e-3 here, 64
    keys, causal), so a converted pretrained model starts at its own outputs; without it, the default start differs
    (the declaration matters)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, 64, 8, generator=g) for _ in range(3))
    softmax, _ = attention(q, k, v, "softmax", causal=True)
    start, _ = attention(q, k, v, name, causal=True, **normalizer_recipe(name).conversion_start)
    default, _ = attention(q, k, v, name, causal=True)
    torch.testing.assert_close(start, softmax, atol=1e-3, rtol=0)
    assert (default - softmax).abs().max() > 1e-2

