"""The variants around a call and the call features a path declares (kernels/variants.py, kernels/dispatch.py):
the dispatcher and the paths receive plain calls only, a differential call's halves take one path, a feature no
path declares is refused by every path (the reference included) instead of being ignored."""

from __future__ import annotations

import pytest
import torch

from hf_attnorm.attention import constant_heads, make_call
from hf_attnorm.kernels import PATHS, attend, choose, dispatch, explain, register_path, variants
from hf_attnorm.kernels.reference import reference_attention
from hf_attnorm.registry import NORMALIZERS, AttnormError
from hf_attnorm.settings import resolve_settings

MODULE_INFO = {"max_positions": 16}  # (a length-aware scale is active at these lengths)


def _call(name: str, lq: int = 7, dropout: float = 0.0, need_weights: bool = False, **opts):
    torch.manual_seed(0)
    settings = resolve_settings(name, opts)
    q, kv = torch.randn(2, 4, lq, 8), torch.randn(2, 2, 9, 8)
    heads = constant_heads(settings, 4, head_dim=8, kv_heads=2)
    return make_call(q, kv, kv, settings, heads, None, True, None, dropout, need_weights, MODULE_INFO)


@pytest.mark.parametrize("name", list(NORMALIZERS))
@pytest.mark.parametrize("need_weights", [False, True], ids=["out", "weights"])
def test_paths_receive_plain_calls(name, need_weights, monkeypatch):
    """A call reaches the path as it is (what is around it is attend's: no path reads ``around``, which
    tests/test_layout.py checks), a differential call as its two halves, on one path, with nothing around them."""
    received = []
    real = dispatch.run_path

    def spy(call, path):
        received.append((call, path))
        return real(call, path)

    monkeypatch.setattr(dispatch, "run_path", spy)
    call = _call(name, need_weights=need_weights)
    out, w, ran = attend(call)
    assert out.shape == (2, 4, 7, 8) and (w is not None) == need_weights
    assert {p for _, p in received} == {ran}
    if variants.is_differential(call):
        assert len(received) == 2 and all(c.around is None for c, _ in received)
        assert all(c.base == pytest.approx(call.base * 2 ** 0.5) for c, _ in received)
    else:
        assert len(received) == 1 and received[0][0] is call


@pytest.mark.parametrize("name", [n for n in NORMALIZERS if NORMALIZERS.get(n).differential])
def test_a_differential_call_is_decided_on_its_first_half(name):
    call = _call(name)
    first, _ = variants.halves(call)
    assert choose(call) == dispatch.choose(first)
    assert explain(call) == dispatch.explain(first)
    # with attention dropout the combined weights are dropped: only the reference forms them
    dropped = _call(name, dropout=0.2)
    assert choose(dropped) == "reference" and explain(dropped)[-1] == ("reference", "runs")
    with pytest.raises(ValueError, match="combined weights"):
        attend(dropped, "chunked")


def test_a_feature_no_path_declares_is_refused_by_every_path(monkeypatch):
    """A call feature added to the table is declined by every path registered without it, with its name, and a
    call carrying it is refused (the reference too), never computed without it."""
    monkeypatch.setitem(dispatch.FEATURES, "novel", ("a novel score modifier",
                                                     lambda call: bool(call.module_info.get("novel"))))
    settings = resolve_settings("softmax", {})
    q = torch.randn(1, 2, 5, 8)
    call = make_call(q, q, q, settings, {}, None, True, None, 0.0, False, {"novel": True})
    plain = make_call(q, q, q, settings, {}, None, True, None, 0.0, False, {})
    for name, path in PATHS.items():
        why = path.accepts(call)
        assert why is not None and "'novel'" in why, (name, why)
    with pytest.raises(AttnormError, match="no attention path can run this call.*novel"):
        attend(call)
    with pytest.raises(ValueError, match="cannot run this call.*novel"):
        attend(call, "reference")
    assert attend(plain)[2] == "sdpa"
    # a path declaring it is offered the call (registered on copies of the tables, restored afterwards)
    monkeypatch.setattr(dispatch, "PATHS", dict(dispatch.PATHS))
    monkeypatch.setattr(dispatch, "_ORDER", list(dispatch._ORDER))
    monkeypatch.setattr(dispatch, "_AUTO", {})
    register_path("novel_path", reference_attention, takes=lambda norm: None, accepts=lambda call: None,
                  priority=1, supports=("novel",))
    assert dispatch.choose(call) == "novel_path"
    assert dispatch.PATHS["sdpa"].accepts(call) is not None


def test_unknown_features_are_refused_at_registration():
    with pytest.raises(ValueError, match=r"unknown call features \['soft_cap'\]; known: .*'softcap'"):
        register_path("typo", reference_attention, takes=lambda norm: None, accepts=lambda call: None,
                      priority=1, supports=("soft_cap",))
    assert "typo" not in PATHS


def test_declared_features_are_the_ones_the_paths_apply():
    """The declarations, as the package docstring's table states them."""
    declared = {name: set(path.supports) for name, path in PATHS.items()}
    assert declared["reference"] == set(dispatch.FEATURES)
    scores = {"softcap", "bias", "alibi", "sinks"}
    assert declared["chunked"] == scores | {"forget", "dropout"}
    assert declared["decode"] == scores | {"forget", "selective_carry"}
    assert declared["sdpa"] == {"bias", "sinks", "forget", "dropout"}
    for name in ("fused_cpu", "triton"):
        assert declared[name] == {"softcap", "bias", "alibi"}
    forget = {name for name, d in declared.items() if "forget" in d}
    assert forget == {"reference", "chunked", "decode", "sdpa", "triton_forget"}
    assert all(PATHS[name].forget == (name in forget) for name in PATHS)
