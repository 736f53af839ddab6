"""Learnable normalizer parameters: created on load, trained, saved, restored exactly; corrupted checkpoints fail.

Generic over the registry: every preset that has (or can have) learnable per-head values is covered.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import MODEL_IDS, MODEL_KINDS, model_output, tiny

import hf_attnorm
from hf_attnorm.attention import param_specs
from hf_attnorm.hf.persistence import CHECKSUM_FILE, CheckpointError, verify_checkpoint
from hf_attnorm.registry import PRESETS, AttnormError, saved_name
from hf_attnorm.settings import OPTIONS, resolve_settings

ROOT = Path(__file__).resolve().parents[1]


def _learnable_variants() -> list[tuple[str, dict]]:
    """(implementation, options) for every preset, with every '*_learnable' option it has switched on; kept when
    that yields at least one learnable parameter."""
    out = []
    for name in PRESETS:
        base = resolve_settings(name)
        opts = {k: True for k in base.options if k.endswith("_learnable") and OPTIONS.get(k).kind is bool}
        settings = resolve_settings(name, opts)
        if any(spec.is_learnable(settings) for spec in param_specs(settings)):
            out.append((name, opts))
    return out


VARIANTS = _learnable_variants()
VARIANT_IDS = [n for n, _ in VARIANTS]


def _auto_class(family: str, task: str):
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

    return {"causal_lm": AutoModelForCausalLM, "masked_lm": AutoModelForMaskedLM, "encoder": AutoModel}[task]


def _ids(seed=0, b=2, n=11):
    return torch.randint(1, 97, (b, n), generator=torch.Generator().manual_seed(seed))


def test_variants_cover_every_learnable_spec():
    names = {spec.name for impl, opts in VARIANTS for spec in param_specs(resolve_settings(impl, opts))}
    assert {"sink_logit", "ssmax_s", "symax_eta", "sigmoid_bias", "cosine_temperature"} <= names


@pytest.fixture(scope="module")
def roundtrip_cases(tmp_path_factory) -> Path:
    """A folder of trained checkpoints, one per (model kind, variant), for the fresh-process reload: each test that
    trains one adds it; the reload test trains those still missing, so neither test depends on the other's order."""
    return tmp_path_factory.mktemp("roundtrip")


def _train_and_save(kind, impl: str, opts: dict, work: Path, cases: Path) -> None:
    """Load a plain checkpoint with the implementation, check its learnable values, train them 3 steps, save, check
    config and metadata, and leave the checkpoint with its inputs, logits and values in ``cases``."""
    family, task = kind
    auto = _auto_class(family, task)
    plain = tiny(family, task, implementation="sdpa")
    plain.save_pretrained(work / "plain")

    # 1. plain checkpoint + attn_implementation + attnorm: parameters exist at once, named, initialised
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = auto.from_pretrained(work / "plain", attn_implementation=impl, attnorm=opts,
                                           output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    settings = resolve_settings(impl, opts)
    learn = {n: p for n, p in model.named_parameters() if ".attnorm." in n}
    expected_names = {spec.name for spec in param_specs(settings) if spec.is_learnable(settings)}
    assert {n.rsplit(".", 1)[1] for n in learn} == expected_names
    assert len(learn) == len(expected_names) * model.config.num_hidden_layers
    for n, p in learn.items():
        owner, name = n.rsplit(".", 1)
        assert torch.equal(p.detach(), model.get_submodule(owner).initial(name)), n

    # 2. an optimizer built right after loading trains them; the gradient reaches every one
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    x = _ids()
    for _ in range(3):
        out = model_output(model(x))
        loss = out.float().pow(2).mean()
        loss.backward()
        for n, p in learn.items():
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        opt.step()
        opt.zero_grad()
    for n, p in learn.items():
        owner, name = n.rsplit(".", 1)
        assert not torch.equal(p.detach(), model.get_submodule(owner).initial(name)), f"{n} did not train"
    model.eval()
    model.save_pretrained(work / "trained")
    with torch.no_grad():
        logits = model_output(model(x))

    # 3. config.json + safetensors metadata + checksums
    cfg = json.loads((work / "trained" / "config.json").read_text())
    assert cfg["attn_implementation"] == saved_name(impl) and saved_name(impl).startswith(f"hf_attnorm:{impl} ")
    assert cfg["attnorm"]["implementation"] == impl and cfg["attnorm"]["hf_attnorm_version"] == hf_attnorm.__version__
    from safetensors import safe_open

    with safe_open(str(work / "trained" / "model.safetensors"), "pt") as f:
        meta = f.metadata()
        keys = set(f.keys())
    assert json.loads(meta["hf_attnorm"])["implementation"] == impl
    assert meta["hf_attnorm_version"] == hf_attnorm.__version__
    assert all(any(k.endswith(n.split(".", 1)[1]) for k in keys) for n in learn)
    assert (work / "trained" / CHECKSUM_FILE).is_file()

    # 4. (reloaded in a fresh process by test_fresh_process_reload_is_exact)
    case = cases / f"{family}-{task}-{impl}"
    if not case.exists():
        import shutil

        staging = cases / f".{case.name}.partial"
        shutil.copytree(work / "trained", staging / "model")
        torch.save({"x": x, "logits": logits, "params": {n: p.detach() for n, p in learn.items()}},
                   staging / "expected.pt")
        (staging / "meta.json").write_text(json.dumps({"auto": auto.__name__, "impl": impl}))
        staging.rename(case)


@pytest.mark.parametrize("impl,opts", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("kind", MODEL_KINDS, ids=MODEL_IDS)
def test_train_save_reload_exact(kind, impl, opts, tmp_path, roundtrip_cases):
    _train_and_save(kind, impl, opts, tmp_path, roundtrip_cases)
    # 5. an explicit attn_implementation still overrides the saved one
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other = _auto_class(*kind).from_pretrained(tmp_path / "trained", attn_implementation="softmax")
    assert other.config._attn_implementation == "softmax"
    assert not [n for n, _ in other.named_parameters() if ".attnorm." in n]


FRESH_SCRIPT = """
import json, sys, warnings, torch, hf_attnorm, transformers
from pathlib import Path
ok = []
for case in sorted(p for p in Path(sys.argv[1]).iterdir() if not p.name.startswith(".")):
    meta = json.loads((case / "meta.json").read_text())
    Auto = getattr(transformers, meta["auto"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all on an exact reload, but the one (by design) for a
        # normalizer weighing keys by their order in a bidirectional model (tests/test_stickbreaking.py checks it)
        warnings.filterwarnings("ignore", message=".*weighs the keys by their order.*")
        m, info = Auto.from_pretrained(case / "model", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], (case.name, info)
    assert m.config._attn_implementation == meta["impl"], (case.name, m.config._attn_implementation)
    exp = torch.load(case / "expected.pt")
    m.eval()
    with torch.no_grad():
        out = m(exp["x"])
    out = out.logits if hasattr(out, "logits") else out.last_hidden_state
    assert torch.equal(out, exp["logits"]), (case.name, (out - exp["logits"]).abs().max())
    params = dict(m.named_parameters())
    for n, v in exp["params"].items():
        assert torch.equal(params[n].detach(), v), (case.name, n)
    ok.append(case.name)
print(json.dumps(ok))
"""


def test_fresh_process_reload_is_exact(roundtrip_cases, tmp_path):
    """`import hf_attnorm; Auto*.from_pretrained(dir)` with no attn_implementation, in a new process: same
    implementation, identical logits (torch.equal) and parameter values, no missing/unexpected keys, no warning; for
    every (model kind, variant)."""
    expected = {f"{f}-{t}-{impl}" for f, t in MODEL_KINDS for impl, _ in VARIANTS}
    for kind in MODEL_KINDS:
        for impl, opts in VARIANTS:
            if not (roundtrip_cases / f"{kind[0]}-{kind[1]}-{impl}").exists():
                _train_and_save(kind, impl, opts, tmp_path / f"{kind[0]}-{kind[1]}-{impl}", roundtrip_cases)
    res = subprocess.run([sys.executable, "-c", FRESH_SCRIPT, str(roundtrip_cases)], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert set(json.loads(res.stdout.strip().splitlines()[-1])) == expected


@pytest.mark.parametrize("family,task", [("llama", "causal_lm"), ("bert", "masked_lm"), ("gpt2", "causal_lm")])
def test_set_attn_implementation_and_apply_create_parameters(family, task):
    model = tiny(family, task, implementation="sdpa")
    model.set_attn_implementation("sink")
    names = [n for n, _ in model.named_parameters() if ".attnorm." in n]
    assert len(names) == model.config.num_hidden_layers and all(n.endswith("attnorm.sink_logit") for n in names)
    assert model.config.attnorm["implementation"] == "sink"
    hf_attnorm.apply(model, "softmax", scale="ssmax", ssmax_s=0.25)
    params = {n: p for n, p in model.named_parameters() if ".attnorm." in n}
    assert all(n.endswith("attnorm.ssmax_s") for n in params)
    assert all(torch.equal(p.detach(), torch.full_like(p, 0.25)) for p in params.values())
    # switching away drops the settings and the parameters (with a warning naming hf_attnorm)
    with pytest.warns(UserWarning, match="hf_attnorm"):
        model.set_attn_implementation("sdpa")
    assert not [n for n, _ in model.named_parameters() if ".attnorm." in n]
    assert getattr(model.config, "attnorm", None) is None


def test_same_settings_keep_learned_values():
    model = tiny("llama", "causal_lm", implementation="ssmax")
    p = next(p for n, p in model.named_parameters() if n.endswith("ssmax_s"))
    with torch.no_grad():
        p.add_(1.0)
    model.set_attn_implementation("ssmax")  # no change: values kept, same Parameter object
    q = next(p for n, p in model.named_parameters() if n.endswith("ssmax_s"))
    assert q is p and torch.equal(q, torch.full_like(q, 2.0))


def _saved(tmp_path: Path, impl="ssmax") -> Path:
    model = tiny("llama", "causal_lm", implementation=impl)
    d = tmp_path / impl
    model.save_pretrained(d)
    return d


def _load(d: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(d)


def test_config_and_metadata_disagree(tmp_path):
    d = _saved(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["attnorm"]["ssmax_s"] = 3.0
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json and .*model\.safetensors disagree.*ssmax_s"):
        _load(d)


def test_truncated_safetensors(tmp_path):
    d = _saved(tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: sha256 mismatch"):
        _load(d)
    (d / CHECKSUM_FILE).unlink()  # without the checksum file the header check still catches it
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        _load(d)


def test_corrupted_byte(tmp_path):
    d = _saved(tmp_path)
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-7] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        _load(d)


def test_corrupted_header(tmp_path):
    d = _saved(tmp_path)
    (d / CHECKSUM_FILE).unlink()
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[12:20] = b"\xff" * 8
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupted safetensors header"):
        _load(d)


def test_unknown_normalizer_in_config(tmp_path):
    d = _saved(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["attnorm"]["normalizer"] = "quantum_softmax"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: invalid hf_attnorm settings.*quantum_softmax.*symax"):
        _load(d)
    # an unknown implementation name in a plain checkpoint's config is refused by name as well
    plain = tmp_path / "plain"
    tiny("llama", "causal_lm", implementation="sdpa").save_pretrained(plain)
    cfg = json.loads((plain / "config.json").read_text())
    cfg["attn_implementation"] = "hf_attnorm:quantum"
    (plain / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AttnormError, match="'quantum'.*does not know"):
        _load(plain)


def test_metadata_without_config_settings(tmp_path):
    d = _saved(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["attnorm"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="disagree"):
        verify_checkpoint(d)


def test_loading_without_hf_attnorm_fails_naming_it(tmp_path):
    d = _saved(tmp_path, "symax")  # no learnable parameters: nothing else would reveal the difference
    script = f"from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained({str(d)!r})"
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode != 0
    assert re.search(r'attn_implementation="hf_attnorm:symax -- to load this model, run import hf_attnorm first.*"'
                     r'\W{0,3} is not supported', res.stderr), res.stderr[-500:]


def test_explicit_sdpa_on_attnorm_checkpoint_warns(tmp_path):
    d = _saved(tmp_path, "symax")
    from transformers import AutoModelForCausalLM

    with pytest.warns(UserWarning, match="hf_attnorm.*'symax'"):
        m = AutoModelForCausalLM.from_pretrained(d, attn_implementation="sdpa")
    assert m.config._attn_implementation == "sdpa"


def test_attnorm_kwarg_needs_our_implementation(tmp_path):
    d = tmp_path / "plain"
    tiny("llama", "causal_lm", implementation="sdpa").save_pretrained(d)
    from transformers import AutoModelForCausalLM

    with pytest.raises(AttnormError, match="attnorm settings were given"):
        AutoModelForCausalLM.from_pretrained(d, attn_implementation="sdpa", attnorm={"eta": 0.5})
    with pytest.raises(AttnormError, match="'eta'.*not used by normalizer 'softmax'"):
        AutoModelForCausalLM.from_pretrained(d, attn_implementation="ssmax", attnorm={"eta": 0.5})


def test_the_marker_tensor_is_saved_once_and_ignored_with_hf_attnorm(tmp_path):
    """Every checkpoint carries the marker tensor (for transformers without hf_attnorm: tests/test_serve.py) in its
    first weight file and, sharded, in the shard index; with hf_attnorm it is no unexpected key and changes nothing."""
    from hf_attnorm.hf.persistence import INDEX_FILE, is_marker, marker_key, read_safetensors_header, weight_files

    model = tiny("llama", "causal_lm", "symax")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    files = weight_files(tmp_path)
    assert len(files) > 1, "the checkpoint was meant to be sharded"
    key = marker_key("symax")
    assert is_marker(key) and is_marker("model." + key) and not is_marker(key + ".weight")
    assert json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"][key] == files[0].name
    holders = [f.name for f in files if key in read_safetensors_header(f)]
    assert holders == [files[0].name]
    assert read_safetensors_header(files[0])[key]["dtype"] == "U8"
    verify_checkpoint(tmp_path)
    again, info = type(model).from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.arange(1, 9)[None]
    assert torch.equal(model_output(model(ids)), model_output(again(ids)))
