"""The main job's sweep: one run per (task, implementation, seed), cached on disk and resumable.

Each run writes ``<root>/runs/<task>/<label>/seed<k>/result.json`` atomically when it finishes; the file carries
the run's key (a hash of everything that decides what is trained and measured). A later sweep skips every run
whose result.json has the same key, so a killed sweep continues where it stopped and a changed setting re-runs
only what it changes. A run that raises is recorded in ``failed.json`` (with the traceback) and retried by the
next sweep; the other runs go on.

Runs are independent: ``jobs`` worker processes (spawned, ``threads`` torch threads each) take them longest
first. To spread a sweep over machines, give each a disjoint subset (``select(shard=(i, n))`` or ``only``
patterns), collect the ``runs/`` folders into one output directory, and aggregate (no scheduler needed).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
import re
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from ... import AttnormError, available, resolve_settings
from ...settings import parse_option_pairs

#: bump when a change to the probes, the LM or the loop changes what a cached result means
CODE_VERSION = 1
RESULT_FILE = "result.json"
FAILED_FILE = "failed.json"


def label_of(spec: str) -> str:
    """A folder-safe name of an implementation spec: ``symax:eta=0.5`` -> ``symax-eta-0.5``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", spec).strip("-")


def parse_implementation(spec: str) -> tuple[str, dict[str, Any]]:
    """``name`` or ``name:key=value,...`` -> (hf_attnorm implementation, attnorm options), validated now: an
    unknown name or option raises ``ValueError`` naming what is allowed. Values follow the one option grammar of
    the project (``hf_attnorm.settings.parse_option_pairs``)."""

    name, _, rest = spec.partition(":")
    if name not in available():
        raise ValueError(f"unknown attention implementation {name!r} in {spec!r}; available: "
                         f"{', '.join(available())}")
    try:
        options = parse_option_pairs(item for item in rest.split(",") if item)
        resolve_settings(name, options)
    except (AttnormError, ValueError) as e:
        raise ValueError(f"implementation {spec!r}: {e}") from None
    return name, options


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run. ``settings`` decide what is trained (they enter the key); ``runtime`` says where data
    lives (it does not)."""

    task: str
    spec: str
    seed: int
    settings: dict[str, Any]
    runtime: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.task}/{label_of(self.spec)}/seed{self.seed}"

    @property
    def key(self) -> str:
        text = json.dumps([CODE_VERSION, self.task, self.spec, self.seed, self.settings], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def folder(self, root: Path) -> Path:
        return Path(root) / "runs" / self.id

    def cached(self, root: Path) -> dict[str, Any] | None:
        """The finished result of this exact run under ``root``, or None."""
        path = self.folder(root) / RESULT_FILE
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return data if data.get("key") == self.key and data.get("status") == "ok" else None


def select(runs: Sequence[Run], shard: tuple[int, int] | None = None, only: Sequence[str] | None = None) -> list[Run]:
    """The runs whose id (``task/label/seedK``) matches one of the ``only`` glob patterns (all when None), then
    every n-th of them from i (``shard=(i, n)``, 0 <= i < n) in the given order."""
    out = [r for r in runs if not only or any(fnmatch.fnmatchcase(r.id, pat) for pat in only)]
    if shard is not None:
        i, n = shard
        if not 0 <= i < n:
            raise ValueError(f"shard must be i/n with 0 <= i < n, got {i}/{n}")
        out = out[i::n]
    return out


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    tmp.write_text(json.dumps(data, indent=1, default=float))
    os.replace(tmp, path)


def _init_worker(threads: int) -> None:
    import torch
    from transformers.utils import logging

    torch.set_num_threads(threads)
    logging.disable_progress_bar()  # one "Writing model shards" bar per saved run buries the progress lines


def execute(run: Run, root: str, runner: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """Run one (in this process) and record it: result.json on success, failed.json with the traceback on an
    exception. Returns the record (never raises for a failing run)."""
    folder = run.folder(Path(root))
    folder.mkdir(parents=True, exist_ok=True)
    started, cpu = time.perf_counter(), time.process_time()
    base = {"id": run.id, "key": run.key, "task": run.task, "implementation": run.spec, "seed": run.seed,
            "settings": run.settings, "code_version": CODE_VERSION}
    try:
        name, options = parse_implementation(run.spec)
        result = runner(run.task, name, options, run.seed, {**run.settings, **run.runtime}, folder)
    except Exception as e:  # a failed run is reported, the sweep goes on
        record = {**base, "status": "failed", "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc(), "seconds": time.perf_counter() - started}
        _write_json(folder / FAILED_FILE, record)
        return record
    record = {**base, "status": "ok", "seconds": time.perf_counter() - started,
              "cpu_seconds": time.process_time() - cpu, **result}
    _write_json(folder / RESULT_FILE, record)
    (folder / FAILED_FILE).unlink(missing_ok=True)
    return record


def sweep(runs: Sequence[Run], root: Path, runners: dict[str, Callable[..., dict[str, Any]]], jobs: int = 2,
          threads: int = 1, cost: Callable[[Run], float] | None = None,
          log: Callable[[str], None] = print, later: Callable[[Run], bool] | None = None) -> dict[str, dict[str, Any]]:
    """Execute the runs not already cached under ``root`` with ``jobs`` worker processes (in this process when
    jobs == 1) and return {run id: record} for every run (cached ones included). ``cost`` orders the work,
    most expensive first, so that the last minutes are not one long run on one worker; runs for which ``later``
    is true start after the others (e.g. those waiting for a C++ extension that is still being built)."""
    unknown = sorted({r.task for r in runs} - set(runners))
    if unknown:
        raise ValueError(f"no runner for task(s) {unknown}; known: {', '.join(runners)}")
    records: dict[str, dict[str, Any]] = {}
    todo = []
    for r in runs:
        hit = r.cached(root)
        if hit is not None:
            records[r.id] = hit
        else:
            todo.append(r)
    if cost is not None:
        todo.sort(key=cost, reverse=True)
    if later is not None:
        todo.sort(key=later)  # stable: each group keeps its longest-first order
    log(f"sweep: {len(runs)} runs, {len(runs) - len(todo)} cached, {len(todo)} to run "
        f"({jobs} process(es) x {threads} thread(s))")
    started = time.perf_counter()
    done = 0

    def report(record: dict[str, Any]) -> None:
        nonlocal done
        done += 1
        records[record["id"]] = record
        elapsed = time.perf_counter() - started
        eta = elapsed / done * (len(todo) - done)
        what = "ok" if record["status"] == "ok" else f"FAILED ({record['error'][:120]})"
        log(f"[{done}/{len(todo)}] {record['id']}: {what}, {record['seconds']:.1f} s | elapsed "
            f"{elapsed / 60:.1f} min, about {eta / 60:.1f} min left")

    if jobs == 1:
        _init_worker(threads)
        for r in todo:
            report(execute(r, str(root), runners[r.task]))
        return records
    import multiprocessing
    import signal

    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=(threads,))

    def stop(signum, frame):  # SIGTERM: stop like Ctrl-C, and take the workers down too (finished runs stay)
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop) if _main_thread() else None
    try:
        futures = {pool.submit(execute, r, str(root), runners[r.task]): r for r in todo}
        for fut in as_completed(futures):
            r = futures[fut]
            try:
                record = fut.result()
            except Exception as e:  # the worker process died (killed, out of memory): report, go on
                record = {"id": r.id, "key": r.key, "task": r.task, "implementation": r.spec, "seed": r.seed,
                          "status": "failed", "error": f"worker died: {type(e).__name__}: {e}", "seconds": 0.0}
            report(record)
    except KeyboardInterrupt:
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        log(f"sweep interrupted after {done} of {len(todo)} runs; finished runs are cached, run again to continue")
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    pool.shutdown()
    return records


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
