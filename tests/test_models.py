"""Every registered attention implementation on tiny random GPT-2, BERT (encoder and MLM) and Llama (GQA).

Generic over the registry: a new normalizer or scale is picked up here with no edits.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import MODEL_IDS, MODEL_KINDS, model_output, tiny

import hf_attnorm
from hf_attnorm.lab.model_zoo import is_causal_family
from hf_attnorm.registry import NORMALIZERS, PRESETS

IMPLS = list(PRESETS)
CAUSAL_KINDS = [(f, t) for f, t in MODEL_KINDS if is_causal_family(f)]
L = 13  # odd length


def _ids(seed: int, batch: int = 2, length: int = L) -> torch.Tensor:
    return torch.randint(1, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


def _pos(mask: torch.Tensor) -> torch.Tensor:
    """position ids that make padded rows start at 0 (GPT-2/BERT use absolute positions)."""
    return (mask.cumsum(-1) - 1).clamp_min(0)


@pytest.mark.parametrize("kind", MODEL_KINDS, ids=MODEL_IDS)
def test_softmax_equals_transformers_sdpa_and_eager(kind):
    model = tiny(*kind, implementation="sdpa")
    x = _ids(0)
    mask = torch.ones_like(x)
    mask[0, :4] = 0
    with torch.no_grad():
        ref = model_output(model(x, attention_mask=mask, position_ids=_pos(mask)))
        model.set_attn_implementation("eager")
        eager = model_output(model(x, attention_mask=mask, position_ids=_pos(mask)))
        model.set_attn_implementation("softmax")
        ours = model_output(model(x, attention_mask=mask, position_ids=_pos(mask)))
    live = mask.bool()
    torch.testing.assert_close(ours[live], ref[live], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours[live], eager[live], atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", MODEL_KINDS, ids=MODEL_IDS)
def test_causality_and_padding(kind, impl):
    family, _ = kind
    model = tiny(*kind, implementation=impl)
    x = _ids(1)
    with torch.no_grad():
        base = model_output(model(x))
        y = x.clone()
        y[:, 7] = (y[:, 7] % 96) + 1
        changed = model_output(model(y))
        if is_causal_family(family):
            torch.testing.assert_close(changed[:, :7], base[:, :7], atol=1e-6, rtol=0)
        assert not torch.allclose(changed[:, 7:], base[:, 7:]), "a changed token must change its own output"
        if not is_causal_family(family):
            assert not torch.allclose(changed[:, :7], base[:, :7]), "BERT attention must stay bidirectional"
        # left and right padding leave the unpadded positions unchanged
        for side in ("left", "right"):
            mask = torch.ones_like(x)
            if side == "left":
                mask[0, :5] = 0
            else:
                mask[0, -5:] = 0
            padded = model_output(model(x, attention_mask=mask, position_ids=_pos(mask)))
            live = mask[0].bool()
            alone = model_output(model(x[:1, live]))
            torch.testing.assert_close(padded[0, live], alone[0], atol=1e-5, rtol=0)
            # the unpadded row of the batch is unaffected by its neighbour's padding
            torch.testing.assert_close(padded[1], base[1], atol=1e-5, rtol=0)
            assert torch.isfinite(padded).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", CAUSAL_KINDS, ids=[f"{f}-{t}" for f, t in CAUSAL_KINDS])
def test_generation_cache_equals_no_cache_and_full_forward(kind, impl):
    model = tiny(*kind, implementation=impl)
    x = _ids(2, length=6)
    gen = dict(max_new_tokens=7, do_sample=False, output_scores=True, return_dict_in_generate=True,
               pad_token_id=0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cached = model.generate(x, use_cache=True, **gen)
        uncached = model.generate(x, use_cache=False, **gen)
        assert torch.equal(cached.sequences, uncached.sequences)
        full = model_output(model(cached.sequences))
    for step, (a, b) in enumerate(zip(cached.scores, uncached.scores)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        torch.testing.assert_close(a, full[:, x.shape[1] - 1 + step], atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_left_padded_batch_generation(impl):
    model = tiny("llama", "causal_lm", implementation=impl)
    x = _ids(3, length=7)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    gen = dict(max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = model.generate(x, attention_mask=mask, **gen)
        alone = model.generate(x[:1, 3:], **gen)
    assert torch.equal(batch.sequences[0, 7:], alone.sequences[0, 4:])
    for a, b in zip(batch.scores, alone.scores):
        torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", MODEL_KINDS, ids=MODEL_IDS)
def test_backward_and_output_attentions(kind, impl):
    model = tiny(*kind, implementation=impl).train()
    for m in model.modules():  # dropout off: the test compares shapes and gradients, not noise
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    x = _ids(4)
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    out = model_output(model(x, attention_mask=mask, position_ids=_pos(mask)))
    (out.float().pow(2).mean()).backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), name
    for name, p in model.named_parameters():
        if ".attnorm." in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, f"no gradient reaches {name}"
    model.eval()
    with torch.no_grad():
        res = model(x, attention_mask=mask, position_ids=_pos(mask), output_attentions=True)
    att = res.attentions
    assert len(att) == model.config.num_hidden_layers
    heads = model.config.num_attention_heads
    for a in att:
        assert a.shape == (2, heads, L, L)
        assert torch.isfinite(a).all()
        assert (a[1, :, :, :3] == 0).all(), "padded keys get zero weight"
    settings = hf_attnorm.resolve_settings(impl)
    if settings.options.get("num_mem_kv", 0) > 0:  # the weights cover the real keys; memory keys take the rest
        assert (att[0][0].sum(-1) <= 1 + 1e-5).all() and (att[0][0].sum(-1) < 1 - 1e-4).any()
    elif NORMALIZERS.get(settings.normalizer).row_sum == "one":
        sums = att[0][0].sum(-1)
        torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-5, rtol=0)
