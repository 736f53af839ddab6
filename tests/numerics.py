"""Test numerics shared by the kernel test files: a fast path's error against a float64 reference, judged by the
reference path's own error in the same dtype; and the child-process runner for the tests that need Triton's
interpreter (``TRITON_INTERPRET=1`` must be set before anything imports triton).

Criterion per tensor (max abs over all entries): ``err(path) <= factor x err(baseline) + atol``, plus, where a
caller passes ``relative``, that fraction of the float64 value's largest magnitude. The baseline is the reference
path in the same dtype (which computes fp16/bf16 in fp32 inside) or, for half precision, the larger of its error and
that of ``low_precision_reference``: FlashAttention's own criterion, a PyTorch computation with the rounding points
of a half-precision kernel (scores and weights rounded to the input dtype, the products in it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from hf_attnorm.kernels.base import AttnCall, normalize, repeat_kv
from hf_attnorm.kernels.reference import reference_scores
from hf_attnorm.kernels.variants import finish

ROOT = Path(__file__).resolve().parents[1]


def max_abs_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| in float64 (0 for empty tensors)."""
    if want.numel() == 0:
        return 0.0
    return (got.double() - want.double()).abs().max().item()


def low_precision_reference(call: AttnCall) -> torch.Tensor:
    """out [B, H, Lq, Dv] in the call's dtype as a half-precision kernel rounds: the scores (with their score
    modifiers) rounded to the input dtype, the normalizer's weights from them in fp32 rounded to the input dtype (the
    softmax family: torch.softmax in the input dtype, as FlashAttention's own reference), their product with v in the
    input dtype. Differentiable (autograd's backward rounds dW in the input dtype as well)."""
    dt = call.q.dtype
    keep = call.mask.dense(call.q.device)
    if call.normalizer.kernel_family == "softmax" and call.sinks is None and call.normalizer.sink_logit(
            call.ctx()) is None:
        # softmax itself: FlashAttention's reference exactly (torch.softmax on the half-precision scores, its
        # backward on the half-precision weights and their gradient)
        scores = reference_scores(call).to(dt).masked_fill(~keep, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        weights = torch.where(keep.any(-1, keepdim=True), weights, torch.zeros((), dtype=dt, device=scores.device))
    else:
        scores = reference_scores(call).to(dt).float()
        weights = normalize(call.normalizer, scores, keep, call.ctx(), call.sinks)
    out = weights.to(dt) @ repeat_kv(call.v, call.groups).to(dt)
    return out if call.around is None else finish(call, out, None)[0]  # (memory rows, the gate: as attend)


def assert_within_reference_error(label: str, got: torch.Tensor, ref: torch.Tensor | list[torch.Tensor],
                                  exact: torch.Tensor, factor: float, atol: float, relative: float = 0.0) -> None:
    """``got`` (the path under test) and ``ref`` (the reference path, same dtype; or a list of baselines, the
    largest error counts) against ``exact`` (float64)."""
    assert torch.isfinite(got).all(), f"{label}: non-finite values"
    refs = ref if isinstance(ref, (list, tuple)) else [ref]
    err, base = max_abs_error(got, exact), max(max_abs_error(r, exact) for r in refs)
    slack = atol + (relative * exact.abs().max().item() if relative and exact.numel() else 0.0)
    assert err <= factor * base + slack, (f"{label}: error {err:.3e} > {factor} x reference error {base:.3e} + "
                                          f"{slack:.3g}")


def assert_all_within_reference_error(label: str, got: Mapping[str, torch.Tensor | None],
                                      ref: Mapping[str, torch.Tensor | None] | list[Mapping[str, torch.Tensor | None]],
                                      exact: Mapping[str, torch.Tensor | None], factor: float, atol: float,
                                      relative: Mapping[str, float] | None = None) -> None:
    """The same per named tensor (out, dq, ...): the names must agree, and a tensor missing (None) from the float64
    run must be missing from the path under test too. ``ref``: one baseline run or a list of them (the largest error
    per tensor counts). ``relative``: per name, see assert_within_reference_error."""
    refs = ref if isinstance(ref, (list, tuple)) else [ref]
    assert set(got) == set(exact), f"{label}: {sorted(got)} vs {sorted(exact)}"
    for key, want in exact.items():
        if want is None:
            assert got[key] is None, f"{label}: {key} has a gradient on this path only"
            continue
        assert got[key] is not None, f"{label}: no gradient for {key}"
        assert all(r[key] is not None for r in refs), f"{label}: a baseline gave no {key}"
        assert_within_reference_error(f"{label}: {key}", got[key], [r[key] for r in refs], want, factor, atol,
                                      (relative or {}).get(key, 0.0))


def run_interpreted(test_file: str, marker: str | None = None, timeout: float = 1500,
                    allow_skips: bool = False) -> str:
    """Run ``test_file`` (its tests with ``marker``) in a child pytest process with ``TRITON_INTERPRET=1``. Fails
    when the child fails, runs no test, or (unless ``allow_skips``) skips any: a child whose tests all skip would
    otherwise pass silently. Returns the child's output."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", test_file, "-q", "-rs", "-p", "no:cacheprovider"]
    if marker is not None:
        cmd += ["-m", marker]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    tail = f"{' '.join(cmd)}:\n{res.stdout[-8000:]}\n{res.stderr[-3000:]}"
    assert res.returncode == 0, f"interpreted Triton tests failed: {tail}"
    summary = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 0, f"the interpreted child ran no test: {tail}"
    if not allow_skips:
        assert "skipped" not in summary, f"the interpreted child skipped tests: {tail}"
    return res.stdout
