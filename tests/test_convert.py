"""scripts/convert.py (hf_attnorm.lab.convert): attention transfer then fine-tuning, on tiny models.

The teacher is the original model (a softmax target gives zero error, the stream the next layers see is the original
model's, on every causal-LM family); stage 1 lowers the per-layer error for every registered implementation; the
saved model reloads to identical logits; a resumed conversion equals an uninterrupted one; bad input fails first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import first_implementations, has_memory
from family_zoo import FAMILIES, build, inputs
from transformers import AutoModelForCausalLM

import hf_attnorm  # noqa: F401
from hf_attnorm.lab.convert import Converter, ConvertError, Transfer, install_observer, parse_args
from hf_attnorm.lab.convert import converter as convert
from hf_attnorm.registry import PRESETS, SCALES, is_ours

REPO = Path(__file__).resolve().parents[1]
OURS = [name for name in PRESETS if is_ours(name)]


def _transfer_sample() -> list[str]:
    """The first implementation of each normalizer, of each scale with learnable values and with learned memory
    key/values: the other implementations differ from one of these by a constant elementwise scale of q, which
    changes nothing in what attention transfer trains."""
    return first_implementations(lambda s: (s.normalizer, s.scale if SCALES.get(s.scale).params else None,
                                            has_memory(s)), OURS)


CAUSAL = [name for name, fam in FAMILIES.items() if fam.kind == "causal"]
#: a few steps on short blocks of a micro Llama with GPT-2's tokenizer: a conversion takes about a second
FAST = ["--block_size", "32", "--eval_lengths", "32,64", "--eval_tokens", "256", "--error_blocks", "2",
        "--transfer_learning_rate", "1e-2", "--finetune_learning_rate", "1e-2"]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A micro Llama (random weights, q/k scaled up; its softmax attention is the teacher) with the GPT-2 tokenizer,
    as a folder."""
    from hf_attnorm.lab import data as data_lib
    from hf_attnorm.lab.model_zoo import build_model

    folder = tmp_path_factory.mktemp("source")
    tokenizer = data_lib.load_tokenizer("gpt2")
    model = build_model("llama", "micro", attn_implementation="sdpa", seed=0, vocab_size=len(tokenizer),
                        max_positions=128)
    with torch.no_grad():  # sharper attention than a fresh init's near-uniform one, as in a trained model: every
        for name, p in model.named_parameters():  # normalizer then starts measurably away from softmax
            if "q_proj" in name or "k_proj" in name:
                p.mul_(4.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _args(source: Path, out: Path, implementation: str, *extra: str) -> list[str]:
    return ["--model_name_or_path", str(source), "--attn_implementation", implementation, "--output_dir", str(out),
            *FAST, *extra]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


# --------------------------------------------------------------------------------------------- the teacher


@pytest.mark.parametrize("family", CAUSAL)
def test_the_teacher_is_the_original_model_and_every_layer_sees_its_inputs(family):
    """Under the transfer observer the decoder's output equals the original (eager) model's: each layer
    passes the teacher's output on. One error per attention layer, finite, with a gradient to learnable values."""
    student = build(family, "symax", attnorm={"eta_learnable": True})
    original = build(family, "eager")
    feed, _ = inputs(family, pad=False)
    ids = feed["input_ids"]
    transfer = Transfer()
    layers = install_observer(student, transfer)
    try:
        assert layers == student.config.num_hidden_layers if hasattr(student.config, "num_hidden_layers") else layers
        transfer.reset("student")
        with torch.no_grad():
            expected = convert.decoder_of(original)(input_ids=ids, use_cache=False).last_hidden_state
        got = convert.decoder_of(student)(input_ids=ids, use_cache=False).last_hidden_state
        assert len(transfer.errors) == layers > 0
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        loss = torch.stack(transfer.errors).mean()
        assert torch.isfinite(loss) and loss > 0
        loss.backward()
        grads = [p.grad for n, p in student.named_parameters() if n.endswith("symax_eta")]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    finally:
        install_observer(student, None)


def test_a_softmax_target_has_zero_error(source, tmp_path):
    """hf_attnorm's softmax computes what the teacher computes: its swapped error is 0."""
    s = convert.run(_args(source, tmp_path / "o", "softmax", "--transfer_steps", "0", "--finetune_steps", "0",
                          "--no_save_model"))
    assert max(s["layer_errors"]["swapped"]) < 1e-10, s["layer_errors"]


#: a learning rate far too large for softmax1 (close to softmax): stage 1 makes the held-out error worse
#: (softmax1 without its continuation from softmax, which would measure only the steps after its ramp)
OVERSHOOT = ("--transfer_steps", "3", "--finetune_steps", "0", "--transfer_learning_rate", "3", "--max_grad_norm", "0",
             "--no_save_model", "--no-continuation", "--transfer_skip_error", "0")


def test_a_stage_1_that_raises_the_error_says_so(source, tmp_path):
    """Without --transfer_keep_best, a stage 1 worse than the swap warns, naming the flag to change."""
    with pytest.warns(UserWarning, match="stage 1 raised the held-out per-layer error of softmax1 from .* lower "
                                         "--transfer_learning_rate"):
        s = convert.run(_args(source, tmp_path / "o", "softmax1", *OVERSHOOT, "--no-transfer_keep_best"))
    assert _mean(s["layer_errors"]["transfer"]) > _mean(s["layer_errors"]["swapped"])
    assert s["transfer_check"] == {}  # (neither kept nor skipped: nothing measured)


def test_stage_1_ends_at_its_best_held_out_state(source, tmp_path, capsys):
    """The same overshooting run with --transfer_keep_best (the default): every step measured, and the stage ends
    at the best state seen (here the start: LoRA at zero, the swapped model), so the error after stage 1 is the
    start's, not the worse one of its last step."""
    s = convert.run(_args(source, tmp_path / "o", "softmax1", *OVERSHOOT, "--transfer_eval_steps", "1"))
    check = s["transfer_check"]
    start, after = _mean(s["layer_errors"]["swapped"]), _mean(s["layer_errors"]["transfer"])
    assert check["start"] == round(start, 6) and [m[0] for m in check["measured"]] == [1, 2, 3]
    assert all(e > check["start"] for _, e in check["measured"])  # the overshoot, as without keep-best
    assert check["best_step"] == 0 and check["best"] == check["start"]
    assert after == pytest.approx(start, rel=1e-4, abs=1e-9), (start, after)
    assert "stage 1 ends at its best held-out state, step 0" in capsys.readouterr().err


def test_stage_1_is_skipped_when_the_start_is_within_tolerance(source, tmp_path):
    s = convert.run(_args(source, tmp_path / "o", "softmax1", *OVERSHOOT[:-2], "--transfer_skip_error", "1"))
    assert "within --transfer_skip_error 1.0" in s["transfer_check"]["skipped"]
    assert s["stages"] == [] and s["losses"]["transfer"] == [] and "transfer" not in s["layer_errors"]
    assert "transfer" not in s["trained"]
    # 0 never skips, even a start that equals the teacher (softmax: error 0)
    s = convert.run(_args(source, tmp_path / "z", "softmax", "--transfer_steps", "1", "--finetune_steps", "0",
                          "--no_save_model", "--transfer_skip_error", "0", "--transfer_lora_r", "2"))
    assert s["transfer_check"]["start"] == 0 and "skipped" not in s["transfer_check"] and s["stages"] == ["transfer"]


# ------------------------------------------------------------------------------------------------ stage 1


def _lowers(source: Path, out: Path, implementation: str) -> dict:
    """Stage 1 lowers the held-out per-layer error. A normalizer that starts close to softmax gets a smaller learning
    rate (as the warning of such a run advises: a large one overshoots)."""
    # (evaluated only where read: each evaluation point costs a perplexity pass per length)
    swap = convert.run(_args(source, out / "swap", implementation, "--transfer_steps", "0", "--finetune_steps", "0",
                             "--no_save_model", "--eval_stages", "swapped"))
    before = _mean(swap["layer_errors"]["swapped"])
    if before < 1e-8:  # equal to softmax on this model: nothing to transfer
        return swap
    lr = "1e-2" if before > 0.05 else "1e-3"
    s = convert.run(_args(source, out / "run", implementation, "--transfer_steps", "12", "--finetune_steps", "0",
                          "--no_save_model", "--checkpointing_steps", "0", "--transfer_learning_rate", lr,
                          "--transfer_skip_error", "0",
                          "--eval_stages", "swapped,transfer"))
    after = _mean(s["layer_errors"]["transfer"])
    assert _mean(s["layer_errors"]["swapped"]) == before
    assert after < before, (implementation, lr, before, after)
    assert s["trained"]["transfer"]["lora"] and s["trained"]["transfer"]["parameters"] > 0
    return s


@pytest.mark.parametrize("implementation", ["symax", "ssmax", "stickbreaking"])
def test_attention_transfer_lowers_the_per_layer_error(source, tmp_path, implementation):
    _lowers(source, tmp_path / "o", implementation)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", _transfer_sample())
def test_attention_transfer_lowers_the_per_layer_error_of_every_normalizer(source, tmp_path, implementation):
    _lowers(source, tmp_path / "o", implementation)


def test_transfer_without_lora_trains_only_the_learnable_values(source, tmp_path):
    s = convert.run(_args(source, tmp_path / "o", "ssmax", "--transfer_steps", "12", "--transfer_lora_r", "0",
                          "--finetune_steps", "0", "--no_save_model", "--transfer_skip_error", "0"))
    heads = 4 * 2  # micro Llama: 4 heads x 2 layers, one ssmax_s per head
    assert s["trained"]["transfer"] == {"tensors": 2, "parameters": heads, "lora": False}
    assert _mean(s["layer_errors"]["transfer"]) < _mean(s["layer_errors"]["swapped"])


# ----------------------------------------------------------------------------- both stages, saving, reload


def test_both_stages_then_the_saved_model_reloads_to_identical_logits(source, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "o"
    conv = Converter(parse_args(_args(source, out, "symax", "--attnorm", "eta_learnable=true", "--transfer_steps",
                                      "6", "--finetune_steps", "6")))
    s = conv.run()
    assert set(s["perplexity"]) == {"swapped", "transfer", "finetune"} and s["stages"] == ["transfer", "finetune"]
    first, last = s["losses"]["finetune"][0][1], s["losses"]["finetune"][-1][1]
    assert last < first, s["losses"]["finetune"]
    assert all(len(v) == 2 for v in s["layer_errors"].values())
    assert set(s["peak_rss_mb"]) == {"load", "evaluation swapped", "transfer", "evaluation transfer", "finetune",
                                     "evaluation finetune"} and min(s["peak_rss_mb"].values()) > 0
    assert json.loads((out / "conversion.json").read_text())["perplexity"] == s["perplexity"]
    # what each stage cost on a shared machine: CPU seconds of every thread, the load at every training step
    cpu = s["cpu_seconds"]
    assert cpu["transfer"] > 0 and cpu["finetune"] > 0 and cpu["run"] >= cpu["transfer"] + cpu["finetune"]
    load = s["load_average_steps"]
    assert load["steps"] == 12 and 0 <= load["mean"] <= load["max"]
    eta = [p for n, p in conv.model.named_parameters() if n.endswith("symax_eta")]
    assert eta and any((p - 1.0).abs().max() > 1e-4 for p in eta), "the learnable eta did not train"
    assert not any("lora" in n for n, _ in conv.model.named_parameters()), "LoRA must be merged"
    again = AutoModelForCausalLM.from_pretrained(out / "final")  # settings come from config.attnorm
    assert again.config._attn_implementation == "symax" and again.config.attnorm["eta_learnable"] is True
    ids = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(again.eval()(input_ids=ids).logits, conv.model.eval()(input_ids=ids).logits)


def test_full_fine_tuning_and_the_control_without_transfer(source, tmp_path):
    s = convert.run(_args(source, tmp_path / "o", "softmax1", "--transfer_steps", "0", "--finetune_steps", "4",
                          "--finetune_mode", "full", "--finetune_learning_rate", "1e-3", "--eval_stages",
                          "finetune", "--no_save_model"))
    assert s["stages"] == ["finetune"] and set(s["perplexity"]) == {"finetune"}
    assert s["trained"]["finetune"]["lora"] is False
    assert s["trained"]["finetune"]["parameters"] > 1_000_000  # every weight of the micro model, embeddings included
    assert s["command"].startswith("python scripts/convert.py --model_name_or_path ") and s["wall_seconds"] > 0


class _Stop(Exception):
    pass


@pytest.mark.long
@pytest.mark.parametrize("stage,at", [("transfer", 8), ("finetune", 7)])
def test_a_resumed_conversion_equals_an_uninterrupted_one(source, tmp_path, monkeypatch, stage, at):
    flags = ["--attnorm", "eta_learnable=true", "--transfer_steps", "10", "--finetune_steps", "10",
             "--checkpointing_steps", "5", "--eval_stages", "transfer,finetune"]
    whole = Converter(parse_args(_args(source, tmp_path / "whole", "symax", *flags)))
    expected = whole.run()

    original = Converter.batch

    def interrupted(self, which: str, step: int):
        if which == stage and step == at:
            raise _Stop
        return original(self, which, step)

    monkeypatch.setattr(Converter, "batch", interrupted)
    with pytest.raises(_Stop):
        Converter(parse_args(_args(source, tmp_path / "cut", "symax", *flags))).run()
    assert not (tmp_path / "cut" / "conversion.json").exists()
    monkeypatch.setattr(Converter, "batch", original)
    resumed = Converter(parse_args(_args(source, tmp_path / "cut", "symax", *flags, "--resume_from_checkpoint",
                                         "latest")))
    got = resumed.run()
    assert got["losses"] == expected["losses"]
    assert got["perplexity"] == expected["perplexity"]
    # the resumed run's load samples and CPU time continue the checkpoint's (every step sampled once)
    assert got["load_average_steps"]["steps"] == expected["load_average_steps"]["steps"] == 20
    assert got["cpu_seconds"]["run"] > got["cpu_seconds"]["transfer"] > 0
    a, b = whole.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------ continuation


def test_entmax15_walks_from_softmax_and_ends_as_entmax15(source, tmp_path):
    """entmax15's continuation: stage 1 runs alpha-entmax with alpha from 1.001 (softmax, nearly) to 1.5 over the
    first half of the steps, then entmax15 itself. Its first step's loss is the near-softmax start's, far below
    entmax15's own start error; keep-best measures only after the ramp; the model ends as entmax15."""
    flags = ("--transfer_steps", "4", "--finetune_steps", "0", "--transfer_eval_steps", "1", "--eval_stages",
             "swapped,transfer", "--continuation_fraction", "0.5", "--transfer_skip_error", "0")
    s = convert.run(_args(source, tmp_path / "o", "entmax15", *flags))
    cont = s["continuation"]
    assert cont["ran"] and cont["implementation"] == "entmax_alpha" and cont["ramp_steps"] == 2
    assert (cont["start"], cont["end"]) == (1.001, 1.5)
    first_loss = s["losses"]["transfer"][0][1]
    assert first_loss < 0.05 * s["transfer_check"]["start"], (first_loss, s["transfer_check"]["start"])
    assert [m[0] for m in s["transfer_check"]["measured"]] == [2, 3, 4]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "o" / "final")
    assert model.config._attn_implementation == "entmax15"
    # without it: stage 1 trains entmax15 from its first step
    s = convert.run(_args(source, tmp_path / "n", "entmax15", *flags, "--no-continuation"))
    assert not s["continuation"]["ran"] and s["continuation"]["why"] == "--no-continuation"
    assert s["losses"]["transfer"][0][1] > 0.5 * s["transfer_check"]["start"]


def test_ssmax_releases_its_anchor_from_softmax(source, tmp_path):
    """ssmax's continuation (a scale's, off by default: --continuation asks for it): stage 1 starts at ssmax_anchor =
    1, softmax exactly with the calibrated s_h in place, so its first loss is 0; the anchor is released to 0 over the
    ramp; the model ends as plain ssmax. Without the flag, stage 1 trains plain ssmax from its first step."""
    flags = ("--transfer_steps", "4", "--finetune_steps", "0", "--transfer_eval_steps", "1", "--eval_stages",
             "swapped,transfer", "--continuation_fraction", "0.5", "--transfer_skip_error", "0")
    s = convert.run(_args(source, tmp_path / "n", "ssmax", *flags, "--no_save_model"))
    assert not s["continuation"]["ran"] and "off by default" in s["continuation"]["why"]
    assert s["losses"]["transfer"][0][1] > 1e-6
    s = convert.run(_args(source, tmp_path / "o", "ssmax", *flags, "--continuation"))
    cont = s["continuation"]
    assert cont["ran"] and (cont["option"], cont["start"], cont["end"], cont["ramp_steps"]) == \
        ("ssmax_anchor", 1.0, 0.0, 2)
    assert s["losses"]["transfer"][0][1] < 1e-9 < s["losses"]["transfer"][1][1]
    assert [m[0] for m in s["transfer_check"]["measured"]] == [2, 3, 4]
    assert s["settings"]["ssmax_anchor"] == 0.0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "o" / "final")
    assert model.config.attnorm["ssmax_anchor"] == 0.0


@pytest.mark.parametrize("impl", [name for name in PRESETS if is_ours(name)])
def test_stage_1_learning_rate_is_the_measured_one_unless_given(impl, capsys):
    """Without --transfer_learning_rate stage 1 runs the rate measured for the normalizer (else its scale's), which
    convert.py names; with it, the given rate."""
    from hf_attnorm.lab.convert.args import TRANSFER_LR
    from hf_attnorm.lab.convert.recipes import normalizer_recipe, scale_recipe
    from hf_attnorm.settings import resolve_settings

    settings = resolve_settings(impl)
    declared = normalizer_recipe(settings.normalizer).transfer_learning_rate
    declared = scale_recipe(settings.scale).transfer_learning_rate if declared is None else declared
    a = parse_args(["--attn_implementation", impl, "--output_dir", "x"])
    assert a.transfer_learning_rate == (TRANSFER_LR if declared is None else declared)
    assert ("stage-1 learning rate" in capsys.readouterr().err) == (declared is not None)
    a = parse_args(["--attn_implementation", impl, "--output_dir", "x", "--transfer_learning_rate", "0.123"])
    assert a.transfer_learning_rate == 0.123


def test_continuations_are_planned_where_they_change_nothing_saved():
    from hf_attnorm.lab.convert.continuation import plan_continuation

    plan, _ = plan_continuation("sink", {"sink_learnable": False, "sink_init": 0.5}, 0.5)
    assert plan.implementation == "sink" and [plan.value_at(s, 4) for s in range(5)] == [-30.0, -14.75, 0.5, 0.5, 0.5]
    plan, why = plan_continuation("sink", {}, 0.5)  # a learned sink: training moves it
    assert plan is None and "learned per-head value sink_logit" in why
    plan, why = plan_continuation("symax", {}, 0.5)
    assert plan is None and "declares no continuation" in why
    plan, why = plan_continuation("ssmax", {}, 0.5)  # a scale's: the anchor released, off unless asked for
    assert plan is None and "scale ssmax's continuation is off by default" in why
    plan, _ = plan_continuation("ssmax", {}, 0.5, asked=True)
    assert (plan.implementation, plan.option, plan.start, plan.end) == ("ssmax", "ssmax_anchor", 1.0, 0.0)
    plan, why = plan_continuation("log_n", {}, 0.5)
    assert plan is None and "neither softmax nor scale log_n" in why
    with pytest.raises(ConvertError, match="--continuation_fraction must be in"):
        parse_args(["--attn_implementation", "entmax15", "--output_dir", "x", "--continuation_fraction", "1.5"])


@pytest.mark.long
def test_a_resumed_continuation_equals_an_uninterrupted_one(source, tmp_path, monkeypatch):
    """Interrupted inside the ramp: the resumed run sets the option the step needs and ends as the whole run."""
    flags = ["--transfer_steps", "6", "--finetune_steps", "0", "--checkpointing_steps", "2", "--eval_stages",
             "transfer", "--transfer_skip_error", "0"]
    whole = Converter(parse_args(_args(source, tmp_path / "whole", "entmax15", *flags)))
    expected = whole.run()
    original = Converter.batch

    def interrupted(self, which: str, step: int):
        if step == 3:
            raise _Stop
        return original(self, which, step)

    monkeypatch.setattr(Converter, "batch", interrupted)
    with pytest.raises(_Stop):
        Converter(parse_args(_args(source, tmp_path / "cut", "entmax15", *flags))).run()
    monkeypatch.setattr(Converter, "batch", original)
    got = Converter(parse_args(_args(source, tmp_path / "cut", "entmax15", *flags, "--resume_from_checkpoint",
                                     "latest"))).run()
    assert got["losses"] == expected["losses"] and got["perplexity"] == expected["perplexity"]


# ------------------------------------------------------------------------------------------------ held-out texts


def test_held_out_texts_are_scored_at_every_evaluation(source, tmp_path):
    text = tmp_path / "other.txt"
    text.write_text("The committee approved the budget for the new library after a long debate. " * 40)
    s = convert.run(_args(source, tmp_path / "o", "symax", "--transfer_steps", "1", "--finetune_steps", "1",
                          "--no_save_model", "--eval_texts", str(text)))
    scored = s["eval_texts"][str(text)]
    assert scored["description"] == "other.txt" and scored["tokens"] > 64
    assert set(scored["perplexity"]) == set(s["perplexity"]) == {"swapped", "transfer", "finetune"}
    for point, by_length in scored["perplexity"].items():
        assert set(by_length) == set(s["perplexity"][point]) and all(v > 1 for v in by_length.values())
        assert by_length != s["perplexity"][point]  # another text, another perplexity
    with pytest.raises(ConvertError, match="--eval_texts: 'nope' is neither a named held-out text \\(kjv\\)"):
        parse_args(["--attn_implementation", "symax", "--output_dir", "x", "--eval_texts", "nope"])


def test_resuming_with_other_flags_is_refused(source, tmp_path):
    out = tmp_path / "o"
    convert.run(_args(source, out, "ssmax", "--transfer_steps", "2", "--finetune_steps", "0", "--no_save_model"))
    with pytest.raises(ConvertError, match="other values of --transfer_steps"):
        convert.run(_args(source, out, "ssmax", "--transfer_steps", "3", "--finetune_steps", "0", "--no_save_model",
                          "--resume_from_checkpoint", "latest"))


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("extra,match", [
    (["--attn_implementation", "nosuch"], "'nosuch' is not an hf_attnorm implementation; registered: softmax"),
    (["--attn_implementation", "sdpa"], "'sdpa' is not an hf_attnorm implementation"),
    (["--attnorm", "nosuch=1"], "unknown option 'nosuch'"),
    (["--attnorm", "eta=-1"], "eta.*must be >= 0"),
    (["--transfer_lora_targets", "wq,k_proj"], r"LoRA targets \['wq'\] are not linear modules of this model; "
                                               "its linear modules: .*q_proj"),
    (["--transfer_lora_r", "0", "--attn_implementation", "softmax1"], "stage 1 has nothing to train"),
    (["--eval_lengths", "512"], "--eval_lengths up to 512 tokens, but the model has 128 positions"),
])
def test_bad_input_fails_before_training(source, tmp_path, extra, match):
    out = tmp_path / "o"
    argv = _args(source, out, "symax", "--transfer_steps", "2", "--finetune_steps", "2")
    with pytest.raises(ConvertError, match=match):
        convert.run([*argv, *extra])
    assert not (out / "final").exists() and not (out / convert.SUMMARY_FILE).exists()


def test_bad_input_fails_clearly(tmp_path, source):
    with pytest.raises(ConvertError, match="is not empty; pass --overwrite_output_dir"):
        (tmp_path / "full").mkdir()
        (tmp_path / "full" / "mine.txt").write_text("x")
        convert.run(_args(source, tmp_path / "full", "symax"))
    with pytest.raises(ConvertError, match="is not a folder"):
        convert.run(_args(tmp_path / "missing", tmp_path / "o", "symax"))
    from hf_attnorm.lab.model_zoo import build_model

    build_model("bert", "micro", attn_implementation="sdpa", seed=0).save_pretrained(tmp_path / "bert")
    with pytest.raises(ConvertError, match="without a causal-LM head"):
        convert.run(_args(tmp_path / "bert", tmp_path / "o2", "symax"))


def test_the_script_help_and_error_exit():
    env_cmd = [sys.executable, str(REPO / "scripts" / "convert.py")]
    helped = subprocess.run([*env_cmd, "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0
    assert "--transfer_steps" in helped.stdout and "--finetune_mode" in helped.stdout
    bad = subprocess.run([*env_cmd, "--attn_implementation", "nosuch", "--output_dir", "x"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("convert.py: error: --attn_implementation 'nosuch'")


def test_every_flag_has_help():
    for action in convert.build_parser()._actions:
        assert action.help, action.option_strings


# ------------------------------------------------------------------------------------- the published study

BENCH = REPO / "bench" / "convert"


def _study_runs() -> dict:
    """The study's own runs (the default budget, no lever): implementation -> kind -> seed -> conversion.json."""
    from hf_attnorm.lab.convert.study import parse_run_name

    runs: dict = {}
    for path in sorted((BENCH / "runs").glob("*/*/conversion.json")):
        kind, lever, budget, seed = parse_run_name(path.parent.name)
        if lever is None and budget == 1:
            runs.setdefault(path.parent.parent.name, {}).setdefault(kind, {})[seed] = json.loads(path.read_text())
    return runs


def test_the_published_study_is_generated_from_its_runs():
    """bench/convert/results.json's rows are what its run files aggregate to; results.md is its rendering; every
    implementation of the plan ran with every seed, both kinds, and recorded its command."""
    from hf_attnorm.lab.convert import study

    results = json.loads((BENCH / "results.json").read_text())
    runs = _study_runs()
    first, *longer = [str(n) for n in results["settings"]["eval_lengths"]]
    assert json.loads(json.dumps(study.aggregate(runs, first))) == results["rows"]
    assert list(results.get("longer", {})) == longer
    for length in longer:
        assert json.loads(json.dumps(study.aggregate(runs, length))) == results["longer"][length], length
    assert set(runs) == {study.REFERENCE, *results["plan"]}  # (the plan it ran: implementations added since wait)
    seeds = set(range(results["settings"]["seeds"]))
    for impl, kinds in runs.items():
        expected = {"control"} if impl == study.REFERENCE else \
            set(results["settings"].get("kinds", ("convert", "control")))
        assert set(kinds) == expected and all(set(by_seed) == seeds for by_seed in kinds.values()), impl
        for by_seed in kinds.values():
            for run in by_seed.values():
                assert run["command"].startswith("python scripts/convert.py") and run["wall_seconds"] > 0
                assert run["settings"] == {**run["settings"], **results["plan"].get(impl, {})}
    assert (BENCH / "results.md").read_text() == study.markdown(results)


def test_the_study_verdict_is_paired_by_seed():
    from hf_attnorm.lab.convert.study import verdict

    row = {"convert": {0: 10.0, 1: 20.0}, "control": {0: 20.0, 1: 40.0}}
    assert verdict(row).startswith("transfer helps: 50% lower")
    assert verdict({**row, "control": {0: 5.0, 1: 10.0}}).startswith("transfer hurts: 100% higher")
    assert verdict({**row, "control": {0: 5.0, 1: 40.0}}) == "no consistent difference between the seeds"
    assert verdict({"convert": {}, "control": {0: 5.0}}) == "no stage 1 (reference)"


@pytest.mark.long
@pytest.mark.slow
def test_two_processes_match_one_process(source, tmp_path):
    """accelerate launch, 2 gloo processes x 1 block per step = 1 process x 2 blocks: the same blocks per step, the
    gradients averaged over processes, so the same losses and the same converted weights."""
    import os

    flags = [*FAST, "--model_name_or_path", str(source), "--attn_implementation", "ssmax", "--transfer_steps", "4",
             "--finetune_steps", "4", "--eval_stages", "finetune", "--torch_threads", "1"]
    one = convert.run([*flags, "--per_device_train_batch_size", "2", "--output_dir", str(tmp_path / "one")])
    env = dict(os.environ, ACCELERATE_USE_CPU="true", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TQDM_DISABLE="1", OMP_NUM_THREADS="1")
    two = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
         "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
         str(REPO / "scripts" / "convert.py"), *flags, "--per_device_train_batch_size", "1", "--output_dir",
         str(tmp_path / "two")], env=env, cwd=str(REPO), capture_output=True, text=True, timeout=900)
    assert two.returncode == 0, (two.stdout + two.stderr)[-4000:]
    got = json.loads((tmp_path / "two" / convert.SUMMARY_FILE).read_text())
    assert got["processes"] == 2 and one["processes"] == 1 and got["tokens_per_step"] == one["tokens_per_step"]
    for stage in ("transfer", "finetune"):
        a = torch.tensor([v for _, v in one["losses"][stage]])
        b = torch.tensor([v for _, v in got["losses"][stage]])
        # the gradients are reduced in another order; Adam turns such float differences of near-zero gradients
        # into full steps, so the losses (about 10.8) agree to ~3e-4 after 4 steps, not to float precision
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (stage, (a - b).abs().max())
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    wb = load_file(str(tmp_path / "two" / "final" / "model.safetensors"))
    assert wa.keys() == wb.keys() and max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-3


def test_the_claim_finding_compares_the_linearised_model_with_the_softmax_fine_tune():
    from hf_attnorm.lab.convert.study import CLAIM_SUBJECT, claim_finding

    rows = {"softmax": {"convert": {}, "control": {0: 10.0, 1: 10.0}},
            CLAIM_SUBJECT: {"convert": {0: 15.0, 1: 25.0}, "control": {0: 30.0, 1: 40.0},
                            "verdict": "transfer helps"}}
    assert claim_finding({"rows": rows}).endswith("2.0x that of the softmax model fine-tuned as long: the quality "
                                                  "is recovered")
    rows[CLAIM_SUBJECT]["convert"] = {0: 30.0, 1: 31.0}
    assert "not recovered at this budget" in claim_finding({"rows": rows})
    assert claim_finding({"rows": {}}).startswith("not measured")


def test_the_study_renders_each_evaluated_context():
    """Runs scored at 512 and 2048 tokens: rows at 512, ``longer["2048"]`` from the 2048 perplexities, a table and
    a summary for each; a context that was not evaluated is a clear error."""
    from hf_attnorm.lab.convert import study

    def run(ppl_512: float, ppl_2048: float, kind: str) -> dict:
        points = {"finetune": {"512": ppl_512, "2048": ppl_2048}}
        if kind == "convert":
            points["transfer"] = {"512": 2 * ppl_512, "2048": 2 * ppl_2048}
        return {"perplexity": points, "layer_errors": {}, "wall_seconds": 60.0}

    runs = {"softmax": {"control": {0: run(10.0, 12.0, "control"), 1: run(10.0, 12.0, "control")}},
            "ssmax": {"convert": {0: run(20.0, 30.0, "convert"), 1: run(22.0, 50.0, "convert")},
                      "control": {0: run(30.0, 25.0, "control"), 1: run(33.0, 45.0, "control")}}}
    settings = {"eval_lengths": [512, 2048], "block_size": 512, "transfer_steps": 20, "finetune_steps": 20}
    results = {"settings": settings, "rows": study.aggregate(runs, "512"),
               "longer": {"2048": study.aggregate(runs, "2048")}}
    assert results["rows"]["ssmax"]["verdict"].startswith("transfer helps")
    assert results["longer"]["2048"]["ssmax"]["verdict"].startswith("transfer hurts")
    assert study.rows_at(results, 2048) is results["longer"]["2048"] and study.rows_at(results) is results["rows"]
    text = study.markdown(results)
    assert text.count("| implementation |") == 2
    assert "Scored at 2048 tokens (4x the blocks trained on). At 20 + 20 steps" in text
    assert "| `ssmax` | — | 80 [60, 100] | 40 [30, 50] | 35 [25, 45] |" in study.table(results, "2048")
    with pytest.raises(KeyError, match="no perplexity at 4096 tokens.*evaluated: \\[512, 2048\\]"):
        study.rows_at(results, 4096)


def test_the_study_with_calibrated_starts_reports_its_goals():
    """A study with calibrated starts, distillation and a second text: the full table's columns, the other text's
    table from each run's --eval_texts, and each goal met, not met, or not measured from the numbers."""
    from hf_attnorm.lab.convert import study

    def run(final: float, *, swapped=None, calibrated=None, transfer=None, scale=1.0) -> dict:
        points = {"finetune": final}
        points.update({k: v for k, v in (("swapped", swapped), ("calibrated", calibrated), ("transfer", transfer))
                       if v is not None})
        ppl = {k: {"512": v, "2048": v * 0.8} for k, v in points.items()}
        other = {k: {n: v * scale for n, v in by.items()} for k, by in ppl.items()}
        return {"perplexity": ppl, "eval_texts": {"kjv": {"perplexity": other}}, "layer_errors": {},
                "wall_seconds": 120.0, "peak_rss_mb": {"load": 1000.0, "transfer": 2048.0}}

    runs = {"softmax": {"control": {0: run(10.0, swapped=12.0, scale=3), 1: run(10.0, scale=3)}},
            "ssmax": {"convert": {0: run(11.0, swapped=900.0, calibrated=13.0, transfer=12.5), 1: run(11.2)},
                      "distill": {0: run(10.8), 1: run(10.9)}, "control": {0: run(12.0), 1: run(12.0)}},
            "hedgehog": {"convert": {0: run(50.0, swapped=3000.0), 1: run(60.0)},
                         "control": {0: run(80.0), 1: run(55.0)}}}
    settings = {"eval_lengths": [512, 2048], "block_size": 512, "transfer_steps": 20, "finetune_steps": 20,
                "kinds": list(study.KINDS)}
    results = {"settings": settings, "rows": study.aggregate(runs, "512"),
               "longer": {"2048": study.aggregate(runs, "2048")}, "other_text": "Luke and Acts",
               "texts": {"kjv": {n: study.aggregate(runs, n, "kjv") for n in ("512", "2048")}}}
    main = study.table(results)
    assert "| `ssmax` | 900 | 13 | 12.5 | 11.1 [11, 11.2] | 10.9 [10.8, 10.9] | 12 [12, 12] | 2.0 | 2.0 |" in main
    assert "| `hedgehog` | 3000 | — | — | 55 [50, 60] | — | 67.5 [55, 80] | 2.0 | 2.0 |" in main
    other = study.text_table(results, "kjv", "512")
    assert other.startswith("On Luke and Acts (never trained on), at 512 tokens, attention transfer before "
                            "fine-tuning gave lower perplexity than fine-tuning alone, on every seed, for `ssmax`; "
                            "no consistent difference for `hedgehog`.")
    assert "| `softmax` | 36 | — | — | — | — | 30 [30, 30] |" in other
    met = {goal.split(" ")[0] + goal.split(" ")[1]: (ok, detail) for goal, ok, detail in study.goals(results)}
    assert met["adapted:at"][0] is None or met["adapted:at"][0] is False  # 1 of 5 measured: ssmax 1.12x
    assert met["adapted:at"][1].startswith("1 (worst") and "`ssmax` 1.12x" in met["adapted:at"][1]
    # recovered: the distilled runs on the second text over the original's there (36 at 512: 10.9 / 36), not
    # decided while softmax1 has no run
    assert met["recovered:softmax1"] == (None, "worst seed: `ssmax` 0.303x at 512, 0.303x at 2048")
    assert met["recoveredon"][0] is None and met["everycurve"][0] is None  # (no curve given)
    # the finding cell gives the distilled recipe's paired verdict against the same control
    assert "transfer helps: 8% lower perplexity than fine-tuning alone (every seed); distilled: helps: 10% lower" \
        in main
    assert met["ssmaxcalibrated"] == (True, "13 against the original's 12 (1.08x)")
    assert met["sigmoidand"][0] is None
    assert met["attentiontransfer"][0] is None
    assert "`hedgehog` not every seed at 512, not every seed at 2048" in met["attentiontransfer"][1]
    # winning at the training context is not enough: every evaluated context counts
    import copy

    mixed = copy.deepcopy(results)
    for impl in ("hedgehog", "symax"):
        mixed["rows"][impl] = {"convert": {0: 1.0, 1: 1.0}, "control": {0: 2.0, 1: 2.0}}
        mixed["longer"]["2048"][impl] = {"convert": {0: 1.0, 1: 1.0}, "control": {0: 2.0, 1: 2.0}}
    assert study.goals(mixed)[-1][1] is True
    mixed["longer"]["2048"]["symax"]["control"] = {0: 2.0, 1: 0.5}
    goal, ok, detail = study.goals(mixed)[-1]
    assert ok is False and "`symax` every seed at 512, not every seed at 2048" in detail, detail
    assert "Goals:" in study.markdown(results)


def test_the_study_rebuilds_its_results_from_cached_runs(tmp_path):
    """``--aggregate_only`` runs nothing: results.json and results.md come from the cached conversion.json files,
    a run that never ran is left out, and the command recorded is the study's own (without the flag)."""
    from hf_attnorm.lab.convert import study
    from hf_attnorm.lab.convert import study_cli as conversion_study_cli

    def write(impl: str, kind: str, seed: int, final: float) -> None:
        folder = tmp_path / "runs" / impl / f"{kind}-seed{seed}"
        folder.mkdir(parents=True)
        ppl = {"finetune": {"512": final, "2048": final}}
        summary = {"perplexity": ppl, "eval_texts": {"kjv": {"perplexity": ppl}}, "layer_errors": {},
                   "wall_seconds": 10.0, "peak_rss_mb": {"finetune": 100.0}}
        (folder / convert.SUMMARY_FILE).write_text(json.dumps(summary))

    write("softmax", "control", 0, 10.0)
    write("ssmax", "convert", 0, 11.0)
    write("ssmax", "control", 0, 12.0)
    argv = ["--output_dir", str(tmp_path), "--implementations", "ssmax", "--seeds", "1", "--kinds", "convert",
            "control", "--aggregate_only"]
    assert conversion_study_cli.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    # (the output folder as published: relative, or the default folder for one outside the working directory)
    shown = ["--output_dir", conversion_study_cli.shown_root(tmp_path), *argv[2:-1]]
    assert shown[1] == "runs/convert_study"
    assert results["command"] == "python scripts/convert_study.py " + " ".join(shown)
    assert results["rows"]["ssmax"]["convert"] == {"0": 11.0} and results["rows"]["ssmax"]["verdict"].startswith(
        "transfer helps")
    assert results["texts"]["kjv"]["2048"]["ssmax"]["control"] == {"0": 12.0}
    assert (tmp_path / "results.md").read_text() == study.markdown(results)
    assert not (tmp_path / "runs" / "ssmax" / "distill-seed0").exists()


# ------------------------------------------------------------------------------------------- --distill


def test_the_top_k_kl_is_the_kl_of_the_coarsened_distributions():
    """Against an independent computation: with k = V the full KL(p || q) = sum p (log p - log q); with k < V the
    KL between p and q merged into the teacher's top-k tokens and one outcome for the rest, which is at most the full
    KL; 0 for equal logits; float32 inside for bf16 logits."""
    from hf_attnorm.lab.convert.distill import teacher_top_k, top_k_kl

    g = torch.Generator().manual_seed(0)
    t, s = torch.randn(2, 5, 40, generator=g) * 3, torch.randn(2, 5, 40, generator=g) * 3
    p, q = torch.softmax(t.double(), -1), torch.softmax(s.double(), -1)
    full = (p * (p.log() - q.log())).sum(-1).mean()
    torch.testing.assert_close(top_k_kl(s, teacher_top_k(t, 40)).double(), full, rtol=1e-5, atol=1e-6)
    idx = p.topk(7, -1).indices
    p7 = torch.cat([p.gather(-1, idx), 1 - p.gather(-1, idx).sum(-1, keepdim=True)], -1)
    q7 = torch.cat([q.gather(-1, idx), 1 - q.gather(-1, idx).sum(-1, keepdim=True)], -1)
    coarse = (p7 * (p7.log() - q7.log())).sum(-1).mean()
    got = top_k_kl(s, teacher_top_k(t, 7)).double()
    torch.testing.assert_close(got, coarse, rtol=1e-5, atol=1e-6)
    assert 0 < got < full
    assert top_k_kl(t.bfloat16(), teacher_top_k(t.bfloat16(), 7)).abs() < 1e-6
    leaf = s.clone().requires_grad_(True)
    top_k_kl(leaf, teacher_top_k(t, 40)).backward()
    assert torch.isfinite(leaf.grad).all() and leaf.grad.abs().sum() > 0


@pytest.fixture(scope="module")
def sharp_source(source, tmp_path_factory) -> Path:
    """``source`` with its output layer scaled up: a fresh init's next-token distributions are near-uniform (every
    KL ~1e-7), a trained model's are not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("sharp")
    model = AutoModelForCausalLM.from_pretrained(source)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def _distilled(source: Path, out: Path, implementation: str, *extra: str) -> dict:
    return convert.run(_args(source, out, implementation, "--transfer_steps", "0", "--finetune_steps", "3",
                             "--no_save_model", "--distill", "--distill_top_k", "16", "--eval_stages", "finetune",
                             *extra))


def test_the_teacher_is_the_original_model_and_softmax_starts_at_zero(sharp_source, tmp_path):
    """The cached teacher of a symax conversion is the original (eager) model's distribution on the same batch, not
    symax's; hf_attnorm's softmax computes what the teacher computes, so its first KL is 0. The summary records the
    cache (3 steps x 1 block x 32 positions x 16 tokens)."""
    from transformers import AutoModelForCausalLM

    from hf_attnorm.lab.convert.distill import teacher_top_k, top_k_kl

    flags = ("--transfer_steps", "0", "--finetune_steps", "3", "--no_save_model", "--distill", "--distill_top_k",
             "16")
    conv = Converter(parse_args(_args(sharp_source, tmp_path / "c", "symax", *flags)))
    teacher = conv._record_teacher()
    ids = conv.batch("finetune", 1)
    original = AutoModelForCausalLM.from_pretrained(sharp_source, attn_implementation="eager").eval()
    with torch.no_grad():
        want = teacher_top_k(original(input_ids=ids).logits, 16)
        student = conv.model(input_ids=ids).logits
    assert torch.equal(teacher[1].indices, want.indices)
    torch.testing.assert_close(teacher[1].log_probs, want.log_probs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(teacher[1].rest, want.rest, rtol=1e-4, atol=1e-4)
    assert top_k_kl(student, teacher[1]) > 1e-7  # symax is not the teacher
    assert conv.history.distill["cache_mb"] == round(3 * 32 * (16 * (4 + 8) + 4) / 2**20, 2)
    same = _distilled(sharp_source, tmp_path / "softmax", "softmax")
    assert abs(same["losses"]["finetune"][0][1]) < 1e-6, same["losses"]["finetune"]
    new = _distilled(sharp_source, tmp_path / "symax", "symax")
    assert new["distill"]["top_k"] == 16 and new["distill"]["weight"] == 1.0
    plain = convert.run(_args(sharp_source, tmp_path / "plain", "symax", "--transfer_steps", "0", "--finetune_steps",
                              "3", "--no_save_model", "--eval_stages", "finetune"))
    mixed = _distilled(sharp_source, tmp_path / "mixed", "symax", "--distill_weight", "0.5")
    first = [r["losses"]["finetune"][0][1] for r in (new, plain, mixed)]
    assert first[2] == pytest.approx(0.5 * first[0] + 0.5 * first[1], rel=1e-4, abs=1e-6)
    assert plain["distill"] == {}


def test_a_resumed_distillation_equals_an_uninterrupted_one(source, tmp_path, monkeypatch):
    """A resume inside stage 2 recomputes the teacher from the original weights (before rebuilding stage 1)."""
    flags = ["--transfer_steps", "4", "--finetune_steps", "6", "--checkpointing_steps", "2", "--distill",
             "--distill_top_k", "8", "--eval_stages", "finetune", "--no_save_model"]
    expected = convert.run(_args(source, tmp_path / "whole", "symax", *flags))
    original = Converter.batch

    def interrupted(self, which: str, step: int):
        if which == "finetune" and step == 5 and self.history.stage == "finetune":
            raise _Stop
        return original(self, which, step)

    monkeypatch.setattr(Converter, "batch", interrupted)
    with pytest.raises(_Stop):
        convert.run(_args(source, tmp_path / "cut", "symax", *flags))
    monkeypatch.setattr(Converter, "batch", original)
    got = convert.run(_args(source, tmp_path / "cut", "symax", *flags, "--resume_from_checkpoint", "latest"))
    assert got["losses"] == expected["losses"] and got["perplexity"] == expected["perplexity"]


# --------------------------------------------------------------------------- the two verdicts and the budget curve


def test_run_names_round_trip():
    from hf_attnorm.lab.convert import study

    for kind in study.KINDS:
        for lever in (None, *study.LEVERS):
            for budget in study.CURVE_BUDGETS:
                name = study.run_name(kind, 1, budget, lever)
                assert study.parse_run_name(name) == (kind, lever, budget, 1), name
    assert study.run_name("distill", 0) == "distill-seed0" and study.run_name("distill", 1, 4) == "distill-x4-seed1"
    for other in ("distill", "distill-seedx", "nosuch-seed0", "distill-other-x4-seed0", "distill-xy-seed0"):
        assert study.parse_run_name(other) is None, other
    assert study.curve_steps((20, 20), 4) == (80, 80)
    assert study.curve_steps((20, 20), 4, "stage1-3of4") == (120, 40)
    assert [study.curve_seeds(b) for b in study.CURVE_BUDGETS] == [2, 2, 1, 1]


def _fake_run(final: dict, tokens_steps: tuple[int, int], in_domain: float = 30.0) -> dict:
    """A conversion.json of a distilled run: final perplexity on the second text per context."""
    from hf_attnorm.lab.convert.study import OTHER_TEXT

    return {"steps": {"transfer": tokens_steps[0], "finetune": tokens_steps[1]}, "tokens_per_step": 512,
            "perplexity": {"finetune": {n: in_domain for n in final}},
            "eval_texts": {OTHER_TEXT: {"perplexity": {"finetune": dict(final),
                                                       "transfer": {n: 2 * v for n, v in final.items()}}}},
            "wall_seconds": 60.0, "cpu_seconds": {"run": 100.0}, "load_average_start": 1.0,
            "load_average_steps": {"mean": 2.5, "max": 3.0, "steps": 40}, "load_average_end": 2.0,
            "command": "python scripts/convert.py --output_dir /abs/study/runs/entmax15/distill-seed0"}


def test_the_curve_says_where_each_implementation_first_comes_within_reach():
    """Per budget the ratio to the original on every seed; "first within" is the first budget at which every seed
    is within 10%, and a lever moves the curve left only when it is lower on every paired budget and seed."""
    from hf_attnorm.lab.convert import study

    original = {"512": 20.0, "2048": 10.0}
    found = {"default": {
        "entmax15": {1: {0: _fake_run({"512": 40.0, "2048": 30.0}, (20, 20)),
                         1: _fake_run({"512": 30.0, "2048": 20.0}, (20, 20))},
                     4: {0: _fake_run({"512": 21.0, "2048": 10.8}, (80, 80)),
                         1: _fake_run({"512": 23.0, "2048": 10.5}, (80, 80))},  # seed 1 at 512: 1.15x
                     16: {0: _fake_run({"512": 21.6, "2048": 12.0}, (320, 320))}}},
        "full": {"entmax15": {1: {0: _fake_run({"512": 39.0, "2048": 25.0}, (20, 20)),
                                  1: _fake_run({"512": 31.0, "2048": 19.0}, (20, 20))}}}}
    curves = study.curve_rows(found, original, ["512", "2048"])
    row = curves["default"]["entmax15"]
    assert row["budgets"]["4"]["tokens"] == 160 * 512 and row["budgets"]["1"]["ratio"]["512"] == {0: 2.0, 1: 1.5}
    assert row["first_within"] == {"512": 320 * 2 * 512, "2048": 160 * 512}  # (2048: within at 4x, not at 16x)
    assert row["budgets"]["1"]["runs"][0]["load_average"] == [1.0, 2.5, 2.0]
    results = {"curves": curves, "settings": {"eval_lengths": [512, 2048], "seeds": {"1": 2, "4": 2, "16": 1}},
               "original": original, "text": "a text", "levers": {"full": {"description": "every weight"}}}
    table = study.curve_table(results, "512")
    assert "| `entmax15` | 1.75 [1.5, 2] | 1.1 [1.05, 1.15] | 1.08 | not measured | 328k tokens |" in table, table
    assert "20k tokens (1x, 2 seeds)" in table and "(16x, 1 seed)" in table
    assert "1.3M tokens (64x, ? seeds)" in table  # (a budget not run yet: a column, its tokens, not measured)
    one_seed = {"curves": study.curve_rows({"default": {"ssmax": {4: found["default"]["entmax15"][4]}},
                                            "full": found["full"]}, original, ["512"]),
                "settings": {"eval_lengths": [512], "seeds": {"1": 2, "4": 2}}}
    del one_seed["curves"]["default"]["ssmax"]["budgets"]["4"]["ratio"]["512"][1]
    assert "| `ssmax` | not measured | 1.05 (1 of 2 seeds) | not measured | not measured | not within 82k tokens " \
        "(16x, 64x not measured) |" in study.curve_table(one_seed, "512"), study.curve_table(one_seed, "512")
    assert "(4x, 2 seeds)" not in study.curve_table(one_seed, "512", "full")  # a lever's table: the budgets it ran
    (lever, impl, left, words), = study.lever_findings(results, "512")
    assert (lever, impl, left) == ("full", "entmax15", False) and "1x seed 1: 1.55 against 1.5" in words
    assert study.lever_findings(results, "2048")[0][2] is True
    # lower on the one seed measured of two: not decided; higher on it: decided
    partial = {**results, "curves": {**curves, "full": study.curve_rows(
        {"full": {"entmax15": {1: {0: found["full"]["entmax15"][1][0]}}}}, original, ["512", "2048"])["full"]}}
    (_, _, left, words), = study.lever_findings(partial, "2048")
    assert left is None and words.endswith("(not every seed measured at 1x)"), words
    assert study.lever_findings(partial, "512")[0][2] is None  # (39 / 20 against 40 / 20: lower)
    partial["curves"]["full"]["entmax15"]["budgets"]["1"]["ratio"]["512"][0] = 2.5
    assert study.lever_findings(partial, "512")[0][2] is False
    text = study.curve_markdown(results)
    assert "`full` on `entmax15` at 2048 tokens: moves the curve left" in text
    # nothing within reach: the largest budget measured is named
    assert study._first_within_text(curves["full"]["entmax15"], "512") == \
        "not within 20k tokens (4x, 16x, 64x not measured)"


def test_the_two_verdicts_compare_with_the_original_and_with_the_fine_tune():
    """Recovered: the distilled conversion over the original model on the second text; adapted: the next-token
    conversion over the softmax fine-tune of the same seed on the training text; each in words by its worst seed."""
    from hf_attnorm.lab.convert import study

    def rows(distill: dict, convert_: dict, control: dict) -> dict:
        return {"softmax": {"swapped": 20.0, "convert": {}, "distill": {}, "control": control},
                "ssmax": {"swapped": 900.0, "convert": convert_, "distill": distill, "control": {}}}

    results = {"settings": {"eval_lengths": [512, 2048]},
               "rows": rows({}, {0: 33.0, 1: 30.0}, {0: 30.0, 1: 30.0}),
               "longer": {"2048": rows({}, {0: 20.0, 1: 21.0}, {0: 20.0, 1: 20.0})},
               "texts": {study.OTHER_TEXT: {"512": rows({0: 20.5, 1: 21.0}, {}, {}),
                                            "2048": {**rows({0: 10.2, 1: 10.4}, {}, {}),
                                                     "softmax": {"swapped": 10.0, "control": {}}}}}}
    rec, ada = study.recovered(results, "ssmax"), study.adapted(results, "ssmax")
    assert rec["512"] == {0: 20.5 / 20, 1: 21.0 / 20} and rec["2048"] == pytest.approx({0: 1.02, 1: 1.04})
    assert ada["512"] == {0: 1.1, 1: 1.0} and ada["2048"] == {0: 1.0, 1: 1.05}
    assert study.verdict_words(rec, ["512", "2048"], "the original") == "within 5% of the original"
    assert study.verdict_words(ada, ["512", "2048"], "the fine-tune") == "within 10% of the fine-tune"
    assert study.verdict_words({"512": {0: 1.5}}, ["512", "2048"], "x") == "not measured"
    assert study.verdict_words({"512": {0: 1.5}, "2048": {0: 1.2}}, ["512", "2048"], "x") == "1.5× x at worst"


def test_published_commands_name_relative_folders():
    from hf_attnorm.lab.convert.study import published_command

    assert published_command("python scripts/convert.py --seed 0 --output_dir /m/study3/runs/ssmax/distill-x4-seed0 "
                             "--no_save_model") == ("python scripts/convert.py --seed 0 --output_dir "
                                                    "runs/convert_study/runs/ssmax/distill-x4-seed0 --no_save_model")
    assert published_command("python scripts/convert_study.py --output_dir /m/study3 --budgets 4") == \
        "python scripts/convert_study.py --output_dir runs/convert_study --budgets 4"
    assert published_command("python scripts/convert.py --output_dir=/m/lr/ssmax-5e-3") == \
        "python scripts/convert.py --output_dir=runs/ssmax-5e-3"
    relative = "python scripts/convert.py --output_dir runs/x --seed 1"
    assert published_command(relative) == relative


def test_the_published_curve_is_generated_from_its_runs():
    """bench/convert/curve.json's curves are what the run files under bench/convert/runs aggregate to, scored
    against the original model's perplexity of the reference run; curve.md is its rendering; each plot exists;
    every run recorded its command, CPU time and the load it ran under."""
    from hf_attnorm.lab.convert import study

    path = BENCH / "curve.json"
    if not path.is_file():
        pytest.skip("no budget curve published")
    curve = json.loads(path.read_text())
    lengths = [str(n) for n in curve["settings"]["eval_lengths"]]
    reference = json.loads((BENCH / "runs" / study.REFERENCE / "control-seed0" / "conversion.json").read_text())
    assert curve["original"] == {n: study._ppl(reference, "swapped", n, study.OTHER_TEXT) for n in lengths}
    found = study.collect_curve_runs(BENCH / "runs")
    assert json.loads(json.dumps(study.curve_rows(found, curve["original"], lengths))) == curve["curves"]
    assert (BENCH / "curve.md").read_text() == study.curve_markdown(curve)
    assert all((BENCH / f"curve_{n}.png").is_file() for n in lengths)
    for rows in curve["curves"].values():
        for row in rows.values():
            for budget, cell in row["budgets"].items():
                for run in cell["runs"].values():
                    assert run["command"].startswith("python scripts/convert.py") and run["wall_seconds"] > 0
                    if int(budget) > 1:  # (the default budget's runs predate the CPU time's recording)
                        assert run["cpu_seconds"] > 0 and run["load_average"][1] is not None


def test_the_study_runs_each_curve_run_once_and_resumes_a_killed_one(tmp_path, monkeypatch):
    """``convert_study._one``: a run with its conversion.json is read, not run; a curve run from 16x whose folder
    holds a checkpoint resumes it (``--resume_from_checkpoint latest``, no overwrite); shorter ones start over; the
    steps, keep-best points and checkpoints scale with the budget, and the recorded command names the folder
    relative to the study's. (convert.run itself is replaced: the resumption it does is tested above on a real
    conversion; here what the study asks of it.)"""
    import argparse

    from hf_attnorm.lab.convert import study_cli as cli

    calls = []

    def fake_run(argv, shown=None):
        calls.append((list(argv), list(shown)))
        folder = Path(argv[argv.index("--output_dir") + 1])
        folder.mkdir(parents=True, exist_ok=True)
        summary = {"perplexity": {}, "wall_seconds": 1.0, "command": "python scripts/convert.py " + " ".join(shown)}
        (folder / convert.SUMMARY_FILE).write_text(json.dumps(summary))
        return summary

    monkeypatch.setattr(cli.convert, "run", fake_run)
    monkeypatch.chdir(tmp_path)
    a = argparse.Namespace(aggregate_only=False, eval_tokens=4096, eval_lengths=[512, 2048])
    out = Path("study")
    killed = out / "runs" / "entmax15" / "distill-x16-seed0"
    (killed / convert.CHECKPOINTS / "finetune_000080").mkdir(parents=True)
    (killed / "conversion_args.json").write_text("{}")
    cli._one(out, "entmax15", "distill", 0, a, (20, 20), budget=16)
    cli._one(out, "entmax15", "distill", 1, a, (20, 20), budget=4, lever="full")
    cli._one(out, "entmax15", "distill", 1, a, (20, 20), budget=4, lever="full")  # cached now: not run again
    assert len(calls) == 2
    (argv16, shown16), (argv4, _) = calls

    def flag(argv, name):
        return argv[argv.index(name) + 1]

    assert flag(argv16, "--transfer_steps") == flag(argv16, "--finetune_steps") == "320"
    assert flag(argv16, "--transfer_eval_steps") == flag(argv16, "--checkpointing_steps") == "80"
    assert flag(argv16, "--resume_from_checkpoint") == "latest" and "--overwrite_output_dir" not in argv16
    assert flag(shown16, "--output_dir") == "study/runs/entmax15/distill-x16-seed0" and "--distill" in argv16
    assert flag(argv4, "--transfer_steps") == "80" and flag(argv4, "--checkpointing_steps") == "0"
    assert flag(argv4, "--finetune_mode") == "full" and "--overwrite_output_dir" in argv4
    assert "--resume_from_checkpoint" not in argv4
    assert flag(argv4, "--output_dir").endswith("runs/entmax15/distill-full-x4-seed1")
