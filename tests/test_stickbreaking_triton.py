"""The Triton stick-breaking kernels (hf_attnorm/kernels/stickbreaking/triton.py) against the reference under
Triton's interpreter: forward and the gradients of q, k and v, every option, causal, padding with fully masked rows,
GQA, a decode step and a cache prefill, odd lengths crossing 16 x 16 blocks. Like tests/test_triton.py the kernel
tests run in a child pytest process with TRITON_INTERPRET=1 (set before triton is imported); run them directly with
``TRITON_INTERPRET=1 python -m pytest tests/test_stickbreaking_triton.py``. Skipped only when triton is missing."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from numerics import assert_within_reference_error, run_interpreted  # noqa: E402

from hf_attnorm.attention import constant_heads, make_call  # noqa: E402
from hf_attnorm.kernels import attend  # noqa: E402
from hf_attnorm.kernels.fused import triton as ta  # noqa: E402
from hf_attnorm.settings import resolve_settings  # noqa: E402

HERE = os.path.abspath(__file__)
PATH = "stickbreaking_triton"


def _run(q, k, v, mask, causal, opts, gout, path):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    settings = resolve_settings("stickbreaking", opts)
    call = make_call(*leaves, settings, constant_heads(settings, q.shape[1]), mask, causal, None)
    out, _, ran = attend(call, path=path)
    out.backward(gout.to(out.dtype))
    return ran, [out.detach().double()] + [t.grad.double() for t in leaves]


if not ta.interpreter_requested():

    @pytest.mark.long
    def test_kernels_interpreted():
        """The default options in a child process with TRITON_INTERPRET=1 (the other options: the slow twin)."""
        run_interpreted(HERE, "not slow")

    @pytest.mark.long
    @pytest.mark.slow
    def test_kernels_interpreted_slow():
        run_interpreted(HERE, "slow")

    def test_cpu_calls_are_declined_without_the_interpreter():
        q = torch.randn(1, 2, 5, 16)
        settings = resolve_settings("stickbreaking")
        call = make_call(q, q, q, settings, constant_heads(settings, 2), None, True, None)
        with pytest.raises(ValueError, match="cannot run this call.*TRITON_INTERPRET=1"):
            attend(call, path=PATH)

    @pytest.mark.slow
    @pytest.mark.parametrize("masked", [False, True])
    def test_kernels_compile_for_a_gpu_target(masked):
        """The interpreter does not check what the compiler does: compile both kernels to PTX for sm_80 (Triton's
        bundled ptxas; no GPU needed)."""
        import warnings

        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile

        from hf_attnorm.kernels.stickbreaking import triton as ts

        kern = ts._compiled()
        consts = dict(ATTEND_CURRENT=0, REMAINDER=True, HAS_MASK=masked, BLOCK_M=64, BLOCK_N=32, BLOCK_D=64,
                      BLOCK_DV=64)
        pointers = {"KEEP": "*u8", "OWN": "*i32"}
        for fn in (kern._sb_fwd_kernel, kern._sb_bwd_kernel):
            sig = {a: "constexpr" if a in consts else pointers.get(a, "*fp32") if a.upper() == a and a not in (
                "H", "GROUPS", "HKV", "LQ", "LK", "DH", "DV", "NC") else "i32" for a in fn.arg_names}
            src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(a),): v for a, v in consts.items()})
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                compiled = compile(src, target=GPUTarget("cuda", 80, 32))
            assert ".entry" in compiled.asm["ptx"], fn.__name__

else:

    def _padding(B, Lq, Lk):
        keep = torch.ones(B, 1, Lq, Lk, dtype=torch.bool).tril(Lk - Lq)
        keep[0, :, :, :5] = False  # left padding: rows 0-4 of batch 0 see nothing when Lq == Lk
        keep[-1, :, :, Lk - 3:] = False
        return keep

    SCENARIOS = {  # (B, H, Hkv, Lq, Lk, D, mask factory, causal)
        "causal-gqa": (2, 4, 2, 37, 37, 16, None, True),
        "padding": (2, 2, 1, 33, 33, 8, _padding, True),
        "decode": (2, 4, 2, 1, 29, 16, None, False),
        "cache-prefill": (2, 2, 2, 9, 40, 16, _padding, False),
    }
    OPTIONS = [pytest.param({}, id="default"),
               pytest.param({"stickbreaking_attend_current": True}, id="attend_current", marks=pytest.mark.slow),
               pytest.param({"stickbreaking_remainder": False}, id="no_remainder", marks=pytest.mark.slow),
               # (an offset adds a column to q and k: a head dim that is no power of two)
               pytest.param({"stickbreaking_offset": 1.5}, id="offset", marks=pytest.mark.slow)]

    @pytest.mark.parametrize("opts", OPTIONS)
    @pytest.mark.parametrize("scenario", list(SCENARIOS))
    def test_triton_matches_the_reference(scenario, opts):
        B, H, Hkv, Lq, Lk, D, make_mask, causal = SCENARIOS[scenario]
        g = torch.Generator().manual_seed(3)
        q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64) * 2
        k, v = (torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64) for _ in range(2))
        gout = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
        mask = make_mask(B, Lq, Lk) if make_mask else None
        q32, k32, v32 = (t.float().double() for t in (q, k, v))
        _, exact = _run(q32, k32, v32, mask, causal, opts, gout, "reference")
        _, ref32 = _run(q32.float(), k32.float(), v32.float(), mask, causal, opts, gout, "reference")
        ran, got = _run(q32.float(), k32.float(), v32.float(), mask, causal, opts, gout, PATH)
        assert ran == PATH
        for label, e, r, f in zip(("out", "dq", "dk", "dv"), exact, ref32, got):
            assert_within_reference_error(f"{scenario} {label}", f, r, e, 5.0, 1e-5)
        if mask is not None:
            dead = ~mask.any(-1)
            assert (got[0][dead.expand(B, H, Lq)] == 0).all()

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    def test_half_precision_inputs(dtype):
        g = torch.Generator().manual_seed(4)
        q, k, v = (torch.randn(1, 2, 21, 16, generator=g).to(dtype) for _ in range(3))
        gout = torch.randn(1, 2, 21, 16, generator=g)
        _, exact = _run(q.double(), k.double(), v.double(), None, True, {}, gout.double(), "reference")
        _, ref = _run(q, k, v, None, True, {}, gout, "reference")
        ran, got = _run(q, k, v, None, True, {}, gout, PATH)
        assert ran == PATH
        for e, r, f in zip(exact, ref, got):
            assert (f - e).abs().max() <= 2 * (r - e).abs().max() + 1e-6
