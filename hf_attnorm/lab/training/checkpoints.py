"""The output folder of a run: what marks it as ours, whether a run may start or resume there, resumable
checkpoints ``step_N`` (save, rotate, resume) and the final model.

Checkpoints are written into ``.tmp-step_N`` and renamed when complete: ``accelerator.load_state`` resumes them
(optimizer, scheduler, RNG of every rank, accelerate's step counter) and ``from_pretrained`` loads them (config.json
with the attnorm settings, safetensors, tokenizer). ``trainer_state.json`` holds the step, the data position (epoch,
micro-batches consumed), the arguments and the loss history.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType
from safetensors.torch import load_file

from ...fileio import atomic_write
from ...hf.persistence import is_marker
from ..distributed import gathered_state_dict, is_zero3_partitioned
from .args import TrainingArguments, TrainingError

logger = get_logger(__name__)

#: files in an output dir / checkpoint that mark it as ours
ARGS_FILE = "training_args.json"
STATE_FILE = "trainer_state.json"
SUMMARY_FILE = "training_summary.json"
CHECKPOINT_PREFIX = "step_"
TMP_PREFIX = ".tmp-"
#: arguments that define the model and the data stream: a resumed run must use the values of the checkpoint
RESUME_MUST_MATCH = ("model_type", "model_size", "config_name", "model_name_or_path", "task", "tokenizer_name",
                     "block_size", "max_position_embeddings", "dataset_name", "dataset_config_name", "train_file",
                     "validation_file", "per_device_train_batch_size", "gradient_accumulation_steps", "seed",
                     "max_train_samples", "mlm_probability", "num_processes")
#: files of a previous run that --overwrite_output_dir deletes (besides checkpoints, temporary folders, shards)
RUN_FILES = {ARGS_FILE, SUMMARY_FILE, "README.md", "config.json", "generation_config.json", "model.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "added_tokens.json", "runs",
             "model_card"}


# ------------------------------------------------------------------------------------------------- the folder


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints ``step_N`` in ``output_dir``, oldest first (temporary ``.tmp-*`` folders are never
    listed: a checkpoint becomes visible only by the final rename)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and p.name[len(CHECKPOINT_PREFIX):].isdigit():
            if (p / STATE_FILE).is_file():
                found.append(p)
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(output_dir)
    return ckpts[-1] if ckpts else None


def is_run_dir(output_dir: Path) -> bool:
    """Whether ``output_dir`` holds a run of these scripts (its arguments file or a checkpoint)."""
    return (output_dir / ARGS_FILE).is_file() or bool(list_checkpoints(output_dir))


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TrainingError(f"cannot read {path}: {exc}") from exc


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=2, default=str) + "\n")


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish_folder(tmp: Path, final: Path) -> None:
    """Make the complete folder ``tmp`` visible as ``final`` by one rename (a folder already there is moved aside
    first and deleted after), then sync the parent: a kill at any moment leaves the old folder or the new one."""
    old = None
    if final.exists():
        old = final.with_name(f"{TMP_PREFIX}old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def clear_run(output_dir: Path) -> list[str]:
    """Delete what a previous run of ours left (checkpoints, temporary folders, logs, model files, card)."""
    removed = []
    for p in sorted(output_dir.iterdir()):
        if (p.name in RUN_FILES or p.name.startswith(TMP_PREFIX) or p.name.startswith(CHECKPOINT_PREFIX)
                or p.name.startswith("model.safetensors") or p.name.startswith("model-0")):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            removed.append(p.name)
    return removed


@dataclasses.dataclass(frozen=True)
class OutputPlan:
    """What the run does with ``output_dir``: start fresh (clearing it first or not) or resume ``resume_dir``."""

    output_dir: Path
    clear: bool = False
    resume_dir: Path | None = None
    resume_state: dict[str, Any] | None = None

    @property
    def resume_step(self) -> int | None:
        return int(self.resume_state["step"]) if self.resume_state else None

    @property
    def saved_settings(self) -> dict[str, Any] | None:
        """The attnorm settings of the checkpoint being resumed (its config.json), or None."""
        if self.resume_dir is None or not (self.resume_dir / "config.json").is_file():
            return None
        return read_json(self.resume_dir / "config.json").get("attnorm")


def plan_output(args: TrainingArguments) -> OutputPlan:
    """Decide, before anything is built, whether the run may use ``--output_dir`` and what it resumes; a checkpoint
    is resumed only with the arguments that define its model and data stream."""
    output_dir = Path(args.output_dir)
    resume_dir: Path | None = None
    if args.resume_from_checkpoint == "latest":
        resume_dir = latest_checkpoint(output_dir)
    elif args.resume_from_checkpoint is not None:
        resume_dir = Path(args.resume_from_checkpoint)
        if not resume_dir.is_dir():
            raise TrainingError(f"--resume_from_checkpoint {resume_dir}: no such folder (or pass 'latest')")
        if not (resume_dir / STATE_FILE).is_file():
            raise TrainingError(f"--resume_from_checkpoint {resume_dir} is not a checkpoint of these scripts (no "
                                f"{STATE_FILE}); to start from its weights use finetune.py --model_name_or_path")
    clear = False
    if output_dir.is_dir() and any(output_dir.iterdir()):
        if args.overwrite_output_dir:
            clear = True
        elif args.resume_from_checkpoint is None:
            what = ("holds a previous run of these scripts" if is_run_dir(output_dir)
                    else "exists, is not empty and is not a run of these scripts")
            raise TrainingError(f"--output_dir {output_dir} {what}: pass --resume_from_checkpoint latest to "
                                "continue it, --overwrite_output_dir to start over there, or another --output_dir")
        elif not is_run_dir(output_dir):
            raise TrainingError(f"--output_dir {output_dir} is not empty and is not a run of these scripts; pass "
                                "--overwrite_output_dir or another --output_dir")
    if resume_dir is None:
        return OutputPlan(output_dir, clear)
    state = read_json(resume_dir / STATE_FILE)
    saved_args, current = state.get("args", {}), args.as_dict()
    problems = [f"--{k} {current[k]!r} (checkpoint: {saved_args[k]!r})" for k in RESUME_MUST_MATCH
                if k in saved_args and k in current and current[k] != saved_args[k]]
    if problems:
        raise TrainingError(f"cannot resume {resume_dir} exactly with different settings: {'; '.join(problems)}. "
                            "Use the checkpoint's values, or start a new run from its weights with finetune.py "
                            "--model_name_or_path")
    return OutputPlan(output_dir, clear, resume_dir, state)


# ------------------------------------------------------------------------------------------------ checkpoints


def _sharded(accelerator: Accelerator) -> bool:
    return accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)


def load_weights(model: torch.nn.Module, folder: Path) -> None:
    """Load ``folder``'s safetensors into ``model`` in place (tied weights stay tied); every key must match."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise TrainingError(f"checkpoint {folder} has no model.safetensors")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(folder / f)))
    state = {k: v for k, v in state.items() if not is_marker(k)}  # (a marker for transformers without hf_attnorm)
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = model.state_dict(keep_vars=True)
    loaded_ptrs = {params[k].data_ptr() for k in state if k in params}
    really_missing = [k for k in missing if params[k].data_ptr() not in loaded_ptrs]
    if really_missing or unexpected:
        raise TrainingError(f"checkpoint {folder} does not match the model: missing {really_missing[:5]}, "
                            f"unexpected {list(unexpected)[:5]}")


def full_state_dict(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A full state dict of a sharded (FSDP/DeepSpeed) model; collective: every rank calls it. Under ZeRO-3 it is
    gathered with DeepSpeed's public API, so no ``zero3_save_16bit_model`` is needed (accelerate's
    ``get_state_dict`` refuses without it)."""
    unwrapped = accelerator.unwrap_model(model)
    if is_zero3_partitioned(unwrapped):
        return gathered_state_dict(unwrapped)
    return accelerator.get_state_dict(model)


def register_checkpoint_hooks(accelerator: Accelerator) -> None:
    """Make ``save_state``/``load_state`` write and read the model with ``save_pretrained`` (config with the
    attnorm settings, safetensors with metadata): the same folder then also loads with ``from_pretrained``."""
    plain = not _sharded(accelerator)

    def save_hook(models: list, weights: list, output_dir: str) -> None:
        for model in models:
            unwrapped = accelerator.unwrap_model(model)
            if plain:
                if accelerator.is_main_process:
                    unwrapped.save_pretrained(output_dir, safe_serialization=True)
            else:  # sharded engines: gather a full state dict (collective) for the HF copy
                state = full_state_dict(accelerator, model)
                if accelerator.is_main_process:
                    unwrapped.save_pretrained(output_dir, state_dict=state, safe_serialization=True)
        if plain:
            weights.clear()  # accelerate must not write its own model.safetensors over ours

    def load_hook(models: list, input_dir: str) -> None:
        if not plain:
            return
        while models:
            load_weights(accelerator.unwrap_model(models.pop()), Path(input_dir))

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def save_checkpoint(accelerator: Accelerator, output_dir: Path, tokenizer: Any, state: dict[str, Any],
                    total_limit: int | None) -> Path:
    """``step_N`` (N = ``state["step"]``): written into ``.tmp-step_N`` by every rank (each saves its RNG state)
    and renamed by the main process once complete; then only the newest ``total_limit`` are kept. A kill at any
    moment leaves either the previous checkpoints or the new one."""
    final = output_dir / f"{CHECKPOINT_PREFIX}{state['step']}"
    tmp = output_dir / f"{TMP_PREFIX}{final.name}"
    main = accelerator.is_main_process
    if main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp))
        if main:
            tokenizer.save_pretrained(tmp)
            write_json(tmp / STATE_FILE, state)
        accelerator.wait_for_everyone()
        if main:
            publish_folder(tmp, final)  # (a step re-run after resuming from an older checkpoint replaces its folder)
            if total_limit is not None:
                for stale in list_checkpoints(output_dir)[:-total_limit]:
                    shutil.rmtree(stale, ignore_errors=True)
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    accelerator.wait_for_everyone()
    logger.info(f"checkpoint {final}")
    return final


def save_final(accelerator: Accelerator, model: torch.nn.Module, tokenizer: Any, output_dir: Path,
               write_rest: Any) -> None:
    """Final model into ``output_dir``: written into a temporary folder and moved in file by file; then
    ``write_rest()`` (main process: card and summary, the completion marker, last)."""
    unwrapped = accelerator.unwrap_model(model)
    state = full_state_dict(accelerator, model) if _sharded(accelerator) else None
    if accelerator.is_main_process:
        tmp = output_dir / f"{TMP_PREFIX}final"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        try:
            unwrapped.save_pretrained(tmp, safe_serialization=True, state_dict=state)
            tokenizer.save_pretrained(tmp)
            for p in sorted(tmp.iterdir()):
                os.replace(p, output_dir / p.name)
            shutil.rmtree(tmp)
            write_rest()
            fsync_dir(output_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    accelerator.wait_for_everyone()
