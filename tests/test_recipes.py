"""The conversion recipes (lab/convert/recipes.py) against the registries: each names a registered normalizer
or scale, and every option or per-head value it sets is one that normalizer or scale declares."""

from __future__ import annotations

import pytest

from hf_attnorm.lab.convert import recipes
from hf_attnorm.registry import NORMALIZERS, SCALES
from hf_attnorm.settings import resolve_settings

ALL = [("normalizer", name) for name in recipes.NORMALIZER_RECIPES] + \
      [("scale", name) for name in recipes.SCALE_RECIPES]


def _owner(kind: str, name: str):
    return (NORMALIZERS if kind == "normalizer" else SCALES).get(name)


@pytest.mark.parametrize(("kind", "name"), ALL, ids=lambda x: str(x))
def test_a_recipe_sets_only_what_its_normalizer_or_scale_declares(kind, name):
    assert name in (NORMALIZERS if kind == "normalizer" else SCALES), f"a recipe for unregistered {kind} {name!r}"
    owner, recipe = _owner(kind, name), (recipes.NORMALIZER_RECIPES if kind == "normalizer" else
                                         recipes.SCALE_RECIPES)[name]
    for option in (*recipe.conversion_start, *recipe.calibration_options):
        assert option in owner.options, (name, option, owner.options)
    if recipe.offset_search is not None:
        assert recipe.offset_search.value in {spec.name for spec in owner.params}
        assert recipe.calibrate is not None  # (the search's errors are read by the formula only)
    cont = recipe.continuation
    if cont is not None:
        via = cont.via or name
        settings = resolve_settings(via, dict(cont.via_options))
        declared = {*NORMALIZERS.get(settings.normalizer).options, *SCALES.get(settings.scale).options}
        assert cont.option in declared, (name, cont.option)
    if recipe.transfer_learning_rate is not None:
        assert 0 < recipe.transfer_learning_rate < 1
    assert recipe.calibration_note.strip()


def test_a_name_without_a_recipe_gets_the_defaults_and_a_registered_one_is_found(monkeypatch):
    monkeypatch.delitem(recipes.NORMALIZER_RECIPES, "sink")
    assert recipes.normalizer_recipe("sink") == recipes.Recipe()
    assert recipes.normalizer_recipe("sink").calibration_note == recipes.NO_CALIBRATION
    mine = recipes.register_recipe("sink", recipes.Recipe(transfer_learning_rate=3e-3))
    assert recipes.normalizer_recipe("sink") is mine
    monkeypatch.delitem(recipes.SCALE_RECIPES, "ssmax")
    recipes.register_recipe("ssmax", recipes.Recipe(transfer_learning_rate=4e-3), kind="scale")
    assert recipes.scale_recipe("ssmax").transfer_learning_rate == 4e-3
    assert recipes.recipes_of(resolve_settings("ssmax")) == (recipes.normalizer_recipe("softmax"),
                                                             recipes.scale_recipe("ssmax"))


def test_register_recipe_refuses_what_is_not_a_recipe():
    with pytest.raises(TypeError, match=r"register_recipe\('x', \.\.\.\) takes a Recipe, got dict"):
        recipes.register_recipe("x", {"transfer_learning_rate": 1e-3})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kind is 'norm'; allowed: 'normalizer', 'scale'"):
        recipes.register_recipe("x", recipes.Recipe(), kind="norm")  # type: ignore[arg-type]
