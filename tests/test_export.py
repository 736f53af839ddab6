"""Export (docs/export.md): ``torch.export`` with a dynamic sequence length, a saved program reloaded in a fresh
process, and ONNX (``torch.onnx.export(..., dynamo=True)`` run by onnxruntime) against eager, for every registered
implementation on a tiny Llama (GQA, left padding). Generic over the registry: a new implementation is covered with
no edits here."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import LAST_CALL, first_implementations, has_memory
from family_zoo import V, build
from torch.export import Dim

from hf_attnorm.kernels import PATHS, set_forced_path
from hf_attnorm.kernels.fused import cpu as fused_cpu
from hf_attnorm.registry import NORMALIZERS, PRESETS, SCALES
from hf_attnorm.settings import resolve_settings
from hf_attnorm.torch_compat import DYNAMIC_EXPORT, DYNAMIC_EXPORT_FEATURE

IMPLS = list(PRESETS)
#: the default run's representatives (every implementation runs in the slow twins): a fused C++ normalizer, a
#: sort-based one whose chunked path picked block sizes from the length, selective (query-coupled), softmax (SDPA)
FAST = [i for i in ("symax", "entmax15", "selective", "softmax") if i in IMPLS]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_ONNX = all(importlib.util.find_spec(m) for m in ("onnx", "onnxscript", "onnxruntime"))
#: non-strict tracing, pinned rather than left to torch's default: strict tracing (Dynamo) cannot trace transformers'
#: model wrappers ("Unsupported: call_method ... co_varnames __contains__"), and only non-strict tracing tells
#: hf_attnorm it is exporting (torch_compat.is_exporting)
STRICT = False
needs_onnx = pytest.mark.skipif(not HAS_ONNX, reason="onnx, onnxscript and onnxruntime are not installed "
                                "(pip install -e '.[dev]')")


class Logits(torch.nn.Module):
    """(input_ids [B, L], attention_mask [B, L]) -> logits [B, L, V], no cache."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def _batch(length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows, the first left-padded by 3 tokens."""
    ids = torch.randint(3, V, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids, mask


def _custom_ops(ep: torch.export.ExportedProgram) -> set[str]:
    return {str(n.target) for n in ep.graph.nodes if n.op == "call_function" and "hf_attnorm" in str(n.target)}


def _live(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return out[mask.bool()]


def _check_dynamic_export(impl: str) -> None:
    wrapped = Logits(build("llama", impl))
    with torch.no_grad():
        wrapped(*_batch(12))  # an eager call first: it must not leave a length-specialising choice behind
    seq = Dim("seq", min=4, max=64)
    ep = torch.export.export(wrapped, _batch(12), dynamic_shapes={"input_ids": {1: seq}, "attention_mask": {1: seq}},
                             strict=STRICT)
    assert not _custom_ops(ep), "the automatic rule must export portable PyTorch paths only"
    for length in (7, 23):
        ids, mask = _batch(length, seed=length)
        LAST_CALL.path = ""
        with torch.no_grad():
            eager = wrapped(ids, mask)
        assert LAST_CALL.path, "the eager call did not go through hf_attnorm"
        got = ep.module()(ids, mask)
        err = (_live(got, mask) - _live(eager, mask)).abs().max().item()
        assert err <= 1e-5, f"{impl}: exported at length {length} differs from eager by {err:.3g}"


@pytest.mark.parametrize("impl", FAST)
def test_dynamic_sequence_length_export(impl):
    if not DYNAMIC_EXPORT:  # older torch: the feature says which torch it needs, in its first line
        with pytest.raises(Exception, match=re.escape(DYNAMIC_EXPORT_FEATURE.message().split(";")[0])):
            _check_dynamic_export(impl)
        return
    _check_dynamic_export(impl)


def _per_normalizer() -> list[str]:
    """The first implementation of each normalizer (and one with learned memory key/values), FAST excluded: the other
    implementations of a normalizer differ by their scale, whose ops ``test_every_scale_exports_to_onnx`` exports on
    their own."""
    return [i for i in first_implementations(lambda s: (s.normalizer, has_memory(s))) if i not in FAST]


@pytest.mark.slow
@pytest.mark.parametrize("impl", _per_normalizer())
def test_dynamic_sequence_length_export_every_implementation(impl):
    _check_dynamic_export(impl)


#: an implementation whose normalizer the fused C++ kernels take (the first such preset in the registry)
FUSED_IMPL = next(p for p in IMPLS
                  if PATHS["fused_cpu"].takes(NORMALIZERS.get(resolve_settings(p, {}).normalizer)) is None)

_RELOAD = """
import sys, torch
import hf_attnorm  # registers the hf_attnorm_fused ops: nothing is built here
from hf_attnorm.kernels.native import EXTENSIONS
assert EXTENSIONS and all(e.ops is None for e in EXTENSIONS.values()), "import hf_attnorm must build no C++ extension"
ep = torch.export.load(sys.argv[1])
ids, mask, want = torch.load(sys.argv[2])
got = ep.module()(ids, mask)
err = (got - want).abs().max().item()
assert err <= 1e-6, err
print("reloaded", err)
"""


@pytest.mark.skipif(fused_cpu.unavailable_reason() is not None, reason="fused CPU kernels unavailable")
def test_program_with_a_fused_op_reloads_in_a_fresh_process(tmp_path):
    """A program exported on a forced fused path holds ``hf_attnorm_fused`` ops; ``import hf_attnorm`` alone makes
    them resolvable in a new process (schemas and shape functions are registered at import; the C++ extension is
    built on the first call)."""
    wrapped = Logits(build("llama", FUSED_IMPL))
    ids, mask = _batch(12)
    set_forced_path("fused_cpu")
    try:
        ep = torch.export.export(wrapped, (ids, mask), strict=STRICT)
    finally:
        set_forced_path()
    assert "hf_attnorm_fused.forward.default" in _custom_ops(ep)
    with torch.no_grad():
        want = wrapped(ids, mask)
    torch.export.save(ep, tmp_path / "program.pt2")
    torch.save((ids, mask, want), tmp_path / "inputs.pt")
    (tmp_path / "reload.py").write_text(_RELOAD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, str(tmp_path / "reload.py"), str(tmp_path / "program.pt2"),
                          str(tmp_path / "inputs.pt")], capture_output=True, text=True, timeout=600, env=env,
                         cwd=tmp_path)
    assert res.returncode == 0 and "reloaded" in res.stdout, res.stderr[-3000:]


def _onnx_run(module: torch.nn.Module, args: tuple[torch.Tensor, ...], tmp_path) -> list:
    import onnxruntime

    path = tmp_path / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), dynamo=True, verbose=False)
    runtime = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in runtime.get_inputs()]
    return runtime.run(None, {n: a.numpy() for n, a in zip(names, args)})


def _check_onnx(impl: str, tmp_path) -> None:
    wrapped = Logits(build("llama", impl))
    ids, mask = _batch(12)
    LAST_CALL.path = ""
    with torch.no_grad():
        eager = wrapped(ids, mask)
    assert LAST_CALL.path, "the eager call did not go through hf_attnorm"
    (got,) = _onnx_run(wrapped, (ids, mask), tmp_path)
    err = (_live(torch.from_numpy(got), mask) - _live(eager, mask)).abs().max().item()
    assert err <= 1e-5, f"{impl}: onnxruntime differs from eager by {err:.3g}"


@needs_onnx
@pytest.mark.parametrize("impl", FAST)
def test_onnx_runtime_equals_eager(impl, tmp_path):
    _check_onnx(impl, tmp_path)


@needs_onnx
@pytest.mark.slow
@pytest.mark.parametrize("impl", _per_normalizer())
def test_onnx_runtime_equals_eager_every_implementation(impl, tmp_path):
    _check_onnx(impl, tmp_path)


class _ScaledSoftmax(torch.nn.Module):
    """Softmax attention with one length-aware scale on plain tensors, a padding x causal mask."""

    def __init__(self, scale: str) -> None:
        super().__init__()
        self.settings = resolve_settings("softmax", {"scale": scale})

    def forward(self, q, k, v, keep):
        from hf_attnorm.attention import attention

        return attention(q, k, v, self.settings, attention_mask=keep, causal=True,
                         module_info={"max_positions": 4, "head_dim": q.shape[-1], "num_heads": q.shape[1]})[0]


@needs_onnx
@pytest.mark.slow
@pytest.mark.parametrize("scale", sorted(SCALES))
def test_every_scale_exports_to_onnx(scale, tmp_path):
    """Each scale's multiplier translated to ONNX (onnxruntime equals eager): the model-level tests above run one
    implementation per normalizer."""
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(2, 4, 9, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g), torch.randn(2, 2, 9, 8,
                                                                                                    generator=g)
    keep = torch.ones(2, 1, 9, 9, dtype=torch.bool).tril()
    keep[0, :, :, :3] = False
    keep[0, :, :3, :] = torch.eye(3, 9, dtype=torch.bool)  # (padded rows see themselves: no empty row)
    module = _ScaledSoftmax(scale)
    want = module(q, k, v, keep)
    (got,) = _onnx_run(module, (q, k, v, keep), tmp_path)
    torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-5, rtol=1e-5, msg=scale)


class _FlashGQA(torch.nn.Module):
    """SDPA's CPU flash kernel (what the sdpa path calls with a mask or a sink) with 4 query heads on 2 key/value
    heads and a float mask: no hf_attnorm involved."""

    def forward(self, q, k, v, mask):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                          scale=0.3)[0]


@needs_onnx
def test_torch_onnx_still_mistranslates_gqa_flash_sdpa_with_a_mask(tmp_path):
    """The bug ``sdpa_rewrite.sdpa_attention`` works around (torch 2.13) by not calling the CPU flash op under
    export: when this test fails, torch translates it correctly and the workaround can go."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g)
    k, v = torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    mask = torch.zeros(2, 1, 6, 6).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    want = _FlashGQA()(q, k, v, mask)
    try:
        (got,) = _onnx_run(_FlashGQA(), (q, k, v, mask), tmp_path)
    except Exception as e:  # onnxruntime rejects the graph ("MatMul ... Incompatible dimensions")
        assert "Incompatible dimensions" in str(e), e
        return
    err = (torch.from_numpy(got) - want).abs().max().item()
    assert err > 1e-4, (f"torch.onnx now translates GQA flash SDPA with a mask correctly (error {err:.3g}): the "
                        "CPU flash op can run under export again (hf_attnorm/kernels/sdpa_rewrite.py)")


@needs_onnx
def test_forced_chunked_path_exports_to_onnx(tmp_path):
    """Forcing the pure-PyTorch chunked path (HF_ATTNORM_PATH=chunked) under export traces its chunk loop, at the
    exported length (it used to refuse with a message about torch.compile)."""
    impl = next(i for i in FAST if PATHS["chunked"].takes(NORMALIZERS.get(resolve_settings(i, {}).normalizer)) is None)
    wrapped = Logits(build("llama", impl))
    ids, mask = _batch(12)
    with torch.no_grad():
        eager = wrapped(ids, mask)
    set_forced_path("chunked")
    try:
        (got,) = _onnx_run(wrapped, (ids, mask), tmp_path)
    finally:
        set_forced_path()
    err = (_live(torch.from_numpy(got), mask) - _live(eager, mask)).abs().max().item()
    assert err <= 1e-5, err
