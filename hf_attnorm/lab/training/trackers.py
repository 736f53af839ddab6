"""Experiment trackers for ``--with_tracking``: accelerate's (tensorboard, wandb, ...) or ``JSONLTracker``, a file
tracker that needs no package and is used when none is installed."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from accelerate.tracking import GeneralTracker, get_available_trackers
from accelerate.utils import LoggerType

from ...fileio import atomic_write
from .args import TrainingError


class JSONLTracker(GeneralTracker):
    """Appends one JSON object per ``log`` call to ``<logging_dir>/<run>/metrics.jsonl`` (and the hyper-parameters
    to ``hparams.json``). On resume at step S the records of later steps (written by the interrupted run) are
    dropped first, so the file matches an uninterrupted run."""

    name = "jsonl"
    requires_logging_directory = True
    main_process_only = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, resume_step: int | None = None) -> None:
        super().__init__()
        self.run_dir = Path(logging_dir) / run_name
        self.path = self.run_dir / "metrics.jsonl"
        self.resume_step = resume_step
        self._file = None

    @property
    def tracker(self):
        return self._file

    def _open(self):
        if self._file is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                keep = []
                for line in self.path.read_text().splitlines():
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:  # a line cut by a kill
                        continue
                    if self.resume_step is not None and rec.get("step", -1) <= self.resume_step:
                        keep.append(line)
                atomic_write(self.path, "".join(f"{line}\n" for line in keep))
            self._file = self.path.open("a")
        return self._file

    def store_init_configuration(self, values: dict) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.run_dir / "hparams.json", json.dumps(values, indent=2, default=str) + "\n")
        self._open()

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        f = self._open()
        rec = {"step": step, "time": round(time.time(), 3)}
        rec.update({k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in values.items()})
        f.write(json.dumps(rec) + "\n")
        f.flush()

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def build_trackers(report_to: str, run_name: str, logging_dir: Path, resume_step: int | None) -> list[Any]:
    """``--report_to`` (comma separated) -> what ``Accelerator(log_with=...)`` takes; a named tracker whose package
    is missing is an error, ``all`` falls back to jsonl."""
    wanted = [w.strip() for w in report_to.split(",") if w.strip()]
    available = [str(t) for t in get_available_trackers()]
    out: list[Any] = []
    for w in wanted:
        if w == "all":
            out += available or [JSONLTracker(run_name, logging_dir, resume_step)]
        elif w == "jsonl":
            out.append(JSONLTracker(run_name, logging_dir, resume_step))
        elif w in [str(t) for t in LoggerType]:
            if w not in available:
                raise TrainingError(f"--report_to {w}: the {w} package is not installed; installed trackers: "
                                    f"{', '.join(available) or 'none'} (jsonl always works)")
            out.append(w)
        else:
            raise TrainingError(f"--report_to: unknown tracker {w!r}; use all, jsonl or one of "
                                f"{', '.join(str(t) for t in LoggerType if str(t) != 'all')}")
    return out
