"""The fused Triton kernels compiled ahead of time for an H100/H200 (sm_90) with the installed triton and its
bundled ptxas, no GPU needed (hf_attnorm/lab/speed/triton_ptx.py): every product of every kernel runs on tensor cores
(``wgmma``), no dot falls back to a loop of fp32 FMAs, for one map per kernel form, bf16 inputs. The registers and
spills ptxas reports come out as a warning (the CI log's warnings summary), so a change that makes a kernel spill is
seen. CI runs this with the main environment's triton and the GPU image's (triton 3.6.0)."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("triton")

from hf_attnorm.kernels.fused import triton as ta  # noqa: E402
from hf_attnorm.lab.speed import triton_ptx  # noqa: E402

#: the oldest triton whose ahead-of-time compile API (``ASTSource(..., constexprs=...)``) the check uses: the GPU
#: image's (3.6.0) and newer; older ones (the floor environment's 3.2.0) compile the kernels on a GPU only
MIN_TRITON = (3, 6)


@pytest.fixture(autouse=True, scope="module")
def _triton():
    if ta.interpreter_requested():
        pytest.skip("compiling for a GPU target needs triton in compiled mode (TRITON_INTERPRET is set)")
    ta._load_triton()
    import triton

    version = tuple(int(x) for x in triton.__version__.split(".")[:2])
    if version < MIN_TRITON:
        pytest.skip(f"the ahead-of-time sm_90 check needs triton >= {'.'.join(map(str, MIN_TRITON))} (its compile "
                    f"API); this is triton {triton.__version__}")


@pytest.mark.parametrize("map_name", triton_ptx.FORM_MAPS)
def test_every_product_runs_on_tensor_cores_for_sm90(map_name):
    reports = triton_ptx.check_forms((map_name,), "bf16", (64,), 90)
    assert len(reports) >= 3  # forward, dq, dk/dv (+ the threshold kernel)
    warnings.warn(f"sm_90 compile of the {map_name} kernels:\n{triton_ptx.markdown(reports)}", stacklevel=1)
    bad = [f"{r.kernel}: {r.problem}" for r in reports if r.problem]
    assert not bad, bad
    assert all(r.tensor_core >= r.dots for r in reports)


def test_the_check_sees_a_product_on_fma():
    """fp32 inputs with IEEE products compile to FMA loops on sm_90: the check must flag them (it can fail)."""
    report = triton_ptx.check_kernel("_fwd_kernel", "symax", dtype="fp32", head_dim=64, arch=90)
    assert report.problem is not None and "fp32 FMAs" in report.problem, report


def test_a_masked_call_compiles_on_tensor_cores_too():
    """A keep-mask (padding) takes the masked blocks of every kernel (MASKED_BLOCKS) and their block tables."""
    for kernel in ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"):
        report = triton_ptx.check_kernel(kernel, "sigmoid", "bf16", 64, 90, masked=True)
        assert report.problem is None, report
