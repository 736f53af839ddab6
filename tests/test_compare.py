"""scripts/compare.py end-to-end on the micro budget: every artifact, its content, reuse, and bad input."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def compare():
    return load_script("compare")


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def micro_run(compare, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    argv = ["--budget", "micro", "--implementations", "softmax", "symax:eta=0.5", "--output_dir", str(out),
            "--model_card_dir", str(out / "cards"), "--threads", "2"]
    result = compare.main(argv)
    return out, argv, result


def test_micro_budget_writes_every_artifact(micro_run):
    out, _, result = micro_run
    saved = json.loads((out / "results.json").read_text())
    assert saved["table"] == result["table"] and saved["budget"] == "micro"
    runs = saved["runs"]
    assert [r["implementation"] for r in runs] == ["softmax", "symax:eta=0.5"]
    assert all(r["status"] == "ok" for r in runs)
    for r in runs:
        assert r["steps"] == 4 and [s for s, _ in r["val_losses"]] == [2, 4]
        ext = r["extrapolation"]
        assert [c["context"] for c in ext["contexts"]] == [16, 64, 128]
        assert ext["tokens_used"] == 256 and ext["position_encoding"] == "rope"
        for c in ext["contexts"]:
            assert c["status"] == "ok" and torch.isfinite(torch.tensor(c["perplexity"]))
            assert len(c["buckets"]) == c["context"] // 16
        assert len(r["diagnostics"]["layers"]) == 2 and len(r["diagnostics"]["hidden_states"]) == 3
        assert r["diagnostics_context"] == 128
        card = Path(r["model_card"])
        assert card.parent == out / "cards" and "## Length extrapolation (scripts/compare.py)" in card.read_text()
    assert runs[1]["attnorm"]["eta"] == 0.5  # the option reached training
    # the trained model reloads with its attention
    config = json.loads((out / "symax-eta-0.5" / "config.json").read_text())
    assert config["attnorm"]["implementation"] == "symax" and config["attnorm"]["eta"] == 0.5
    # the table: a header, a separator and one row per run
    lines = (out / "results.md").read_text().strip().splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert len(table) == 2 + len(runs) and "`symax:eta=0.5`" in table[-1] and "ppl @ 128" in table[0]
    # plots: valid PNGs with one series per run (the entropy plot adds the ln n reference)
    names = {"val_loss": 2, "ppl_vs_context": 2, "position_buckets": 2, "entropy_vs_n": 3}
    for name, count in names.items():
        info = saved["plots"][name]
        assert is_png(Path(info["path"])) and Path(info["path"]).parent == out / "plots"
        assert len(info["series"]) == count and info["series"][:2] == ["softmax", "symax:eta=0.5"]


def test_reuse_skips_training(compare, micro_run, tmp_path):
    out, _, first = micro_run
    shutil.copytree(out / "softmax", tmp_path / "softmax")  # a finished run, moved elsewhere
    again = compare.main(["--budget", "micro", "--implementations", "softmax", "--output_dir", str(tmp_path),
                          "--model_card_dir", str(tmp_path / "cards"), "--threads", "2", "--reuse"])
    run = again["runs"][0]
    assert run["reused"] is True
    assert Path(run["model_card"]) == tmp_path / "cards" / "compare-llama-micro-softmax.md"
    assert run["train_losses"] == first["runs"][0]["train_losses"]
    # the evaluation is deterministic: the same model gives the same numbers
    assert run["extrapolation"] == first["runs"][0]["extrapolation"]


def test_bad_implementation_fails_before_training(compare, tmp_path):
    with pytest.raises(SystemExit, match="unknown attention implementation 'nope'"):
        compare.main(["--budget", "micro", "--implementations", "nope", "--output_dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="not used by normalizer 'symax'"):
        compare.main(["--budget", "micro", "--implementations", "symax:bogus=1", "--output_dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="repeats"):
        compare.main(["--budget", "micro", "--implementations", "softmax", "softmax", "--output_dir", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def test_help_documents_every_flag():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare.py"), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0
    parser = load_script("compare").build_parser()
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help text"


def test_evaluate_script_swaps_on_a_saved_model(tmp_path):
    """scripts/evaluate.py (the SmolLM2 swap experiment) on a tiny saved Llama: sdpa and hf_attnorm softmax agree,
    a swap changes the numbers, options reach the model, and the table has one row per variant."""
    from hf_attnorm.lab.data import load_tokenizer, shakespeare_text
    from hf_attnorm.lab.model_zoo import build_model

    tok = load_tokenizer("llama")
    model = build_model("llama", "micro", vocab_size=len(tok), max_positions=64, attn_implementation="sdpa")
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    (tmp_path / "text.txt").write_text(shakespeare_text("validation")[:4000], encoding="utf-8")
    script = load_script("evaluate")
    result = script.main(["--model_name_or_path", str(tmp_path / "model"), "--text_file", str(tmp_path / "text.txt"),
                          "--contexts", "8", "32", "--max_tokens", "96", "--variants", "sdpa", "softmax",
                          "qwen_logn:train_length=8", "symax", "--output_dir", str(tmp_path / "out"),
                          "--no_progress", "--threads", "2"])
    rows = {r["variant"]: r for r in result["variants"]}
    assert result["tokens_used"] == 96 and list(rows) == ["sdpa", "softmax", "qwen_logn:train_length=8", "symax"]
    for ctx in ("8", "32"):
        assert rows["softmax"]["perplexity"][ctx] == pytest.approx(rows["sdpa"]["perplexity"][ctx], rel=1e-5)
        assert rows["symax"]["perplexity"][ctx] != pytest.approx(rows["softmax"]["perplexity"][ctx], rel=1e-4)
    # qwen_logn with L_train = 8 is the identity for n <= 8: the same as softmax at context 8 and on the first
    # position bucket of the 32-token windows, different beyond (a random model reacts weakly: exact comparison)
    qwen, soft = rows["qwen_logn:train_length=8"], rows["softmax"]
    assert qwen["perplexity"]["8"] == pytest.approx(soft["perplexity"]["8"], rel=1e-6)
    assert qwen["buckets"]["32"][0]["mean_nll"] == pytest.approx(soft["buckets"]["32"][0]["mean_nll"], rel=1e-6)
    assert all(abs(q["mean_nll"] - s["mean_nll"]) > 1e-7 for q, s in zip(qwen["buckets"]["32"][1:],
                                                                          soft["buckets"]["32"][1:]))
    assert rows["qwen_logn:train_length=8"]["attnorm"]["train_length"] == 8
    table = [line for line in (tmp_path / "out" / "results.md").read_text().splitlines() if line.startswith("|")]
    assert len(table) == 2 + 4
    with pytest.raises(SystemExit, match="unknown attention implementation"):
        script.main(["--model_name_or_path", str(tmp_path / "model"), "--variants", "nope"])
