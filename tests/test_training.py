"""hf_attnorm.lab.training and scripts/pretrain.py, scripts/finetune.py: training runs on tiny models and the embedded
corpus (loss decreases for every family x normalizer kind), checkpoints that load with from_pretrained and give the
logged validation loss, exact resume after SIGKILL, two gloo ranks, Ctrl-C, fine-tuning with surgery, bad input."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_attnorm.lab import training
from hf_attnorm.lab.training import TrainingError, run_finetuning, run_pretraining

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"

#: a micro model on short blocks: a step takes tens of milliseconds even with GPT-2's 50257-token vocabulary
FAST = ["--model_size", "micro", "--block_size", "32", "--per_device_train_batch_size", "4",
        "--per_device_eval_batch_size", "8", "--max_eval_samples", "16", "--learning_rate", "3e-3",
        "--lr_scheduler_type", "constant", "--model_card_dir", "none"]

#: family -> (softmax, a softmax-family variant, a non-exp normalizer)
VARIANTS = {"gpt2": ["softmax", "softmax1", "symax"],
            "bert": ["softmax", "ssmax", "stablemax"],
            "llama": ["softmax", "sink", "relu_len"]}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return env


def pretrain(out: Path, *extra: str, steps: int = 30) -> dict:
    return run_pretraining([*FAST, "--max_train_steps", str(steps), "--output_dir", str(out), *extra])


def _decreased(summary: dict) -> tuple[float, float]:
    losses = [loss for _, loss in summary["train_losses"]]
    return sum(losses[:3]) / 3, sum(losses[-5:]) / 5


# ------------------------------------------------------------------------------------------- training works


@pytest.fixture(scope="module")
def llama_sink_run(tmp_path_factory) -> dict:
    """Llama with learnable sink logits: checkpoints at steps 10, 20, 30 and evaluations at the same steps."""
    out = tmp_path_factory.mktemp("llama-sink")
    return pretrain(out, "--model_type", "llama", "--attn_implementation", "sink", "--eval_steps", "10",
                    "--checkpointing_steps", "10", "--with_tracking", "--report_to", "jsonl")


@pytest.mark.parametrize("family,implementation",
                         [(f, i) for f, impls in VARIANTS.items() for i in impls],
                         ids=[f"{f}-{i}" for f, impls in VARIANTS.items() for i in impls])
def test_training_reduces_the_loss(family, implementation, tmp_path, request) -> None:
    if (family, implementation) == ("llama", "sink"):
        summary = request.getfixturevalue("llama_sink_run")
    else:
        summary = pretrain(tmp_path / "run", "--model_type", family, "--attn_implementation", implementation)
    first, last = _decreased(summary)
    assert summary["steps"] == 30 and len(summary["train_losses"]) == 30
    assert all(math.isfinite(loss) for _, loss in summary["train_losses"])
    assert last < first - 1.0, (first, last)
    assert summary["final_val_loss"] < math.log(50257 if family != "bert" else 30522) - 1.0
    assert summary["attnorm"]["implementation"] == implementation
    assert summary["model_type"] == family and summary["block_size"] == 32
    assert summary["final_val_perplexity"] == pytest.approx(math.exp(summary["final_val_loss"]))
    assert summary["tokens_per_second"] > 0 and summary["seconds"] > 0
    assert (Path(summary["output_dir"]) / "training_summary.json").is_file()


def test_checkpoint_and_final_model_load_with_from_pretrained_and_give_the_logged_val_loss(llama_sink_run) -> None:
    from transformers import AutoModelForCausalLM

    from hf_attnorm.lab import data

    s = llama_sink_run
    out = Path(s["output_dir"])
    assert [p.name for p in training.list_checkpoints(out)] == ["step_10", "step_20", "step_30"]
    assert not list(out.glob(".tmp-*"))
    logged = dict((step, loss) for step, loss in s["val_losses"])
    assert sorted(logged) == [10, 20, 30]
    tok = data.load_tokenizer("llama")
    tr, va, col, _ = data.load_text_datasets()
    _, val = data.build_lm_datasets(tr, va, col, tok, block_size=32, masked_lm=False)
    val = data.evenly_spaced(val, 16)
    loader = torch.utils.data.DataLoader(val, batch_size=8, collate_fn=data.collate_blocks)
    for folder, step in ((out / "step_20", 20), (out, 30)):
        model = AutoModelForCausalLM.from_pretrained(folder)  # no attn_implementation: restored from config
        assert model.config._attn_implementation == "sink"
        sink = model.model.layers[0].self_attn.attnorm.sink_logit
        assert not torch.allclose(sink, torch.zeros_like(sink))  # learned values came back
        loss, n = training.evaluate_loss(model, loader, masked_lm=False)
        assert n == 16 * 31
        assert loss == pytest.approx(logged[step], rel=1e-6, abs=1e-6)
    state = json.loads((out / "step_20" / "trainer_state.json").read_text())
    assert state["step"] == 20 and state["train_losses"] == s["train_losses"][:20]
    # tracker file: one record per step and per evaluation
    records = [json.loads(line) for line in (out / "runs" / out.name / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train_loss" in r] == list(range(1, 31))
    assert [r["val_loss"] for r in records if "val_loss" in r] == [logged[10], logged[20], logged[30]]
    # the model card
    card = (out / "README.md").read_text()
    assert "model-index" in card and "perplexity" in card and "block_size: 32" in card
    assert "sink_init" in card and "AutoModelForCausalLM.from_pretrained" in card


def test_gradient_accumulation_and_epochs(tmp_path) -> None:
    """max_train_samples 64 blocks / batch 4 = 16 micro-batches per epoch = 8 steps with accumulation 2."""
    s = run_pretraining([*FAST, "--model_type", "llama", "--max_train_samples", "64", "--num_train_epochs", "2",
                         "--gradient_accumulation_steps", "2", "--checkpointing_steps", "epoch",
                         "--output_dir", str(tmp_path / "o")])
    assert s["steps"] == 16 and s["total_batch_size"] == 8
    assert [v[0] for v in s["val_losses"]] == [8, 16]  # evaluated at each epoch end
    assert [p.name for p in training.list_checkpoints(tmp_path / "o")] == ["step_8", "step_16"]


# ------------------------------------------------------------------------------------------ exact resume


def _script(kind: str, args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPTS / f"{kind}.py"), *args], env=_env(), cwd=str(REPO),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


def _kill_after(proc: subprocess.Popen, marker: Path, sig: int, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.time() < deadline, f"{marker} never appeared"
        time.sleep(0.05)
    proc.send_signal(sig)
    try:
        proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
        raise AssertionError(f"signal {sig} did not end the run within {timeout} s:\n{out[-3000:]}") from None


@pytest.mark.long
@pytest.mark.parametrize("family", ["bert", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_sigkill_and_resume_gives_bit_identical_losses(family, tmp_path) -> None:
    """BERT draws dropout and MLM masks from the RNG, GPT-2 dropout; with gradient accumulation 2."""
    args = [*FAST, "--model_type", family, "--max_train_steps", "24", "--gradient_accumulation_steps", "2",
            "--checkpointing_steps", "4", "--eval_steps", "6", "--torch_threads", "1"]
    full = _script("pretrain", [*args, "--output_dir", str(tmp_path / "full")])
    _finish(full)
    reference = json.loads((tmp_path / "full" / "training_summary.json").read_text())

    killed = tmp_path / "killed"
    proc = _script("pretrain", [*args, "--output_dir", str(killed)])
    _kill_after(proc, killed / "step_8", signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "training_summary.json").exists()
    resumed_from = training.latest_checkpoint(killed)
    resume_step = int(resumed_from.name.split("_")[1])
    assert 8 <= resume_step < 24
    out = _finish(_script("pretrain", [*args, "--output_dir", str(killed), "--resume_from_checkpoint", "latest"]))
    assert f"resumed from {resumed_from}" in out
    resumed = json.loads((killed / "training_summary.json").read_text())
    ref_after = [x for x in reference["train_losses"] if x[0] > resume_step]
    got_after = [x for x in resumed["train_losses"] if x[0] > resume_step]
    assert len(got_after) == 24 - resume_step
    assert got_after == ref_after  # bit-identical floats, same data order
    assert resumed["train_losses"] == reference["train_losses"]
    assert resumed["val_losses"] == reference["val_losses"]
    assert not list(killed.glob(".tmp-*"))


def test_ctrl_c_leaves_no_half_written_files(tmp_path) -> None:
    out = tmp_path / "o"
    # a suite started from a background job hands its children SIGINT ignored, and Python then installs no
    # KeyboardInterrupt handler: the child restores the default first, as a terminal's Ctrl-C would find it
    proc = _script("pretrain", [*FAST, "--model_type", "llama", "--max_train_steps", "100000",
                                "--checkpointing_steps", "3", "--output_dir", str(out)],
                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _kill_after(proc, out / "step_3", signal.SIGINT, timeout=120)
    assert proc.returncode == 130
    assert not list(out.glob(".tmp-*"))
    assert not (out / "config.json").exists() and not (out / "training_summary.json").exists()
    for ckpt in training.list_checkpoints(out):  # every visible checkpoint is complete and loads
        assert {"config.json", "model.safetensors", "optimizer.bin", "random_states_0.pkl",
                "trainer_state.json", "tokenizer.json"} <= {p.name for p in ckpt.iterdir()}


# ------------------------------------------------------------------------------------------- two processes


@pytest.mark.long
def test_two_gloo_processes_match_one_process(tmp_path) -> None:
    """1 process x batch 8 and 2 processes x batch 4 see the same blocks per step: the losses agree closely."""
    args = [*FAST, "--model_type", "llama", "--max_train_steps", "12", "--eval_steps", "6", "--torch_threads", "1"]
    one = _script("pretrain", [*args, "--per_device_train_batch_size", "8", "--output_dir", str(tmp_path / "one")])
    _finish(one)
    env = _env()
    env["ACCELERATE_USE_CPU"] = "true"
    two = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
         "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
         str(SCRIPTS / "pretrain.py"), *args, "--per_device_train_batch_size", "4",
         "--output_dir", str(tmp_path / "two")],
        env=env, cwd=str(REPO), capture_output=True, text=True, timeout=900)
    assert two.returncode == 0, (two.stdout + two.stderr)[-4000:]
    a = json.loads((tmp_path / "one" / "training_summary.json").read_text())
    b = json.loads((tmp_path / "two" / "training_summary.json").read_text())
    assert b["num_processes"] == 2 and a["num_processes"] == 1
    assert b["total_batch_size"] == a["total_batch_size"] == 8
    assert b["tokens"] == a["tokens"] == 12 * 8 * 32  # gathered from both ranks
    la = torch.tensor([loss for _, loss in a["train_losses"]])
    lb = torch.tensor([loss for _, loss in b["train_losses"]])
    assert torch.allclose(la, lb, rtol=0, atol=1e-4), (la - lb).abs().max()  # measured: <= 2e-6
    va = torch.tensor([loss for _, loss in a["val_losses"]])
    vb = torch.tensor([loss for _, loss in b["val_losses"]])
    assert torch.allclose(va, vb, rtol=0, atol=1e-4)


# ------------------------------------------------------------------------------------------- fine-tuning


def test_finetune_minilm_with_surgery(tmp_path) -> None:
    """The real all-MiniLM-L6-v2 (a BertModel, so the MLM head starts fresh), switched to symax."""
    s = run_finetuning(["--model_name_or_path", "minilm", "--attn_implementation", "symax", "--attnorm",
                        "eta=0.5", "--block_size", "32", "--per_device_train_batch_size", "4",
                        "--max_train_steps", "6", "--learning_rate", "1e-3", "--max_eval_samples", "8",
                        "--model_card_dir", str(tmp_path / "cards"), "--output_dir", str(tmp_path / "ft")])
    assert s["attnorm"]["implementation"] == "symax" and s["attnorm"]["eta"] == 0.5
    assert s["task"] == "masked_lm" and s["steps"] == 6
    assert (tmp_path / "cards" / "ft.md").read_text() == (tmp_path / "ft" / "README.md").read_text()
    assert "sentence-transformers/all-MiniLM-L6-v2" in (tmp_path / "ft" / "README.md").read_text()
    from transformers import AutoModelForMaskedLM

    model = AutoModelForMaskedLM.from_pretrained(tmp_path / "ft")
    assert model.config.attnorm["eta"] == 0.5 and model.config._attn_implementation == "symax"


def test_finetune_our_checkpoint_keeps_its_attention(llama_sink_run, tmp_path) -> None:
    src = Path(llama_sink_run["output_dir"]) / "step_30"
    s = run_finetuning(["--model_name_or_path", str(src), "--block_size", "32", "--per_device_train_batch_size",
                        "4", "--max_train_steps", "3", "--max_eval_samples", "8", "--model_card_dir", "none",
                        "--output_dir", str(tmp_path / "ft")])
    assert s["attnorm"] == llama_sink_run["attnorm"]
    assert s["final_val_loss"] < llama_sink_run["final_val_loss"] + 0.5
    # only a scale swap: the normalizer and its saved options stay
    s = run_finetuning(["--model_name_or_path", str(src), "--scale", "log_n", "--block_size", "32",
                        "--max_train_steps", "2", "--max_eval_samples", "8", "--model_card_dir", "none",
                        "--output_dir", str(tmp_path / "ft2")])
    assert s["attnorm"] == {**llama_sink_run["attnorm"], "scale": "log_n"}


@pytest.mark.slow
def test_finetune_smollm2_with_surgery(tmp_path) -> None:
    s = run_finetuning(["--model_name_or_path", "smollm2", "--attn_implementation", "softmax1", "--block_size",
                        "32", "--per_device_train_batch_size", "1", "--max_train_steps", "2", "--max_eval_samples",
                        "4", "--per_device_eval_batch_size", "4", "--learning_rate", "1e-5", "--model_card_dir",
                        "none", "--output_dir", str(tmp_path / "ft")])
    assert s["model_type"] == "llama" and s["attnorm"]["implementation"] == "softmax1"
    assert s["final_val_perplexity"] < 200  # a real pretrained model on Shakespeare, not a random one
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in (tmp_path / "ft" / "README.md").read_text()


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("extra,match", [
    (["--attn_implementation", "nosuch"], "unknown attention implementation 'nosuch'; registered: softmax"),
    (["--normalizer", "nosuch"], "unknown normalizer 'nosuch'"),
    (["--scale", "nosuch"], "unknown scale 'nosuch'; registered scales: .*standard"),
    (["--attnorm", "nosuch=1"], "unknown option 'nosuch'"),
    (["--attn_implementation", "softmax", "--attnorm", "eta=0.5"], r"\['eta'\] are not used by normalizer 'softmax'"),
    (["--attn_implementation", "symax", "--attnorm", "eta=-1"], "eta.*must be >= 0"),
    (["--attn_implementation", "symax", "--attnorm", "eta=abc"], "eta must be a number, got 'abc'"),
    (["--attnorm", "eta"], "expects KEY=VALUE"),
    (["--block_size", "128", "--max_position_embeddings", "64"], "--block_size 128 is larger than the model's 64 "
                                                                    "positions"),
    (["--report_to", "tensorboardish", "--with_tracking"], "unknown tracker 'tensorboardish'"),
    (["--learning_rate", "-1"], "--learning_rate must be > 0"),
])
def test_bad_input_fails_before_training(extra, match, tmp_path) -> None:
    out = tmp_path / "o"
    with pytest.raises((TrainingError, ValueError), match=match):
        pretrain(out, *extra)
    assert not training.list_checkpoints(out) and not (out / "config.json").exists()


def test_bad_data_files_fail(tmp_path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="--train_file .*empty.txt' is empty"):
        pretrain(tmp_path / "o", "--train_file", str(empty))
    with pytest.raises(ValueError, match="--train_file .*missing.txt' does not exist"):
        pretrain(tmp_path / "o", "--train_file", str(tmp_path / "missing.txt"))


def test_block_size_beyond_a_checkpoints_positions_fails(tmp_path) -> None:
    with pytest.raises(TrainingError, match="--block_size 1024 is larger than the model's 512 positions"):
        run_finetuning(["--model_name_or_path", "minilm", "--block_size", "1024", "--output_dir", str(tmp_path)])


def test_output_dir_protection(tmp_path, llama_sink_run) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(TrainingError, match="is not empty and is not a run of these scripts.*--overwrite_output_dir"):
        pretrain(foreign)
    ours = Path(llama_sink_run["output_dir"])
    with pytest.raises(TrainingError, match="holds a previous run.*--resume_from_checkpoint latest"):
        pretrain(ours, "--attn_implementation", "sink")
    with pytest.raises(TrainingError, match="trained with attention settings.*'sink'.*'symax'"):
        pretrain(ours, "--attn_implementation", "symax", "--resume_from_checkpoint", "latest")
    with pytest.raises(TrainingError, match="different settings: --block_size 64"):
        pretrain(ours, "--resume_from_checkpoint", "latest", "--block_size", "64")
    with pytest.raises(TrainingError, match="not a checkpoint of these scripts"):
        pretrain(tmp_path / "x", "--resume_from_checkpoint", str(foreign))
    # overwrite: our files go, the user's stay
    s = pretrain(foreign, "--overwrite_output_dir", steps=2)
    assert (foreign / "notes.txt").read_text() == "mine" and s["steps"] == 2


def test_resume_latest_of_a_finished_run_extends_it(tmp_path) -> None:
    out = tmp_path / "o"
    first = pretrain(out, "--model_type", "llama", "--checkpointing_steps", "4", steps=4)
    more = pretrain(out, "--model_type", "llama", "--checkpointing_steps", "4", "--resume_from_checkpoint",
                    "latest", steps=8)
    assert more["steps"] == 8 and more["train_losses"][:4] == first["train_losses"]


def test_scripts_report_bad_input_as_errors(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPTS / "pretrain.py"), "--attn_implementation", "nosuch",
                           "--output_dir", str(tmp_path / "o")], env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert "pretrain.py: error: unknown attention implementation 'nosuch'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_list_prints_the_registries(capsys) -> None:
    assert run_finetuning(["--model_name_or_path", "x", "--output_dir", "y", "--list"]) == {}
    listing = capsys.readouterr().out
    assert "symax" in listing and "eta_learnable" in listing and "ssmax" in listing


def test_parse_attnorm_options_types() -> None:
    opts = training.parse_attnorm_options(["eta=0.25", "eta_learnable=true", "sigmoid_bias=null",
                                           "sparse_m_rule=sqrt"])
    assert opts == {"eta": 0.25, "eta_learnable": True, "sigmoid_bias": None, "sparse_m_rule": "sqrt"}
    with pytest.raises(TrainingError, match="eta_learnable must be true or false"):
        training.parse_attnorm_options(["eta_learnable=maybe"])
    with pytest.raises(TrainingError, match="given twice"):
        training.parse_attnorm_options(["eta=1", "eta=2"])


def test_every_flag_has_help() -> None:
    for kind in ("pretrain", "finetune"):
        parser = training.build_parser(kind)
        for action in parser._actions:
            assert action.help, (kind, action.dest)


def test_divergence_stops_with_a_clear_error(tmp_path) -> None:
    with pytest.raises(TrainingError, match="training diverged: the loss is nan at step"):
        pretrain(tmp_path / "o", "--learning_rate", "1e30", "--max_grad_norm", "0", steps=10)
    assert not (tmp_path / "o" / "training_summary.json").exists()


def test_model_card_goes_into_the_output_dir_by_default(tmp_path, monkeypatch) -> None:
    """A run started anywhere (here: the working directory a checkout would be) writes only into --output_dir."""
    monkeypatch.chdir(tmp_path)
    fast = FAST[:FAST.index("--model_card_dir")] + FAST[FAST.index("--model_card_dir") + 2:]
    assert "--model_card_dir" not in fast
    s = run_pretraining([*fast, "--model_type", "llama", "--max_train_steps", "2", "--output_dir", "run"])
    card = tmp_path / "run" / training.MODEL_CARD_SUBDIR / "run.md"
    assert card.read_text() == (tmp_path / "run" / "README.md").read_text()
    assert Path(s["model_card"]) == Path("run") / "README.md"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
