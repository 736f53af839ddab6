#!/usr/bin/env bash
# One command for a GPU machine: install what is missing (scripts/gpu_setup.py: CUDA torch from PyPI, triton, the
# package, pytest), run the gpu test suite, benchmark against SDPA (flash) and write bench/gpu/<device name>/.
#   scripts/gpu_check.sh            quick: the suite's core subset and a small grid (~6-8 min on an H100)
#   scripts/gpu_check.sh --full     every gpu test and the full grid (~30 min)
#   scripts/gpu_check.sh --dry-run  on a CPU: plan the setup, list the suite's skip reasons, toy-size benchmark
#   scripts/gpu_check.sh --help     every flag (of both steps)
# Without an active virtual environment (and no $PYTHON) it uses ./.venv-gpu, created on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -n "${VIRTUAL_ENV:-}" ]; then
    PY=python
  else
    [ -x .venv-gpu/bin/python ] || python3 -m venv .venv-gpu
    PY=.venv-gpu/bin/python
  fi
fi
RECORD="$(mktemp "${TMPDIR:-/tmp}/hf_attnorm_gpu_setup.XXXXXX")"
trap 'rm -f "$RECORD"' EXIT
"$PY" scripts/gpu_setup.py --record "$RECORD" "$@"
"$PY" -m hf_attnorm.lab.gpu_check --setup-record "$RECORD" "$@"
