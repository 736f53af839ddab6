"""What the command lines share: offline by default (``offline_by_default``, which every command's ``main`` and
``scripts/_bootstrap.py`` call), and argparse types that refuse bad numbers with the value and what is allowed."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable

#: the variables that keep huggingface_hub, transformers and datasets from downloading
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def offline_by_default() -> list[str]:
    """Nothing downloads from a model or dataset hub unless the user says otherwise: sets each of
    ``OFFLINE_VARIABLES`` that is unset to "1" (a value the user set is kept) and returns the names it set."""
    unset = [name for name in OFFLINE_VARIABLES if name not in os.environ]
    for name in unset:
        os.environ[name] = "1"
    # huggingface_hub and datasets read the variables once, when imported, and a command has imported them (with
    # hf_attnorm and the lab) before its main runs: their copies get what they would read now
    hub = sys.modules.get("huggingface_hub.constants")
    if unset and hub is not None:
        hub.HF_HUB_OFFLINE = _true(os.environ["HF_HUB_OFFLINE"] or os.environ["TRANSFORMERS_OFFLINE"])
    datasets_config = sys.modules.get("datasets.config")
    if unset and datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = datasets_config.HF_DATASETS_OFFLINE = _true(os.environ["HF_DATASETS_OFFLINE"])
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
