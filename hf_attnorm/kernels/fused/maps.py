"""The fused maps, each declared once: what the C++ (``fused/fused_cpu.cpp``) and Triton (``triton.py``) kernels
compute per score entry, as a named form and the few numbers the form needs.

A fused map turns a score s (q . k with every scale applied) and the row's value r (one number per query row,
``Normalizer.row_value``; n when the normalizer gives none) into a weight. ``FusedMap`` states it once:

* ``weight(s, r)`` and ``slope(s, r)`` = d weight / ds: the numerator term of one visible key (0 for invisible keys);
  ``den_term`` / ``den_slope`` when the denominator sums another term (softpick: |e^s - 1|);
* ``form``, one of three, with its numbers:

  - "pointwise": the map's own per-entry ``code`` (``EntryCode``, C++ and Triton expressions), ``normalised`` or
    not (symax, squared, stablemax, sigmoid, relu_len);
  - "shifted": a normalised map whose weights are kept relative to a per-row ``running_shift`` (softpick, softplus,
    power; softmax on the GPU only); the shift names the weight the kernels compute;
  - "threshold": [x]_+^e with a per-row threshold found by a search over the row, e = ``threshold_exponent`` (1:
    sparsemax, 2: entmax-1.5, -1: alpha-entmax's 1 / (alpha - 1) from the row value);

* ``row_value_use``: how the kernels read r ("n", "score_offset", "weight_factor", "den_offset", "exponent",
  "alpha"); ``single_key``: how they find rows with one visible key (their score gradients are exactly 0);
  ``row_value`` (what r holds), ``row_value_for(n)`` (its default value), ``row_value_has_gradient``.

``FACTS`` is the vocabulary the three languages share: ``FusedMap.facts()`` gives each fact's number; the C++ header
``cpp_header`` declares ``map_<fact>(id)`` and ``<FACT>_<VALUE>`` constants from it, the Triton kernels take the
facts as constexprs of the same names (``triton.map_constants``) and jit the generated ``triton_source``
(``_map_weight`` / ``_map_slope``). ``__post_init__`` checks each number against the declared ``weight`` and
refuses what the kernels cannot obey. Neither kernel names a map; ``tests/test_fused_maps.py`` evaluates every map
here through both kernels (forward and gradients against ``weight`` / ``slope``), asks the compiled C++ for its facts
per id (``map_facts``), and runs a map declared only in the test. An id outside the table raises in both kernels.

Adding a map: one ``FusedMap`` entry in ``MAPS`` (next free id below 64, never reuse one): a pointwise map with its
``code``, or the numbers of a form the kernels already compute (docs/extending.md lists what else changes).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from ...normalizers.base import HEAD_MAP_IDS, N_TERM_IDS, Normalizer

Tensor = torch.Tensor
#: elementwise function of the score s [..., Lk] and the row value r (broadcast to s)
EntryFn = Callable[[Tensor, Tensor], Tensor]
#: the named forms of a fused map (``FusedMap.form``)
Form = Literal["pointwise", "shifted", "threshold"]
#: how the kernels read the row value (``FusedMap.row_value_use``)
RowValueUse = Literal["n", "score_offset", "weight_factor", "den_offset", "exponent", "alpha"]
#: how the kernels find single-key rows (``FusedMap.single_key``)
SingleKey = Literal["none", "n == 1", "negative"]
#: the per-row running shift of the shifted form (``FusedMap.running_shift``)
Shift = Literal["none", "max_score", "max_score_below_zero", "log_abs_max", "max_exp", "max_abs_exp"]

#: the vocabulary the three languages share: each fact's name (the Triton constexpr; ``map_<fact lowered>(id)`` in
#: the C++ header; the ``FusedMap`` field of that name lowered) and the number each value of it is passed as (C++
#: constants ``<FACT>_<VALUE>``; Triton compares with the number and names the value in a comment, checked by
#: tests/test_fused_maps.py)
FORM_IDS: dict[str, int] = {"pointwise": 0, "shifted": 1, "threshold": 2}
ROW_VALUE_USE_IDS: dict[str, int] = {"n": 0, "score_offset": 1, "weight_factor": 2, "den_offset": 3, "exponent": 4,
                                     "alpha": 5}
SINGLE_KEY_IDS: dict[str, int] = {"none": 0, "n == 1": 1, "negative": 2}
SHIFT_IDS: dict[str, int] = {"none": 0, "max_score": 1, "max_score_below_zero": 2, "log_abs_max": 3, "max_exp": 4,
                             "max_abs_exp": 5}
THRESHOLD_EXPONENT_IDS: dict[int, int] = {0: 0, 1: 1, 2: 2, -1: -1}
_FACT_IDS: dict[str, dict] = {"FORM": FORM_IDS, "NORMALISED": {False: 0, True: 1}, "RUNNING_SHIFT": SHIFT_IDS,
                              "THRESHOLD_EXPONENT": THRESHOLD_EXPONENT_IDS, "ROW_VALUE_USE": ROW_VALUE_USE_IDS,
                              "SINGLE_KEY": SINGLE_KEY_IDS}
FACTS: tuple[str, ...] = tuple(_FACT_IDS)
#: the C++ forward drivers (``FusedMap.driver``)
DRIVERS: dict[str, int] = {"tiles": 0, "threshold": 1, "alpha": 2}


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
    """One fused map: its ``form`` and the few numbers the form needs (the vocabulary ``FACTS`` names, the same in
    Python, the C++ header and the Triton constexprs), its declared ``weight`` / ``slope`` and, for the pointwise
    form, its per-entry ``code``. ``__post_init__`` checks each number against the declared ``weight``."""

    name: str
    kernel_id: int
    weight: EntryFn
    slope: EntryFn
    #: "pointwise" (per-entry ``code``), "shifted" (the weight of its ``running_shift``), "threshold" ([x]_+^e with
    #: a per-row threshold; ``threshold_exponent``)
    form: Form
    #: what r holds (for the docs), the value a normalizer with default options passes for rows with n visible keys,
    #: whether the kernels return d out / d r
    row_value: str
    row_value_for: Callable[[Tensor], Tensor]
    row_value_has_gradient: bool
    #: rows are divided by ``sum_j den_term(s_j, r)`` (plus r with ``row_value_use`` "den_offset"); pointwise and
    #: shifted maps only
    normalised: bool = False
    #: how the kernels read the row value r: "n" (not at all: r = n, the visible keys), "score_offset" (weight(s +
    #: r, 0): sigmoid's bias, d out / d r = sum_j dS_j), "weight_factor" (r weight(s, 1): relu_len's 1/n; the C++
    #: kernel scales each row once), "den_offset" (added to a normalised map's denominator: symax's eta),
    #: "exponent" (|s|^|r|, form "shifted" with running_shift "log_abs_max": power's p, d weight / d r = weight
    #: ln|s|), "alpha" (alpha-entmax's alpha: the threshold form's exponent is 1 / (alpha - 1))
    row_value_use: RowValueUse = "n"
    #: single-key rows, whose weights do not depend on the scores: the kernels set their score gradients to exactly
    #: 0 (computed, they would be rounding noise amplified by f'/D) and find them by "n == 1" (the row value is n
    #: there) or "negative" (the row value is negated there); "none": computed as any row (alpha-entmax's weights
    #: are constant there too, but its row value marks nothing)
    single_key: SingleKey = "none"
    #: form "shifted": the per-row running shift m the weights are kept relative to (rescaled by e^(m_old - m_new)
    #: when it rises; m cancels in the normalised ratio): "max_score": m = max(0, visible scores) (softpick's e^s -
    #: 1); "max_score_below_zero": m = min(0, max visible score), from -inf (softplus); "log_abs_max": m = |r| ln
    #: max_j |s_j|, from -inf (power's |s|^|r|); "max_exp": m = the max visible score, from -inf (softmax's e^s:
    #: the Triton kernels only); "max_abs_exp": m = the max visible |s|, from 0 (cog's sign(s) e^|s| over e^|s|).
    #: Each shift computes one weight (``_SHIFT_FORMS``)
    running_shift: Shift = "none"
    #: form "threshold": weight(x) = [x / e]_+^e with e = 1 (sparsemax) or 2 (entmax-1.5), or -1: alpha-entmax's
    #: [(alpha - 1) x]_+^(1 / (alpha - 1)) with alpha the row value (``row_value_use`` "alpha")
    threshold_exponent: int = 0
    #: the denominator's term when it is not the weight (softpick: |e^s - 1|), and its slope
    den_term: EntryFn | None = None
    den_slope: EntryFn | None = None
    #: form "pointwise": the per-entry code both kernels compile (``EntryCode``)
    code: EntryCode | None = None
    #: normalised maps: the Triton backward takes delta_i = sum_j w_ij dP_ij from dO_i . O_i (FlashAttention's
    #: shortcut, one preprocess instead of a second walk over the keys) because the map's b'(s) / D is bounded, so
    #: the rounding of O is not amplified into dS (docs/triton.md has the measurement that sorted the maps); False:
    #: the kernels compute delta from the same dP as dS (exact zeros on single-key rows)
    delta_from_output: bool = False
    #: the C++ kernels implement this map (``cpp_header`` takes only these); False: the Triton kernels only
    #: (softmax, which the CPU runs through SDPA's own kernels)
    cpu: bool = True

    def __post_init__(self) -> None:
        def refuse(why: str) -> None:
            raise ValueError(f"fused map {self.name!r}: {why}")

        for fact, ids in _FACT_IDS.items():
            value = getattr(self, fact.lower())
            if value not in ids:
                refuse(f"{fact.lower()} must be one of {sorted(ids, key=str)} (got {value!r})")
        if self.form == "pointwise" and self.code is None:
            refuse("the pointwise form declares its per-entry code (code=EntryCode(...))")
        if self.form != "pointwise" and self.code is not None:
            refuse(f"the {self.form} form is computed by the kernels' code for its numbers: no code=")
        if (self.form == "shifted") != (self.running_shift != "none"):
            refuse("the shifted form, and only it, names its running_shift")
        if (self.form == "threshold") != (self.threshold_exponent != 0):
            refuse("the threshold form, and only it, declares threshold_exponent 1, 2 or -1 (alpha)")
        if self.form == "threshold" and self.normalised:
            refuse("a threshold map is not also divided by a denominator")
        if self.form == "shifted" and not self.normalised:
            refuse("a running shift cancels only in a normalised map's ratio")
        if (self.row_value_use == "alpha") != (self.threshold_exponent == -1):
            refuse("threshold_exponent -1 takes its exponent from the row value alpha (row_value_use='alpha'), "
                   "and only it")
        if (self.row_value_use == "exponent") != (self.running_shift == "log_abs_max"):
            refuse("row_value_use 'exponent' (|s|^|r|) and running_shift 'log_abs_max' (m = |r| ln max|s|) go "
                   "together")
        if self.row_value_use == "exponent" and self.single_key != "negative":
            refuse("row_value_use 'exponent' reads |r|: its sign marks single-key rows (single_key='negative')")
        if self.single_key == "negative" and self.row_value_use != "exponent":
            refuse("single_key 'negative' needs a row value whose sign is free (row_value_use 'exponent')")
        if self.single_key == "n == 1" and self.row_value_use != "n":
            refuse("single_key 'n == 1' reads n from the row value (row_value_use 'n')")
        if self.row_value_use == "den_offset" and (not self.normalised or self.form != "pointwise"):
            refuse("row_value_use 'den_offset' adds r to the denominator of a normalised pointwise map")
        if self.row_value_use in ("score_offset", "weight_factor") and (self.normalised or self.form != "pointwise"):
            refuse(f"row_value_use {self.row_value_use!r} is implemented for pointwise maps that are not normalised "
                   "(a factor would cancel; an offset is the map's own business there)")
        if self.den_term is not None and self.running_shift not in ("max_score", "max_abs_exp"):
            refuse("the kernels sum a map's own weight in its denominator: only running_shift 'max_score' "
                   "(softpick: |e^s - 1|) and 'max_abs_exp' (cog: e^|s|) sum another term")
        if self.running_shift == "max_exp" and self.cpu:
            refuse("the C++ kernels have no 'max_exp' shift (cpu=False)")
        if self.delta_from_output and not self.normalised:
            refuse("delta_from_output is the delta of a normalised map (sum_j w_ij dP_ij = dO . O); threshold maps "
                   "keep their own mean term")
        self._check_numbers_against_weight()

    def _check_numbers_against_weight(self) -> None:
        """Each number the kernels branch on, checked on the declared ``weight`` (float64 probes)."""
        probe = torch.linspace(-2.5, 2.5, 11, dtype=torch.float64)
        if self.running_shift != "none":
            form = _SHIFT_FORMS[self.running_shift]
            r = torch.full_like(probe, 3.0)
            term = self.den_term or self.weight
            if not (torch.allclose(self.weight(probe, r), form[0](probe, r), rtol=1e-12, atol=1e-300)
                    and torch.allclose(term(probe, r), form[1](probe, r), rtol=1e-12, atol=1e-300)):
                raise ValueError(f"fused map {self.name!r}: the kernels compute running_shift "
                                 f"{self.running_shift!r} for the weight {form[2]} only")
        if self.row_value_use == "score_offset":
            r = torch.full_like(probe, 0.75)
            if not torch.allclose(self.weight(probe, r), self.weight(probe + r, torch.zeros_like(r)), rtol=1e-12,
                                  atol=0):
                raise ValueError(f"fused map {self.name!r}: row_value_use 'score_offset' needs weight(s, r) = "
                                 "weight(s + r, 0)")
        if self.threshold_exponent in (1, 2):
            e = self.threshold_exponent
            if not torch.allclose(self.weight(probe, probe), (probe.clamp(min=0) / e) ** e, rtol=1e-12, atol=0):
                raise ValueError(f"fused map {self.name!r}: threshold_exponent {e} means weight(x) = [x / {e}]_+^{e}")

    def facts(self) -> dict[str, int]:
        """The numbers the kernels branch on, by their shared names (``FACTS``): the C++ header's ``map_<fact>``
        and the Triton constexprs of the same name take exactly these values."""
        return {fact: _FACT_IDS[fact][getattr(self, fact.lower())] for fact in FACTS}

    @property
    def driver(self) -> int:
        """The C++ forward driver (``DRIVERS``): one tiled pass, the threshold search then a pass, or alpha-entmax's
        Newton search."""
        return 2 if self.threshold_exponent == -1 else 1 if self.form == "threshold" else 0


#: the weight (and denominator term) each running shift is implemented for: the kernels' code for that shift
#: computes exactly these, so a declaration naming the shift must declare them
_SHIFT_FORMS: dict[str, tuple[EntryFn, EntryFn, str]] = {
    "max_score": (lambda s, r: torch.relu(torch.expm1(s)), lambda s, r: torch.expm1(s).abs(),
                  "relu(e^s - 1) over |e^s - 1|"),
    "max_score_below_zero": (lambda s, r: torch.nn.functional.softplus(s),
                             lambda s, r: torch.nn.functional.softplus(s), "softplus(s)"),
    "log_abs_max": (lambda s, r: s.abs() ** r.abs(), lambda s, r: s.abs() ** r.abs(), "|s|^|r|"),
    "max_exp": (lambda s, r: s.exp(), lambda s, r: s.exp(), "e^s"),
    "max_abs_exp": (lambda s, r: torch.sign(s) * s.abs().exp(), lambda s, r: s.abs().exp(),
                    "sign(s) e^|s| over e^|s|"),
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
    FusedMap("symax", 0, lambda s, r: s.abs(), lambda s, r: s.sign(), "pointwise", normalised=True,
             row_value_use="den_offset", row_value="eta (|eta_h| >= 0), added to the denominator",
             row_value_for=lambda n: torch.ones_like(_n(n)), row_value_has_gradient=True,
             code=EntryCode("std::abs(s)", "sgn(s)",
                            "tl.abs(s)", "tl.where(s > 0, 1.0, tl.where(s < 0, -1.0, 0.0))")),
    FusedMap("squared", 1, lambda s, r: s * s, lambda s, r: 2 * s, "pointwise", normalised=True,
             single_key="n == 1", row_value=_ROW_IS_N, row_value_for=_n, row_value_has_gradient=False,
             code=EntryCode("s * s", "T(2) * s", "s * s", "2.0 * s")),
    FusedMap("stablemax", 2, _stablemax, lambda s, r: torch.where(s >= 0, 1.0, 1 / (1 - s.clamp(max=0)) ** 2),
             "pointwise", normalised=True, single_key="n == 1", row_value=_ROW_IS_N, row_value_for=_n,
             row_value_has_gradient=False,
             # each side of 0 sees only its own half-line (no inf in the branch not taken); slope: w^2 below 0
             code=EntryCode("s >= T(0) ? s + T(1) : T(1) / (T(1) - std::min(s, T(0)))", "s >= T(0) ? T(1) : w * w",
                            "tl.where(s >= 0, tl.maximum(s, 0.0) + 1.0, 1.0 / (1.0 - tl.minimum(s, 0.0)))",
                            "tl.where(s >= 0, 1.0, w * w)"),
             delta_from_output=True),
    FusedMap("softpick", 3, lambda s, r: torch.relu(torch.expm1(s)), lambda s, r: torch.where(s > 0, s.exp(), 0.0),
             "shifted", den_term=lambda s, r: torch.expm1(s).abs(),
             den_slope=lambda s, r: torch.expm1(s).sign() * s.exp(), normalised=True, single_key="n == 1",
             row_value=_ROW_IS_N, row_value_for=_n, row_value_has_gradient=False, running_shift="max_score"),
    FusedMap("sigmoid", 4, lambda s, r: torch.sigmoid(s + r),
             lambda s, r: torch.sigmoid(s + r) * (1 - torch.sigmoid(s + r)), "pointwise",
             row_value_use="score_offset", row_value="the bias b added to every score (-ln n by default)",
             row_value_for=lambda n: -torch.log(_n(n)), row_value_has_gradient=True,
             code=EntryCode("T(1) / (T(1) + vexp(-(s + r)))", "w * (T(1) - w)",
                            "_sigmoid(s + r, FAST)", "w * (1.0 - w)")),
    FusedMap("relu_len", 5, lambda s, r: torch.relu(s) * r, lambda s, r: (s > 0).to(s.dtype) * r, "pointwise",
             row_value_use="weight_factor", row_value="1 / n, the factor on relu(s)",
             row_value_for=lambda n: 1 / _n(n), row_value_has_gradient=True,
             code=EntryCode("std::max(s, T(0)) * r", "s > T(0) ? r : T(0)",
                            "tl.maximum(s, 0.0) * r", "tl.where(s > 0, r + 0.0 * s, 0.0)")),
    FusedMap("entmax15", 6, lambda x, r: (torch.relu(x) / 2) ** 2, lambda x, r: torch.relu(x) / 2, "threshold",
             threshold_exponent=2, single_key="n == 1", row_value=_ROW_IS_N, row_value_for=_n,
             row_value_has_gradient=False),
    FusedMap("sparsemax", 7, lambda x, r: torch.relu(x), lambda x, r: (x > 0).to(x.dtype), "threshold",
             threshold_exponent=1, single_key="n == 1", row_value=_ROW_IS_N, row_value_for=_n,
             row_value_has_gradient=False),
    FusedMap("entmax_alpha", 8, _alpha_weight, _alpha_slope, "threshold", threshold_exponent=-1,
             row_value_use="alpha", row_value="alpha (1 < alpha <= 2, per head)",
             row_value_for=lambda n: torch.full_like(_n(n), _ALPHA), row_value_has_gradient=True),
    FusedMap("power", 9, lambda s, r: s.abs() ** r.abs(),
             lambda s, r: torch.where(s != 0, r.abs() * s.abs() ** r.abs() / torch.where(s != 0, s, 1.0), 0.0),
             "shifted", normalised=True, running_shift="log_abs_max", row_value_use="exponent", single_key="negative",
             row_value="+p on rows with more than one visible key, -p on rows with one",
             row_value_for=lambda n: torch.where(_n(n) > 1, _P, -_P), row_value_has_gradient=True),
    FusedMap("softplus", 10, lambda s, r: torch.nn.functional.softplus(s), lambda s, r: torch.sigmoid(s), "shifted",
             normalised=True, running_shift="max_score_below_zero", single_key="n == 1", row_value=_ROW_IS_N,
             row_value_for=_n, row_value_has_gradient=False, delta_from_output=True),
    # cog's signed weights: the numerator's slope is e^|s| away from 0 (sign(s)^2), the denominator's sign(s) e^|s|
    FusedMap("cog", 12, lambda s, r: torch.sign(s) * s.abs().exp(), lambda s, r: (s != 0).to(s.dtype) * s.abs().exp(),
             "shifted", den_term=lambda s, r: s.abs().exp(), den_slope=lambda s, r: torch.sign(s) * s.abs().exp(),
             normalised=True, running_shift="max_abs_exp", single_key="n == 1", row_value=_ROW_IS_N,
             row_value_for=_n, row_value_has_gradient=False),
    # softmax itself, for the Triton kernels' score modifiers SDPA has no kernel for (forgetting attention's decay:
    # path triton_forget); the CPU and the plain calls run SDPA. delta from its own pass, not dO . O: with the decay
    # the weights sit on a few near keys, where the rounding of O reaches dS whole (measured, fp16 decode step: dq
    # 2.3x, dk 3.6x the error of FlashAttention's own low-precision reference; exact pass 1.0x)
    FusedMap("softmax", 11, lambda s, r: s.exp(), lambda s, r: s.exp(), "shifted", normalised=True,
             running_shift="max_exp", row_value=_ROW_IS_N, row_value_for=_n, row_value_has_gradient=False, cpu=False),
)

BY_NAME: dict[str, FusedMap] = {m.name: m for m in MAPS}
BY_ID: dict[int, FusedMap] = {m.kernel_id: m for m in MAPS}
if len(BY_NAME) != len(MAPS) or len(BY_ID) != len(MAPS):
    raise ValueError("kernels/fused/maps.py: every fused map needs its own name and its own kernel_id")

#: map name -> map id (what both kernels take; ``FusedMap.kernel_id``); ids are never reused
MAP_IDS: dict[str, int] = {m.name: m.kernel_id for m in MAPS}
#: maps whose rows are divided by a denominator accumulated with them
NORMALISED: frozenset[str] = frozenset(m.name for m in MAPS if m.normalised)
#: maps of the threshold form (a per-row threshold found by a search over the row)
THRESHOLD: frozenset[str] = frozenset(m.name for m in MAPS if m.form == "threshold")

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


def check_table(table: tuple[FusedMap, ...]) -> None:
    """A map table the kernels can be built for: distinct names, distinct ids below 64 (the C++ bit masks)."""
    if len({m.name for m in table}) != len(table) or len({m.kernel_id for m in table}) != len(table):
        raise ValueError("a fused map table needs distinct names and distinct kernel ids")
    if any(not 0 <= m.kernel_id < 64 for m in table):
        raise ValueError("fused map ids are 0..63")


def cpu_maps(table: tuple[FusedMap, ...] = MAPS) -> tuple[FusedMap, ...]:
    """The maps of ``table`` the C++ kernels implement (``FusedMap.cpu``)."""
    return tuple(m for m in table if m.cpu)


def _cpp_name(value: object) -> str:
    """A fact's value as a C++ identifier part: "n == 1" -> "N_EQ_1", "max_score" -> "MAX_SCORE"."""
    return re.sub(r"\W+", "_", str(value).replace("==", "eq")).strip("_").upper()


def cpp_facts_header(table: tuple[FusedMap, ...] = MAPS) -> str:
    """The C++ that ``fused/fused_cpu.cpp`` includes first as ``hf_map_facts_generated.h`` (``cpu.py`` writes it
    beside the build): the shared vocabulary (``FACTS``) as constants ``<FACT>_<VALUE>`` and, per fact, ``constexpr
    int64_t map_<fact>(int64_t id)`` with every declared map's number (-1000 for an undeclared id, which
    ``map_declared`` tells). The maps with ``cpu=False`` are left out."""
    check_table(table)
    table = sorted(cpu_maps(table), key=lambda m: m.kernel_id)
    out = ["// generated by hf_attnorm/kernels/fused/maps.py (cpp_facts_header) from the map declarations; not a "
           "source", "#pragma once", "",
           "// the vocabulary shared with maps.py (FACTS) and the Triton constexprs of the same names"]
    for fact, ids in _FACT_IDS.items():
        if all(isinstance(v, str) for v in ids):
            out += [f"constexpr int64_t {fact}_{_cpp_name(v)} = {i};" for v, i in ids.items()]
    out += ["", "// the row forms of the decode op (normalizers/base.py RowForm: HEAD_MAP_IDS, N_TERM_IDS)",
            *[f"constexpr int64_t ROW_HEAD_MAP_{_cpp_name(v)} = {i};" for v, i in HEAD_MAP_IDS.items()],
            *[f"constexpr int64_t ROW_N_TERM_{_cpp_name(v)} = {i};" for v, i in N_TERM_IDS.items()]]
    out += ["", "constexpr bool map_declared(int64_t id) {", "  switch (id) {",
            *[f"    case {m.kernel_id}:  // {m.name}" for m in table], "      return true;", "    default:",
            "      return false;", "  }", "}"]
    for fact in FACTS:
        out += ["", f"constexpr int64_t map_{fact.lower()}(int64_t id) {{", "  switch (id) {"]
        for m in table:
            out += [f"    case {m.kernel_id}:  // {m.name}: {getattr(m, fact.lower())!r}",
                    f"      return {m.facts()[fact]};"]
        out += ["    default:", "      return -1000;", "  }", "}"]
    return "\n".join(out) + "\n"


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
            table, "|".join([cpp_facts_header(table), cpp_header(table), triton_source(table)]))
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
    if fmap.form == "threshold":
        return threshold_weights(fmap, s, r, keep)
    a = torch.where(keep, fmap.weight(s, r), 0.0)
    if not fmap.normalised:
        return a
    term = fmap.den_term or fmap.weight
    den = torch.where(keep, term(s, r), 0.0).sum(-1, keepdim=True)
    if fmap.row_value_use == "den_offset":
        den = den + r
    return torch.where(den != 0, a / torch.where(den != 0, den, 1.0), 0.0)


if __name__ == "__main__":  # python -m hf_attnorm.kernels.fused.maps: regenerate triton_maps.py
    print(f"wrote {write_triton_maps()}")
