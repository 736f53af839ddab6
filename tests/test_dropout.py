"""Attention dropout, seen from a model and from every path: a model configured with attention dropout applies it
in training (outputs vary with the seed, the expected fraction of weights is dropped, survivors scaled by
1 / (1 - p)) and never in eval; every kernel path either applies it at the rate or refuses it when forced, and
the automatic rule never picks a path that would drop nothing."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import LAST_CALL
from transformers import LlamaForCausalLM

from hf_attnorm.attention import attention, constant_heads
from hf_attnorm.kernels import PATHS, paths_for
from hf_attnorm.kernels.dispatch import _WARNED_DROPOUT
from hf_attnorm.lab.model_zoo import make_config
from hf_attnorm.registry import NORMALIZERS, PRESETS
from hf_attnorm.settings import resolve_settings

IMPLS = list(PRESETS)
#: a high rate: sharp statistics with few weights
P = 0.5


def _model(impl: str, p: float) -> LlamaForCausalLM:
    """A tiny Llama whose config asks for attention dropout ``p`` (the modules read it at construction)."""
    config = make_config("llama", "micro", vocab_size=97, max_positions=64)
    config.attention_dropout = p
    config._attn_implementation = impl
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _batch(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(1, 97, (2, n), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(x)
    mask[0, :4] = 0  # left padding
    return x, mask


def _logits(model, x, mask, seed: int | None = None) -> torch.Tensor:
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return model(x, attention_mask=mask).logits[mask.bool()]


def _check_dropped(dropped: torch.Tensor, full: torch.Tensor, p: float, what: str) -> None:
    """``dropped``: weights after dropout, ``full``: the same weights without; among the positive ones a fraction
    ~p must be exactly 0 and the rest equal full / (1 - p)."""
    pos = full > 1e-6
    n = int(pos.sum())
    assert n >= 100, f"{what}: only {n} positive weights, too few to test the rate"
    zero = dropped[pos] == 0
    rate = zero.float().mean().item()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(rate - p) < 5 * sigma + 1e-3, f"{what}: dropped {rate:.3f} of {n} weights, expected {p}"
    torch.testing.assert_close(dropped[pos][~zero], full[pos][~zero] / (1 - p), rtol=1e-4, atol=1e-6, msg=what)


@pytest.mark.parametrize("impl", IMPLS)
def test_model_applies_attention_dropout_in_training_only(impl):
    x, mask = _batch()
    model = _model(impl, P)
    plain = _model(impl, 0.0)  # same weights, no dropout
    plain.train()
    LAST_CALL.path = ""
    _logits(plain, x, mask, seed=1)
    fast = LAST_CALL.path  # the path a training forward takes without dropout
    model.train()
    LAST_CALL.path = ""
    _WARNED_DROPOUT.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = _logits(model, x, mask, seed=1)
    assert LAST_CALL.path, "the forward did not go through hf_attnorm"
    said = [str(w.message) for w in caught if "attention dropout" in str(w.message)]
    if LAST_CALL.path != fast:  # dropout moved it to another path: visibly
        assert any(repr(fast) in m and repr(LAST_CALL.path) in m for m in said), (fast, LAST_CALL.path, said)
    else:
        assert not said, said
    b = _logits(model, x, mask, seed=1)
    c = _logits(model, x, mask, seed=2)
    torch.testing.assert_close(a, b, atol=0, rtol=0)  # the seed decides the dropout mask
    assert (a - c).abs().max() > 1e-3, f"{impl}: training outputs do not depend on the seed (no dropout applied)"
    assert (a - _logits(plain, x, mask, seed=1)).abs().max() > 1e-3, f"{impl}: dropout {P} changed nothing"
    model.eval()
    plain.eval()
    e1, e2 = _logits(model, x, mask, seed=1), _logits(model, x, mask, seed=2)
    torch.testing.assert_close(e1, e2, atol=0, rtol=0)
    torch.testing.assert_close(e1, _logits(plain, x, mask), atol=0, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_model_drops_the_configured_fraction_of_weights(impl):
    """The weights a training forward used (``output_attentions``): in the first layer (same input as in eval) a
    fraction ~p of the eval weights is 0, the rest scaled by 1 / (1 - p)."""
    x, mask = _batch(24)
    model = _model(impl, P)
    with torch.no_grad():
        full = model.eval()(x, attention_mask=mask, output_attentions=True).attentions[0]
        torch.manual_seed(5)
        dropped = model.train()(x, attention_mask=mask, output_attentions=True).attentions[0]
    assert LAST_CALL.path == "reference"
    _check_dropped(dropped.float(), full.float(), P, impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_every_path_applies_dropout_at_the_rate_or_refuses(impl):
    """Per path that takes the normalizer, forced: with v = identity the output rows are the weights after
    dropout. A path that cannot apply dropout must refuse when forced (and is then never chosen automatically)."""
    settings = resolve_settings(impl)
    B, H, L = 2, 4, 24
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, H, L, L, generator=g), torch.randn(B, H, L, L, generator=g)
    v = torch.eye(L).expand(B, H, L, L)
    heads = constant_heads(settings, H, head_dim=L, kv_heads=H)
    heads = {n: (torch.zeros_like(t) if n == "mem_v" else t) for n, t in heads.items()}  # memory adds nothing
    kw = dict(causal=True, heads=heads, module_info={"max_positions": 64})  # (length-aware scales read it)
    # a differential normalizer's output is normalised per row, so its weights are read instead (reference only)
    weights = NORMALIZERS.get(settings.normalizer).differential
    full = attention(q, k, v, settings, path="reference", need_weights=weights, **kw)[weights]
    ran = []
    for path in dict.fromkeys([*paths_for(settings.normalizer), "reference"]):
        try:
            torch.manual_seed(7)
            dropped = attention(q, k, v, settings, dropout=P, path=path, need_weights=weights and path == "reference",
                                **kw)[weights]
        except ValueError as e:
            if "dropout" not in str(e):
                continue  # this call's shape, dtype or device, not dropout (other tests cover those)
            with pytest.raises(ValueError, match="dropout"):
                attention(q, k, v, settings, dropout=P, **kw, path=path)
            continue
        _check_dropped(dropped, full, P, f"{impl} on path {path}")
        ran.append(path)
    assert ran, f"{impl}: no path applies dropout"
    torch.manual_seed(7)
    auto = attention(q, k, v, settings, dropout=P, need_weights=weights, **kw)[weights]  # the automatic choice too
    _check_dropped(auto, full, P, f"{impl}, automatic path")
    assert set(PATHS) >= set(ran)
