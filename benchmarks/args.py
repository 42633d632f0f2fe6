"""Argument types that refuse, with a usage message, what no run can use (a
negative size, zero repeats), before any cluster or process starts."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from hoplite_gpu.config import parse_size


def at_least(low: int) -> Callable[[str], int]:
    """An int of at least `low`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an int: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}; got {value}")
        return value
    return parse


def seconds(low: float = 0.0, *, above: bool = False) -> Callable[[str], float]:
    """A finite float of at least `low` (more than `low` with `above`)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or value < low or (above and value == low):
            raise argparse.ArgumentTypeError(
                f"must be {'more than' if above else 'at least'} {low:g}; got {text}")
        return value
    return parse


def size(text: str) -> int:
    """A positive number of bytes: 4096, 64K, 16M, 1GiB (binary units)."""
    try:
        value = parse_size(text)
    except Exception:  # (parse_size raises the project's ConfigError)
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 64K, 16M)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte; got {text!r}")
    return value
