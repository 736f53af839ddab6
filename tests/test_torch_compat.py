"""The features that need a newer torch than the lowest supported one (hf_attnorm.torch_compat.TORCH_FEATURES): each
names itself and the torch it needs in its message, and below that torch does what it declares (refused with that
message, or an exact fallback with it as one warning). On the installed torch where it has the feature, the older
torch's code path is forced by setting the flag its caller reads."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_attnorm import supported, torch_compat
from hf_attnorm.attention import attention
from hf_attnorm.kernels import sdpa_rewrite
from hf_attnorm.torch_compat import COMPILE_FEATURE, FLASH_CPU_GQA_FEATURE, TORCH_FEATURES


@pytest.mark.parametrize("feature", TORCH_FEATURES, ids=lambda f: f.since + "-" + f.name.split()[0])
def test_every_feature_names_itself_and_the_torch_it_needs(feature, monkeypatch):
    assert supported.release(feature.since) > supported.release(supported.MIN_TORCH), "the floor needs no gate"
    assert bool(feature.fallback) != bool(feature.remedy), "an older torch gets a fallback or a remedy, not both"
    message = feature.message("2.6.0+cu124")
    first = f"{feature.name} needs torch >= {feature.since}; this is torch 2.6.0+cu124"
    assert message.startswith(("hf_attnorm: " if feature.fallback else "") + first), message
    assert (feature.fallback or feature.remedy) in message and feature.older in message
    # read from the installed torch at call time
    monkeypatch.setattr(torch, "__version__", "2.6.0+cu124")
    assert not feature.available and feature.problem() == message
    monkeypatch.setattr(torch, "__version__", feature.since + "+cpu")
    assert feature.available and feature.problem() is None


def test_compile_problem_is_the_compile_feature(monkeypatch):
    """The compile tests skip with this reason below the torch torch.compile needs (conftest.needs_compile)."""
    major, minor, _ = supported.release(COMPILE_FEATURE.since)
    monkeypatch.setattr(torch, "__version__", f"{major}.{minor - 1}.0")
    assert torch_compat.compile_problem() == COMPILE_FEATURE.message()
    assert torch_compat.compile_problem().startswith(
        f"torch.compile of models with hf_attnorm attention needs torch >= {torch_compat.COMPILE_TORCH}")


def _gqa_call(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 7, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 7, 8, generator=g, requires_grad=True) for _ in range(2))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0  # left padding: a mask goes to the flash kernel itself (not plain SDPA)
    return q, k, v, mask


def _run(path: str):
    q, k, v, mask = _gqa_call()
    out, _ = attention(q, k, v, "softmax", attention_mask=mask, causal=True, path=path)
    out.pow(2).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("flash_gqa", [True, False], ids=["kernel-gqa", "older-torch-repeat"])
def test_gqa_on_the_cpu_flash_kernel_is_exact_and_the_fallback_warns_once(flash_gqa, monkeypatch):
    monkeypatch.setattr(sdpa_rewrite, "FLASH_CPU_GQA", flash_gqa)
    monkeypatch.setattr(torch_compat, "_WARNED", set())
    flash_calls = []
    monkeypatch.setattr(sdpa_rewrite, "_FLASH", lambda *a, **kw: flash_calls.append(a[1].shape[1]) or
                        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*a, **kw))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _run("sdpa")
        again = _run("sdpa")
    want = _run("reference")
    for a, b, c in zip(got, again, want):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)
        assert torch.equal(a, b)
    # the kernel ran, with 2 key/value heads where it takes them and 4 (repeated) where it cannot
    assert flash_calls and set(flash_calls) == {2 if flash_gqa else 4}, flash_calls
    said = [str(w.message) for w in caught if "hf_attnorm:" in str(w.message) and "flash" in str(w.message)]
    assert said == ([] if flash_gqa else [FLASH_CPU_GQA_FEATURE.message()]), said
