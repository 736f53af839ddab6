"""Every registered implementation on a CUDA GPU against the float64 reference on the same GPU (marker ``gpu``;
skipped with the reason where torch sees no CUDA device, see conftest.py). Run by ``scripts/gpu_check.sh``
(``python -m hf_attnorm.lab.speed.gpu_check``): the quick run takes ``-m "gpu and not slow"``, the full run ``-m gpu``.

Per implementation (generic over the registries) and scenario: the automatic path and, where the normalizer has a
Triton path that takes the call, that path forced; forward and the gradients of q, k, v, a learned score bias and
every learnable per-head value. Criterion per tensor (max abs error against float64):
``err <= factor x err(baseline) + atol`` (fp32: 5 x + 1e-5, the baseline the reference path in fp32; fp16/bf16:
3 x + 1e-4, the baseline the larger error of the reference path in that dtype and of a PyTorch computation with a
half-precision kernel's rounding points, ``numerics.low_precision_reference``: FlashAttention's criterion); the
gradients of learnable per-head values (sums over every row) also get a fraction of their magnitude
(``HEAD_VALUE_RELATIVE``).
Each test asserts the path that ran: the Triton path where one takes the call (or a higher-priority specialised
path, e.g. ``decode`` on one query), never the materialised reference. Plus a determinism check for the Triton
paths whose module declares ``DETERMINISTIC = True`` and ``torch.compile(fullgraph=True)`` of a tiny Llama train
step per implementation.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
from conftest import needs_compile
from numerics import assert_all_within_reference_error, low_precision_reference

from hf_attnorm.attention import constant_heads, make_call, param_specs
from hf_attnorm.kernels import PATHS, attend, explain, paths_for
from hf_attnorm.kernels.variants import is_differential
from hf_attnorm.registry import NORMALIZERS, PRESETS
from hf_attnorm.settings import resolve_settings

pytestmark = pytest.mark.gpu

#: the device under test (another only to check this file's own logic: the gpu marker still skips without CUDA)
DEV = os.environ.get("HF_ATTNORM_GPU_TEST_DEVICE", "cuda")
IMPLEMENTATIONS = list(PRESETS)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: paths that take a 4-D mask only after reading its structure on the host (MaskInfo.padding), which tracing forbids
HOST_MASK_READERS = {"linear_chunked"}
#: (factor, atol) of the criterion per dtype
TOLERANCE = {torch.float32: (5.0, 1e-5), torch.bfloat16: (3.0, 1e-4), torch.float16: (3.0, 1e-4)}
#: the gradient of a learnable per-head value sums a product over every query row and head dimension (ssmax's s:
#: sum of log(n) q.dq), so a fused backward's rounding adds up coherently; measured on an H100
#: (bench/gpu/NVIDIA_H100_80GB_HBM3/2026-11-27-ef50fad/README.md)
#: with ssmax through SDPA: fp32, the math backend gave the reference's dq and dk exactly yet 2.5 x its error on s
#: (5.9e-4 of 83), the efficient backend 8.4 x (2.0e-3, a relative 2.4e-5); bf16 flash/cuDNN had a smaller dq error
#: than the reference but 5.4-6.9 x its error on s (9.1-11.5 of 122). These gradients may also differ from the
#: float64 reference by this fraction of their largest magnitude.
HEAD_VALUE_RELATIVE = {torch.float32: 1e-4, torch.bfloat16: 0.1, torch.float16: 0.1}
LEAF_GRADIENTS = {"out", "dq", "dk", "dv", "dbias"}


def _is_triton(path: str) -> bool:
    return PATHS[path].kernel.__module__.rsplit(".", 1)[-1].startswith("triton")


def triton_path(implementation: str) -> str | None:
    """The first Triton path implementing the preset's normalizer, or None."""
    norm = resolve_settings(implementation).normalizer
    return next((p for p in paths_for(norm) if _is_triton(p)), None)


def _keep_padding(B: int, Lq: int, Lk: int, causal: bool) -> torch.Tensor:
    """Left padding in row 0 (its first 5 query rows fully masked), right padding in row 1; causal lower-right."""
    keep = torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
    keep[0, :, :, :5] = False
    keep[0, :, :5] = False
    keep[1, :, :, Lk - 7:] = False
    if causal:
        keep &= torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq)
    return keep


def _keep_random(B: int, H: int, Lq: int, Lk: int) -> torch.Tensor:
    keep = torch.rand(B, H, Lq, Lk, generator=torch.Generator().manual_seed(3)) > 0.4
    keep[:, 0, 0] = False  # a fully masked row
    return keep


#: id -> (B, H, Hkv, Lq, Lk, kwargs factory); odd lengths cross block edges
SCENARIOS = {
    "causal-gqa": (2, 4, 2, 257, 257, lambda: {"causal": True}),
    "padding-causal": (2, 4, 4, 193, 193, lambda: {"attention_mask": _keep_padding(2, 193, 193, True)}),
    "bidirectional-mask-Lq<Lk": (2, 4, 1, 130, 301, lambda: {"attention_mask": _keep_random(2, 4, 130, 301)}),
    "decode": (2, 4, 2, 1, 300, lambda: {"attention_mask": _keep_padding(2, 1, 300, False)}),
    "score-mods": (2, 4, 2, 257, 257, lambda: {
        "causal": True, "softcap": 5.0, "alibi_slopes": 2.0 ** -torch.arange(1, 5, dtype=torch.float64),
        "bias": torch.randn(1, 4, 257, 257, generator=torch.Generator().manual_seed(7),
                            dtype=torch.float64).requires_grad_(True)}),
    "bidirectional-none": (1, 4, 2, 200, 200, lambda: {}),
}
#: (scenario, dtype, head dim) run by the quick check, by how much of an implementation is new: the first preset of a
#: path set (the paths the normalizer may take) gets every case; the first of a normalizer (its own map in each
#: kernel) the plain ones; any other preset (a scale, a memory) two. Every other combination is marked slow (full)
QUICK_PER_PRESET = {("causal-gqa", "bf16", 128), ("padding-causal", "fp32", 64)}
QUICK_PER_NORMALIZER = QUICK_PER_PRESET | {("causal-gqa", "fp32", 64), ("decode", "fp32", 64)}
QUICK_PER_PATH_SET = QUICK_PER_NORMALIZER | {("bidirectional-mask-Lq<Lk", "fp32", 64), ("score-mods", "fp32", 64)}


def _reference_cases() -> list:
    """(implementation, scenario, dtype name, head dim) params, the quick subset unmarked, the rest slow."""
    cases, normalizers, path_sets = [], set(), set()
    for impl in IMPLEMENTATIONS:
        norm = resolve_settings(impl).normalizer
        path_set = tuple(paths_for(norm))
        quick = (QUICK_PER_PATH_SET if path_set not in path_sets
                 else QUICK_PER_NORMALIZER if norm not in normalizers else QUICK_PER_PRESET)
        normalizers.add(norm)
        path_sets.add(path_set)
        cases += [pytest.param(impl, s, dt, d, marks=() if (s, dt, d) in quick else pytest.mark.slow,
                               id=f"{impl}-{s}-{dt}-d{d}")
                  for s in SCENARIOS for dt in DTYPES for d in (64, 128)]
    return cases


def _heads(settings, H: int, head_dim: int, hkv: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Per-head values: the learnable ones (leaves with a gradient) at their initial value plus offsets that differ
    per head; the others as constant_heads gives them."""
    heads = constant_heads(settings, H, DEV, head_dim, hkv)
    g = torch.Generator().manual_seed(11)
    real = torch.float64 if dtype == torch.float64 else torch.float32
    for spec in param_specs(settings):
        if spec.is_learnable(settings):
            init = heads[spec.name].detach().double().cpu()
            init = init + 0.1 * torch.randn(init.shape, generator=g, dtype=torch.float64)
            heads[spec.name] = init.to(device=DEV, dtype=real).requires_grad_(True)
    return heads


def _settings(implementation: str):
    learn = {spec.learnable_option: True for spec in NORMALIZERS.get(resolve_settings(implementation).normalizer)
             .params if spec.learnable_option}
    return resolve_settings(implementation, learn)


def _run(implementation, scen, dtype, head_dim, path):
    """(results {out, dq, dk, dv, dbias?, d<head value>}, path that ran, the call)."""
    B, H, Hkv, Lq, Lk, make_kwargs = SCENARIOS[scen]
    settings = _settings(implementation)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, Lq, head_dim, generator=g, dtype=torch.float64) * 1.5
    k = torch.randn(B, Hkv, Lk, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, Lk, head_dim, generator=g, dtype=torch.float64)
    up = torch.randn(B, H, Lq, head_dim, generator=g, dtype=torch.float64).to(DEV, dtype)
    kwargs = make_kwargs()
    leaves = {n: t.to(DEV, dtype).requires_grad_(True) for n, t in (("q", q), ("k", k), ("v", v))}
    if "bias" in kwargs:
        leaves["bias"] = kwargs["bias"].detach().to(DEV, dtype).requires_grad_(True)
        kwargs["bias"] = leaves["bias"]
    if "attention_mask" in kwargs:
        kwargs["attention_mask"] = kwargs["attention_mask"].to(DEV)
    if "alibi_slopes" in kwargs:
        kwargs["alibi_slopes"] = kwargs["alibi_slopes"].to(DEV)
    heads = _heads(settings, H, head_dim, Hkv, dtype)
    call = make_call(leaves["q"], leaves["k"], leaves["v"], settings, heads,
                     module_info={"max_positions": 4096}, **kwargs)
    if path == "low-precision":
        out, ran = low_precision_reference(call), path
    else:
        out, _, ran = attend(call, path)
    tensors = {**leaves, **{n: t for n, t in heads.items() if t.requires_grad}}
    grads = torch.autograd.grad((out * up).sum(), list(tensors.values()), allow_unused=True)
    res = {"out": out.detach()}
    res.update({f"d{n}": gr for n, gr in zip(tensors, grads)})
    return res, ran, call


def _compare(label: str, got: dict, ref: dict | list[dict], ref64: dict, dtype: torch.dtype) -> None:
    factor, atol = TOLERANCE[dtype]
    relative = {key: HEAD_VALUE_RELATIVE[dtype] for key in ref64 if key not in LEAF_GRADIENTS}
    assert_all_within_reference_error(label, got, ref, ref64, factor, atol, relative)


def _baselines(implementation, scen, dtype, head_dim) -> list[dict]:
    """The reference path in ``dtype``, and for fp16/bf16 the low-precision computation where it applies (a
    normalizer whose weights the materialised scores give: not differential, no query-coupled carry)."""
    ref, _, call = _run(implementation, scen, dtype, head_dim, "reference")
    if dtype == torch.float32 or is_differential(call) or call.normalizer.kernel_family == "linear":
        return [ref]
    try:
        low, _, _ = _run(implementation, scen, dtype, head_dim, "low-precision")
    except (ValueError, NotImplementedError, RuntimeError):  # a normalizer the generic form does not cover
        return [ref]
    return [ref, low]


# first in the file: the slowest tests (a compile each) start first when the quick run is stopped by its timeout
def _compile_cases():
    """Every implementation; the quick check compiles the first implementation per training path."""
    seen, cases = set(), []
    for impl in IMPLEMENTATIONS:
        group = triton_path(impl) or (paths_for(resolve_settings(impl).normalizer) or ["reference"])[0]
        quick = group not in seen
        seen.add(group)
        cases.append(pytest.param(impl, marks=() if quick else pytest.mark.slow, id=impl))
    return cases


@needs_compile
@pytest.mark.parametrize("implementation", _compile_cases())
def test_torch_compile_fullgraph_llama_train_step(implementation):
    """A tiny Llama (GQA) train step under torch.compile(fullgraph=True) on CUDA: the loss equals eager's, every
    gradient is finite, and the attention path is the one eager mode runs."""
    from conftest import LAST_CALL, tiny

    torch._dynamo.reset()
    model = tiny("llama", "causal_lm", implementation).to(DEV).train()
    ids = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(0)).to(DEV)
    LAST_CALL.path = ""
    eager = model(input_ids=ids, labels=ids).loss
    path, mask = LAST_CALL.path, LAST_CALL.mask
    assert path and path != "reference", f"{implementation}: eager ran {path!r}"
    LAST_CALL.path = ""
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(model, fullgraph=True)
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
    torch.testing.assert_close(loss.detach(), eager.detach(), atol=1e-4, rtol=1e-4)
    assert LAST_CALL.path, f"{implementation}: the compiled call did not reach hf_attnorm"
    if not (PATHS[path].traceable and PATHS[path].compiled_backward):
        # a path that declares it declines torch.compile (or compiled training): the compiled call runs another one
        assert LAST_CALL.path != path, \
            f"{implementation}: {path!r} is registered not to run compiled training but ran compiled"
    elif LAST_CALL.mask == mask:  # same call, same path
        assert LAST_CALL.path == path, f"{implementation}: compiled ran {LAST_CALL.path!r}, eager {path!r}"
    else:  # transformers materialises the causal mask while Dynamo traces on some torch versions (2.11): a path
        # may decline a 4-D mask it cannot read under tracing (explain() says so); the loss still matches
        assert (mask, LAST_CALL.mask) == ("causal", "given"), (implementation, mask, LAST_CALL.mask)
        # only a path that must read the mask's structure on the host (MaskInfo.padding) may decline it then
        assert LAST_CALL.path == path or path in HOST_MASK_READERS, \
            f"{implementation}: compiled ran {LAST_CALL.path!r} on a {LAST_CALL.mask} mask, eager {path!r}"
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(torch.isfinite(g).all() for g in grads.values()), implementation


@pytest.mark.parametrize("implementation, scen, dtype_name, head_dim", _reference_cases())
def test_matches_float64_reference_on_gpu(implementation, scen, dtype_name, head_dim):
    dtype = DTYPES[dtype_name]
    try:
        ref64, _, _ = _run(implementation, scen, torch.float64, head_dim, "reference")
    except ValueError as exc:  # e.g. a normalizer without a score matrix refuses score modifiers
        pytest.skip(f"{implementation} refuses this call: {exc}")
    ref = _baselines(implementation, scen, dtype, head_dim)
    got, ran, call = _run(implementation, scen, dtype, head_dim, None)
    label = f"{implementation}/{scen}/{dtype_name}/d{head_dim} (path {ran})"
    if ran == "reference":
        pytest.skip(f"only the materialised reference takes this call: {explain(call)}")
    _compare(label, got, ref, ref64, dtype)
    tri = triton_path(implementation)
    if tri is None:
        return
    why = PATHS[tri].check(call)
    if why is not None:
        pytest.skip(f"{tri} declines this call: {why} (auto path {ran} checked above)")
    # the Triton path takes the call: auto mode ran it, or a specialised path of higher priority (decode ...)
    assert ran == tri or PATHS[ran].priority < PATHS[tri].priority, f"{label}: expected {tri}; {explain(call)}"
    if ran != tri:
        forced, ran_forced, _ = _run(implementation, scen, dtype, head_dim, tri)
        assert ran_forced == tri
        _compare(f"{label} forced {tri}", forced, ref, ref64, dtype)
    if "attention_mask" in SCENARIOS[scen][5]():  # fully masked query rows give exactly 0
        keep = call.mask.keep
        if keep is not None:
            dead = ~keep.any(-1).expand(got["out"].shape[:3])
            assert (got["out"][dead] == 0).all(), label


#: one implementation per Triton path (the first preset it serves), for the determinism check
TRITON_FIRST = {}
for _impl in IMPLEMENTATIONS:
    _tri = triton_path(_impl)
    if _tri is not None:
        TRITON_FIRST.setdefault(_tri, _impl)


@pytest.mark.parametrize("path", sorted(TRITON_FIRST))
def test_triton_path_determinism_as_declared(path):
    """Paths whose module declares DETERMINISTIC = True give bitwise equal outputs and gradients on equal inputs."""
    module = sys.modules[PATHS[path].kernel.__module__]
    if not getattr(module, "DETERMINISTIC", False):
        pytest.skip(f"{module.__name__} declares DETERMINISTIC = False (atomics in its backward)")
    impl = TRITON_FIRST[path]
    first, ran, _ = _run(impl, "causal-gqa", torch.bfloat16, 128, path)
    second, _, _ = _run(impl, "causal-gqa", torch.bfloat16, 128, path)
    assert ran == path
    for key in first:
        if first[key] is not None:
            assert torch.equal(first[key], second[key]), f"{path} ({impl}): {key} differs between two runs"


