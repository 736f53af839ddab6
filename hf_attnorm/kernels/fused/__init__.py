"""The fused maps: normalizers that are one elementwise map of the score plus a row value (symax, sigmoid,
sparsemax, entmax, power, ...), each map declared once in ``maps.py`` (with the id table, the sets and the code the
kernels compile in, generated from the declarations). Two kernels obey the declarations: ``cpu.py`` (the blocked
C++ kernel ``fused_cpu.cpp``, path ``fused_cpu``) and ``triton.py`` (path ``triton``); their naive reference is the
normalizer's own ``reference`` (``kernels/reference.py`` runs it)."""

from . import cpu, triton  # noqa: F401  (each registers its path at import)
