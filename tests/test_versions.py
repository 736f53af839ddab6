"""What must hold on every supported transformers version: CI runs this file in a second environment with the lowest
supported transformers (``hf_attnorm.hf.compat.MIN_TRANSFORMERS``) beside the main one (the newest tested).

Registration, softmax == sdpa on GPT-2, BERT and Llama with padding, a learnable value on every family's modules at
build time, a fast path taken from a model, save/reload exact; and, simulated on the installed version, an
unsupported transformers: ``import hf_attnorm`` leaves sdpa/eager models untouched and refuses our names clearly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import model_output, tiny

from hf_attnorm.hf import compat, integration
from hf_attnorm.registry import PRESETS

REPO = Path(__file__).resolve().parent.parent
KINDS = [("gpt2", "causal_lm"), ("bert", "masked_lm"), ("llama", "causal_lm")]


def _ids(seed: int = 0, batch: int = 2, length: int = 11) -> torch.Tensor:
    return torch.randint(1, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_installed_transformers_is_supported_and_every_name_is_registered():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert compat.unsupported_reason() is None
    # (continuous batching's name checks only where every name it relies on exists; refused elsewhere)
    cb = set() if compat.continuous_batching_missing() else {compat.CONTINUOUS_BATCHING_SWITCH[1],
                                                              compat.CONTINUOUS_BATCHING_MASKS[1],
                                                              compat.CONTINUOUS_BATCHING_THREAD[1]}
    assert integration.HOOKED == {"_check_and_adjust_attn_implementation", "post_init", "set_attn_implementation",
                                  "_initialize_weights", "from_pretrained", "save_pretrained",
                                  compat.CONTINUOUS_BATCHING_ENTRY[1], *cb}
    for name in PRESETS:
        assert name in AttentionInterface._global_mapping and name in AttentionMaskInterface._global_mapping, name
    assert compat.unsupported_reason("5.3.0") and compat.unsupported_reason("4.57.6")
    assert compat.unsupported_reason(compat.MIN_TRANSFORMERS) is None
    assert compat.unsupported_reason("99.0") is None  # no upper cap


@pytest.mark.parametrize("kind", KINDS, ids=[f for f, _ in KINDS])
def test_softmax_equals_sdpa_with_padding_and_values_exist_at_build_time(kind):
    model = tiny(*kind, implementation="sdpa")
    x = _ids()
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        ref = model_output(model(x, attention_mask=mask, position_ids=pos))
        model.set_attn_implementation("softmax")
        ours = model_output(model(x, attention_mask=mask, position_ids=pos))
    live = mask.bool()
    torch.testing.assert_close(ours[live], ref[live], atol=1e-5, rtol=0)
    # the learnable per-head values of every layer exist before any forward (an optimizer built now trains them)
    ssmax = tiny(*kind, implementation="ssmax")
    names = [n for n, _ in ssmax.named_parameters() if n.endswith(".attnorm.ssmax_s")]
    assert len(names) == ssmax.config.num_hidden_layers, names


def test_a_fast_path_runs_inside_a_model():
    from conftest import LAST_CALL

    model = tiny("llama", "causal_lm", implementation="softmax1")
    LAST_CALL.path = ""
    with torch.no_grad():
        model(_ids())
    assert LAST_CALL.path not in ("", "reference"), LAST_CALL.path


def test_save_and_reload_is_exact(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny("llama", "causal_lm", implementation="symax", attnorm={"eta_learnable": True})
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".attnorm." in n:
                p.uniform_(0.2, 2.0)
        ref = model(_ids()).logits
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config._attn_implementation == "symax"
    with torch.no_grad():
        assert torch.equal(again(_ids()).logits, ref)


#: run in a fresh interpreter that reports transformers 5.2.0 (the real 5.2.0 and 4.57.6 were checked by hand,
#: see docs/internals.md: their private method signatures differ, which is why nothing private may be hooked there)
_OLD = textwrap.dedent('''
    import inspect, transformers, torch
    from transformers import PreTrainedModel
    transformers.__version__ = "5.2.0"
    hooked = {k: inspect.getattr_static(PreTrainedModel, k) for k in (
        "_check_and_adjust_attn_implementation", "post_init", "set_attn_implementation", "_initialize_weights",
        "save_pretrained", "from_pretrained")}
    import hf_attnorm
    from hf_attnorm import AttnormError
    from hf_attnorm.lab.model_zoo import build_model
    untouched = [k for k, v in hooked.items() if inspect.getattr_static(PreTrainedModel, k) is v]
    print("UNTOUCHED", sorted(untouched))
    x = torch.randint(0, 97, (1, 7))
    for family in ("gpt2", "llama", "bert"):
        for impl in ("sdpa", "eager"):
            m = build_model(family, "micro", vocab_size=97, attn_implementation=impl).eval()
            m(x)
            assert not [n for n, _ in m.named_parameters() if ".attnorm." in n]
    print("PLAIN OK")
    try:
        build_model("llama", "micro", vocab_size=97, attn_implementation="symax")
    except AttnormError as e:
        print("REFUSED", e)
''')


def test_unsupported_transformers_leaves_other_models_alone_and_refuses_ours():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _OLD], env=env, cwd=str(REPO), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "UNTOUCHED ['_check_and_adjust_attn_implementation', '_initialize_weights', 'from_pretrained', " \
           "'save_pretrained', 'set_attn_implementation']" in out, out
    assert "PLAIN OK" in out
    assert f"REFUSED attention implementation 'symax': hf_attnorm needs transformers >= {compat.MIN_TRANSFORMERS}" \
        in out, out


def test_ci_runs_every_version_it_claims():
    """hf_attnorm.supported (what the README states as tested) is what .ci/run installs: the README's command in the
    main environment, then every entry of CI_ENVIRONMENTS in its order, pinned by supported.py itself, each running
    its groups of tests; the floors agree with pyproject.toml, and docs/triton.md records the GPU image's versions
    that CI rehearses."""
    import re

    from hf_attnorm import supported

    ci = (REPO / ".ci" / "run").read_text()
    assert "ENVS=$(python3 hf_attnorm/supported.py names)" in ci
    assert 'python3 hf_attnorm/supported.py base-requirements "$env"' in ci  # the shared torch installs
    assert 'python3 hf_attnorm/supported.py requirements "$env"' in ci  # each environment's transformers
    assert 'for group in $(python3 hf_attnorm/supported.py runs "$env")' in ci
    assert '[ "$group" = torch ]' in ci
    assert 'pip install torch==2.13.0 && pip install -e ".[dev]"' in ci and supported.MAIN_TORCH == "2.13.0"
    names = subprocess.run([sys.executable, str(REPO / "hf_attnorm" / "supported.py"), "names"], capture_output=True,
                           text=True, check=True).stdout.split()
    assert names == list(supported.CI_ENVIRONMENTS)
    assert {g for *_, groups in supported.CI_ENVIRONMENTS.values() for g in groups} == set(supported.CI_GROUPS)
    for group in supported.CI_GROUPS:  # every group runs on the lowest torch and on the newest
        torches = [p["torch"] for p, _, groups in supported.CI_ENVIRONMENTS.values() if group in groups]
        assert supported.CI_TORCH[0] in torches and supported.CI_TORCH[-1] in torches, group
    pins = {name: dict(p) for name, (p, *_) in supported.CI_ENVIRONMENTS.items()}
    assert (pins["floor"]["torch"], pins["floor"]["transformers"]) == (supported.MIN_TORCH, supported.MIN_TRANSFORMERS)
    assert "transformers" in supported.runs("floor")
    assert supported.CI_VERSIONS[0] == compat.MIN_TRANSFORMERS == supported.MIN_TRANSFORMERS
    assert supported.CI_TORCH[0] == supported.MIN_TORCH
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"transformers>={compat.MIN_TRANSFORMERS}"' in pyproject
    floor = re.search(r'"torch>=([0-9.]+)"', pyproject)
    assert floor and supported.release(floor.group(1)) == supported.release(supported.MIN_TORCH)
    triton = re.search(r'"triton>=([0-9.]+);', pyproject)  # the dev extra admits the triton the lowest torch pins
    assert triton and supported.release(triton.group(1)) == supported.release(supported.MIN_TRITON)
    assert pins["floor"]["triton"] == supported.MIN_TRITON and "torch" in supported.runs("floor")
    image = pins["gpu-image"]
    triton_doc = (REPO / "docs" / "triton.md").read_text()
    for name in ("torch", "triton", "transformers"):
        assert f"{name} {image[name]}" in triton_doc, f"docs/triton.md does not record the GPU image's {name}"
    assert supported.requirements("floor")[0] == f"torch=={supported.MIN_TORCH}"


def test_ci_environments_with_one_torch_share_one_virtual_environment():
    """A CUDA torch is several GB and minutes to install: .ci/run installs each distinct torch/triton/numpy once."""
    from hf_attnorm import supported

    by_venv: dict[str, set[tuple[str, ...]]] = {}
    for env in supported.CI_ENVIRONMENTS:
        by_venv.setdefault(supported.venv(env), set()).add(tuple(supported.base_requirements(env)))
        assert not any(r.startswith("transformers") for r in supported.base_requirements(env))
    assert all(len(bases) == 1 for bases in by_venv.values())  # one venv holds one torch/triton/numpy
    assert len(by_venv) == len({next(iter(bases)) for bases in by_venv.values()})  # and each torch gets one venv
    assert supported.venv("floor") != supported.venv("gpu-image")  # the floor is older than the GPU image's torch
    for command in (supported.venv, supported.runs, supported.requirements):
        with pytest.raises(SystemExit, match="unknown CI environment 'nope'; known: gpu-image"):
            command("nope")


def test_an_unsupported_torch_is_named_with_what_is_allowed():
    from hf_attnorm import supported

    assert supported.torch_problem(supported.MIN_TORCH) is None
    assert supported.torch_problem("2.99.0+cu130") is None
    below = supported.torch_problem("2.5.1+cu124")
    assert below.startswith(f"hf_attnorm needs torch >= {supported.MIN_TORCH}") and "2.5.1" in below

