"""Property tests over every implementation and every attention path that claims it.

Hypothesis draws shapes (B, H, Hkv for GQA, Lq, Lk including 1, D), random boolean masks with all-false rows,
causal or not, and value scales up to 1e4; a fixed list of adversarial cases runs beside it deterministically.
Paths come from the kernel registry, so a new normalizer, scale or fast path is covered with no edits here.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_attnorm.attention import attention, constant_heads
from hf_attnorm.kernels import PATHS
from hf_attnorm.kernels import paths_for as fast_paths_for
from hf_attnorm.normalizers.base import Normalizer
from hf_attnorm.registry import NORMALIZERS, PRESETS
from hf_attnorm.settings import resolve_settings

IMPLS = list(PRESETS)


#: paths these fp64 CPU tests cannot exercise at all, and why (they have their own tests): every Triton path (fp64 and
#: CPU tensors: test_triton.py, test_triton_errors.py and each family's Triton tests) and the recurrent one
NOT_HERE = {n: "fp64 and CPU tensors: a Triton path" for n, p in PATHS.items()
            if p.kernel.__module__.rsplit(".", 1)[-1].startswith("triton")}
NOT_HERE["linear_recurrent"] = "needs a recurrent state kept by a cache: tested in test_recurrent.py"


def paths_for(impl: str) -> list[str]:
    """The reference plus every fast path that implements this implementation's normalizer."""
    norm = resolve_settings(impl).normalizer
    return ["reference", *[p for p in fast_paths_for(norm) if p not in NOT_HERE]]


#: the least share of the generated cases each path must actually run (not decline); the paths not listed take
#: every case. linear_chunked takes only masks that are key padding x causal (random masks are not) and one query;
#: decode and selective_step take one query (Lq is drawn from 1, 2, 5, 9).
MIN_SHARE = {"linear_chunked": 0.2, "decode": 0.1, "selective_step": 0.1}


def run(q, k, v, impl, path, **kw):
    """attention() on a forced path; None when that path declines this call (shape/mask it does not take)."""
    kw.setdefault("module_info", {"max_positions": 4})  # a model's context length (qwen_logn's default L_train)
    try:
        out, _ = attention(q, k, v, impl, path=path, **kw)
    except ValueError as e:
        if "cannot run this call" in str(e):
            return None
        raise
    return out


@st.composite
def cases(draw):
    B = draw(st.integers(1, 3))
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 3))
    Lq = draw(st.sampled_from([1, 2, 5, 9]))
    Lk = draw(st.sampled_from([1, 3, 8, 13]))
    D = draw(st.sampled_from([2, 4, 8]))
    causal = draw(st.booleans()) and Lq == Lk
    masked = draw(st.booleans())
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0, 1e4]))
    seed = draw(st.integers(0, 2**31 - 1))
    return B, H, Hkv, Lq, Lk, D, causal, masked, scale, seed


def make(B, H, Hkv, Lq, Lk, D, causal, masked, scale, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g, dtype=dtype) * math.sqrt(scale)
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=dtype) * math.sqrt(scale)
    v = torch.randn(B, Hkv, Lk, D, generator=g, dtype=dtype)
    mask = None
    if masked:
        mask = torch.rand(B, 1, Lq, Lk, generator=g) > 0.35
        if causal:
            mask &= torch.ones(Lq, Lk, dtype=torch.bool).tril()
        mask[0, 0, torch.randint(0, Lq, (1,), generator=g)] = False  # an all-false row
        if Lk > 2:
            mask[:, :, :, -1] = False  # a padding column: no query sees the last key
    return q, k, v, mask


PROFILE = settings(max_examples=12, deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("impl", IMPLS)
def test_invariants(impl):
    """The invariants on the generated cases; every path must have run on its stated share of them (a path that
    declined everything would otherwise pass without testing anything)."""
    ran = dict.fromkeys(paths_for(impl), 0)
    total = 0

    @PROFILE
    @given(case=cases())
    def check(case):
        nonlocal total
        total += 1
        for path in check_case(impl, case):
            ran[path] += 1

    check()
    for path, count in ran.items():
        share = MIN_SHARE.get(path, 1.0)
        assert count >= share * total, f"{impl}: path {path} ran on {count} of {total} cases (needs {share:.0%})"


def check_case(impl, case) -> list[str]:
    """Check one case on every path; returns the paths that ran it."""
    B, H, Hkv, Lq, Lk, D, causal, masked, scale, seed = case
    q, k, v, mask = make(*case)
    resolved = resolve_settings(impl)
    norm = NORMALIZERS.get(resolved.normalizer)
    kind = norm.row_sum
    # learned memory key/values: their values have q/k's head dim (so no ones column can be appended to v), and the
    # real keys' weights sum to at most 1 (the memory takes the rest): checked on the returned weights instead
    memory = resolved.options.get("num_mem_kv", 0) > 0
    if memory:
        _, w = attention(q, k, v, impl, attention_mask=mask, causal=causal, need_weights=True,
                         module_info={"max_positions": 4})
        assert w.shape == (B, H, Lq, Lk) and (w.sum(-1) <= 1 + 1e-6).all() and (w >= 0).all(), impl
    ran = []
    for path in paths_for(impl):
        out = run(q, k, v, impl, path, attention_mask=mask, causal=causal)
        if out is None:
            continue
        ran.append(path)
        where = f"{impl} on {path} with {case}"
        assert out.shape == (B, H, Lq, D) and torch.isfinite(out).all(), where
        if mask is not None:
            dead_rows = ~mask.any(-1)  # [B, 1, Lq]
            assert (out.masked_select(dead_rows[..., None].expand_as(out)) == 0).all(), where
            if Lk > 2:  # garbage in the padding column changes nothing
                for junk in (1e10, float("nan")):
                    k2, v2 = k.clone(), v.clone()
                    k2[:, :, -1] = junk
                    v2[:, :, -1] = junk
                    out2 = run(q, k2, v2, impl, path, attention_mask=mask, causal=causal)
                    torch.testing.assert_close(out2, out, atol=1e-10, rtol=0, msg=where)
        # row sums through a ones column of v: the same check on every path, weights not needed
        ones = torch.ones_like(v[..., :1])
        # (not for an output gate, which scales the ones column too: its weights' sums are test_normalizers')
        gated = type(norm).output_gate is not Normalizer.output_gate
        sums = None if memory or gated else run(q, k, torch.cat([v, ones], -1), impl, path, attention_mask=mask,
                                                causal=causal)
        if sums is not None:  # (a path may decline a value width that differs from the key width)
            sums = sums[..., -1]
            live = torch.ones_like(sums, dtype=torch.bool) if mask is None else mask.any(-1).expand_as(sums)
            if kind == "one":
                torch.testing.assert_close(sums[live], torch.ones_like(sums[live]), atol=1e-6, rtol=0, msg=where)
            elif kind == "at_most_one":
                assert (sums <= 1 + 1e-6).all(), where
            if kind == "signed":  # |sum w| <= sum |w| = 1
                assert (sums.abs() <= 1 + 1e-6).all(), where
            else:
                assert (sums >= -1e-9).all(), where
        # batch rows are independent
        if B > 1:
            solo = run(q[1:2], k[1:2], v[1:2], impl, path, causal=causal,
                       attention_mask=None if mask is None else mask[1:2])
            torch.testing.assert_close(solo[0], out[1], atol=1e-9, rtol=1e-9, msg=where)
        # without causality, permuting keys together with their values (and mask columns) changes nothing, unless
        # the normalizer declares that its weights depend on the key order (stick-breaking) or couples the queries
        # (selective: its penalty follows query order, BOS and each query's own key)
        if not causal and not norm.key_order and not norm.query_coupled:
            perm = torch.randperm(Lk, generator=torch.Generator().manual_seed(seed))
            outp = run(q, k[:, :, perm], v[:, :, perm], impl, path, causal=False,
                       attention_mask=None if mask is None else mask[..., perm])
            torch.testing.assert_close(outp, out, atol=1e-9, rtol=1e-7, msg=where)
    return ran


ADVERSARIAL = [
    # (B, H, Hkv, Lq, Lk, D, causal, masked, scale, seed)
    (1, 1, 1, 1, 1, 2, False, False, 1.0, 0),  # a single key
    (2, 4, 2, 7, 7, 4, True, True, 1e4, 1),  # huge scores, GQA, causal + padding
    (1, 3, 1, 1, 13, 8, False, True, 1e4, 2),  # decode step with MQA
    (2, 2, 2, 9, 3, 2, False, True, 1e-3, 3),  # tiny scores (symax/squared near 0)
    (3, 2, 1, 5, 8, 8, False, False, 30.0, 4),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ADVERSARIAL, ids=[f"adv{i}" for i in range(len(ADVERSARIAL))])
def test_adversarial_cases(impl, case):
    ran = check_case(impl, case)
    # the reference and the fast path taking every case of this normalizer (chunked; selective's own path)
    fallback = "chunked" if PATHS["chunked"].takes(NORMALIZERS.get(resolve_settings(impl).normalizer)) is None \
        else paths_for(impl)[-1]
    assert "reference" in ran and fallback in ran, ran


def test_all_false_mask_gives_zeros_and_finite_gradients_on_every_path():
    for impl in IMPLS:
        q, k, v, _ = make(2, 2, 1, 4, 6, 4, False, False, 1.0, 0)
        mask = torch.zeros(2, 1, 4, 6, dtype=torch.bool)
        for path in paths_for(impl):
            qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
            out = run(qq, kk, vv, impl, path, attention_mask=mask)
            if out is None:
                continue
            assert (out == 0).all(), (impl, path)
            out.sum().backward()
            assert all(torch.isfinite(t.grad).all() for t in (qq, kk, vv)), (impl, path)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("impl", IMPLS)
def test_low_precision_every_path(impl, dtype):
    """fp16/bf16: error vs float64 <= 2x the plain reference's error in the same dtype; |scores| up to 1e4."""
    for scale in (1.0, 1e4):
        q, k, v, mask = make(2, 4, 2, 9, 9, 8, True, True, scale, 5)
        exact = run(q, k, v, impl, "reference", attention_mask=mask)
        lo = [t.to(dtype) for t in (q, k, v)]
        ref_lo = run(*lo, impl, "reference", attention_mask=mask)
        assert ref_lo.dtype == dtype and torch.isfinite(ref_lo).all(), (impl, dtype, scale)
        ref_err = (ref_lo.double() - exact).abs().max().item()
        for path in paths_for(impl)[1:]:
            out = run(*lo, impl, path, attention_mask=mask)
            if out is None:
                continue
            assert out.dtype == dtype and torch.isfinite(out).all(), (impl, path, dtype, scale)
            err = (out.double() - exact).abs().max().item()
            assert err <= 2 * ref_err, (impl, path, dtype, scale, err, ref_err)


@pytest.mark.parametrize("impl", IMPLS)
def test_fast_paths_are_deterministic(impl):
    q, k, v, mask = make(2, 4, 2, 33, 33, 8, True, True, 1.0, 6, dtype=torch.float32)
    for path in paths_for(impl):
        results = []
        for _ in range(2):
            qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
            out = run(qq, kk, vv, impl, path, attention_mask=mask)
            if out is None:
                break
            out.pow(2).sum().backward()
            results.append((out.detach(), qq.grad, kk.grad, vv.grad))
        if len(results) == 2:
            assert all(torch.equal(a, b) for a, b in zip(*results)), (impl, path)


# ------------------------------------------------------------------------------ the knobs do something (item 5)


def _qkv(seed=7, B=1, H=3, L=12, D=4):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(3))


def _per_head_knob(impl: str, name: str, opts: dict | None = None):
    """Changing one head's value changes that head's output only."""
    q, k, v = _qkv()
    settings = resolve_settings(impl, opts or {})
    heads = constant_heads(settings, 3, head_dim=4)
    heads = {n: t.double() for n, t in heads.items()}
    base, _ = attention(q, k, v, settings, heads=heads, causal=True)
    bumped = dict(heads)
    bumped[name] = heads[name].clone()
    bumped[name][1] += 0.7
    out, _ = attention(q, k, v, settings, heads=bumped, causal=True)
    assert torch.equal(out[:, 0], base[:, 0]) and torch.equal(out[:, 2], base[:, 2]), f"{name} leaks across heads"
    assert not torch.allclose(out[:, 1, 1:], base[:, 1, 1:]), f"{name} does nothing"


@pytest.mark.parametrize("impl,name,opts", [
    ("sink", "sink_logit", None), ("ssmax", "ssmax_s", None), ("symax", "symax_eta", {"eta_learnable": True}),
    ("sigmoid", "sigmoid_bias", {"sigmoid_bias_learnable": True}), ("cosine", "cosine_temperature", None),
])
def test_per_head_knobs(impl, name, opts):
    _per_head_knob(impl, name, opts)


@pytest.mark.parametrize("impl,option,a,b", [
    ("symax", "eta", 0.0, 3.0), ("softmax_n", "n_extra", 0.0, 5.5), ("sink", "sink_init", -2.0, 2.0),
    ("sigmoid", "sigmoid_bias", -1.0, 1.0), ("ssmax", "ssmax_s", 0.5, 2.0),
    ("sparse_target", "sparse_eps", 0.01, 0.3), ("max_gradient", "max_gradient_dist", "normal", "cosine"),
    ("llama4", "llama4_floor_scale", 2.0, 8192.0), ("qwen_logn", "train_length", 2, 4096),
])
def test_option_knobs_change_the_output(impl, option, a, b):
    q, k, v = _qkv()
    out_a, _ = attention(q, k, v, impl, causal=True, **{option: a})
    out_b, _ = attention(q, k, v, impl, causal=True, **{option: b})
    assert not torch.allclose(out_a, out_b), f"{impl}.{option} does nothing"


def test_knobs_do_nothing_where_they_should_not():
    q, k, v = _qkv(L=9)
    plain, _ = attention(q, k, v, "softmax", causal=True)
    # SSMax with s * ln n = 1 equals softmax (bidirectional: every query sees n = 9 keys)
    s = torch.full((3,), 1 / math.log(9), dtype=torch.float64)
    a, _ = attention(q, k, v, "ssmax", heads={"ssmax_s": s})
    b, _ = attention(q, k, v, "softmax")
    torch.testing.assert_close(a, b)
    # llama4 with n < floor_scale and qwen_logn with n <= L_train are the standard scale
    c, _ = attention(q, k, v, "llama4", causal=True, llama4_floor_scale=100.0)
    d, _ = attention(q, k, v, "qwen_logn", causal=True, train_length=9)
    torch.testing.assert_close(c, plain)
    torch.testing.assert_close(d, plain)
    # a length-aware scale with causal masking: extending the sequence leaves earlier queries unchanged
    q2, k2, v2 = _qkv(L=15)
    for impl in ("log_n", "ssmax", "max_gradient", "sparse_target", "sigmoid", "relu_len"):
        short, _ = attention(q2[:, :, :9], k2[:, :, :9], v2[:, :, :9], impl, causal=True)
        long, _ = attention(q2, k2, v2, impl, causal=True)
        torch.testing.assert_close(long[:, :, :9], short, msg=impl)
    # ... but bidirectionally the length is felt by every query
    short, _ = attention(q2[:, :, :9], k2[:, :, :9], v2[:, :, :9], "log_n")
    long, _ = attention(q2[:, :, :9], k2, v2, "log_n")
    assert not torch.allclose(long, short)
