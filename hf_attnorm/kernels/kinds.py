"""The one kernel-id table of the fused kernels, shared by the C++ (``csrc/fused_cpu.cpp``, ``enum Kind``) and the
Triton kernels (``triton_attn.py``, compile-time ``KIND`` compared with the ``K_<NAME>`` constants made from this
table). ``tests/test_kernels.py`` checks that the C++ enum spells exactly this table.

A normalizer runs on the fused kernels by declaring ``kernel_family = "fused"`` and ``fused_kind = <a name here>``
in its own file (several normalizers may share a map). A new map needs its elementwise code in both kernels, its
name appended here and to the C++ enum, and, if it is sum-normalised or threshold-based, its name in the sets below.
"""

from __future__ import annotations

from ..normalizers.base import Normalizer

#: map name -> kernel id (the C++ enum value and the Triton KIND); ids are positions, never reuse one
FUSED_KINDS: dict[str, int] = {
    "symax": 0, "squared": 1, "stablemax": 2, "softpick": 3, "sigmoid": 4, "relu_len": 5,
    "entmax15": 6, "sparsemax": 7, "entmax_alpha": 8,
    "power": 9, "softplus": 10,
}
#: maps whose rows are divided by a denominator accumulated with them (C++ ``is_normalised``)
NORMALISED: frozenset[str] = frozenset({"symax", "squared", "stablemax", "softpick", "power", "softplus"})
#: maps with a per-row threshold found by a search over the row (C++ ``is_threshold``)
THRESHOLD: frozenset[str] = frozenset({"entmax15", "sparsemax", "entmax_alpha"})
#: maps the C++ kernel computes in float64 whatever the input dtype: alpha-entmax's weights are r^(1/(alpha-1)),
#: which amplifies fp32 rounding of r by 1/(alpha-1); gradients of values that aggregate dq over every row (ASEntmax's
#: delta, gamma) then drifted 5-20x past the fp32 reference's own error
WIDE: frozenset[str] = frozenset({"entmax_alpha"})


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
