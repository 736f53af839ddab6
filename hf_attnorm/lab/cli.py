"""What the command lines share: argparse types that refuse bad numbers with the value and what is allowed."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


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


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value
