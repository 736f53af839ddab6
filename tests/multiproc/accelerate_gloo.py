"""Run a script under ``accelerate launch --use_deepspeed`` on a CPU-only machine (tests only).

accelerate picks its process-group backend from the device: with no GPU and no ``ACCELERATE_USE_CPU`` it finds none,
treats the run as ONE process and DeepSpeed's batch-size check fails; with ``ACCELERATE_USE_CPU`` it ignores
DeepSpeed altogether. This shim hands every ``Accelerator`` an ``InitProcessGroupKwargs(backend="gloo")`` (accelerate's
own, public way to choose a backend) and then runs the script unchanged:
``accelerate launch --use_deepspeed ... tests/multiproc/accelerate_gloo.py scripts/finetune.py --flags``.
"""

from __future__ import annotations

import os
import runpy
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import accelerate  # noqa: E402
from accelerate.utils import InitProcessGroupKwargs  # noqa: E402

_init = accelerate.Accelerator.__init__


def _init_with_gloo(self, *args, kwargs_handlers=None, **kwargs):
    handlers = [*(kwargs_handlers or []), InitProcessGroupKwargs(backend="gloo")]
    _init(self, *args, kwargs_handlers=handlers, **kwargs)


accelerate.Accelerator.__init__ = _init_with_gloo

if __name__ == "__main__":
    script, *rest = sys.argv[1:]
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")
