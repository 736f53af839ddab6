"""Score modifiers on the tensor API: soft-cap, additive bias (explicit, float mask, ALiBi) and attention sinks.

Every path that accepts a call with modifiers must equal a plain eager formula (softmax) and the reference
(every normalizer), forward and gradients (bias and sinks are learned in T5 and GPT-OSS); paths that cannot apply
them must decline with the reason.
"""

from __future__ import annotations

import pytest
import torch

from hf_attnorm.attention import attention, constant_heads, make_call
from hf_attnorm.kernels import PATHS, attend, candidate_paths, choose, declared_normalizers, explain
from hf_attnorm.kernels.fused import cpu as fused_cpu
from hf_attnorm.registry import NORMALIZERS, PRESETS, SCALES
from hf_attnorm.settings import resolve_settings

B, H, LQ, LK, D = 2, 4, 9, 9, 8
SCORE_PRESETS = [p for p in PRESETS if not NORMALIZERS.get(resolve_settings(p, {}).normalizer).scoreless]
#: normalizers without a sum over keys (sigmoid, relu_len): a sink would change nothing, so it is refused
FREE = {p for p in PRESETS if NORMALIZERS.get(resolve_settings(p, {}).normalizer).row_sum == "free"}


def _options(impl: str) -> dict:
    """A training length for the scales that need one (there is no model config here)."""
    return {"train_length": 64} if "train_length" in SCALES.get(resolve_settings(impl, {}).scale).options else {}


def _inputs(seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=dtype) for n in (LQ, LK, LK))
    bias = torch.randn(1, H, LQ, LK, generator=g, dtype=dtype)
    sinks = torch.randn(H, generator=g, dtype=dtype)
    keep = torch.rand(B, 1, LQ, LK, generator=g) > 0.3
    keep[:, :, :, 0] = True
    return q, k, v, bias, sinks, keep


def _eager(q, k, v, keep, bias=None, cap=None, sinks=None):
    s = q @ k.transpose(-1, -2) * D**-0.5
    if cap is not None:
        s = torch.tanh(s / cap) * cap
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    w = s.softmax(-1)
    return (w[..., :-1] if sinks is not None else w) @ v


MODS = [dict(bias=True), dict(cap=5.0), dict(sinks=True), dict(bias=True, cap=3.0, sinks=True)]


@pytest.mark.parametrize("mods", MODS, ids=lambda m: "+".join(m))
@pytest.mark.parametrize("path", ["reference", "chunked", "sdpa", "auto"])
def test_softmax_with_modifiers_equals_eager(path, mods):
    q, k, v, bias, sinks, keep = _inputs()
    kw = dict(bias=bias if mods.get("bias") else None, softcap=mods.get("cap"),
              sinks=sinks if mods.get("sinks") else None)
    ref = _eager(q, k, v, keep, kw["bias"], kw["softcap"], kw["sinks"])
    if path == "sdpa" and kw["softcap"] is not None:
        with pytest.raises(ValueError, match="soft-cap"):
            attention(q, k, v, "softmax", attention_mask=keep, path=path, **kw)
        return
    out, _ = attention(q, k, v, "softmax", attention_mask=keep, path=path, **kw)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)


def _outputs_and_grads(q, k, v, impl, bias, sinks, paths, kw) -> list[tuple]:
    """Per path (None = the rule's choice): (out, dq, dbias, dsinks or None) of sum(out^2), from fresh leaves."""
    results = []
    for path in paths:
        qq, bb = q.clone().requires_grad_(), bias.clone().requires_grad_()
        ss = None if sinks is None else sinks.clone().requires_grad_()
        out, _ = attention(qq, k, v, impl, bias=bb, sinks=ss, path=path, **kw)
        out.pow(2).sum().backward()
        results.append((out.detach(), qq.grad, bb.grad, None if ss is None else ss.grad))
    return results


@pytest.mark.parametrize("impl", SCORE_PRESETS)
def test_every_normalizer_applies_modifiers_like_the_reference(impl):
    """Forward and the gradients of q, the bias and the sinks agree between the reference and the path the rule
    picks; the modifiers change the output (they are not ignored)."""
    q, k, v, bias, sinks, keep = _inputs(1)
    kw = dict(softcap=4.0, attention_mask=keep, causal=False, **_options(impl))
    if impl in FREE:
        with pytest.raises(ValueError, match="sink"):
            attention(q, k, v, impl, sinks=sinks, **kw)
        sinks = None
    results = _outputs_and_grads(q, k, v, impl, bias, sinks, ("reference", None), kw)
    for a, b in zip(*results):
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-7)
    plain, _ = attention(q, k, v, impl, **kw)
    assert not torch.allclose(plain, results[0][0])
    assert results[0][2].abs().sum() > 0
    assert sinks is None or results[0][3].abs().sum() > 0


def test_fast_paths_decline_sinks_with_the_reason():
    """The fused kernels take soft-cap, bias and ALiBi (below) but not sinks: declared in explain, and named."""
    q, k, v, bias, sinks, keep = _inputs()
    call = make_call(q, k, v, resolve_settings("symax", {}), {"symax_eta": torch.ones(H, dtype=q.dtype)}, keep,
                     bias=bias, sinks=sinks)
    assert "chunked" in candidate_paths(call)
    for path in ("fused_cpu", "triton"):
        with pytest.raises(ValueError, match="attention sinks"):
            attend(call, path)
    assert "does not apply attention sinks (s_aux)" in dict(explain(call))["fused_cpu"]
    _, _, ran = attend(call)
    assert ran == "chunked"


def test_float_mask_with_bias_equals_bias_and_bool_mask():
    q, k, v, bias, _, keep = _inputs(2)
    additive = torch.where(keep, bias.expand(B, H, LQ, LK), torch.finfo(q.dtype).min)
    for impl in ("softmax", "symax", "entmax15"):
        a, _ = attention(q, k, v, impl, attention_mask=additive)
        b, _ = attention(q, k, v, impl, attention_mask=keep, bias=bias)
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_alibi_equals_bloom_eager_for_softmax():
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    q, k, v, _, _, _ = _inputs(3)
    mask = torch.ones(B, LK, dtype=torch.long)
    alibi = build_alibi_tensor(mask, H, torch.float64).view(B, H, 1, LK)  # BLOOM: m_h * j
    slopes = alibi[0, :, 0, 1]  # m_h
    causal = torch.ones(LQ, LK, dtype=torch.bool).tril()
    ref = _eager(q, k, v, causal, bias=alibi)
    for path in ("reference", "chunked", "sdpa"):
        out, _ = attention(q, k, v, "softmax", causal=True, alibi_slopes=slopes, path=path)
        torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    out, _ = attention(q, k, v, "symax", causal=True, alibi_slopes=slopes)  # every other normalizer runs
    assert torch.isfinite(out).all()
    # softmax gets the materialised bias; a fused map carries the slopes to the kernel, the other paths add them
    settings = resolve_settings("symax", {})
    call = make_call(q, k, v, settings, constant_heads(settings, H), None, True, alibi_slopes=slopes)
    assert call.alibi_slopes is not None and call.bias is None
    torch.testing.assert_close(call.score_bias(), -slopes.view(1, H, 1, 1) * (torch.arange(LQ)[:, None]
                                                                              - torch.arange(LK)).abs())
    for path in ("chunked", "reference"):
        torch.testing.assert_close(attention(q, k, v, "symax", causal=True, alibi_slopes=slopes, path=path)[0],
                                   attention(q, k, v, "symax", causal=True, bias=call.score_bias(), path=path)[0])
    soft = make_call(q, k, v, resolve_settings("softmax", {}), {}, None, True, alibi_slopes=slopes)
    assert soft.alibi_slopes is None and soft.bias is not None


def test_bad_modifiers_are_errors():
    q, k, v, bias, sinks, _ = _inputs()
    with pytest.raises(ValueError, match="does not broadcast"):
        attention(q, k, v, "softmax", bias=torch.zeros(3, H, LQ, LK, dtype=q.dtype))
    with pytest.raises(ValueError, match="one logit per head"):
        attention(q, k, v, "softmax", sinks=torch.zeros(H + 1, dtype=q.dtype))
    with pytest.raises(ValueError, match="softcap must be a positive"):
        attention(q, k, v, "softmax", softcap=0.0)
    with pytest.raises(ValueError, match="no score matrix"):
        attention(q, k, v, "linear", bias=bias)


#: presets whose normalizer the one-query decode path implements
DECODE_PRESETS = [p for p in SCORE_PRESETS
                  if PATHS["decode"].takes(NORMALIZERS.get(resolve_settings(p, {}).normalizer)) is None]


def test_decode_presets_exist():
    assert DECODE_PRESETS, "no preset runs on the decode path: the test below would check nothing"


@pytest.mark.parametrize("impl", DECODE_PRESETS)
def test_one_query_decode_path_applies_modifiers(impl):
    """A decode step (one query, GQA, soft-cap + bias + sinks) on the decode path equals the reference, forward and
    gradients; the rule picks that path for it, and explain() says so without running a kernel."""
    q, k, v, bias, sinks, keep = _inputs(2)
    q, keep, bias = q[:, :, -1:], keep[:, :, -1:], bias[:, :, -1:]
    k, v = k[:, :2], v[:, :2]  # GQA: 4 query heads over 2 kv heads
    sinks = None if impl in FREE else sinks
    alibi = 2.0 ** -torch.arange(1, H + 1, dtype=q.dtype)  # slopes (unmaterialised for the fused maps)
    kw = dict(softcap=3.0, attention_mask=keep, alibi_slopes=alibi, **_options(impl))
    results = _outputs_and_grads(q, k, v, impl, bias, sinks, ("reference", "decode"), kw)
    for a, b in zip(*results):
        if a is not None:
            torch.testing.assert_close(b, a, atol=1e-9, rtol=1e-7)
    settings = resolve_settings(impl, _options(impl))
    heads = constant_heads(settings, H, head_dim=q.shape[-1])
    call = make_call(q, k, v, settings, heads, keep, bias=bias, softcap=3.0, sinks=sinks, alibi_slopes=alibi)
    assert choose(call) == "decode"
    assert explain(call)[-1] == ("decode", "runs")


# ------------------------------------------------------------------ the fused C++ kernels with score modifiers

FUSED = declared_normalizers("fused_cpu")
FB, FH, FHKV, FD = 2, 4, 2, 8
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)  # powers of 2, as ALiBi's


def _bias(shape, seed=5):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _mod_cases(lq: int, lk: int) -> dict[str, dict]:
    """id -> attention keywords: a bias of every broadcast shape (with and without a gradient, one an expanded
    view), ALiBi, soft-cap, and all combined."""
    B, H = FB, FH
    return {
        "bias-1HQK-grad": dict(bias=_bias((1, H, lq, lk)), grad=True),
        "bias-B1QK": dict(bias=_bias((B, 1, lq, lk))),
        "bias-BHQK-grad": dict(bias=_bias((B, H, lq, lk)), grad=True),
        "bias-B11K-grad": dict(bias=_bias((B, 1, 1, lk)), grad=True),
        "bias-BHQ1-grad": dict(bias=_bias((B, H, lq, 1)), grad=True),
        "bias-expanded-grad": dict(bias=_bias((1, H, lq, lk)), grad=True, expand=True),
        "alibi": dict(alibi_slopes=SLOPES),
        "softcap": dict(softcap=2.0),
        "all": dict(bias=_bias((1, H, lq, lk)), grad=True, alibi_slopes=SLOPES, softcap=3.0),
    }


def _cache_keep(lq: int, lk: int) -> torch.Tensor:
    """Lower-right causal with left padding (2 keys in batch 1) and, in batch 0, a fully masked query row."""
    keep = (torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)).repeat(FB, 1, 1)
    keep[1, :, :2] = False
    if lq > 3:
        keep[0, 3] = False
    return keep[:, None]


#: id -> (Lq, Lk, attention keywords): padding + GQA at odd lengths, the causal flag, a one-query decode step
LAYOUTS = {
    "padding-gqa": (11, 13, lambda: dict(attention_mask=_cache_keep(11, 13))),
    "causal": (13, 13, lambda: dict(causal=True)),
    "decode": (1, 13, lambda: dict(attention_mask=_cache_keep(1, 13))),
}


def _fused_run(name, path, q, k, v, heads, mods, layout_kw, dtype):
    """(forced path output and gradients, the path that ran)."""
    settings = resolve_settings(name, {spec.learnable_option: True for spec in NORMALIZERS.get(name).params
                                       if spec.learnable_option})
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    hl = {n: t.to(dtype).requires_grad_() for n, t in heads.items()}
    bias = mods.get("bias")
    if bias is not None:
        bias = bias.to(dtype).requires_grad_(bool(mods.get("grad")))
        bl = bias.expand(FB, FH, *bias.shape[2:]) if mods.get("expand") else bias
    else:
        bl = None
    full = {**constant_heads(settings, FH, None, FD), **hl}
    call = make_call(*leaves, settings, full, bias=bl, softcap=mods.get("softcap"),
                     alibi_slopes=mods.get("alibi_slopes"), **layout_kw)
    out, _, ran = attend(call, path)
    tensors = [*leaves, *hl.values(), *([bias] if bias is not None and bias.requires_grad else [])]
    grads = torch.autograd.grad(out.pow(2).sum(), tensors)
    return [out.detach(), *grads], ran, call


@pytest.fixture
def small_fused_blocks(monkeypatch):
    if fused_cpu.unavailable_reason():
        pytest.skip(fused_cpu.unavailable_reason())
    monkeypatch.setattr(fused_cpu, "BLOCK_OVERRIDE", (4, 8))  # tiles cross edges at these odd lengths


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", FUSED)
def test_fused_cpu_applies_modifiers_like_the_reference(name, layout, small_fused_blocks):
    """fused_cpu (fp64) equals the reference, forward and the gradients of q, k, v, the learnable per-head values
    and the bias (in its own broadcast shape), for every modifier case; fully masked rows give exactly 0; the
    fused path ran (forced, and chosen by the automatic rule where no one-query path comes first)."""
    lq, lk, make = LAYOUTS[layout]
    g = torch.Generator().manual_seed(11)
    q = torch.randn(FB, FH, lq, FD, generator=g, dtype=torch.float64) * 1.5
    k, v = (torch.randn(FB, FHKV, lk, FD, generator=g, dtype=torch.float64) for _ in range(2))
    settings = resolve_settings(name, {spec.learnable_option: True for spec in NORMALIZERS.get(name).params
                                       if spec.learnable_option})
    heads = {s.name: s.initial(FH, settings, FD).double() + 0.3 * torch.arange(FH, dtype=torch.float64).view(
        -1, *[1] * (s.initial(FH, settings, FD).dim() - 1)) for s in NORMALIZERS.get(name).params
        if s.is_learnable(settings)}
    for cid, mods in _mod_cases(lq, lk).items():
        ref, _, _ = _fused_run(name, "reference", q, k, v, heads, mods, make(), torch.float64)
        got, ran, call = _fused_run(name, "fused_cpu", q, k, v, heads, mods, make(), torch.float64)
        assert ran == "fused_cpu"
        if lq > 1:
            assert choose(call) == "fused_cpu", (cid, explain(call))
        assert len(got) == len(ref) == 4 + len(heads) + (1 if mods.get("grad") else 0)
        for i, (a, b) in enumerate(zip(got, ref)):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8, msg=lambda m, i=i, cid=cid: f"{cid}[{i}]: {m}")
        if layout == "padding-gqa":
            assert (got[0][0, :, 3] == 0).all(), cid


@pytest.mark.parametrize("name", FUSED)
def test_fused_cpu_modifiers_without_a_backward_pass(name, small_fused_blocks):
    """Under torch.no_grad the threshold maps skip their backward-only output U (need_u): with every modifier the
    forward still equals the reference, and the fused path ran."""
    lq, lk, make = LAYOUTS["padding-gqa"]
    g = torch.Generator().manual_seed(7)
    q = torch.randn(FB, FH, lq, FD, generator=g, dtype=torch.float64) * 1.5
    k, v = (torch.randn(FB, FHKV, lk, FD, generator=g, dtype=torch.float64) for _ in range(2))
    settings = resolve_settings(name)
    heads = constant_heads(settings, FH, None, FD)
    for cid, mods in _mod_cases(lq, lk).items():
        kw = dict(bias=mods.get("bias"), softcap=mods.get("softcap"), alibi_slopes=mods.get("alibi_slopes"), **make())
        ref, _, _ = attend(make_call(q, k, v, settings, heads, **kw), "reference")
        with torch.no_grad():
            got, _, ran = attend(make_call(q, k, v, settings, heads, **kw), "fused_cpu")
        assert ran == "fused_cpu"
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-8, msg=lambda m, cid=cid: f"{cid}: {m}")
        assert (got[0, :, 3] == 0).all(), cid


def test_fused_cpu_modifiers_in_fp32_and_the_key_block_split(small_fused_blocks):
    """fp32 (the vectorised tanh) against the fp64 reference, with 3 threads on 4 (batch, kv head) items, so the
    backward splits work by key blocks and dbias updates of different items meet (locked)."""
    lq, lk, make = LAYOUTS["padding-gqa"]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(FB, FH, lq, FD, generator=g, dtype=torch.float64) * 3
    k, v = (torch.randn(FB, FHKV, lk, FD, generator=g, dtype=torch.float64) for _ in range(2))
    mods = _mod_cases(lq, lk)["all"]
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for name in ("symax", "entmax15"):
            ref, _, _ = _fused_run(name, "reference", q, k, v, {}, mods, make(), torch.float64)
            got, ran, _ = _fused_run(name, "fused_cpu", q, k, v, {}, mods, make(), torch.float32)
            assert ran == "fused_cpu"
            for a, b in zip(got, ref):
                torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-4)
    finally:
        torch.set_num_threads(threads)


def test_fused_bias_is_never_expanded():
    """An expanded bias view comes back to its own size before the cast (no B x H x Lq x Lk copy)."""
    from hf_attnorm.kernels.base import compact_bias

    small = torch.randn(1, 4, 1, 64, dtype=torch.float64)
    c = compact_bias(small.expand(8, 4, 32, 64), torch.float32)
    assert c.shape == (1, 4, 1, 64) and c.dtype == torch.float32


def test_float_mask_bias_runs_fused():
    """A float mask (even one holding only 0 / finfo.min) gives a bias tensor (deciding that it is all zero would
    read it on the host): the fused path takes it and equals the bool mask."""
    if fused_cpu.unavailable_reason():
        pytest.skip(fused_cpu.unavailable_reason())
    q, k, v, _, _, keep = _inputs(4)
    additive = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, torch.finfo(q.dtype).min)
    settings = resolve_settings("symax", {})
    call = make_call(q, k, v, settings, constant_heads(settings, H), additive)
    out, _, ran = attend(call)
    assert ran == "fused_cpu" and call.bias is not None
    torch.testing.assert_close(out, attention(q, k, v, "symax", attention_mask=keep, path="reference")[0])
