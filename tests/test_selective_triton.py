"""The Triton selective-attention kernels (hf_attnorm/kernels/selective/triton.py) against the reference under
Triton's interpreter: forward and the gradients of q, k and v, causal and bidirectional, padding with fully masked
rows, per-head masks, GQA, a non-zero selecting head, cross-attention shapes, a decode step, fp16/bf16 inputs and an
entering carry (``selective_carry``), odd lengths crossing 16 x 16 blocks. Like tests/test_triton.py the kernel tests
run in a child pytest process with TRITON_INTERPRET=1 (set before triton is imported); run them directly with
``TRITON_INTERPRET=1 python -m pytest tests/test_selective_triton.py``. Skipped only when triton is missing."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from numerics import assert_within_reference_error, run_interpreted  # noqa: E402

from hf_attnorm.attention import constant_heads, make_call  # noqa: E402
from hf_attnorm.kernels import attend, candidate_paths  # noqa: E402
from hf_attnorm.kernels.fused import triton as ta  # noqa: E402
from hf_attnorm.settings import resolve_settings  # noqa: E402

HERE = os.path.abspath(__file__)
PATH = "selective_triton"


def _call(q, k, v, mask, causal, head, **kw):
    settings = resolve_settings("selective", {"selective_head": head})
    return make_call(q, k, v, settings, constant_heads(settings, q.shape[1]), mask, causal, None, **kw)


def _run(q, k, v, mask, causal, head, gout, path):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, _, ran = attend(_call(*leaves, mask, causal, head), path=path)
    out.backward(gout.to(out.dtype))
    return ran, [out.detach().double()] + [t.grad.double() for t in leaves]


if not ta.interpreter_requested():

    @pytest.mark.long
    def test_kernels_interpreted():
        """Three kernel scenarios below in a child process with TRITON_INTERPRET=1 (~10 s; the rest: the slow
        twin)."""
        run_interpreted(HERE, "not slow")

    @pytest.mark.long
    @pytest.mark.slow
    def test_kernels_interpreted_slow():
        run_interpreted(HERE, "slow")

    def test_cpu_calls_are_declined_without_the_interpreter(monkeypatch):
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        q = torch.randn(1, 2, 5, 16)
        call = _call(q, q, q, None, True, 0)
        assert PATH not in candidate_paths(call)  # and the automatic rule never tries it on CPU tensors
        with pytest.raises(ValueError, match="cannot run this call.*TRITON_INTERPRET=1"):
            attend(call, path=PATH)

    @pytest.mark.slow
    @pytest.mark.parametrize("masked, head_dim", [(True, 64), (False, 128)])
    def test_kernels_compile_for_a_gpu_target(masked, head_dim):
        """The interpreter does not check what the compiler does: compile the three kernels to PTX for sm_80
        (Triton's bundled ptxas; no GPU needed) with the GPU block sizes and stages, within sm_80's shared memory
        per block (163 KB)."""
        import warnings

        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile

        from hf_attnorm.kernels.selective import triton as ts

        kern = ts._compiled()
        bm, bn = ts.BLOCKS_GPU[64 if head_dim <= 64 else 128]
        consts = dict(HAS_MASK=masked, CAUSAL=not masked, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=head_dim,
                      BLOCK_DV=head_dim)
        pointers = {"KEEP": "*u8", "ROWSEL": "*u8", "STARTS": "*u8"}
        ints = ("H", "HKV", "GROUPS", "LQ", "LK", "OFF", "DH", "DV", "H0", "NQ")
        for fn in (kern._colsum_kernel, kern._fwd_kernel, kern._bwd_kernel):
            cs = {a: c for a, c in consts.items() if a in fn.arg_names}
            sig = {a: "constexpr" if a in cs else pointers.get(a, "*fp32") if a.upper() == a and a not in ints
                   else "i32" for a in fn.arg_names}
            src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(a),): c for a, c in cs.items()})
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                compiled = compile(src, target=GPUTarget("cuda", 80, 32), options={"num_stages": ts.NUM_STAGES})
            assert ".entry" in compiled.asm["ptx"], fn.__name__
            assert compiled.metadata.shared <= 163 * 1024, (fn.__name__, compiled.metadata.shared)

else:
    from hf_attnorm.kernels.selective import triton as ts
    from hf_attnorm.normalizers.selective import head_keep, selection_penalty

    @pytest.fixture(autouse=True)
    def _small_blocks(monkeypatch):
        monkeypatch.setattr(ts, "BLOCK_OVERRIDE", (16, 16))  # odd lengths cross block edges

    def _padding(B, H, Lq, Lk, causal):
        """Left padding in row 0 (its first rows see nothing), right padding in the last row."""
        keep = torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
        keep[0, :, :, :5] = False
        keep[0, :, :5] = False
        keep[-1, :, :, Lk - 3:] = False
        if causal:
            keep &= torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq)
        return keep

    def _per_head(B, H, Lq, Lk, causal):
        keep = torch.rand(B, H, Lq, Lk, generator=torch.Generator().manual_seed(3)) > 0.4
        keep[:, 0, 0] = False
        keep[:, 1, 2] = False
        return keep

    def _packed(B, H, Lq, Lk, causal):
        """Three documents packed in each row (block-diagonal causal): every document's first key is a BOS."""
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate((13, 11, Lk - 24))])
        return ((doc[:, None] == doc[None, :]) & torch.ones(Lq, Lk, dtype=torch.bool).tril())[None, None].expand(
            B, 1, Lq, Lk)

    #: in the default (not slow) run: GQA + a non-zero selecting head, fully masked rows, a decode step, packing
    FAST = ("causal-gqa", "padding-bidirectional", "decode", "packed")
    SCENARIOS = {  # (B, H, Hkv, Lq, Lk, D, mask factory, causal, selecting head)
        "causal-gqa": (2, 4, 2, 37, 37, 16, None, True, 3),
        "bidirectional": (1, 2, 2, 29, 29, 8, None, False, 0),
        "padding-causal": (2, 2, 1, 33, 33, 8, _padding, True, 1),
        "padding-bidirectional": (2, 2, 2, 21, 21, 16, _padding, False, 0),
        "per-head-masks": (1, 3, 3, 19, 23, 8, _per_head, False, 1),
        "cross": (1, 2, 2, 9, 30, 16, None, False, 0),
        "causal-lq<lk": (1, 2, 1, 20, 35, 8, None, True, 1),
        "causal-lq>lk": (1, 2, 1, 40, 20, 8, None, True, 1),  # early queries' own keys lie before key 0
        "decode": (2, 4, 2, 1, 29, 16, None, False, 2),
        "packed": (2, 4, 2, 37, 37, 16, _packed, True, 1),
    }

    @pytest.mark.parametrize("scenario", [pytest.param(s, marks=() if s in FAST else pytest.mark.slow)
                                          for s in SCENARIOS])
    def test_triton_matches_the_reference(scenario):
        B, H, Hkv, Lq, Lk, D, make_mask, causal, head = SCENARIOS[scenario]
        g = torch.Generator().manual_seed(5)
        q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
        k, v = (torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64) for _ in range(2))
        gout = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
        mask = make_mask(B, H, Lq, Lk, causal) if make_mask else None
        q32, k32, v32 = (t.float() for t in (q, k, v))
        _, exact = _run(q32.double(), k32.double(), v32.double(), mask, causal, head, gout, "reference")
        _, ref32 = _run(q32, k32, v32, mask, causal, head, gout, "reference")
        ran, got = _run(q32, k32, v32, mask, causal, head, gout, PATH)
        assert ran == PATH
        for label, e, r, f in zip(("out", "dq", "dk", "dv"), exact, ref32, got):
            assert_within_reference_error(f"{scenario} {label}", f, r, e, 5.0, 1e-5)
        if mask is not None:
            dead = ~mask.any(-1).expand(B, H, Lq)
            assert (dead.any() or make_mask is _packed) and (got[0][dead] == 0).all()

    @pytest.mark.slow
    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    def test_half_precision_inputs(dtype):
        g = torch.Generator().manual_seed(4)
        q, k, v = (torch.randn(1, 2, 21, 16, generator=g).to(dtype) for _ in range(3))
        gout = torch.randn(1, 2, 21, 16, generator=g)
        _, exact = _run(q.double(), k.double(), v.double(), None, True, 1, gout.double(), "reference")
        _, ref = _run(q, k, v, None, True, 1, gout, "reference")
        ran, got = _run(q, k, v, None, True, 1, gout, PATH)
        assert ran == PATH
        for e, r, f in zip(exact, ref, got):
            assert (f - e).abs().max() <= 2 * (r - e).abs().max() + 1e-6

    @pytest.mark.slow
    def test_entering_carry_and_its_gradient():
        """``selective_carry`` [B, Lk] (a cache's column sums of the earlier queries' R) is added to F, with its
        gradient: checked against softmax(s - F - carry) written out."""
        B, H, Lq, Lk, D = 2, 2, 5, 23, 8
        g = torch.Generator().manual_seed(6)
        q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (Lq, Lk, Lk))
        carry = torch.rand(B, Lk, generator=g) * 3
        keep = torch.ones(B, 1, Lq, Lk, dtype=torch.bool).tril(Lk - Lq)  # the cache's lower-right causal mask
        gout = torch.randn(B, H, Lq, D, generator=g)
        leaves = [t.double().requires_grad_(True) for t in (q, k, v, carry)]
        s = leaves[0] @ leaves[1].transpose(-1, -2) / D**0.5
        pen = selection_penalty(s[:, 1], head_keep(keep, 1, B, Lq, Lk)) + leaves[3][:, None]
        want = torch.softmax((s - pen[:, None]).masked_fill(~keep, float("-inf")), -1) @ leaves[2]
        want_grads = torch.autograd.grad(want, leaves, gout.double())
        got_leaves = [t.clone().requires_grad_(True) for t in (q, k, v, carry)]
        call = _call(*got_leaves[:3], keep, False, 1)
        call.selective_carry = got_leaves[3]
        assert ts.accepts(call) is None
        out, _, ran = attend(call, path=PATH)
        assert ran == PATH
        grads = torch.autograd.grad(out, got_leaves, gout)
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=0)
        for label, a, b in zip(("dq", "dk", "dv", "dcarry"), grads, want_grads):
            torch.testing.assert_close(a.double(), b, atol=5e-5, rtol=0, msg=label)
        call.selective_carry = got_leaves[3][:1].detach()  # one row for the batch
        out1, _, _ = attend(call, path=PATH)
        torch.testing.assert_close(out1[0], out[0].detach())
        call.selective_carry = torch.zeros(B, Lk + 1)
        assert "selective_carry must be a float tensor [B=2 or 1, Lk=23]" in ts.accepts(call)

    def test_modifiers_and_dropout_are_declined():
        q = torch.randn(1, 2, 5, 16)
        with pytest.raises(ValueError, match="score bias"):
            attend(_call(q, q, q, None, True, 0, bias=torch.zeros(1, 1, 5, 5)), path=PATH)
        with pytest.raises(ValueError, match="dropout"):
            attend(_call(q, q, q, None, True, 0, dropout=0.1), path=PATH)
        with pytest.raises(ValueError, match="dtype torch.float64"):
            attend(_call(q.double(), q.double(), q.double(), None, True, 0), path=PATH)

    @pytest.mark.slow
    def test_model_with_padding_matches_reference():
        """A whole tiny llama (GQA, causal, left padding through transformers' mask function, selecting head 1),
        forward and the gradients of every parameter, with every attention call forced onto the Triton path."""
        from conftest import LAST_CALL, model_output, tiny

        from hf_attnorm.kernels import set_forced_path

        model = tiny("llama", "causal_lm", "selective", attnorm={"selective_head": 1})
        ids = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(0))
        mask = torch.ones(2, 19, dtype=torch.long)
        mask[1, :6] = 0
        res = {}
        try:
            for path in ("reference", PATH):
                set_forced_path(path)
                model.zero_grad()
                out = model_output(model(input_ids=ids, attention_mask=mask))
                (out[mask.bool()] ** 2).mean().backward()
                res[path] = (out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                            if p.grad is not None})
        finally:
            set_forced_path()
        assert LAST_CALL.path == PATH
        (o_ref, g_ref), (o_tri, g_tri) = res["reference"], res[PATH]
        live = mask.bool()
        torch.testing.assert_close(o_tri[live], o_ref[live], atol=2e-5, rtol=1e-4)
        assert g_ref.keys() == g_tri.keys() and g_ref
        for n in g_ref:
            torch.testing.assert_close(g_tri[n], g_ref[n], atol=2e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
