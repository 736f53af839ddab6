"""Gradient checkpointing and torch.compile with every implementation."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import (
    LAST_CALL,
    first_implementations,
    has_memory,
    model_output,
    needs_compile,
    needs_compile_inductor,
    tiny,
)

from hf_attnorm.registry import NORMALIZERS, PRESETS, SCALES
from hf_attnorm.settings import resolve_settings

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


def _padded(seed=1):
    """Token ids [2, 12] and a left-padding mask (the tokenizer's output for a batch of unequal lengths)."""
    x = _ids(seed)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    return x, mask


def _family(settings) -> str:
    return NORMALIZERS.get(settings.normalizer).kernel_family


def _compile_cases(with_memory: bool, inductor_families: tuple[str, ...]) -> list:
    """(implementation, backend) of a compile test. aot_eager: Dynamo traces the whole call (fullgraph) and the aten
    graph runs as traced, so a view that only works by luck of the strides inductor picks (asentmax's einsum backward
    did) fails here instead of in a user's job; for the first implementation of each normalizer (and, with
    ``with_memory``, one with learned memory key/values): the other implementations of a normalizer only change the
    elementwise scale ops before the same code, and each scale is traced on its own by
    ``test_every_scale_traces_fullgraph_with_a_mask``. inductor (the default backend, ~45 s a case on 2 cores with a
    cold cache) for the first implementation of the kernel families named: what inductor generates code for is the
    family's torch code around its kernel (SDPA, the fused C++ op, the chunked linear scan); normalizer differences
    inside a family live in the kernels."""
    aot = first_implementations(lambda s: (s.normalizer, with_memory and has_memory(s)))
    cases = [pytest.param(impl, "aot_eager", id=f"{impl}-aot_eager") for impl in aot]
    cases += [pytest.param(impl, "inductor", id=f"{impl}-inductor", marks=needs_compile_inductor)
              for impl in first_implementations(_family) if _family(resolve_settings(impl)) in inductor_families]
    return cases


@pytest.mark.slow
@needs_compile
@pytest.mark.parametrize("scale", sorted(SCALES))
def test_every_scale_traces_fullgraph_with_a_mask(scale):
    """Each length-aware scale's multiplier traced by Dynamo (fullgraph, aot_eager) in a softmax call with a
    padding x causal mask, forward and the gradients of q, k, v and the scale's learnable values equal eager."""
    from hf_attnorm.attention import attention, constant_heads

    settings = resolve_settings("softmax", {"scale": scale})
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 9, 8, generator=g) for _ in range(3))
    mask = torch.ones(2, 1, 9, 9, dtype=torch.bool).tril()
    mask[1, :, :, :2] = False
    info = {"max_positions": 4, "head_dim": 8, "num_heads": 2}
    heads = {n: t.requires_grad_(True) for n, t in constant_heads(settings, 2, head_dim=8).items()}

    def run(fn):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        hl = {n: t.detach().clone().requires_grad_(True) for n, t in heads.items()}
        out = fn(*leaves, hl)
        out.pow(2).sum().backward()
        return [out.detach()] + [t.grad for t in leaves] + [t.grad for t in hl.values()]

    def attend(q, k, v, hl):
        return attention(q, k, v, settings, attention_mask=mask, causal=True, heads=hl, module_info=info)[0]

    torch._dynamo.reset()
    eager = run(attend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = run(torch.compile(attend, fullgraph=True, backend="aot_eager"))
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=scale)


@pytest.mark.slow
@needs_compile
@pytest.mark.parametrize("impl, backend", _compile_cases(True, ("softmax", "fused", "linear")))
def test_torch_compile_with_padding_mask_matches_eager_and_trains(impl, backend):
    """fullgraph=True with an attention mask: no data-dependent branch or host sync anywhere in the call (the eager
    call first builds the fused CPU extension, which cannot be built while tracing); a training step on the
    left-padded batch as a data collator gives it (position_ids from 0 after the padding, labels -100 on it)."""
    torch._dynamo.reset()
    x, mask = _padded()
    model = _no_dropout(tiny("llama", "causal_lm", implementation=impl))
    LAST_CALL.path = ""
    with torch.no_grad():
        eager = model(x, attention_mask=mask).logits
    path = LAST_CALL.path
    assert path, "the eager call did not go through hf_attnorm"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        LAST_CALL.path = ""  # so the check below sees what the compiled graph ran, not what eager left
        with torch.no_grad():
            out = compiled(x, attention_mask=mask).logits
    live = mask.bool()
    torch.testing.assert_close(out[live], eager[live], atol=1e-4, rtol=1e-4)
    if NORMALIZERS.get(resolve_settings(impl).normalizer).kernel_family == "linear":
        # a 4-D mask over several queries cannot be analysed while tracing (MaskInfo.padding reads it on the host
        # in eager mode): the compiled graph takes the exact chunked path, or the reference with a backward pass
        # (docs/kernels.md)
        path = "chunked"
    assert LAST_CALL.path == path  # the compiled graph runs the same fast path as eager
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    labels = x.masked_fill(mask == 0, -100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = compiled(x, attention_mask=mask, position_ids=position_ids, labels=labels).loss
        loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.slow
@needs_compile
@pytest.mark.parametrize("impl, backend", _compile_cases(False, ("fused", "stickbreaking")))
def test_static_cache_generation_compiles_and_matches_eager(impl, backend):
    """model.forward compiled with fullgraph=True generates the same tokens as eager with a static cache and a
    padding mask (prefill with a 4-D mask, then one-query decode steps)."""
    if NORMALIZERS.get(resolve_settings(impl).normalizer).query_coupled:
        # its cached steps need the column sums kept on a DynamicCache layer (hf/selective_cache.py): static caches
        # and torch.compile are refused with an error (tests/test_selective_decode.py checks it)
        pytest.skip("a normalizer coupling the queries decodes from a DynamicCache only, not a compiled static one")
    torch._dynamo.reset()
    x, mask = _padded(2)
    model = tiny("llama", "causal_lm", implementation=impl)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        eager = model.generate(x, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.forward = torch.compile(model.forward, fullgraph=True, backend=backend)
        LAST_CALL.path = ""
        with torch.no_grad():
            compiled = model.generate(x, **kw)
    assert LAST_CALL.path, "the compiled generation did not go through hf_attnorm"
    assert torch.equal(compiled, eager)
