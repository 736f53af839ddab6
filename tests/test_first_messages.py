"""The messages a user meets first: loading a saved model without ``import hf_attnorm`` (AutoModel, pipeline, the
lm-eval command line), a misspelt implementation name, and the supported lm-eval route
(``python -m hf_attnorm.lab.evaluation.lm_eval``). Loading without the import runs in a fresh process, where hf_attnorm
is not imported by anything."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import tiny

from hf_attnorm.registry import LOAD_HINT, PRESETS, UnknownNameError, saved_name

ROOT = Path(__file__).resolve().parents[1]
#: the instruction the first line must carry
HINT = "run import hf_attnorm first"


def _fresh_python(code: str, cwd: Path, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a new interpreter that has not imported hf_attnorm (it asserts so itself)."""
    prologue = "import sys\n"
    epilogue = "\nassert 'hf_attnorm' not in sys.modules, 'hf_attnorm was imported'\n"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           **(extra_env or {})}
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-c", prologue + textwrap.dedent(code) + epilogue], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def _exception_line(stderr: str) -> str:
    """The line a reader sees first in a Python error: the last non-empty one (the exception and its message)."""
    return [line for line in stderr.splitlines() if line.strip()][-1]


def _chars_tokenizer(text: str):
    from transformers import PreTrainedTokenizerFast

    from hf_attnorm.lab.compare.charlm import UNK, train_tokenizer

    return PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(text), unk_token=UNK, eos_token=UNK)


DOCS = ["the cat sat on the mat", "a dog ran far away", "sing a song of six pence"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny symax Llama saved with a character tokenizer (ids < its 97 embeddings)."""
    d = tmp_path_factory.mktemp("symax_model")
    tok = _chars_tokenizer(" ".join(DOCS))
    assert len(tok) < 97
    tiny("llama", "causal_lm", implementation="symax").save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_saved_config_names_what_to_do(saved):
    cfg = json.loads((saved / "config.json").read_text())
    assert cfg["attn_implementation"] == saved_name("symax") == "hf_attnorm:symax" + LOAD_HINT
    assert HINT in LOAD_HINT and "/" not in LOAD_HINT  # a "/" would make transformers fetch a hub kernel


# a fresh interpreter importing transformers takes ~5-12 s: one variant in the default run, the others slow
@pytest.mark.parametrize("how", [pytest.param("AutoModel", marks=pytest.mark.slow), "AutoModelForCausalLM",
                                 pytest.param("pipeline", marks=pytest.mark.slow)])
def test_loading_without_import_says_import_hf_attnorm_first(saved, how, tmp_path):
    if how == "pipeline":
        code = f"from transformers import pipeline\npipeline('text-generation', model={str(saved)!r})"
    else:
        code = f"import transformers\ntransformers.{how}.from_pretrained({str(saved)!r})"
    res = _fresh_python(code, cwd=tmp_path)
    assert res.returncode != 0
    assert "hf_attnorm was imported" not in res.stderr
    line = _exception_line(res.stderr)
    assert line.startswith("ValueError: "), line
    assert "hf_attnorm:symax" in line and HINT in line, line
    if how != "pipeline":  # pipeline() wraps the errors of each class it tried; its own message starts the text
        assert re.search(r"^ValueError: .*" + re.escape(HINT), res.stderr, re.M)


def test_checkpoint_saved_before_the_hint_still_loads(saved, tmp_path):
    """config.json files written as "hf_attnorm:<name>" (no hint) load as before."""
    from transformers import AutoModelForCausalLM

    old = tmp_path / "old"
    old.mkdir()
    for f in saved.iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((old / "config.json").read_text())
    cfg["attn_implementation"] = "hf_attnorm:symax"
    (old / "config.json").write_text(json.dumps(cfg))
    model = AutoModelForCausalLM.from_pretrained(old)
    assert model.config._attn_implementation == "symax"
    assert model.model.layers[0].self_attn.attnorm.settings.implementation == "symax"


def _misspelt(name: str) -> str:
    """``name`` with its middle character dropped (a typo)."""
    i = len(name) // 2
    return name[:i] + name[i + 1:]


@pytest.mark.parametrize("impl", [p for p in PRESETS if len(p) > 3])
def test_misspelt_implementation_names_the_closest(impl):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    wrong = _misspelt(impl)
    if wrong in PRESETS:
        pytest.skip(f"dropping a character of {impl!r} gives another registered name, {wrong!r}")
    with pytest.raises(UnknownNameError) as exc:
        LlamaForCausalLM._from_config(config, attn_implementation=wrong)
    first = str(exc.value).splitlines()[0]
    assert first.startswith(f"attn_implementation={wrong!r} is not registered; did you mean ")
    assert repr(impl) in first.split("?")[0], first
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    with pytest.raises(UnknownNameError, match=f"did you mean.*{impl!r}"):
        model.set_attn_implementation(wrong)
    model.set_attn_implementation("eager")  # transformers' own names still pass
    assert model.config._attn_implementation == "eager"


# ------------------------------------------------------------------------------------------------------ lm-eval

needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                   reason="lm-evaluation-harness is not installed (optional test dependency: "
                                   "pip install 'lm-eval==0.4.13' with torch and transformers pinned)")


def _local_task(tmp_path: Path) -> Path:
    """A rolling-perplexity task over a local JSONL file (no hub access)."""
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "local_ppl.yaml").write_text(textwrap.dedent(f"""\
        task: attnorm_local_ppl
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{{{text}}}}"
        metric_list:
          - metric: word_perplexity
        """))
    return tasks


def _word_perplexity(model, tok) -> float:
    """exp(-sum log p(doc) / words): each document scored from the end-of-text token, as lm-eval's rolling task."""
    total, words = 0.0, 0
    for text in DOCS:
        ids = torch.tensor([[tok.eos_token_id, *tok(text)["input_ids"]]])
        with torch.no_grad():
            logp = model(ids).logits.float().log_softmax(-1)[0, :-1]
        total += logp.gather(-1, ids[0, 1:, None]).sum().item()
        words += len(re.split(r"\s+", text))
    return math.exp(-total / words)


@pytest.mark.slow
@needs_lm_eval
def test_lm_eval_command_line_through_the_wrapper(saved, tmp_path):
    """``python -m hf_attnorm.lab.evaluation.lm_eval`` runs lm-eval's CLI on a saved symax model and reports the
    perplexity the model computes in this process; the plain ``python -m lm_eval`` fails saying what to do."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tasks = _local_task(tmp_path)
    args = ["--model", "hf", "--model_args", f"pretrained={saved},dtype=float32", "--tasks", "attnorm_local_ppl",
            "--include_path", str(tasks), "--device", "cpu", "--batch_size", "1", "--output_path",
            str(tmp_path / "out")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    res = subprocess.run([sys.executable, "-m", "hf_attnorm.lab.evaluation.lm_eval", *args], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in (tmp_path / "out").rglob("results*.json")]
    assert len(results) == 1, list((tmp_path / "out").rglob("*"))
    got = results[0]["results"]["attnorm_local_ppl"]["word_perplexity,none"]
    model = AutoModelForCausalLM.from_pretrained(saved).eval()
    assert model.config._attn_implementation == "symax"
    want = _word_perplexity(model, AutoTokenizer.from_pretrained(saved))
    assert got == pytest.approx(want, rel=1e-4)
    with pytest.warns(UserWarning, match="now computes 'sdpa' attention"):
        sdpa = AutoModelForCausalLM.from_pretrained(saved, attn_implementation="sdpa").eval()
    assert _word_perplexity(sdpa, AutoTokenizer.from_pretrained(saved)) != pytest.approx(want, rel=1e-3)

    env.pop("PYTHONPATH", None)
    plain = subprocess.run([sys.executable, "-m", "lm_eval", *args], capture_output=True, text=True, cwd=tmp_path,
                           env=env, timeout=600)
    assert plain.returncode != 0
    assert HINT in plain.stderr, plain.stderr[-2000:]
