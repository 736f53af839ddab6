"""The protocol for state kept on the KV cache across decoding (hf/cache_state.py): a new kind plugs in by
registering, with no edit of the attention function, and sees the calls of generation in order; every registered
kind is served by the pre-hook and forgotten by drop_states."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from conftest import tiny
from transformers import DynamicCache

from hf_attnorm.hf import cache_state, compat
from hf_attnorm.hf.families import attention_modules
from hf_attnorm.registry import NORMALIZERS, PRESETS


@dataclasses.dataclass
class _Count:
    """A toy state: how many keys the layer held after the call that wrote it, and for which key tensor."""

    keys: int
    tensor: object


class _CountingKind(cache_state.CacheStateKind):
    name = "counting-test"

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int, int | None]] = []  # (event, queries, keys, armed count)

    def serves(self, normalizer) -> bool:
        return normalizer.name == "symax"

    def arm(self, layer, module):
        st = layer.__dict__.get("_counting_test")
        keys, _ = compat.layer_tensors(layer)
        return (st, "") if st is not None and st.tensor is keys else (None, "no count for these keys")

    def drop(self, layer) -> None:
        layer.__dict__.pop("_counting_test", None)

    def step(self, module, pending, query, key, value, settings, causal):
        if pending is None:
            return None
        kind = self

        class Step:
            def begin(self, call, query, key):
                kind.events.append(("begin", query.shape[2], key.shape[2],
                                    None if pending.armed is None else pending.armed.keys))

            def after(self, call, path):
                layer = pending.layer()
                layer.__dict__["_counting_test"] = _Count(key.shape[2], compat.layer_tensors(layer)[0])

        return Step()


@pytest.fixture
def counting():
    kind = cache_state.register(_CountingKind())
    try:
        yield kind
    finally:
        del cache_state.KINDS[kind.name]


def test_a_registered_kind_follows_cached_generation(counting):
    model = tiny("llama", "causal_lm", "symax")  # built after the kind registered: its modules carry the pre-hook
    layers = model.config.num_hidden_layers
    assert all(cache_state.hooked(m) for _, m in attention_modules(model))
    ids = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, **compat.cache_kwargs(model, cache))
    # per layer: the prefill (6 queries, nothing armed), then each decode step sees the count the previous call left
    expected = [("begin", 6, 6, None)] * layers + [("begin", 1, 7, 6)] * layers + [("begin", 1, 8, 7)] * layers
    assert counting.events == expected
    cache_state.drop_states(cache)
    assert not any("_counting_test" in layer.__dict__ for layer in compat.cache_layers(cache))


def test_the_pre_hook_follows_the_normalizer(counting):
    """sync installs the pre-hook where some kind serves the module's normalizer and removes it elsewhere."""
    import hf_attnorm

    model = tiny("llama", "causal_lm", "symax")
    mods = [m for _, m in attention_modules(model)]
    assert all(cache_state.hooked(m) for m in mods)
    hf_attnorm.apply(model, "softmax")
    assert not any(cache_state.hooked(m) for m in mods)
    hf_attnorm.apply(model, "symax")
    assert all(cache_state.hooked(m) for m in mods)


def test_one_pre_hook_and_one_note_serve_the_cache_state_and_continuous_batching(counting, monkeypatch):
    """A module whose normalizer keeps state and that continuous batching runs carries one pre-hook, which leaves one
    note per call (``NOTE_ATTR``); the attention function takes it (nothing is left for the next call), and the
    continuous-batching mark keeps the hook through a switch to a normalizer that keeps none (the packed calls
    themselves: tests/test_continuous_batching.py)."""
    import hf_attnorm

    model = tiny("llama", "causal_lm", "symax")
    mods = [m for _, m in attention_modules(model)]
    cache_state.mark_packed(mods)
    cache_state.mark_packed(mods)  # (once per module, however often it is marked)
    assert all(list(m._forward_pre_hooks.values()).count(cache_state._pre_hook) == 1 for m in mods)
    assert all(len(m._forward_pre_hooks) == 1 for m in mods)
    seen = []
    real_take = cache_state.take_note

    def take(module):
        note = real_take(module)
        seen.append(note)
        return note

    from hf_attnorm.hf import forward

    monkeypatch.setattr(forward, "take_note", take)
    ids = torch.randint(1, 97, (1, 5), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **compat.cache_kwargs(model, cache), use_cache=True)
    monkeypatch.undo()
    assert len(seen) == len(mods) and all(n is not None and not n.packed for n in seen)
    assert all(set(n.pending) == {counting.name} for n in seen)
    assert all(getattr(m, cache_state.NOTE_ATTR) is None for m in mods)  # taken: nothing stale for the next call
    hf_attnorm.apply(model, "softmax")  # no kind serves softmax; the mark keeps the hook
    assert all(cache_state.hooked(m) for m in mods)
    with torch.no_grad():
        model(ids)
    assert all(getattr(m, cache_state.NOTE_ATTR, None) is None for m in mods)
    cache_state.detach(mods[0])
    assert not cache_state.hooked(mods[0]) and not getattr(mods[0], cache_state.PACKED_MARK, False)


def test_every_stateful_normalizer_is_served_by_a_registered_kind():
    """The normalizers whose cached decoding needs or keeps state are served (linear: recurrent, selective: column
    sums, fox: cumulative forget gates), and a kind's name is unique."""
    served = {name for name in NORMALIZERS if cache_state.kinds_serving(name)}
    assert {"linear", "selective", "fox"} <= served
    with pytest.raises(ValueError, match="unique name"):
        cache_state.register(cache_state.KINDS["selective"])


def test_forgetting_attention_continues_its_kept_gates(monkeypatch):
    """fox keeps its cumulative forget gates on the cache: each decode step computes the gates of its new key only
    (make_call gets the kept sum), the kept sum is bit for bit the sum over every cached value, and cached generation
    equals generation without a cache."""
    from hf_attnorm.attention import make_call
    from hf_attnorm.hf import forget_cache, forward

    model = tiny("llama", "causal_lm", implementation="fox",
                 attnorm={"fox_bias_init": 1.0, "fox_weight_init": 0.2}).double()
    prefixes = []
    real = forward.make_call

    def spy(*args, **kwargs):
        prefixes.append(kwargs.get("forget_prefix"))
        return real(*args, **kwargs)

    monkeypatch.setattr(forward, "make_call", spy)
    x = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    gen = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    layers = model.config.num_hidden_layers
    for m in (None, mask):
        prefixes.clear()
        with torch.no_grad():
            cached = model.generate(x, attention_mask=m, use_cache=True, **gen)
        kept = [p for p in prefixes if p is not None]
        assert len(kept) == layers * (gen["max_new_tokens"] - 1)  # every decode step continued a kept sum
        assert [p.shape[-1] for p in kept[::layers]] == [7, 8, 9]
        with torch.no_grad():
            whole = model.generate(x, attention_mask=m, use_cache=False, **gen)
        assert torch.equal(cached.sequences, whole.sequences)
        for a, b in zip(cached.scores, whole.scores):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    # (without a mask no value is zeroed as padding: the kept sum is the sum over the layer's cached values)
    with torch.no_grad():
        out = model.generate(x, use_cache=True, **gen)
        for i, layer in enumerate(out.past_key_values.layers):
            state = getattr(layer, forget_cache.STATE_ATTR)
            module = model.model.layers[i].self_attn
            q = torch.zeros(2, model.config.num_attention_heads, 1, layer.keys.shape[-1], dtype=torch.float64)
            call = make_call(q, layer.keys, layer.values, module.attnorm.settings, module.attnorm(q.device), None,
                             True, module_info=module.attnorm.module_info)
            assert state.c.shape[-1] == layer.keys.shape[2] and torch.equal(state.c, call.forget)


def test_cosine_keeps_its_normalised_keys(monkeypatch):
    """cosine keeps its l2-normalised keys on the cache: each decode step normalises its new key only and the SDPA
    path takes the kept ones (bit for bit the normalisation of every cached key); cached generation equals generation
    without a cache."""
    import torch.nn.functional as F

    from hf_attnorm.hf import key_cache
    from hf_attnorm.kernels import dispatch
    from hf_attnorm.normalizers.cosine import NORM_EPS

    model = tiny("llama", "causal_lm", implementation="cosine").double()
    kept = []
    real = dispatch.run_path

    def spy(call, name):
        if call.k_transformed is not None:
            assert torch.equal(call.k_transformed, F.normalize(call.k, dim=-1, eps=NORM_EPS))
        kept.append((call.q.shape[2], None if call.k_transformed is None else call.k_transformed.shape[2], name))
        return real(call, name)

    monkeypatch.setattr(dispatch, "run_path", spy)
    transformed = []  # how many keys each call normalised
    real_transform = key_cache._transform_keys

    def counting(call, keys):
        transformed.append(keys.shape[2])
        return real_transform(call, keys)

    monkeypatch.setattr(key_cache, "_transform_keys", counting)
    x = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0
    gen = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    layers = model.config.num_hidden_layers
    for m in (None, mask):
        kept.clear()
        transformed.clear()
        with torch.no_grad():
            cached = model.generate(x, attention_mask=m, use_cache=True, **gen)
        assert [lk for lq, lk, _ in kept if lq == 1] == [n for n in (8, 9, 10) for _ in range(layers)]
        assert transformed == [7] * layers + [1] * (layers * 3)  # the prefill's keys, then one new key a step
        assert {name for _, _, name in kept} == {"sdpa"}
        with torch.no_grad():
            whole = model.generate(x, attention_mask=m, use_cache=False, **gen)
        assert torch.equal(cached.sequences, whole.sequences)
        for a, b in zip(cached.scores, whole.scores):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    for layer in cached.past_key_values.layers:
        assert getattr(layer, key_cache.STATE_ATTR).length == layer.keys.shape[2]


@pytest.mark.parametrize("implementation", list(PRESETS))
def test_generation_under_inference_mode_equals_no_grad(implementation):
    """torch.inference_mode makes tensors without version counters: every implementation still generates (greedy,
    padded batch) exactly what it generates under no_grad, and a kind that serves it keeps its state on the cache
    there too (checked by the tensors' identity alone, ``cache_state.versions``)."""
    model = tiny("llama", "causal_lm", implementation=implementation)
    x = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(8))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0
    gen = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, output_scores=True,
               return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(x, **gen)
    with torch.inference_mode():
        got = model.generate(x, **gen)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        assert torch.equal(a, b)
    settings = model.model.layers[0].self_attn.attnorm.settings
    attrs = {kind.name: getattr(importlib.import_module(type(kind).__module__), "STATE_ATTR", None)
             for kind in cache_state.kinds_serving(settings.normalizer)}
    for name, attr in attrs.items():
        kept = [getattr(layer, attr, None) for layer in got.past_key_values.layers]
        assert attr is not None and all(s is not None for s in kept), (name, kept)
