"""Selective attention (Leviathan et al., arXiv 2410.02703): the reference against a transcription of the paper's code
listing, the blocked ``selective`` path against the reference (forward and every gradient), padding, the choices
documented in ``hf_attnorm/normalizers/selective.py``, and the refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import mask_of_kind, tiny

from hf_attnorm.attention import attention, constant_heads, make_call
from hf_attnorm.kernels import attend, explain
from hf_attnorm.kernels.selective import blocked as selective_mod
from hf_attnorm.kernels.selective import cpu as selective_cpu
from hf_attnorm.normalizers.selective import selection_penalty
from hf_attnorm.registry import AttnormError
from hf_attnorm.settings import resolve_settings


def paper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head: int = 0) -> torch.Tensor:
    """The paper's listing, transcribed (causal, no padding, Lq = Lk, one head selects): q, k, v [B, H, n, D]."""
    n, d = q.shape[2], q.shape[3]
    logits = q @ k.transpose(-1, -2) / d**0.5
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    logits = logits.masked_fill(~causal, float("-inf"))
    s = F.relu(logits[:, head])  # only positive selection
    s = s.clone()
    s[..., 0] = 0  # do not mask <BOS>
    s = (1 - torch.eye(n, dtype=s.dtype)) * s  # do not mask self
    s = torch.roll(s, 1, -2)  # mask strictly in the future
    s[..., 0, :] = 0
    penalty = torch.cumsum(s, -2)
    return torch.softmax(logits - penalty[:, None], -1) @ v


def _leaves(*shape_sets, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=dtype).requires_grad_(True) for s in shape_sets]


@pytest.mark.parametrize("head", [0, 2])
def test_reference_equals_the_paper_listing_forward_and_gradients(head):
    q, k, v = _leaves((2, 3, 11, 8), (2, 3, 11, 8), (2, 3, 11, 8))
    gout = torch.randn(2, 3, 11, 8, dtype=torch.float64)
    ours, _ = attention(q, k, v, "selective", causal=True, path="reference", selective_head=head)
    g_ours = torch.autograd.grad(ours, (q, k, v), gout)
    ref = paper(q, k, v, head)
    g_ref = torch.autograd.grad(ref, (q, k, v), gout)
    torch.testing.assert_close(ours, ref, atol=1e-12, rtol=0)
    for a, b in zip(g_ours, g_ref):  # the gradient flows through the penalty, as in the paper's listing
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    plain, _ = attention(q, k, v, "softmax", causal=True)
    assert not torch.allclose(ours, plain), "the penalty must change the output"


@pytest.mark.parametrize("path", ["selective", pytest.param("selective_cpu", marks=pytest.mark.skipif(
    selective_cpu.NATIVE.unavailable_reason() is not None, reason="selective CPU kernels unavailable"))])
def test_gradient_flows_through_the_penalty(path):
    """With F detached the selecting head's q gets another gradient: the path differentiates through F."""
    q, k, v = _leaves((1, 2, 9, 4), (1, 2, 9, 4), (1, 2, 9, 4), seed=1)
    out, _ = attention(q, k, v, "selective", causal=True, path=path)
    (dq,) = torch.autograd.grad(out.pow(2).sum(), (q,))
    s = q @ k.transpose(-1, -2) / 2.0
    keep = torch.ones(9, 9, dtype=torch.bool).tril()
    pen = selection_penalty(s[:, 0].detach(), keep[None])
    w = torch.softmax(s.masked_fill(~keep, float("-inf")) - pen[:, None], -1)
    (dq_detached,) = torch.autograd.grad((w @ v).pow(2).sum(), (q,))
    torch.testing.assert_close(dq[:, 1], dq_detached[:, 1])  # head 1 does not select: same
    assert (dq[:, 0] - dq_detached[:, 0]).abs().max() > 1e-3


CASES = [  # (B, H, Hkv, Lq, Lk, causal, mask)
    (2, 4, 2, 37, 37, True, "none"),  # odd length, GQA
    (1, 2, 2, 29, 29, False, "none"),  # bidirectional
    (2, 2, 1, 41, 41, True, "padding"),
    (2, 2, 2, 33, 33, False, "padding"),
    (2, 3, 3, 21, 21, False, "heads"),
    (2, 2, 2, 9, 30, False, "none"),  # cross-attention shapes
    (2, 4, 2, 1, 17, True, "none"),  # one query
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES, ids=[f"c{i}" for i in range(len(CASES))])
def test_blocked_path_matches_reference(case, dtype, monkeypatch):
    B, H, Hkv, Lq, Lk, causal, kind = case
    monkeypatch.setattr(selective_mod, "BLOCK_OVERRIDE", 8)  # several blocks, so the carries are exercised
    q, k, v = _leaves((B, H, Lq, 16), (B, Hkv, Lk, 16), (B, Hkv, Lk, 16), seed=Lq)
    mask = mask_of_kind(kind, B, H, Lq, Lk, causal)
    gout = torch.randn(B, H, Lq, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    settings = resolve_settings("selective", {"selective_head": 1})
    res = {}
    for path, dt in (("exact", torch.float64), ("reference", dtype), ("selective", dtype)):
        leaves = [t.detach().to(dt).requires_grad_(True) for t in (q, k, v)]
        call = make_call(*leaves, settings, constant_heads(settings, H), mask, causal)
        out, _, ran = attend(call, "reference" if path == "exact" else path)
        assert ran == ("reference" if path == "exact" else path)
        grads = torch.autograd.grad(out, leaves, gout.to(dt))
        res[path] = [t.double() for t in (out, *grads)]
    for label, e, r, f in zip(("out", "dq", "dk", "dv"), res["exact"], res["reference"], res["selective"]):
        err_ref, err_fast = (r - e).abs().max().item(), (f - e).abs().max().item()
        assert err_fast <= 5 * err_ref + 1e-5, f"{label}: {err_fast:.3g} vs reference {err_ref:.3g}"
    if mask is not None and mask.shape[1] == 1:
        dead = (~mask.any(-1)).expand(B, H, Lq)
        assert (res["selective"][0][dead] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_fp32(dtype):
    q, k, v = (t.detach() for t in _leaves((1, 2, 19, 8), (1, 2, 19, 8), (1, 2, 19, 8), dtype=torch.float32))
    ref, _ = attention(q, k, v, "selective", causal=True, path="reference")
    half, _ = attention(q.to(dtype), k.to(dtype), v.to(dtype), "selective", causal=True, path="selective")
    assert half.dtype == dtype
    torch.testing.assert_close(half.float(), ref, atol=3e-2, rtol=0)


def test_left_padding_equals_the_sequence_alone():
    """BOS is the first live key and padded positions neither select nor are selected."""
    q, k, v = (t.detach() for t in _leaves((1, 2, 12, 8), (1, 2, 12, 8), (1, 2, 12, 8), seed=4))
    keep = torch.ones(1, 1, 12, 12, dtype=torch.bool).tril()
    keep[..., :3] = False
    keep[:, :, :3] = False
    for path in ("reference", "selective"):
        padded, _ = attention(q, k, v, "selective", attention_mask=keep, path=path)
        alone, _ = attention(q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], "selective", causal=True, path=path)
        torch.testing.assert_close(padded[:, :, 3:], alone, atol=1e-6, rtol=0)


def _packed_keep(lengths: tuple[int, ...]) -> torch.Tensor:
    """bool [1, 1, L, L]: documents of these lengths packed in one row, causal within each (transformers' sdpa_mask
    for position_ids restarting per document)."""
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return ((doc[:, None] == doc[None, :]) & torch.ones(len(doc), len(doc), dtype=torch.bool).tril())[None, None]


@pytest.mark.parametrize("path", ["reference", "selective", pytest.param("selective_cpu", marks=pytest.mark.skipif(
    selective_cpu.NATIVE.unavailable_reason() is not None, reason="selective CPU kernels unavailable"))])
def test_packed_documents_equal_each_alone_forward_and_gradients(path, monkeypatch):
    """Every document's first key is a BOS (``document_starts``): with a block-diagonal mask each document gets the
    output and the gradients it gets alone (before: only the row's first key was exempt)."""
    monkeypatch.setattr(selective_mod, "BLOCK_OVERRIDE", 8)  # blocks straddle the documents' edges
    lengths = (7, 12, 5)
    q, k, v = _leaves((1, 3, 24, 8), (1, 3, 24, 8), (1, 3, 24, 8), seed=11)
    gout = torch.randn(1, 3, 24, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    call = make_call(q, k, v, resolve_settings("selective", {"selective_head": 1}),
                     constant_heads(resolve_settings("selective", {}), 3), _packed_keep(lengths), True)
    packed, _, ran = attend(call, path)
    assert ran == path
    grads = torch.autograd.grad(packed, (q, k, v), gout)
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        qs, ks, vs = (t[:, :, part].detach().requires_grad_(True) for t in (q, k, v))
        alone, _ = attention(qs, ks, vs, "selective", causal=True, path=path, selective_head=1)
        torch.testing.assert_close(packed[:, :, part], alone, atol=1e-10, rtol=0)
        for g, a in zip(grads, torch.autograd.grad(alone, (qs, ks, vs), gout[:, :, part])):
            torch.testing.assert_close(g[:, :, part], a, atol=1e-10, rtol=0)
        start += n


def test_the_rule_picks_a_selective_path_and_the_splitting_paths_decline():
    q = torch.randn(1, 2, 5, 4)
    settings = resolve_settings("selective")
    call = make_call(q, q, q, settings, {}, None, True)
    # the fused C++ path (test_selective_cpu.py) where the extension builds, else the blocked path
    expected = "selective_cpu" if selective_cpu.NATIVE.unavailable_reason() is None else "selective"
    assert explain(call)[-1] == (expected, "runs")
    with pytest.raises(ValueError, match="couples the queries"):
        attend(make_call(q[:, :, :1], q, q, settings, {}, None, True), "chunked")
    # one query has no other query in its call (earlier ones arrive as AttnCall.selective_carry): the one-query
    # paths take it (tests/test_selective_decode.py)
    one = make_call(q[:, :, -1:], q, q, settings, {}, None, True)
    assert explain(one)[0] == ("selective_step", "runs")
    for path in ("selective_step", "decode"):
        torch.testing.assert_close(attend(one, path)[0], attend(one, "reference")[0], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="score bias"):  # declines modifiers: the reference applies them
        attend(make_call(q, q, q, settings, {}, None, True, bias=torch.zeros(1, 1, 5, 5)), "selective")


def test_selecting_head_out_of_range_is_refused_at_load_time():
    with pytest.raises(AttnormError, match="selective_head"):
        tiny("llama", "causal_lm", implementation="selective", attnorm={"selective_head": 99})
    with pytest.raises(AttnormError, match="selective_head"):
        attention(*(torch.randn(1, 2, 3, 4) for _ in range(3)), "selective", selective_head=2)
