"""A calibrated conversion start: per-head values of the new normalizer set from one pass of the original model.

The original (softmax) model runs over a few blocks of training text with every attention layer observed: each call
records, per head, statistics of its rows' logsumexp (``TeacherStats``: mean and spread of LSE - ln n, mean and
minimum of LSE, the share a phantom zero logit would take, the longest row) and passes the softmax output on, so
every layer sees the original model's inputs. Then the recipes of the normalizer and the scale (``recipes.py``)
each turn one layer's statistics into per-head values with their ``calibrate`` (docs/convert.md lists the formulas),
which are copied into the model's learnable values. A normalizer without a formula is reported as not calibrated, with
why.

>>> report = calibrate(model, blocks)   # blocks: token ids [N, L]; the model's attention is an hf_attnorm one
>>> report["calibrated"], report["notes"]
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ...attention import param_specs
from ...hf.families import attention_modules
from ...hf.forward import softmax_attention, softmax_row_statistics
from ...kernels.base import repeat_kv
from ...normalizers.base import Ctx, Normalizer
from ...registry import NORMALIZERS, SCALES, AttnormError
from ...settings import AttnormSettings
from ..observe import observing
from .recipes import Calibration, OffsetSearch, Recipe, TeacherStats, normalizer_recipe, scale_recipe

#: bisection steps of ``unit_sigmoid_bias`` over a bracket 24 wide: 24 / 2^30, far below fp32 rounding of the scores
UNIT_BIAS_STEPS = 30


def unit_sigmoid_bias(z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Per row, the c with sum_j sigmoid(z_j + c) = 1: z [B, H, Lq, Lk] (-inf where masked), lse [B, H, Lq] its
    logsumexp -> c [B, H, Lq]. The sum increases with c and is below 1 at c = -LSE (sigmoid(x) < e^x), so bisection
    over [-LSE, -LSE + 24] finds c; a row whose sum stays below 1 there (one key: sigmoid < 1 always) gets -LSE + 24
    (its weight sigmoid(24) = 1 - 4e-11)."""
    lo = -lse.clamp_min(-1e4)  # (rows without keys: finite garbage, dropped by the caller)
    width = torch.full_like(lo, 24.0)
    for _ in range(UNIT_BIAS_STEPS):
        width = width / 2
        mid = lo + width
        total = torch.sigmoid(z + mid.unsqueeze(-1)).sum(-1)
        lo = torch.where(total < 1, mid, lo)
    return lo + width


class _Accumulator:
    """Running per-head sums of one layer's rows (float64, so thousands of rows add up exactly enough)."""

    def __init__(self, heads: int, device: torch.device) -> None:
        def zeros() -> torch.Tensor:
            return torch.zeros(heads, dtype=torch.float64, device=device)
        self.count, self.d_sum, self.d_sq, self.lse_sum, self.zero_mass = zeros(), zeros(), zeros(), zeros(), zeros()
        self.exp_d, self.exp_2d, self.unit, self.unit_n, self.unit_count = zeros(), zeros(), zeros(), zeros(), zeros()
        self.v_sum, self.v_ln, self.v_ln2 = zeros(), zeros(), zeros()
        self.lse_min = torch.full((heads,), math.inf, dtype=torch.float64, device=device)
        self.max_n = 0
        self.offset_errors: torch.Tensor | None = None  # [H, G] with the normalizer's offset search

    def add(self, lse: torch.Tensor, n: torch.Tensor, z: torch.Tensor) -> None:
        """lse, n: [B, H, Lq] (rows with n = 0 are skipped); z: the scores [B, H, Lq, Lk], -inf where masked."""
        valid = (n >= 1) & torch.isfinite(lse)
        # V_i = Var_p(z_i): how much row i's softmax moves under a temperature (the weights of a temperature fit)
        p = torch.exp(z - lse.unsqueeze(-1)).nan_to_num(0.0)
        zf = torch.where(torch.isfinite(z), z, 0.0)
        var = torch.where(valid, (p * zf * zf).sum(-1) - (p * zf).sum(-1).square(), 0.0).clamp_min(0).double()
        ln_n = torch.log(n.clamp_min(1))
        self.v_sum += var.sum((0, 2))
        self.v_ln += (var * ln_n).sum((0, 2))
        self.v_ln2 += (var * ln_n * ln_n).sum((0, 2))
        several = valid & (n >= 2)  # (a row of one key has no unit-mass bias: sigmoid < 1)
        unit = torch.where(several, unit_sigmoid_bias(z, lse), 0.0).double()
        self.unit_count += several.sum((0, 2))
        self.unit += unit.sum((0, 2))
        self.unit_n += torch.where(several, unit + torch.log(n.double().clamp_min(1)), 0.0).sum((0, 2))
        lse, n = lse.double(), n.double()
        d = torch.where(valid, lse - torch.log(n.clamp_min(1)), 0.0)
        self.count += valid.sum((0, 2))
        self.d_sum += d.sum((0, 2))
        self.d_sq += (d * d).sum((0, 2))
        self.exp_d += torch.where(valid, d.exp(), 0.0).sum((0, 2))  # (float64: e^(2d) stays finite for d < 300)
        self.exp_2d += torch.where(valid, (2 * d).exp(), 0.0).sum((0, 2))
        self.lse_sum += torch.where(valid, lse, 0.0).sum((0, 2))
        self.zero_mass += torch.where(valid, torch.sigmoid(-lse), 0.0).sum((0, 2))
        self.lse_min = torch.minimum(self.lse_min, torch.where(valid, lse, math.inf).amin((0, 2)))
        self.max_n = max(self.max_n, int(n.max()))

    def add_offset_search(self, z: torch.Tensor, lse: torch.Tensor, value: torch.Tensor, norm: Normalizer,
                          settings: AttnormSettings, head_dim: int, search: OffsetSearch) -> None:
        """The recipe's ``search`` with the normalizer ``norm`` on this call's rows: z [B, H, Lq, Lk] (-inf where
        masked), lse [B, H, Lq], value [B, H, Lk, Dv] (repeated to the query heads). Adds, per head and candidate,
        the squared error of the attention outputs with value_h = (the head's mean LSE over these rows) + delta
        against the teacher's softmax outputs."""
        z, lse = z[:, :, ::search.row_stride], lse[:, :, ::search.row_stride]
        keep = torch.isfinite(z)
        valid = keep.any(-1)
        teacher = torch.exp(z - lse.unsqueeze(-1)).nan_to_num(0.0) @ value
        center = torch.where(valid, lse, 0.0).sum((0, 2)) / valid.sum((0, 2)).clamp_min(1)
        scores = torch.where(keep, z, 0.0)
        n = keep.sum(-1).float().clamp_min(1)
        errors = []
        for delta in search.deltas:
            ctx = Ctx(settings, {search.value: center + delta}, head_dim, n, {}, z.shape[-1])
            out = norm.reference(scores, keep, ctx) @ value
            errors.append(torch.where(valid, (out - teacher).square().sum(-1), 0.0).sum((0, 2)))
        found = torch.stack(errors, dim=1).double()
        self.offset_errors = found if self.offset_errors is None else self.offset_errors + found

    def stats(self) -> TeacherStats:
        count = self.count.clamp_min(1)
        mean = self.d_sum / count
        var = (self.d_sq / count - mean * mean).clamp_min(0)
        return TeacherStats(lse_minus_log_n=mean.float().cpu(), lse_minus_log_n_std=var.sqrt().float().cpu(),
                            log_mean_exp_d=(self.exp_d / count).log().float().cpu(),
                            log_mean_exp_2d=(self.exp_2d / count).log().float().cpu(),
                            unit_sigmoid_bias=(self.unit / self.unit_count.clamp_min(1)).float().cpu(),
                            unit_sigmoid_bias_plus_log_n=(self.unit_n / self.unit_count.clamp_min(1)).float().cpu(),
                            weighted_ln_n=(self.v_ln / self.v_sum.clamp_min(1e-30)).float().cpu(),
                            weighted_ln2_n=(self.v_ln2 / self.v_sum.clamp_min(1e-30)).float().cpu(),
                            lse_mean=(self.lse_sum / count).float().cpu(), lse_min=self.lse_min.float().cpu(),
                            zero_logit_mass=(self.zero_mass / count).float().cpu(), rows=int(self.count.min()),
                            max_n=self.max_n,
                            offset_errors=None if self.offset_errors is None else self.offset_errors.float().cpu())


class TeacherObserver:
    """The observer (``lab/observe.py``) put on every attention module while the teacher's statistics are
    gathered: records the call's softmax rows per head and returns the softmax output (the original model's)."""

    def __init__(self) -> None:
        #: per attention module, in the order of the first call
        self.layers: dict[nn.Module, _Accumulator] = {}

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: object, scaling: float | None, kwargs: dict[str, Any],
                 student: Any) -> tuple[torch.Tensor, None]:
        with torch.no_grad():
            lse, n, z = softmax_row_statistics(module, query, key, value, attention_mask, scaling, kwargs)
            if module not in self.layers:
                self.layers[module] = _Accumulator(lse.shape[1], lse.device)
            self.layers[module].add(lse, n, z)
            settings = module.attnorm.settings
            search = normalizer_recipe(settings.normalizer).offset_search
            # (a teacher with sink logits has an extra column no student key matches: the search is left out)
            if search is not None and z.shape[-1] == key.shape[2]:
                values = repeat_kv(value, query.shape[1] // value.shape[1]).float()
                self.layers[module].add_offset_search(z, lse, values, NORMALIZERS.get(settings.normalizer),
                                                      settings, query.shape[-1], search)
            return softmax_attention(module, query, key, value, attention_mask, scaling, kwargs), None


def teacher_statistics(model: nn.Module, blocks: torch.Tensor) -> dict[nn.Module, TeacherStats]:
    """One pass of the original (softmax) attention of ``model`` over ``blocks`` (token ids [N, L], one block per
    forward): per attention module, its ``TeacherStats`` (per head [H]). The decoder runs without the LM head."""
    if blocks.dim() != 2 or blocks.shape[0] < 1 or blocks.shape[1] < 1:
        raise ValueError(f"calibration blocks must be token ids [N >= 1, L >= 1], got shape {tuple(blocks.shape)}")
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(hf_model, "base_model", hf_model)
    device = next(model.parameters()).device
    observer = TeacherObserver()
    with observing(model, observer) as count, torch.no_grad():
        if count == 0:
            raise AttnormError("calibration: the model has no hf_attnorm attention module (load it with an hf_attnorm "
                               "attn_implementation)")
        for ids in blocks:
            decoder(input_ids=ids[None].to(device), use_cache=False)
    if not observer.layers:
        raise AttnormError("calibration: no attention call went through hf_attnorm; the model's attention modules do "
                           "not call transformers' attention interface")
    return {module: acc.stats() for module, acc in observer.layers.items()}


def calibration_options(settings: AttnormSettings) -> dict[str, Any]:
    """The option values the calibration of ``settings``' normalizer and scale needs (their recipes'
    ``calibration_options``)."""
    return {**normalizer_recipe(settings.normalizer).calibration_options,
            **scale_recipe(settings.scale).calibration_options}


def _owners(settings: AttnormSettings) -> list[tuple[str, Any, Recipe]]:
    """(label, normalizer or scale, its recipe) whose calibration is asked: each that has per-head values or a
    formula; the normalizer when neither has (so that its note says why nothing is calibrated)."""
    norm, scale = NORMALIZERS.get(settings.normalizer), SCALES.get(settings.scale)
    owners = [(f"normalizer {settings.normalizer}", norm, normalizer_recipe(settings.normalizer)),
              (f"scale {settings.scale}", scale, scale_recipe(settings.scale))]
    asked = [owner for owner in owners if owner[1].params or owner[2].calibrate is not None]
    return asked or owners[:1]


def formulas(settings: AttnormSettings, stats: TeacherStats) -> dict[str, Calibration | None]:
    """What each owner (``"normalizer X"``, ``"scale Y"``) of ``settings`` calibrates from one layer's ``stats``:
    its ``Calibration``, or None where it has no formula. ValueError naming the values when an owner returns a
    value that is not one of its per-head values."""
    out: dict[str, Calibration | None] = {}
    for label, owner, recipe in _owners(settings):
        cal = None if recipe.calibrate is None else recipe.calibrate(stats, settings)
        if cal is not None:
            allowed = {spec.name for spec in owner.params}
            unknown = sorted(set(cal.values) - allowed)
            if unknown:
                raise ValueError(f"{label}: calibrate returned {unknown}, which are not its per-head values; "
                                 f"allowed: {sorted(allowed) or 'none'}")
        out[label] = cal
    return out


def calibrate(model: nn.Module, blocks: torch.Tensor) -> dict[str, Any]:
    """Set the per-head values of ``model``'s normalizer and scale from one pass of its original softmax attention
    over ``blocks`` (token ids [N, L]). Returns the report (JSON-ready): ``calibrated`` (whether any value was set),
    ``notes`` (per owner: the formula and what it leaves, or why nothing was calibrated), ``values`` (per value name:
    per layer, per head, as set), ``not_set`` (value name -> why it could not be set: a constant shared by all
    heads), ``teacher`` (per layer: the mean over heads of the spread of LSE - ln n), ``blocks``, ``tokens``,
    ``seconds``."""
    start = time.perf_counter()
    settings = next((m.attnorm.settings for _, m in attention_modules(model) if hasattr(m, "attnorm")), None)
    if settings is not None and not any(recipe.calibrate is not None for _, _, recipe in _owners(settings)):
        # nothing to set: the teacher pass (tens of seconds on a real model) is skipped
        notes = {label: f"not calibrated: {recipe.calibration_note}" for label, _, recipe in _owners(settings)}
        return {"calibrated": False, "notes": notes, "values": {}, "not_set": {}, "teacher": {},
                "blocks": int(blocks.shape[0]), "tokens": 0, "seconds": round(time.perf_counter() - start, 2)}
    stats = teacher_statistics(model, blocks)
    notes: dict[str, str] = {}
    values: dict[str, list[list[float]]] = {}
    not_set: dict[str, str] = {}
    with torch.no_grad():
        for module, layer_stats in stats.items():
            state = module.attnorm
            specs = {spec.name: spec for spec in param_specs(state.settings)}
            recipes = {label: recipe for label, _, recipe in _owners(state.settings)}
            for label, cal in formulas(state.settings, layer_stats).items():
                if cal is None:
                    notes.setdefault(label, f"not calibrated: {recipes[label].calibration_note}")
                    continue
                notes.setdefault(label, cal.note if cal.values else f"nothing set: {cal.note}")
                for name, value in cal.values.items():
                    param = state._parameters.get(name)
                    if param is None:
                        not_set[name] = (f"{name} is a constant shared by every head ({specs[name].learnable_option}"
                                         "=false): set it true to calibrate it per head")
                        continue
                    param.copy_(value.to(param.device, param.dtype).view_as(param))
                    values.setdefault(name, []).append([round(float(v), 5) for v in value.flatten()])
    return {"calibrated": bool(values), "notes": notes, "values": values, "not_set": not_set,
            "teacher": {"lse_minus_log_n_std": [round(float(s.lse_minus_log_n_std.mean()), 4)
                                                for s in stats.values()],
                        "zero_logit_mass": [round(float(s.zero_logit_mass.mean()), 6) for s in stats.values()]},
            "blocks": int(blocks.shape[0]), "tokens": int(blocks.numel()),
            "seconds": round(time.perf_counter() - start, 2)}


def describe(report: Mapping[str, Any]) -> str:
    """One line of a calibration report for the console."""
    head = "calibrated" if report["calibrated"] else "not calibrated"
    parts = [f"{label}: {note}" for label, note in report["notes"].items()]
    parts += [f"not set: {why}" for why in report["not_set"].values()]
    return f"{head} on {report['tokens']} tokens ({report['seconds']} s); " + "; ".join(parts)
