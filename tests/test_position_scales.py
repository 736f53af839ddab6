"""The position-dependent scales and LSSA's length scale: YaRN's temperature (refused where the model applies it),
the position-based Llama-4 scale as Ministral 3 applies it (compared with the model's own), log_train_n."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import LAST_CALL
from transformers import LlamaConfig, LlamaForCausalLM, Ministral3Config, Ministral3ForCausalLM

import hf_attnorm  # noqa: F401  (registers the implementations)
from hf_attnorm.attention import attention
from hf_attnorm.registry import AttnormError
from hf_attnorm.settings import resolve_settings

B, H, D = 2, 2, 8


def _qkv(lq: int, lk: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, lq, D, generator=g, dtype=torch.float64),
            torch.randn(B, H, lk, D, generator=g, dtype=torch.float64),
            torch.randn(B, H, lk, D, generator=g, dtype=torch.float64))


def _softmax_with_row_factor(q, k, v, factor: torch.Tensor, causal: bool) -> torch.Tensor:
    """softmax(q.k / sqrt(D) x factor[i]) v by hand; factor: [Lq]."""
    s = (q @ k.transpose(-1, -2)) / math.sqrt(D) * factor.view(1, 1, -1, 1)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


# ---------------------------------------------------------------------------------------------------------- yarn

def test_yarn_fixed_factor_is_the_squared_mscale():
    q, k, v = _qkv(9, 9)
    s = 8.0
    out, _ = attention(q, k, v, "yarn", causal=True, yarn_factor=s)
    m = 0.1 * math.log(s) + 1.0
    want = _softmax_with_row_factor(q, k, v, torch.full((9,), m * m, dtype=torch.float64), True)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)  # (scale factors are fp32)


def test_yarn_dynamic_factor_is_neutral_inside_the_training_length():
    q, k, v = _qkv(20, 20, seed=1)
    train = 6
    out, _ = attention(q, k, v, "yarn", causal=True, train_length=train)
    n = torch.arange(1, 21, dtype=torch.float64)
    m = torch.where(n > train, 0.1 * torch.log(n / train) + 1.0, torch.ones_like(n))
    torch.testing.assert_close(out, _softmax_with_row_factor(q, k, v, m * m, True), atol=1e-6, rtol=1e-6)
    plain, _ = attention(q[:, :, :train], k[:, :, :train], v[:, :, :train], "softmax", causal=True)
    torch.testing.assert_close(out[:, :, :train], plain, atol=1e-12, rtol=0)


def test_yarn_option_validation():
    with pytest.raises(AttnormError, match=r"yarn_factor.*must be >= 1"):
        resolve_settings("yarn", {"yarn_factor": 0.5})


def _llama(rope: dict | None, impl: str, seed: int = 0, **attnorm) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                      rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0})
    if attnorm:
        cfg.attnorm = attnorm
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LlamaForCausalLM._from_config(cfg, attn_implementation=impl).eval()


YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4}


def test_yarn_refused_on_a_yarn_rope_model_and_accepted_without():
    with pytest.raises(ValueError, match="twice.*rope_type 'yarn'"):
        _llama(YARN_ROPE, "yarn", yarn_factor=4.0)
    model = _llama(None, "sdpa")
    with pytest.raises(ValueError, match="twice"):
        _llama(YARN_ROPE, "sdpa").set_attn_implementation("yarn")
    model.set_attn_implementation("yarn")  # no yarn rope: accepted
    assert model.config.attnorm["scale"] == "yarn"


def test_yarn_scale_equals_transformers_yarn_temperature():
    """A yarn-rope model whose temperature is switched off (attention_factor 1) plus our yarn scale equals the same
    model with transformers' own temperature (0.1 ln 4 + 1 on cos/sin, so squared on the scores)."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    theirs = _llama(YARN_ROPE, "sdpa")
    ours = _llama({**YARN_ROPE, "attention_factor": 1.0}, "yarn", yarn_factor=4.0)
    LAST_CALL.path = None
    with torch.no_grad():
        a, b = theirs(ids).logits, ours(ids).logits
    assert LAST_CALL.path == "sdpa"
    torch.testing.assert_close(b, a, atol=2e-6, rtol=0)
    plain = _llama({**YARN_ROPE, "attention_factor": 1.0}, "sdpa")
    with torch.no_grad():
        assert (plain(ids).logits - a).abs().max() > 1e-4  # the temperature matters here (50x the tolerance)


# ---------------------------------------------------------------------------------------------------- llama4_pos

def test_llama4_pos_by_hand_prefill_and_decode():
    orig, beta = 4, 0.1
    q, k, v = _qkv(11, 11, seed=2)
    out, _ = attention(q, k, v, "llama4_pos", causal=True, train_length=orig)
    pos = torch.arange(11, dtype=torch.float64)
    scale = 1 + beta * torch.log(1 + torch.floor(pos / orig))
    torch.testing.assert_close(out, _softmax_with_row_factor(q, k, v, scale, True), atol=1e-6, rtol=1e-6)
    # a cache decode step: one query at position Lk - 1 = 10
    dec, _ = attention(q[:, :, -1:], k, v, "llama4_pos", train_length=orig)
    torch.testing.assert_close(dec, out[:, :, -1:], atol=1e-12, rtol=0)
    # differs from the n-based llama4 with the same constants: n = pos + 1 crosses the floor one query earlier
    n_based, _ = attention(q, k, v, "llama4", causal=True, llama4_floor_scale=float(orig))
    assert not torch.allclose(n_based[:, :, 3], out[:, :, 3])
    torch.testing.assert_close(n_based[:, :, 4:7], out[:, :, 4:7], atol=1e-12, rtol=0)


def _ministral(beta: float, impl: str) -> Ministral3ForCausalLM:
    cfg = Ministral3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                           pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                            "original_max_position_embeddings": 4,
                                                            "llama_4_scaling_beta": beta})
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Ministral3ForCausalLM._from_config(cfg, attn_implementation=impl).eval()


def test_llama4_pos_equals_ministral3_own_scale():
    """Ministral 3 with llama_4_scaling_beta 0.1 (applied by the model, original_max_position_embeddings 4) equals
    the same weights with beta 0 plus our llama4_pos scale (L_orig read from the config): prefill and cached
    greedy decoding."""
    ids = torch.randint(1, 64, (2, 13), generator=torch.Generator().manual_seed(1))
    theirs, ours = _ministral(0.1, "sdpa"), _ministral(0.0, "llama4_pos")
    LAST_CALL.path = None
    with torch.no_grad():
        a, b = theirs(ids).logits, ours(ids).logits
    assert LAST_CALL.path == "sdpa"
    torch.testing.assert_close(b, a, atol=2e-6, rtol=0)
    with torch.no_grad():
        ga = theirs.generate(ids[:, :5], max_new_tokens=10, do_sample=False)
        gb = ours.generate(ids[:, :5], max_new_tokens=10, do_sample=False)
    assert torch.equal(ga, gb)
    with torch.no_grad():
        assert (_ministral(0.0, "sdpa")(ids).logits - a).abs().max() > 1e-4  # the scale matters (50x the tolerance)


def test_llama4_pos_refused_where_the_model_applies_it():
    with pytest.raises(ValueError, match="llama_4_scaling_beta"):
        _ministral(0.1, "llama4_pos")


# --------------------------------------------------------------------------------------------------- log_train_n

def test_log_train_n_is_log_base_train_length():
    q, k, v = _qkv(10, 10, seed=3)
    out, _ = attention(q, k, v, "log_train_n", causal=True, train_length=5)
    n = torch.arange(1, 11, dtype=torch.float64)
    torch.testing.assert_close(out, _softmax_with_row_factor(q, k, v, torch.log(n) / math.log(5), True),
                               atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="train_length"):
        attention(q, k, v, "log_train_n", causal=True)  # no option and no model: no silent default
