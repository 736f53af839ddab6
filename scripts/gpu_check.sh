#!/usr/bin/env bash
# One command for a GPU machine, offline: check the installed torch/triton/transformers against the supported ranges
# and install only the wheels brought along (scripts/gpu_setup.py), run the gpu test suite, benchmark against SDPA
# (flash) and write bench/gpu/<device name>/ as it goes.
#   scripts/gpu_check.sh                 quick: the suite's core subset and a small grid (docs/triton.md: minutes)
#   scripts/gpu_check.sh --full          every gpu test and the full grid (~30 min)
#   scripts/gpu_check.sh --dry-run       on a CPU: plan, the suite collected with its skip reasons, toy benchmark
#   scripts/gpu_check.sh --wheels DIR    install the wheels in DIR first (offline), e.g. pytest-xdist
#   scripts/gpu_check.sh --help          every flag (of both steps)
# Python: $PYTHON, else the active virtual environment's, else python3 (the one holding the machine's torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -n "${VIRTUAL_ENV:-}" ]; then PY=python; else PY=python3; fi
fi
# the checkout is what runs, whether or not the editable install succeeds
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PIP_NO_INDEX=1
RECORD="$(mktemp "${TMPDIR:-/tmp}/hf_attnorm_gpu_setup.XXXXXX")"
trap 'rm -f "$RECORD"' EXIT
case " $* " in
  *" --help "*|*" -h "*) "$PY" scripts/gpu_setup.py --help; exec "$PY" -m hf_attnorm.lab.speed.gpu_check --help ;;
esac
"$PY" scripts/gpu_setup.py --record "$RECORD" "$@"
"$PY" -m hf_attnorm.lab.speed.gpu_check --setup-record "$RECORD" "$@"
