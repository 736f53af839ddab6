"""The kernel-id table of the fused kernels and the sets the kernels branch on, derived from the map declarations in
``maps.py`` (each map is declared there once). The C++ (``fused/fused_cpu.cpp``, ``enum Kind``) and the Triton
kernels (``triton.py``, compile-time ``KIND`` compared with ``K_<NAME>`` constants made from this table) use
these ids; ``tests/test_fused_maps.py`` checks both kernels against the declarations.

A normalizer runs on the fused kernels by declaring ``kernel_family = "fused"`` and ``fused_kind = <a map name>``
in its own file (several normalizers may share a map). A new map: see ``maps.py`` and docs/extending.md.
"""

from __future__ import annotations

from ...normalizers.base import Normalizer
from .maps import MAPS

#: map name -> kernel id (the C++ enum value and the Triton KIND); ids are never reused
FUSED_KINDS: dict[str, int] = {m.name: m.kernel_id for m in MAPS}
#: maps whose rows are divided by a denominator accumulated with them (C++ ``is_normalised``)
NORMALISED: frozenset[str] = frozenset(m.name for m in MAPS if m.normalised)
#: maps with a per-row threshold found by a search over the row (C++ ``is_threshold``)
THRESHOLD: frozenset[str] = frozenset(m.name for m in MAPS if m.threshold)
#: maps whose denominator adds the row value (``FusedMap.den_offset``; C++ ``den_adds_row_value``)
DEN_ADDS_ROW_VALUE: frozenset[str] = frozenset(m.name for m in MAPS if m.den_offset is not None)
#: maps whose weight is the row value times a function of the score (``FusedMap.row_value_factor``)
ROW_VALUE_FACTOR: frozenset[str] = frozenset(m.name for m in MAPS if m.row_value_factor)
#: maps the C++ kernel computes in float64 whatever the input dtype (``FusedMap.wide``)
WIDE: frozenset[str] = frozenset(m.name for m in MAPS if m.wide)


def kind_id(name: str) -> int:
    """The kernel id of map ``name`` (KeyError naming the known maps otherwise)."""
    try:
        return FUSED_KINDS[name]
    except KeyError:
        raise KeyError(f"no fused kernel map {name!r} (maps: {', '.join(FUSED_KINDS)})") from None


def constant_name(name: str) -> str:
    """The constant a kernel source uses for map ``name``: ``K_SYMAX`` in Triton, ``SYMAX`` in the C++ enum."""
    return name.upper()


def fused_takes(norm: Normalizer, kernels: str) -> str | None:
    """Whether the fused kernels (``kernels`` names which, for the message) can run ``norm``: it declares a fused
    map (``kernel_family = "fused"``, ``fused_kind``) and no q/k transform, since these kernels compute
    s = c (q . k) directly. None, or the reason."""
    if norm.kernel_family != "fused" or norm.fused_kind not in FUSED_KINDS:
        return f"normalizer {norm.name!r} declares no fused kernel map (maps: {', '.join(FUSED_KINDS)})"
    if type(norm).transform_qk is not Normalizer.transform_qk or type(norm).feature_map is not Normalizer.feature_map:
        return f"normalizer {norm.name!r} transforms q/k, which the {kernels} kernels do not"
    return None
