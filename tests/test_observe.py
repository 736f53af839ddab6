"""Observing attention calls from the lab (hf_attnorm/lab/observe.py): the core has no observer; while a module is
observed its implementation's registered function is a wrapper, afterwards the core's function again."""

from __future__ import annotations

import torch
from conftest import tiny
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_attnorm.hf.families import attention_modules
from hf_attnorm.hf.forward import forward_for
from hf_attnorm.hf.integration import apply
from hf_attnorm.lab.observe import observe_model, observed_names, observing


def _ids() -> torch.Tensor:
    return torch.tensor([[3, 17, 5, 9, 30, 2, 11]])


def test_an_observer_sees_every_call_and_nothing_is_left_behind() -> None:
    model = tiny("llama", "causal_lm", "symax").eval()
    layers = len(list(attention_modules(model)))
    assert not hasattr(next(m for _, m in attention_modules(model)).attnorm, "observer")  # the core has none
    with torch.no_grad():
        before = model(_ids()).logits
    seen: list[tuple[int, tuple[int, ...]]] = []

    def count(module, query, key, value, mask, scaling, kwargs, student):
        seen.append((module.layer_idx, tuple(query.shape)))
        return student()

    with torch.no_grad(), observing(model, count) as n:
        assert n == layers and observed_names() == ["symax"]
        assert ALL_ATTENTION_FUNCTIONS["symax"] is not forward_for("symax")
        during = model(_ids()).logits
    assert [layer for layer, _ in seen] == list(range(layers)) and seen[0][1][2] == _ids().shape[1]
    torch.testing.assert_close(during, before, rtol=0, atol=0)  # student() is the call itself
    # nothing observed: the core's own function is registered again
    assert observed_names() == [] and ALL_ATTENTION_FUNCTIONS["symax"] is forward_for("symax")


def test_an_unobserved_model_of_the_same_implementation_passes_through() -> None:
    watched, other = tiny("llama", "causal_lm", "symax").eval(), tiny("llama", "causal_lm", "symax").eval()
    calls: list[torch.nn.Module] = []

    def replace(module, query, key, value, mask, scaling, kwargs, student):
        calls.append(module)
        out, w = student()
        return torch.zeros_like(out), w

    with torch.no_grad():
        expected = other(_ids()).logits
        with observing(watched, replace):
            got = other(_ids()).logits
            changed = watched(_ids()).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    owned = {id(m) for _, m in attention_modules(watched)}
    assert calls and all(id(m) in owned for m in calls)
    assert not torch.equal(changed, expected)  # the observer's result is what the layer got


def test_a_new_implementation_under_observation_is_observed_too() -> None:
    """A conversion's continuation switches the model's implementation while it is observed and observes again."""
    model = tiny("llama", "causal_lm", "symax").eval()
    names: list[str] = []

    def note(module, query, key, value, mask, scaling, kwargs, student):
        names.append(module.attnorm.settings.implementation)
        return student()

    with torch.no_grad():
        assert observe_model(model, note) > 0
        model(_ids())
        apply(model, "ssmax")
        observe_model(model, note)
        assert observed_names() == ["ssmax", "symax"]
        model(_ids())
        observe_model(model, None)
    assert set(names) == {"symax", "ssmax"} and observed_names() == []
    assert ALL_ATTENTION_FUNCTIONS["ssmax"] is forward_for("ssmax")
