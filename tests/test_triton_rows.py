"""The row kernels around SDPA on a GPU (hf_attnorm/kernels/triton_rows.py), run by Triton's interpreter on the
CPU (a child process with TRITON_INTERPRET=1, as tests/test_triton.py): the query scale with and without cosine's
l2-normalisation, and differential attention's RMS-normalised difference, forward and every gradient against the
PyTorch ops the paths use elsewhere; plus, in the normal process, the declarations the kernels rely on
(``Normalizer.qk_norm_eps``, ``Normalizer.difference_form``), generic over the registry."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from numerics import run_interpreted

from hf_attnorm.attention import constant_heads
from hf_attnorm.normalizers.base import Ctx
from hf_attnorm.registry import NORMALIZERS
from hf_attnorm.settings import resolve_settings

HERE = os.path.abspath(__file__)
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _ctx(name: str, H: int = 3, D: int = 8, dtype=torch.float64) -> Ctx:
    settings = resolve_settings(name)
    heads = {n: t.to(dtype) for n, t in constant_heads(settings, H, head_dim=D).items()}
    return Ctx(settings, heads, D, torch.ones(1), {"layer_idx": 2}, 5)


@pytest.mark.parametrize("name", [n for n, norm in NORMALIZERS.items() if norm.qk_norm_eps is not None])
def test_a_declared_qk_norm_is_what_transform_qk_computes(name):
    norm = NORMALIZERS.get(name)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64), torch.randn(2, 3, 7, 8, generator=g)
    q[0, 0, 0] = 0.0  # a zero row: below the floor
    got_q, got_k = norm.transform_qk(q, k.double(), _ctx(name))
    eps = norm.qk_norm_eps
    assert torch.equal(got_q, q / q.norm(dim=-1, keepdim=True).clamp_min(eps))
    torch.testing.assert_close(got_k, k.double() / k.double().norm(dim=-1, keepdim=True).clamp_min(eps))


@pytest.mark.parametrize("name", [n for n, norm in NORMALIZERS.items() if norm.differential])
def test_a_declared_difference_form_is_what_the_two_methods_compute(name):
    norm = NORMALIZERS.get(name)
    ctx = _ctx(name)
    ctx.heads["diff_norm_w"] = ctx.heads["diff_norm_w"] + torch.linspace(-0.5, 0.5, 24, dtype=torch.float64).view(3, 8)
    form = norm.difference_form(ctx)
    assert form is not None, f"{name} is differential and declares no difference_form"
    g = torch.Generator().manual_seed(1)
    a, c = (torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64) for _ in range(2))
    want = norm.normalize_output(norm.halves_difference(a, c, ctx), ctx)
    lam, weight, factor, eps = form
    d = a - lam.view(1, -1, 1, 1) * c
    got = d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + eps) * weight[None, :, None, :] * factor
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


if not INTERPRETED:

    @pytest.mark.long
    def test_row_kernels_interpreted():
        pytest.importorskip("triton")
        run_interpreted(HERE)

else:
    from hf_attnorm.kernels import triton_rows as tr

    def _grads(fn, inputs, up):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        out = fn(*leaves)
        return [out.detach(), *torch.autograd.grad((out * up.to(out.dtype)).sum(), leaves)]

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
    @pytest.mark.parametrize("normalize", [False, True], ids=["scale", "l2-normalise"])
    @pytest.mark.parametrize("factor_shape", [(2, 3, 19), (1, 3, 1), (1, 1, 19)])
    def test_row_scale_matches_the_pytorch_ops(normalize, dtype, factor_shape):
        g = torch.Generator().manual_seed(0)
        # a transposed q (as transformers hands it over: [B, L, H, D] viewed as [B, H, L, D]), a zero row
        x = torch.randn(2, 19, 3, 40, generator=g).transpose(1, 2).to(dtype)
        if dtype == torch.float32:  # (in fp16 the gradient of a zero row, f / eps, overflows in both)
            x[1, 2, 4] = 0
        f = torch.rand(*factor_shape, generator=g) + 0.5
        up = torch.randn(2, 3, 19, 40, generator=g)
        eps = 1e-6

        def ref(x, f):
            x32 = x.float()
            if normalize:
                x32 = F.normalize(x32, dim=-1, eps=eps)
            return (x32 * f.unsqueeze(-1)).to(x.dtype)

        got = _grads(lambda x, f: tr.row_scale(x, f, normalize, eps), [x, f], up)
        want = _grads(ref, [x, f], up)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
        for name, a, b in zip(["out", "dx", "dfactor"], got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m, n=name: f"{n}: {m}")

    def test_row_scale_by_a_number_has_no_factor_gradient():
        x = torch.randn(1, 2, 5, 16, requires_grad=True)
        out = tr.row_scale(x, 0.25)
        torch.testing.assert_close(out, x * 0.25)
        (gx,) = torch.autograd.grad(out.sum(), x)
        torch.testing.assert_close(gx, torch.full_like(x, 0.25))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
    def test_rms_difference_matches_the_pytorch_ops(dtype):
        g = torch.Generator().manual_seed(2)
        a, c = (torch.randn(2, 3, 21, 24, generator=g).to(dtype) for _ in range(2))
        a[0, 1, 3], c[0, 1, 3] = 0, 0  # a fully masked row: zeros stay zeros
        lam = torch.tensor([0.3, -0.2, 0.8])
        w = torch.rand(3, 24, generator=g) + 0.5
        up = torch.randn(2, 3, 21, 24, generator=g)
        eps, factor = 1e-5, 0.7

        def ref(a, c, lam, w):
            d = a.float() - lam.view(1, -1, 1, 1) * c.float()
            return (d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + eps) * w[None, :, None, :] * factor).to(a.dtype)

        got = _grads(lambda a, c, lam, w: tr.rms_difference(a, c, lam, w, factor, eps), [a, c, lam, w], up)
        want = _grads(ref, [a, c, lam, w], up)
        tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-3, rtol=3e-3)
        for name, x, y in zip(["out", "dfirst", "dsecond", "dlam", "dweight"], got, want):
            torch.testing.assert_close(x.float(), y.float(), **tol, msg=lambda m, n=name: f"{n}: {m}")
        assert (got[0][0, 1, 3] == 0).all()
