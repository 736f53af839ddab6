"""``python -m hf_attnorm serve PATH [options of transformers serve]`` (console command ``hf-attnorm-serve``): serve
an hf_attnorm checkpoint through transformers' own OpenAI-compatible server (``transformers serve``; its routes are
listed in docs/clients.md) in a process that imported hf_attnorm, so that the model runs the implementation its
config.json records.

* PATH comes first: a local checkpoint folder saved with hf_attnorm imported (config.json holds ``attnorm``). It is
  checked like ``from_pretrained`` checks it (settings, checksums, safetensors metadata) before the server starts;
  a plain checkpoint is refused (serve it with ``transformers serve``).
* Its own options are ``--max-new-tokens-cap`` and ``--grace-period`` (below); every other option is transformers
  serve's (``--port``, ``--host``, ``--continuous-batching``, ``--cb-*``, ``--device``, ``--dtype``, ...).
  ``--attn-implementation`` may only name the checkpoint's own implementation (it is then left out: transformers
  serve accepts its own names only, and the checkpoint's name is what loads).
* ``--continuous-batching`` runs the implementation on continuous batching's packed route when its normalizer and
  scale declare it exact there (``continuous_batching`` = "packed" or "per_sequence"). transformers serve has a
  sequential path (``model.generate`` per request, its default): an implementation declared "refused" there, or a
  transformers lacking what the integration needs, is served on that path instead, with a warning saying why
  (transformers serve falls back the same way for a model without continuous batching).
* A guard sits in front of transformers serve's app (``serve_guard``): malformed requests get a 400 in OpenAI's error
  shape naming the field; a request's new tokens are bounded by the model's positions, continuous batching's KV cache
  and ``--max-new-tokens-cap``; a client that disconnects stops its generation; a continuous-batching worker that
  dies anyway is restarted. The model runs a few forward passes before the port opens, so that the kernels its
  implementation needs are built first (a line says which and how long it took).
* On a CPU, ``--continuous-batching`` gets a bounded KV cache and batch unless ``--cb-num-blocks`` /
  ``--cb-max-batch-tokens`` say otherwise (transformers would size the cache from the free memory: most of it).
* It prints one line when it starts (the checkpoint, the implementation, the route) and one when it stops: how many
  attention calls hf_attnorm's function ran, how many came packed from continuous batching, on which kernel paths,
  and what the guard refused, capped and stopped. SIGINT or SIGTERM stop it: the requests in flight get
  ``--grace-period`` seconds (default ``GRACE_PERIOD_S``), then the ones left get a 503 and their generations stop;
  continuous batching's thread stops, the model is unloaded and it exits 0. A second signal exits at once (status
  128 + the signal's number).

transformers serve never imports hf_attnorm itself: what it does with an hf_attnorm checkpoint is described in
docs/clients.md (it warns, through the marker tensor of ``hf.persistence``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from .hf import compat, continuous_batching
from .hf.continuous_batching import continuous_batching_support
from .hf.forward import PathRecord, record_paths
from .hf.persistence import verify_checkpoint
from .registry import AttnormError, canonical
from .serve_guard import Guardian, log, warm_up
from .settings import AttnormSettings
from .version import __version__

PROG = "python -m hf_attnorm serve"
#: transformers serve's options this command reads (transformers/cli/serve.py, ``Serve.__init__``'s parameters
#: ``attn_implementation`` and ``continuous_batching`` as typer names them; tests/test_transformers_contract.py)
ATTN_OPTION = "--attn-implementation"
CB_OPTION = "--continuous-batching"
NO_CB_OPTION = "--no-continuous-batching"
#: the names of those parameters
SERVE_PARAMETERS = ("force_model", "attn_implementation", "continuous_batching")
#: this command's own options (taken out before the rest goes to transformers serve)
CAP_OPTION = "--max-new-tokens-cap"
GRACE_OPTION = "--grace-period"
#: seconds the requests in flight get after SIGINT/SIGTERM (``--grace-period``)
GRACE_PERIOD_S = 5.0
#: transformers serve's continuous-batching options this command reads or sets on a CPU
CB_BLOCKS_OPTION, CB_PAGE_OPTION = "--cb-num-blocks", "--cb-block-size"
CB_BATCH_OPTION, CB_MEMORY_OPTION = "--cb-max-batch-tokens", "--cb-max-memory-percent"
DEVICE_OPTION, DTYPE_OPTION = "--device", "--dtype"
#: continuous batching's page (tokens per block) when --cb-block-size is not given (ContinuousBatchingConfig's)
CB_PAGE_DEFAULT = 256
#: the bounded defaults on a CPU: a KV cache of at most CPU_CACHE_BYTES holding at most CPU_CACHE_SEQUENCES sequences
#: of the model's full length (CPU_CACHE_FALLBACK_TOKENS without a known length), and batches of CPU_BATCH_TOKENS
#: (transformers would take most of the free memory for the cache, and 8192-token batches whose masks alone take GBs)
CPU_CACHE_BYTES = 1024**3
CPU_CACHE_SEQUENCES = 4
CPU_CACHE_FALLBACK_TOKENS = 16384
CPU_BATCH_TOKENS = 256
CPU_CACHE_MIB = CPU_CACHE_BYTES // 1024**2

USAGE = f"""usage: {PROG} PATH [options of transformers serve]

Serve the hf_attnorm checkpoint folder PATH through transformers' OpenAI-compatible server with hf_attnorm imported:
the model runs the attention implementation its config.json records, on transformers serve's sequential path or,
with --continuous-batching, on continuous batching's packed route where the implementation is exact there (else
the sequential path, with a warning).

positional arguments:
  PATH  local checkpoint folder saved with hf_attnorm imported (config.json holds 'attnorm'); it comes first

options:
  -h, --help  show this message and transformers serve's options, then exit
  --attn-implementation NAME
              only the checkpoint's own implementation (redundant: it is what loads); any other is refused
  --max-new-tokens-cap N
              the most new tokens one request may ask for; the model's positions minus the prompt (and continuous
              batching's KV cache) bound every request anyway. A larger max_tokens is refused with a 400; a request
              without one gets transformers serve's default, capped at the bound
  --grace-period SECONDS
              after SIGINT or SIGTERM, how long the requests in flight may run on (default: {GRACE_PERIOD_S:g});
              the ones left then get a 503 and their generations stop. A second signal exits at once
  every other option is transformers serve's (--port, --host, --continuous-batching, --cb-num-blocks, --device,
  --dtype, --log-level, ...), listed below. On a CPU, --continuous-batching gets a bounded KV cache (at
  most {CPU_CACHE_SEQUENCES} full-length sequences and {CPU_CACHE_MIB} MiB) and batches of {CPU_BATCH_TOKENS} tokens
  unless --cb-num-blocks, --cb-max-batch-tokens or --cb-max-memory-percent say otherwise
"""


class ServeError(AttnormError):
    """A command line or checkpoint that ``hf_attnorm serve`` cannot serve as asked."""


class PathCounts(list):
    """``PathRecord.paths`` for a server that runs for long: counts each kernel path instead of keeping one entry per
    attention call."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def append(self, path: str) -> None:  # (the only method the attention function calls)
        self.counts[path] = self.counts.get(path, 0) + 1


def checkpoint_settings(path: str | Path) -> AttnormSettings:
    """The hf_attnorm settings of the checkpoint folder ``path``, checked as ``from_pretrained`` checks them
    (``persistence.verify_checkpoint``); raises ``ServeError`` when it is not one."""
    directory = Path(path)
    if not directory.is_dir():
        raise ServeError(f"{PROG}: PATH {str(path)!r} is not a folder; allowed: a local checkpoint folder saved with "
                         "hf_attnorm imported (config.json holds 'attnorm')")
    if not (directory / "config.json").is_file():
        raise ServeError(f"{PROG}: {directory} has no config.json; allowed: a local checkpoint folder saved with "
                         "hf_attnorm imported (model.save_pretrained)")
    settings = verify_checkpoint(directory)  # (CheckpointError naming the file for anything inconsistent)
    if settings is None:
        raise ServeError(f"{PROG}: {directory / 'config.json'} holds no hf_attnorm settings ('attnorm'): a plain "
                         "checkpoint runs transformers' own attention, serve it with `transformers serve`; allowed "
                         "here: checkpoints saved with hf_attnorm imported")
    return settings


def _option_value(args: list[str], option: str) -> tuple[str | None, list[str]]:
    """The last value of ``option`` in ``args`` (``--opt VALUE`` or ``--opt=VALUE``) and ``args`` without it."""
    value, rest, i = None, [], 0
    while i < len(args):
        a = args[i]
        if a == option:
            if i + 1 >= len(args):
                raise ServeError(f"{PROG}: {option} needs a value")
            value, i = args[i + 1], i + 2
            continue
        if a.startswith(option + "="):
            value = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return value, rest


def continuous_batching_requested(args: Sequence[str]) -> bool:
    """Whether transformers serve would run continuous batching with ``args`` (its switch; the last one wins)."""
    switches = [a for a in args if a in (CB_OPTION, NO_CB_OPTION)]
    return bool(switches) and switches[-1] == CB_OPTION


def plan(argv: Sequence[str]) -> tuple[list[str], AttnormSettings, str]:
    """Check a command line and decide how to serve: (the arguments for transformers serve, the checkpoint's
    settings, the route: "packed", "per_sequence" or "sequential"). Raises ``ServeError`` for what cannot be served
    as asked; warns (stderr) when continuous batching falls back to the sequential path."""
    args = list(argv)
    if not args or args[0].startswith("-"):
        raise ServeError(f"{PROG}: the first argument must be PATH, the checkpoint folder (got "
                         f"{args[0] if args else 'nothing'!r}); usage: {PROG} PATH [options of transformers serve]")
    path, rest = args[0], args[1:]
    settings = checkpoint_settings(path)
    impl = settings.implementation
    asked, rest = _option_value(rest, ATTN_OPTION)
    if asked is not None and canonical(asked) != impl:
        raise ServeError(
            f"{PROG}: {ATTN_OPTION} {asked!r} is not the checkpoint's implementation {impl!r}; allowed: leave the "
            f"option out (or name {impl!r}): {path} is served with the implementation its config.json records, as it "
            "was saved (another one would not compute what the model was trained with)")
    route = "sequential"
    if continuous_batching_requested(rest):
        reason = continuous_batching.settings_refusal([settings])
        if reason is None:
            route = continuous_batching_support(settings)[0]
        else:
            print(f"hf_attnorm serve: WARNING: continuous batching cannot run {impl!r} exactly: {reason}. Serving it "
                  "on transformers serve's sequential path instead (model.generate per request); leave out "
                  f"{CB_OPTION} to silence this warning.", file=sys.stderr, flush=True)
            rest.append(NO_CB_OPTION)
    return [path, *rest], settings, route


@dataclasses.dataclass(frozen=True)
class Options:
    """This command's own options (``--max-new-tokens-cap``, ``--grace-period``)."""

    max_new_tokens_cap: int | None = None
    grace_period: float = GRACE_PERIOD_S


def own_options(argv: Sequence[str]) -> tuple[Options, list[str]]:
    """This command's options and the arguments without them; raises ``ServeError`` for a bad value."""
    cap, rest = _option_value(list(argv), CAP_OPTION)
    grace, rest = _option_value(rest, GRACE_OPTION)
    options = Options()
    if cap is not None:
        try:
            value = int(cap)
        except ValueError:
            value = 0
        if value < 1:
            raise ServeError(f"{PROG}: {CAP_OPTION} {cap!r}; allowed: an integer >= 1 (the most new tokens one "
                             "request may ask for)")
        options = dataclasses.replace(options, max_new_tokens_cap=value)
    if grace is not None:
        try:
            seconds = float(grace)
        except ValueError:
            seconds = -1.0
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ServeError(f"{PROG}: {GRACE_OPTION} {grace!r}; allowed: a number of seconds >= 0 (how long the "
                             "requests in flight may run after SIGINT or SIGTERM)")
        options = dataclasses.replace(options, grace_period=seconds)
    return options, rest


def serves_on_cpu(args: Sequence[str]) -> bool:
    """Whether transformers serve would put the model on the CPU with ``args`` (``--device``; its default "auto"
    picks an accelerator where torch sees one)."""
    device, _ = _option_value(list(args), DEVICE_OPTION)
    device = (device or "auto").lower()
    if device == "auto":
        return not torch.accelerator.is_available()
    return device == "cpu"


@dataclasses.dataclass(frozen=True)
class CachePlan:
    """Continuous batching's KV cache as the command plans it: the arguments it adds for transformers serve, the
    cache in tokens when known before the first request (the most one request may occupy), and the line it prints."""

    added: tuple[str, ...]
    tokens: int | None
    line: str


def _kv_bytes_per_token(config: Any, dtype: str | None) -> int:
    """Bytes of keys and values one token takes in the cache: 2 x layers x KV heads x head size x the dtype's size."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", 1) or 1
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or getattr(text, "hidden_size", 64) // heads
    name = dtype if dtype not in (None, "auto") else str(getattr(text, "dtype", None) or "float32")
    resolved = getattr(torch, name.replace("torch.", ""), torch.float32)
    size = resolved.itemsize if isinstance(resolved, torch.dtype) else 4
    return 2 * getattr(text, "num_hidden_layers", 1) * kv_heads * head_dim * size


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def cache_plan(path: str, args: Sequence[str]) -> CachePlan:
    """Continuous batching's KV cache for ``args`` (which run it): on a CPU, without ``--cb-num-blocks`` or
    ``--cb-max-memory-percent``, a bounded one (``CPU_CACHE_BYTES``, ``CPU_CACHE_SEQUENCES`` full-length sequences)
    and, without ``--cb-max-batch-tokens``, ``CPU_BATCH_TOKENS``-token batches."""
    args = list(args)
    blocks, _ = _option_value(args, CB_BLOCKS_OPTION)
    page_text, _ = _option_value(args, CB_PAGE_OPTION)
    batch, _ = _option_value(args, CB_BATCH_OPTION)
    memory, _ = _option_value(args, CB_MEMORY_OPTION)
    dtype, _ = _option_value(args, DTYPE_OPTION)
    page = int(page_text) if page_text and page_text.isdigit() and int(page_text) > 0 else CB_PAGE_DEFAULT
    if blocks is not None and blocks.isdigit():
        tokens = int(blocks) * page
        return CachePlan((), tokens, f"continuous batching's KV cache: {blocks} blocks of {page} tokens ({tokens:,} "
                                     f"tokens; {CB_BLOCKS_OPTION})")
    if memory is not None or not serves_on_cpu(args):
        return CachePlan((), None, "continuous batching's KV cache: sized by transformers from the free memory of the "
                                   f"device when the first request starts it ({CB_BLOCKS_OPTION} sets it)")
    config = AutoConfig.from_pretrained(path)
    per_token = _kv_bytes_per_token(config, dtype)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    positions = getattr(text, "max_position_embeddings", None)
    wanted = CPU_CACHE_SEQUENCES * positions if isinstance(positions, int) and positions > 0 else \
        CPU_CACHE_FALLBACK_TOKENS
    tokens = max(page, min(wanted, CPU_CACHE_BYTES // per_token))
    n_blocks = math.ceil(tokens / page)
    added = [CB_BLOCKS_OPTION, str(n_blocks)]
    batch_note = f"batches of at most {batch} tokens ({CB_BATCH_OPTION})"
    if batch is None:
        added += [CB_BATCH_OPTION, str(CPU_BATCH_TOKENS)]
        batch_note = f"batches of at most {CPU_BATCH_TOKENS} tokens"
    tokens = n_blocks * page
    return CachePlan(tuple(added), tokens,
                     f"continuous batching's KV cache on the CPU: {n_blocks} blocks of {page} tokens ({tokens:,} "
                     f"tokens, about {_size(tokens * per_token)}), {batch_note}: bounded defaults on a CPU "
                     f"({CB_BLOCKS_OPTION}, {CB_BATCH_OPTION} set them)")


def summary(record: PathRecord, implementation: str, guardian: Guardian | None = None) -> str:
    """The line printed when the server stops: what hf_attnorm's attention function ran (and what the guard did)."""
    counts = record.paths.counts if isinstance(record.paths, PathCounts) else {}
    calls = sum(counts.values())
    paths = ", ".join(f"{p} x{n}" for p, n in sorted(counts.items())) or "none"
    guard = f"; requests: {guardian.summary()}" if guardian is not None else ""
    return (f"hf_attnorm serve: stopped; attention implementation {implementation!r} ran {calls} attention calls "
            f"({record.packed} packed by continuous batching); kernel paths: {paths}{guard}")


#: transformers serve's hidden switch that starts uvicorn in a thread and returns the ``Serve`` object (its
#: ``kill_server`` stops the continuous-batching manager's thread, which uvicorn's own shutdown leaves running: a
#: blocking ``transformers serve --continuous-batching`` does not exit after SIGINT)
NON_BLOCKING_OPTION = compat.SERVE_COMMAND[1]


def transformers_serve(args: list[str], standalone: bool = True) -> Any:
    """``transformers serve ARGS`` in this process, through transformers' own command-line app (without its update
    check, which would reach the network). ``standalone``: click's standalone mode (it prints usage errors and
    exits); else the command's value is returned (the ``Serve`` object) and errors are raised."""
    from transformers.cli.transformers import app  # (its import needs the serving extra only when it serves)

    return app(args=["serve", *args], prog_name="python -m hf_attnorm", standalone_mode=standalone)


class Stopper:
    """SIGINT/SIGTERM: the first sets ``event`` (the server stops gracefully); a second runs ``at_once`` (which
    exits)."""

    def __init__(self, at_once: Any) -> None:
        self.event = threading.Event()
        self.at_once = at_once
        self.signal: int | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        if self.event.is_set():
            self.at_once(signum)
            return
        self.signal = signum
        self.event.set()


def serve_until_stopped(args: list[str], guardian: Guardian, options: Options, stopper: Stopper,
                        on_built: Any = None) -> int:
    """Start transformers serve with ``args`` (uvicorn in its thread, the guard in front of its app), watch the
    continuous-batching worker until SIGINT or SIGTERM, then stop: uvicorn stops accepting, the requests in flight
    get the grace period, the ones left are stopped (a 503 each), continuous batching's worker stops, then
    ``Serve.kill_server`` unloads the model. Returns the exit status: 0 when stopped by a signal, 1 when the server
    stopped by itself (e.g. its port was taken; uvicorn logged why) or the worker kept dying, click's status for a
    usage error."""
    try:
        with guardian.wrapping_app_factory(on_built):
            server = transformers_serve([*args, NON_BLOCKING_OPTION], standalone=False)
    except Exception as e:  # click's usage errors know how to show themselves
        if callable(getattr(e, "show", None)) and isinstance(getattr(e, "exit_code", None), int):
            e.show()
            return e.exit_code
        raise
    if isinstance(server, int):  # (click's status for an early exit)
        return server
    thread = compat.serve_object_attribute(server, "_thread")
    uvicorn_server = compat.serve_object_attribute(server, "server")
    while thread.is_alive() and not stopper.event.wait(0.5):
        guardian.revive()
        if guardian.fatal:
            break
    stopped_by_signal = stopper.event.is_set() and not guardian.fatal
    if stopped_by_signal:
        name = signal.Signals(stopper.signal).name if stopper.signal else "a signal"
        log(f"{name}: stopping; the requests in flight ({len(guardian.active)}) get up to {options.grace_period:g} s "
            "(a second signal exits at once)")
    uvicorn_server.should_exit = True
    thread.join(options.grace_period)
    if thread.is_alive():
        stopped = guardian.abort_requests("the grace period ended")
        log(f"the grace period of {options.grace_period:g} s ended: stopped {stopped} request"
            f"{'s' if stopped != 1 else ''} still in flight")
        thread.join(5)
        if thread.is_alive():
            uvicorn_server.force_exit = True
            thread.join(2)
    guardian.stop_generations("the server stopped")
    with contextlib.suppress(Exception):  # (continuous batching's worker stops now, without waiting for a flush)
        compat.serve_stop_continuous_batching(compat.serve_object_attribute(server, "_generation_state"))
    compat.serve_stop(server)
    if guardian.fatal:
        log(f"ERROR: {guardian.fatal}")
        return 1
    return 0 if stopped_by_signal else 1


def _exit_now(code: int) -> None:
    """Leave the process with ``code`` without waiting for threads that still run (a generation stuck in a forward
    pass): the summary is printed already."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None, exit_process: bool | None = None) -> int:
    """The command; returns the exit status (0: stopped by SIGINT or SIGTERM, or ``--help``; 1: the server stopped by
    itself or the continuous-batching worker kept dying; 2: refused). ``exit_process`` (default: when ``argv`` is
    None, i.e. run as the command): once a server ran, leave the process with that status at once."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE, flush=True)
        try:
            transformers_serve(["--help"])
        except SystemExit:
            pass
        return 0
    try:
        options, args = own_options(args)
        serve_args, settings, route = plan(args)
    except AttnormError as e:
        print(str(e), file=sys.stderr)
        return 2
    missing = compat.serve_missing()
    if missing:
        print(f"{PROG}: transformers {compat.transformers_version_string()} lacks {', '.join(missing)}: serving "
              "needs the transformers serve of transformers 5.17 or later (checked: 5.17.0, 5.24.0); "
              "pip install -U transformers", file=sys.stderr)
        return 2
    if not compat.serve_extra_installed():
        print(f"{PROG}: transformers serve needs its serving extra (fastapi, uvicorn, pydantic, openai); install it "
              "with pip install 'hf_attnorm[serve]'", file=sys.stderr)
        return 2
    missing = compat.serve_guard_missing()
    if missing:
        print(f"{PROG}: transformers {compat.transformers_version_string()}'s server lacks {', '.join(missing)}, "
              "which this command's request guard relies on (checked: 5.17.0, 5.24.0)", file=sys.stderr)
        return 2
    impl = settings.implementation
    print(f"hf_attnorm serve: {serve_args[0]} with attention implementation {impl!r} (hf_attnorm {__version__}, "
          f"transformers {compat.transformers_version_string()}); route: "
          + ("continuous batching, " + route if route != "sequential" else "sequential (model.generate per request)"),
          file=sys.stderr, flush=True)
    cache_tokens = None
    if continuous_batching_requested(serve_args):
        cache = cache_plan(serve_args[0], serve_args)
        serve_args, cache_tokens = [*serve_args, *cache.added], cache.tokens
        log(cache.line)
    guardian = Guardian(options.max_new_tokens_cap, cache_tokens)
    record = PathRecord(paths=PathCounts())
    recording = contextlib.ExitStack()

    def on_built(model: Any, processor: Any) -> None:
        """The model is loaded and the port not yet open: build its kernels, then count what serving runs."""
        try:
            seconds, ran = warm_up(model)
        except Exception as e:
            raise ServeError(f"{PROG}: {serve_args[0]} failed its first forward passes on {model.device}, before "
                             f"serving: {type(e).__name__}: {e}") from e
        paths = collections.Counter(ran.paths)
        listed = ", ".join(f"{p} x{n}" for p, n in sorted(paths.items())) or "none"
        log(f"attention kernels ready in {seconds:.1f} s, built or loaded from the build cache before the port opens "
            f"(a prefill, a decode step and a padded batch on {model.device}; kernel paths: {listed})")
        recording.enter_context(record_paths(record, all_threads=True))  # (the server's threads)

    def at_once(signum: int) -> None:
        log(f"{signal.Signals(signum).name} again: exiting now, without waiting for the requests in flight")
        print(summary(record, impl, guardian), file=sys.stderr, flush=True)
        _exit_now(128 + signum)

    stopper = Stopper(at_once)
    previous = {s: signal.signal(s, stopper) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 1
    try:
        code = serve_until_stopped(serve_args, guardian, options, stopper, on_built)
    except ServeError as e:
        print(str(e), file=sys.stderr)
        code = 1
    finally:
        recording.close()
        print(summary(record, impl, guardian), file=sys.stderr, flush=True)
        for s, h in previous.items():
            signal.signal(s, h)
    if argv is None if exit_process is None else exit_process:
        # nothing is left to write; a thread stuck in a forward pass (or the interpreter's teardown after continuous
        # batching: 2.5 s here) need not be waited for
        _exit_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
