"""The Triton kernels (hf_attnorm/kernels/fused/triton.py) against the reference path, run on the CPU by Triton's
interpreter: forward and the gradients of q, k, v and every learnable per-head value, generic over the normalizers
the kernels implement (the normalizers declaring a fused map of ``kernels/fused/maps.py``).

Triton fixes interpreted vs compiled mode for its own library when it is imported, so ``TRITON_INTERPRET=1`` must be
set before anything imports triton. The kernel tests therefore run in a child pytest process started with it set
(``test_kernels_interpreted``, and its ``slow`` twin for the slow cases); run them directly with
``TRITON_INTERPRET=1 python -m pytest tests/test_triton.py``. Skipped only when triton is not installed.

Criterion (fp32): |triton - float64 reference| <= 5 x |fp32 reference - float64 reference| + 1e-5, per tensor
(max abs over all entries). fp16/bf16: <= 2 x the larger error of the reference path in that dtype and of a PyTorch
computation with a half-precision kernel's rounding points (``numerics.low_precision_reference``, FlashAttention's
criterion) (+ 1e-6).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

pytest.importorskip("triton")

from conftest import needs_compile  # noqa: E402
from numerics import assert_all_within_reference_error, low_precision_reference, run_interpreted  # noqa: E402

from hf_attnorm.attention import attention, constant_heads, make_call, param_specs  # noqa: E402
from hf_attnorm.kernels import PATHS, attend, candidate_paths, declared_normalizers, paths_for  # noqa: E402
from hf_attnorm.kernels.fused import (
    maps,  # noqa: E402
    triton_device,  # noqa: E402
)
from hf_attnorm.kernels.fused import triton as ta  # noqa: E402
from hf_attnorm.registry import NORMALIZERS  # noqa: E402
from hf_attnorm.settings import resolve_settings  # noqa: E402

NAMES = declared_normalizers("triton")
FORGET_NAMES = declared_normalizers("triton_forget")
INTERPRETED = ta.interpreter_requested()
HERE = os.path.abspath(__file__)


# ------------------------------------------------------------------------------ tests in the normal pytest process

if not INTERPRETED:

    @pytest.mark.long
    def test_kernels_interpreted():
        """Every non-slow test below, in a child process with TRITON_INTERPRET=1."""
        run_interpreted(HERE, "not slow", allow_skips=True)

    @pytest.mark.long
    @pytest.mark.slow
    def test_kernels_interpreted_slow():
        run_interpreted(HERE, "slow", allow_skips=True)

    def test_the_device_code_compares_the_map_id_with_nothing():
        """The kernels branch on the declared facts (constexprs from maps.py) and call the generated per-entry code
        (``_map_weight`` / ``_map_slope``): the hand-written device code never compares ``MAP`` with an id (see
        tests/test_fused_maps.py for the generated code)."""
        import inspect
        import re

        src = "".join(inspect.getsource(getattr(triton_device, name)) for name in triton_device.JIT_FUNCTIONS)
        assert not re.search(r"\bMAP\s*(==|!=|>=|<=|<|>)", src)

    def _call(name: str, device: str = "cpu", **kw):
        q = torch.randn(1, 2, 5, 16, device=device)
        settings = resolve_settings(name)
        return make_call(q, q, q, settings, constant_heads(settings, 2, q.device, q.shape[-1]), None, True, None, **kw)

    @pytest.mark.parametrize("name", NAMES)
    def test_cpu_calls_are_declined_without_the_interpreter(name, monkeypatch):
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        assert "triton" not in candidate_paths(_call(name))
        with pytest.raises(ValueError, match="cannot run this call.*TRITON_INTERPRET=1"):
            attend(_call(name), path="triton")

    @pytest.mark.parametrize("module", ["fused.triton", "selective.triton", "stickbreaking.triton"])
    def test_compiled_launcher_sees_every_constexpr_parameter(module):
        """Compiled kernels learn which parameters are ``tl.constexpr`` from the annotations (the interpreter does
        not need them): every jitted copy must flag exactly the parameters its source annotates, else a launch on a
        GPU fails ('failed to specialize argument of type: str', "arange's arguments must be of type
        tl.constexpr"). Checked on the compiled-mode namespace, no GPU needed."""
        mod = importlib.import_module(f"hf_attnorm.kernels.{module}")
        kern = mod._compiled()
        names = [n for n in vars(kern) if not n.startswith("__") and n != "tuned"]
        assert names
        flagged_somewhere = False
        for name in names:
            jitted = getattr(kern, name)
            # the fused maps' device code lives in triton_device.py, its per-entry code in triton_maps.py
            sources = [mod, *(importlib.import_module(f"hf_attnorm.kernels.fused.{m}")
                              for m in ("triton_device", "triton_maps") if module == "fused.triton")]
            raw = next(getattr(src, name) for src in sources if hasattr(src, name))
            declared = [a for a, ann in raw.__annotations__.items() if "constexpr" in str(ann)]
            params = getattr(jitted, "params", None)
            if params is None:  # (a device helper kept as a plain function)
                continue
            assert [p.name for p in params if p.is_constexpr] == declared, f"{module}.{name}"
            flagged_somewhere |= bool(declared)
        assert flagged_somewhere  # the check saw constexpr parameters at all

    def test_on_a_gpu_the_kernels_are_autotuned_and_masked_calls_keep_their_blocks():
        """The launch decisions of a GPU call (the plan's blocks taken away as on CUDA; building the autotuned
        kernels needs no GPU): unmasked calls autotune over CONFIGS, a keep-mask's calls over warps and stages with
        MASKED_BLOCKS and block tables built for them; the autotuner keys on the map's constants and the lengths."""
        ta._load_triton()
        kern = ta._compiled()
        try:
            ta.tuned(kern, "_fwd_kernel", "small", False)
        except RuntimeError as exc:  # (triton 3.2 sets up its GPU driver when an autotuner is made)
            pytest.skip(f"this triton makes no autotuner without a GPU driver: {exc}")
        q = torch.zeros(1, 2, 300, 64)
        keep = torch.ones(1, 1, 300, 200, dtype=torch.bool)
        k = torch.zeros(1, 2, 200, 64)
        for masked in (False, True):
            plan = ta._Plan(q, k, k, keep if masked else None, not masked, "symax")
            plan.fixed = None  # (a CUDA call's plan)
            for name in triton_device.KERNELS:
                kernel, blocks, table = plan.kernel(kern, name)
                assert kernel is ta.tuned(kern, name, "small", masked)
                assert {"MAP", "CAUSAL", "HAS_MASK", "LQ_KEY", "LK_KEY", "DH"} <= set(kernel.keys), kernel.keys
                got = [(c.kwargs.get("BLOCK_M"), c.kwargs.get("BLOCK_N"), c.num_warps, c.num_stages)
                       for c in kernel.configs]
                if masked:
                    bm, bn = ta.MASKED_BLOCKS[name]
                    assert blocks == {"BLOCK_M": bm, "BLOCK_N": bn}
                    assert table.shape[-2:] == (-(-300 // bm), -(-200 // bn)) and table.dtype == torch.uint8
                    assert {g[2:] for g in got} == {c[2:] for c in ta.CONFIGS[name]["small"]}
                    assert all(g[:2] == (None, None) for g in got)
                else:
                    assert blocks == {} and got == list(ta.CONFIGS[name]["small"])
        # a config far larger than the call is pruned (a one-query decode step keeps the smallest query block)
        fwd = ta.tuned(kern, "_fwd_kernel", "small", False)
        area = [c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] for c in fwd.configs]
        kept = ta._prune(fwd.configs, {}, LQ_KEY=16, LK_KEY=4096)
        assert len(kept) == 1 and kept[0].kwargs["BLOCK_M"] * kept[0].kwargs["BLOCK_N"] == min(area)
        assert ta._prune(fwd.configs, {}, LQ_KEY=4096, LK_KEY=4096) == fwd.configs

    TRITON_PATHS = sorted(p for p, path in PATHS.items() if path.kernel.__module__.rsplit(".", 1)[-1]
                          .startswith("triton"))

    @needs_compile
    @pytest.mark.parametrize("path", TRITON_PATHS)
    def test_accepts_traces_under_torch_compile_and_declines_as_registered(path):
        """A compiled model asks every candidate path's ``accepts`` while Dynamo traces (on a GPU too, before any
        device check could decline): it must trace without a graph break (Dynamo cannot trace ``isinstance`` on a
        Triton function nor triton's knobs), and a path registered ``traceable=False`` declines with the reason."""
        call = _call(declared_normalizers(path)[0])
        ta._load_triton()
        reasons: list[str | None] = []

        @torch.compile(fullgraph=True, backend="eager")
        def ask(x: torch.Tensor) -> torch.Tensor:
            reasons.append(PATHS[path].accepts(call))
            reasons.append(str(ta.interpreter_consistent()))
            return x + 1

        torch._dynamo.reset()
        ask(torch.zeros(2))
        assert reasons[1] == str(ta.interpreter_consistent())
        if PATHS[path].traceable:
            assert reasons[0] is None or "torch.compile" not in reasons[0]
        else:
            assert reasons[0] is not None and reasons[0].startswith(f"torch.compile: path {path!r}"), reasons[0]
        eager = PATHS[path].accepts(call)
        assert eager is None or "torch.compile" not in eager  # eager: not this reason

    def test_interpreter_switched_on_after_import_is_refused_with_a_warning(monkeypatch):
        ta._load_triton()  # triton imported in compiled mode in this process
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(ta, "_WARNED", set())
        with pytest.warns(UserWarning, match="TRITON_INTERPRET changed after triton was imported"):
            with pytest.raises(ValueError, match="TRITON_INTERPRET changed after triton was imported"):
                attend(_call("symax"), path="triton")


def test_calls_the_kernels_cannot_take_are_declined_with_the_reason():
    q = torch.randn(1, 2, 5, 16)
    cases = [("softmax", {}, "normalizer 'softmax' declares no fused kernel map"),
             ("symax", {"dropout": 0.1}, "dropout")]
    for name, kw, why in cases:
        settings = resolve_settings(name)
        call = make_call(q, q, q, settings, constant_heads(settings, 2, head_dim=q.shape[-1]), None, True, None, **kw)
        with pytest.raises(ValueError, match=f"cannot run this call.*{why}"):
            attend(call, path="triton")
    if INTERPRETED:  # only the interpreter gets as far as the dtype on a CPU
        settings = resolve_settings("symax")
        heads = constant_heads(settings, 2, head_dim=q.shape[-1])
        call = make_call(q.double(), q.double(), q.double(), settings, heads, None, True, None)
        with pytest.raises(ValueError, match="dtype torch.float64: the Triton kernels take"):
            attend(call, path="triton")


def test_block_table_marks_exactly_the_blocks_with_a_visible_key():
    torch.manual_seed(0)
    keep = torch.rand(2, 3, 37, 50) > 0.97
    keep[1, 2] = False
    table = ta.block_table(keep, 37, 50, 16, 8)
    assert table.shape == (2, 3, 3, 7)
    for i in range(3):
        for j in range(7):
            want = keep[:, :, i * 16:(i + 1) * 16, j * 8:(j + 1) * 8].flatten(2).any(-1)
            assert torch.equal(table[:, :, i, j].bool(), want)
    row = torch.zeros(1, 1, 1, 50, dtype=torch.bool)
    row[..., 49] = True  # one query row broadcast over all queries
    assert ta.block_table(row, 37, 50, 16, 8)[0, 0, :, 6].all()


# --------------------------------------------------------------------- kernel tests (TRITON_INTERPRET=1 processes)

@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    # 16 x 16 blocks: the odd lengths below cross block edges, and the interpreter is fast enough
    monkeypatch.setattr(ta, "BLOCK_OVERRIDE", (16, 16))


def _keep(B, Lq, Lk, seed, heads=1, density=0.7):
    """A random keep-mask [B, heads, Lq, Lk] with fully masked rows, a whole masked query block (batch 1,
    queries 0-15: its blocks are skipped) and a row with a single visible key."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(B, heads, Lq, Lk, generator=g) < density
    keep[0, :, min(3, Lq - 1)] = False
    if B > 1:
        keep[1, :, : min(16, Lq)] = False
        if Lq > 16:
            keep[1, :, 16] = False
            keep[1, :, 16, Lk // 2] = True
    return keep


def _cache_mask(B, Lq, Lk, pad):
    """What transformers passes with a cache: lower-right causal (query i sees keys <= i + Lk - Lq) and left
    padding of ``pad[b]`` keys; padded query rows are fully masked."""
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    causal = j <= i + (Lk - Lq)
    keep = causal[None].repeat(B, 1, 1)
    for b, p in enumerate(pad):
        keep[b, :, :p] = False
        keep[b, : max(0, p - (Lk - Lq)), :] = False
    return keep[:, None]


def _bias(shape, grad=True, seed=7):
    """A score bias (a leaf with a gradient when ``grad``: T5's is learned)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).requires_grad_(grad)


def _slopes(H):
    return 2.0 ** -torch.arange(1, H + 1, dtype=torch.float64)  # powers of 2, as ALiBi's


#: id -> (B, H, Hkv, Lq, Lk, D, Dv, attention kwargs factory, normalizer/scale options)
SCENARIOS = {
    "mask-gqa": (2, 4, 2, 17, 33, 16, 16, lambda: {"attention_mask": _keep(2, 17, 33, 1)}, {}),
    "causal-upper-left-Lq<Lk": (2, 2, 2, 17, 40, 16, 16, lambda: {"causal": True}, {}),
    "cache-decode-1": (2, 2, 1, 1, 33, 16, 16, lambda: {"attention_mask": _cache_mask(2, 1, 33, [0, 5])}, {}),
    "log_n-cache-prefill": (2, 2, 1, 17, 40, 16, 16, lambda: {"attention_mask": _cache_mask(2, 17, 40, [0, 26])},
                            {"scale": "log_n"}),
    "ssmax-causal": (1, 3, 3, 17, 17, 16, 16, lambda: {"causal": True}, {"scale": "ssmax"}),
    # score modifiers: bias (learned, shared over the batch) + ALiBi + soft-cap; a decode step with a frozen one
    "mods-mask-gqa": (2, 4, 2, 17, 33, 16, 16, lambda: {"attention_mask": _keep(2, 17, 33, 1),
                                                        "bias": _bias((1, 4, 17, 33)), "alibi_slopes": _slopes(4),
                                                        "softcap": 3.0}, {}),
    "mods-cache-decode": (2, 2, 1, 1, 33, 16, 16, lambda: {"attention_mask": _cache_mask(2, 1, 33, [0, 5]),
                                                           "bias": _bias((2, 1, 1, 33), grad=False),
                                                           "alibi_slopes": _slopes(2), "softcap": 2.0}, {}),
}
SLOW_SCENARIOS = {
    "causal-LqLk": (1, 2, 1, 33, 33, 16, 16, lambda: {"causal": True}, {}),
    "per-head-mask-odd-dims": (2, 4, 4, 33, 17, 12, 20, lambda: {"attention_mask": _keep(2, 33, 17, 2, heads=4)},
                               {}),
    "causal-64-multiblock-gqa4": (1, 4, 1, 64, 64, 16, 16, lambda: {"causal": True}, {}),
    "bidirectional-nomask": (2, 2, 1, 17, 64, 16, 16, lambda: {}, {}),
    "bias-B1QK-causal": (2, 2, 1, 17, 17, 16, 16, lambda: {"causal": True, "bias": _bias((2, 1, 17, 17))}, {}),
    "bias-BHQ1-softcap-mask": (2, 4, 2, 17, 33, 16, 16, lambda: {"attention_mask": _keep(2, 17, 33, 2),
                                                                 "bias": _bias((2, 4, 17, 1)), "softcap": 1.5}, {}),
    "bias-B11K-alibi-causal-Lq<Lk": (2, 2, 2, 17, 40, 16, 16, lambda: {"causal": True, "bias": _bias((2, 1, 1, 40)),
                                                                       "alibi_slopes": _slopes(2)}, {}),
}
#: extra option settings per normalizer (constant eta = 0: a zero denominator on fully masked rows; constant bias)
OPTION_CASES = {"symax": {"eta": 0.0, "eta_learnable": False}, "sigmoid": {"sigmoid_bias": -2.0}}


def _inputs(B, H, Hkv, Lq, Lk, D, Dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, Lk, Dv, generator=g, dtype=torch.float64)
    up = torch.randn(B, H, Lq, Dv, generator=g, dtype=torch.float64)
    return q * 1.5, k, v, up  # x1.5: scores with some spread (sparse maps get several supports)


def _heads(name: str, H: int, opts: dict, head_dim: int = 16) -> dict[str, torch.Tensor]:
    """The learnable per-head values of the normalizer and the scale, at their initial value plus offsets that
    differ per head (symax eta crosses 0, so |eta| and its gradient sign are exercised)."""
    settings = resolve_settings(name, opts)
    out = {}
    for spec in param_specs(settings):
        if spec.is_learnable(settings):
            init = spec.initial(H, settings, head_dim).double()
            out[spec.name] = init + torch.linspace(-1.7, 0.5, H, dtype=torch.float64).view(-1, *[1] * (init.dim() - 1))
    return out


def _run(name, q, k, v, up, heads, path, dtype, kwargs, opts):
    leaves = {"q": q, "k": k, "v": v}
    kwargs = dict(kwargs)
    bias = kwargs.pop("bias", None)
    if bias is not None and bias.requires_grad:  # differentiated like q, k, v
        leaves["bias"] = bias.detach()
    elif bias is not None:
        kwargs["bias"] = bias.to(dtype)
    leaves = {n: t.to(dtype).requires_grad_(True) for n, t in leaves.items()}
    if "bias" in leaves:
        kwargs["bias"] = leaves["bias"]
    hl = {n: t.to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_(True)
          for n, t in heads.items()}
    settings = resolve_settings(name, opts)
    call = make_call(leaves["q"], leaves["k"], leaves["v"], settings,
                     {**constant_heads(settings, q.shape[1], None, q.shape[-1]), **hl}, **kwargs)
    if path == "low-precision":  # (numerics.low_precision_reference: a half-precision kernel's rounding points)
        out, ran = low_precision_reference(call), path
    else:
        out, _, ran = attend(call, path)
    assert ran == path and out.dtype == dtype
    tensors = [*leaves.values(), *hl.values()]
    grads = torch.autograd.grad((out * up.to(dtype)).sum(), tensors, allow_unused=True)
    res = {"out": out.detach()}
    for n, g in zip([*leaves, *hl], grads):
        res[f"d{n}"] = g
    return res


def _check_scenario(name, scen, sid, extra_opts=None, dtype=torch.float32, path="triton"):
    B, H, Hkv, Lq, Lk, D, Dv, make_kwargs, opts = scen
    learn = {spec.learnable_option: True for spec in NORMALIZERS.get(name).params}  # gradients of eta, bias...
    opts = {**learn, **opts, **(extra_opts or {})}
    q, k, v, up = _inputs(B, H, Hkv, Lq, Lk, D, Dv)
    kwargs = make_kwargs()
    heads = _heads(name, H, opts, D)
    ref64 = _run(name, q, k, v, up, heads, "reference", torch.float64, kwargs, opts)
    ref = _run(name, q, k, v, up, heads, "reference", dtype, kwargs, opts)
    got = _run(name, q, k, v, up, heads, path, dtype, kwargs, opts)
    # a per-head value's gradient sums a product over every row of the call, so the kernels' summation order (their
    # block sizes) moves it by rounding coherently: it may also differ by 1e-5 of its magnitude in fp32 (alpha-entmax's
    # d alpha at 64 x 64 causal: 1.1e-5 with 16 x 16 blocks, 2.4e-5 with 32 x 16, of 12.6; fox's gates, through the
    # cumulative sum over the keys: up to 1.1e-6 against a float64 decay) and 1e-2 in half precision (fox: up to
    # 1.7e-3)
    heads_relative = 1e-5 if dtype == torch.float32 else 1e-2
    relative = {key: heads_relative for key in ref64 if key not in ("out", "dq", "dk", "dv", "dbias")}
    if dtype == torch.float32:
        assert_all_within_reference_error(f"{name}/{sid}", got, ref, ref64, 5.0, 1e-5, relative)
    else:  # half precision: FlashAttention's criterion (numerics.py)
        low = _run(name, q, k, v, up, heads, "low-precision", dtype, kwargs, opts)
        assert_all_within_reference_error(f"{name}/{sid}", got, [ref, low], ref64, 2.0, 1e-6, relative)
    if "attention_mask" in kwargs:  # fully masked query rows give exactly 0
        keep = kwargs["attention_mask"]
        dead = ~keep.any(-1).expand(B, H, Lq)
        assert (got["out"][dead] == 0).all()


if INTERPRETED:  # the kernel tests proper: only where the interpreter was on before triton was imported

    @pytest.mark.parametrize("sid", list(SCENARIOS))
    @pytest.mark.parametrize("name", NAMES)
    def test_matches_reference_fp32(name, sid):
        _check_scenario(name, SCENARIOS[sid], sid)

    @pytest.mark.parametrize("name", list(OPTION_CASES))
    def test_matches_reference_with_options(name):
        if name not in NAMES:
            pytest.skip(f"{name} is not a Triton kernel normalizer")
        _check_scenario(name, SCENARIOS["mask-gqa"], "mask-gqa+options", OPTION_CASES[name])

    def _half_sample() -> list[str]:
        """The first normalizer of each kind of map (normalised or not, threshold search or not): fp16/bf16 change
        the loads, the upcast and the stores, which are the same code for every map of a kind; every normalizer
        runs in fp16 and bf16 natively on a GPU (tests/test_gpu.py)."""
        first: dict[tuple[bool, bool], str] = {}
        for name in NAMES:
            kind = NORMALIZERS.get(name).fused_map
            first.setdefault((kind in maps.NORMALISED, kind in maps.THRESHOLD), name)
        return list(first.values())

    def _form_sample() -> list[str]:
        """The first normalizer of each kernel form: the constexprs a map's declaration gives the kernels except
        its id (``map_constants``), which decide every branch they take; normalizers of one form differ only in
        the per-entry code (``_map_weight`` / ``_map_slope``, run by the non-slow scenarios for every normalizer)
        or in what happens before the kernel (asentmax's query scale)."""
        first: dict[tuple, str] = {}
        for name in NAMES:
            consts = ta.map_constants(maps.BY_NAME[NORMALIZERS.get(name).fused_map])
            first.setdefault(tuple(sorted((k, v) for k, v in consts.items() if k != "MAP")), name)
        return list(first.values())

    def _more_shapes() -> list[tuple[str, str]]:
        """(normalizer, scenario): the shapes and masks for the first normalizer of each kernel form; the
        score-modifier scenarios (bias shapes, ALiBi, soft-cap: the same load and broadcast code for every map)
        for the sample of each kind."""
        forms, sample = _form_sample(), _half_sample()
        return [(name, sid) for sid in SLOW_SCENARIOS for name in forms
                if not sid.startswith("bias-") or name in sample]

    @pytest.mark.slow
    @pytest.mark.parametrize("name, sid", _more_shapes())
    def test_matches_reference_fp32_more_shapes(name, sid):
        _check_scenario(name, SLOW_SCENARIOS[sid], sid)

    @pytest.mark.slow
    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
    @pytest.mark.parametrize("name", _half_sample())
    def test_matches_reference_half(name, dtype):
        _check_scenario(name, SCENARIOS["mask-gqa"], "mask-gqa", dtype=dtype)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
    @pytest.mark.parametrize("sid", ["mask-gqa", "causal-upper-left-Lq<Lk", "cache-decode-1", "mods-mask-gqa"])
    @pytest.mark.parametrize("name", FORGET_NAMES)
    def test_forget_gates_match_reference(name, sid, dtype):
        """Softmax with forgetting attention's decay on path triton_forget (the kernels' softmax map, the decay
        -|c_p - c_j| in the score modifiers from the cumulative gates): forward and the gradients of q, k, v, the
        score bias and the gates' per-head values (through the gates' cumulative sum), masks with dead rows,
        Lq < Lk (the query's own key at Lk - Lq + i), a decode step and keys after the query (a bidirectional
        mask: the decay is -|c_p - c_j| there)."""
        scen = {**SCENARIOS, **SLOW_SCENARIOS}[sid]
        _check_scenario(name, scen, sid, dtype=dtype, path="triton_forget")

    @pytest.mark.parametrize("name", NAMES)
    def test_matches_reference_fp16_causal(name):
        """Every normalizer in fp16 (the interpreter's half precision: its bf16 dot is wrong), causal with Lq < Lk:
        the products on the fp16 inputs, P and dS rounded to fp16, the blocks split at the diagonal."""
        _check_scenario(name, SCENARIOS["causal-upper-left-Lq<Lk"], "causal-upper-left-Lq<Lk", dtype=torch.float16)

    @pytest.mark.parametrize("blocks", [(32, 16), (16, 32)], ids=["BM32-BN16", "BM16-BN32"])
    @pytest.mark.parametrize("sid", ["causal-64-multiblock-gqa4", "bidirectional-nomask"])
    def test_unequal_blocks_split_at_the_right_keys(blocks, sid, monkeypatch):
        """Query and key blocks of different sizes (the autotuner's configs have both): which key blocks a causal
        query block sees whole, and which query blocks see a key block whole, depend on both sizes."""
        monkeypatch.setattr(ta, "BLOCK_OVERRIDE", blocks)
        for name in _half_sample():
            _check_scenario(name, SLOW_SCENARIOS[sid], f"{sid}/{blocks}")

    @needs_compile
    @pytest.mark.parametrize("name", ["sigmoid", "entmax15", "fox"])
    def test_torch_compile_keeps_the_triton_path(name, monkeypatch):
        """torch.compile(fullgraph=True) of a call forced onto the Triton path (backend aot_eager: Dynamo and
        AOTAutograd trace the forward and the backward) runs the kernels as the custom ops
        hf_attnorm_triton::forward / backward, with eager's output and gradients (a score bias and a per-head value
        included; fox: path triton_forget, the gates' cumulative sum an input of the ops with its gradient)."""
        path, kernel_map = ("triton_forget", "softmax") if name == "fox" else ("triton", name)
        torch._dynamo.reset()
        ops = []
        real_plan = ta._op_plan
        monkeypatch.setattr(ta, "_op_plan", lambda *a: ops.append(a[5]) or real_plan(*a))
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 2, 19, 16, generator=g) for _ in range(3))
        bias = torch.randn(1, 2, 19, 19, generator=g)

        def run(fn):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
            out = fn(*leaves)
            return [out.detach(), *torch.autograd.grad((out * out).sum(), leaves)]

        def f(q, k, v, bias):
            return attention(q, k, v, name, causal=True, bias=bias, path=path)[0]

        eager = run(f)
        assert ops == []  # eager calls run the autograd.Function, not the ops
        compiled = run(torch.compile(f, backend="aot_eager", fullgraph=True))
        assert ops == [kernel_map, kernel_map], ops  # the forward op, then the backward op
        for a, b in zip(compiled, eager):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)

    def test_forced_call_runs_on_cpu_but_auto_mode_leaves_cpu_to_the_cpu_paths():
        q = torch.randn(1, 2, 17, 16)
        settings = resolve_settings("squared")
        call = make_call(q, q, q, settings, constant_heads(settings, 2, head_dim=q.shape[-1]), None, True, None)
        out, w, path = attend(call, path="triton")
        assert path == "triton" and w is None and out.shape == (1, 2, 17, 16)
        ref, _, _ = attend(call, path="reference")
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert "triton" in paths_for("squared") and "triton" not in candidate_paths(call)
        assert attend(call)[2] != "triton"

    def test_all_rows_masked_gives_zeros_and_zero_gradients():
        for name in NAMES:
            q = torch.randn(2, 2, 17, 16, requires_grad=True)
            kv = torch.randn(2, 1, 20, 16, requires_grad=True)
            keep = torch.zeros(2, 1, 17, 20, dtype=torch.bool)
            out, _ = attention(q, kv, kv, name, attention_mask=keep, path="triton")
            assert (out == 0).all(), name
            gq, gkv = torch.autograd.grad(out.sum(), (q, kv))
            assert (gq == 0).all() and (gkv == 0).all(), name

    @pytest.mark.parametrize("family", ["llama", "gpt2"])
    def test_model_with_padding_matches_reference(family, monkeypatch):
        """A whole tiny model (llama: GQA; both causal, left padding through transformers' mask function), forward
        and the gradients of every parameter, with every attention call forced onto the Triton path."""
        from conftest import model_output, tiny

        name = "symax"
        model = tiny(family, "causal_lm", name, attnorm={"eta_learnable": True})
        ids = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(0))
        mask = torch.ones(2, 19, dtype=torch.long)
        mask[1, :6] = 0
        from hf_attnorm.kernels import set_forced_path

        grads = {}
        try:
            for path in ("reference", "triton"):
                set_forced_path(path)
                model.zero_grad()
                out = model_output(model(input_ids=ids, attention_mask=mask))
                (out[mask.bool()] ** 2).mean().backward()
                grads[path] = (out.detach(),
                               {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        finally:
            set_forced_path()
        from conftest import LAST_CALL

        assert LAST_CALL.path == "triton"
        (o_ref, g_ref), (o_tri, g_tri) = grads["reference"], grads["triton"]
        live = mask.bool()
        torch.testing.assert_close(o_tri[live], o_ref[live], atol=2e-5, rtol=1e-4)
        assert g_ref.keys() == g_tri.keys() and any("attnorm.symax_eta" in n for n in g_ref)
        for n in g_ref:
            torch.testing.assert_close(g_tri[n], g_ref[n], atol=2e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
