"""Settings validation, registry listings and bad input: every error names what was wrong and what is allowed."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny

import hf_attnorm
from hf_attnorm.attention import attention
from hf_attnorm.masks import MaskError
from hf_attnorm.registry import NORMALIZERS, PRESETS, SCALES, AttnormError, UnknownNameError
from hf_attnorm.settings import OPTIONS, AttnormSettings, resolve_settings


def test_available_lists_every_name_with_a_description():
    impls = hf_attnorm.available()
    assert set(impls) == set(PRESETS)
    assert set(NORMALIZERS) <= set(impls)  # every normalizer is an attn_implementation
    assert {"softmax1", "ssmax", "sparse_target", "max_gradient"} <= set(impls)
    assert all(isinstance(d, str) and d for d in impls.values())
    assert set(hf_attnorm.available("normalizers")) == set(NORMALIZERS)
    assert set(hf_attnorm.available("scales")) == set(SCALES)
    assert all(o.help for o in OPTIONS._items.values())  # help text on every option
    with pytest.raises(ValueError, match="implementations, normalizers, scales or options"):
        hf_attnorm.available("colours")


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_round_trips_through_a_dict(name):
    s = resolve_settings(name)
    assert AttnormSettings.from_dict(s.to_dict()) == s
    assert s.normalizer in NORMALIZERS and s.scale in SCALES


def test_unknown_names_list_the_registered_ones():
    with pytest.raises(UnknownNameError, match="unknown attention implementation 'softermax'.*symax"):
        resolve_settings("softermax")
    with pytest.raises(UnknownNameError, match="unknown normalizer 'nope'.*stablemax"):
        resolve_settings("softmax", {"normalizer": "nope"})
    with pytest.raises(UnknownNameError, match="unknown scale 'huge'.*ssmax"):
        resolve_settings("softmax", {"scale": "huge"})
    model = tiny("llama", "causal_lm", implementation="sdpa")
    with pytest.raises(ValueError, match="softermax"):
        model.set_attn_implementation("softermax")


@pytest.mark.parametrize(
    "impl,opts,pattern",
    [
        ("symax", {"eta": -0.1}, "'eta'.*>= 0"),
        ("symax", {"eta": "big"}, "'eta'.*must be a number"),
        ("symax", {"eta_learnable": "yes"}, "'eta_learnable'.*true or false"),
        ("softmax_n", {"n_extra": -1}, "'n_extra'.*>= 0"),
        ("sparse_target", {"sparse_eps": 1.0}, "'sparse_eps'.*strictly between 0 and 1"),
        ("sparse_target", {"sparse_eps": 0.0}, "'sparse_eps'.*strictly between 0 and 1"),
        ("sparse_target", {"sparse_m_rule": "cube"}, "'sparse_m_rule'.*one of"),
        ("sparse_target", {"sparse_m_rule": "fraction", "sparse_m": 1.5}, "'sparse_m'.*< 1"),
        ("max_gradient", {"max_gradient_dist": "cauchy"}, "'max_gradient_dist'.*one of"),
        ("max_gradient", {"head_dim": 64}, "'head_dim' is only used with max_gradient_dist='cosine'"),
        ("qwen_logn", {"train_length": 1}, "'train_length'.*>= 2"),
        ("cosine", {"cosine_temperature": 0}, "'cosine_temperature'.*> 0"),
        ("softmax", {"eta": 1.0}, r"\['eta'\] are not used by normalizer 'softmax'.*belong to other"),
        ("softmax", {"colour": 1}, r"\['colour'\] are not used"),
    ],
)
def test_out_of_range_options_name_the_field(impl, opts, pattern):
    with pytest.raises(AttnormError, match=pattern):
        resolve_settings(impl, opts)


def test_sparse_target_k_needs_m_below_n():
    from hf_attnorm.scales import sparse_target_k

    with pytest.raises(ValueError, match="m must be < n"):
        sparse_target_k(10, 10, 0.1)
    with pytest.raises(ValueError, match="eps must lie strictly between 0 and 1"):
        sparse_target_k(10, 2, 1.5)


def test_bad_masks_are_type_errors():
    q = torch.randn(2, 2, 5, 4)
    k = torch.randn(2, 2, 7, 4)
    with pytest.raises(MaskError, match="does not fit"):
        attention(q, k, k, "symax", attention_mask=torch.ones(2, 1, 5, 6, dtype=torch.bool))
    with pytest.raises(MaskError, match="type list"):
        attention(q, k, k, "symax", attention_mask=[[1, 0]])
    # a float mask holding other values than 0 / -inf is a score bias (tests/test_score_mods.py), not an error
    with pytest.raises(MaskError, match="only 0"):
        attention(q, k, k, "symax", attention_mask=torch.full((2, 7), 3))
    with pytest.raises(MaskError, match="2-D padding mask"):
        attention(q, k, k, "symax", attention_mask=torch.ones(2, 5, dtype=torch.bool))
    assert issubclass(MaskError, TypeError)


def test_equivalent_mask_formats_agree():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=g) for _ in range(3))
    keep = torch.rand(2, 1, 5, 5, generator=g) > 0.4
    additive = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    a, _ = attention(q, k, v, "symax", attention_mask=keep)
    b, _ = attention(q, k, v, "symax", attention_mask=additive)
    c, _ = attention(q, k, v, "symax", attention_mask=keep.long())
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c)
    pad = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    d, _ = attention(q, k, v, "squared", attention_mask=pad, causal=True)
    full = pad[:, None, None, :] & torch.ones(5, 5, dtype=torch.bool).tril()
    e, _ = attention(q, k, v, "squared", attention_mask=full)
    torch.testing.assert_close(d, e)


def test_unknown_path_and_forced_path_errors(monkeypatch):
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="unknown attention path 'warp'"):
        attention(q, q, q, "softmax", path="warp")
    from hf_attnorm.kernels import set_forced_path

    try:  # the variable is read at import and by set_forced_path(), not per call
        monkeypatch.setenv("HF_ATTNORM_PATH", "warp")
        with pytest.raises(ValueError, match="HF_ATTNORM_PATH"):
            set_forced_path()
        monkeypatch.setenv("HF_ATTNORM_PATH", "reference")
        set_forced_path()
        out, w = attention(q, q, q, "softmax", need_weights=True)
        assert w.shape == (1, 2, 3, 3)
    finally:
        monkeypatch.delenv("HF_ATTNORM_PATH")
        set_forced_path()


def test_from_pretrained_attnorm_overrides_and_config_built_models(tmp_path):
    from transformers import LlamaForCausalLM

    from hf_attnorm.lab.model_zoo import make_config

    config = make_config("llama", "micro")
    config._attn_implementation = "softmax"
    config.attnorm = {"scale": "ssmax", "ssmax_s": 0.5}
    model = LlamaForCausalLM(config)
    assert model.config.attnorm["scale"] == "ssmax" and model.config.attnorm["implementation"] == "softmax"
    assert any(n.endswith("attnorm.ssmax_s") for n, _ in model.named_parameters())
    config2 = make_config("llama", "micro")
    config2._attn_implementation = "symax"
    m2 = LlamaForCausalLM(config2)
    assert m2.model.layers[0].self_attn.attnorm.settings.normalizer == "symax"


def test_settings_options_are_read_only_and_copy_cleanly() -> None:
    import copy
    import pickle

    s = resolve_settings("symax", {"eta": 0.5})
    with pytest.raises(TypeError, match="read-only"):
        s.options["eta"] = 3.0  # type: ignore[index]
    with pytest.raises(TypeError, match="read-only"):
        s.options.update(eta=3.0)  # type: ignore[attr-defined]
    assert s.eta == 0.5 and s.replace(eta=0.25).eta == 0.25
    assert copy.deepcopy(s) == s and pickle.loads(pickle.dumps(s)) == s


def test_option_text_has_one_grammar():
    from hf_attnorm.settings import OptionError, parse_option_pairs

    assert parse_option_pairs(["ssmax_learnable=yes", "eta_learnable=OFF", "eta=0.25", "sigmoid_bias=null",
                               "sparse_m_rule=sqrt", "head_dim=64", "scale=ssmax"]) == {
        "ssmax_learnable": True, "eta_learnable": False, "eta": 0.25, "sigmoid_bias": None,
        "sparse_m_rule": "sqrt", "head_dim": 64, "scale": "ssmax"}
    for pairs, message in ((["ssmax_learnable=maybe"], "must be true or false"), (["head_dim=6.5"], "integer"),
                           (["eta=big"], "must be a number"),
                           (["eta=1", "eta=2"], "given twice"), (["eta"], "KEY=VALUE")):
        with pytest.raises(OptionError, match=message):
            parse_option_pairs(pairs)
    # a name no component declares stays text; resolve_settings refuses it naming what the normalizer uses
    assert parse_option_pairs(["nosuch=1"]) == {"nosuch": "1"}
    with pytest.raises(AttnormError, match=r"\['nosuch'\] are not used by normalizer 'symax'.*allowed"):
        resolve_settings("symax", parse_option_pairs(["nosuch=1"]))


def test_every_command_line_reads_options_alike():
    # training's --attnorm and evaluation's name:key=value variants used to disagree (ssmax_learnable=yes)
    from hf_attnorm.lab.evaluation import EvaluationError, parse_variant
    from hf_attnorm.lab.training import TrainingError, parse_attnorm_options

    assert parse_variant("ssmax:ssmax_learnable=yes,ssmax_s=2") == ("ssmax", {"ssmax_learnable": True,
                                                                              "ssmax_s": 2.0})
    assert parse_attnorm_options(["ssmax_learnable=yes", "ssmax_s=2"]) == {"ssmax_learnable": True, "ssmax_s": 2.0}
    with pytest.raises(EvaluationError, match="ssmax_learnable must be true or false"):
        parse_variant("ssmax:ssmax_learnable=maybe")
    with pytest.raises(TrainingError, match="ssmax_learnable must be true or false"):
        parse_attnorm_options(["ssmax_learnable=maybe"])
