"""Gradient checkpointing and torch.compile with every implementation (issue 8, items 3 and 4)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import model_output, tiny

from hf_attnorm.hf.forward import LAST_CALL
from hf_attnorm.registry import PRESETS

IMPLS = list(PRESETS)


def _ids(seed=0, b=2, n=12):
    return torch.randint(1, 97, (b, n), generator=torch.Generator().manual_seed(seed))


def _no_dropout(model):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family,task", [("llama", "causal_lm"), ("gpt2", "causal_lm"), ("bert", "masked_lm")])
def test_gradient_checkpointing_matches(family, task, impl):
    x = _ids()
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    grads, outs = [], []
    for ckpt in (False, True):
        model = _no_dropout(tiny(family, task, implementation=impl).train())
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        out = model_output(model(x, attention_mask=mask))
        out.float().pow(2).mean().backward()
        outs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)
    assert grads[0].keys() == grads[1].keys()
    assert any(".attnorm." in n for n in grads[0]) == any(
        ".attnorm." in n for n, _ in tiny(family, task, implementation=impl).named_parameters())
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-6, rtol=1e-5, msg=n)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_torch_compile_matches_eager_and_trains(impl):
    """fullgraph=True: no graph break anywhere (the eager call first builds the fused CPU extension, which cannot be
    built while tracing)."""
    torch._dynamo.reset()
    x = _ids(1)
    model = _no_dropout(tiny("llama", "causal_lm", implementation=impl))
    with torch.no_grad():
        eager = model(x).logits
    path = LAST_CALL.path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(model, fullgraph=True)
        with torch.no_grad():
            out = compiled(x).logits
    torch.testing.assert_close(out, eager, atol=1e-4, rtol=1e-4)
    assert LAST_CALL.path == path  # the compiled graph runs the same fast path as eager
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    loss = compiled(x, labels=x).loss
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p).all() for p in model.parameters())
