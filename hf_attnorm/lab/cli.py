"""What the command lines share: offline by default (``offline_by_default``, around every command's ``main``, and
``set_offline_defaults``, which ``scripts/_bootstrap.py`` calls), and argparse types that refuse bad numbers with the
value and what is allowed."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from collections.abc import Callable, Iterator

#: the variables that keep huggingface_hub, transformers and datasets from downloading
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def _library_copies() -> list[tuple[object, str, bool]]:
    """(module, attribute, value): the copies of the variables that huggingface_hub and datasets read once, when
    imported (a command imports them, with hf_attnorm and the lab, before its main runs), with the values they would
    read from the environment now; only for the modules imported so far."""
    copies: list[tuple[object, str, bool]] = []
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:
        value = _true(os.environ.get("HF_HUB_OFFLINE", "") or os.environ.get("TRANSFORMERS_OFFLINE", ""))
        copies.append((hub, "HF_HUB_OFFLINE", value))
    datasets_config = sys.modules.get("datasets.config")
    if datasets_config is not None:
        value = _true(os.environ.get("HF_DATASETS_OFFLINE", ""))
        copies += [(datasets_config, "HF_HUB_OFFLINE", value), (datasets_config, "HF_DATASETS_OFFLINE", value)]
    return copies


@contextlib.contextmanager
def offline_by_default() -> Iterator[list[str]]:
    """Nothing downloads from a model or dataset hub inside the block unless the user says otherwise: sets each of
    ``OFFLINE_VARIABLES`` that is unset to "1" (a value the user set is kept), gives the copies huggingface_hub and
    datasets took of them the values they would read now, and yields the names it set. On exit both are as before
    (copies taken inside the block read the restored variables), so a command's ``main`` called from Python (a
    notebook) changes nothing for the rest of the process. Also a decorator (``@offline_by_default()``)."""
    unset = [name for name in OFFLINE_VARIABLES if name not in os.environ]
    before = {(id(module), attr): (module, attr, getattr(module, attr)) for module, attr, _ in _library_copies()}
    for name in unset:
        os.environ[name] = "1"
    try:
        if unset:
            for module, attr, value in _library_copies():
                setattr(module, attr, value)
        yield unset
    finally:
        for name in unset:
            os.environ.pop(name, None)
        if unset:
            for module, attr, value in _library_copies():
                old = before.get((id(module), attr))
                setattr(module, attr, value if old is None else old[2])


def set_offline_defaults() -> list[str]:
    """``offline_by_default`` for the rest of this process: for a script's own process (``scripts/_bootstrap.py``),
    never for code that other code imports. Returns the names it set."""
    unset = [name for name in OFFLINE_VARIABLES if name not in os.environ]
    for name in unset:
        os.environ[name] = "1"
    if unset:
        for module, attr, value in _library_copies():
            setattr(module, attr, value)
    return unset


def _true(value: str) -> bool:
    """Whether huggingface_hub and datasets read an environment variable's value as true."""
    return value.upper() in {"1", "ON", "YES", "TRUE"}


def int_at_least(low: int, name: str | None = None) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low`` (``name``: the function's name, which argparse shows in some
    messages)."""
    what = "a positive integer" if low == 1 else f"an integer >= {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    parse.__name__ = name or f"int_at_least_{low}"
    return parse


#: argparse types: an integer >= 1, an integer >= 0
positive_int = int_at_least(1, "positive_int")
nonnegative_int = int_at_least(0, "nonnegative_int")


def _finite_float(text: str, allowed: Callable[[float], bool], what: str) -> float:
    """An argparse type's check: ``text`` as a finite number for which ``allowed`` holds, else an error saying
    ``what`` it must be."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not math.isfinite(value) or not allowed(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    return _finite_float(text, lambda v: v > 0, "a finite number > 0")


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    return _finite_float(text, lambda v: v >= 0, "a finite number >= 0")


def comma_names(text: str) -> list[str]:
    """An argparse type: comma-separated names (at least one), e.g. ``q_proj,k_proj``."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"must be comma-separated names (at least one), got {text!r}")
    return names


def token_counts(text: str) -> list[int]:
    """An argparse type: comma-separated token counts >= 2 (e.g. ``512,2048``)."""
    try:
        values = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated token counts, e.g. 512,2048; got {text!r}") \
            from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"must be comma-separated token counts >= 2, got {text!r}")
    return values
