"""The stacks researchers train with: PEFT (LoRA + modules_to_save), DeepSpeed ZeRO-3 and torch FSDP2.

The multi-process tests run 2 torchrun processes on the CPU (gloo) with the workers in ``tests/multiproc/`` and
compare losses, learned per-head values and the saved model with one process doing the same steps on the whole
batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_attnorm import AttnormError
from hf_attnorm.lab.model_zoo import build_model

REPO = Path(__file__).resolve().parent.parent
DIST = Path(__file__).resolve().parent / "multiproc"

#: implementation, attnorm settings: every kind of learnable per-head value the presets have
LEARNABLE = [("ssmax", {}), ("sink", {}), ("symax", {"eta_learnable": True})]


def _batch(seed: int = 1, size: int = 4, length: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (size, length), generator=g)


def _attnorm_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".attnorm." in n}


# ------------------------------------------------------------------------------------------------------- PEFT


@pytest.mark.parametrize("implementation,attnorm", LEARNABLE)
def test_peft_lora_with_modules_to_save_trains_saves_reloads_and_merges(tmp_path, implementation, attnorm):
    """``modules_to_save=["attnorm"]``: the per-head values train beside LoRA, go into the adapter file, come back
    with ``PeftModel.from_pretrained`` and survive ``merge_and_unload`` + ``save_pretrained``."""
    peft = pytest.importorskip("peft", reason="peft is not installed (a dev dependency: pip install peft)")
    from safetensors.torch import load_file

    base = build_model("llama", "micro", attn_implementation=implementation, attnorm=attnorm or None, seed=0)
    init = _attnorm_values(base)
    assert init, "the preset must have learnable per-head values"
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                      modules_to_save=["attnorm"]))
    trainable = [n for n, p in model.named_parameters() if ".attnorm." in n and p.requires_grad]
    assert len(trainable) == len(init) and all(".modules_to_save.default." in n for n in trainable)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    x = _batch()
    for _ in range(3):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    trained = {n.replace("base_model.model.", "").replace(".modules_to_save.default", ""): p.detach().clone()
               for n, p in model.named_parameters() if ".modules_to_save.default." in n}
    assert trained.keys() == init.keys()
    assert all((trained[n] - init[n]).abs().max() > 1e-3 for n in init), "the per-head values did not train"
    with torch.no_grad():
        ref = model(input_ids=x).logits
        with model.disable_adapter():  # the base model's own (untrained) values are what the disabled path uses
            plain = model(input_ids=x).logits
    fresh = build_model("llama", "micro", attn_implementation=implementation, attnorm=attnorm or None, seed=0)
    with torch.no_grad():
        assert torch.equal(plain, fresh(input_ids=x).logits)

    model.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert sorted(k for k in saved if ".attnorm." in k) == sorted(f"base_model.model.{n}" for n in init)

    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=x).logits, ref, rtol=0, atol=1e-6)
    merged = loaded.merge_and_unload()
    assert _attnorm_values(merged).keys() == trained.keys()
    assert all(torch.equal(v, trained[n]) for n, v in _attnorm_values(merged).items())
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=x).logits, ref, rtol=0, atol=1e-5)  # LoRA merge rounding only
    merged.save_pretrained(tmp_path / "merged")
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert all(torch.equal(v, trained[n]) for n, v in _attnorm_values(again).items())


def test_missing_state_is_a_clear_error_not_a_lazy_creation():
    """A module called with one of our names but without its state raises (it is never created at first forward,
    where it would replace PEFT's wrapper and escape an optimizer built before)."""
    model = build_model("llama", "micro", attn_implementation="sdpa", seed=0)
    model.config._attn_implementation = "ssmax"  # bypasses set_attn_implementation: no state is installed
    x = _batch(size=1)
    with pytest.raises(AttnormError, match=r"carries no hf_attnorm state.*set_attn_implementation"):
        model(input_ids=x)
    assert not [n for n, _ in model.named_parameters() if ".attnorm." in n]
    model.set_attn_implementation("ssmax")  # the supported way
    assert len(_attnorm_values(model)) == model.config.num_hidden_layers
    model(input_ids=x)


def test_meta_values_are_materialised_at_their_initial_values_and_loaded_ones_kept():
    """What ``from_pretrained`` does after FSDP low-memory loading (the 2-process test runs the real thing)."""
    from hf_attnorm.hf.distributed import materialize_meta_states

    model = build_model("llama", "micro", attn_implementation="sink", attnorm={"sink_init": 0.5}, seed=0)
    states = [layer.self_attn.attnorm for layer in model.model.layers]
    with torch.no_grad():
        states[1].sink_logit.fill_(-2.0)  # a "loaded" value
    states[0]._parameters["sink_logit"] = torch.nn.Parameter(torch.empty(states[0].num_heads, device="meta"))
    assert materialize_meta_states(model) == ["model.layers.0.self_attn.attnorm.sink_logit"]
    assert states[0].sink_logit.device.type == "cpu" and states[0].sink_logit.requires_grad
    assert torch.equal(states[0].sink_logit, torch.full((states[0].num_heads,), 0.5))
    assert torch.equal(states[1].sink_logit, torch.full((states[1].num_heads,), -2.0))
    assert materialize_meta_states(model) == []


# ------------------------------------------------------------------------------------------- two processes


def _torchrun(worker: str, args: list[str], extra_env: dict[str, str] | None = None) -> None:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1", **(extra_env or {}))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(DIST / worker), *args], env=env, cwd=str(REPO), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]


def _single_process(model_dir: Path, implementation: str, attnorm: dict, batch: torch.Tensor, steps: int,
                    lr: float, groups) -> tuple[list[float], torch.nn.Module]:
    """The reference: one process, the whole batch, the same optimizer steps."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=implementation, attnorm=attnorm,
                                                 dtype=torch.float32)
    opt = torch.optim.AdamW(groups(model), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def _compare_saved(final: Path, reference: torch.nn.Module, batch: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(final)
    ref_sd = reference.state_dict()
    worst = max((v - ref_sd[k]).abs().max().item() for k, v in again.state_dict().items())
    with torch.no_grad():
        logits = (again(input_ids=batch).logits - reference(input_ids=batch).logits).abs().max().item()
    return max(worst, logits)


def _check_against_one_process(what: str, res: dict, losses: list[float], values: dict[str, torch.Tensor],
                               init: float, saved: float) -> None:
    """Losses, learned values and the saved model of the 2-process run equal one process within 1e-5; the values
    moved away from their initial value (the path that trains them ran). Prints the measured differences."""
    loss_diff = max(abs(a - b) for a, b in zip(res["losses"], losses, strict=True))
    value_diff = max((torch.tensor(res["attnorm_values"][n]) - v).abs().max().item() for n, v in values.items())
    moved = min((v - init).abs().max().item() for v in values.values())
    print(f"{what}: losses {losses}; max |loss diff| {loss_diff:.2e}, max |value diff| {value_diff:.2e}, "
          f"saved/reloaded max |diff| {saved:.2e}, smallest move from init {moved:.2e}")
    assert loss_diff < 1e-5, (res["losses"], losses)
    assert value_diff < 1e-5
    assert saved < 1e-5
    assert moved > 1e-4, "the per-head values did not train"


@pytest.mark.slow
@pytest.mark.parametrize("implementation,attnorm", LEARNABLE)
def test_deepspeed_zero3_two_processes_match_one(tmp_path, implementation, attnorm):
    """ZeRO-3 (2 gloo processes, CPU): losses, learned values and the final save equal one process within 1e-5;
    the training script's parameter groups and count read the real shapes of the partitioned parameters."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (optional test dependency: "
                                            "pip install deepspeed; DS_BUILD_OPS=0 needs no compiler)")
    from hf_attnorm.lab.training.loop import _param_groups as param_groups
    from hf_attnorm.lab.training.loop import _unique_params as unique_params

    src = tmp_path / "src"
    build_model("llama", "micro", attn_implementation="sdpa", seed=0).save_pretrained(src)
    batch = _batch()
    torch.save(batch, tmp_path / "batch.pt")
    steps, lr, wd = 3, 1e-2, 0.1
    _torchrun("zero3_worker.py", ["--model", str(src), "--implementation", implementation, "--attnorm",
                                  json.dumps(attnorm), "--batch", str(tmp_path / "batch.pt"), "--steps", str(steps),
                                  "--lr", str(lr), "--weight_decay", str(wd), "--out", str(tmp_path / "out")])
    res = json.loads((tmp_path / "out" / "result.json").read_text())
    losses, ref = _single_process(src, implementation, attnorm, batch, steps, lr, lambda m: param_groups(m, wd))
    # the worker really ran partitioned, with our values among the partitioned parameters
    assert any(".attnorm." in n for n in res["partitioned"]), res["partitioned"]
    ref_groups = param_groups(ref, wd)
    assert res["group_shapes"] == [[list(p.shape) for p in g["params"]] for g in ref_groups]
    assert res["group_decay"] == [wd, 0.0] and res["group_shapes"][0], "matrices must be in the decay group"
    assert res["num_params"] == unique_params(ref)
    values = _attnorm_values(ref)
    assert values.keys() == res["attnorm_values"].keys()
    _check_against_one_process("zero3 " + implementation, res, losses, values, init=0.0 if implementation == "sink"
                               else 1.0, saved=_compare_saved(tmp_path / "out" / "final", ref, batch))


@pytest.mark.slow
def test_fsdp2_two_processes_low_memory_swap_step_and_full_state_dict(tmp_path):
    """FSDP2 per decoder layer (2 gloo processes): a normalizer swap under transformers' low-memory FSDP loading
    leaves nothing on meta on any rank; training steps, learned values and the full-state-dict save/reload equal
    one process."""
    implementation, attnorm = "symax", {"eta_learnable": True}
    src = tmp_path / "src"
    build_model("llama", "micro", attn_implementation="sdpa", seed=0).save_pretrained(src)
    batch = _batch()
    torch.save(batch, tmp_path / "batch.pt")
    steps, lr = 3, 1e-2
    _torchrun("fsdp2_worker.py", ["--model", str(src), "--implementation", implementation, "--attnorm",
                                  json.dumps(attnorm), "--batch", str(tmp_path / "batch.pt"), "--steps", str(steps),
                                  "--lr", str(lr), "--out", str(tmp_path / "out")],
              {"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"})
    res = json.loads((tmp_path / "out" / "result.json").read_text())
    assert res["meta_after_load"] == [[], []], res["meta_after_load"]
    assert res["sharded_attnorm"], "the per-head values must be sharded with their decoder layer"
    losses, ref = _single_process(src, implementation, attnorm, batch, steps, lr,
                                  lambda m: [{"params": list(m.parameters()), "weight_decay": 0.0}])
    values = _attnorm_values(ref)
    assert values.keys() == res["attnorm_values"].keys()
    _check_against_one_process("fsdp2 " + implementation, res, losses, values, init=1.0,
                               saved=_compare_saved(tmp_path / "out" / "final", ref, batch))


@pytest.mark.slow
def test_training_script_under_accelerate_deepspeed_zero3_matches_one_process(tmp_path):
    """finetune.py with a symax swap (learnable eta) under ``accelerate launch --use_deepspeed --zero_stage 3
    --zero3_init_flag true`` on 2 gloo processes equals one process with the same blocks per step: losses, parameter
    count, the final save (written without ``zero3_save_16bit_model``) and the checkpoint's HF copy."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (optional test dependency: "
                                            "pip install deepspeed; DS_BUILD_OPS=0 needs no compiler)")
    from safetensors.torch import load_file

    env = dict(os.environ)
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1",
               DS_ACCELERATOR="cpu")
    env.pop("ACCELERATE_USE_CPU", None)
    common = ["--block_size", "32", "--max_eval_samples", "16", "--per_device_eval_batch_size", "8",
              "--lr_scheduler_type", "constant", "--model_card_dir", "none", "--torch_threads", "1"]

    def run(args: list[str], launcher: list[str]) -> None:
        proc = subprocess.run([*launcher, *common, *args], env=env, cwd=str(REPO), capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]

    python = [sys.executable]
    run(["--model_type", "llama", "--model_size", "micro", "--attn_implementation", "softmax", "--max_train_steps",
         "1", "--per_device_train_batch_size", "2", "--output_dir", str(tmp_path / "src")],
        [*python, str(REPO / "scripts" / "pretrain.py")])
    ft = ["--model_name_or_path", str(tmp_path / "src"), "--attn_implementation", "symax", "--attnorm",
          "eta_learnable=true", "--learning_rate", "3e-3", "--weight_decay", "0.1", "--max_train_steps", "6",
          "--eval_steps", "3", "--checkpointing_steps", "3"]
    launch = [*python, "-m", "accelerate.commands.launch", "--use_deepspeed", "--zero_stage", "3",
              "--zero3_init_flag", "true", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no", "--main_process_port", "0", str(DIST / "accelerate_gloo.py")]
    run([*ft, "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / "zero3")],
        [*launch, str(REPO / "scripts" / "finetune.py")])
    run([*ft, "--per_device_train_batch_size", "8", "--output_dir", str(tmp_path / "one")],
        [*python, str(REPO / "scripts" / "finetune.py")])
    a = json.loads((tmp_path / "zero3" / "training_summary.json").read_text())
    b = json.loads((tmp_path / "one" / "training_summary.json").read_text())
    assert json.loads((tmp_path / "zero3" / "training_args.json").read_text())["distributed_type"] == \
        "DistributedType.DEEPSPEED"
    assert (tmp_path / "zero3" / "step_3" / "pytorch_model").is_dir(), "DeepSpeed's engine did not save: not ZeRO"
    assert a["num_processes"] == 2 and a["parameters"] == b["parameters"] > 1_000_000
    loss_diff = max(abs(x - y) for (_, x), (_, y) in zip(a["train_losses"], b["train_losses"], strict=True))
    val_diff = max(abs(x - y) for (_, x), (_, y) in zip(a["val_losses"], b["val_losses"], strict=True))
    worst = {}
    for sub in ("", "step_3/"):
        wa = load_file(tmp_path / "zero3" / sub / "model.safetensors")
        wb = load_file(tmp_path / "one" / sub / "model.safetensors")
        assert wa.keys() == wb.keys() and any(".attnorm.symax_eta" in k for k in wa)
        worst[sub or "final"] = {"attnorm": max((wa[k] - wb[k]).abs().max().item() for k in wa if ".attnorm." in k),
                                 "all": max((wa[k] - wb[k]).abs().max().item() for k in wa)}
    print(f"accelerate zero3 finetune: max |loss diff| {loss_diff:.2e}, max |val loss diff| {val_diff:.2e}, "
          f"saved weights {worst}")
    assert loss_diff < 1e-5 and val_diff < 1e-5
    for w in worst.values():
        assert w["attnorm"] < 1e-5
        # AdamW turns rounding-level differences of near-zero gradients into updates of up to ~lr x 1e-2: measured
        # 1.2e-5 on single matrix entries (mean difference 3e-8)
        assert w["all"] < 1e-4
