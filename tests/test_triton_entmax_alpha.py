"""alpha-entmax (fused map 8) and ASEntmax on the Triton kernels, beyond the generic matrix of test_triton.py: the fp32
threshold search against an fp64 root, d alpha over a range of alphas (alpha > 2 included), the identities alpha = 1.5
-> entmax15 and alpha = 2 -> sparsemax on this path, and ASEntmax's per-head values (alpha, delta, gamma, w [H, D])
against the fp64 reference.

Run by Triton's interpreter in a child pytest process (TRITON_INTERPRET=1 must be set before triton is imported, see
test_triton.py); directly: ``TRITON_INTERPRET=1 python -m pytest tests/test_triton_entmax_alpha.py``.

Tolerances (fp32 inputs, compared with the reference path in float64; measured with the seeds below, 2 cores):
* tau: within 4 fp32 ulps of the row's score scale, |tau - tau64| <= 4 eps (1 + (alpha - 1) max|s|) (measured
  <= 3e-6 at max|s| ~ 25, <= 2e-7 on small scores), alpha from 1.001 to 4;
* every output and gradient: max error <= 2e-5 x the tensor's largest entry (measured <= 6e-6 for ASEntmax's delta,
  gamma, w and alpha over 4 seeds at batch 2, 0.1-4.2x the fp32 reference path's own error; <= 4e-6 for
  entmax_alpha), or no more than the fp32 reference path's own error: d alpha near alpha = 1 carries
  1/(alpha - 1)^2 (2500 at 1.02), there both are ~1e-5 relative (measured: Triton 6e-4, the fp32 reference 2e-3,
  on a gradient of 26).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from numerics import run_interpreted  # noqa: E402

from hf_attnorm.attention import attention, constant_heads  # noqa: E402
from hf_attnorm.kernels.fused import triton as ta  # noqa: E402
from hf_attnorm.normalizers.entmax_alpha import entmax_alpha_threshold  # noqa: E402
from hf_attnorm.settings import resolve_settings  # noqa: E402

HERE = os.path.abspath(__file__)
EPS32 = torch.finfo(torch.float32).eps
#: max error / largest entry, per tensor (see the module docstring)
REL_TOL = 2e-5

if not ta.interpreter_requested():

    @pytest.mark.long
    def test_interpreted():
        """Every non-slow test below, in a child process with TRITON_INTERPRET=1."""
        run_interpreted(HERE, "not slow")

    @pytest.mark.long
    @pytest.mark.slow
    def test_interpreted_slow():
        run_interpreted(HERE, "slow")

else:

    @pytest.fixture(autouse=True)
    def _small_blocks(monkeypatch):
        monkeypatch.setattr(ta, "BLOCK_OVERRIDE", (16, 16))  # lengths below cross block edges

    def _qkv(shape, seed, qscale=1.5):
        g = torch.Generator().manual_seed(seed)
        q, k, v, up = (torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(4))
        return q * qscale, k, v, up, g

    def _triton_node(out: torch.Tensor):
        """The autograd node of the Triton kernels behind ``out`` (its saved tensors: q, k, v, c, r, bias, out, Z,
        tau, M)."""
        todo = [out.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is None:
                continue
            if type(fn).__name__.startswith("_TritonAttention"):
                return fn
            todo += [nxt for nxt, _ in fn.next_functions]
        raise AssertionError("the Triton kernels did not run")

    def _run(name, heads, q, k, v, up, path, dtype, **kw):
        """out and the gradients of q, k, v and every per-head value, on ``path`` in ``dtype``."""
        leaves = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
        hd = {n: t.to(dtype).requires_grad_(True) for n, t in heads.items()}
        out, _ = attention(*leaves, resolve_settings(name), heads=hd, path=path, **kw)
        if path == "triton":
            _triton_node(out)
        grads = torch.autograd.grad((out * up.to(dtype)).sum(), [*leaves, *hd.values()])
        return dict(zip(["out", "dq", "dk", "dv", *hd], [out.detach(), *grads]))

    def _check(name, got, want, ref32):
        for key, w in want.items():
            err = (got[key].double() - w).abs().max().item()
            base = (ref32[key].double() - w).abs().max().item()
            scale = w.abs().max().item()
            assert err <= max(REL_TOL * scale, base), (
                f"{name}: {key} error {err:.2e} > {REL_TOL} x its scale {scale:.2e} and > the fp32 reference's "
                f"error {base:.2e}")

    @pytest.mark.parametrize("qscale", [pytest.param(0.05, marks=pytest.mark.slow), 1.5,
                                        pytest.param(6.0, marks=pytest.mark.slow)],
                             ids=["near-uniform", "moderate", "sparse"])
    def test_threshold_is_the_fp64_root_to_fp32_precision(qscale):
        """tau from the fp32 search (Newton on the P-norm for alpha <= 2, bisection above) against an fp64
        bisection in the same shifted coordinates x = (s - M)(alpha - 1), from the kernel's own M; Z (the mass
        the forward renormalises by) near 1."""
        alphas = [1.001, 1.02, 1.2, 1.5, 1.8, 2.0, 2.6, 4.0]
        H, L = len(alphas), 40
        q, k, v, _, _ = _qkv((1, H, L, 16), 1, qscale)
        q32 = q.float().requires_grad_(True)
        heads = {"entmax_alpha": torch.tensor(alphas, requires_grad=True)}
        out, _ = attention(q32, k.float(), v.float(), "entmax_alpha", heads=heads, causal=True, path="triton")
        _q, _k, _v, c, _r, _bias, _out, z, tau, m, *_forget = _triton_node(out).saved_tensors
        s = c.double()[..., None] * (q32.detach().double() @ k.float().double().transpose(-1, -2))
        keep = torch.ones(L, L, dtype=torch.bool).tril().expand(1, H, L, L)
        a = torch.tensor(alphas, dtype=torch.float64).view(1, H, 1, 1)
        x = ((s - m.double()[..., None]) * (a - 1)).masked_fill(~keep, -10.0)
        tau64 = entmax_alpha_threshold(x, keep, a.expand(1, H, L, 1))[..., 0]
        smax = s.masked_fill(~keep, 0).abs().amax(dim=(-1, -2))  # [1, H]
        bound = 4 * EPS32 * (1 + (a.view(1, H) - 1) * smax)
        err = (tau.double() - tau64).abs().amax(-1)
        assert (err <= bound).all(), f"tau error per alpha {err.tolist()} > {bound.tolist()}"
        assert ((z - 1).abs() < 1e-3).all(), (z - 1).abs().amax(-1)

    def test_alpha_gradient_matches_fp64_across_alphas():
        """d alpha (per head, summed over rows), dq, dk, dv for alphas from 1.02 to 2.6, causal with GQA."""
        alphas = [1.02, 1.2, 1.5, 1.8, 2.0, 2.6]
        q, k, v, up, _ = _qkv((1, 6, 33, 16), 2)
        k, v = k[:, :3], v[:, :3]  # GQA: 2 query heads per kv head
        heads = {"entmax_alpha": torch.tensor(alphas, dtype=torch.float64)}
        want = _run("entmax_alpha", heads, q, k, v, up, "reference", torch.float64, causal=True)
        ref32 = _run("entmax_alpha", heads, q, k, v, up, "reference", torch.float32, causal=True)
        got = _run("entmax_alpha", heads, q, k, v, up, "triton", torch.float32, causal=True)
        assert (want["entmax_alpha"].abs() > 1e-3).all()  # every head's alpha gradient is exercised
        _check("entmax_alpha", got, want, ref32)

    @pytest.mark.parametrize("alpha, other", [(1.5, "entmax15"), (2.0, "sparsemax")])
    def test_alpha_three_halves_and_two_are_entmax15_and_sparsemax_here_too(alpha, other):
        q, k, v, up, g = _qkv((1, 2, 21, 16), 3)
        mask = torch.rand(1, 1, 21, 21, generator=g) > 0.3
        heads = {"entmax_alpha": torch.full((2,), alpha, dtype=torch.float64)}
        mine = _run("entmax_alpha", heads, q, k, v, up, "triton", torch.float32, attention_mask=mask)
        theirs = _run(other, {}, q, k, v, up, "triton", torch.float32, attention_mask=mask)
        for key in ("out", "dq", "dk", "dv"):
            torch.testing.assert_close(mine[key], theirs[key], atol=2e-5, rtol=1e-5,
                                       msg=lambda m, key=key: f"{key}: {m}")

    def _asentmax_case(seed, batch=2):
        H, D = 4, 16
        q, k, v, up, g = _qkv((batch, H, 40, D), seed)
        settings = resolve_settings("asentmax")
        heads = {n: t.double() + 0.3 * torch.randn(t.shape, generator=g, dtype=torch.float64)
                 for n, t in constant_heads(settings, H, head_dim=D).items()}
        heads["entmax_alpha"] = torch.tensor([1.1, 1.4, 1.7, 2.0], dtype=torch.float64)
        assert heads["asentmax_w"].shape == (H, D)
        want = _run("asentmax", heads, q, k, v, up, "reference", torch.float64, causal=True)
        ref32 = _run("asentmax", heads, q, k, v, up, "reference", torch.float32, causal=True)
        got = _run("asentmax", heads, q, k, v, up, "triton", torch.float32, causal=True)
        assert set(want) == {"out", "dq", "dk", "dv", "entmax_alpha", "asentmax_delta", "asentmax_gamma",
                             "asentmax_w"}
        _check("asentmax", got, want, ref32)

    def test_asentmax_per_head_values_match_fp64():
        """The temperature theta = delta + softplus(w . q) (ln n)^gamma reaches the kernels as the per-row score
        scale; delta and gamma sum dq-like terms over every row (what drifted in the C++ kernel's fp32 version)."""
        _asentmax_case(0, batch=1)

    @pytest.mark.slow
    @pytest.mark.parametrize("seed", [1, 2, 3])
    def test_asentmax_per_head_values_match_fp64_more_seeds(seed):
        _asentmax_case(seed)
