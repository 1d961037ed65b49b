"""argparse types for numeric flags: an impossible value is refused by argparse with the flag's name
(``argument --jobs: must be >= 1, got 0``), on one line (see :class:`fedtailor.cli._Parser`)."""

from __future__ import annotations

import argparse
import math


def _number(text: str, kind: type) -> float | int:
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return int(value)


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return int(value)


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _number(text, float)
    if not (value > 0.0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return float(value)


def open_unit(text: str) -> float:
    """A number strictly between 0 and 1 (a probability such as delta, a fraction)."""
    value = _number(text, float)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must lie strictly between 0 and 1, got {text}")
    return float(value)
