"""Real pretrained models from the offline assets: SmolLM2-135M (Llama, GQA 9/3) and all-MiniLM-L6-v2 (BERT).

softmax with the standard scale equals transformers' sdpa; swapped normalizers save and restore exactly.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_attnorm.lab import assets

PASSAGE = (
    "HAMLET: To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer "
    "The slings and arrows of outrageous fortune, Or to take arms against a sea of troubles, "
    "And by opposing end them. To die: to sleep; No more; and by a sleep to say we end "
    "The heart-ache and the thousand natural shocks That flesh is heir to."
)


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = assets.smollm2_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    return path, tok, model


@pytest.fixture(scope="module")
def minilm():
    from transformers import AutoModel, AutoTokenizer

    path = assets.minilm_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    return path, tok, model


def test_smollm2_softmax_equals_sdpa(smollm2):
    path, tok, model = smollm2
    assert model.config.num_attention_heads == 9 and model.config.num_key_value_heads == 3
    batch = tok([PASSAGE, PASSAGE[:120]], return_tensors="pt", padding=True)
    with torch.no_grad():
        ref = model(**batch).logits
        model.set_attn_implementation("softmax")
        ours = model(**batch).logits
        model.set_attn_implementation("sdpa")
    live = batch["attention_mask"].bool()
    torch.testing.assert_close(ours[live], ref[live], atol=1e-4, rtol=0)


def test_minilm_softmax_equals_sdpa(minilm):
    path, tok, model = minilm
    batch = tok([PASSAGE, "A short sentence."], return_tensors="pt", padding=True)
    with torch.no_grad():
        ref = model(**batch).last_hidden_state
        model.set_attn_implementation("softmax")
        ours = model(**batch).last_hidden_state
        model.set_attn_implementation("sdpa")
    live = batch["attention_mask"].bool()
    torch.testing.assert_close(ours[live], ref[live], atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl,opts", [("ssmax", {}), ("symax", {"eta_learnable": True})])
def test_smollm2_swap_save_restore(smollm2, impl, opts, tmp_path):
    from transformers import AutoModelForCausalLM

    path, tok, _ = smollm2
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, attnorm=opts)
    learn = [p for n, p in model.named_parameters() if ".attnorm." in n]
    assert len(learn) == model.config.num_hidden_layers
    batch = tok(PASSAGE, return_tensors="pt")
    opt = torch.optim.SGD(learn, lr=1e-2)  # surgery fine-tune of the new parameters only: a real step
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in learn)
    opt.step()
    model.eval()
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        before = model(**batch).logits
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert again.config._attn_implementation == impl
    with torch.no_grad():
        after = again.eval()(**batch).logits
    assert torch.equal(before, after)


def test_minilm_swap_save_restore(minilm, tmp_path):
    from transformers import AutoModel

    path, tok, _ = minilm
    model = AutoModel.from_pretrained(path, attn_implementation="sink").eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("sink_logit"):
                p.uniform_(-1, 1)
    batch = tok([PASSAGE, "A short sentence."], return_tensors="pt", padding=True)
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        before = model(**batch).last_hidden_state
    again = AutoModel.from_pretrained(tmp_path).eval()
    assert again.config._attn_implementation == "sink"
    with torch.no_grad():
        after = again(**batch).last_hidden_state
    assert torch.equal(before, after)
