"""Score modifiers on the tensor API: soft-cap, additive bias (explicit, float mask, ALiBi) and attention sinks.

Every path that accepts a call with modifiers must equal a plain eager formula (softmax) and the reference
(every normalizer), forward and gradients (bias and sinks are learned in T5 and GPT-OSS); paths that cannot apply
them must decline with the reason.
"""

from __future__ import annotations

import pytest
import torch

from hf_attnorm.attention import attention, constant_heads, make_call
from hf_attnorm.kernels import PATHS, attend, candidate_paths, choose, explain
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
    results = []
    for path in ("reference", None):
        qq, bb = q.clone().requires_grad_(), bias.clone().requires_grad_()
        ss = None if sinks is None else sinks.clone().requires_grad_()
        out, _ = attention(qq, k, v, impl, bias=bb, sinks=ss, path=path, **kw)
        out.pow(2).sum().backward()
        results.append((out.detach(), qq.grad, bb.grad, None if ss is None else ss.grad))
    for a, b in zip(*results):
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-7)
    plain, _ = attention(q, k, v, impl, **kw)
    assert not torch.allclose(plain, results[0][0])
    assert results[0][2].abs().sum() > 0
    assert sinks is None or results[0][3].abs().sum() > 0


def test_fast_paths_decline_modifiers_with_the_reason():
    q, k, v, bias, sinks, keep = _inputs()
    call = make_call(q, k, v, resolve_settings("symax", {}), {"symax_eta": torch.ones(H, dtype=q.dtype)}, keep,
                     bias=bias)
    assert "chunked" in candidate_paths(call)
    for path in ("fused_cpu", "triton"):
        with pytest.raises(ValueError, match="score bias"):
            attend(call, path)
    # the decline is declared (explain runs no kernel), and named
    assert dict(explain(call))["fused_cpu"] == "this path does not apply a score bias"
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
    kw = dict(softcap=3.0, attention_mask=keep, **_options(impl))
    results = []
    for path in ("reference", "decode"):
        qq, bb = q.clone().requires_grad_(), bias.clone().requires_grad_()
        ss = None if sinks is None else sinks.clone().requires_grad_()
        out, _ = attention(qq, k, v, impl, bias=bb, sinks=ss, path=path, **kw)
        out.pow(2).sum().backward()
        results.append((out.detach(), qq.grad, bb.grad, None if ss is None else ss.grad))
    for a, b in zip(*results):
        if a is not None:
            torch.testing.assert_close(b, a, atol=1e-9, rtol=1e-7)
    settings = resolve_settings(impl, _options(impl))
    heads = constant_heads(settings, H, head_dim=q.shape[-1])
    call = make_call(q, k, v, settings, heads, keep, bias=bias, softcap=3.0, sinks=sinks)
    assert choose(call) == "decode"
    assert explain(call)[-1] == ("decode", "runs")
