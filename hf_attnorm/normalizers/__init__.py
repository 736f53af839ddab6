"""Normalizers: one file each; importing this package imports (and so registers) every module in it."""

from __future__ import annotations

import importlib
import pkgutil

from .base import Ctx, Normalizer, ParamSpec

# softmax first: the reference is listed (CLI help, README tables, ``available()``) before the others, which follow
# in file order (a file importing another, asentmax -> entmax_alpha, registers that one first)
importlib.import_module(f"{__name__}.softmax")
for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name != "base":
        importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["Ctx", "Normalizer", "ParamSpec"]
