"""power and softplus / LSSA: references against independent transcriptions, squared as power with
p = 2, the gradient with respect to p, option validation, and the fused maps (the generic matrix in test_kernels /
test_triton compares every path with the reference, including d power_p)."""

from __future__ import annotations

import math

import pytest
import torch

from hf_attnorm.attention import attention, make_call
from hf_attnorm.kernels import attend
from hf_attnorm.kernels.fused import cpu as fused_cpu
from hf_attnorm.registry import AttnormError
from hf_attnorm.settings import resolve_settings

B, H, L, D = 2, 3, 23, 8


def _qkv(seed: int = 0, scale: float = 1.0, lq: int = L, lk: int = L):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, lq, D, generator=g, dtype=torch.float64) * scale
    k = torch.randn(B, H, lk, D, generator=g, dtype=torch.float64) * scale
    v = torch.randn(B, H, lk, D, generator=g, dtype=torch.float64)
    return q, k, v


def _causal_keep(lq: int, lk: int) -> torch.Tensor:
    return torch.ones(lq, lk, dtype=torch.bool).tril()


def _transcribe(q, k, v, f, keep, mult=None):
    """sum_j f(s_ij) v_j / sum_j f(s_ij) written out per row with Python loops over the visible keys, s = q.k/sqrt(D)
    (x mult[i])."""
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for i in range(q.shape[2]):
                js = [j for j in range(k.shape[2]) if keep[i, j]]
                c = 1.0 / math.sqrt(q.shape[-1]) * (1.0 if mult is None else float(mult[i]))
                w = [f(float(q[b, h, i] @ k[b, h, j]) * c) for j in js]
                den = sum(w)
                if den > 0:
                    out[b, h, i] = sum(wj * v[b, h, j] for wj, j in zip(w, js)) / den
    return out


@pytest.mark.parametrize("p", [1.0, 1.5, 2.0, 3.7])
def test_power_reference_is_the_formula(p):
    q, k, v = _qkv(1)
    out, _ = attention(q, k, v, "power", causal=True, power_p=p, path="reference")
    pf = float(torch.tensor(p, dtype=torch.float32))  # per-head values are stored in fp32
    want = _transcribe(q, k, v, lambda s: abs(s) ** pf, _causal_keep(L, L))
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)


def test_power_rows_of_zeros_give_zero_and_huge_scores_do_not_overflow():
    q, k, v = _qkv(2)
    q[:, :, 5] = 0.0  # row 5: every score 0
    for path in ("reference", "fused_cpu"):
        out, _ = attention(q, k, v, "power", causal=True, power_p=3.0, path=path)
        assert (out[:, :, 5] == 0).all(), path
    # |s|^p far beyond fp32 (and fp64) range: weights are computed relative to the row's largest p ln|s|
    qb, kb, vb = (t.float() for t in _qkv(3, scale=30.0))
    for path in ("reference", "fused_cpu"):
        out, _ = attention(qb, kb, vb, "power", causal=True, power_p=40.0, path=path)
        assert torch.isfinite(out).all(), path
    ref, _ = attention(qb.double(), kb.double(), vb.double(), "power", causal=True, power_p=40.0, path="reference")
    fast, _ = attention(qb, kb, vb, "power", causal=True, power_p=40.0, path="fused_cpu")
    torch.testing.assert_close(fast.double(), ref, atol=2e-4, rtol=0)


@pytest.mark.parametrize("path", ["reference", "chunked", "fused_cpu"])
def test_squared_is_power_with_p_2(path):
    """Values and every gradient of the registered ``squared`` equal those of ``power`` at p = 2 (a constant)."""
    q, k, v = _qkv(4)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, :4] = False
    res = []
    for impl, opts in (("squared", {}), ("power", {"power_p": 2.0, "power_learnable": False})):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        settings = resolve_settings(impl, opts)
        heads = {"power_p": torch.full((H,), 2.0, dtype=torch.float64)} if impl == "power" else {}
        call = make_call(*leaves, settings, heads, mask, True, None)
        out, _, used = attend(call, path)
        assert used == path
        grads = torch.autograd.grad(out.pow(2).sum(), leaves)
        res.append((out, *grads))
    for a, b in zip(*res):  # (single-key rows: both give 0 up to rounding noise, which differs)
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("path", ["reference", "fused_cpu"])
def test_power_gradient_wrt_p(path):
    """d out / d p_h against central finite differences (fp64), with zero scores (|s|^p ln|s| -> 0 there) and a
    single-key row (weights constant: gradient 0)."""
    q, k, v = _qkv(5)
    k[:, :, 3] = 0.0  # key 3 scores 0 against every query
    p0 = torch.tensor([1.0, 1.7, 2.9], dtype=torch.float64)
    gout = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    settings = resolve_settings("power")

    def loss(p):
        call = make_call(q, k, v, settings, {"power_p": p}, None, True, None)
        out, _, used = attend(call, path)
        assert used == path
        return (out * gout).sum()

    p = p0.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(loss(p), [p])
    eps = 1e-6
    fd = torch.stack([(loss(p0 + eps * e) - loss(p0 - eps * e)) / (2 * eps) for e in torch.eye(H, dtype=p0.dtype)])
    # p = 1 sits on the clamp's kink (max(p, 1)): compare the one-sided derivative from above there
    fd[0] = (loss(p0 + eps * torch.eye(H, dtype=p0.dtype)[0]) - loss(p0)) / eps
    torch.testing.assert_close(grad, fd, atol=1e-5, rtol=1e-5)
    assert grad.abs().min() > 0


def test_power_option_validation_at_set_time():
    with pytest.raises(AttnormError, match=r"power_p.*must be >= 1"):
        resolve_settings("power", {"power_p": 0.5})


def test_learned_p_below_one_acts_as_one():
    q, k, v = _qkv(6)
    low, _ = attention(q, k, v, "power", causal=True, heads={"power_p": torch.full((H,), 0.4, dtype=torch.float64)})
    one, _ = attention(q, k, v, "power", causal=True, heads={"power_p": torch.ones(H, dtype=torch.float64)})
    torch.testing.assert_close(low, one, atol=1e-12, rtol=0)


def test_softplus_reference_is_the_formula():
    q, k, v = _qkv(7, scale=2.0)
    out, _ = attention(q, k, v, "softplus", causal=True, path="reference")
    want = _transcribe(q, k, v, lambda s: math.log1p(math.exp(s)), _causal_keep(L, L))
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)


def test_lssa_is_softplus_with_the_length_scale():
    """lssa = softplus(log_{L_train}(n) s) / sum: causal query i sees n = i + 1 keys."""
    q, k, v = _qkv(8)
    train = 8
    out, _ = attention(q, k, v, "lssa", causal=True, module_info={"max_positions": train}, path="reference")
    # (n and the scale are fp32, as in every call: the transcription uses the same rounded factors)
    mult = (torch.log(torch.arange(1, L + 1, dtype=torch.float32)) / math.log(train)).tolist()
    want = _transcribe(q, k, v, lambda s: math.log1p(math.exp(s)), _causal_keep(L, L), mult)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    fast, _ = attention(q, k, v, "lssa", causal=True, module_info={"max_positions": train}, path="fused_cpu")
    torch.testing.assert_close(fast, want, atol=1e-12, rtol=1e-10)
    opt, _ = attention(q, k, v, "lssa", causal=True, train_length=train, path="fused_cpu")
    torch.testing.assert_close(opt, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softplus_very_negative_rows_keep_their_weights(dtype):
    """Scores around -300: softplus underflows (fp32 and fp64) but the weights, then ~ softmax(s), do not."""
    q, k, v = (t.to(dtype) for t in _qkv(9))
    q = torch.cat([q, torch.ones_like(q[..., :1])], -1)
    k = torch.cat([k, torch.full_like(k[..., :1], -300.0 * math.sqrt(D + 1))], -1)
    v = torch.cat([v, v[..., :1]], -1)
    want = torch.softmax((q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D + 1), -1) @ v.double()
    for path in ("reference", "fused_cpu"):
        out, _ = attention(q, k, v, "softplus", path=path)
        torch.testing.assert_close(out.double(), want, atol=1e-5 if dtype == torch.float32 else 1e-10, rtol=0)


def test_fused_maps_run_natively():
    if fused_cpu.unavailable_reason():
        pytest.skip(fused_cpu.unavailable_reason())
    q, k, v = _qkv(10)
    for impl in ("power", "softplus", "lssa"):
        call = make_call(q, k, v, resolve_settings(impl), {"power_p": torch.full((H,), 2.5, dtype=torch.float64)}
                         if impl == "power" else {}, None, True, None, module_info={"max_positions": 8})
        assert attend(call)[2] == "fused_cpu", impl


def _sp(s: float) -> float:
    """softplus(s) = ln(1 + e^s), written out (no torch)."""
    return max(s, 0.0) + math.log1p(math.exp(-abs(s)))


def _sigmoid(s: float) -> float:
    return 1.0 / (1.0 + math.exp(-s)) if s >= 0 else math.exp(s) / (1.0 + math.exp(s))


# scores placed where an op with a kink may sit on the gradient path: the row max of rows whose every visible score
# is negative (there s - c = 0 for the shift c = min(0, row max)), exact zeros (|s| and max(s, 0) kinks), scores
# beyond F.softplus's linear threshold (20), very negative rows (the kernels' slow form below -650), masked keys
# above the visible max, and a row with one visible key
_SP_ROWS = [
    [-0.3, -1.2, -2.5, -0.7, -4.0, -0.31, -9.0, -1.0],
    [0.0, -1.0, 0.5, 2.0, -0.25, 0.0, 1.5, -3.0],
    [25.0, 21.0, 19.5, -3.0, 0.0, 40.0, 20.0, 3.0],
    [-700.0, -701.5, -700.25, -702.0, -703.0, -700.5, -701.0, -702.5],
    [-2.0, 3.0, -0.5, 1.0, -1.5, 4.0, -0.75, 2.0],
    [0.0, -0.5, -1.0, -1.5, -2.0, -2.5, -3.0, -3.5],
    [-0.6, -5.0, -0.2, -3.0, -1.0, -7.0, -0.4, -2.0],
]
_SP_KEEP_OFF = {4: (1, 3, 5, 7), 6: (0, 1, 3, 4, 5, 6, 7)}  # row 4: the positive keys masked; row 6: one key left


@pytest.mark.parametrize("path", ["reference", "chunked", "fused_cpu"])
def test_softplus_gradient_is_the_formula_at_kinks(path):
    """Forward and every gradient in fp64 against a transcription: w_i = sp(s_i) / S, S = sum_j sp(s_j), and
    dL/ds_i = (g_i - sum_j g_j w_j) sigmoid(s_i) / S (g = dL/dw), at the points above. torch 2.14 passes no gradient
    through clamp(x, max=0) at x = 0 (2.13 passed 1): the reference, written with that clamp, then lost the
    e^(s - c) term of every negative row's max (dq off by 0.8 in test_kernels' L17 case)."""
    if path == "fused_cpu" and fused_cpu.unavailable_reason():
        pytest.skip(fused_cpu.unavailable_reason())
    lq, lk, dv = len(_SP_ROWS), len(_SP_ROWS[0]), 3
    s = torch.tensor(_SP_ROWS, dtype=torch.float64)
    keep = torch.ones(lq, lk, dtype=torch.bool)
    for i, off in _SP_KEEP_OFF.items():
        keep[i, list(off)] = False
    g = torch.Generator().manual_seed(11)
    v = torch.randn(1, 1, lk, dv, generator=g, dtype=torch.float64)
    gout = torch.randn(1, 1, lq, dv, generator=g, dtype=torch.float64)
    # q = s, k = identity, scaling 1: the scores are s exactly
    q = s.clone()[None, None].requires_grad_(True)
    k = torch.eye(lk, dtype=torch.float64)[None, None].requires_grad_(True)
    vl = v.clone().requires_grad_(True)
    out, _ = attention(q, k, vl, "softplus", attention_mask=keep[None, None], scaling=1.0, path=path)
    out.backward(gout)

    w_want = torch.zeros(lq, lk, dtype=torch.float64)
    ds_want = torch.zeros(lq, lk, dtype=torch.float64)
    gw = (gout[0, 0] @ v[0, 0].T).tolist()  # dL/dw_ij = gout_i . v_j
    for i, row in enumerate(_SP_ROWS):
        js = [j for j in range(lk) if keep[i, j]]
        den = sum(_sp(row[j]) for j in js)
        w = {j: _sp(row[j]) / den for j in js}
        delta = sum(gw[i][j] * w[j] for j in js)
        for j in js:
            w_want[i, j] = w[j]
            ds_want[i, j] = (gw[i][j] - delta) * _sigmoid(row[j]) / den
    torch.testing.assert_close(q.grad[0, 0], ds_want, atol=1e-13, rtol=1e-9)  # k = I: dq = dS
    torch.testing.assert_close(out[0, 0], w_want @ v[0, 0], atol=1e-13, rtol=1e-10)
    torch.testing.assert_close(vl.grad[0, 0], w_want.T @ gout[0, 0], atol=1e-13, rtol=1e-10)
    torch.testing.assert_close(k.grad[0, 0], ds_want.T @ s, atol=1e-11, rtol=1e-9)


def test_piecewise_maps_have_the_formulas_derivative_at_their_kinks():
    """elu+1 (linear's feature map), stablemax's g and power's max(p, 1) at their kinks: the derivative of the
    published formula's branch that holds there (1 in each case), independent of how torch defines clamp's gradient at
    its bound (it changed in torch 2.14)."""
    from hf_attnorm.normalizers.linear import elu_feature
    from hf_attnorm.normalizers.power import power_exponent
    from hf_attnorm.normalizers.stablemax import stablemax_g

    x = torch.tensor([-3.0, 0.0, 2.0], dtype=torch.float64, requires_grad=True)
    for fn, derivative in ((elu_feature, lambda t: torch.where(t > 0, 1.0, torch.exp(t))),
                           (stablemax_g, lambda t: torch.where(t >= 0, 1.0, 1 / (1 - t) ** 2))):
        (grad,) = torch.autograd.grad(fn(x).sum(), x)
        torch.testing.assert_close(grad, derivative(x.detach()), msg=fn.__name__)
    p = torch.tensor([0.5, 1.0, 2.5], dtype=torch.float64, requires_grad=True)
    ctx = type("Ctx", (), {"heads": {"power_p": p}})()
    (grad,) = torch.autograd.grad(power_exponent(ctx).sum(), p)
    assert grad.tolist() == [0.0, 1.0, 1.0]
