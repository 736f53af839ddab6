#!/usr/bin/env bash
# Download, here (with a package registry), the wheels the GPU check's anchors need into .cache/gpu-wheels: the GPU
# machine is offline, so they travel with the call (carry .cache/gpu-wheels) and scripts/gpu_check.sh --wheels
# .cache/gpu-wheels installs them there. The list is hf_attnorm/lab/speed/gpu_anchors.py's WHEELS (pure Python + Triton
# wheels, about 1 MB; torch and triton stay the machine's own).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
wheels=$("$PY" - <<'PYEOF'
import ast
tree = ast.parse(open("hf_attnorm/lab/speed/gpu_anchors.py").read())
node = next(n for n in tree.body if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "WHEELS" for t in n.targets))
print(" ".join(ast.literal_eval(node.value)))
PYEOF
)
mkdir -p .cache/gpu-wheels
# shellcheck disable=SC2086
"$PY" -m pip download --no-deps --only-binary :all: -d .cache/gpu-wheels $wheels
ls -l .cache/gpu-wheels
