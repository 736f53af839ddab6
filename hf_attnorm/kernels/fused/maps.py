"""The fused maps, each declared once: what the C++ (``fused/fused_cpu.cpp``) and Triton (``triton.py``) kernels
compute per score entry, and the facts they branch on.

A fused map turns a score s (q . k with every scale applied) and the row's value r (one number per query row,
``Normalizer.row_value``; n when the normalizer gives none) into a weight. ``FusedMap`` states it once:

* ``weight(s, r)`` and ``slope(s, r)`` = d weight / ds: the numerator term of one visible key (0 for invisible keys);
  ``den_term`` / ``den_slope`` when the denominator sums another term (softpick: |e^s - 1|);
* ``normalised``: rows are divided by ``den_offset(r) + sum_j den_term(s_j, r)``; else the weights are used as they
  are (``threshold`` maps: ``weight(s_j - t, r)`` with the per-row t that makes them sum to 1);
* ``constant_on_single_key``: the kernels set the score gradients of rows with one visible key to exactly 0 (the
  map's weights do not depend on the scores there; computed, they would be rounding noise amplified by f'/D),
  ``single_key_mark``: how the row value tells the kernels which rows those are (alpha-entmax's weights are
  constant there too, but its row value is alpha, which marks nothing: its kernels compute those gradients);
* ``row_value``: what r holds, ``row_value_for(n)``: the value a normalizer with default options passes for rows
  with n visible keys, ``row_value_has_gradient``: whether the kernels return d out / d r;
* ``dispatch``: which C++ driver runs it ("tiles": one blocked pass; "threshold": a threshold search, then a pass;
  "alpha": alpha-entmax's Newton search on the power P = 1/(alpha - 1));
* the facts that pick the kernels' code for a map without its own: ``shift`` (a running shift, as softpick's,
  softplus's and power's), ``threshold_exponent`` (sparsemax, entmax-1.5), ``row_value_in_score`` (sigmoid's
  bias), ``row_value_exponent`` (power's p), ``den_offset``, ``row_value_factor``; each is checked here against the
  declared ``weight`` (``FusedMap.__post_init__`` refuses what the kernels cannot obey);
* ``code`` (``EntryCode``): the per-entry code of every other map, as C++ and Triton expressions.

How the kernels read it: ``cpu.py`` compiles the C++ with the facts as preprocessor definitions
(``compile_definitions``) and with the generated header ``cpp_header`` (the dispatch over the declared ids and each
map's ``EntryCode``); ``triton.py`` hands the facts to its kernels as constexprs (``triton.map_constants``) and
jits the generated ``triton_source`` (``_map_weight`` / ``_map_slope``) with them. Neither kernel names a map;
``tests/test_fused_maps.py`` evaluates every map here through both kernels (forward and gradients against
``weight`` / ``slope``), asks the compiled C++ for its facts per id (``map_facts``), and runs a map declared only
in the test. An id outside the table raises in both kernels.

Adding a map: one ``FusedMap`` entry in ``MAPS`` (next free id below 64, never reuse one), with its ``code``, or
with the facts of a form the kernels already compute (see docs/extending.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from ...normalizers.base import Normalizer

Tensor = torch.Tensor
#: elementwise function of the score s [..., Lk] and the row value r (broadcast to s)
EntryFn = Callable[[Tensor, Tensor], Tensor]
Dispatch = Literal["tiles", "threshold", "alpha"]
#: "n == 1": the row value is n there (maps that read no row value); "negative": the row value is negated there
SingleKeyMark = Literal["n == 1", "negative", "none"]
DISPATCH_IDS: dict[str, int] = {"tiles": 0, "threshold": 1, "alpha": 2}
#: the per-row running shift m a normalised map's weights are computed relative to (``FusedMap.shift``)
Shift = Literal["none", "max_score", "max_score_below_zero", "log_abs_max", "max_exp"]
SHIFT_IDS: dict[str, int] = {"none": 0, "max_score": 1, "max_score_below_zero": 2, "log_abs_max": 3, "max_exp": 4}


@dataclass(frozen=True)
class EntryCode:
    """A map's per-entry code in the languages of both kernels, compiled into them as written (``cpp_header``
    and ``triton_source`` generate the code that calls it; nothing in a kernel names a map).

    * ``cpp_weight`` / ``cpp_slope``: C++ expressions of type ``T`` (float or double) in the score ``s`` and the row
      value ``r`` (``cpp_slope`` may also read ``w``, the weight at s); ``vexp``, ``sgn``, ``std::abs``,
      ``std::max`` / ``std::min`` are at hand. Written branch-free (``?:`` selects), so the loops that call them
      vectorise as before;
    * ``triton_weight`` / ``triton_slope``: the same as Triton expressions on a block ``s`` [BM, BN] and ``r``
      [BM, 1] (``tl.where`` / ``tl.maximum`` ..., fp32; ``w`` as above). Both are evaluated on invisible entries
      too (the kernels select 0 there): keep them finite for every finite s. They may call the device helpers of
      ``triton_device.py`` and read the constexpr ``FAST`` (half-precision inputs on a GPU: ``_sigmoid(x, FAST)``
      takes the one-instruction tanh form there).
    """

    cpp_weight: str
    cpp_slope: str
    triton_weight: str
    triton_slope: str


@dataclass(frozen=True)
class FusedMap:
    name: str
    kernel_id: int
    weight: EntryFn
    slope: EntryFn
    normalised: bool
    threshold: bool
    constant_on_single_key: bool
    single_key_mark: SingleKeyMark
    row_value: str
    row_value_for: Callable[[Tensor], Tensor]
    row_value_has_gradient: bool
    dispatch: Dispatch
    den_term: EntryFn | None = None
    den_slope: EntryFn | None = None
    #: the denominator adds the row value (symax's eta): the kernels implement exactly ``den_offset(r) = r``
    #: (``HF_MAPS_DEN_ADDS_ROW_VALUE`` in C++, ``DEN_ADDS_ROW_VALUE`` in Triton), so no other offset is accepted
    den_offset: Callable[[Tensor], Tensor] | None = None
    #: weight(s, r) = r weight(s, 1) (relu_len's 1/n): the C++ kernel computes weight(s, 1) per entry and scales
    #: each row once, and both kernels take dr = sum_j weight(s_j, 1) dP_j (``HF_MAPS_ROW_VALUE_FACTOR`` in C++,
    #: ``ROW_VALUE_FACTOR`` in Triton); tests/test_fused_maps.py checks the identity on the declared ``weight``
    row_value_factor: bool = False
    #: the weights are kept relative to a per-row running shift m (what was accumulated is rescaled by e^(m_old -
    #: m_new) when it rises; m cancels in the normalised ratio): "max_score": m = max(0, visible scores) (softpick's
    #: e^s - 1); "max_score_below_zero": m = min(0, max visible score), starting at -inf (softplus);
    #: "log_abs_max": m = |r| ln max_j |s_j|, starting at -inf (power's |s|^|r|); "max_exp": m = the max visible
    #: score, starting at -inf (softmax's e^s: the Triton kernels only); "none": none (``HF_MAPS_SHIFT_*`` in C++,
    #: ``RUNNING_SHIFT`` in Triton, ids ``SHIFT_IDS``)
    shift: Shift = "none"
    #: weight(s, r) = weight(s + r, 0) (sigmoid's bias): d out / d r = sum_j dS_j (``HF_MAPS_ROW_VALUE_IN_SCORE``,
    #: ``ROW_VALUE_IN_SCORE``)
    row_value_in_score: bool = False
    #: weight(s, r) = |s|^|r| (power's p; the sign of r marks single-key rows): d weight / d r = weight ln|s|
    #: (``HF_MAPS_ROW_VALUE_EXPONENT``, ``ROW_VALUE_EXPONENT``); goes with shift "log_abs_max"
    row_value_exponent: bool = False
    #: dispatch "threshold" maps: weight(x) = [x / e]_+^e with e = threshold_exponent, 1 (sparsemax) or 2
    #: (entmax-1.5), the form the threshold search solves (``HF_MAPS_THRESHOLD_SQUARED``, ``THRESHOLD_SQUARED``);
    #: 0 for every other map (alpha-entmax's exponent is its row value: dispatch "alpha")
    threshold_exponent: int = 0
    #: the per-entry code both kernels compile for this map (``EntryCode``): every map whose weights take no
    #: running shift and no threshold search declares it; the others are computed by the kernels' code for their
    #: declared ``shift`` / threshold form, which ``__post_init__`` checks against ``weight``
    code: EntryCode | None = None
    #: normalised maps: the Triton backward takes delta_i = sum_j w_ij dP_ij from dO_i . O_i (FlashAttention's
    #: shortcut, one preprocess instead of a second walk over the keys) because the map's b'(s) / D is bounded, so
    #: the rounding of O is not amplified into dS (docs/triton.md has the measurement that sorted the maps); False:
    #: the kernels compute delta from the same dP as dS (exact zeros on single-key rows)
    delta_from_output: bool = False
    #: the C++ kernels implement this map (``compile_definitions`` and ``cpp_header`` take only these); False: the
    #: Triton kernels only (softmax, which the CPU runs through SDPA's own kernels)
    cpu: bool = True

    def __post_init__(self) -> None:
        if self.threshold == self.normalised and self.threshold:
            raise ValueError(f"fused map {self.name!r}: a threshold map is not also divided by a denominator")
        if (self.dispatch == "tiles") == self.threshold:
            raise ValueError(f"fused map {self.name!r}: threshold maps dispatch to 'threshold' or 'alpha', the "
                             f"others to 'tiles' (got dispatch={self.dispatch!r}, threshold={self.threshold})")
        if self.constant_on_single_key == (self.single_key_mark == "none"):
            raise ValueError(f"fused map {self.name!r}: constant_on_single_key needs a single_key_mark, and only it")
        if self.den_offset is not None:
            probe = torch.tensor([0.0, 0.5, 3.0], dtype=torch.float64)
            if not self.normalised or not torch.equal(self.den_offset(probe), probe):
                raise ValueError(f"fused map {self.name!r}: the kernels add the row value itself to a normalised "
                                 "map's denominator (den_offset = lambda r: r) and no other offset")
        if self.row_value_factor and (self.normalised or self.threshold):
            raise ValueError(f"fused map {self.name!r}: row_value_factor scales the weights of a map that is "
                             "neither normalised nor a threshold map (the factor would cancel or move the threshold)")
        plain = self.shift == "none" and not self.threshold
        if plain != (self.code is not None):
            raise ValueError(f"fused map {self.name!r}: a map with neither a running shift nor a threshold declares "
                             "its per-entry code (code=EntryCode(...)); the others take the kernels' code for their "
                             "shift or threshold form and declare none")
        if self.code is not None and self.den_term is not None:
            raise ValueError(f"fused map {self.name!r}: the kernels sum a map's own weight in its denominator: "
                             "only shift 'max_score' (softpick) sums another term")
        if self.shift == "max_exp" and self.cpu:
            raise ValueError(f"fused map {self.name!r}: the C++ kernels have no 'max_exp' shift (cpu=False)")
        if self.delta_from_output and not self.normalised:
            raise ValueError(f"fused map {self.name!r}: delta_from_output is the delta of a normalised map "
                             "(sum_j w_ij dP_ij = dO . O); threshold maps keep their own mean term")
        if self.shift not in SHIFT_IDS:
            raise ValueError(f"fused map {self.name!r}: shift must be one of {sorted(SHIFT_IDS)}")
        if self.shift != "none" and (not self.normalised or self.den_offset is not None):
            raise ValueError(f"fused map {self.name!r}: a running shift cancels only in a normalised map's ratio "
                             "with no offset added to its denominator")
        if self.row_value_exponent != (self.shift == "log_abs_max"):
            raise ValueError(f"fused map {self.name!r}: row_value_exponent (|s|^|r|) and shift 'log_abs_max' "
                             "(m = |r| ln max|s|) go together")
        if self.row_value_exponent and self.single_key_mark != "negative":
            raise ValueError(f"fused map {self.name!r}: row_value_exponent reads |r|: its sign marks single-key "
                             "rows (single_key_mark='negative')")
        if self.shift != "none":
            form = _SHIFT_FORMS[self.shift]
            probe = torch.linspace(-2.5, 2.5, 11, dtype=torch.float64)
            r = torch.full_like(probe, 3.0)
            term = self.den_term or self.weight
            if not (torch.allclose(self.weight(probe, r), form[0](probe, r), rtol=1e-12, atol=1e-300)
                    and torch.allclose(term(probe, r), form[1](probe, r), rtol=1e-12, atol=1e-300)):
                raise ValueError(f"fused map {self.name!r}: the kernels compute shift {self.shift!r} for the "
                                 f"weight {form[2]} only")
        if self.row_value_in_score and (self.normalised or self.threshold or self.row_value_factor):
            raise ValueError(f"fused map {self.name!r}: row_value_in_score (weight(s + r)) is implemented for maps "
                             "that are neither normalised, threshold nor row_value_factor maps")
        if self.row_value_in_score:
            probe = torch.linspace(-2.0, 2.0, 9, dtype=torch.float64)
            r = torch.full_like(probe, 0.75)
            if not torch.allclose(self.weight(probe, r), self.weight(probe + r, torch.zeros_like(r)),
                                  rtol=1e-12, atol=0):
                raise ValueError(f"fused map {self.name!r}: row_value_in_score needs weight(s, r) = weight(s + r, 0)")
        if (self.dispatch == "threshold") != (self.threshold_exponent in (1, 2)) or self.threshold_exponent not in (
                0, 1, 2):
            raise ValueError(f"fused map {self.name!r}: dispatch 'threshold' maps declare threshold_exponent 1 or "
                             "2 ([x / e]_+^e), the others 0")
        if self.threshold_exponent:
            e, probe = self.threshold_exponent, torch.linspace(-2.0, 3.0, 11, dtype=torch.float64)
            if not torch.allclose(self.weight(probe, probe), (probe.clamp(min=0) / e) ** e, rtol=1e-12, atol=0):
                raise ValueError(f"fused map {self.name!r}: threshold_exponent {e} means weight(x) = [x / {e}]_+^{e}")


#: the weight (and denominator term) each running shift is implemented for: the kernels' code for that shift
#: computes exactly these, so a declaration naming the shift must declare them
_SHIFT_FORMS: dict[str, tuple[EntryFn, EntryFn, str]] = {
    "max_score": (lambda s, r: torch.relu(torch.expm1(s)), lambda s, r: torch.expm1(s).abs(),
                  "relu(e^s - 1) over |e^s - 1|"),
    "max_score_below_zero": (lambda s, r: torch.nn.functional.softplus(s),
                             lambda s, r: torch.nn.functional.softplus(s), "softplus(s)"),
    "log_abs_max": (lambda s, r: s.abs() ** r.abs(), lambda s, r: s.abs() ** r.abs(), "|s|^|r|"),
    "max_exp": (lambda s, r: s.exp(), lambda s, r: s.exp(), "e^s"),
}


def _n(n: Tensor) -> Tensor:
    return n.to(torch.float64)


def _stablemax(s: Tensor, r: Tensor) -> Tensor:
    return torch.where(s >= 0, s.clamp(min=0) + 1, 1 / (1 - s.clamp(max=0)))


def _alpha_weight(x: Tensor, alpha: Tensor) -> Tensor:
    return torch.relu((alpha - 1) * x) ** (1 / (alpha - 1))


def _alpha_slope(x: Tensor, alpha: Tensor) -> Tensor:
    return torch.relu((alpha - 1) * x) ** ((2 - alpha) / (alpha - 1))


_ROW_IS_N = "n, the keys the query sees (the map reads no row value; n == 1 marks single-key rows)"
#: power's default p and alpha-entmax's default alpha (normalizers/power.py, normalizers/entmax_alpha.py)
_P, _ALPHA = 2.0, 1.5

MAPS: tuple[FusedMap, ...] = (
    FusedMap("symax", 0, lambda s, r: s.abs(), lambda s, r: s.sign(), normalised=True, threshold=False,
             constant_on_single_key=False, single_key_mark="none", den_offset=lambda r: r,
             row_value="eta (|eta_h| >= 0), added to the denominator", row_value_for=lambda n: torch.ones_like(_n(n)),
             row_value_has_gradient=True, dispatch="tiles",
             code=EntryCode("std::abs(s)", "sgn(s)",
                            "tl.abs(s)", "tl.where(s > 0, 1.0, tl.where(s < 0, -1.0, 0.0))")),
    FusedMap("squared", 1, lambda s, r: s * s, lambda s, r: 2 * s, normalised=True, threshold=False,
             constant_on_single_key=True, single_key_mark="n == 1", row_value=_ROW_IS_N, row_value_for=_n,
             row_value_has_gradient=False, dispatch="tiles",
             code=EntryCode("s * s", "T(2) * s", "s * s", "2.0 * s")),
    FusedMap("stablemax", 2, _stablemax, lambda s, r: torch.where(s >= 0, 1.0, 1 / (1 - s.clamp(max=0)) ** 2),
             normalised=True, threshold=False, constant_on_single_key=True, single_key_mark="n == 1",
             row_value=_ROW_IS_N, row_value_for=_n, row_value_has_gradient=False, dispatch="tiles",
             # each side of 0 sees only its own half-line (no inf in the branch not taken); slope: w^2 below 0
             code=EntryCode("s >= T(0) ? s + T(1) : T(1) / (T(1) - std::min(s, T(0)))", "s >= T(0) ? T(1) : w * w",
                            "tl.where(s >= 0, tl.maximum(s, 0.0) + 1.0, 1.0 / (1.0 - tl.minimum(s, 0.0)))",
                            "tl.where(s >= 0, 1.0, w * w)"),
             delta_from_output=True),
    FusedMap("softpick", 3, lambda s, r: torch.relu(torch.expm1(s)), lambda s, r: torch.where(s > 0, s.exp(), 0.0),
             den_term=lambda s, r: torch.expm1(s).abs(), den_slope=lambda s, r: torch.expm1(s).sign() * s.exp(),
             normalised=True, threshold=False, constant_on_single_key=True, single_key_mark="n == 1",
             row_value=_ROW_IS_N, row_value_for=_n, row_value_has_gradient=False, dispatch="tiles", shift="max_score"),
    FusedMap("sigmoid", 4, lambda s, r: torch.sigmoid(s + r),
             lambda s, r: torch.sigmoid(s + r) * (1 - torch.sigmoid(s + r)), normalised=False, threshold=False,
             constant_on_single_key=False, single_key_mark="none", row_value="the bias b added to every score "
             "(-ln n by default)", row_value_for=lambda n: -torch.log(_n(n)), row_value_has_gradient=True,
             dispatch="tiles", row_value_in_score=True,
             code=EntryCode("T(1) / (T(1) + vexp(-(s + r)))", "w * (T(1) - w)",
                            "_sigmoid(s + r, FAST)", "w * (1.0 - w)")),
    FusedMap("relu_len", 5, lambda s, r: torch.relu(s) * r, lambda s, r: (s > 0).to(s.dtype) * r, normalised=False,
             threshold=False, constant_on_single_key=False, single_key_mark="none",
             row_value="1 / n, the factor on relu(s)", row_value_for=lambda n: 1 / _n(n),
             row_value_has_gradient=True, dispatch="tiles", row_value_factor=True,
             code=EntryCode("std::max(s, T(0)) * r", "s > T(0) ? r : T(0)",
                            "tl.maximum(s, 0.0) * r", "tl.where(s > 0, r + 0.0 * s, 0.0)")),
    FusedMap("entmax15", 6, lambda x, r: (torch.relu(x) / 2) ** 2, lambda x, r: torch.relu(x) / 2,
             normalised=False, threshold=True, constant_on_single_key=True, single_key_mark="n == 1",
             row_value=_ROW_IS_N, row_value_for=_n, row_value_has_gradient=False, dispatch="threshold",
             threshold_exponent=2),
    FusedMap("sparsemax", 7, lambda x, r: torch.relu(x), lambda x, r: (x > 0).to(x.dtype), normalised=False,
             threshold=True, constant_on_single_key=True, single_key_mark="n == 1", row_value=_ROW_IS_N,
             row_value_for=_n, row_value_has_gradient=False, dispatch="threshold", threshold_exponent=1),
    FusedMap("entmax_alpha", 8, _alpha_weight, _alpha_slope, normalised=False, threshold=True,
             constant_on_single_key=False, single_key_mark="none", row_value="alpha (1 < alpha <= 2, per head)",
             row_value_for=lambda n: torch.full_like(_n(n), _ALPHA), row_value_has_gradient=True, dispatch="alpha"),
    FusedMap("power", 9, lambda s, r: s.abs() ** r.abs(),
             lambda s, r: torch.where(s != 0, r.abs() * s.abs() ** r.abs() / torch.where(s != 0, s, 1.0), 0.0),
             normalised=True, threshold=False, constant_on_single_key=True, single_key_mark="negative",
             row_value="+p on rows with more than one visible key, -p on rows with one",
             row_value_for=lambda n: torch.where(_n(n) > 1, _P, -_P), row_value_has_gradient=True, dispatch="tiles",
             shift="log_abs_max", row_value_exponent=True),
    FusedMap("softplus", 10, lambda s, r: torch.nn.functional.softplus(s), lambda s, r: torch.sigmoid(s),
             normalised=True, threshold=False, constant_on_single_key=True, single_key_mark="n == 1",
             row_value=_ROW_IS_N, row_value_for=_n, row_value_has_gradient=False, dispatch="tiles",
             shift="max_score_below_zero", delta_from_output=True),
    # softmax itself, for the Triton kernels' score modifiers SDPA has no kernel for (forgetting attention's decay:
    # path triton_forget); the CPU and the plain calls run SDPA. delta from its own pass, not dO . O: with the decay
    # the weights sit on a few near keys, where the rounding of O reaches dS whole (measured, fp16 decode step: dq
    # 2.3x, dk 3.6x the error of FlashAttention's own low-precision reference; exact pass 1.0x)
    FusedMap("softmax", 11, lambda s, r: s.exp(), lambda s, r: s.exp(), normalised=True, threshold=False,
             constant_on_single_key=False, single_key_mark="none", row_value=_ROW_IS_N, row_value_for=_n,
             row_value_has_gradient=False, dispatch="tiles", shift="max_exp", cpu=False),
)

BY_NAME: dict[str, FusedMap] = {m.name: m for m in MAPS}
BY_ID: dict[int, FusedMap] = {m.kernel_id: m for m in MAPS}
if len(BY_NAME) != len(MAPS) or len(BY_ID) != len(MAPS):
    raise ValueError("kernels/fused/maps.py: every fused map needs its own name and its own kernel_id")

#: map name -> map id (what both kernels take; ``FusedMap.kernel_id``); ids are never reused
MAP_IDS: dict[str, int] = {m.name: m.kernel_id for m in MAPS}
#: maps whose rows are divided by a denominator accumulated with them (C++ ``is_normalised``)
NORMALISED: frozenset[str] = frozenset(m.name for m in MAPS if m.normalised)
#: maps with a per-row threshold found by a search over the row (C++ ``is_threshold``)
THRESHOLD: frozenset[str] = frozenset(m.name for m in MAPS if m.threshold)
#: maps whose denominator adds the row value (``FusedMap.den_offset``; C++ ``den_adds_row_value``)
DEN_ADDS_ROW_VALUE: frozenset[str] = frozenset(m.name for m in MAPS if m.den_offset is not None)
#: maps whose weight is the row value times a function of the score (``FusedMap.row_value_factor``)
ROW_VALUE_FACTOR: frozenset[str] = frozenset(m.name for m in MAPS if m.row_value_factor)


def map_id(name: str) -> int:
    """The id of map ``name`` (KeyError naming the known maps otherwise)."""
    try:
        return MAP_IDS[name]
    except KeyError:
        raise KeyError(f"no fused kernel map {name!r} (maps: {', '.join(MAP_IDS)})") from None


def fused_takes(norm: Normalizer, kernels: str) -> str | None:
    """Whether the fused kernels (``kernels`` names which, for the message) can run ``norm``: it declares a fused
    map (``kernel_family = "fused"``, ``fused_map``) and no q/k transform, since these kernels compute
    s = score_scale (q . k) directly. None, or the reason."""
    if norm.kernel_family != "fused" or norm.fused_map not in MAP_IDS:
        return f"normalizer {norm.name!r} declares no fused kernel map (maps: {', '.join(MAP_IDS)})"
    if type(norm).transform_qk is not Normalizer.transform_qk or type(norm).feature_map is not Normalizer.feature_map:
        return f"normalizer {norm.name!r} transforms q/k, which the {kernels} kernels do not"
    return None


def lookup_id(kernel_id: int) -> FusedMap:
    """The map with ``kernel_id``; ValueError naming the declared ids otherwise (the launchers call this before
    handing an id to a kernel)."""
    try:
        return BY_ID[int(kernel_id)]
    except (KeyError, TypeError, ValueError):
        known = ", ".join(f"{m.kernel_id} ({m.name})" for m in MAPS)
        raise ValueError(f"unknown fused map id {kernel_id!r}: the declared ids are {known}") from None


def _mask(pred: Callable[[FusedMap], bool], table: tuple[FusedMap, ...]) -> int:
    return sum(1 << m.kernel_id for m in table if pred(m))


def check_table(table: tuple[FusedMap, ...]) -> None:
    """A map table the kernels can be built for: distinct names, distinct ids below 64 (the C++ bit masks)."""
    if len({m.name for m in table}) != len(table) or len({m.kernel_id for m in table}) != len(table):
        raise ValueError("a fused map table needs distinct names and distinct kernel ids")
    if any(not 0 <= m.kernel_id < 64 for m in table):
        raise ValueError("fused map ids are 0..63 (the C++ kernel reads its facts from 64-bit masks)")


def cpu_maps(table: tuple[FusedMap, ...] = MAPS) -> tuple[FusedMap, ...]:
    """The maps of ``table`` the C++ kernels implement (``FusedMap.cpu``)."""
    return tuple(m for m in table if m.cpu)


def compile_definitions(table: tuple[FusedMap, ...] = MAPS) -> list[str]:
    """The map facts as C++ preprocessor definitions (bit i: map id i), read by ``fused/fused_cpu.cpp``; the maps
    with ``cpu=False`` are not declared there."""
    check_table(table)
    table = cpu_maps(table)
    facts: dict[str, Callable[[FusedMap], bool]] = {
        "HF_MAPS_DECLARED": lambda m: True,
        "HF_MAPS_NORMALISED": lambda m: m.normalised,
        "HF_MAPS_THRESHOLD": lambda m: m.threshold,
        "HF_MAPS_CONSTANT_ON_SINGLE_KEY": lambda m: m.constant_on_single_key,
        "HF_MAPS_SINGLE_KEY_NEGATIVE": lambda m: m.single_key_mark == "negative",
        "HF_MAPS_DEN_ADDS_ROW_VALUE": lambda m: m.den_offset is not None,
        "HF_MAPS_ROW_VALUE_FACTOR": lambda m: m.row_value_factor,
        "HF_MAPS_DISPATCH_THRESHOLD": lambda m: m.dispatch == "threshold",
        "HF_MAPS_DISPATCH_ALPHA": lambda m: m.dispatch == "alpha",
        "HF_MAPS_THRESHOLD_SQUARED": lambda m: m.threshold_exponent == 2,
        "HF_MAPS_SHIFT_MAX_SCORE": lambda m: m.shift == "max_score",
        "HF_MAPS_SHIFT_MAX_SCORE_BELOW_ZERO": lambda m: m.shift == "max_score_below_zero",
        "HF_MAPS_SHIFT_LOG_ABS_MAX": lambda m: m.shift == "log_abs_max",
        "HF_MAPS_ROW_VALUE_IN_SCORE": lambda m: m.row_value_in_score,
        "HF_MAPS_ROW_VALUE_EXPONENT": lambda m: m.row_value_exponent,
    }
    return [f"-D{name}={_mask(pred, table)}ULL" for name, pred in facts.items()]


def cpp_header(table: tuple[FusedMap, ...] = MAPS) -> str:
    """The C++ that ``fused/fused_cpu.cpp`` includes as ``hf_maps_generated.h`` (``cpu.py`` writes it beside the
    build): ``HF_MAPS_FOR_EACH(X)``, X(id) for every declared id (the kernels' dispatch switch), and
    ``MapEntry<T, id>`` with the declared ``EntryCode`` (``weight(s, r)``, ``slope(s, r, w)``) of each map that has
    one. Inline functions of plain expressions: each call is inlined into the kernels' loops. The maps with
    ``cpu=False`` are left out."""
    check_table(table)
    table = cpu_maps(table)
    ids = sorted(m.kernel_id for m in table)
    out = ["// generated by hf_attnorm/kernels/fused/maps.py (cpp_header) from the map declarations; not a source",
           "#pragma once", "", "#define HF_MAPS_FOR_EACH(X) " + " ".join(f"X({i})" for i in ids), "",
           "// MapEntry<T, id>::declared: the map has per-entry code (FusedMap.code); the others are computed by the",
           "// kernels' code for their declared running shift or threshold form",
           "template <typename T, int64_t MAP>", "struct MapEntry {", "  static constexpr bool declared = false;",
           "};"]
    for m in sorted(table, key=lambda m: m.kernel_id):
        if m.code is None:
            continue
        out += ["", f"template <typename T>  // {m.name}", f"struct MapEntry<T, {m.kernel_id}> {{",
                "  static constexpr bool declared = true;",
                "  static inline __attribute__((always_inline)) T weight(T s, [[maybe_unused]] T r) {",
                f"    return {m.code.cpp_weight};", "  }",
                "  static inline __attribute__((always_inline)) T slope(T s, [[maybe_unused]] T r, "
                "[[maybe_unused]] T w) {",
                f"    return {m.code.cpp_slope};", "  }", "};"]
    return "\n".join(out) + "\n"


def triton_source(table: tuple[FusedMap, ...] = MAPS) -> str:
    """The Triton device functions ``triton.py`` jits with its kernels: ``_map_weight(s, r, MAP, FAST)`` and
    ``_map_slope(s, r, w, MAP, FAST)``, each a compile-time chain over the ids of the maps with per-entry code (the
    declared ``EntryCode`` expressions); an id without code fails to compile there. For ``MAPS`` it is the checked-in
    module ``triton_maps.py`` (``write_triton_maps``; tests/test_fused_maps.py fails when the two drift)."""
    check_table(table)
    coded = [m for m in sorted(table, key=lambda m: m.kernel_id) if m.code is not None]
    lines = ['"""Generated by hf_attnorm/kernels/fused/maps.py (``triton_source``) from the map declarations: the',
             "per-entry code of the fused maps for the Triton kernels (triton_device.py calls these). Do not edit;",
             'regenerate with ``python -m hf_attnorm.kernels.fused.maps``."""', "",
             "# ruff: noqa: F821  (the device helpers they call resolve in the kernels' jit namespace)", "",
             "from __future__ import annotations", "", "from typing import Any", "",
             "tl: Any = None  # bound by triton._compiled before jitting", "", ""]
    for fn, args, attr, var in (("_map_weight", "s, r", "triton_weight", "w"),
                                ("_map_slope", "s, r, w", "triton_slope", "d")):
        lines.append(f"def {fn}({args}, MAP: tl.constexpr, FAST: tl.constexpr):")
        for i, m in enumerate(coded):
            lines += [f"    {'if' if i == 0 else 'elif'} MAP == {m.kernel_id}:  # {m.name}",
                      f"        {var} = {getattr(m.code, attr)}"]
        lines += [f"    {'else:' if coded else 'if True:'}",
                  '        tl.static_assert(False, "hf_attnorm triton: no per-entry code for this fused map '
                  '(see fused/maps.py)")',
                  f"        {var} = s", f"    return {var}", "", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


#: the checked-in module holding ``triton_source(MAPS)``
TRITON_MAPS_FILE = Path(__file__).with_name("triton_maps.py")


def write_triton_maps() -> Path:
    """Regenerate ``triton_maps.py`` from ``MAPS`` (after editing a declaration's Triton code)."""
    TRITON_MAPS_FILE.write_text(triton_source(MAPS))
    return TRITON_MAPS_FILE


#: id(table) -> (table, its key): each Triton launch looks its kernels up by the key, so it is generated once per
#: table (the entry holds the table, so its id is not reused while cached; tables and maps are immutable)
_TABLE_KEYS: dict[int, tuple[tuple[FusedMap, ...], str]] = {}


def table_key(table: tuple[FusedMap, ...] = MAPS) -> str:
    """What the kernels built for ``table`` depend on (its facts and its per-entry code): builds for different
    tables get different names."""
    cached = _TABLE_KEYS.get(id(table))
    if cached is None or cached[0] is not table:
        cached = _TABLE_KEYS[id(table)] = (
            table, "|".join([*compile_definitions(table), cpp_header(table), triton_source(table)]))
    return cached[1]


def threshold_weights(fmap: FusedMap, s: Tensor, r: Tensor, keep: Tensor, iters: int = 200) -> Tensor:
    """A threshold map's weights ``weight(s_j - t, r)`` over the visible keys, with the per-row t that makes them sum
    to 1 (float64; rows without a visible key give 0). s, keep: [..., Lk]; r: broadcastable to [..., 1].

    t is found by bisection, then moved by one Newton step t + (sum_j weight(s_j - t, r) - 1) / sum_j slope(s_j - t,
    r) taken with autograd on: its value stays t (the sum is 1 there) and its derivatives are the implicit ones,
    dt/ds_j = slope_j / sum slope and dt/dr = sum d weight/dr / sum slope, so gradients through the result are the
    map's Jacobian (built from the declared ``slope``)."""
    s = s.to(torch.float64)
    with torch.no_grad():
        masked = torch.where(keep, s, -math.inf)
        top = masked.max(dim=-1, keepdim=True).values
        live = torch.isfinite(top)
        top = torch.where(live, top, 0.0)
        lo, hi = top - 1e4, top.clone()  # at t = max the sum is 0; far below it, above 1 for every map here
        for _ in range(iters):
            mid = (lo + hi) / 2
            above = torch.where(keep, fmap.weight(s - mid, r), 0.0).sum(-1, keepdim=True) > 1
            lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
        t0 = (lo + hi) / 2
    mass = torch.where(keep, fmap.weight(s - t0, r), 0.0).sum(-1, keepdim=True)
    slope = torch.where(keep, fmap.slope(s - t0, r), 0.0).sum(-1, keepdim=True).detach()
    t = t0 + (mass - 1) / torch.where(slope > 0, slope, 1.0)
    return torch.where(keep & live, fmap.weight(s - t, r), 0.0)


def declared_weights(fmap: FusedMap, s: Tensor, r: Tensor, keep: Tensor) -> Tensor:
    """The attention weights the declaration defines, [..., Lk] (float64, autograd-connected to s and r): the
    numerator over the denominator for normalised maps (0 where it is 0), threshold weights, or the weights as
    they are. s, keep: [..., Lk]; r: [...] (one value per row)."""
    r = r.unsqueeze(-1)
    if fmap.threshold:
        return threshold_weights(fmap, s, r, keep)
    a = torch.where(keep, fmap.weight(s, r), 0.0)
    if not fmap.normalised:
        return a
    term = fmap.den_term or fmap.weight
    den = torch.where(keep, term(s, r), 0.0).sum(-1, keepdim=True)
    if fmap.den_offset is not None:
        den = den + fmap.den_offset(r)
    return torch.where(den != 0, a / torch.where(den != 0, den, 1.0), 0.0)


if __name__ == "__main__":  # python -m hf_attnorm.kernels.fused.maps: regenerate triton_maps.py
    print(f"wrote {write_triton_maps()}")
