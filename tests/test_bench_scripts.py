"""The benchmark scripts run end to end on tiny shapes: scripts/bench_kernels.py with its memory runs (a fresh
process per row) on a fused-kernel row whose scale needs the model's length (lssa) and forgetting attention on SDPA,
and scripts/bench_decode.py's implementation list."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import torch

import hf_attnorm

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str) -> dict:
    return runpy.run_path(str(ROOT / "scripts" / f"{name}.py"), run_name=f"bench_script_{name}")


def test_bench_kernels_writes_timings_errors_and_memory_for_each_kind_of_row(tmp_path, monkeypatch):
    rows = ["lssa", "fox"]
    monkeypatch.setattr(sys, "argv", ["bench_kernels.py"])
    bench = _script("bench_kernels")
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # main() sets the process's threads
    assert bench["main"](["--lengths", "32", "--heads", "2", "--head-dim", "8", "--repeats", "1", "--warmup", "0",
                          "--error-length", "16", "--max-reference-length", "32", "--memory", "--memory-length", "32",
                          "--memory-reference", "--threads", "1", "--no-plot", "--only", *rows,
                          "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_kernels.json").read_text())
    fast = {r["row"]: r for r in result["rows"] if r["path"] != "reference"}
    assert sorted(fast) == sorted(rows)
    assert fast["lssa"]["path"] in ("fused_cpu", "chunked") and fast["fox"]["path"] == "sdpa"
    assert all(r["fwd_ratio"] > 0 and r["max_err_vs_fp64"] < 1e-4 for r in fast.values())
    memory = {m["row"]: m for m in result["memory"]}
    assert sorted(memory) == sorted(rows) and all(m["extra_mb"] >= 0 for m in memory.values()), memory


def test_bench_decode_all_means_every_registered_implementation():
    curve_implementations = _script("bench_decode")["curve_implementations"]
    assert curve_implementations(["all"]) == list(hf_attnorm.available())
    assert curve_implementations(["softmax", "sdpa", "softmax", "linear_exact"]) == ["softmax", "linear_exact"]
