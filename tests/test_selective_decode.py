"""Exact cached decoding of selective attention: the carry (``AttnCall.selective_carry``) on the paths that take it,
the column sums a cache keeps (kernels/selective/carry.py, hf/selective_cache.py) against the reference's, and
generation with the cache equal to generation without it (use_cache=False: every step recomputes the sequence), token
for token and logits of every step, in fp64 on a tiny GQA Llama: left padding, a non-zero selecting head, chunked
prefill, beam search, a cropped and a batch-edited cache, and the refusals (static cache, a cache edited behind our
back)."""

from __future__ import annotations

import dataclasses
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from hf_attnorm.attention import constant_heads, make_call
from hf_attnorm.hf import compat
from hf_attnorm.hf.selective_cache import SelectiveLayer, drop_states, state_of_layer
from hf_attnorm.kernels import PATHS, attend, dispatch, explain
from hf_attnorm.kernels.reference import reference_scores
from hf_attnorm.kernels.selective import blocked as selective_mod
from hf_attnorm.kernels.selective import cpu as selective_cpu
from hf_attnorm.kernels.selective.carry import column_sums, prefix_column_sums
from hf_attnorm.normalizers.selective import selection_parts
from hf_attnorm.registry import AttnormError
from hf_attnorm.settings import resolve_settings

TOL = 1e-10  # fp64 throughout
#: the path the rule gives calls of several queries on CPU: the fused C++ kernel where it builds, else the blocked one
SEVERAL = ("selective_cpu" if "selective_cpu" in PATHS and selective_cpu.NATIVE.unavailable_reason() is None
           else "selective")


def reference_column_sums(call) -> torch.Tensor:
    """[B, Lk]: sum over the call's queries of the selecting head's relu'd scores where they select, from the
    reference's own pieces (its scores and ``selection_parts``), independently of the blocked pass."""
    h = call.normalizer.selecting_head(call.settings)
    s = reference_scores(call)[:, h]  # [B, Lq, Lk]
    keep = call.mask.dense(s.device)
    keep = (keep[:, h] if keep.shape[1] > 1 else keep[:, 0]).expand(keep.shape[0], s.shape[1], s.shape[2])
    _, selects = selection_parts(keep, s.shape[1], s.shape[2])
    return torch.where(selects, F.relu(s), torch.zeros((), dtype=s.dtype)).sum(dim=1)


def _tensors(B=2, H=4, Hkv=2, L=13, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, L, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv)]


def _padding(B=2, L=13):
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, :4] = False  # left padding
    return mask


def _causal_pad(mask: torch.Tensor, lq: int) -> torch.Tensor:
    """The 4-D keep-mask generation builds: [B, 1, lq, Lk], the last lq keys are the queries' own."""
    lk = mask.shape[1]
    i = torch.arange(lq)[:, None] + (lk - lq)
    return (mask[:, None, None, :] & (torch.arange(lk)[None, :] <= i)[None, None])


@pytest.mark.parametrize("head", [0, 3])
def test_split_calls_with_the_carry_equal_the_whole_call(head):
    """A prefill, then chunks of several queries (selective path) and single queries (decode path), each started
    from the column sums of all earlier queries, give the whole call's outputs; the stored sums equal the
    reference's; forward and every gradient, the carry's included."""
    settings = resolve_settings("selective", {"selective_head": head})
    q, k, v = _tensors()
    mask = _padding()
    heads = constant_heads(settings, 4, head_dim=8)
    whole, _ = attend_ref(q, k, v, mask, settings, heads)
    carry = None
    for i0, i1, path in ((0, 5, SEVERAL), (5, 9, SEVERAL), (9, 10, "selective_step"),
                         (10, 11, "selective_step"), (11, 13, SEVERAL)):
        call = make_call(q[:, :, i0:i1], k[:, :, :i1], v[:, :, :i1], settings, heads,
                         _causal_pad(mask[:, :i1], i1 - i0), True)
        if carry is not None:
            call = dataclasses.replace(call, selective_carry=F.pad(carry, (0, i1 - i0)))
        assert explain(call)[-1] == (path, "runs")
        extra = ("decode",) if i1 - i0 == 1 else ("selective",) if path != "selective" else ()
        for p in (path, "reference", *extra):
            out, _, ran = attend(call, p)
            assert ran == p
            torch.testing.assert_close(out, whole[:, :, i0:i1], atol=TOL, rtol=0,
                                       msg=lambda m, p=p, i0=i0: f"{p} {i0}: {m}")
        sums = column_sums(call)
        torch.testing.assert_close(sums, reference_column_sums(call), atol=TOL, rtol=0)
        carry = sums if carry is None else call.selective_carry + sums
    # the sums over every query of the whole call, and a prefix recomputed from per-position q', k'
    full = make_call(q, k, v, settings, heads, _causal_pad(mask, 13), True)
    torch.testing.assert_close(carry, reference_column_sums(full), atol=TOL, rtol=0)
    qs = q[:, head] * 8 ** -0.5
    ks = k[:, head // 2]
    torch.testing.assert_close(prefix_column_sums(qs, ks, mask), carry, atol=TOL, rtol=0)
    torch.testing.assert_close(prefix_column_sums(qs[:, :9], ks[:, :9], mask[:, :9]),
                               reference_column_sums(make_call(q[:, :, :9], k[:, :, :9], v[:, :, :9], settings,
                                                               heads, _causal_pad(mask[:, :9], 9), True)),
                               atol=TOL, rtol=0)


def attend_ref(q, k, v, mask, settings, heads):
    out, w, _ = attend(make_call(q, k, v, settings, heads, _causal_pad(mask, q.shape[2]), True), "reference")
    return out, w


def test_the_carry_gradient(monkeypatch):
    """The blocked path with a carry: forward and the gradients of q, k, v and the carry equal the reference's."""
    monkeypatch.setattr(selective_mod, "BLOCK_OVERRIDE", 3)  # several blocks, so the carries are exercised
    settings = resolve_settings("selective", {"selective_head": 1})
    q, k, v = _tensors(L=11, seed=1)
    heads = constant_heads(settings, 4, head_dim=8)
    mask = _padding(L=11)
    carry0 = torch.rand(2, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 3
    carry0[:, -7:] = 0  # the call's new keys
    gout = torch.randn(2, 4, 7, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    res = {}
    for path in ("selective", "reference"):
        qq, kk, vv, cc = (t.clone().requires_grad_() for t in (q[:, :, 4:], k, v, carry0))
        call = dataclasses.replace(make_call(qq, kk, vv, settings, heads, _causal_pad(mask, 7), True),
                                   selective_carry=cc)
        out, _, ran = attend(call, path)
        assert ran == path
        res[path] = (out, *torch.autograd.grad(out, (qq, kk, vv, cc), gout))
    for name, a, b in zip(("out", "dq", "dk", "dv", "dcarry"), res["selective"], res["reference"]):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    assert res["selective"][4].abs().max() > 0


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "padding"])
def test_one_query_paths_forward_and_gradients(masked):
    """selective_step (SDPA) and decode (the normalizer's reference) on one query with a carry: GQA, padding with a
    fully masked row (zeros, no NaN), fp64 forward and the gradients of q, k, v against the reference."""
    settings = resolve_settings("selective", {"selective_head": 2})
    q, k, v = _tensors(B=3, L=9, seed=4)
    mask = None
    if masked:
        mask = torch.ones(3, 9, dtype=torch.bool)
        mask[0, :3] = False
        mask[2] = False
    heads = constant_heads(settings, 4, head_dim=8)
    carry = torch.rand(3, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 2
    carry[:, -1] = 0
    gout = torch.randn(3, 4, 1, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    res = {}
    for path in ("selective_step", "decode", "reference"):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q[:, :, -1:], k, v))
        call = dataclasses.replace(make_call(qq, kk, vv, settings, heads, mask, True), selective_carry=carry)
        out, _, ran = attend(call, path)
        assert ran == path and torch.isfinite(out).all()
        res[path] = (out, *torch.autograd.grad(out, (qq, kk, vv), gout))
    for path in ("selective_step", "decode"):
        for name, a, b in zip(("out", "dq", "dk", "dv"), res[path], res["reference"]):
            torch.testing.assert_close(a, b, atol=TOL, rtol=0, msg=lambda m, name=name, p=path: f"{p} {name}: {m}")
    if masked:
        assert res["selective_step"][0][2].abs().max() == 0
    call = make_call(q[:, :, -1:], k, v, settings, heads, mask, True)
    assert explain(dataclasses.replace(call, selective_carry=carry))[0] == ("selective_step", "runs")
    needs = dataclasses.replace(call, selective_carry=carry.clone().requires_grad_())
    assert "carry requires grad" in PATHS["selective_step"].check(needs)


def test_other_paths_decline_and_a_bad_carry_is_named():
    settings = resolve_settings("selective")
    q, k, v = _tensors(L=6)
    call = make_call(q, k, v, settings, {}, None, True)
    bad = dataclasses.replace(call, selective_carry=torch.zeros(2, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"selective_carry must be a float tensor \[B=2, Lk=6\]"):
        attend(bad, "selective")
    with pytest.raises(ValueError, match="selective_carry must be"):
        attend(bad, "reference")
    assert "couples the queries" in PATHS["chunked"].check(call)


# ------------------------------------------------------------------------------------------------- generation


@pytest.fixture
def ran(monkeypatch):
    """(path, carried) of every selective/decode/reference kernel run (LAST_CALL keeps only the last path)."""
    seen = []
    for name in ("selective", "selective_cpu", "selective_step", "decode", "reference"):
        if name not in PATHS:
            continue
        path = PATHS[name]

        def kernel(call, path=path):
            seen.append((path.name, call.selective_carry is not None))
            return path.kernel(call)

        monkeypatch.setitem(PATHS, name, dataclasses.replace(path, kernel=kernel))
    return seen


@pytest.fixture(scope="module")
def model():
    return tiny("llama", "causal_lm", implementation="selective", attnorm={"selective_head": 3}).double()


def _padded(seed=0, b=2, n=11):
    x = torch.randint(1, 97, (b, n), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(x)
    mask[0, :4] = 0
    return x, mask


def _generate(model, x, cached: bool, **kw):
    kw = {"max_new_tokens": 6, "do_sample": False, "output_logits": True, "return_dict_in_generate": True,
          "pad_token_id": 0, **kw}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(x, use_cache=cached, **kw)
    return out, torch.stack(out.logits)


def _same(a, b):
    assert torch.equal(a[0].sequences, b[0].sequences)
    torch.testing.assert_close(a[1], b[1], atol=TOL, rtol=0)


def test_model_is_gqa_with_a_nonzero_selecting_head(model):
    assert model.config.num_attention_heads == 4 and model.config.num_key_value_heads == 2
    assert model.config.attnorm["selective_head"] == 3


def test_generate_with_cache_equals_without(model, ran):
    x, mask = _padded()
    uncached = _generate(model, x, False, attention_mask=mask)
    assert not any(c for _, c in ran)
    ran.clear()
    cached = _generate(model, x, True, attention_mask=mask)
    _same(cached, uncached)
    layers = model.config.num_hidden_layers
    assert ran[:layers] == [(SEVERAL, False)] * layers  # the prefill: the normal path, no carry
    assert ran[layers:] == [("selective_step", True)] * (5 * layers)  # every decode step of every layer, carried


def test_learned_memory_with_the_cache_equals_without():
    """num_mem_kv: the memory columns lead the key axis of every call, so the state covers them too."""
    model = tiny("llama", "causal_lm", implementation="selective", attnorm={"num_mem_kv": 2}).double()
    x, mask = _padded(seed=9)
    for m in (mask, None):
        _same(_generate(model, x, True, attention_mask=m), _generate(model, x, False, attention_mask=m))


def test_stored_sums_equal_the_reference(model, monkeypatch):
    """After a prefill and after a decode step, each layer's C equals the reference column sums over every query so
    far (recomputed from the calls the layers received, the whole sequence at once)."""
    calls = []
    real = dispatch.run_path

    def spy(call, name):  # (every call a path runs passes here)
        calls.append(call)
        return real(call, name)

    monkeypatch.setattr(dispatch, "run_path", spy)
    x, mask = _padded(seed=1)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(x, attention_mask=mask, **compat.cache_kwargs(model, cache), use_cache=True)
        for layer, call in zip(cache.layers, calls):
            assert type(layer) is SelectiveLayer
            torch.testing.assert_close(state_of_layer(layer).c, reference_column_sums(call), atol=TOL, rtol=0)
        nxt = out.logits[:, -1:].argmax(-1)
        mask2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        calls.clear()
        model(nxt, attention_mask=mask2, **compat.cache_kwargs(model, cache), use_cache=True)
        steps = list(calls)
        calls.clear()
        model(torch.cat([x, nxt], 1), attention_mask=mask2, use_cache=False)  # the whole sequence, no cache
    for layer, step, whole in zip(cache.layers, steps, calls):
        assert step.q.shape[2] == 1 and step.selective_carry is not None
        torch.testing.assert_close(state_of_layer(layer).c, reference_column_sums(whole), atol=TOL, rtol=0)


def test_chunked_prefill_equals_the_whole_forward(model, ran):
    """A prefill, then several new tokens with the past (the selective path with a carry), then one: the logits of
    every position equal one uncached forward of the whole sequence."""
    x, mask = _padded(seed=2, n=14)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        whole = model(x, attention_mask=mask, use_cache=False).logits
        ran.clear()
        parts = [model(x[:, a:b], attention_mask=mask[:, :b], **compat.cache_kwargs(model, cache),
                       use_cache=True).logits for a, b in ((0, 6), (6, 13), (13, 14))]
    layers = model.config.num_hidden_layers
    assert ran == ([(SEVERAL, False)] * layers + [(SEVERAL, True)] * layers
                   + [("selective_step", True)] * layers)
    live = mask.bool()
    torch.testing.assert_close(torch.cat(parts, 1)[live], whole[live], atol=TOL, rtol=0)


def test_continued_and_cropped_cache(model):
    """A cache passed on to a second generate call (its new tokens: a chunked prefill with the carry), then cropped
    (assisted decoding's rollback: C recomputed over the kept positions) and continued: every call equals
    generation without a cache."""
    x, mask = _padded(seed=3)
    cache = DynamicCache(config=model.config)
    first = _generate(model, x, True, attention_mask=mask, **compat.cache_kwargs(model, cache))
    _same(first, _generate(model, x, False, attention_mask=mask))
    seq = first[0].sequences
    more = torch.cat([seq, torch.randint(1, 97, (2, 3), generator=torch.Generator().manual_seed(5))], dim=1)
    mask2 = torch.cat([mask, torch.ones(2, more.shape[1] - x.shape[1], dtype=mask.dtype)], dim=1)
    second = _generate(model, more, True, attention_mask=mask2, **compat.cache_kwargs(model, cache))
    _same(second, _generate(model, more, False, attention_mask=mask2))
    seq2 = second[0].sequences
    mask3 = torch.cat([mask2, torch.ones(2, seq2.shape[1] - more.shape[1], dtype=mask.dtype)], dim=1)
    n = cache.get_seq_length()
    cache.crop(-4)
    assert cache.get_seq_length() == n - 4
    # the cropped C equals the C of a fresh prefill of the kept positions
    fresh = DynamicCache(config=model.config)
    with torch.no_grad():
        kept = mask3[:, :n - 4]
        pos = (kept.cumsum(-1) - 1).masked_fill(kept == 0, 1)  # as generate makes them
        model(seq2[:, :n - 4], attention_mask=kept, position_ids=pos, **compat.cache_kwargs(model, fresh),
              use_cache=True)
    for a, b in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(state_of_layer(a).c, state_of_layer(b).c, atol=TOL, rtol=0)
    _same(_generate(model, seq2, True, attention_mask=mask3, **compat.cache_kwargs(model, cache)),
          _generate(model, seq2, False, attention_mask=mask3))


def test_beam_search_equals_without_cache(model, ran):
    x, mask = _padded(seed=4)
    kw = dict(attention_mask=mask, num_beams=3, num_return_sequences=2, max_new_tokens=5)
    _same(_generate(model, x, True, **kw), _generate(model, x, False, **kw))
    assert ("selective_step", True) in ran


def test_batch_select_and_repeat_follow_the_cache(model):
    """batch_select_indices / batch_repeat_interleave act on the column sums too: continuing from the edited cache
    equals the uncached forward of the edited batch."""
    x, mask = _padded(seed=5)
    nxt = torch.randint(1, 97, (2, 2), generator=torch.Generator().manual_seed(6))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(x, attention_mask=mask, **compat.cache_kwargs(model, cache), use_cache=True)
        cache.batch_select_indices(torch.tensor([0]))
        cache.batch_repeat_interleave(2)
        m2 = torch.cat([mask[:1], torch.ones(1, 2, dtype=mask.dtype)], 1).repeat(2, 1)
        step = model(nxt, attention_mask=m2, **compat.cache_kwargs(model, cache), use_cache=True).logits
        whole = model(torch.cat([x[:1].repeat(2, 1), nxt], 1), attention_mask=m2, use_cache=False).logits
    torch.testing.assert_close(step, whole[:, -2:], atol=TOL, rtol=0)


def test_refusals_are_clear(model):
    x, mask = _padded(seed=7)
    with pytest.raises(AttnormError, match="StaticLayer"):  # a static cache: refused at generate time
        _generate(model, x, True, attention_mask=mask, cache_implementation="static")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(x, attention_mask=mask, **compat.cache_kwargs(model, cache), use_cache=True)
        cache.layers[0].keys.mul_(1.0)  # an in-place edit hf_attnorm does not follow
        nxt = torch.ones(2, 1, dtype=x.dtype)
        m2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        with pytest.raises(AttnormError, match="changed in place.*use_cache=False"):
            model(nxt, attention_mask=m2, **compat.cache_kwargs(model, cache), use_cache=True)
        fresh = DynamicCache(config=model.config)
        model(x, attention_mask=mask, **compat.cache_kwargs(model, fresh), use_cache=True)
        drop_states(fresh)
        with pytest.raises(AttnormError, match="drop_states was called"):
            model(nxt, attention_mask=m2, **compat.cache_kwargs(model, fresh), use_cache=True)


def test_a_cache_that_no_longer_reaches_the_module_is_refused_naming_the_version(model, monkeypatch):
    """If a transformers release moves the cache argument again (simulated: hf_attnorm looks for another name), the
    first cached step is refused, naming the transformers version and what was looked for, never a wrong step."""
    import transformers

    monkeypatch.setattr(compat, "CACHE_ARGUMENTS", ("a_renamed_cache",))
    x, mask = _padded(seed=7)
    with pytest.raises(AttnormError, match=rf"no transformers Cache reached .*transformers "
                                           rf"{transformers.__version__}; looked for the keywords a_renamed_cache"):
        _generate(model, x, True, attention_mask=mask)


def test_a_cache_with_sums_pickles_as_a_plain_cache(model):
    x, mask = _padded(seed=8)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(x, attention_mask=mask, **compat.cache_kwargs(model, cache), use_cache=True)
    assert state_of_layer(cache.layers[0]) is not None
    copy = pickle.loads(pickle.dumps(cache))
    assert type(copy.layers[0]) is DynamicLayer and state_of_layer(copy.layers[0]) is None
    assert torch.equal(copy.layers[0].keys, cache.layers[0].keys)
    pickle.dumps(model)


def test_hook_follows_the_implementation():
    """The pre-hook is installed with a query-coupled normalizer and removed when the model leaves it."""
    import hf_attnorm
    from hf_attnorm.hf.cache_state import _pre_hook
    from hf_attnorm.hf.families import attention_modules

    m = tiny("llama", "causal_lm", implementation="selective")
    mods = [mod for _, mod in attention_modules(m)]
    assert all(_pre_hook in mod._forward_pre_hooks.values() for mod in mods)
    hf_attnorm.apply(m, "softmax")
    assert not any(_pre_hook in mod._forward_pre_hooks.values() for mod in mods)
    hf_attnorm.apply(m, "selective")
    assert all(_pre_hook in mod._forward_pre_hooks.values() for mod in mods)
    m.set_attn_implementation("sdpa")
    assert not any(_pre_hook in mod._forward_pre_hooks.values() for mod in mods)


def test_encoder_decoder_cache_is_refused_by_name_and_uncached_generation_runs():
    """An encoder-decoder model's EncoderDecoderCache is not followed (its cross-attention would need column sums of
    its own): a cached step is refused naming it; generation without a cache runs."""
    import family_zoo as fz
    from transformers import EncoderDecoderCache

    model = fz.build("bart", "selective")
    ins, _ = fz.inputs("bart", pad=False)
    enc = model.get_encoder()(input_ids=ins["input_ids"], attention_mask=ins["attention_mask"])
    dec = ins["decoder_input_ids"]
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    out = model(encoder_outputs=enc, attention_mask=ins["attention_mask"], decoder_input_ids=dec[:, :1],
                **compat.cache_kwargs(model, cache), use_cache=True)  # the first step has no earlier query: exact
    with pytest.raises(AttnormError, match="EncoderDecoderCache"):
        model(encoder_outputs=enc, attention_mask=ins["attention_mask"], decoder_input_ids=dec[:, 1:2],
              **compat.cache_kwargs(model, compat.output_cache(out)), use_cache=True)
    gen = model.generate(input_ids=ins["input_ids"], attention_mask=ins["attention_mask"], max_new_tokens=3,
                         do_sample=False, use_cache=False)
    assert gen.shape[0] == 2
