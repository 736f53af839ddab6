#!/usr/bin/env python
"""Install what the GPU check needs on a bare GPU machine, timing each step (called by scripts/gpu_check.sh).

Standard library only: it runs before torch exists. It probes the target Python (torch and whether it is a CUDA
build, triton, transformers, hf_attnorm, pytest, pytest-xdist, flash-attn), plans the missing steps and runs them:

* torch==2.13.0 from PyPI (its default Linux wheel is the CUDA build); a CPU-only build is uninstalled first
  (a ``+cpu`` local version satisfies ``==2.13.0``, so pip would keep it);
* triton==3.9.0 (the version the kernels are tested with);
* the package itself (``pip install -e .``, with its dependencies) when hf_attnorm or transformers is missing;
* pytest and pytest-xdist (the suite runs on several CPU processes: Triton compiles on the CPU);
* with ``--flash-attn``: FlashAttention-2 from a binary wheel only (compiling it takes far longer than the budget).

``--dry-run`` plans and prints, running nothing. ``--record`` writes the plan and each step's seconds, exit code and
output tail as JSON (hf_attnorm.lab.gpu_check merges it into its results).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"
TRITON = "triton==3.9.0"
TRITON_VERSION = TRITON.split("==")[1]

#: run in the target Python: what is installed (no import of anything that is missing)
PROBE = r"""
import importlib.util, json, importlib.metadata as md
def ver(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
info = {d: ver(d) for d in ("torch", "triton", "transformers", "pytest", "pytest-xdist", "flash-attn")}
info["hf_attnorm"] = importlib.util.find_spec("hf_attnorm") is not None
info["torch_cuda_build"] = None
info["cuda_available"] = False
info["device_count"] = 0
if info["torch"]:
    import torch
    info["torch_cuda_build"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    info["device_count"] = torch.cuda.device_count()
print(json.dumps(info))
"""


@dataclasses.dataclass
class Step:
    """One install step: the pip arguments, why it is needed, whether a failure stops the check."""

    name: str
    pip_args: list[str]
    why: str
    required: bool = True


def probe(python: str) -> dict:
    """What ``python`` has installed (see PROBE)."""
    res = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise SystemExit(f"gpu_setup: probing {python} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def plan(env: dict, flash_attn: bool = False) -> list[Step]:
    """The install steps ``env`` (a ``probe`` result) lacks, in order."""
    steps = []
    if not env.get("torch"):
        steps.append(Step("torch", ["install", TORCH], "torch is not installed; PyPI's Linux wheel is the CUDA build"))
    elif not env.get("torch_cuda_build"):
        steps.append(Step("torch-cpu-out", ["uninstall", "-y", "torch"],
                          f"the installed torch {env['torch']} is a CPU-only build (torch.version.cuda is None)"))
        steps.append(Step("torch", ["install", TORCH], "the CUDA build from PyPI replaces it"))
    if env.get("triton") != TRITON_VERSION:
        steps.append(Step("triton", ["install", TRITON],
                          f"triton {env.get('triton') or 'missing'}; the kernels are tested with {TRITON_VERSION}"))
    if not env.get("hf_attnorm") or not env.get("transformers"):
        steps.append(Step("hf_attnorm", ["install", "-e", str(ROOT)], "the package and its dependencies"))
    if not env.get("pytest") or not env.get("pytest-xdist"):
        steps.append(Step("pytest", ["install", "pytest>=8", "pytest-xdist"],
                          "the gpu suite runs under pytest, on several processes (pytest-xdist)"))
    if flash_attn and not env.get("flash-attn"):
        steps.append(Step("flash-attn", ["install", "--only-binary=:all:", "flash-attn"],
                          "FlashAttention-2 baseline (--flash-attn), binary wheels only", required=False))
    return steps


def run_steps(python: str, steps: list[Step], dry_run: bool) -> list[dict]:
    """Run (or, dry, only list) each step; returns one record per step. Stops at a failed required step."""
    records = []
    for step in steps:
        cmd = [python, "-m", "pip", *step.pip_args]
        rec = {"name": step.name, "command": " ".join(cmd), "why": step.why, "required": step.required,
               "ran": False, "seconds": 0.0, "returncode": None, "output_tail": ""}
        records.append(rec)
        print(f"gpu_setup: {'would run' if dry_run else 'running'}: {rec['command']}  ({step.why})", flush=True)
        if dry_run:
            continue
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True)
        rec.update(ran=True, seconds=round(time.perf_counter() - t0, 1), returncode=res.returncode,
                   output_tail=(res.stdout + res.stderr)[-3000:])
        print(f"gpu_setup: {step.name}: exit {res.returncode} after {rec['seconds']} s", flush=True)
        if res.returncode != 0 and step.required:
            print(rec["output_tail"], file=sys.stderr)
            break
    return records


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default=sys.executable, help="the Python whose packages are set up")
    p.add_argument("--record", type=Path, default=None, help="write the plan and the timed steps to this JSON file")
    p.add_argument("--dry-run", action="store_true", help="plan and print the steps, install nothing")
    p.add_argument("--no-setup", action="store_true", help="skip every step (the record says so)")
    p.add_argument("--flash-attn", action="store_true",
                   help="also install FlashAttention-2 for the baseline (binary wheel only; skipped when none)")
    args, _ = p.parse_known_args(argv)  # the other flags of gpu_check.sh belong to hf_attnorm.lab.gpu_check
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    before = probe(args.python)
    steps = [] if args.no_setup else plan(before, args.flash_attn)
    if not steps:
        print("gpu_setup: nothing to install" + (" (--no-setup)" if args.no_setup else ""), flush=True)
    if not before["cuda_available"]:
        print(f"gpu_setup: no CUDA device visible to torch {before['torch']} "
              f"(CUDA build: {before['torch_cuda_build']})", flush=True)
    records = run_steps(args.python, steps, args.dry_run)
    failed = [r for r in records if r["required"] and r["returncode"] not in (None, 0)]
    after = before if args.dry_run or not records else probe(args.python)
    result = {"dry_run": args.dry_run, "skipped": args.no_setup, "before": before, "after": after,
              "steps": records, "seconds": round(time.perf_counter() - t0, 1), "failed": [r["name"] for r in failed]}
    if args.record:
        args.record.write_text(json.dumps(result, indent=1))
    if failed:
        print(f"gpu_setup: step {failed[0]['name']!r} failed ({failed[0]['command']}); see the output above",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
