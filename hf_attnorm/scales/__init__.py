"""Length-aware scales: one file each (importing this package registers them all) and the public scale functions.

>>> from hf_attnorm.scales import max_gradient_alpha, sparse_target_k
>>> round(max_gradient_alpha(1000, dist="normal"), 2)
2.14
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import Scale

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name != "base":
        importlib.import_module(f"{__name__}.{_info.name}")

from .llama4 import llama4_scale  # noqa: E402
from .log_n import log_n_scale  # noqa: E402
from .max_gradient import (  # noqa: E402
    max_gradient_alpha,
    max_gradient_condition,
    max_gradient_objective,
    sum_p2_model,
)
from .qwen_logn import qwen_logn_scale  # noqa: E402
from .sparse_target import sparse_target_k, sparse_target_m, sparse_target_scale  # noqa: E402

__all__ = [
    "Scale",
    "llama4_scale",
    "log_n_scale",
    "max_gradient_alpha",
    "max_gradient_condition",
    "max_gradient_objective",
    "qwen_logn_scale",
    "sparse_target_k",
    "sparse_target_m",
    "sparse_target_scale",
    "sum_p2_model",
]
