"""Files written by the code before the package was split into its current modules (commit e546e6f,
tests/fixtures/written_by_e546e6f/) still work: a saved ssmax checkpoint loads with its settings, learned values and
logits, and a training checkpoint's recorded arguments are the ones today's parser produces, and today's code resumes
it exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_attnorm  # noqa: F401  (registers the attention implementations)
from hf_attnorm.lab import training
from hf_attnorm.lab.training import STATE_FILE, build_parser, run_pretraining
from hf_attnorm.lab.training.args import parse_args
from hf_attnorm.lab.training.checkpoints import plan_output

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "written_by_e546e6f"


def test_old_ssmax_checkpoint_loads_with_its_settings_values_and_logits() -> None:
    folder = FIXTURES / "gpt2_ssmax"
    expected = json.loads((folder / "expected.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert model.config._attn_implementation.endswith("ssmax")
    assert {k: v for k, v in model.config.attnorm.items() if k != "hf_attnorm_version"} == {
        "implementation": "ssmax", "normalizer": "softmax", "scale": "ssmax", "ssmax_learnable": True,
        "ssmax_s": 1.0, "ssmax_bias": 0.0, "ssmax_bias_learnable": False,
        "ssmax_anchor": 0.0}  # (options added since: their defaults)
    params = dict(model.named_parameters())
    assert len(expected["learned"]) == 2
    for name, values in expected["learned"].items():
        assert params[name].requires_grad, name
        torch.testing.assert_close(params[name].detach(), torch.tensor(values), rtol=0, atol=0)
        assert not torch.allclose(params[name].detach(), torch.ones_like(params[name])), "values are the init"
    with torch.no_grad():
        logits = model(torch.tensor(expected["input_ids"])).logits
    torch.testing.assert_close(logits, torch.tensor(expected["logits"]), rtol=0, atol=2e-6)


#: the flags the fixture run was started with (scripts/pretrain.py of commit e546e6f, from inside char_run/): a
#: one-layer Llama with a character tokenizer, so that the checkpoint with its optimizer state is ~100 KB
OLD_RUN_FLAGS = ["--config_name", "cfg/config.json", "--tokenizer_name", "chartok", "--block_size", "16",
                 "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--max_eval_samples", "8",
                 "--max_train_samples", "64", "--learning_rate", "3e-3", "--lr_scheduler_type", "constant",
                 "--model_card_dir", "none", "--max_train_steps", "4", "--checkpointing_steps", "2",
                 "--attn_implementation", "sink", "--output_dir", "run"]


@pytest.fixture
def old_run(tmp_path, monkeypatch) -> Path:
    """A copy of char_run/ as the working directory: run/ holds training_args.json and step_2/ of the old code."""
    shutil.copytree(FIXTURES / "char_run", tmp_path / "char_run")
    monkeypatch.chdir(tmp_path / "char_run")
    return tmp_path / "char_run" / "run"


def test_old_training_state_records_the_arguments_of_todays_parser(old_run) -> None:
    saved = json.loads((old_run / "step_2" / STATE_FILE).read_text())["args"]
    now = {**parse_args("pretrain", OLD_RUN_FLAGS).as_dict(), "num_processes": 1}
    # the old code rewrote --model_card_dir none to None in place; today the flag's value is kept as given
    assert saved.pop("model_card_dir") is None and now.pop("model_card_dir") == "none"
    assert now == saved


def test_old_checkpoint_folder_is_accepted_for_resume(old_run) -> None:
    plan = plan_output(parse_args("pretrain", [*OLD_RUN_FLAGS, "--resume_from_checkpoint", "latest"]))
    assert plan.resume_dir == Path("run") / "step_2" and plan.resume_step == 2 and not plan.clear
    changed = parse_args("pretrain", [*OLD_RUN_FLAGS, "--resume_from_checkpoint", "latest", "--block_size", "32"])
    with pytest.raises(ValueError, match="--block_size 32 .checkpoint: 16."):
        plan_output(changed)


@pytest.mark.slow  # ~7 s on the busy 2-core machine (tokenises the corpus with the character tokenizer once)
def test_old_checkpoint_resumes_exactly(old_run) -> None:
    """Today's code continues the old step_2 (weights, AdamW state, scheduler, RNG, data position) to step 4 with
    the losses of the old code's uninterrupted run: the recorded steps and the first resumed step (3) bit for bit,
    the next ones to fp32 rounding (the sink path's kernel arithmetic changed when it moved onto SDPA, so the
    step-3 update differs in the last bits; a resume of a run by the same code stays bit-exact:
    tests/test_training.py::test_sigkill_and_resume_gives_bit_identical_losses)."""
    expected = json.loads((FIXTURES / "char_run" / "uninterrupted.json").read_text())
    summary = run_pretraining([*OLD_RUN_FLAGS, "--resume_from_checkpoint", "latest"])
    assert summary["steps"] == 4 and summary["attnorm"]["implementation"] == "sink"
    got, want = summary["train_losses"], expected["train_losses"]
    assert [s for s, _ in got] == [s for s, _ in want] == [1, 2, 3, 4]
    assert got[:3] == want[:3]  # steps 1-2 from the checkpoint's history, step 3 computed from the old state
    assert got[3][1] == pytest.approx(want[3][1], rel=1e-6, abs=0)
    assert [s for s, _ in summary["val_losses"]] == [s for s, _ in expected["val_losses"]]
    for (_, a), (_, b) in zip(summary["val_losses"], expected["val_losses"]):
        assert a == pytest.approx(b, rel=1e-6, abs=0)
    assert [p.name for p in training.list_checkpoints(old_run)] == ["step_2", "step_4"]


def _flags(parser) -> list[dict]:
    return [{"flag": a.option_strings, "dest": a.dest, "action": type(a).__name__, "required": a.required,
             "choices": list(a.choices) if a.choices else None, "type": getattr(a.type, "__name__", None),
             "default": a.default, "help": a.help, "metavar": a.metavar,
             "group": next(g.title for g in parser._action_groups if a in g._group_actions)} for a in parser._actions]


@pytest.mark.parametrize("kind", ["pretrain", "finetune"])
def test_scripts_keep_their_flags_defaults_and_help(kind) -> None:
    """The dataclass-built parser has the flags of the hand-written one of e546e6f (cli_flags.json), in the same
    order and groups; only --model_card_dir changed on purpose (the card goes into the output folder now)."""
    # module paths in help texts follow the move of the lab into hf_attnorm.lab; the integer types are shared by
    # every command line now (hf_attnorm.lab.cli)
    text = (FIXTURES / "cli_flags.json").read_text().replace("hf_attnorm.model_zoo", "hf_attnorm.lab.model_zoo")
    text = text.replace('"_positive_int"', '"positive_int"').replace('"_nonnegative_int"', '"nonnegative_int"')
    old = json.loads(text)["parsers"][kind]
    new = json.loads(json.dumps(_flags(build_parser(kind))))  # tuples -> lists, as in the fixture
    assert [f["dest"] for f in new] == [f["dest"] for f in old]
    card_old, card_new = old.pop(-2), new.pop(-2)
    assert card_old["dest"] == card_new["dest"] == "model_card_dir"
    assert card_old["default"] == "model_cards" and card_new["default"] is None
    assert new == old
