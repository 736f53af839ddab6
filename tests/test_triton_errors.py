"""Failures of the Triton kernels say what failed, on which device, and how to run another path (never a silent
fallback): a compile or launch error inside any Triton kernel of any Triton path, and a GPU below the supported
compute capability, raise ``TritonKernelError`` naming the kernel, the device and ``HF_ATTNORM_PATH=chunked``.

The compile failure is simulated on the CPU under Triton's interpreter (a child pytest process with
``TRITON_INTERPRET=1``, as tests/test_triton.py), generic over the registered Triton paths; the device check runs in
the normal process with the CUDA queries monkeypatched.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

pytest.importorskip("triton")

from numerics import run_interpreted  # noqa: E402

from hf_attnorm.attention import attention  # noqa: E402
from hf_attnorm.kernels import (  # noqa: E402
    PATHS,
    declared_normalizers,
    triton_common,  # noqa: E402
)
from hf_attnorm.kernels.fused import triton as ta  # noqa: E402
from hf_attnorm.kernels.fused import triton_device  # noqa: E402

INTERPRETED = ta.interpreter_requested()
HERE = os.path.abspath(__file__)
#: every registered path whose kernel lives in a Triton module (kernels/triton_*.py)
TRITON_PATHS = sorted(n for n, p in PATHS.items() if p.kernel.__module__.rsplit(".", 1)[-1].startswith("triton"))


def test_every_triton_path_is_found():
    assert {"triton", "selective_triton", "stickbreaking_triton"} <= set(TRITON_PATHS)


class _FailingKernel:
    """Stands in for a jitted kernel: indexing with a grid and calling raises what a Triton compile error raises."""

    def __init__(self, real):
        self.fn = real.fn
        self.arg_names = real.arg_names
        self.launched = 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launched += 1
            raise RuntimeError("PassManager::run failed\n(simulated compile failure)")
        return run


def _module_of(path: str) -> types.ModuleType:
    return sys.modules[PATHS[path].kernel.__module__]


def _inputs(path: str):
    name = declared_normalizers(path)[0]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=g) for _ in range(3))
    return name, q, k, v


if not INTERPRETED:

    @pytest.mark.long
    def test_interpreted_error_tests():
        """The tests below that need Triton's interpreter, in a child process with TRITON_INTERPRET=1."""
        out = run_interpreted(HERE, timeout=900)
        assert f"{len(TRITON_PATHS) + 2} passed" in out, out[-2000:]

    def test_old_gpu_is_refused_naming_device_and_escape(monkeypatch):
        """A GPU below MIN_CAPABILITY (simulated: the CUDA queries monkeypatched) is refused with the device named."""
        monkeypatch.setattr(torch.version, "hip", None)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 5))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Tesla T4")
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        dev = torch.device("cuda", 0)
        assert ta.describe_device(dev) == "cuda:0 (Tesla T4, compute capability 7.5)"
        assert "compute capability 7.5 is below 8.0" in ta.device_problem(dev)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
        assert ta.device_problem(dev) is None

    def test_launch_turns_any_failure_into_a_clear_error(monkeypatch):
        """``launch`` itself, with a stand-in kernel (no interpreter needed): the message's first line names the
        kernel, the device, the cause and the escape; the original error is chained."""
        real = types.SimpleNamespace(fn=triton_device._fwd_kernel, arg_names=())
        fake = _FailingKernel(real)
        with pytest.raises(ta.TritonKernelError) as info:
            ta.launch(fake, (1,))(torch.zeros(2))
        first = str(info.value).splitlines()[0]
        assert "hf_attnorm.kernels.fused.triton_device._fwd_kernel failed to compile or launch on cpu" in first
        assert "RuntimeError: PassManager::run failed" in first and "HF_ATTNORM_PATH=chunked" in first
        assert isinstance(info.value.__cause__, RuntimeError) and fake.launched == 1
        # (patched where launch looks it up: every Triton family shares triton_common's launch)
        monkeypatch.setattr(triton_common, "device_problem", lambda device: "simulated unsupported device")
        with pytest.raises(ta.TritonKernelError, match="cannot run on cpu .*simulated unsupported device.*"
                                                       "HF_ATTNORM_PATH=chunked"):
            ta.launch(fake, (1,))(torch.zeros(2))
        assert fake.launched == 1  # refused before launching


if INTERPRETED:

    @pytest.fixture(autouse=True)
    def _small_blocks(monkeypatch):
        for path in TRITON_PATHS:
            monkeypatch.setattr(_module_of(path), "BLOCK_OVERRIDE", (16, 16))

    @pytest.mark.parametrize("path", TRITON_PATHS)
    def test_compile_failure_names_kernel_device_and_escape(path, monkeypatch):
        """Every kernel of the path's namespace replaced by one that fails as a compile error does: the forced call
        raises TritonKernelError (not a fallback), and after the patch is undone the interpreter path runs."""
        module = _module_of(path)
        real = module._compiled()
        failing = {n: _FailingKernel(f) for n, f in vars(real).items() if n.endswith("_kernel")}
        assert failing, f"{module.__name__} has no jitted kernels"
        name, q, k, v = _inputs(path)
        with monkeypatch.context() as m:
            # (the fused maps' _compiled takes the map table; the other families' none)
            m.setattr(module, "_compiled", lambda *table: types.SimpleNamespace(**{**vars(real), **failing}))
            with pytest.raises(ta.TritonKernelError) as info:
                attention(q, k, v, name, causal=True, path=path)
        first = str(info.value).splitlines()[0]
        # (the fused maps' kernels are defined in triton_device.py beside the host module)
        assert (f"Triton kernel {module.__name__}._" in first or f"Triton kernel {module.__name__}_device._" in first)
        assert "cpu (Triton interpreter)" in first
        assert "PassManager::run failed" in first and "HF_ATTNORM_PATH=chunked" in first
        assert sum(f.launched for f in failing.values()) == 1
        out, _ = attention(q, k, v, name, causal=True, path=path)  # the real kernels again
        ref, _ = attention(q, k, v, name, causal=True, path="reference")
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)

    def test_interpreter_runs_every_triton_path():
        for path in TRITON_PATHS:
            name, q, k, v = _inputs(path)
            assert attention(q, k, v, name, causal=True, path=path)[0].isfinite().all(), path
