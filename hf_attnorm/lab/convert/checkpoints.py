"""A conversion run's record and its checkpoints: ``History`` (what conversion.json records, saved in every
checkpoint), the newest resumable state under ``<output_dir>/checkpoints`` (trained tensors, optimizer, history),
where a resume starts, and the process's peak memory per phase."""

from __future__ import annotations

import argparse
import dataclasses
import resource
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file
from torch import nn

from ..training.checkpoints import TMP_PREFIX, publish_folder, write_json
from .args import STAGES, ConvertError

SUMMARY_FILE = "conversion.json"
CHECKPOINTS = "checkpoints"
#: the stage-1 result kept for a resume inside stage 2 (never rotated)
TRANSFER_DONE = "transfer_done"
#: stage 1's trained tensors at its best held-out point so far (never rotated; --transfer_keep_best)
TRANSFER_BEST = "transfer_best"

@dataclasses.dataclass
class History:
    """What conversion.json records; saved in every checkpoint, so a resumed run continues it."""

    stage: str = "transfer"
    step: int = 0
    losses: dict[str, list[list[float]]] = dataclasses.field(default_factory=lambda: {s: [] for s in STAGES})
    seconds: dict[str, float] = dataclasses.field(default_factory=lambda: {s: 0.0 for s in STAGES})
    perplexity: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    layer_errors: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    #: the process's peak resident memory (MB) during each phase: loading, each evaluation, each stage
    peak_rss_mb: dict[str, float] = dataclasses.field(default_factory=dict)
    trained: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: what the calibrated start set (``hf_attnorm.lab.convert.calibration.calibrate``'s report), or why nothing
    calibration: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: stage 1's held-out mean layer error: at its start ("start"), at each measured step ("measured": [[step,
    #: error]]), the best ("best_step", "best"), and why the stage was skipped ("skipped"), when it was
    transfer_check: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: --distill: top-k, weight, the teacher's cache size (MB) and the seconds its pass took
    distill: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: --eval_texts: text -> evaluation point -> context -> perplexity
    perplexity_texts: dict[str, dict[str, dict[str, float]]] = dataclasses.field(default_factory=dict)
    #: CPU seconds (every thread of the process) of each stage, as ``seconds`` holds their wall seconds
    cpu_seconds: dict[str, float] = dataclasses.field(default_factory=lambda: {s: 0.0 for s in STAGES})
    #: CPU seconds of the whole run spent by earlier processes (a resumed run: up to the checkpoint it resumed)
    cpu_before: float = 0.0
    #: the machine's 1-minute load average read at every training step: [samples, sum, max]
    load_steps: list[float] = dataclasses.field(default_factory=lambda: [0, 0.0, 0.0])


def reset_peak_rss() -> None:
    """Start a new peak-memory window (Linux: writing 5 to clear_refs resets VmHWM; elsewhere the peak stays the
    process's since its start)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    """The process's peak resident memory since the last ``reset_peak_rss`` (MB)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024.0, 1)
    except (OSError, ValueError, IndexError):
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)  # Linux: KiB


def save_trainable(folder: Path, params: dict[str, nn.Parameter]) -> None:
    """The trained tensors in ``folder``/trainable.safetensors (written whole, then renamed into place)."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: p.detach().cpu().contiguous() for n, p in params.items()}, str(folder / ".tmp"))
    (folder / ".tmp").replace(folder / "trainable.safetensors")


def load_trainable(folder: Path, params: dict[str, nn.Parameter]) -> None:
    """Copy the trained tensors saved in ``folder`` into ``params`` (the same names, or a clear error)."""
    saved = load_file(str(folder / "trainable.safetensors"))
    if set(saved) != set(params):
        raise ConvertError(f"checkpoint {folder} holds other trained tensors than this run trains "
                           f"({len(saved)} vs {len(params)}); resume with the flags it was made with")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(saved[n].to(p.device, p.dtype))


def save_checkpoint(out: Path, history: History, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer,
                    accelerator: Accelerator, cpu_total: float, stage_done: bool = False) -> None:
    """The newest resumable state (trained tensors, optimizer, history) in checkpoints/<stage>_<N>; the end of
    stage 1 also in checkpoints/transfer_done (what a resume inside stage 2 rebuilds from). ``cpu_total``: the run's
    CPU seconds so far (a resume from here adds its own process's)."""
    h = history
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        root = out / CHECKPOINTS
        name = TRANSFER_DONE if stage_done and h.stage == "transfer" else f"{h.stage}_{h.step:06d}"
        tmp = root / f"{TMP_PREFIX}{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_trainable(tmp, params)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        state = dataclasses.asdict(h)
        state["cpu_before"] = cpu_total
        if stage_done:  # what a resume does next: the following stage, from its first step
            state["stage_done"] = h.stage
        write_json(tmp / "state.json", state)
        publish_folder(tmp, root / name)  # the training scripts' checkpoints: complete, or not there
        for old in root.iterdir():  # only the newest is kept (and the stage-1 result)
            if old.name not in (name, TRANSFER_DONE, TRANSFER_BEST):
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def resume_point(args: argparse.Namespace, out: Path) -> Path | None:
    """The checkpoint ``--resume_from_checkpoint`` names (``latest``: the newest under ``out``; None: none, or none
    there yet)."""
    if args.resume_from_checkpoint is None:
        return None
    root = out / CHECKPOINTS
    if args.resume_from_checkpoint == "latest":
        found = [p for p in root.iterdir() if not p.name.startswith(".")] if root.is_dir() else []
        if not found:
            print(f"[convert] no checkpoint in {root}: starting from the beginning", file=sys.stderr)
            return None
        return max(found, key=lambda p: p.stat().st_mtime_ns)
    folder = Path(args.resume_from_checkpoint)
    if not (folder / "state.json").is_file():
        raise ConvertError(f"--resume_from_checkpoint {folder}: not a conversion checkpoint (no state.json)")
    return folder
