"""The GPU check's machinery on a CPU (scripts/gpu_check.sh, scripts/gpu_setup.py, hf_attnorm.lab.speed.gpu_check): the
install plan against the torch installed here, the benchmark's dry run at a toy size, the suite's result parsing
and, slow, the whole dry run (setup plan, the gpu suite collected with its skip reasons, benchmark, files)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_attnorm.kernels import declared_normalizers
from hf_attnorm.lab.speed import gpu_anchors, gpu_check
from hf_attnorm.registry import NORMALIZERS

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_setup", ROOT / "scripts" / "gpu_setup.py")
gpu_setup = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("gpu_setup", gpu_setup)  # (its dataclass looks its module up there)
_spec.loader.exec_module(gpu_setup)

FUSED = declared_normalizers("triton")[0]  # a normalizer with a Triton kernel (first of the registry)
BARE = {"torch": None, "triton": None, "transformers": None, "pytest": None, "pytest-xdist": None, "numpy": None,
        "flash-attn": None, "setuptools": None, "hf_attnorm": None, "python": "3.12.3", "torch_cuda_build": None,
        "cuda_available": False, "device_count": 0}
#: the GPU machine's image (docs/triton.md)
GPU_IMAGE = {**BARE, "torch": "2.11.0+cu130", "torch_cuda_build": "13.0", "cuda_available": True, "device_count": 1,
             "triton": "3.6.0", "transformers": "5.17.0", "pytest": "9.1.1", "pytest-xdist": "3.8.0",
             "numpy": "2.5.2", "setuptools": "80.0"}


def _verdicts(env: dict, dry_run: bool = False) -> dict[str, tuple[bool, bool]]:
    return {c.name: (c.ok, c.required) for c in gpu_setup.checks(env, dry_run)}


def test_setup_never_asks_an_index():
    """Every pip call the plan can make is offline: --no-index, and the environment switches any index off."""
    steps = gpu_setup.plan(BARE, wheels=ROOT / "tests", flash_attn=True)
    assert [s.name for s in steps] == ["wheels", "hf_attnorm"]
    assert all("--no-index" in s.pip_args for s in steps)
    assert "--no-deps" in steps[1].pip_args and "--no-build-isolation" in steps[1].pip_args
    assert gpu_setup.OFFLINE_ENV["PIP_NO_INDEX"] == "1"
    assert "install" not in " ".join(a for s in steps for a in s.pip_args if a.startswith(("torch", "triton")))


def test_setup_accepts_the_gpu_images_versions_and_installs_only_the_checkout():
    verdicts = _verdicts(GPU_IMAGE)
    assert all(ok for ok, _ in verdicts.values()), verdicts
    assert [s.name for s in gpu_setup.plan(GPU_IMAGE)] == ["hf_attnorm"]
    here = {**GPU_IMAGE, "hf_attnorm": str(ROOT / "hf_attnorm" / "__init__.py")}
    assert gpu_setup.plan(here) == []  # already this checkout


def test_setup_refuses_what_it_cannot_fix_offline_with_the_reason():
    old = {**GPU_IMAGE, "torch": "2.5.1", "transformers": "5.3.0", "pytest": None}
    found = {c.name: c for c in gpu_setup.checks(old)}
    assert not found["torch"].ok and f"needs torch >= {gpu_setup.supported.MIN_TORCH}" in found["torch"].message
    assert not found["transformers"].ok and "--wheels" in found["transformers"].message
    assert not found["pytest"].ok and found["pytest"].required
    cpu = {**GPU_IMAGE, "torch_cuda_build": None}
    assert _verdicts(cpu)["torch"] == (False, True) and _verdicts(cpu, dry_run=True)["torch"] == (True, True)
    # optional pieces are warnings: no triton, no xdist, an old triton's interpreter beside numpy >= 2.4
    lean = {**GPU_IMAGE, "triton": None, "pytest-xdist": None}
    assert _verdicts(lean)["triton"] == (False, False) and _verdicts(lean)["pytest-xdist"] == (False, False)
    assert _verdicts(GPU_IMAGE, dry_run=True)["numpy"] == (False, False)
    assert "numpy" not in _verdicts({**GPU_IMAGE, "numpy": "2.3.5"}, dry_run=True)


def test_setup_against_the_python_running_this_test():
    """The probe reads this interpreter's versions; the checks agree with supported.py about them."""
    env = gpu_setup.probe(sys.executable)
    assert env["torch"] == torch.__version__ and env["cuda_available"] == torch.cuda.is_available()
    assert _verdicts(env, dry_run=True)["torch"] == (True, True)


def test_setup_dry_run_prints_the_plan_and_installs_nothing(tmp_path):
    record = tmp_path / "setup.json"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_setup.py"), "--dry-run", "--record",
                          str(record), "--quick"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    rec = json.loads(record.read_text())
    assert rec["dry_run"] and rec["offline"] and not any(s["ran"] for s in rec["steps"])
    for step in rec["steps"]:
        assert f"would run: {step['command']}" in res.stdout
    assert f"ok: torch {torch.__version__.split('+')[0]}" in res.stdout.replace("+cpu", "")


def test_wheels_folder_must_exist(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_setup.parse_args(["--wheels", str(tmp_path / "missing")])
    assert "not a folder" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_check_without_cuda_refuses_and_points_at_dry_run(capsys, tmp_path):
    assert gpu_check.main(["--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--dry-run" in err and not (tmp_path / "out").exists()


def test_unknown_rows_and_phases_are_errors(capsys):
    for argv, what in ((["--rows", "nope"], "unknown rows ['nope']"), (["--phases", "bench,x"], "--phases takes")):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(argv)
        assert what in capsys.readouterr().err


def test_grids_cover_the_requested_ranges():
    full = gpu_check.grid("full")
    assert {s.d for s in full} == {64, 128} and {s.causal for s in full} == {True, False}
    assert min(s.n for s in full) == 1024 and max(s.n for s in full) == 16384
    assert {s.B for s in full} <= set(range(1, 9)) and {1, 8} <= {s.B for s in full}
    assert all(8 <= s.H <= 32 for s in full + gpu_check.grid("quick"))
    assert len(gpu_check.grid("quick")) < len(full)


def test_benchmark_dry_run_writes_json_markdown_and_command(tmp_path):
    """The benchmark machinery at the dry run's toy size on the CPU: every (shape, row) measured, the path recorded,
    the ratio to SDPA computed, and the files written."""
    rows = ["sdpa", FUSED]
    assert gpu_check.main(["--dry-run", "--out-dir", str(tmp_path), "--phases", "bench", "--rows", *rows]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    recs = result["bench"]["records"]
    assert len(recs) == len(gpu_check.grid("dry-run")) * len(rows)
    for r in recs:
        assert r["status"] == "ok", r
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_tflops"] > 0
        assert r["path"] == ("sdpa" if r["row"] == "sdpa" else "fused_cpu")
        assert r["fwd_vs_sdpa"] is not None and r["fwd_bwd_vs_sdpa"] is not None
    assert result["versions"]["torch"] == torch.__version__ and result["device"]["name"] == "cpu"
    md = (tmp_path / "results.md").read_text()
    assert "| shape | row | path |" in md and f"| {FUSED} | fused_cpu |" in md
    assert (tmp_path / "command.txt").read_text().startswith("scripts/gpu_check.sh --dry-run")
    assert set(os.listdir(tmp_path)) == {"results.json", "results.md", "command.txt"}
    anchors = [gpu_anchors.row_name(a) for a in gpu_anchors.ANCHORS.values()]
    assert gpu_check.bench_rows(False) == ["sdpa", *anchors, *NORMALIZERS]  # every normalizer and anchor


def test_anchors_are_recorded_as_not_run_where_they_cannot_run(tmp_path):
    """On a CPU (or without their wheels) the anchors' rows say why they did not run; nothing fails."""
    rows = ["sdpa", "anchor:fla_forgetting_attn", "anchor:flex_ssmax"]
    assert gpu_check.main(["--dry-run", "--out-dir", str(tmp_path), "--phases", "bench", "--rows", *rows]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["bench"]["anchors"]) == set(gpu_anchors.ANCHORS)
    anchor_recs = [r for r in result["bench"]["records"] if r["row"] != "sdpa"]
    assert anchor_recs and all(r["status"].startswith("not run: a GPU kernel") for r in anchor_recs), anchor_recs
    assert {tuple(r["anchor_of"]) for r in anchor_recs} == {("fox",), ("ssmax",)}


def test_every_anchor_names_implementations_that_exist():
    import hf_attnorm

    for anchor in gpu_anchors.ANCHORS.values():
        assert anchor.of and set(anchor.of) <= set(hf_attnorm.available()), anchor


def test_the_quick_grid_holds_the_goal_shapes():
    """The GPU goals hold from n = 2048 (goals.GPU_GOAL_FROM): the quick grid measures there, at d 64 and 128."""
    from hf_attnorm.lab.speed import goals as speed_goals

    quick = gpu_check.grid("quick")
    at_goal = [s for s in quick if s.n >= speed_goals.GPU_GOAL_FROM]
    assert {s.d for s in at_goal} == {64, 128} and all(s.causal and s.dtype == "bf16" for s in quick)


def test_suite_results_parse_from_junit_and_from_a_cut_log(tmp_path):
    xml = tmp_path / "suite.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.test_gpu" name="a[x]"/>'
                   '<testcase classname="tests.test_gpu" name="b"><failure message="boom">tb</failure></testcase>'
                   '<testcase classname="tests.test_gpu" name="c"><skipped message="s"/></testcase>'
                   '</testsuite></testsuites>')
    log = "SKIPPED [3] tests/test_gpu.py:10: needs a CUDA GPU\n"
    got = gpu_check.parse_suite(log, xml)
    assert got["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert got["failures"] == [{"test": "tests.test_gpu::b", "message": "boom"}]
    assert got["skip_reasons"] == [{"count": 3, "where": "tests/test_gpu.py:10", "reason": "needs a CUDA GPU"}]
    cut = ("tests/test_gpu.py::test_a[x] PASSED [ 1%]\n"
           "[gw1] [ 2%] FAILED tests/test_gpu.py::test_b[y-z]\n")  # plain and pytest-xdist verbose lines
    got = gpu_check.parse_suite(cut, None)
    assert got["counts"] == {"passed": 1, "failed": 1}
    assert got["failures"][0]["test"] == "tests/test_gpu.py::test_b[y-z]"


@pytest.mark.slow
def test_whole_dry_run_through_the_shell_command(tmp_path):
    """scripts/gpu_check.sh --dry-run: the setup planned (nothing installed), the gpu suite collected and every test
    skipped with the reason, the benchmark at toy size, everything under the output directory."""
    env = {**os.environ, "PYTHON": sys.executable}
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out-dir", str(tmp_path),
                          "--rows", "sdpa", FUSED], capture_output=True, text=True, timeout=1200, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["setup"]["dry_run"] and not any(s["ran"] for s in result["setup"]["steps"])
    suite = result["suite"]
    assert suite["counts"].get("skipped", 0) > 0 and set(suite["counts"]) == {"skipped"}
    assert sum(s["count"] for s in suite["skip_reasons"]) == suite["counts"]["skipped"]
    assert all("needs a CUDA GPU" in s["reason"] for s in suite["skip_reasons"])
    assert {r["row"] for r in result["bench"]["records"]} == {"sdpa", FUSED}
    assert "## Setup" in (tmp_path / "results.md").read_text()
