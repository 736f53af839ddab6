"""``python -m hf_attnorm serve PATH [options of transformers serve]`` (console command ``hf-attnorm-serve``): serve
an hf_attnorm checkpoint through transformers' own OpenAI-compatible server (``transformers serve``:
/v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /health) in a process that imported hf_attnorm, so
that the model runs the implementation its config.json records.

* PATH comes first: a local checkpoint folder saved with hf_attnorm imported (config.json holds ``attnorm``). It is
  checked like ``from_pretrained`` checks it (settings, checksums, safetensors metadata) before the server starts;
  a plain checkpoint is refused (serve it with ``transformers serve``).
* Every other option is transformers serve's (``--port``, ``--host``, ``--continuous-batching``, ``--cb-*``,
  ``--device``, ``--dtype``, ...). ``--attn-implementation`` may only name the checkpoint's own implementation (it is
  then left out: transformers serve accepts its own names only, and the checkpoint's name is what loads).
* ``--continuous-batching`` runs the implementation on continuous batching's packed route when its normalizer and
  scale declare it exact there (``continuous_batching`` = "packed" or "per_sequence"). transformers serve has a
  sequential path (``model.generate`` per request, its default): an implementation declared "refused" there, or a
  transformers lacking what the integration needs, is served on that path instead, with a warning saying why
  (transformers serve falls back the same way for a model without continuous batching).
* It prints one line when it starts (the checkpoint, the implementation, the route) and one when it stops: how many
  attention calls hf_attnorm's function ran, how many came packed from continuous batching, and on which kernel
  paths. SIGINT or SIGTERM stop it after the requests in flight (uvicorn's graceful shutdown), then stop
  continuous batching's thread and unload the model; it then exits 0.

transformers serve never imports hf_attnorm itself: what it does with an hf_attnorm checkpoint is described in
docs/clients.md (it warns, through the marker tensor of ``hf.persistence``).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .hf import compat, integration
from .hf.forward import PathRecord, continuous_batching_support, record_paths
from .hf.persistence import verify_checkpoint
from .registry import AttnormError, canonical
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
  every other option is transformers serve's (--port, --host, --continuous-batching, --cb-num-blocks, --device,
  --dtype, --log-level, ...), listed below
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
        reason = integration.settings_continuous_batching_refusal([settings])
        if reason is None:
            route = continuous_batching_support(settings)[0]
        else:
            print(f"hf_attnorm serve: WARNING: continuous batching cannot run {impl!r} exactly: {reason}. Serving it "
                  "on transformers serve's sequential path instead (model.generate per request); leave out "
                  f"{CB_OPTION} to silence this warning.", file=sys.stderr, flush=True)
            rest.append(NO_CB_OPTION)
    return [path, *rest], settings, route


def summary(record: PathRecord, implementation: str) -> str:
    """The line printed when the server stops: what hf_attnorm's attention function ran."""
    counts = record.paths.counts if isinstance(record.paths, PathCounts) else {}
    calls = sum(counts.values())
    paths = ", ".join(f"{p} x{n}" for p, n in sorted(counts.items())) or "none"
    return (f"hf_attnorm serve: stopped; attention implementation {implementation!r} ran {calls} attention calls "
            f"({record.packed} packed by continuous batching); kernel paths: {paths}")


#: transformers serve's hidden switch that starts uvicorn in a thread and returns the ``Serve`` object (its
#: ``kill_server`` stops the continuous-batching manager's thread, which uvicorn's own shutdown leaves running: a
#: blocking ``transformers serve --continuous-batching`` does not exit after SIGINT)
NON_BLOCKING_OPTION = "--non-blocking"


def transformers_serve(args: list[str], standalone: bool = True) -> Any:
    """``transformers serve ARGS`` in this process, through transformers' own command-line app (without its update
    check, which would reach the network). ``standalone``: click's standalone mode (it prints usage errors and
    exits); else the command's value is returned (the ``Serve`` object) and errors are raised."""
    from transformers.cli.transformers import app  # (its import needs the serving extra only when it serves)

    return app(args=["serve", *args], prog_name="python -m hf_attnorm", standalone_mode=standalone)


def serve_until_stopped(args: list[str]) -> int:
    """Start transformers serve with ``args`` (uvicorn in its thread), wait for SIGINT or SIGTERM, then stop it
    gracefully: uvicorn finishes the requests in flight, then ``Serve.kill_server`` stops the generation managers
    (continuous batching's thread) and unloads the model. Returns the exit status: 0 when stopped by a signal, 1 when
    the server stopped by itself (e.g. its port was taken; uvicorn logged why), click's status for a usage error."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda signum, frame: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            server = transformers_serve([*args, NON_BLOCKING_OPTION], standalone=False)
        except Exception as e:  # click's usage errors know how to show themselves
            if callable(getattr(e, "show", None)) and isinstance(getattr(e, "exit_code", None), int):
                e.show()
                return e.exit_code
            raise
        if isinstance(server, int):  # (click's status for an early exit)
            return server
        thread = server._thread
        while thread.is_alive() and not stop.wait(0.5):
            pass
        stopped_by_signal = stop.is_set()
        server.server.should_exit = True
        thread.join()
        server.kill_server()
        return 0 if stopped_by_signal else 1
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def main(argv: Sequence[str] | None = None) -> int:
    """The command; returns the exit status (0: stopped by SIGINT or SIGTERM, or ``--help``; 2: refused)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE, flush=True)
        try:
            transformers_serve(["--help"])
        except SystemExit:
            pass
        return 0
    try:
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
    impl = settings.implementation
    print(f"hf_attnorm serve: {serve_args[0]} with attention implementation {impl!r} (hf_attnorm {__version__}, "
          f"transformers {compat.transformers_version_string()}); route: "
          + ("continuous batching, " + route if route != "sequential" else "sequential (model.generate per request)"),
          file=sys.stderr, flush=True)
    record = PathRecord(paths=PathCounts())
    try:
        with record_paths(record):
            return serve_until_stopped(serve_args)
    finally:
        print(summary(record, impl), file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
