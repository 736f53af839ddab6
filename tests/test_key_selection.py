"""Key selections: the keys a sparse-attention indexer picks per query (``indices``: DeepSeek-V3.2-style top-k keys;
``block_indices``: MiniMax M3's key blocks), turned into a keep-mask (``masks.selected_keys``) and combined with the
call's mask (``masks.select_keys``), so every path runs the normalizer over exactly the selected keys.

The families that pass them run in the family matrix (test_families.py); here: the semantics of the indices
(duplicates, -1 slots, blocks, per-head selections, decode), every path of every normalizer against the reference
with the combined mask, the refusals, and the states kept across calls that a selection must not reach.
"""

from __future__ import annotations

import pytest
import torch
from conftest import first_implementations

from hf_attnorm.attention import attention, constant_heads, make_call
from hf_attnorm.hf import cache_state, forward
from hf_attnorm.hf.families import SELECTION_KEYWORDS
from hf_attnorm.kernels import PATHS, choose, paths_for, prepare_path
from hf_attnorm.kernels.linear.recurrent import accepts as recurrent_accepts
from hf_attnorm.kernels.linear.recurrent import build_state
from hf_attnorm.masks import MaskError, causal_keep, selected_keys
from hf_attnorm.registry import NORMALIZERS, PRESETS, AttnormError
from hf_attnorm.settings import resolve_settings

B, H, HKV, L, D = 2, 4, 2, 9, 8


def _qkv(lq: int = L, lk: int = L, seed: int = 0, grad: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, lq, D, generator=g)
    k, v = torch.randn(B, HKV, lk, D, generator=g), torch.randn(B, HKV, lk, D, generator=g)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _topk(lq: int = L, lk: int = L, k: int = 3, seed: int = 1) -> torch.Tensor:
    """int32 [B, Lq, k]: per query, the top k of random scores over the keys it sees causally (lower-right aligned;
    a query seeing fewer than k keys also gets masked ones, as a DSA indexer's top-k does)."""
    g = torch.Generator().manual_seed(seed)
    seen = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    scores = torch.rand(B, lq, lk, generator=g).masked_fill(~seen, -1.0)
    return scores.topk(min(k, lk), dim=-1).indices.to(torch.int32)


# ------------------------------------------------------------------------------------------------ the indices


def test_indices_select_a_set_of_keys_and_minus_one_selects_none():
    idx = torch.tensor([[[2, 0, 2], [-1, 1, -1]]])  # [B=1, Lq=2, k=3]: a duplicate, unused slots
    sel = selected_keys(idx, 4)
    assert sel.shape == (1, 1, 2, 4) and sel.dtype == torch.bool
    assert sel[0, 0].tolist() == [[True, False, True, False], [False, True, False, False]]
    # as the family's eager path builds it: scatter into an all-masked row (a set: duplicates change nothing)
    eager = torch.ones(1, 2, 4, dtype=torch.bool).scatter(-1, idx.clamp_min(0).long(), False)
    assert torch.equal(sel[0, 0, 0], ~eager[0, 0])


def test_block_indices_select_whole_blocks_per_head_and_cut_the_last():
    idx = torch.tensor([[[[0, 2]], [[1, -1]]]])  # [B=1, Hs=2, Lq=1, k=2], blocks of 2 over 5 keys (3 blocks)
    sel = selected_keys(idx, 5, block=2)
    assert sel.shape == (1, 2, 1, 5)
    assert sel[0, :, 0].tolist() == [[True, True, False, False, True], [False, False, True, True, False]]


@pytest.mark.parametrize("bad, match", [(torch.tensor([[[4]]]), r"\[-1, 4\)"), (torch.tensor([[[-2]]]), r"\[-1, 4\)"),
                                        (torch.zeros(1, 1, 1), "integer tensor"),
                                        (torch.zeros(1, 1, dtype=torch.long), "integer tensor")])
def test_indices_out_of_range_or_of_another_kind_are_refused(bad, match):
    with pytest.raises(MaskError, match=match):
        selected_keys(bad, 4)


# ------------------------------------------------------------------------------------------------ every path


def _impls() -> list[str]:
    return first_implementations(lambda s: s.normalizer)


@pytest.mark.parametrize("lq", [L, 1], ids=["prefill", "decode"])
@pytest.mark.parametrize("impl", _impls())
def test_every_path_runs_the_normalizer_over_exactly_the_selected_keys(impl, lq):
    """Padding x causal mask and a top-k selection on every CPU path that takes the call (a prefill, and one query
    against L cached keys): equal to the reference given the combined keep-mask (the keep-mask the family's eager
    path builds); the path the automatic rule picks is among them."""
    norm = resolve_settings(impl, {}).normalizer
    q, k, v = _qkv(lq=lq)
    mask = torch.ones(B, 1, lq, L, dtype=torch.bool).tril(L - lq)
    mask[0, :, :, :2] = False
    sel = selected_keys(_topk(lq=lq), L)
    want, _ = attention(q, k, v, impl, attention_mask=mask & sel, path="reference")
    heads = constant_heads(resolve_settings(impl, {}), H, None, D, HKV, D)
    call = make_call(q, k, v, resolve_settings(impl, {}), heads, mask, True, selection=sel)
    assert call.mask.selected and torch.equal(call.mask.keep, mask & sel)
    ran = []
    for path in ["reference", *paths_for(norm)]:
        if "triton" in path or (prepare_path(path) and PATHS[path].check(call) is not None):
            continue
        got, _ = attention(q, k, v, impl, attention_mask=mask, selection=sel, path=path)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=lambda m, p=path: f"{impl} on {p}: {m}")
        ran.append(path)
    assert "reference" in ran and choose(call) in ran, (choose(call), ran)


@pytest.mark.parametrize("impl", ["softmax", "symax"])
def test_selection_gradients_equal_the_combined_mask(impl):
    q, k, v = _qkv(grad=True)
    sel = selected_keys(_topk(), L)
    grads = []
    for kw in (dict(causal=True, selection=sel), dict(attention_mask=causal_keep(L, L, "cpu") & sel)):
        out, _ = attention(q, k, v, impl, **kw)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_a_decode_step_sees_its_selected_keys_among_every_cached_one():
    """One query against a cache (no mask, as sdpa_mask leaves it): every cached key is visible, so the visible keys
    are exactly the selected ones."""
    q, k, v = _qkv(lq=1, lk=L)
    idx = torch.tensor([[[0, 5, 8]], [[3, 3, -1]]], dtype=torch.int32)
    got, w = attention(q, k, v, "softmax", causal=True, selection=selected_keys(idx, L), need_weights=True)
    assert ((w > 0) == selected_keys(idx, L)).all()
    want, _ = attention(q, k, v, "softmax", attention_mask=selected_keys(idx, L))
    torch.testing.assert_close(got, want)


def test_a_selection_per_key_value_head_serves_the_query_heads_of_its_group():
    q, k, v = _qkv()
    g = torch.Generator().manual_seed(4)
    per_kv = torch.rand(B, HKV, L, L, generator=g) > 0.5
    got, _ = attention(q, k, v, "softmax", selection=per_kv)
    want, _ = attention(q, k, v, "softmax", attention_mask=per_kv.repeat_interleave(H // HKV, dim=1))
    torch.testing.assert_close(got, want)
    with pytest.raises(MaskError, match="key selection"):
        attention(q, k, v, "softmax", selection=per_kv[:, :1].expand(B, 3, L, L))


# ------------------------------------------------------------------------------------------------ states and refusals


def test_states_kept_across_calls_do_not_take_a_selection():
    """Linear attention's recurrent state sums every cached key and selective attention's column sums follow key
    padding x causal: a selection (a new one each step) must reach neither."""
    from hf_attnorm.hf.selective_cache import _plain_key_padding

    impl = next(p for p in PRESETS if NORMALIZERS.get(resolve_settings(p, {}).normalizer).scoreless)
    settings = resolve_settings(impl, {})
    q, k, v = _qkv(lq=1)
    heads = constant_heads(settings, H, None, D, HKV, D)
    sel = selected_keys(torch.tensor([[[0, 2]], [[1, 4]]]), L)
    plain = make_call(q, k, v, settings, heads, None, True)
    selected = make_call(q, k, v, settings, heads, None, True, selection=sel)
    assert build_state(plain) is not None and build_state(selected) is None
    plain.recurrent = selected.recurrent = build_state(make_call(q, k[:, :, :-1], v[:, :, :-1], settings, heads))
    assert recurrent_accepts(plain) is None
    assert "selects keys per query" in recurrent_accepts(selected)
    assert "selects keys per query" in _plain_key_padding(selected) and _plain_key_padding(plain) is None


def _projected(module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    shape = (*hidden_states.shape[:2], -1, module.head_dim)
    return tuple(p(hidden_states).view(shape).transpose(1, 2) for p in (module.q_proj, module.k_proj, module.v_proj))


def _interface(module):
    """transformers' attention function for the module's implementation (ALL_ATTENTION_FUNCTIONS)."""
    from transformers.models.llama import modeling_llama

    return modeling_llama.ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation,
                                                                modeling_llama.eager_attention_forward)


def _first_key(hidden_states: torch.Tensor) -> torch.Tensor:
    return torch.zeros(*hidden_states.shape[:2], 1, dtype=torch.int32)  # [B, L, k=1]: each query's first key


class _Folding(torch.nn.Module):
    """Passes ``indices`` as the DSA families do: folded into the mask for eager/sdpa, by keyword otherwise."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        q, k, v = _projected(self, hidden_states)
        topk_indices = sparse_indices = _first_key(hidden_states)
        if self.config._attn_implementation in ("eager", "sdpa"):
            sparse_indices, n = None, hidden_states.shape[1]
            index_mask = (topk_indices.new_ones((hidden_states.shape[0], n, n), dtype=torch.bool)
                          .scatter(-1, topk_indices.long(), False).unsqueeze(1))
            attention_mask = attention_mask.masked_fill(index_mask, torch.finfo(q.dtype).min)
        attention_interface = _interface(self)
        out, weights = attention_interface(self, q, k, v, attention_mask, scaling=self.scaling, indices=sparse_indices)
        return self.o_proj(out.reshape(*hidden_states.shape[:2], -1)), weights


class _Unfolding(torch.nn.Module):
    """Passes ``indices`` without showing what they mean (no eager fold)."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        q, k, v = _projected(self, hidden_states)
        attention_interface = _interface(self)
        out, weights = attention_interface(self, q, k, v, attention_mask, scaling=self.scaling,
                                           indices=_first_key(hidden_states))
        return self.o_proj(out.reshape(*hidden_states.shape[:2], -1)), weights


def _llama_passing(fold: bool):
    """A tiny Llama whose first attention module passes ``indices`` by name."""
    from conftest import tiny
    from transformers.models.llama import modeling_llama

    model = tiny("llama", "causal_lm", implementation="eager")
    mixin = _Folding if fold else _Unfolding
    module = model.model.layers[0].self_attn
    module.__class__ = type(mixin.__name__, (mixin, modeling_llama.LlamaAttention), {})
    return model


def test_a_selection_keyword_whose_meaning_the_module_does_not_show_is_refused_at_load():
    model = _llama_passing(fold=False)
    with pytest.raises(AttnormError, match=r"'indices' \(hf_attnorm reads it as .* does not fold it"):
        model.set_attn_implementation("softmax")


def test_selection_keywords_are_read_only_from_the_modules_passing_them_by_name():
    from conftest import tiny

    model = tiny("llama", "causal_lm", implementation="softmax")
    module = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 8)
    fn = forward.forward_for("softmax")
    for keyword in SELECTION_KEYWORDS:
        with pytest.raises(AttnormError, match=f"passed '{keyword}' .* through \\*\\*kwargs"):
            fn(module, q, q, q, None, **{keyword: torch.zeros(1, 3, 1, dtype=torch.int32)})
    out, _ = fn(module, q, q, q, None, indices=None)  # (None: no selection, as the families pass on dense layers)
    assert torch.isfinite(out).all()
    with pytest.raises(AttnormError, match="one key selection per call"):
        fn(module, q, q, q, None, indices=torch.zeros(1, 3, 1, dtype=torch.int32),
           block_indices=torch.zeros(1, 1, 3, 1, dtype=torch.int32))


def test_continuous_batchings_packed_route_refuses_a_selection():
    from conftest import tiny

    model = tiny("llama", "causal_lm", implementation="softmax")
    module = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 8)
    module.__dict__[cache_state.NOTE_ATTR] = cache_state.CallNote(packed=True)
    with pytest.raises(AttnormError, match=r"packed call carries 'indices' .* use generate"):
        forward.forward_for("softmax")(module, q, q, q, torch.ones(1, 1, 3, 3, dtype=torch.bool),
                                       indices=torch.zeros(1, 3, 1, dtype=torch.int32))


def test_a_module_folding_its_selection_runs_it_and_matches_eager(monkeypatch):
    model = _llama_passing(fold=True)
    x = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model(x, attention_mask=torch.ones_like(x)).logits
        model.set_attn_implementation("softmax")
        with forward.record_paths() as rec:
            ours = model(x, attention_mask=torch.ones_like(x)).logits
        assert rec.paths
        torch.testing.assert_close(ours, eager, atol=1e-5, rtol=0)
        monkeypatch.setattr(forward, "key_selection", lambda *args, **kwargs: None)
        unselected = model(x, attention_mask=torch.ones_like(x)).logits
    assert (unselected - ours).abs().max() > 1e-3
