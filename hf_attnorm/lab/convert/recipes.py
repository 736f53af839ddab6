"""Conversion recipes: how the lab converts a pretrained softmax model to each normalizer and scale.

A normalizer or scale says what attention computes; how ``scripts/convert.py`` gets a pretrained model there is a
recipe here, keyed by the registered name (``NORMALIZER_RECIPES``, ``SCALE_RECIPES``; ``register_recipe`` adds one
for a normalizer or scale registered elsewhere): the option values that reproduce softmax (``conversion_start``),
the path from softmax along one option that stage 1 walks (``Continuation``), the calibrated start from the teacher's
statistics (``calibrate`` with its ``TeacherStats``, the options it needs, an ``OffsetSearch`` over candidates where
there is no closed form, or a note saying why there is none) and stage 1's measured peak learning rate. Every value
is one measured or derived in docs/convert.md; a name without a recipe gets ``Recipe()``: no start, no path, no
formula, the default rate.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from ...settings import AttnormSettings


@dataclasses.dataclass(frozen=True)
class TeacherStats:
    """What one pass of the original (softmax) model over a few calibration blocks says about one attention layer,
    per query head, over every row with a visible key. z = the row's scaled scores (the teacher's mask, soft-cap,
    bias and sink included), LSE_i = logsumexp_j z_ij, n_i = keys row i sees.

    lse_minus_log_n: mean_i (LSE_i - ln n_i), [H]; lse_minus_log_n_std: its standard deviation over the rows,
    [H]; log_mean_exp_d, log_mean_exp_2d: ln mean_i e^(d_i), ln mean_i e^(2 d_i) with d_i = LSE_i - ln n_i, [H];
    unit_sigmoid_bias: mean_i c_i over rows of >= 2 keys, where c_i gives the row's sigmoid weights unit mass
    (sum_j sigmoid(z_ij + c_i) = 1; c_i > -LSE_i), [H]; unit_sigmoid_bias_plus_log_n: mean_i (c_i + ln n_i), [H];
    weighted_ln_n, weighted_ln2_n: sum_i V_i ln n_i / sum_i V_i and sum_i V_i (ln n_i)^2 / sum_i V_i, V_i =
    Var_{p_i}(z_i) the variance of row i's scores under its softmax weights p_i (its sensitivity to a temperature:
    KL(p_i || softmax(beta z_i)) ~ (beta - 1)^2 V_i / 2), [H] (0 where every row is flat);
    lse_mean: mean_i LSE_i, [H]; lse_min: min_i LSE_i, [H]; zero_logit_mass: mean_i sigmoid(-LSE_i), the share a
    phantom key of logit 0 would take, [H]; rows: rows measured per head; max_n: the longest row (the calibration
    blocks' length L)."""

    lse_minus_log_n: torch.Tensor
    lse_minus_log_n_std: torch.Tensor
    log_mean_exp_d: torch.Tensor
    log_mean_exp_2d: torch.Tensor
    unit_sigmoid_bias: torch.Tensor
    unit_sigmoid_bias_plus_log_n: torch.Tensor
    weighted_ln_n: torch.Tensor
    weighted_ln2_n: torch.Tensor
    lse_mean: torch.Tensor
    lse_min: torch.Tensor
    zero_logit_mass: torch.Tensor
    rows: int
    max_n: int
    #: with the recipe's ``offset_search``: [H, G] the summed squared error of the layer's attention outputs against
    #: the teacher's for each of the G candidate offsets (``OffsetSearch.deltas``); None: no search ran
    offset_errors: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A calibrated start for one layer: per-head values to set (name -> fp32 [H]; names of the owner's
    ``params``), and a note: the formula and the error it leaves (empty values with a note: nothing to set, e.g. a
    start that is already exact)."""

    values: dict[str, torch.Tensor]
    note: str


@dataclasses.dataclass(frozen=True)
class Continuation:
    """A path from softmax to a normalizer along one option (a conversion's stage 1 walks it, so that the stage starts
    at the teacher and ends at the asked normalizer): implementation ``via`` (None: the normalizer's own) with
    ``via_options`` added, and ``option`` moved from ``start`` (where it computes softmax, or nearly) to ``end`` (None:
    the value the conversion asks for). At ``end`` the ``via`` implementation computes the asked normalizer (entmax15
    is alpha-entmax at alpha = 1.5)."""

    option: str
    start: float
    end: float | None = None
    via: str | None = None
    via_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: the source of the path (a paper that anneals the parameter, or the limit it follows)
    note: str = ""
    #: whether a conversion walks it unless told not to; False for a path measured to do worse than starting at the
    #: asked normalizer (then ``--continuation`` asks for it, and ``off_note`` says what was measured)
    by_default: bool = True
    off_note: str = ""


@dataclasses.dataclass(frozen=True)
class OffsetSearch:
    """A per-head value with no closed-form calibration, fitted on the teacher's rows instead: the teacher pass tries
    value_h = m_h + delta for every delta in ``deltas`` (m_h the head's mean LSE_i over the call's rows) with the
    normalizer's own ``reference``, and accumulates per head the squared error of the attention outputs sum_j w_ij
    v_j against the teacher's softmax outputs (``TeacherStats.offset_errors``); the recipe's ``calibrate`` keeps the
    best delta per head. Every ``row_stride``-th query row is measured (rows are independent: a sample is enough)."""

    value: str
    deltas: tuple[float, ...]
    row_stride: int = 4


#: what a normalizer or scale without a calibration formula says when asked for one
NO_CALIBRATION = "declares no calibration formula (its per-head values, if any, start at their options' values)"

#: one layer's teacher statistics and the run's settings -> the calibrated start (or None: no formula applies)
Calibrate = Callable[[TeacherStats, AttnormSettings], "Calibration | None"]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a conversion reaches one normalizer or scale (the module docstring); every field optional."""

    #: option values under which the normalizer computes (to within 1e-4) softmax attention, so that a converted
    #: model starts at its own outputs (``scripts/convert.py`` uses them unless given others); empty where softmax
    #: needs no option or no setting reproduces it
    conversion_start: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: a path from softmax along one option (``Continuation``; a normalizer's wins over its scale's), or None
    continuation: Continuation | None = None
    #: option values a calibrated start needs (e.g. a per-head value made learnable, so that each head can hold its
    #: own); ``scripts/convert.py --calibrate`` sets them unless given others
    calibration_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: the peak learning rate of stage 1 (attention transfer), where one was measured to do better than convert.py's
    #: default (docs/convert.md, "Stage-1 learning rates"; a normalizer's wins over its scale's); None: the default
    transfer_learning_rate: float | None = None
    #: a per-head value fitted by trying candidates on the teacher's rows (``OffsetSearch``), or None
    offset_search: OffsetSearch | None = None
    #: the calibrated start of one layer from the teacher's statistics (per head [H]), or None where there is no
    #: formula (``calibration_note`` says why); docs/convert.md has each formula, its source and the error it leaves
    calibrate: Calibrate | None = None
    #: why there is no calibration (reported, never silent)
    calibration_note: str = NO_CALIBRATION


# ------------------------------------------------------------------------------------------------- the formulas

#: the largest share of a calibration row the calibrated sink may take: 1e-4, softmax to within 1e-4 (the bound of
#: ``conversion_start``) while the sink keeps a gradient (Adam rescales a small one)
CALIBRATION_SINK_MASS = 1e-4

#: candidate stick-breaking offsets, relative to the head's mean row logsumexp (``OffsetSearch``), in half steps from
#: 8 below the sink limit (delta 0) to 2 above it: a lower offset lets the first (sink) key break more of what is left,
#: at the price of larger shares for the keys nearer the query
OFFSET_DELTAS = tuple(d / 2 for d in range(-16, 5))


def calibrate_sink(stats: TeacherStats, settings: AttnormSettings) -> Calibration:
    """The sink takes sigmoid(sigma_h - LSE_i) of row i; sigma_h -> -inf is softmax. sigma_h = min_i LSE_i -
    ln((1 - eps) / eps), eps = ``CALIBRATION_SINK_MASS``: the sink takes at most eps of every calibration row."""
    eps = CALIBRATION_SINK_MASS
    sigma = stats.lse_min.float() - math.log((1 - eps) / eps)
    return Calibration({"sink_logit": sigma},
                       f"sigma_h = min LSE - ln((1-eps)/eps), eps = {eps:g}: the sink takes at most {eps:g} of a "
                       "calibration row (more only on a held-out row whose LSE is below that minimum)")


def calibrate_sigmoid(stats: TeacherStats, settings: AttnormSettings) -> Calibration:
    """sigmoid(z_i + b) is near the softmax weight e^(z_i - LSE) when b = -LSE and the weights are small; exact
    row mass 1 needs b = c_i >= -LSE_i (sum_j sigmoid(z_ij + c_i) = 1, larger on peaked rows, where sigmoid
    saturates). One b per head: with b = -ln n + b_h (the default, derived -ln n), b_h = mean_i (c_i + ln n_i);
    with a constant sigmoid_bias, b_h = mean_i c_i. Ramapuram et al.'s b = -ln n is about a flat row's c_i (all n
    scores 0: c_i = -ln(n - 1)); b_h = -mean(LSE - ln n) is the small-weight limit (c_i -> -LSE_i)."""
    if settings.sigmoid_bias is None:
        return Calibration({"sigmoid_bias": stats.unit_sigmoid_bias_plus_log_n.float()},
                           "b = -ln n + b_h, b_h = mean over the teacher's rows of (c_i + ln n_i), c_i the bias "
                           "that gives row i unit mass: rows whose c_i + ln n_i is off the mean keep mass off 1 "
                           "(the spread of LSE - ln n, lse_minus_log_n_std, predicts it), and within a row "
                           "sigmoid's saturation reshapes the weights of peaked rows")
    return Calibration({"sigmoid_bias": stats.unit_sigmoid_bias.float()},
                       "b_h = mean of c_i (constant-bias form): rows of other lengths keep mass off 1 (-ln n per "
                       "row, the default form, is closer)")


def calibrate_stickbreaking(stats: TeacherStats, settings: AttnormSettings) -> Calibration:
    """Softmax as a stick broken from the nearest key has break logits z_ij - ln sum_{m<j} e^{z_im}: no offset
    is exact (the subtracted term depends on the row and the key). When an early sink key holds most of a row,
    ln sum_{m<j} e^{z_im} ~ z_i0 ~ LSE_i, so c_h ~ mean_i LSE_i; but then the sink itself breaks only half the
    stick (sigmoid(z_i0 - c_h) ~ 1/2) and leaves the rest to the query's own key. The teacher pass therefore
    tries c_h = mean LSE + delta (``OFFSET_DELTAS``) and keeps, per head, the one whose attention outputs are
    nearest the teacher's; without that search (no teacher rows), the sink limit delta = 0."""
    if stats.offset_errors is None:
        return Calibration({"stickbreaking_offset": stats.lse_mean.float()},
                           "c_h = mean LSE (the sink limit; no search over the teacher's rows ran)")
    best = stats.offset_errors.argmin(dim=1)
    delta = torch.tensor(OFFSET_DELTAS, dtype=torch.float32)[best]
    return Calibration({"stickbreaking_offset": stats.lse_mean.float() + delta},
                       f"c_h = mean LSE + delta_h, delta_h in [{OFFSET_DELTAS[0]}, {OFFSET_DELTAS[-1]}] the one "
                       "whose outputs are nearest the teacher's on its rows: no offset is exact, the stick "
                       "still breaks from the nearest key where softmax weighs keys by score alone")


def calibrate_ssmax(stats: TeacherStats, settings: AttnormSettings) -> Calibration:
    """With a learnable bias: s_h = 0, b_h = 1, softmax exactly. Without: the multiplier s_h ln n is 1
    (softmax) only on rows of n = e^(1/s_h) keys, so s_h is fitted to the teacher: s_h = sum V_i ln n_i /
    sum V_i (ln n_i)^2 minimises sum_i V_i (s_h ln n_i - 1)^2, the second-order KL of every row's softmax against
    its ssmax (V_i = the row's score variance, ``TeacherStats.weighted_ln_n``); 1/ln L (exact on rows of L keys)
    for a head whose rows are all flat."""
    heads = stats.lse_min.shape[0]
    if settings.ssmax_bias_learnable:
        return Calibration({"ssmax_s": torch.zeros(heads), "ssmax_bias": torch.ones(heads)},
                           "s_h = 0, b_h = 1: softmax exactly on every row (training moves s_h from 0)")
    if stats.max_n < 2:
        return Calibration({}, f"rows of {stats.max_n} key: ln n = 0, no s_h reproduces softmax")
    fallback = 1.0 / math.log(stats.max_n)
    fitted = stats.weighted_ln_n.float() / stats.weighted_ln2_n.float()
    s = torch.where(stats.weighted_ln2_n > 0, fitted, torch.full((heads,), fallback))
    return Calibration({"ssmax_s": s},
                       "s_h = sum V ln n / sum V (ln n)^2 (V = a row's score variance under softmax): the "
                       "multiplier s_h ln n is 1 only on rows of e^(1/s_h) keys, shorter rows flatter, longer "
                       f"sharper (1/ln L = {fallback:.4f} would be exact on rows of L = {stats.max_n}; exact "
                       "everywhere: --attnorm ssmax_bias_learnable=true)")


# -------------------------------------------------------------------------------------------------- the recipes

_ALPHA_TO_SOFTMAX = "alpha-entmax is softmax in the limit alpha -> 1"

#: normalizer name -> its recipe
NORMALIZER_RECIPES: dict[str, Recipe] = {
    "softmax": Recipe(calibration_note="softmax is the teacher itself: nothing to calibrate"),
    "softmax_n": Recipe(
        continuation=Continuation("n_extra", 0.0, note="softmax_n is softmax at n_extra = 0"),
        calibration_note="no per-head value to set: the swap is the start, off softmax by the share n_extra / "
                         "(n_extra + e^LSE) the phantom key takes (for softmax1 the teacher's statistics give its "
                         "mean, zero_logit_mass)"),
    # a constant sink (sink_learnable false) walked from where it takes no mass (e^-30 of a row) to its value
    "sink": Recipe(continuation=Continuation("sink_init", -30.0, note="a sink logit sigma -> -inf is softmax"),
                   calibrate=calibrate_sink),
    # every gate sigmoid(10) = 1 - 4.5e-5
    "gated": Recipe(conversion_start={"gated_bias_init": 10.0}),
    # f = sigmoid(10): a decay of 4.5e-5 per token
    "fox": Recipe(conversion_start={"fox_bias_init": 10.0}),
    "symax": Recipe(calibration_note="no exact start: |s_i| / (eta + sum |s_j|) is not a function of softmax's e^s_i "
                                     "for any eta; not calibrated (attention transfer trains eta)"),
    # softmax in the limit alpha -> 1: with a fixed alpha (entmax_alpha_learnable false) a conversion anneals it
    "entmax_alpha": Recipe(
        continuation=Continuation("entmax_alpha", 1.001, note=_ALPHA_TO_SOFTMAX),
        calibration_note="no per-head temperature; alpha -> 1 is softmax, a start chosen with --attnorm "
                         "entmax_alpha=1.001 rather than from the teacher: not calibrated"),
    # alpha-entmax tends to softmax as alpha -> 1 (Peters et al. 2019): anneal alpha from there to 1.5; stage 1 (with
    # the continuation) on SmolLM2 ended nearest the teacher at 1e-2 (5e-3 to 2e-2 measured)
    "entmax15": Recipe(
        continuation=Continuation("entmax_alpha", 1.001, 1.5, via="entmax_alpha",
                                  via_options={"entmax_alpha_learnable": False},
                                  note=f"{_ALPHA_TO_SOFTMAX} and entmax15 at alpha = 1.5"),
        transfer_learning_rate=1e-2,
        calibration_note="no per-head temperature exists (alpha is fixed at 1.5): not calibrated"),
    # stage 1 on SmolLM2 (LoRA on q/k only: nothing else to train) ended nearest the teacher at 5e-2 (5e-3 to 1e-1
    # measured)
    "linear": Recipe(
        transfer_learning_rate=5e-2,
        calibration_note="no exact start: elu+1 features give weights phi(q).phi(k) / sum phi(q).phi(k), no function "
                         "of e^(q.k) (a learned feature map does better: Hedgehog, arXiv 2402.04347): not calibrated"),
    # not linear's 5e-2: with its feature maps to train, stage 1 on SmolLM2 ended nearest the teacher at the default
    # 2e-2 (5e-3 to 5e-2 measured)
    "hedgehog": Recipe(
        calibration_note="no closed-form start: the feature maps start at the identity and attention transfer "
                         "(scripts/convert.py stage 1) trains them to mimic softmax; not calibrated"),
    # one offset per head needs the learnable (per-head) value; no measured rate: stage 1 alone ended nearer the
    # teacher at 1e-2 than at the default 2e-2 on SmolLM2, but whole conversions at 1e-2 ended worse in 3 of 4 final
    # perplexities (docs/convert.md, "Stage-1 learning rates")
    "sigmoid": Recipe(calibration_options={"sigmoid_bias_learnable": True}, calibrate=calibrate_sigmoid),
    # one offset per head needs the learnable value; from the calibrated offset, stage 1 on SmolLM2 ended nearest the
    # teacher at 1e-2 (2e-3 to 2e-2 measured)
    "stickbreaking": Recipe(calibration_options={"stickbreaking_offset_learnable": True},
                            offset_search=OffsetSearch("stickbreaking_offset", OFFSET_DELTAS),
                            transfer_learning_rate=1e-2, calibrate=calibrate_stickbreaking),
}

#: scale name -> its recipe
SCALE_RECIPES: dict[str, Recipe] = {
    # stage 1 from the calibrated s_h on SmolLM2: 2e-2 overshot (layer error 0.037 -> 0.09 at step 5 and back), 5e-3
    # fell steadily (1e-3 to 2e-2 measured). The anchor released: stage 1 starts at softmax (a = 1) with the
    # calibrated s_h in place and ends at SSMax; not walked by default: measured on SmolLM2 (docs/convert.md), it
    # ends stage 1 further from the teacher than training the calibrated plain form from its first step
    "ssmax": Recipe(
        transfer_learning_rate=5e-3,
        continuation=Continuation(
            "ssmax_anchor", 1.0, note="(1 - a)(s_h ln n + b_h) + a with a from 1 (softmax) to 0", by_default=False,
            off_note="its calibrated start is already near the teacher (SmolLM2: layer error 0.037); releasing the "
                     "anchor over stage 1 ended further from it than training that start (0.028 against 0.022 after "
                     "20 steps)"),
        calibrate=calibrate_ssmax),
}

_NONE = Recipe()


def register_recipe(name: str, recipe: Recipe, kind: Literal["normalizer", "scale"] = "normalizer") -> Recipe:
    """Declare the conversion recipe of a registered normalizer (or, with ``kind="scale"``, a scale) ``name``,
    replacing any earlier one; returns it."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"register_recipe({name!r}, ...) takes a Recipe, got {type(recipe).__name__}")
    if kind not in ("normalizer", "scale"):
        raise ValueError(f"register_recipe: kind is {kind!r}; allowed: 'normalizer', 'scale'")
    (NORMALIZER_RECIPES if kind == "normalizer" else SCALE_RECIPES)[name] = recipe
    return recipe


def normalizer_recipe(name: str) -> Recipe:
    """The recipe of normalizer ``name`` (``Recipe()`` where none is declared)."""
    return NORMALIZER_RECIPES.get(name, _NONE)


def scale_recipe(name: str) -> Recipe:
    """The recipe of scale ``name`` (``Recipe()`` where none is declared)."""
    return SCALE_RECIPES.get(name, _NONE)


def recipes_of(settings: AttnormSettings) -> tuple[Recipe, Recipe]:
    """(the normalizer's recipe, the scale's) for ``settings``."""
    return normalizer_recipe(settings.normalizer), scale_recipe(settings.scale)
