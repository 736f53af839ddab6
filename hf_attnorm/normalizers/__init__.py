"""Normalizers: one file each; importing this package imports (and so registers) every module in it."""

from __future__ import annotations

import importlib
import pkgutil

from .base import Ctx, Normalizer, ParamSpec

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name != "base":
        importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["Ctx", "Normalizer", "ParamSpec"]
