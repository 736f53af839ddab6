"""The sink rewrite on CUDA (``sdpa_rewrite._SinkCUDA``: SDPA's flash or efficient kernel, their log-sum-exp and an
exact rescale for the sink logit), checked without a GPU: the four CUDA ops it calls are replaced by PyTorch math of
the same contract (shapes, GQA, padded log-sum-exp, a backward that takes the given (out, lse), the efficient
kernel's bias alignment, all asserted), and the result is compared with the float64 reference, forward and every
gradient (q, k, v, the learned sink logit). The ops' real schemas are checked against the arguments passed. The real
kernels run in tests/test_gpu.py on a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from hf_attnorm.attention import constant_heads, make_call
from hf_attnorm.kernels import attend
from hf_attnorm.kernels import sdpa_rewrite as sr
from hf_attnorm.kernels.base import repeat_kv
from hf_attnorm.settings import resolve_settings

#: the arguments each op is called with, by position, as its schema names them
CALLED = {
    "flash": ["query", "key", "value", "dropout_p", "is_causal", "return_debug_mask"],
    "flash_backward": ["grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q",
                       "max_k", "dropout_p", "is_causal", "philox_seed", "philox_offset"],
    "efficient": ["query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal"],
    "efficient_backward": ["grad_out_", "query", "key", "value", "attn_bias", "out", "logsumexp", "philox_seed",
                           "philox_offset", "dropout_p", "grad_input_mask", "is_causal"],
}
#: the outputs used, by position
RETURNS = {"flash": 9, "flash_backward": 3, "efficient": 4, "efficient_backward": 4}


@pytest.mark.parametrize("name", list(CALLED))
def test_the_cuda_ops_take_the_arguments_as_passed(name):
    schema = sr.CUDA_OPS[name].default._schema
    positional = [a.name for a in schema.arguments if not a.kwarg_only]
    assert positional[:len(CALLED[name])] == CALLED[name], schema
    assert "scale" in [a.name for a in schema.arguments if a.kwarg_only], schema
    assert len(schema.returns) == RETURNS[name], schema


def _scores(q, k, scale, causal, bias):
    s = q.double() @ repeat_kv(k, q.shape[1] // k.shape[1]).double().transpose(-1, -2) * scale
    if causal:  # the flash kernel's causal mask is aligned to the last key
        Lq, Lk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq), -math.inf)
    if bias is not None:
        s = s + bias.double()
    return s


def _grads(dout, q, k, v, out, lse, scale, causal, bias):
    """The backward both kernels compute from the given (out, lse): P = e^(s - lse), delta = dO . out."""
    H, Hkv = q.shape[1], k.shape[1]
    s = _scores(q, k, scale, causal, bias)
    p = torch.exp(s - lse.double()[..., None])
    dp = dout.double() @ repeat_kv(v, H // Hkv).double().transpose(-1, -2)
    ds = p * (dp - (dout.double() * out.double()).sum(-1, keepdim=True))
    dq = ds @ repeat_kv(k, H // Hkv).double() * scale
    dk = ds.transpose(-1, -2) @ q.double() * scale
    dv = p.transpose(-1, -2) @ dout.double()
    if Hkv != H:
        dk, dv = (t.unflatten(1, (Hkv, -1)).sum(2) for t in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _flash(q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
    assert dropout_p == 0.0 and not return_debug_mask and q.shape[-1] % 8 == 0
    assert all(t.stride(-1) == 1 for t in (q, k, v)) and q.shape[1] % k.shape[1] == 0  # (GQA natively)
    s = _scores(q, k, scale, is_causal, None)
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ repeat_kv(v, q.shape[1] // k.shape[1]).double()
    empty = torch.empty(0)
    return out.to(q.dtype), lse.float(), empty, empty, q.shape[2], k.shape[2], empty, empty, empty


def _flash_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *,
                    scale):
    assert lse.shape == q.shape[:3] and dout.stride(-1) == 1 and (max_q, max_k) == (q.shape[2], k.shape[2])
    return _grads(dout, q, k, v, out, lse, scale, is_causal, None)


def _efficient(q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, *, scale):
    B, H, Lq, _ = q.shape
    assert compute_log_sumexp and dropout_p == 0.0 and not is_causal
    assert k.shape[1] == H, "the efficient kernel takes as many key/value heads as query heads"
    assert attn_bias.shape == (B, H, Lq, k.shape[2]) and attn_bias.dtype == q.dtype
    assert attn_bias.stride(-1) == 1 and attn_bias.stride(-2) % 16 == 0, "unaligned bias rows"
    s = _scores(q, k, scale, False, attn_bias)
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ v.double()
    padded = torch.full((B, H, -(-Lq // 32) * 32), math.inf)  # (padded to 32 rows; the padding is garbage)
    padded[..., :Lq] = lse
    return out.to(q.dtype), padded, torch.empty(0), torch.empty(0)


def _efficient_backward(dout, q, k, v, attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal, *,
                        scale):
    assert list(grad_input_mask) == [True, True, True, False] and lse.shape[-1] % 32 == 0
    dq, dk, dv = _grads(dout, q, k, v, out, lse[..., :q.shape[2]], scale, False, attn_bias)
    return dq, dk, dv, torch.empty(0)


@pytest.fixture
def math_ops(monkeypatch):
    for name, fn in (("flash", _flash), ("flash_backward", _flash_backward), ("efficient", _efficient),
                     ("efficient_backward", _efficient_backward)):
        monkeypatch.setitem(sr.CUDA_OPS, name, fn)


def _padding(B, Lq, Lk):
    keep = torch.ones(B, 1, Lq, Lk, dtype=torch.bool).tril(Lk - Lq)
    keep[0, :, :, :4] = False  # left padding: query rows 0-3 see no key
    keep[0, :, :4] = False
    return keep


#: id -> (B, H, Hkv, Lq, Lk, the kernel, make_call kwargs)
CASES = {
    "flash-causal-gqa": (2, 4, 2, 21, 21, "flash", lambda: {"causal": True}),
    "flash-bidirectional": (1, 2, 2, 9, 21, "flash", lambda: {}),
    "efficient-padding-dead-rows": (2, 2, 2, 13, 19, "efficient", lambda: {"attention_mask": _padding(2, 13, 19)}),
    "efficient-causal-Lq<Lk-gqa": (1, 4, 2, 9, 21, "efficient", lambda: {"causal": True}),
    "efficient-bias": (2, 2, 1, 11, 11, "efficient", lambda: {
        "causal": True, "bias": torch.randn(1, 2, 11, 11, generator=torch.Generator().manual_seed(5))}),
}


@pytest.mark.parametrize("impl", ["sink", "softmax1"])
@pytest.mark.parametrize("case", list(CASES))
def test_sink_on_the_cuda_kernels_matches_the_reference(impl, case, math_ops):
    B, H, Hkv, Lq, Lk, backend, make_kwargs = CASES[case]
    settings = resolve_settings(impl)
    g = torch.Generator().manual_seed(0)
    q64 = torch.randn(B, H, Lq, 16, generator=g, dtype=torch.float64) * 1.5
    k64, v64 = (torch.randn(B, Hkv, Lk, 16, generator=g, dtype=torch.float64) for _ in range(2))
    up = torch.randn(B, H, Lq, 16, generator=g, dtype=torch.float64)
    learned = {"sink_logit": torch.linspace(-1.0, 1.5, H, dtype=torch.float64)} if impl == "sink" else {}

    def run(dtype, fn):
        leaves = {n: t.to(dtype).requires_grad_(True) for n, t in (("q", q64), ("k", k64), ("v", v64))}
        heads = {**constant_heads(settings, H, head_dim=16),
                 **{n: t.to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_(True)
                    for n, t in learned.items()}}
        call = make_call(leaves["q"], leaves["k"], leaves["v"], settings, heads, **make_kwargs())
        out = fn(call)
        tensors = [*leaves.values(), *(heads[n] for n in learned)]
        grads = torch.autograd.grad((out * up.to(dtype)).sum(), tensors)
        return [out.detach(), *grads], call

    want, _ = run(torch.float64, lambda call: attend(call, "reference")[0])
    got, call = run(torch.float32, lambda call: sr._sink_cuda(call, backend))
    for name, a, b in zip(["out", "dq", "dk", "dv", "dsink"], got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-4, msg=lambda m, n=name: f"{case}: {n}: {m}")
    if "attention_mask" in make_kwargs():  # rows that see no key: exactly 0
        assert (got[0][0, :, :4] == 0).all()


def test_the_rule_picks_the_kernel_from_shapes_and_flags():
    """sink_backend reads the device, dtype, head dims, lengths and flags of the call (no tensor values)."""
    settings = resolve_settings("sink")
    heads = constant_heads(settings, 2, head_dim=64)
    cases = [(dict(dtype=torch.bfloat16, causal=True), "flash"), (dict(dtype=torch.float16), "flash"),
             (dict(dtype=torch.float32, causal=True), "efficient"),
             (dict(dtype=torch.bfloat16, causal=True, lq=4, lk=8), "efficient"),
             (dict(dtype=torch.bfloat16, mask=True), "efficient"),
             (dict(dtype=torch.bfloat16, d=60), None), (dict(dtype=torch.bfloat16, d=512), None),
             (dict(dtype=torch.bfloat16, dropout=0.1), None), (dict(dtype=torch.bfloat16, cpu=True), None)]
    for kw in cases:
        opts, want = kw
        d, lq, lk = opts.get("d", 64), opts.get("lq", 8), opts.get("lk", 8)
        q = torch.zeros(1, 2, lq, d, dtype=opts["dtype"])
        k = torch.zeros(1, 2, lk, d, dtype=opts["dtype"])
        mask = torch.ones(1, 1, lq, lk, dtype=torch.bool) if opts.get("mask") else None
        call = make_call(q, k, k, settings, heads, mask, opts.get("causal", False), dropout=opts.get("dropout", 0.0))
        if not opts.get("cpu"):
            call.q = _CudaShape(q)
        assert sr.sink_backend(call) == want, (opts, sr.sink_backend(call))


class _CudaShape:
    """What sink_backend reads of q (shape, dtype, device), with the device CUDA: no GPU needed."""

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.dtype, self.device = t.shape, t.dtype, torch.device("cuda")
