#!/usr/bin/env python
"""Check, offline, that a GPU machine's Python can run the GPU check, and install only what the user brought along
(called by scripts/gpu_check.sh).

Standard library only: it runs before anything is known about the installed packages. It never reaches a network:
every pip call gets ``--no-index``, so a machine without a package registry behaves like one with. It probes the
target Python (torch and whether it is a CUDA build, triton, transformers, pytest, pytest-xdist, numpy, flash-attn,
hf_attnorm), prints its plan, then:

* ``--wheels DIR``: installs the wheels in DIR, and nothing else (``pip install --no-index --find-links DIR``), e.g.
  a newer transformers or pytest-xdist carried to a machine that lacks them. torch and triton are too large to carry
  to most GPU machines: the check runs on the ones installed;
* checks the installed versions against the supported ranges (``hf_attnorm/supported.py``): torch (a CUDA build,
  except in a dry run), transformers, pytest. One that is missing or out of range stops the check here, with what is
  allowed; a missing triton, pytest-xdist or numpy too new for an old triton's interpreter is a warning (the check
  runs without the Triton kernels / on one process);
* installs the package from this checkout without touching anything else (``pip install --no-index --no-deps
  --no-build-isolation -e .``); where that cannot run (no setuptools, a read-only site-packages), the check imports
  the package from the checkout (gpu_check.sh puts it first on PYTHONPATH either way, so the checkout is what runs).

``--dry-run`` plans and prints, running nothing. ``--record`` writes the plan, the checks and each step's seconds,
exit code and output tail as JSON (hf_attnorm.lab.speed.gpu_check merges it into its results).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("hf_attnorm_supported", ROOT / "hf_attnorm" / "supported.py")
supported = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(supported)

#: pip never reaches a network from here: an index is neither configured nor asked for
OFFLINE_ENV = {"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}

#: run in the target Python: what is installed (no import of anything that is missing)
PROBE = r"""
import importlib.util, json, importlib.metadata as md
def ver(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
info = {d: ver(d) for d in ("torch", "triton", "transformers", "pytest", "pytest-xdist", "numpy", "flash-attn",
                            "setuptools")}
spec = importlib.util.find_spec("hf_attnorm")
info["hf_attnorm"] = spec.origin if spec is not None else None
info["python"] = ".".join(map(str, __import__("sys").version_info[:3]))
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


@dataclasses.dataclass
class Check:
    """One installed version against what the check needs: ``ok`` False and ``required`` stops the check."""

    name: str
    found: str | None
    ok: bool
    message: str
    required: bool = True


def probe(python: str) -> dict:
    """What ``python`` has installed (see PROBE)."""
    # from another folder and without PYTHONPATH: what is installed, not the checkout
    res = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=300,
                         cwd=os.path.expanduser("~"), env={**os.environ, "PYTHONPATH": ""})
    if res.returncode != 0:
        raise SystemExit(f"gpu_setup: probing {python} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _at_least(found: str | None, floor: str) -> bool:
    return found is not None and supported.release(found) >= supported.release(floor)


def checks(env: dict, dry_run: bool = False) -> list[Check]:
    """The installed versions of ``env`` (a ``probe`` result) against the supported ranges."""
    torch_v, tf_v, triton_v, numpy_v = env.get("torch"), env.get("transformers"), env.get("triton"), env.get("numpy")
    out = []
    if torch_v is None:
        out.append(Check("torch", None, False, f"torch is not installed; the check runs on an installed torch >= "
                                               f"{supported.MIN_TORCH} (a CUDA build); it installs none"))
    elif (problem := supported.torch_problem(torch_v)) is not None:
        out.append(Check("torch", torch_v, False, problem))
    elif not env.get("torch_cuda_build") and not dry_run:
        out.append(Check("torch", torch_v, False, f"torch {torch_v} is a CPU-only build (torch.version.cuda is "
                                                  "None): install a CUDA build, or use --dry-run"))
    else:
        out.append(Check("torch", torch_v, True, f"torch {torch_v} (CUDA {env.get('torch_cuda_build')})"))
    if not _at_least(tf_v, supported.MIN_TRANSFORMERS):
        out.append(Check("transformers", tf_v, False,
                         f"transformers {tf_v or 'is not installed'}; hf_attnorm needs >= "
                         f"{supported.MIN_TRANSFORMERS}: bring a wheel (--wheels DIR)"))
    else:
        out.append(Check("transformers", tf_v, True, f"transformers {tf_v}"))
    if env.get("pytest") is None:
        out.append(Check("pytest", None, False, "pytest is not installed: bring a wheel (--wheels DIR)"))
    else:
        out.append(Check("pytest", env["pytest"], True, f"pytest {env['pytest']}"))
    if env.get("pytest-xdist") is None:
        out.append(Check("pytest-xdist", None, False, "pytest-xdist is not installed: the suite runs on one process "
                                                      "(slower: Triton compiles on the CPU)", required=False))
    if triton_v is None:
        out.append(Check("triton", None, False, "triton is not installed: the Triton kernels are not checked (the "
                                                "tests that need them skip, saying so)", required=False))
    else:
        out.append(Check("triton", triton_v, True, f"triton {triton_v} (the one installed with torch is used)"))
        if (dry_run and numpy_v and _at_least(numpy_v, "2.4")
                and not _at_least(triton_v, supported.TRITON_INTERPRETER_NUMPY24)):
            out.append(Check("numpy", numpy_v, False,
                             f"numpy {numpy_v} with triton {triton_v}: Triton's CPU interpreter needs numpy < 2.4 "
                             f"before triton {supported.TRITON_INTERPRETER_NUMPY24} (compiled kernels are not "
                             "affected); the interpreted kernel tests will say so", required=False))
    return out


def plan(env: dict, wheels: Path | None = None, flash_attn: bool = False) -> list[Step]:
    """The offline install steps for ``env`` (a ``probe`` result), in order."""
    steps = []
    if wheels is not None:
        files = sorted(str(p) for p in wheels.glob("*.whl"))
        steps.append(Step("wheels", ["install", "--no-index", "--find-links", str(wheels), *files],
                          f"the {len(files)} wheel(s) brought along in {wheels}"))
    origin = env.get("hf_attnorm")
    if origin is None or not Path(origin).resolve().is_relative_to(ROOT):
        install = ["install", "--no-index", "--no-deps", "--no-build-isolation", "-e", str(ROOT)]
        steps.append(Step("hf_attnorm", install,
                          "this checkout, leaving every installed package as it is (if this fails, the check "
                          "imports the package from the checkout)", required=False))
    if flash_attn and not env.get("flash-attn"):
        print("gpu_setup: --flash-attn: flash-attn is not installed (bring its wheel with --wheels DIR); the "
              "FlashAttention-2 row is left out", flush=True)
    return steps


def run_steps(python: str, steps: list[Step], dry_run: bool) -> list[dict]:
    """Run (or, dry, only list) each step offline; returns one record per step. Stops at a failed required step."""
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
        res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **OFFLINE_ENV})
        rec.update(ran=True, seconds=round(time.perf_counter() - t0, 1), returncode=res.returncode,
                   output_tail=(res.stdout + res.stderr)[-3000:])
        print(f"gpu_setup: {step.name}: exit {res.returncode} after {rec['seconds']} s", flush=True)
        if res.returncode != 0:
            print(rec["output_tail"], file=sys.stderr)
            if step.required:
                break
    return records


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default=sys.executable, help="the Python whose packages are checked and set up")
    p.add_argument("--record", type=Path, default=None, help="write the plan and the timed steps to this JSON file")
    p.add_argument("--dry-run", action="store_true", help="plan and print the steps, install nothing; a CPU-only "
                                                          "torch is accepted")
    p.add_argument("--no-setup", action="store_true", help="skip every install step (the checks still run)")
    p.add_argument("--wheels", type=Path, default=None,
                   help="a folder of wheels to install first, offline (e.g. a newer transformers or pytest-xdist)")
    p.add_argument("--flash-attn", action="store_true",
                   help="note whether FlashAttention-2 is installed for the baseline row (it is never installed "
                        "from a network: bring its wheel with --wheels)")
    args, _ = p.parse_known_args(argv)  # the other flags of gpu_check.sh belong to hf_attnorm.lab.speed.gpu_check
    if args.wheels is not None and not args.wheels.is_dir():
        p.error(f"--wheels {args.wheels}: not a folder (give the folder holding the .whl files)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    before = probe(args.python)
    steps = [] if args.no_setup else plan(before, args.wheels, args.flash_attn)
    print(f"gpu_setup: Python {before['python']} ({args.python}): torch {before['torch']} (CUDA build "
          f"{before['torch_cuda_build']}, {before['device_count']} device(s)), triton {before['triton']}, "
          f"transformers {before['transformers']}, numpy {before['numpy']}; offline (pip --no-index)", flush=True)
    if not steps:
        print("gpu_setup: nothing to install" + (" (--no-setup)" if args.no_setup else ""), flush=True)
    records = run_steps(args.python, steps, args.dry_run)
    after = before if args.dry_run or not any(r["ran"] for r in records) else probe(args.python)
    found = checks(after, args.dry_run)
    for c in found:
        print(f"gpu_setup: {'ok' if c.ok else 'REQUIRED' if c.required else 'warning'}: {c.message}", flush=True)
    failed = [r["name"] for r in records if r["required"] and r["returncode"] not in (None, 0)]
    failed += [c.name for c in found if c.required and not c.ok]
    result = {"dry_run": args.dry_run, "skipped": args.no_setup, "offline": True, "before": before, "after": after,
              "steps": records, "checks": [dataclasses.asdict(c) for c in found],
              "seconds": round(time.perf_counter() - t0, 1), "failed": failed}
    if args.record:
        args.record.write_text(json.dumps(result, indent=1))
    if failed:
        print(f"gpu_setup: cannot run the GPU check: {', '.join(failed)} (see above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
