"""The one-query softmax of long CPU decode steps (kernels/base.py ``one_query_softmax``): its formula against an
independent float64 transcription, and every implementation whose decode step runs on the ``sdpa`` path taking it
from ``one_query_runs``'s key counts (plain softmax keeps SDPA's own kernel), with the reference path's result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny

from hf_attnorm.hf.forward import hf_attention_forward, record_paths, unplanned
from hf_attnorm.kernels import base, sdpa_rewrite, set_forced_path
from hf_attnorm.registry import NORMALIZERS, PRESETS


def _attention64(q, k, v, scale, mask):
    """softmax(scale q k^T + mask) v in float64 written out: e_j = exp(s_j - max s) over the visible keys, w = e / sum
    e; a row that sees no key gives 0 and log-sum-exp -inf. q [B, H, 1, D], k/v [B, Hkv, Lk, D]."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = scale * (q @ k.transpose(-1, -2))
    if mask is not None:
        s = s + mask.double()
    visible = s > float("-inf")
    top = torch.where(visible, s, torch.full_like(s, -1e300)).amax(-1, keepdim=True)
    e = torch.where(visible, torch.exp(s - top), torch.zeros_like(s))
    total = e.sum(-1, keepdim=True)
    out = torch.where(total > 0, (e @ v) / total.clamp_min(1e-300), torch.zeros_like(e @ v))
    lse = torch.where(total[..., 0] > 0, top[..., 0] + torch.log(total[..., 0].clamp_min(1e-300)),
                      torch.full_like(total[..., 0], float("-inf")))
    return out, lse


def _inputs(b, h, hkv, lk, d, dtype, mask_kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, 1, d, generator=g, dtype=dtype)
    k, v = (torch.randn(b, hkv, lk, d, generator=g, dtype=dtype) for _ in range(2))
    if mask_kind == "none":
        return q, k, v, None
    if mask_kind == "decay":  # forgetting attention's: -(c_L - c_j), large enough that most weights underflow
        c = F.logsigmoid(torch.randn(b, h, lk, generator=g, dtype=torch.float64) - 3.0).cumsum(-1)
        return q, k, v, (c[..., -1:] - c).unsqueeze(2).to(dtype)
    keep = torch.rand(b, 1, 1, lk, generator=g) > 0.4
    keep[..., -1] = True
    if mask_kind == "dead_row":  # the last batch row sees no key
        keep[-1] = False
    return q, k, v, torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("mask_kind", ["none", "decay", "padding", "dead_row"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("lk", [1, 7, 300])
def test_one_query_softmax_is_the_formula(dtype, mask_kind, heads, lk):
    h, hkv = heads
    q, k, v, mask = _inputs(2, h, hkv, lk, 16, dtype, mask_kind)
    want, want_lse = _attention64(q, k, v, 0.25, mask)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for lse in (False, True):
        out, got_lse = base.one_query_softmax(q, k, v, 0.25, mask, lse)
        assert out.dtype == dtype and out.shape == (2, h, 1, 16)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
        if not lse:
            assert got_lse is None
            continue
        assert got_lse.shape == (2, h, 1)
        assert torch.equal(torch.isinf(got_lse), torch.isinf(want_lse))
        finite = torch.isfinite(want_lse)
        torch.testing.assert_close(got_lse.double()[finite], want_lse[finite], atol=tol * 10, rtol=tol)
    if mask_kind == "dead_row":
        assert torch.equal(out[-1], torch.zeros_like(out[-1])) and torch.isneginf(got_lse[-1]).all()


def test_one_query_softmax_gives_hidden_keys_no_weight():
    """A hidden key's value, however large, changes nothing (its weight is exactly 0)."""
    q, k, v, mask = _inputs(1, 4, 2, 50, 8, torch.float32, "padding")
    hidden = torch.isneginf(mask[0, 0, 0])
    v2 = v.clone()
    v2[:, :, hidden] = 1e30
    a, _ = base.one_query_softmax(q, k, v, 0.3, mask)
    b, _ = base.one_query_softmax(q, k, v2, 0.3, mask)
    assert hidden.any() and torch.equal(a, b)


def _plain_softmax(implementation: str) -> bool:
    settings = PRESETS.get(implementation).settings
    return (settings["normalizer"] == "softmax" and settings.get("scale", "standard") == "standard"
            and not settings.get("num_mem_kv"))


@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "padded"])
@pytest.mark.parametrize("implementation", list(PRESETS))
def test_long_decode_steps_on_the_sdpa_path_take_the_one_query_form(implementation, padded, monkeypatch):
    """A one-query call with more keys than ``one_query_runs`` asks for, on the ``sdpa`` path, runs
    ``one_query_softmax`` (planned, with and without the direct entry, and decided in full) and gives the reference
    path's result; plain softmax keeps SDPA's own call, bitwise transformers' one."""
    if NORMALIZERS.get(PRESETS.get(implementation).settings["normalizer"]).query_coupled:
        pytest.skip("a query-coupled normalizer's decode step needs the earlier queries' state on a cache")
    model = tiny("llama", "causal_lm", implementation=implementation)
    with torch.no_grad():  # per-head values away from their (often equal) initial values
        for p in model.parameters():
            p.add_(torch.rand_like(p) * 0.1)
    module = model.model.layers[0].self_attn
    cfg = model.config
    h, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // h
    lk = base.ONE_QUERY_KEYS + 3
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, h, 1, d, generator=g)
    k, v = (torch.randn(2, hkv, lk, d, generator=g) for _ in range(2))
    mask = None
    if padded:
        mask = torch.ones(2, 1, 1, lk, dtype=torch.bool)
        mask[1, ..., :5] = False
    runs = []
    real = sdpa_rewrite.one_query_softmax
    monkeypatch.setattr(sdpa_rewrite, "one_query_softmax", lambda *a, **kw: runs.append(1) or real(*a, **kw))

    def call():
        with record_paths() as rec:
            out, _ = hf_attention_forward(module, q, k, v, mask, d ** -0.5, implementation=implementation)
        return out, rec.path

    with torch.no_grad():
        with unplanned():
            full, path = call()
        first, _ = call()  # (makes the plan)
        planned, _ = call()  # (its direct entry where it has one)
        try:
            set_forced_path("reference")
            want, _ = call()
        finally:
            set_forced_path("auto")
    if path != "sdpa":
        assert not runs, f"{implementation} decodes on {path}, yet one_query_softmax ran"
        return
    if _plain_softmax(implementation):
        assert not runs
        if mask is None:
            kr, vr = (t.repeat_interleave(h // hkv, dim=1) for t in (k, v))
            assert torch.equal(planned.transpose(1, 2), F.scaled_dot_product_attention(q, kr, vr, scale=d ** -0.5))
        return
    assert len(runs) >= 3, f"{implementation}: one_query_softmax ran {len(runs)} times in 3 calls"
    assert torch.equal(first, full) and torch.equal(planned, full)
    torch.testing.assert_close(full, want, atol=2e-5, rtol=2e-5)


def test_short_decode_steps_keep_the_flash_kernel(monkeypatch):
    """Below ``one_query_runs``'s key counts the one-query form does not run."""
    model = tiny("llama", "causal_lm", implementation="sink")
    module = model.model.layers[0].self_attn
    cfg = model.config
    h, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // h
    runs = []
    real = sdpa_rewrite.one_query_softmax
    monkeypatch.setattr(sdpa_rewrite, "one_query_softmax", lambda *a, **kw: runs.append(1) or real(*a, **kw))
    for lk, expected in ((base.ONE_QUERY_KEYS - 1, 0), (base.ONE_QUERY_KEYS, 1)):
        runs.clear()
        q = torch.randn(1, h, 1, d)
        k, v = torch.randn(1, hkv, lk, d), torch.randn(1, hkv, lk, d)
        with torch.no_grad(), unplanned():
            hf_attention_forward(module, q, k, v, None, d ** -0.5, implementation="sink")
        assert len(runs) == expected, (lk, runs)
