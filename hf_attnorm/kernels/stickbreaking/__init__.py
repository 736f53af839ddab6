"""Stick-breaking attention (``normalizers/stickbreaking.py``, whose ``reference`` is the naive one): ``scan.py``
(the block scan in PyTorch, path ``stickbreaking_scan``, and what the other two share with it), ``cpu.py`` (C++
``stickbreaking_cpu.cpp``, path ``stickbreaking_cpu``) and ``triton.py`` (path ``stickbreaking_triton``)."""

from . import cpu, scan, triton  # noqa: F401  (the paths register at import)
