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


# ------------------------------------------------------------------------------ the fast paths, every option


def _grads(path, q, k, v, mask, causal, opts, gout):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, _, ran = _attend(path, *leaves, mask, causal, opts)
    out.backward(gout)
    return ran, [out.detach()] + [t.grad for t in leaves]


def _attend(path, q, k, v, mask, causal, opts):
    from hf_attnorm.attention import constant_heads, make_call
    from hf_attnorm.kernels import attend

    settings = resolve_settings("stickbreaking", opts)
    call = make_call(q, k, v, settings, constant_heads(settings, q.shape[1]), mask, causal, None)
    return attend(call, path=path)


def _padding_mask(B, Lq, Lk, causal):
    keep = torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
    keep[0, :, :, : Lk // 4] = False  # left padding
    keep[-1, :, :, Lk - 2:] = False  # right padding
    if causal:
        keep &= torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq)
    keep[0, :, : min(3, Lq)] = False  # fully masked rows
    return keep


FAST = ["stickbreaking_scan", "stickbreaking_cpu"]
SHAPES = [  # (B, H, Hkv, Lq, Lk, causal, masked)
    (2, 4, 2, 37, 37, True, False),  # causal, GQA, odd length
    (2, 2, 1, 29, 29, True, True),  # causal + padding + dead rows
    (2, 4, 2, 1, 23, False, False),  # decode: one query against a cache
    (2, 2, 2, 7, 30, False, True),  # a cache with several queries (bottom-right causal mask)
    (1, 2, 2, 19, 19, False, False),  # bidirectional: right-to-left order
]


@pytest.mark.parametrize("path", FAST)
@pytest.mark.parametrize("opts", [{}, {"stickbreaking_attend_current": True}, {"stickbreaking_remainder": False},
                                  {"stickbreaking_attend_current": True, "stickbreaking_remainder": False}],
                         ids=["default", "attend_current", "no_remainder", "both"])
def test_fast_paths_match_the_reference(path, opts, monkeypatch):
    """Forward and every gradient, float64, with small blocks so that every length crosses block edges."""
    from hf_attnorm.kernels.stickbreaking import cpu as cpu_mod
    from hf_attnorm.kernels.stickbreaking import scan as scan_mod

    monkeypatch.setattr(scan_mod, "BLOCK_OVERRIDE", (8, 16))
    monkeypatch.setattr(cpu_mod, "BLOCK_OVERRIDE", (8, 16))
    g = torch.Generator().manual_seed(5)
    for B, H, Hkv, Lq, Lk, causal, masked in SHAPES:
        q = torch.randn(B, H, Lq, 16, generator=g, dtype=torch.float64) * 2
        k, v = (torch.randn(B, Hkv, Lk, 16, generator=g, dtype=torch.float64) for _ in range(2))
        mask = _padding_mask(B, Lq, Lk, causal or Lq < Lk) if masked else None
        gout = torch.randn(B, H, Lq, 16, generator=g, dtype=torch.float64)
        _, want = _grads("reference", q, k, v, mask, causal, opts, gout)
        ran, got = _grads(path, q, k, v, mask, causal, opts, gout)
        assert ran == path
        for label, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8, msg=f"{path} {label} {(B, H, Lq, Lk, causal)}")
        if mask is not None:
            dead = ~mask.any(-1)
            assert (got[0][dead.expand(B, H, Lq)] == 0).all()


@pytest.mark.parametrize("path", FAST)
def test_a_learned_per_head_offset_matches_the_reference(path, monkeypatch):
    """beta = sigmoid(z - c_h) with a different learned c_h per head: the fast paths fold it into q and k; forward,
    every gradient and c_h's own gradient equal the reference's, and the offset changes the output."""
    from hf_attnorm.attention import make_call
    from hf_attnorm.kernels import attend
    from hf_attnorm.kernels.stickbreaking import cpu as cpu_mod
    from hf_attnorm.kernels.stickbreaking import scan as scan_mod

    monkeypatch.setattr(scan_mod, "BLOCK_OVERRIDE", (8, 16))
    monkeypatch.setattr(cpu_mod, "BLOCK_OVERRIDE", (8, 16))
    settings = resolve_settings("stickbreaking", {"stickbreaking_offset_learnable": True})
    g = torch.Generator().manual_seed(9)
    for B, H, Hkv, Lq, Lk, causal, masked in SHAPES[:4]:
        q = torch.randn(B, H, Lq, 16, generator=g, dtype=torch.float64) * 2
        k, v = (torch.randn(B, Hkv, Lk, 16, generator=g, dtype=torch.float64) for _ in range(2))
        offset = torch.linspace(-1.5, 2.5, H, dtype=torch.float64)
        mask = _padding_mask(B, Lq, Lk, causal or Lq < Lk) if masked else None
        gout = torch.randn(B, H, Lq, 16, generator=g, dtype=torch.float64)
        results = {}
        for which in ("reference", path):
            leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, offset)]
            call = make_call(*leaves[:3], settings, {"stickbreaking_offset": leaves[3]}, mask, causal, None)
            out, _, ran = attend(call, path=which)
            assert ran == which
            out.backward(gout)
            results[which] = [out.detach()] + [t.grad for t in leaves]
        for label, a, b in zip(("out", "dq", "dk", "dv", "d offset"), results[path], results["reference"]):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8, msg=f"{path} {label} {(B, H, Lq, Lk, causal)}")
        zero, _, _ = _attend(path, q, k, v, mask, causal, {})
        assert (results[path][0] - zero).abs().max() > 1e-2
        assert results[path][4].abs().min() > 0


@pytest.mark.parametrize("path", FAST)
def test_packed_block_diagonal_mask(path, monkeypatch):
    """Sequences packed one after another under a block-diagonal causal mask (continuous batching's layout: a chunk
    after its prefix, decode rows, a prefill): most key tiles are hidden from a whole query block, and the C++ kernel
    skips them; forward and gradients equal the reference."""
    from hf_attnorm.kernels.stickbreaking import cpu as cpu_mod
    from hf_attnorm.kernels.stickbreaking import scan as scan_mod

    monkeypatch.setattr(scan_mod, "BLOCK_OVERRIDE", (8, 16))
    monkeypatch.setattr(cpu_mod, "BLOCK_OVERRIDE", (8, 16))
    runs = [(1, 21), (1, 40), (13, 45), (20, 20)]  # (queries, keys) per sequence
    lq, lk = sum(q for q, _ in runs), sum(k for _, k in runs)
    mask = torch.zeros(1, 1, lq, lk, dtype=torch.bool)
    r0 = c0 = 0
    for q, k in runs:
        mask[0, 0, r0:r0 + q, c0:c0 + k] = torch.ones(q, k, dtype=torch.bool).tril(k - q)
        r0, c0 = r0 + q, c0 + k
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 4, lq, 16, generator=g, dtype=torch.float64) * 2
    k, v = (torch.randn(1, 2, lk, 16, generator=g, dtype=torch.float64) for _ in range(2))
    gout = torch.randn(1, 4, lq, 16, generator=g, dtype=torch.float64)
    _, want = _grads("reference", q, k, v, mask, True, {}, gout)
    ran, got = _grads(path, q, k, v, mask, True, {}, gout)
    assert ran == path
    for label, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8, msg=f"{path} {label}")


@pytest.mark.parametrize("path", FAST)
def test_fast_paths_in_fp32_long(path):
    """n = 600 in fp32 against float64: the accumulated scan stays within a few fp32 ulps of the exact weights."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 600, 32, generator=g, dtype=torch.float64) for _ in range(3))
    gout = torch.randn(1, 2, 600, 32, generator=g, dtype=torch.float64)
    _, exact = _grads("reference", q, k, v, None, True, {}, gout)
    ran, got = _grads(path, q.float(), k.float(), v.float(), None, True, {}, gout.float())
    assert ran == path
    for label, a, b in zip(("out", "dq", "dk", "dv"), got, exact):
        err = (a.double() - b).abs().max().item()
        assert err < 2e-5, f"{path} {label}: {err:.3g}"


def test_auto_rule_picks_the_fused_kernel_on_cpu():
    from hf_attnorm.kernels.stickbreaking import cpu as sb_cpu

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g) for _ in range(3))
    _, _, ran = _attend(None, q, k, v, None, True, {})
    assert ran == ("stickbreaking_cpu" if sb_cpu.NATIVE.unavailable_reason() is None else "stickbreaking_scan")


# ------------------------------------------------------------------------------ models


def test_encoder_modules_warn_and_causal_models_do_not():
    """Loading stick-breaking into a bidirectional encoder warns (its meaning there is a right-to-left order); a
    causal LM loads silently and its forward takes the fused path."""
    import warnings

    from conftest import LAST_CALL

    from hf_attnorm.hf import state
    from hf_attnorm.kernels.stickbreaking import cpu as sb_cpu
    from hf_attnorm.lab.model_zoo import build_model

    state._WARNED_ORDER.clear()
    with pytest.warns(UserWarning, match="not causal .* breaks the stick from the last visible key"):
        build_model("bert", "micro", task="masked_lm", vocab_size=97, max_positions=64,
                    attn_implementation="stickbreaking")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model = build_model("llama", "micro", task="causal_lm", vocab_size=97, max_positions=64,
                            attn_implementation="stickbreaking").eval()
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    LAST_CALL.path = None
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()
    expected = "stickbreaking_cpu" if sb_cpu.NATIVE.unavailable_reason() is None else "stickbreaking_scan"
    assert LAST_CALL.path == expected
