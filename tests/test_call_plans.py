"""Call plans (hf/forward.py): decided once per module and plan key, reused while nothing they depend on changes,
and the same outputs and paths as deciding every call in full."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny

import hf_attnorm
from hf_attnorm.attention import make_call
from hf_attnorm.hf import forward
from hf_attnorm.hf.forward import hf_attention_forward, plans_of, record_paths, unplanned
from hf_attnorm.kernels import explain, set_forced_path
from hf_attnorm.kernels.base import ONE_QUERY_KEYS
from hf_attnorm.registry import NORMALIZERS, PRESETS

GEN = dict(max_new_tokens=3, do_sample=False, output_scores=True, return_dict_in_generate=True)


def _generate(model, x, mask):
    with torch.no_grad(), record_paths() as rec:
        out = model.generate(x, attention_mask=mask, **GEN)
    return out, rec.paths


def _padded():
    x = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0  # left padding: decode steps carry a mask tensor
    return x, mask


@pytest.mark.parametrize("implementation", list(PRESETS))
@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "padded"])
def test_planned_generation_equals_the_full_rule(implementation, padded):
    """Cached generation with plans gives exactly the scores and the paths of the same generation with every call
    decided in full, and the decode steps were served from a plan."""
    model = tiny("llama", "causal_lm", implementation=implementation).double()
    x, mask = _padded()
    mask = mask if padded else None
    with unplanned():
        want, want_paths = _generate(model, x, mask)
    modules = [layer.self_attn for layer in model.model.layers]
    assert not any(plans_of(m) for m in modules)  # (nothing planned inside the block)
    got, got_paths = _generate(model, x, mask)
    assert got_paths == want_paths
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        assert torch.equal(a, b)
    uses = [p.uses for m in modules for p in plans_of(m).values()]
    assert uses and sum(uses) >= len(modules) * (GEN["max_new_tokens"] - 2)  # the later steps reused a plan


def _call_args(model, dtype=torch.float32, lq=1, lk=12, mask=None):
    module = model.model.layers[0].self_attn
    cfg = model.config
    h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, h, lq, d, generator=g, dtype=dtype)
    k, v = (torch.randn(1, hkv, lk, d, generator=g, dtype=dtype) for _ in range(2))
    return module, q, k, v, mask


def _run(module, q, k, v, mask, implementation):
    with record_paths() as rec:
        out, _ = hf_attention_forward(module, q, k, v, mask, q.shape[-1] ** -0.5, implementation=implementation)
    return out, rec


@pytest.mark.parametrize("implementation", ["softmax", "symax", "ssmax", "fox"])
def test_a_plan_is_reused_and_remade_when_what_it_depends_on_changes(implementation):
    model = tiny("llama", "causal_lm", implementation=implementation)
    module, q, k, v, _ = _call_args(model)
    with torch.no_grad():
        first, rec = _run(module, q, k, v, None, implementation)
        (plan,) = plans_of(module).values()
        for lk in (13, 14):  # a decode step: one more key each time
            _run(module, *_call_args(model, lk=lk)[1:], implementation)
        assert list(plans_of(module).values()) == [plan] and plan.uses == 2
        # the path it records is the one the full rule explains
        call = make_call(q, k, v, module.attnorm.settings, module.attnorm(q.device), None, True,
                         q.shape[-1] ** -0.5, module_info=module.attnorm.module_info)
        assert rec.path == explain(call)[-1][0] and rec.mask == call.mask.kind

        # a new kind of mask: another plan
        keep = torch.ones(1, 1, 1, 12, dtype=torch.bool)
        _run(module, q, k, v, keep, implementation)
        assert len(plans_of(module)) == 2 and plan.uses == 2

        # a dtype move: another plan, the first kept
        model.double()
        _run(module, *_call_args(model, dtype=torch.float64)[1:], implementation)
        assert len(plans_of(module)) == 3 and plan.uses == 2
        model.float()
        _run(module, q, k, v, None, implementation)
        assert plan.uses == 3

        # train/eval: another plan
        model.train()
        _run(module, q, k, v, None, implementation)
        model.eval()
        assert len(plans_of(module)) == 4 and plan.uses == 3

        # a forced path makes the rule another one: the plans made before are not used
        set_forced_path("reference")
        try:
            forced, rec = _run(module, q, k, v, None, implementation)
        finally:
            set_forced_path()
        assert rec.path == "reference" and plan.uses == 3
        torch.testing.assert_close(forced, first, atol=1e-5, rtol=1e-5)
        _run(module, q, k, v, None, implementation)
        assert plan.uses == 3  # (stale: made under another version of the rule)

    # autograd on: decided in full, no plan made or used
    count = len(plans_of(module))
    _run(module, q, k, v, None, implementation)
    assert len(plans_of(module)) == count

    # settings edited: a new state, so new plans; the old ones are dropped with it
    old_state = module.attnorm
    scale = "log_n" if old_state.settings.scale == "standard" else "standard"
    hf_attnorm.apply(model, implementation, scale=scale)
    assert module.attnorm is not old_state
    with torch.no_grad():
        edited, _ = _run(module, q, k, v, None, implementation)
    (new_plan,) = plans_of(module).values()
    assert new_plan.state is module.attnorm and new_plan.settings.scale == scale
    with unplanned(), torch.no_grad():
        want, _ = _run(module, q, k, v, None, implementation)
    assert torch.equal(edited, want) and not torch.equal(edited, first)


#: implementations whose plain decode step (no mask tensor) must have a direct entry on the CPU, with its path:
#: softmax and the length-aware scales (their factor from the per-head values and n = Lk) on SDPA; the fused maps,
#: learned per-head values included (power's exponent), on their C++ kernel (skipped where it cannot be built); a
#: sink logit (learned per head for sink) through the lse rewrite; gated attention's output gate after SDPA
DIRECT = {"softmax": "sdpa", "ssmax": "sdpa", "log_n": "sdpa", "yarn": "sdpa", "llama4_pos": "sdpa",
          "max_gradient": "sdpa", "sink": "sdpa", "softmax_n": "sdpa", "softmax1": "sdpa", "gated": "sdpa",
          **{name: "fused_cpu" for name in ("symax", "sigmoid", "squared", "stablemax", "softpick", "softplus",
                                            "relu_len", "power", "lssa", "sparsemax", "entmax15", "entmax_alpha")}}


@pytest.mark.parametrize("lengths", [(12, 15), (ONE_QUERY_KEYS + 1, ONE_QUERY_KEYS + 4)],
                         ids=["short", "one_query_form"])
@pytest.mark.parametrize("implementation", list(PRESETS))
def test_a_planned_plain_decode_step_runs_its_direct_entry_exactly(implementation, lengths, monkeypatch):
    """A planned plain decode step with a direct entry runs it, with no AttnCall built, and gives exactly what the
    full rule's call gives, at two key counts (the row value and the per-query factor follow n), short and long
    enough for the one-query softmax of the sdpa path (kernels/base.py); the implementations of ``DIRECT`` have
    one."""
    if DIRECT.get(implementation) == "fused_cpu":
        from hf_attnorm.kernels.fused import cpu

        if cpu.unavailable_reason() is not None:
            pytest.skip(f"the fused C++ kernels are unavailable: {cpu.unavailable_reason()}")
    if NORMALIZERS.get(PRESETS.get(implementation).settings["normalizer"]).query_coupled:
        pytest.skip("a query-coupled normalizer's decode step needs the earlier queries' state on a cache")
    model = tiny("llama", "causal_lm", implementation=implementation)
    with torch.no_grad():  # per-head values away from their (often equal) initial values, so head indexing counts
        for p in model.parameters():
            p.add_(torch.rand_like(p) * 0.1)
    module, q, k, v, _ = _call_args(model, lk=lengths[0])
    later = _call_args(model, lk=lengths[1])[1:]
    with torch.no_grad():
        with unplanned():
            want, _ = _run(module, q, k, v, None, implementation)
            want_later, _ = _run(module, *later, implementation)
        planned, _ = _run(module, q, k, v, None, implementation)
        (plan,) = plans_of(module).values()
        if implementation in DIRECT:
            assert plan.direct is not None and plan.path == DIRECT[implementation]
        if plan.direct is None:
            return

        def no_call(*args, **kwargs):
            raise AssertionError("a planned plain call built an AttnCall")

        monkeypatch.setattr(forward, "make_call", no_call)
        got, rec = _run(module, q, k, v, None, implementation)
        got_later, _ = _run(module, *later, implementation)
    assert torch.equal(planned, want) and torch.equal(got, want) and torch.equal(got_later, want_later)
    assert rec.path == plan.path and rec.mask == "none" and plan.uses == 2


def test_a_copied_model_carries_no_plans():
    import copy
    import pickle

    model = tiny("llama", "causal_lm", implementation="symax")
    module, q, k, v, _ = _call_args(model)
    with torch.no_grad():
        _run(module, q, k, v, None, "symax")
    assert plans_of(module)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert not plans_of(twin.model.layers[0].self_attn)
