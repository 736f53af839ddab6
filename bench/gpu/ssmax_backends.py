"""Errors of one implementation's gradients against float64 with each SDPA backend forced (a CUDA GPU; run from the
repository root): ``python bench/gpu/ssmax_backends.py [implementation ...]`` (default: ssmax softmax). Prints per
case and backend the max abs error of each tensor, the reference path's error in the same dtype, and the largest
magnitude of the float64 value. Used for bench/gpu/NVIDIA_H100_80GB_HBM3/2026-11-27-ef50fad/README.md."""

from __future__ import annotations

import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, "tests")
import test_gpu  # noqa: E402  (the GPU test's inputs and scenarios)

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
CASES = (("causal-gqa", "bf16", 128), ("padding-causal", "fp32", 64))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def main(implementations: list[str]) -> None:
    test_gpu.DEV = "cuda"
    for impl in implementations:
        for scen, dtype_name, head_dim in CASES:
            dtype = test_gpu.DTYPES[dtype_name]
            ref64, _, _ = test_gpu._run(impl, scen, torch.float64, head_dim, "reference")
            ref, _, _ = test_gpu._run(impl, scen, dtype, head_dim, "reference")
            for backend in ("auto", *BACKENDS):
                try:
                    if backend == "auto":
                        got, ran, _ = test_gpu._run(impl, scen, dtype, head_dim, None)
                    else:
                        with sdpa_kernel(BACKENDS[backend]):
                            got, ran, _ = test_gpu._run(impl, scen, dtype, head_dim, None)
                except RuntimeError as exc:  # the backend does not take these inputs
                    print(impl, scen, dtype_name, backend, "not available:", str(exc)[:80])
                    continue
                cells = [f"{key}: {_err(got[key], want):.3g} (ref {_err(ref[key], want):.3g}, |max| "
                         f"{want.abs().max().item():.3g})" for key, want in ref64.items() if want is not None]
                print(impl, scen, dtype_name, backend, ran, " | ".join(cells), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["ssmax", "softmax"])
