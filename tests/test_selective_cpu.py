"""The fused C++ selective path (``selective_cpu``, kernels/selective/selective_cpu.cpp) against the reference
(normalizers/selective.py) and the blocked ``selective`` path: forward and every gradient, fp64 to 1e-10,
fp32/fp16/bf16, odd lengths, several query blocks and key tiles, padding (fully masked rows give zeros, no NaN),
causal and bidirectional, GQA, another selecting head, one-query calls, carried-in column sums
(``selective_carry``), and the calls it declines."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import mask_of_kind, needs_compile, needs_compile_inductor

from hf_attnorm.attention import attention, constant_heads, make_call
from hf_attnorm.kernels import attend, explain
from hf_attnorm.kernels.selective import cpu as cpu_mod
from hf_attnorm.normalizers.selective import selection_penalty
from hf_attnorm.settings import resolve_settings

pytestmark = pytest.mark.skipif(cpu_mod.NATIVE.unavailable_reason() is not None,
                                reason=f"selective CPU kernels unavailable: {cpu_mod.NATIVE.unavailable_reason()}")

PATH = "selective_cpu"


def _leaves(*shapes, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=dtype) for s in shapes]


def _run(path, q, k, v, settings, mask, causal, gout, dtype):
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    call = make_call(*leaves, settings, constant_heads(settings, q.shape[1]), mask, causal)
    out, _, ran = attend(call, path)
    assert ran == path
    grads = torch.autograd.grad(out, leaves, gout.to(dtype))
    return [t.double() for t in (out, *grads)]


CASES = [  # (B, H, Hkv, Lq, Lk, causal, mask)
    (2, 4, 2, 37, 37, True, "none"),  # odd length, GQA
    (1, 2, 2, 29, 29, False, "none"),  # bidirectional
    (2, 2, 1, 41, 41, True, "padding"),  # MQA, left padding with fully masked rows
    (2, 2, 2, 33, 33, False, "padding"),
    (2, 3, 3, 21, 21, False, "heads"),  # a different mask per head
    (2, 2, 2, 9, 30, False, "none"),  # fewer queries than keys
    (1, 2, 2, 30, 9, True, "none"),  # more queries than keys (upper-left causal)
    (2, 4, 2, 1, 17, True, "none"),  # one query (a decode step)
    (2, 4, 2, 1, 17, False, "padding"),  # one query with padding
]


@pytest.mark.parametrize("head", [0, 1])
@pytest.mark.parametrize("case", CASES, ids=[f"c{i}" for i in range(len(CASES))])
def test_matches_reference_in_fp64(case, head, monkeypatch):
    """Small blocks, so that the carries cross query blocks and the key tiles split the rows."""
    B, H, Hkv, Lq, Lk, causal, kind = case
    monkeypatch.setattr(cpu_mod, "BLOCK_OVERRIDE", (8, 8))
    q, k, v, gout = _leaves((B, H, Lq, 16), (B, Hkv, Lk, 16), (B, Hkv, Lk, 12), (B, H, Lq, 12), seed=Lq)
    mask = mask_of_kind(kind, B, H, Lq, Lk, causal)
    settings = resolve_settings("selective", {"selective_head": head})
    ref = _run("reference", q, k, v, settings, mask, causal, gout, torch.float64)
    fast = _run(PATH, q, k, v, settings, mask, causal, gout, torch.float64)
    for label, r, f in zip(("out", "dq", "dk", "dv"), ref, fast):
        torch.testing.assert_close(f, r, atol=1e-10, rtol=1e-10, msg=lambda m, lb=label: f"{lb}: {m}")
    if mask is not None and mask.shape[1] == 1:  # fully masked rows: zeros
        dead = (~mask.any(-1)).expand(B, H, Lq)
        assert (fast[0][dead] == 0).all()


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]], ids=["causal", "padding", "heads"])
def test_fp32_matches_the_blocked_path(case, monkeypatch):
    """fp32 error against fp64 no larger than the reference's and the blocked path's own (with a margin)."""
    B, H, Hkv, Lq, Lk, causal, kind = case
    monkeypatch.setattr(cpu_mod, "BLOCK_OVERRIDE", (16, 8))
    q, k, v, gout = _leaves((B, H, Lq, 16), (B, Hkv, Lk, 16), (B, Hkv, Lk, 16), (B, H, Lq, 16), seed=2)
    mask = mask_of_kind(kind, B, H, Lq, Lk, causal)
    settings = resolve_settings("selective", {"selective_head": H - 1})
    exact = _run("reference", q, k, v, settings, mask, causal, gout, torch.float64)
    res = {p: _run(p, q, k, v, settings, mask, causal, gout, torch.float32) for p in ("reference", "selective", PATH)}
    for i, label in enumerate(("out", "dq", "dk", "dv")):
        base = max((res[p][i] - exact[i]).abs().max().item() for p in ("reference", "selective"))
        err = (res[PATH][i] - exact[i]).abs().max().item()
        assert err <= 5 * base + 1e-6, f"{label}: {err:.3g} vs {base:.3g}"


def test_several_default_blocks():
    """Default block sizes with a length spanning several query blocks and key tiles, with left padding."""
    B, H, Lq = 2, 3, 2 * cpu_mod.BLOCKS[0] + 37
    q, k, v, gout = _leaves((B, H, Lq, 8), (B, H, Lq, 8), (B, H, Lq, 8), (B, H, Lq, 8), seed=5)
    mask = torch.ones(B, 1, Lq, Lq, dtype=torch.bool).tril()
    mask[1, :, :, :50] = False
    mask[1, :, :50] = False
    settings = resolve_settings("selective", {"selective_head": 2})
    ref = _run("reference", q, k, v, settings, mask, False, gout, torch.float64)
    fast = _run(PATH, q, k, v, settings, mask, False, gout, torch.float64)
    for label, r, f in zip(("out", "dq", "dk", "dv"), ref, fast):
        torch.testing.assert_close(f, r, atol=1e-10, rtol=1e-10, msg=lambda m, lb=label: f"{lb}: {m}")


def test_fully_masked_rows_give_zeros_and_finite_gradients():
    q, k, v = (t.requires_grad_(True) for t in _leaves((2, 2, 6, 4), (2, 1, 6, 4), (2, 1, 6, 4), dtype=torch.float32))
    mask = torch.zeros(2, 1, 6, 6, dtype=torch.bool)
    mask[1, :, 3:, 2:] = True  # batch row 0: nothing visible; row 1: three fully masked queries
    out, _ = attention(q, k, v, "selective", attention_mask=mask, path=PATH)
    assert (out[0] == 0).all() and (out[1, :, :3] == 0).all() and (out[1, :, 3:] != 0).any()
    out.pow(2).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_fp32(dtype):
    q, k, v = _leaves((1, 2, 19, 8), (1, 2, 19, 8), (1, 2, 19, 8), dtype=torch.float32)
    ref, _ = attention(q, k, v, "selective", causal=True, path="reference")
    half, _ = attention(q.to(dtype), k.to(dtype), v.to(dtype), "selective", causal=True, path=PATH)
    assert half.dtype == dtype
    torch.testing.assert_close(half.float(), ref, atol=3e-2, rtol=0)


def test_left_padding_equals_the_sequence_alone(monkeypatch):
    """BOS is the first live key and padded positions neither select nor are selected."""
    monkeypatch.setattr(cpu_mod, "BLOCK_OVERRIDE", (4, 4))
    q, k, v = _leaves((1, 2, 12, 8), (1, 2, 12, 8), (1, 2, 12, 8), seed=4)
    keep = torch.ones(1, 1, 12, 12, dtype=torch.bool).tril()
    keep[..., :3] = False
    keep[:, :, :3] = False
    padded, _ = attention(q, k, v, "selective", attention_mask=keep, path=PATH)
    alone, _ = attention(q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], "selective", causal=True, path=PATH)
    torch.testing.assert_close(padded[:, :, 3:], alone, atol=1e-12, rtol=0)


def test_the_rule_picks_this_path_on_cpu():
    q = torch.randn(1, 2, 5, 4)
    call = make_call(q, q, q, resolve_settings("selective"), {}, None, True)
    assert explain(call)[-1] == (PATH, "runs")  # (the one-query paths before it decline several queries)
    assert attend(call)[2] == PATH


@pytest.mark.parametrize("mod", ["bias", "softcap", "sinks", "dropout", "carry"])
def test_declines_with_a_reason_and_the_rule_falls_back(mod):
    q = torch.randn(1, 2, 5, 4)
    settings = resolve_settings("selective")
    kw = {"bias": dict(bias=torch.zeros(1, 1, 5, 5)), "softcap": dict(softcap=5.0),
          "sinks": dict(sinks=torch.zeros(2)), "dropout": dict(dropout=0.1), "carry": {}}[mod]
    call = make_call(q, q, q, settings, {}, None, True, **kw)
    if mod == "carry":
        call.selective_carry = torch.zeros(1, 3)  # wrong key count
    why = dict(explain(call))[PATH]
    assert why != "runs" and {"bias": "score bias", "softcap": "softcap", "sinks": "sinks", "dropout": "dropout",
                              "carry": "selective_carry"}[mod] in why
    with pytest.raises(ValueError, match="cannot run this call"):
        attend(call, PATH)
    if mod == "carry":  # no path takes a carry of the wrong size: the next one names the error
        with pytest.raises(ValueError, match="selective_carry"):
            attend(call)
    else:
        assert attend(call)[2] != PATH


def _direct(q, k, v, carry, keep):
    """softmax(s - carry - F) with F from the call's own queries (normalizers/selective.py), every head."""
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    pen = selection_penalty(s[:, 0], keep[:, 0]) + carry[:, None, :]
    return torch.softmax(s.masked_fill(~keep, float("-inf")) - pen[:, None], -1) @ v


@pytest.mark.parametrize("blocks", [(4, 4), (64, 64)])
def test_carried_column_sums_continue_a_longer_call(blocks, monkeypatch):
    """With ``selective_carry`` = the column sums of relu(S) of the earlier queries, the last m queries give the
    tail of the full call's output, and every gradient (the carry's too) is that of softmax(s - carry - F)."""
    monkeypatch.setattr(cpu_mod, "BLOCK_OVERRIDE", blocks)
    n, m = 15, 6
    q, k, v, gout = _leaves((2, 2, n, 8), (2, 2, n, 8), (2, 2, n, 8), (2, 2, m, 8), seed=7)
    settings = resolve_settings("selective")
    full, _ = attention(q, k, v, settings, causal=True, path="reference")
    s = q @ k.transpose(-1, -2) / 8 ** 0.5
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    carry = selection_penalty(s[:, 0], causal[None])[:, n - m]  # F of query n - m: the sums over queries < n - m
    keep = causal[n - m:][None, None].expand(2, 1, m, n)
    leaves = [t[:, :, n - m:].clone() if i == 0 else t.clone() for i, t in enumerate((q, k, v))] + [carry.clone()]
    leaves = [t.requires_grad_(True) for t in leaves]
    call = make_call(*leaves[:3], settings, {}, keep, False)
    call.selective_carry = leaves[3]
    out, _, ran = attend(call)
    assert ran == PATH
    torch.testing.assert_close(out, full[:, :, n - m:], atol=1e-12, rtol=0)
    got = torch.autograd.grad(out, leaves, gout)
    want = torch.autograd.grad(_direct(*leaves, keep), leaves, gout)
    for label, a, b in zip(("dq", "dk", "dv", "dcarry"), got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=lambda msg, lb=label: f"{lb}: {msg}")
    assert got[3].abs().max() > 0


def test_deterministic_with_several_threads(monkeypatch):
    """Private dK/dV buffers per part, summed in a fixed order: two runs agree bit for bit."""
    monkeypatch.setattr(cpu_mod, "BLOCK_OVERRIDE", (8, 16))
    q, k, v = _leaves((1, 4, 70, 8), (1, 2, 70, 8), (1, 2, 70, 8), dtype=torch.float32, seed=8)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = []
        for _ in range(2):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out, _ = attention(*leaves, "selective", causal=True, path=PATH)
            runs.append([out, *torch.autograd.grad(F.silu(out).sum(), leaves)])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.slow
@needs_compile
@needs_compile_inductor
def test_compiles_with_fullgraph_forward_and_backward():
    """The ops' fake implementations let dynamo trace the path, backward included, with eager's results."""
    q, k, v = _leaves((1, 2, 11, 8), (1, 2, 11, 8), (1, 2, 11, 8), dtype=torch.float32, seed=6)
    mask = torch.ones(1, 1, 11, 11, dtype=torch.bool).tril()
    mask[..., :2] = False

    def fn(q_, k_, v_):
        return attention(q_, k_, v_, "selective", attention_mask=mask, path=PATH)[0]

    res = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = f(*leaves)
        res.append([out, *torch.autograd.grad(out.pow(2).sum(), leaves)])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_learnable_per_head_scale_reaches_its_gradient():
    """A per-row multiplier (ssmax's learnable s_h ln n) scales q before the kernel; a plain float scale is applied
    in the kernel's matmuls instead: both give the reference's output and gradients, the per-head value's too."""
    settings = resolve_settings("selective", {"scale": "ssmax"})
    heads = constant_heads(settings, 2)
    q, k, v = _leaves((1, 2, 13, 8), (1, 2, 13, 8), (1, 2, 13, 8), seed=3)
    res = []
    for path in ("reference", PATH):
        hl = {n: (t.double() * 1.3).requires_grad_(True) for n, t in heads.items()}
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, _, ran = attend(make_call(*leaves, settings, hl, None, True), path)
        assert ran == path
        res.append([out, *torch.autograd.grad(out.pow(2).sum(), leaves + list(hl.values()))])
    assert res[1][-1].abs().min() > 0
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(("batch", "threads"), [(1, 2), (1, 3), (3, 2)])
def test_private_dk_dv_parts_match_reference(batch, threads, monkeypatch):
    """With more threads than batch rows, or rows that do not divide over the threads, the backward splits each row's
    query blocks into parts with private dK/dV buffers (summed at the end): fp64 gradients equal the reference's."""
    monkeypatch.setattr(cpu_mod, "BLOCK_OVERRIDE", (8, 8))
    q, k, v, gout = _leaves((batch, 4, 45, 8), (batch, 2, 45, 8), (batch, 2, 45, 8), (batch, 4, 45, 8), seed=11)
    settings = resolve_settings("selective", {"selective_head": 3})
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fast = _run(PATH, q, k, v, settings, None, True, gout, torch.float64)
    finally:
        torch.set_num_threads(before)
    ref = _run("reference", q, k, v, settings, None, True, gout, torch.float64)
    for label, r, f in zip(("out", "dq", "dk", "dv"), ref, fast):
        torch.testing.assert_close(f, r, atol=1e-10, rtol=1e-10, msg=lambda m, lb=label: f"{lb}: {m}")
