"""The calibrated conversion start (hf_attnorm.lab.convert.calibration, ``scripts/convert.py --calibrate``).

Generic over the registry: every implementation either calibrates (its per-head values move the swapped model's
attention outputs toward the original model's, on a tiny random Llama) or says why not. The teacher's statistics
match an independent computation from the layers' q and k; each published formula matches its transcription; on the
real SmolLM2-135M the calibrated ssmax swap scores within 10% of the original model's perplexity with no training."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
from conftest import first_implementations, has_memory

import hf_attnorm  # noqa: F401
from hf_attnorm.hf.families import attention_modules
from hf_attnorm.lab.convert import calibration as cal
from hf_attnorm.lab.convert import converter as convert
from hf_attnorm.lab.convert.recipes import (
    OFFSET_DELTAS,
    Calibration,
    Recipe,
    TeacherStats,
    normalizer_recipe,
    recipes_of,
    scale_recipe,
)
from hf_attnorm.lab.observe import observing
from hf_attnorm.registry import PRESETS, SCALES, is_ours
from hf_attnorm.settings import resolve_settings

OURS = [name for name in PRESETS if is_ours(name)]
#: one implementation per normalizer, per scale with per-head values and per learned memory (the others differ by a
#: constant factor on q, which calibration does not read)
SAMPLE = first_implementations(lambda s: (s.normalizer, s.scale if SCALES.get(s.scale).params else None,
                                          has_memory(s)), OURS)
L = 32  # tokens per block on the tiny model


def _settings(impl: str, **extra):
    """The implementation's settings with the options its calibration needs (as convert.py sets them)."""
    options = cal.calibration_options(resolve_settings(impl, extra))
    return resolve_settings(impl, {**options, **extra})


def _tiny(impl: str, **extra) -> torch.nn.Module:
    """A micro Llama with q/k scaled up (sharper attention than a fresh init's, as in a trained model)."""
    from hf_attnorm.lab.model_zoo import build_model

    settings = _settings(impl, **extra)
    options = {k: v for k, v in settings.to_dict().items() if k not in ("implementation", "normalizer", "scale")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model("llama", "micro", vocab_size=97, max_positions=128, attn_implementation=impl,
                            attnorm=options, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(4.0)
    return model.eval()


def _ids(seed: int, blocks: int = 2) -> torch.Tensor:
    return torch.randint(0, 97, (blocks, L), generator=torch.Generator().manual_seed(seed))


def _layer_error(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """Mean over layers and blocks of the relative error of the attention outputs against the original model's
    (every layer fed the original model's inputs, as convert.py measures it)."""
    with convert.observing(model, convert.Transfer()) as transfer, torch.no_grad():
        return float(torch.stack([convert.transfer_errors(model, transfer, row[None], False) for row in ids]).mean())


def _random_stats(heads: int = 4, seed: int = 0) -> TeacherStats:
    g = torch.Generator().manual_seed(seed)
    return TeacherStats(lse_minus_log_n=torch.rand(heads, generator=g) * 3, lse_minus_log_n_std=torch.rand(heads),
                        log_mean_exp_d=torch.rand(heads, generator=g) * 3 + 1,
                        log_mean_exp_2d=torch.rand(heads, generator=g) * 3 + 5,
                        unit_sigmoid_bias=-torch.rand(heads, generator=g) * 4,
                        unit_sigmoid_bias_plus_log_n=torch.randn(heads, generator=g),
                        weighted_ln_n=torch.rand(heads, generator=g) + 4,
                        weighted_ln2_n=torch.rand(heads, generator=g) + 25,
                        lse_mean=torch.rand(heads, generator=g) * 5 + 2, lse_min=torch.rand(heads, generator=g),
                        zero_logit_mass=torch.rand(heads, generator=g) * 0.1, rows=100, max_n=512)


# ---------------------------------------------------------------------------------------- every implementation


@pytest.mark.parametrize("impl", OURS)
def test_every_implementation_calibrates_per_head_values_or_says_why_not(impl):
    settings = _settings(impl)
    found = cal.formulas(settings, _random_stats())
    assert found, impl
    for label, result in found.items():
        if result is None:
            recipe = normalizer_recipe(settings.normalizer) if label.startswith("normalizer") else \
                scale_recipe(settings.scale)
            assert recipe.calibration_note.strip(), label
            continue
        assert result.note.strip(), label
        for name, value in result.values.items():
            assert value.shape == (4,) and torch.isfinite(value).all(), (label, name, value)


def test_a_formula_returning_a_value_its_owner_does_not_have_is_refused(monkeypatch):
    from hf_attnorm.lab.convert import recipes

    wrong = Recipe(calibrate=lambda stats, settings: Calibration({"nosuch": torch.zeros(4)}, "x"))
    monkeypatch.setitem(recipes.NORMALIZER_RECIPES, "sink", wrong)
    with pytest.raises(ValueError,
                       match=r"normalizer sink: calibrate returned \['nosuch'\].*allowed: \['sink_logit'\]"):
        cal.formulas(_settings("sink"), _random_stats())


# -------------------------------------------------------------------------- the teacher's statistics, by hand


def _captured(model: torch.nn.Module, ids: torch.Tensor) -> list[list[tuple[torch.Tensor, ...]]]:
    """Per layer, per block: the (q, k, v, scaling) each attention call of the original (softmax) model receives,
    every layer fed the softmax output (as the calibration pass runs)."""
    from hf_attnorm.hf.forward import softmax_attention

    calls: list[tuple[torch.Tensor, ...]] = []

    def capture(module, query, key, value, attention_mask, scaling, kwargs, student):
        calls.append((query.detach(), key.detach(), value.detach(), scaling))
        return softmax_attention(module, query, key, value, attention_mask, scaling, kwargs), None

    modules = [m for _, m in attention_modules(model)]
    with torch.no_grad(), observing(model, capture):
        for row in ids:
            model.model(input_ids=row[None], use_cache=False)
    layers = len(modules)
    assert len(calls) == layers * len(ids)
    return [calls[layer::layers] for layer in range(layers)]


def _scores64(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """The causal scaled scores in float64, -inf above the diagonal: q [1, H, L, D], k [1, Hkv, L, D] -> [H, L, L]."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    z = (q.double() @ k.double().transpose(-1, -2)) * scaling
    return z.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), -math.inf)[0]


def test_the_teacher_statistics_match_an_independent_computation_from_q_and_k():
    """LSE of the causal rows of softmax(q k^T * scaling), computed here from the q and k each layer receives."""
    model = _tiny("sigmoid")
    ids = _ids(1)
    captured = _captured(model, ids)
    stats = list(cal.teacher_statistics(model, ids).values())
    assert len(stats) == len(captured)
    ln_n = torch.log(torch.arange(1, L + 1, dtype=torch.float64)).repeat(len(ids))
    for got, calls in zip(stats, captured):
        z = torch.cat([_scores64(q, k, scaling) for q, k, _, scaling in calls], dim=1)  # [H, blocks * L, L]
        lse = torch.logsumexp(z, -1)
        d = lse - ln_n
        unit = torch.cat([_unit_bias_by_newton(_scores64(q, k, scaling)) for q, k, _, scaling in calls], dim=1)
        p = torch.softmax(z, -1)
        zf = z.nan_to_num(0, 0, 0)
        var = (p * zf ** 2).sum(-1) - (p * zf).sum(-1) ** 2  # Var_p(z): the temperature fit's row weight
        several = unit.isfinite()  # (one-key rows have no unit bias: sigmoid < 1)
        mean_unit = torch.where(several, unit, 0).sum(-1) / several.sum(-1)
        # the bisection stops within 24 / 2^30 of c_i; the scores themselves are fp32 (about 1e-6 relative)
        torch.testing.assert_close(got.unit_sigmoid_bias.double(), mean_unit, rtol=0, atol=1e-4)
        torch.testing.assert_close(got.unit_sigmoid_bias_plus_log_n.double(),
                                   torch.where(several, unit + ln_n, 0).sum(-1) / several.sum(-1), rtol=0, atol=1e-4)
        torch.testing.assert_close(got.weighted_ln_n.double(), (var * ln_n).sum(-1) / var.sum(-1), rtol=1e-4,
                                   atol=1e-5)
        torch.testing.assert_close(got.weighted_ln2_n.double(), (var * ln_n ** 2).sum(-1) / var.sum(-1), rtol=1e-4,
                                   atol=1e-5)
        torch.testing.assert_close(got.lse_minus_log_n.double(), d.mean(-1), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.lse_minus_log_n_std.double(), d.std(-1, correction=0), rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(got.lse_mean.double(), lse.mean(-1), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.log_mean_exp_d.double(), d.exp().mean(-1).log(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.log_mean_exp_2d.double(), (2 * d).exp().mean(-1).log(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.lse_min.double(), lse.amin(-1), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.zero_logit_mass.double(), torch.sigmoid(-lse).mean(-1), rtol=1e-4,
                                   atol=1e-6)
        assert got.max_n == L and got.rows == L * len(ids)


def _unit_bias_by_newton(z: torch.Tensor) -> torch.Tensor:
    """z: [H, L, L] causal scores (-inf masked) -> per row of >= 2 keys the c with sum_j sigmoid(z_j + c) = 1, by
    Newton's method in float64 kept inside [-LSE, -LSE + 24]; NaN on the one-key row (sigmoid < 1: none)."""
    z = z.double()
    lse = torch.logsumexp(z, -1)
    c = -lse + 1.0
    for _ in range(200):
        s = torch.sigmoid(z + c.unsqueeze(-1))
        step = (s.sum(-1) - 1) / (s * (1 - s)).sum(-1).clamp_min(1e-300)
        c = torch.minimum(torch.maximum(c - step, -lse), -lse + 24)
    c[:, 0] = math.nan
    return c


# ------------------------------------------------------- each calibration end to end, against float64 by hand


def _set_values(model: torch.nn.Module, name: str) -> list[torch.Tensor]:
    """Per layer, the per-head value ``name`` the model holds [H]."""
    return [m.attnorm._parameters[name].detach().flatten() for _, m in attention_modules(model)]


def test_ssmax_calibration_end_to_end_is_the_variance_weighted_fit():
    """The s_h each layer holds after the calibration pass is argmin_s sum_i V_i (s ln n_i - 1)^2 over the teacher's
    rows, V_i = Var_{p_i}(z_i), computed here in float64 from the q and k each layer receives; the second moment
    E_p[z^2] as the weight (a plausible slip) gives other values, far outside the tolerance."""
    model = _tiny("ssmax")
    ids = _ids(2)
    captured = _captured(model, ids)
    assert cal.calibrate(model, ids)["calibrated"]
    ln_n = torch.log(torch.arange(1, L + 1, dtype=torch.float64))
    for got, calls in zip(_set_values(model, "ssmax_s"), captured, strict=True):
        num = den = num_wrong = den_wrong = 0.0
        for q, k, _, scaling in calls:
            z = _scores64(q, k, scaling)
            p = torch.softmax(z, -1)
            zf = z.nan_to_num(0, 0, 0)
            second = (p * zf ** 2).sum(-1)
            var = second - (p * zf).sum(-1) ** 2
            num, den = num + (var * ln_n).sum(-1), den + (var * ln_n ** 2).sum(-1)
            num_wrong, den_wrong = num_wrong + (second * ln_n).sum(-1), den_wrong + (second * ln_n ** 2).sum(-1)
        expected, wrong = num / den, num_wrong / den_wrong
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=0)
        assert ((wrong - expected).abs() / expected).max() > 1e-2, (wrong, expected)


def _stick_breaking64(z: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """Stick-breaking weights written out key by key in float64 (the paper's defaults: the query's own key does not
    break the stick and takes the remainder): z [H, R, L] break logits of the rows at ``positions`` -> [H, R, L]."""
    out = torch.zeros_like(z)
    for r, i in enumerate(positions):
        left = torch.ones(z.shape[0], dtype=z.dtype)
        for j in range(i - 1, -1, -1):  # from the nearest key backwards
            beta = torch.sigmoid(z[:, r, j])
            out[:, r, j] = beta * left
            left = left * (1 - beta)
        out[:, r, i] = left
    return out


def test_stickbreaking_calibration_end_to_end_is_the_nearest_searched_offset():
    """The offset each layer holds after the calibration pass is mean_i LSE_i + delta_h, where delta_h's outputs
    (stick-breaking written out in float64 here, on every 4th row as the search reads them, each block's candidates
    centred on that block's mean LSE) are the nearest the teacher's softmax outputs among OFFSET_DELTAS (up to
    rounding: the chosen candidate's error is within 1e-6 of the least)."""
    model = _tiny("stickbreaking")
    ids = _ids(3)
    captured = _captured(model, ids)
    assert cal.calibrate(model, ids)["calibrated"]
    stride = normalizer_recipe("stickbreaking").offset_search.row_stride
    positions = list(range(0, L, stride))
    deltas = torch.tensor(OFFSET_DELTAS, dtype=torch.float64)
    moved = False
    for got, calls in zip(_set_values(model, "stickbreaking_offset"), captured, strict=True):
        errors = torch.zeros(got.shape[0], len(OFFSET_DELTAS), dtype=torch.float64)
        lse_all = []
        for q, k, v, scaling in calls:
            z = _scores64(q, k, scaling)
            lse = torch.logsumexp(z, -1)
            lse_all.append(lse)
            rows, center = z[:, positions], lse[:, positions].mean(-1)
            values = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)[0].double()  # [H, L, D]
            teacher = torch.softmax(rows, -1) @ values
            for g, delta in enumerate(deltas):
                shifted = (rows - (center + delta)[:, None, None]).nan_to_num(0, 0, 0)
                out = _stick_breaking64(shifted, positions) @ values
                errors[:, g] += (out - teacher).square().sum((-1, -2))
        chosen = got.double() - torch.cat(lse_all, -1).mean(-1)
        index = (chosen[:, None] - deltas).abs().argmin(1)
        torch.testing.assert_close(chosen, deltas[index], rtol=0, atol=2e-4)  # a candidate, to fp32's rounding
        picked = errors.gather(1, index[:, None])[:, 0]
        assert (picked <= errors.min(1).values * (1 + 1e-6)).all(), (errors, index)
        moved = moved or bool((deltas[index] != 0).any())
    assert moved  # the search moved off the sink limit (delta 0) somewhere


# ---------------------------------------------------------------------------- each formula, transcribed


def test_the_formulas_match_their_transcriptions():
    stats = _random_stats()
    got = cal.formulas(_settings("sigmoid"), stats)["normalizer sigmoid"].values["sigmoid_bias"]
    torch.testing.assert_close(got, stats.unit_sigmoid_bias_plus_log_n)  # b = -ln n + b_h, b_h = mean(c + ln n)
    got = cal.formulas(_settings("sigmoid", sigmoid_bias=0.0), stats)["normalizer sigmoid"].values["sigmoid_bias"]
    torch.testing.assert_close(got, stats.unit_sigmoid_bias)  # constant bias: b_h = mean(c)
    got = cal.formulas(_settings("sink"), stats)["normalizer sink"].values["sink_logit"]
    torch.testing.assert_close(got, stats.lse_min - math.log(9999.0))  # the sink takes <= 1e-4 of each row
    got = cal.formulas(_settings("ssmax"), stats)["scale ssmax"].values
    # s_h = argmin_s sum_i V_i (s ln n_i - 1)^2
    torch.testing.assert_close(got["ssmax_s"], stats.weighted_ln_n / stats.weighted_ln2_n)
    flat = dataclasses.replace(stats, weighted_ln_n=torch.zeros(4), weighted_ln2_n=torch.zeros(4))
    got = cal.formulas(_settings("ssmax"), flat)["scale ssmax"].values
    torch.testing.assert_close(got["ssmax_s"], torch.full((4,), 1 / math.log(512)))  # flat rows: exact at n = L
    got = cal.formulas(_settings("ssmax", ssmax_bias_learnable=True), stats)["scale ssmax"].values
    torch.testing.assert_close(got["ssmax_s"], torch.zeros(4))
    torch.testing.assert_close(got["ssmax_bias"], torch.ones(4))


def test_the_ssmax_bias_variant_at_s_0_b_1_is_softmax():
    """scaling * (s ln n + b) with s = 0, b = 1 is the model's own scaling: the layer error is 0 (to rounding)."""
    model = _tiny("ssmax", ssmax_bias_learnable=True)
    report = cal.calibrate(model, _ids(0))
    assert report["calibrated"] and not report["not_set"]
    assert _layer_error(model, _ids(5)) < 1e-10


def test_sigmoid_calibration_makes_the_rows_weights_close_to_softmax_in_the_mean():
    """The calibrated sigmoid weights, summed over a row, are close to 1 on average (softmax rows sum to 1), where
    the default -ln n start is not."""
    from hf_attnorm.normalizers.base import Ctx

    torch.manual_seed(0)
    scores = torch.randn(1, 3, 64, 64) * torch.tensor([1.0, 3.0, 6.0]).view(1, 3, 1, 1)
    keep = torch.ones(64, 64, dtype=torch.bool).tril()
    n = keep.sum(-1).float().view(1, 1, 64)
    lse = torch.logsumexp(scores.masked_fill(~keep, -math.inf), -1)
    d = lse - torch.log(n)
    unit = cal.unit_sigmoid_bias(scores.masked_fill(~keep, -math.inf), lse)
    stats = TeacherStats(d.mean((0, 2)), d.std((0, 2)), d.exp().mean((0, 2)).log(), (2 * d).exp().mean((0, 2)).log(),
                         unit.mean((0, 2)), (unit + torch.log(n)).mean((0, 2)), torch.zeros(3), torch.zeros(3),
                         lse.mean((0, 2)), lse.amin((0, 2)),
                         torch.sigmoid(-lse).mean((0, 2)), 64, 64)
    settings = _settings("sigmoid")
    norm = cal.NORMALIZERS.get("sigmoid")
    offset = cal.formulas(settings, stats)["normalizer sigmoid"].values["sigmoid_bias"]

    def row_sums(value: torch.Tensor) -> torch.Tensor:
        ctx = Ctx(settings=settings, heads={"sigmoid_bias": value}, head_dim=8, n=n, module_info={}, lk=64)
        return norm.reference(scores, keep, ctx).sum(-1).mean((0, 2))

    calibrated, default = row_sums(offset), row_sums(torch.zeros(3))
    assert ((calibrated - 1).abs() < (default - 1).abs()).all(), (calibrated, default)


# -------------------------------------------------------------------- on a tiny model: toward the teacher


@pytest.mark.parametrize("impl", SAMPLE)
def test_calibration_moves_the_swapped_outputs_toward_the_teacher_or_says_why_not(impl):
    model = _tiny(impl)
    held_out = _ids(7)
    before = _layer_error(model, held_out)
    report = cal.calibrate(model, _ids(0))
    after = _layer_error(model, held_out)
    # the teacher pass runs (and reads every token) exactly when the normalizer or scale declares a formula
    settings = resolve_settings(impl)
    declares = any(recipe.calibrate is not None for recipe in recipes_of(settings))
    assert report["notes"] and report["tokens"] == (2 * L if declares else 0) and bool(report["teacher"]) == declares
    if not report["calibrated"]:
        assert after == pytest.approx(before, rel=1e-6, abs=1e-9)
        assert all(note.startswith(("not calibrated", "nothing set")) for note in report["notes"].values()) or \
            report["not_set"], report
        assert "not calibrated" in cal.describe(report)
        return
    assert after < before, (impl, before, after, report["notes"])


def test_a_constant_value_is_reported_not_set():
    model = _tiny("sigmoid", sigmoid_bias_learnable=False)
    report = cal.calibrate(model, _ids(0))
    assert not report["calibrated"]
    assert "sigmoid_bias_learnable=false" in report["not_set"]["sigmoid_bias"]


def test_the_offset_search_keeps_per_head_the_candidate_nearest_the_teacher():
    """Stick-breaking's calibration tries c_h = mean LSE + delta per head (``OffsetSearch``); the one it keeps is,
    head by head, the candidate whose outputs (computed here through the public attention call) are nearest the
    teacher's softmax outputs on the searched rows."""
    from hf_attnorm.attention import attention
    from hf_attnorm.normalizers.stickbreaking import StickBreaking

    g = torch.Generator().manual_seed(4)
    H, Lq, D = 3, 40, 8
    q = torch.randn(1, H, Lq, D, generator=g) * torch.tensor([0.5, 2.0, 4.0]).view(1, H, 1, 1)
    k, v = torch.randn(1, H, Lq, D, generator=g), torch.randn(1, H, Lq, D, generator=g)
    k[:, :, 0] = q.mean(2) * 3  # a sink: the first key scores high for every query
    z = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~torch.ones(Lq, Lq, dtype=torch.bool).tril(),
                                                            -math.inf)
    lse = torch.logsumexp(z, -1)
    settings = _settings("stickbreaking")
    acc = cal._Accumulator(H, torch.device("cpu"))
    acc.add(lse, (z > -math.inf).sum(-1).float(), z)
    recipe = normalizer_recipe("stickbreaking")
    acc.add_offset_search(z, lse, v, StickBreaking(), settings, D, recipe.offset_search)
    chosen = recipe.calibrate(acc.stats(), settings).values["stickbreaking_offset"]

    rows = slice(None, None, recipe.offset_search.row_stride)
    teacher = torch.softmax(z, -1)[:, :, rows] @ v
    center = lse[:, :, rows].mean((0, 2))
    errors = []
    for delta in OFFSET_DELTAS:
        out, _ = attention(q, k, v, settings, heads={"stickbreaking_offset": center + delta}, causal=True)
        out = out[:, :, rows]
        errors.append((out - teacher).square().sum((0, 2, 3)))
    best = torch.tensor(OFFSET_DELTAS)[torch.stack(errors, 1).argmin(1)]
    torch.testing.assert_close(chosen, lse.mean((0, 2)) + best)
    assert len(set(best.tolist())) > 1 or best[0] != 0  # the search moved off the sink limit somewhere


# -------------------------------------------------------------------------------- the real SmolLM2-135M


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M, its tokenizer, 4 training blocks of 512 tokens and 2048 held-out tokens of Shakespeare."""
    from transformers import AutoTokenizer

    from hf_attnorm.lab import data as data_lib
    from hf_attnorm.lab.evaluation import spread_chunks
    from hf_attnorm.lab.training.setup import resolve_model_path

    path = resolve_model_path("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    train, val, column, _ = data_lib.load_text_datasets(train_file=None, validation_file=None)
    train_ds, val_ds = data_lib.build_lm_datasets(train, val, column, tokenizer, block_size=512, masked_lm=False)
    blocks = train_ds.with_format("torch")["input_ids"][:].long()
    stream = val_ds.with_format("torch")["input_ids"][:].long().reshape(-1)
    return path, blocks[torch.linspace(0, len(blocks) - 1, 4).round().long()], spread_chunks(stream, 512, 2048)


def _smollm2_perplexity(path, impl: str, options: dict, blocks: torch.Tensor | None,
                        held_out: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    from hf_attnorm.lab.evaluation import causal_lm_perplexity

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, attnorm=options,
                                                     dtype=torch.float32).eval()
    if blocks is not None:
        assert cal.calibrate(model, blocks)["calibrated"]
    return causal_lm_perplexity(model, input_ids=[held_out], max_length=512).perplexity


@pytest.mark.slow
def test_smollm2_ssmax_calibrated_is_within_10_percent_of_the_original(smollm2):
    """The plain form (s_h fitted to the teacher) is within 10% of the original model. Measured on these 2,048
    held-out tokens: original 38.01, swapped uncalibrated 780.1, calibrated 40.37 (+6.2%), bias variant 38.01; on
    4,096: 52.69, 1,192.6, 55.30 (+5.0%), 52.69 (docs/convert.md, "Calibrated start"). The bias variant's exactness
    is checked on a tiny model (``test_the_ssmax_bias_variant_at_s_0_b_1_is_softmax``), the swapped model's distance
    by the conversion tests; this real-model check runs the two evaluations the claim needs."""
    path, blocks, held_out = smollm2
    original = _smollm2_perplexity(path, "softmax", {}, None, held_out)
    plain = _smollm2_perplexity(path, "ssmax", {}, blocks, held_out)
    print(f"SmolLM2 @512: original {original:.3f}, ssmax calibrated {plain:.3f}")
    assert abs(plain / original - 1) < 0.10, (original, plain)


@pytest.mark.slow
def test_smollm2_stickbreaking_calibrated_offset_brings_the_swap_near_the_original(smollm2):
    """The searched per-head offset turns the swap from far off into near the original. Measured on these 2,048
    held-out tokens: original 38.01, swapped 4,905, calibrated 88.8 (2.34x); the sink limit alone (delta 0 on every
    head) 282."""
    path, blocks, held_out = smollm2
    original = _smollm2_perplexity(path, "softmax", {}, None, held_out)
    calibrated = _smollm2_perplexity(path, "stickbreaking", {"stickbreaking_offset_learnable": True}, blocks,
                                     held_out)
    print(f"SmolLM2 @512: original {original:.3f}, stickbreaking calibrated {calibrated:.3f}")
    assert calibrated < 3 * original, (original, calibrated)


@pytest.mark.slow
def test_smollm2_sigmoid_needs_a_bias_per_row_not_per_head(smollm2):
    """Why no per-head calibration brings sigmoid near the original. A row's mass sum_j sigmoid(z_ij + b) is 1 at
    b = c_i (its unit-mass bias) and about e^(b - c_i) when the weights are small, so one b per head (minus ln n)
    leaves every row whose c_i + ln n_i is off the head's value with too little or too much mass, in every layer.
    Measured here, on the same held-out tokens: sigmoid with each row's own c_i (an oracle applied in the attention
    call, not a per-head value) is within 10% of the original model; the calibrated per-head bias is above 100x;
    and even the best per-head value for these very rows (each head's mean of c_i + ln n_i over them) leaves a
    large share of rows with more than twice or less than half the mass. Measured: original 38.01, per row 37.56,
    calibrated per head 3.1e8; c_i + ln n_i spreads by 1.16 nats within the median head (2.80 the widest); 39.9% of
    the rows off by more than 2x under their head's mean (docs/convert.md, "sigmoid's start")."""
    from transformers import AutoModelForCausalLM

    from hf_attnorm.hf.forward import softmax_row_statistics
    from hf_attnorm.kernels.base import repeat_kv
    from hf_attnorm.lab.evaluation import causal_lm_perplexity

    path, blocks, held_out = smollm2
    original = _smollm2_perplexity(path, "softmax", {}, None, held_out)
    per_head = _smollm2_perplexity(path, "sigmoid", {"sigmoid_bias_learnable": True}, blocks, held_out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sigmoid",
                                                     attnorm={"sigmoid_bias_learnable": True},
                                                     dtype=torch.float32).eval()
    spread, log_mass = [], []  # per call: [H] std of c_i + ln n_i; [rows] ln(mass) under the rows' head mean

    def per_row(module, query, key, value, attention_mask, scaling, kwargs, student):
        lse, n, z = softmax_row_statistics(module, query, key, value, attention_mask, scaling, kwargs)
        unit = cal.unit_sigmoid_bias(z, lse)  # [B, H, Lq]
        rows = n >= 2  # (a row of one key has no unit-mass bias: sigmoid < 1)
        shifted = torch.where(rows, unit + torch.log(n), torch.nan)
        head = shifted.nanmean((0, 2))  # [H]: the best single value (in the mean) for these rows
        spread.append((shifted - head.view(1, -1, 1)).square().nanmean((0, 2)).sqrt())
        mass = torch.sigmoid(z + (head.view(1, -1, 1) - torch.log(n)).unsqueeze(-1)).nan_to_num(0.0).sum(-1)
        log_mass.append(mass.log()[rows])
        weights = torch.sigmoid(z + unit.unsqueeze(-1)).nan_to_num(0.0)
        values = repeat_kv(value, query.shape[1] // value.shape[1]).float()
        return (weights @ values).transpose(1, 2).to(query.dtype), None

    with torch.no_grad(), observing(model, per_row):
        oracle = causal_lm_perplexity(model, input_ids=[held_out], max_length=512).perplexity
    assert spread, "the per-row bias never ran"
    spread_h, log_mass = torch.cat(spread), torch.cat(log_mass)
    off = (log_mass.abs() > math.log(2)).float().mean().item()
    print(f"SmolLM2 @512: original {original:.3f}, sigmoid per-head calibrated {per_head:.4g}, per-row c_i "
          f"{oracle:.3f}; std of c_i + ln n_i within a head: median {spread_h.median():.2f}, max "
          f"{spread_h.max():.2f} nats; under each head's mean: {off:.1%} of rows with mass off by more than 2x, "
          f"median |ln mass| {log_mass.abs().median():.2f}")
    assert oracle < 1.1 * original and per_head > 100 * original, (original, per_head, oracle)
    assert off > 0.2, off


# ------------------------------------------------------------------------------------------- scripts/convert.py


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A micro Llama (q/k scaled up) with the GPT-2 tokenizer, as a folder (as tests/test_convert.py builds it)."""
    from hf_attnorm.lab import data as data_lib
    from hf_attnorm.lab.model_zoo import build_model

    folder = tmp_path_factory.mktemp("source")
    tokenizer = data_lib.load_tokenizer("gpt2")
    model = build_model("llama", "micro", attn_implementation="sdpa", seed=0, vocab_size=len(tokenizer),
                        max_positions=128)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(4.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _convert(source, out, impl: str, *extra: str) -> dict:
    return convert.run(["--model_name_or_path", str(source), "--attn_implementation", impl, "--output_dir", str(out),
                        "--block_size", "32", "--eval_lengths", "32", "--eval_tokens", "256", "--error_blocks", "2",
                        "--transfer_steps", "0", "--finetune_steps", "0", "--no_save_model",
                        "--calibration_blocks", "2", *extra])


def test_convert_records_the_calibration_and_the_calibrated_perplexity(source, tmp_path):
    s = _convert(source, tmp_path / "on", "sigmoid")
    assert s["settings"]["sigmoid_bias_learnable"] is True  # set for the calibration (one offset per head)
    c = s["calibration"]
    assert c["calibrated"] and len(c["values"]["sigmoid_bias"]) == 2 and c["tokens"] == 64
    assert c["perplexity"]["calibrated"]["32"] < c["perplexity"]["swapped"]["32"]
    assert statistics_mean(s["layer_errors"]["calibrated"]) < statistics_mean(s["layer_errors"]["swapped"])
    off = _convert(source, tmp_path / "off", "sigmoid", "--no-calibrate")
    assert not off["calibration"]["calibrated"] and "calibrated" not in off["perplexity"]
    assert off["perplexity"]["swapped"] == s["perplexity"]["swapped"]


def test_convert_reports_a_normalizer_without_a_formula(source, tmp_path, capsys):
    s = _convert(source, tmp_path / "o", "symax")
    assert not s["calibration"]["calibrated"] and "calibrated" not in s["perplexity"]
    assert s["calibration"]["notes"]["normalizer symax"].startswith("not calibrated: no exact start")
    assert "symax: not calibrated" in capsys.readouterr().err


def statistics_mean(values: list[float]) -> float:
    return sum(values) / len(values)
