"""``model.config.attnorm``: the settings a model runs with and the settings it saves are one thing.

The dict is read-only (an in-place edit raises, naming ``hf_attnorm.apply``); a whole new dict assigned to it is
refused at the next forward and before ``save_pretrained`` writes anything; ``hf_attnorm.apply`` is the way to change
settings, and what it sets is what reloads.
"""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch
from conftest import LAST_CALL, tiny

import hf_attnorm
from hf_attnorm.registry import PRESETS, AttnormError
from hf_attnorm.settings import ConfigSettings

IMPLS = list(PRESETS)


def _ids(n: int = 10) -> torch.Tensor:
    return torch.randint(1, 97, (2, n), generator=torch.Generator().manual_seed(0))


def _first_line(exc: pytest.ExceptionInfo) -> str:
    return str(exc.value).splitlines()[0]


@pytest.mark.parametrize("impl", IMPLS)
def test_in_place_edits_raise_naming_apply(impl):
    model = tiny("llama", "causal_lm", implementation=impl)
    cfg = model.config.attnorm
    assert isinstance(cfg, ConfigSettings)
    before = dict(cfg)
    key = next(k for k in cfg if k != "implementation") if len(cfg) > 1 else "implementation"
    edits = [
        lambda: cfg.__setitem__(key, "changed"),
        lambda: cfg.__setitem__("a_new_key", 1),
        lambda: cfg.update({key: "changed"}),
        lambda: cfg.pop(key),
        lambda: cfg.setdefault("a_new_key", 1),
        lambda: cfg.popitem(),
        lambda: cfg.clear(),
        lambda: cfg.__delitem__(key),
    ]
    for edit in edits:
        with pytest.raises(AttnormError) as exc:
            edit()
        assert "read-only" in _first_line(exc) and "hf_attnorm.apply" in _first_line(exc)
    assert dict(cfg) == before
    cfg[key] = before[key]  # a "change" to the same value changes nothing and passes (transformers does that)
    assert cfg.pop("not_a_key", None) is None


@pytest.mark.parametrize("impl", IMPLS)
def test_replaced_dict_is_refused_at_the_next_forward_and_before_saving(impl, tmp_path):
    model = tiny("llama", "causal_lm", implementation=impl)
    x = _ids()
    with torch.no_grad():
        model(x)
    running = dict(model.config.attnorm)
    model.config.attnorm = {**running, "not_an_option": 1}  # invalid: no normalizer or scale declares it
    with pytest.raises(AttnormError) as exc:
        model(x)
    assert "model.config.attnorm was replaced" in _first_line(exc)
    assert "not_an_option" in _first_line(exc) and "hf_attnorm.apply" in _first_line(exc)
    with pytest.raises(AttnormError, match="model.config.attnorm was replaced"):
        model.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists(), "save_pretrained wrote files before refusing"
    model.config.attnorm = dict(running)  # an equal plain dict changes nothing: accepted, read-only again
    with torch.no_grad():
        model(x)
    assert isinstance(model.config.attnorm, ConfigSettings)


def test_symax_eta_edit_cannot_diverge_from_what_is_saved(tmp_path):
    """The reproduction: eta 0.25 written into the dict was ignored by the forward but saved (reload differed by
    2.19); eta -3 ran and only save_pretrained refused it."""
    from transformers import AutoModelForCausalLM

    model = tiny("llama", "causal_lm", implementation="symax")
    x = _ids()
    with torch.no_grad():
        base = model(x).logits
    with pytest.raises(AttnormError, match="read-only.*hf_attnorm.apply"):
        model.config.attnorm["eta"] = 0.25
    with pytest.raises(AttnormError, match="read-only"):
        model.config.attnorm["eta"] = -3
    model.config.attnorm = {**model.config.attnorm, "eta": -3}
    with pytest.raises(AttnormError, match=r"replaced.*invalid.*'eta'.*>= 0"):
        model(x)
    hf_attnorm.apply(model, "symax", eta=0.25)  # the supported edit: validated, takes effect at once
    assert model.config.attnorm["eta"] == 0.25
    LAST_CALL.path = ""
    with torch.no_grad():
        edited = model(x).logits
    assert LAST_CALL.path, "the forward did not go through hf_attnorm"
    assert (edited - base).abs().max() > 1e-3, "eta=0.25 did not change the forward"
    with pytest.raises(AttnormError, match=r"option 'eta'.*>= 0"):
        hf_attnorm.apply(model, "symax", eta=-3)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["attnorm"]["eta"] == 0.25
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, edited, atol=0, rtol=0)
    assert isinstance(reloaded.config.attnorm, ConfigSettings)


def test_copies_and_serialisations_keep_working():
    """transformers copies and serialises configs (to_dict, to_json_string, deepcopy, pickle): they still work, and
    a deep copy of the model is read-only too."""
    model = tiny("llama", "causal_lm", implementation="symax")
    want = dict(model.config.attnorm)
    assert model.config.to_dict()["attnorm"] == want
    assert json.loads(model.config.to_json_string())["attnorm"] == want
    assert pickle.loads(pickle.dumps(model.config)).attnorm == want
    twin = copy.deepcopy(model)
    assert isinstance(twin.config.attnorm, ConfigSettings) and twin.config.attnorm == want
    with pytest.raises(AttnormError, match="read-only"):
        twin.config.attnorm["eta"] = 0.5
    plain = copy.deepcopy(dict(model.config.attnorm))  # a user's copy is theirs to edit
    plain["eta"] = 0.5
    assert model.config.attnorm["eta"] == want["eta"]
