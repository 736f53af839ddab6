"""The fused maps' per-row values declared as row forms (normalizers/base.py ``RowForm``): the C++ decode op of a
cached step evaluates the form itself, and must give the value ``Normalizer.row_value`` gives for the same call;
a normalizer that overrides ``row_value`` instead, and a state whose call is hooked, keep their Python route."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny

from hf_attnorm.hf.forward import hf_attention_forward, plans_of, record_paths, unplanned
from hf_attnorm.hf.state import AttnormState
from hf_attnorm.kernels.base import one_query_ctx
from hf_attnorm.normalizers.base import HEAD_MAP_IDS, N_TERM_IDS, Normalizer, RowForm
from hf_attnorm.registry import NORMALIZERS, PRESETS
from hf_attnorm.settings import resolve_settings

#: settings beyond the presets' whose row form differs (a constant sigmoid bias drops the -ln n term)
VARIANTS = {"sigmoid": [{"sigmoid_bias": -0.7}]}


def _ops():
    from hf_attnorm.kernels.fused import cpu

    if cpu.unavailable_reason() is not None:
        pytest.skip(f"the fused C++ kernels are unavailable: {cpu.unavailable_reason()}")
    return cpu.NATIVE.ops


def _declared() -> list[tuple[str, dict]]:
    """(implementation, option overrides) of every preset whose normalizer declares a row form, and VARIANTS."""
    cases = []
    for name, preset in PRESETS.items():
        norm = NORMALIZERS.get(preset.settings["normalizer"])
        if norm.kernel_family == "fused" and type(norm).row_value is Normalizer.row_value:
            cases.append((name, {}))
            cases += [(name, extra) for extra in VARIANTS.get(norm.name, [])]
    return cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("implementation,extra", _declared(), ids=lambda x: str(x) if x else "")
def test_the_decode_op_evaluates_the_row_form_as_row_value_does(implementation, extra, dtype):
    """Bitwise: per-head values drawn around and below their floors, n of 1 (a single-key row), 2, 7 and 300."""
    ops = _ops()
    settings = resolve_settings(implementation, extra)
    norm = NORMALIZERS.get(settings.normalizer)
    form = norm.row_form(settings) or RowForm(n_term="n")
    B, H = 2, 4
    g = torch.Generator().manual_seed(0)
    heads = {spec.name: torch.rand(H, generator=g) * 4 - 1.5 for spec in norm.params}
    q = torch.randn(B, H, 1, 8, generator=g, dtype=dtype)
    for n in (1, 2, 7, 300):
        ctx = one_query_ctx(settings, heads, q, n, {})
        want = norm.row_value(ctx, dtype)
        want = ctx.n.to(dtype) if want is None else want
        got = ops.decode_row_values(q, None if form.head is None else heads[form.head], HEAD_MAP_IDS[form.head_map],
                                    form.floor, N_TERM_IDS[form.n_term], form.negate_single_key, n)
        assert got.dtype == dtype and got.shape == (B, H, 1)
        assert torch.equal(got, want.expand(B, H, 1)), (implementation, n)


def test_a_row_form_names_what_is_wrong():
    with pytest.raises(ValueError, match="head_map must be one of"):
        RowForm(head="x", head_map="square")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a per-head value"):
        RowForm()


def _decode_steps(model, implementation, lengths=(12, 15)):
    """One layer's planned decode steps at ``lengths`` keys, and the same calls decided in full."""
    module = model.model.layers[0].self_attn
    cfg = model.config
    h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(1)
    calls = [(torch.randn(1, h, 1, d, generator=g), *(torch.randn(1, hkv, n, d, generator=g) for _ in range(2)))
             for n in lengths]
    run = [lambda c=c: hf_attention_forward(module, *c, None, d ** -0.5, implementation=implementation)[0]
           for c in calls]
    with torch.no_grad():
        with unplanned():
            want = [f() for f in run]
        with record_paths() as rec:
            got = [f() for f in run] + [f() for f in run]
    return module, want, got, rec


def test_a_normalizer_overriding_row_value_keeps_it_on_the_direct_entry(monkeypatch):
    """The direct entry resolves an overridden ``row_value`` in Python (the op's row form would be the base's)."""
    _ops()
    symax = type(NORMALIZERS.get("symax"))

    def doubled(self, ctx, dtype=torch.float32):
        return ctx.heads["symax_eta"].to(dtype).abs().view(1, -1, 1) * 2 + 0.25

    monkeypatch.setattr(symax, "row_value", doubled)
    model = tiny("llama", "causal_lm", implementation="symax")
    module, want, got, rec = _decode_steps(model, "symax")
    (plan,) = plans_of(module).values()
    assert plan.direct is not None and set(rec.paths) == {"fused_cpu"}
    for i, w in enumerate(want * 2):
        assert torch.equal(got[i], w)
    monkeypatch.undo()  # the declared form gives another output: the override was used
    assert not torch.equal(_decode_steps(tiny("llama", "causal_lm", implementation="symax"), "symax")[2][0],
                           want[0])


def test_a_state_of_constants_is_read_once_and_a_hooked_one_each_call(monkeypatch):
    """A plan keeps the per-head constants of a plain state (no parameter, no hook) and calls it no more; a state
    with a forward hook is called for every call, so the hook sees each. The outputs are the full rule's."""
    calls = []
    forward = AttnormState.forward

    def counted(self, device):
        calls.append(1)
        return forward(self, device)

    monkeypatch.setattr(AttnormState, "forward", counted)
    for hook in (False, True):
        model = tiny("llama", "causal_lm", implementation="symax")  # (eta is a constant by default)
        seen = []
        if hook:
            model.model.layers[0].self_attn.attnorm.register_forward_hook(lambda *a, seen=seen: seen.append(1))
        module, want, got, rec = _decode_steps(model, "symax")
        (plan,) = plans_of(module).values()
        assert plan.direct is not None and rec.paths == ["fused_cpu"] * 4
        assert all(torch.equal(g, w) for g, w in zip(got, want * 2))
        calls.clear()
        seen.clear()
        shape = (module.config.num_attention_heads, module.config.num_key_value_heads,
                 module.config.hidden_size // module.config.num_attention_heads)
        q, k, v = torch.randn(1, shape[0], 1, shape[2]), *(torch.randn(1, shape[1], 9, shape[2]) for _ in range(2))
        with torch.no_grad():
            for _ in range(3):
                hf_attention_forward(module, q, k, v, None, shape[2] ** -0.5, implementation="symax")
        if hook:
            assert plan.constants is None and len(calls) == 3 and len(seen) == 3
        else:
            assert plan.constants is not None and set(plan.constants) == {"symax_eta"} and not calls
