"""Selective attention (``normalizers/selective.py``, whose ``reference`` is the naive one): ``blocked.py`` (query
blocks in order in PyTorch, path ``selective``), ``cpu.py`` (C++ ``selective_cpu.cpp``, path ``selective_cpu``),
``triton.py`` (path ``selective_triton``), ``step.py`` (one-query decode steps, path ``selective_step``) and
``carry.py`` (the column sums a KV cache keeps between calls)."""

from . import blocked, carry, cpu, step, triton  # noqa: F401  (the paths register at import)
