"""The recurrent decode step of linear attention (kernels/linear/recurrent.py) and the state a transformers cache keeps
for it (hf/recurrent.py): every step against the reference, and generation with the state against generation on the
exact O(Lk) path (same tokens, logits within 1e-5) through padding, beam search, consecutive calls, a continued,
cropped or reordered cache and a static cache."""

from __future__ import annotations

import dataclasses
import pickle
import warnings

import pytest
import torch
import transformers
from conftest import LAST_CALL, needs_compile, needs_compile_inductor, tiny
from transformers import DynamicCache

from hf_attnorm.attention import constant_heads, make_call
from hf_attnorm.hf import compat
from hf_attnorm.hf.recurrent import STATE_ATTR, drop_states
from hf_attnorm.kernels import PATHS, attend, explain, set_forced_path
from hf_attnorm.kernels.linear.recurrent import build_state, takes
from hf_attnorm.registry import NORMALIZERS
from hf_attnorm.settings import resolve_settings

#: every normalizer the recurrent step takes (linear, hedgehog, ...)
RECURRENT = [name for name in NORMALIZERS if takes(NORMALIZERS.get(name)) is None]
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _tensors(B, H, Hkv, L, D, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    # keys growing in size: the running maximum of phi(k) changes during decoding (the state is rescaled)
    k = torch.randn(B, Hkv, L, D, generator=g, dtype=torch.float64) * torch.linspace(0.5, 6, L)[:, None]
    v = torch.randn(B, Hkv, L, Dv, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _varied_heads(settings, H, D, Hkv, seed=0):
    """The per-head values at their start plus noise, so that heads differ (a head read from the wrong index shows;
    a learned feature map starts as the same identity in every head). Per key/value head where declared so."""
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.3 * torch.randn(t.shape, generator=g)
            for n, t in constant_heads(settings, H, head_dim=D, kv_heads=Hkv).items()}


def _decode_against_reference(settings, q, k, v, mask, L0, dtype):
    """Prefill L0 keys (causal, mask[:, :L0]), build the state, then decode the rest one query at a time on the
    forced recurrent path; every step equals the reference on the same call. Returns the number of steps."""
    B, H, L, D = q.shape
    heads = _varied_heads(settings, H, D, k.shape[1])
    info = {"max_positions": 16}
    pre = make_call(q[:, :, :L0], k[:, :, :L0], v[:, :, :L0], settings, heads,
                    None if mask is None else mask[:, :L0], True, None, module_info=info)
    state = build_state(pre)
    assert state is not None and state.length == L0
    for t in range(L0, L):
        call = make_call(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], settings, heads,
                         None if mask is None else mask[:, :t + 1], True, None, module_info=info)
        ref, _, _ = attend(call, path="reference")
        out, _, path = attend(dataclasses.replace(call, recurrent=state), path="linear_recurrent")
        assert path == "linear_recurrent" and state.length == t + 1
        assert out.dtype == dtype and torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), ref.double(), atol=TOL[dtype], rtol=TOL[dtype],
                                   msg=lambda m, t=t: f"step {t}: {m}")
    return L - L0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp64", "fp32", "fp16", "bf16"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "padding"])
@pytest.mark.parametrize("L0", [1, 7])
@pytest.mark.parametrize("name", RECURRENT)
def test_steps_match_reference(name, dtype, masked, L0):
    """GQA 4/2, Dv != D, odd lengths; with padding: left padding in row 0, a masked key appended while decoding in
    row 1 (it must not enter the state) and row 2 fully masked (zeros, no NaN)."""
    q, k, v = _tensors(3, 4, 2, 15, 8, 6, dtype)
    mask = None
    if masked:
        mask = torch.ones(3, 15, dtype=torch.bool)
        mask[0, :3] = False
        mask[1, 9] = False
        mask[2] = False
    settings = resolve_settings(name)
    assert _decode_against_reference(settings, q, k, v, mask, L0, dtype) == 15 - L0
    if masked:  # the fully masked row is exactly 0 on the last step too
        heads = constant_heads(settings, 4, head_dim=8)
        call = make_call(q[:, :, :1], k, v, settings, heads, mask, True, None)
        assert attend(call, path="reference")[0][2].abs().max() == 0


def test_steps_with_a_length_aware_scale():
    """ssmax multiplies q by s log n (n = the visible keys of the step): the query side is recomputed every step."""
    q, k, v = _tensors(2, 2, 1, 11, 4, 4, torch.float64, seed=3)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, :4] = False
    _decode_against_reference(resolve_settings("linear", {"scale": "ssmax"}), q, k, v, mask, 5, torch.float64)


def test_steps_with_far_negative_keys():
    """phi(k) = e^k below fp32's normal range (k ~ -95): the state's running maximum keeps the sums at scale 1, so
    the weights are still the average the reference gives, not 0/0 or 0."""
    q, k, v = _tensors(1, 2, 2, 9, 4, 4, torch.float32, seed=4)
    k = k.clamp(-3, 3) - 95
    _decode_against_reference(resolve_settings("linear"), q, k, v, None, 3, torch.float32)


@pytest.mark.parametrize("causal, Lq", [(True, 13), (True, 5), (False, 13)], ids=["causal", "cached-5", "bidir"])
@pytest.mark.parametrize("name", RECURRENT)
def test_chunked_path_with_varied_heads_matches_reference(name, causal, Lq):
    """The O(n) chunked path against the reference, forward and gradients (q, k, v and every per-head value), with
    per-head values that differ between heads (a learned feature map), GQA 4/2, left padding and a fully masked
    row, 5 queries after 8 cached keys; chunk 4 so that several chunks and the carried state run."""
    from hf_attnorm.kernels.linear import chunked

    q, k, v = _tensors(3, 4, 2, 13, 8, 6, torch.float64, seed=5)
    q = q[:, :, -Lq:]
    mask = torch.ones(3, 13, dtype=torch.bool)
    mask[0, :3] = False
    mask[2] = False
    settings = resolve_settings(name)
    grads = {}
    for path in ("linear_chunked", "reference"):
        heads = {n: t.clone().double().requires_grad_(True) for n, t in _varied_heads(settings, 4, 8, 2).items()}
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        call = make_call(*inputs, settings, heads, mask, causal, None)
        old = chunked.CHUNK
        chunked.CHUNK = 4
        try:
            out, _, ran = attend(call, path=path)
        finally:
            chunked.CHUNK = old
        assert ran == path
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads[path] = [out, *(t.grad for t in inputs), *(heads[n].grad for n in sorted(heads))]
    assert all(g.abs().max() > 0 for g in grads["reference"][4:])  # every per-head value was reached
    for got, want in zip(grads["linear_chunked"], grads["reference"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8)
    assert grads["reference"][0][2].abs().max() == 0  # the fully masked row


def test_declines_with_reasons():
    settings = resolve_settings("linear")
    q, k, v = _tensors(1, 2, 2, 6, 4, 4, torch.float32)
    heads = constant_heads(settings, 2, head_dim=4)
    state = build_state(make_call(q[:, :, :4], k[:, :, :4], v[:, :, :4], settings, heads, None, True))
    step = make_call(q[:, :, 4:5], k[:, :, :5], v[:, :, :5], settings, heads, None, True)
    assert "no recurrent state" in PATHS["linear_recurrent"].check(step)
    assert PATHS["linear_recurrent"].check(dataclasses.replace(step, recurrent=state)) is None
    two_more = make_call(q[:, :, 5:6], k, v, settings, heads, None, True)
    assert "holds 4 keys, the call has 6" in PATHS["linear_recurrent"].check(
        dataclasses.replace(two_more, recurrent=state))
    several = make_call(q[:, :, 3:5], k[:, :, :5], v[:, :, :5], settings, heads, None, True)
    assert "2 queries" in PATHS["linear_recurrent"].check(dataclasses.replace(several, recurrent=state))
    grad_q = q[:, :, 4:5].clone().requires_grad_()
    needs_grad = make_call(grad_q, k[:, :, :5], v[:, :, :5], settings, heads, None, True)
    assert "require grad" in PATHS["linear_recurrent"].check(dataclasses.replace(needs_grad, recurrent=state))
    other = make_call(q[:, :, 4:5], k[:, :, :5], v[:, :, :5], resolve_settings("linear", {"scale": "ssmax"}),
                      constant_heads(resolve_settings("linear", {"scale": "ssmax"}), 2, head_dim=4), None, True)
    assert "other settings" in PATHS["linear_recurrent"].check(dataclasses.replace(other, recurrent=state))
    with pytest.raises(ValueError, match="path 'linear_recurrent' cannot run this call.*no recurrent state"):
        attend(step, path="linear_recurrent")
    # without a state the rule says why and takes the exact one-query path
    assert explain(step)[0][0] == "linear_recurrent" and explain(step)[-1] == ("linear_chunked", "runs")


# ------------------------------------------------------------------------------------------------- generation


@pytest.fixture
def counted(monkeypatch):
    """Counts the recurrent steps that actually ran (LAST_CALL only keeps the last path)."""
    ran = []
    path = PATHS["linear_recurrent"]

    def kernel(call):
        ran.append(call.k.shape[2])
        return path.kernel(call)

    monkeypatch.setitem(PATHS, "linear_recurrent", dataclasses.replace(path, kernel=kernel))
    return ran


def _generate(model, x, exact: bool, **kw):
    """(sequences, logits [steps, B, V]); exact: every call forced onto the O(Lk) path."""
    kw = {"max_new_tokens": 6, "do_sample": False, "output_logits": True, "return_dict_in_generate": True, **kw}
    set_forced_path("linear_chunked" if exact else "auto")
    try:
        with torch.no_grad():
            out = model.generate(x, **kw)
    finally:
        set_forced_path("auto")
    return out, torch.stack(out.logits)


def _same(a, b):
    assert torch.equal(a[0].sequences, b[0].sequences)
    torch.testing.assert_close(a[1], b[1], atol=1e-5, rtol=0)


@pytest.fixture(scope="module", params=RECURRENT)
def model(request):
    """A tiny GQA Llama on each recurrent normalizer, its learnable per-head values varied per head."""
    m = tiny("llama", "causal_lm", implementation=request.param)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if ".attnorm." in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return m


def _padded(seed=0, b=2, n=11):
    x = torch.randint(1, 97, (b, n), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(x)
    mask[0, :4] = 0  # left padding
    return x, mask


def test_generate_with_state_equals_exact(model, counted):
    x, mask = _padded()
    exact = _generate(model, x, True, attention_mask=mask)
    assert not counted
    fast = _generate(model, x, False, attention_mask=mask)
    _same(fast, exact)
    layers = model.config.num_hidden_layers
    assert len(counted) == 5 * layers, counted  # every decode step of every layer (6 tokens: 1 prefill + 5 steps)
    assert LAST_CALL.path == "linear_recurrent"
    # two consecutive generate calls: a new cache, a new state (none reused from the first)
    counted.clear()
    x2, mask2 = _padded(seed=1, b=3, n=7)
    _same(_generate(model, x2, False, attention_mask=mask2), _generate(model, x2, True, attention_mask=mask2))
    assert len(counted) == 5 * layers and min(counted) == 8  # its own prompt of 7 keys, not the first call's


def test_a_cache_that_no_longer_reaches_the_module_warns_once_and_stays_exact(model, counted, monkeypatch):
    """If a transformers release moves the cache argument again (simulated: hf_attnorm looks for another name),
    linear attention's O(1) step cannot attach: generation stays exact, and a warning says so once, naming the
    transformers version and the consequence (never a silent O(Lk) fallback)."""
    from hf_attnorm.hf import recurrent

    monkeypatch.setattr(compat, "CACHE_ARGUMENTS", ("a_renamed_cache",))
    monkeypatch.setattr(recurrent, "_WARNED", set())
    x, mask = _padded()
    with pytest.warns(UserWarning) as record:
        fast = _generate(model, x, False, attention_mask=mask)
    ours = [str(w.message) for w in record if "recurrent decode state is not used" in str(w.message)]
    assert len(ours) == 1, ours  # once, though every layer of every step met it
    assert f"transformers {transformers.__version__}" in ours[0] and "no transformers Cache reached" in ours[0]
    assert "O(keys) instead of O(1)" in ours[0]
    assert not counted  # the recurrent step did not run
    _same(fast, _generate(model, x, True, attention_mask=mask))


def test_continued_and_cropped_cache(model, counted):
    """A cache passed to a second generate call (its new tokens are a prefill: the state is rebuilt from all cached
    keys), and a cropped cache (its tensors are replaced: the stale state is dropped, never reused)."""
    x, mask = _padded(seed=2)
    outs = {}
    for exact in (True, False):
        cache = DynamicCache(config=model.config)
        first = _generate(model, x, exact, attention_mask=mask, **compat.cache_kwargs(model, cache))
        seq = first[0].sequences
        more = torch.cat([seq, torch.randint(1, 97, (2, 3), generator=torch.Generator().manual_seed(5))], dim=1)
        mask2 = torch.cat([mask, torch.ones(2, more.shape[1] - x.shape[1], dtype=mask.dtype)], dim=1)
        second = _generate(model, more, exact, attention_mask=mask2, **compat.cache_kwargs(model, cache))
        cache.crop(-3)  # drop the last 3 cached keys, then continue from the cropped cache
        seq2 = second[0].sequences
        mask3 = torch.cat([mask2, torch.ones(2, seq2.shape[1] - more.shape[1], dtype=mask.dtype)], dim=1)
        third = _generate(model, seq2, exact, attention_mask=mask3, **compat.cache_kwargs(model, cache))
        outs[exact] = (first, second, third)
    for a, b in zip(outs[False], outs[True]):
        _same(a, b)
    assert len(counted) >= 3 * 4 * model.config.num_hidden_layers


def test_reordered_cache_is_not_reused(model, counted):
    """reorder_cache (beam search) replaces the layer's tensors: the next step must take the exact path."""
    x, mask = _padded(seed=3)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(x, attention_mask=mask, **compat.cache_kwargs(model, cache), use_cache=True)
    layer = cache.layers[0]
    assert getattr(layer, STATE_ATTR).state.length == x.shape[1]
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    mask2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
    cache.reorder_cache(torch.tensor([1, 0]))
    with torch.no_grad():
        model(nxt.flip(0), attention_mask=mask2.flip(0), **compat.cache_kwargs(model, cache), use_cache=True)
    assert not counted and LAST_CALL.path == "linear_chunked"
    assert not hasattr(layer, STATE_ATTR)  # dropped, not left stale
    # an in-place change of the cached keys (same tensor, new version) is noticed too
    with torch.no_grad():
        model(x[:, :1], attention_mask=torch.cat([mask2, torch.ones(2, 1, dtype=mask.dtype)], 1),
              **compat.cache_kwargs(model, c := DynamicCache(config=model.config)), use_cache=True)
    assert getattr(c.layers[0], STATE_ATTR) is not None  # a one-token prompt builds a state
    c.layers[0].keys.mul_(2)
    counted.clear()
    with torch.no_grad():
        model(x[:, 1:2], **compat.cache_kwargs(model, c), use_cache=True)
    assert len(counted) == model.config.num_hidden_layers - 1  # every layer but the changed one
    drop_states(c)
    assert not any(hasattr(la, STATE_ATTR) for la in c.layers)


def test_cache_with_a_state_pickles(model):
    """A state holds weak references; a pickled cache carries no state (and the model stays picklable)."""
    x, mask = _padded(seed=7)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(x, attention_mask=mask, **compat.cache_kwargs(model, cache), use_cache=True)
    assert hasattr(cache.layers[0], STATE_ATTR)
    copy = pickle.loads(pickle.dumps(cache))
    assert getattr(copy.layers[0], STATE_ATTR) is None and torch.equal(copy.layers[0].keys, cache.layers[0].keys)
    pickle.dumps(model)


def test_beam_search_equals_exact(model, counted):
    x, mask = _padded(seed=4)
    kw = dict(attention_mask=mask, num_beams=3, num_return_sequences=2)
    _same(_generate(model, x, False, **kw), _generate(model, x, True, **kw))


def test_static_cache_takes_the_exact_path(model, counted):
    """A static cache holds max_cache_len keys whose visibility only the mask knows: no state, the exact path."""
    x, mask = _padded(seed=6)
    kw = dict(attention_mask=mask, cache_implementation="static")
    _same(_generate(model, x, False, **kw), _generate(model, x, True, **kw))
    assert not counted and LAST_CALL.path == "linear_chunked"


def test_hook_follows_the_implementation(model):
    """The pre-hook is installed with linear attention and removed when the model leaves it."""
    import hf_attnorm
    from hf_attnorm.hf.cache_state import _pre_hook
    from hf_attnorm.hf.families import attention_modules

    m = tiny("llama", "causal_lm", implementation="linear")
    mods = [mod for _, mod in attention_modules(m)]
    assert all(_pre_hook in mod._forward_pre_hooks.values() for mod in mods)
    hf_attnorm.apply(m, "softmax")
    assert not any(_pre_hook in mod._forward_pre_hooks.values() for mod in mods)
    m.set_attn_implementation("sdpa")
    assert not any(_pre_hook in mod._forward_pre_hooks.values() for mod in mods)


@pytest.mark.slow
@needs_compile
@needs_compile_inductor
def test_compiled_generation_with_a_dynamic_cache(counted):
    """torch.compile(fullgraph=True) traces the pre-hook and the attention function with a dynamic cache: no state
    there (nothing may persist across a graph), the exact path, the same generation as eager."""
    torch._dynamo.reset()
    model = tiny("llama", "causal_lm", implementation="linear")
    x, mask = _padded(seed=8)
    eager = _generate(model, x, False, attention_mask=mask, max_new_tokens=3)
    assert counted
    counted.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.forward = torch.compile(model.forward, fullgraph=True)
        LAST_CALL.path = ""
        compiled = _generate(model, x, False, attention_mask=mask, max_new_tokens=3)
    assert not counted and LAST_CALL.path == "linear_chunked"
    _same(compiled, eager)


def test_gpt2_generation(counted):
    """Another family (GPT-2: its own attention module, no GQA) decodes from the state too."""
    model = tiny("gpt2", "causal_lm", implementation="linear")
    x, mask = _padded(seed=9)
    _same(_generate(model, x, False, attention_mask=mask, pad_token_id=0),
          _generate(model, x, True, attention_mask=mask, pad_token_id=0))
    assert len(counted) == 5 * model.config.n_layer
