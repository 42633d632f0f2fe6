"""Claims the docs make that the code does not keep (docs/architecture.md,
docs/protocol.md, docs/fault-tolerance.md, docs/command-line.md). Each test encodes
what the docs say; mismatches that are only wrong text have no test."""

from __future__ import annotations

import pytest

from hoplite_gpu import calibrate as calibrate_mod
from hoplite_gpu.errors import InvalidArgument


class _Reached(Exception):
    """The size was accepted: calibrate went on to start its cluster."""


class _NoCluster:
    def __init__(self, *args, **kwargs) -> None:
        raise _Reached


def test_calibrate_accepts_a_size_of_1_mib(monkeypatch):
    """docs/command-line.md: `hoplite-gpu calibrate [--size 64MiB]` ... "(the
    size must be at least 1 MiB)". With the default inline threshold the
    code asks for 16 x (64 KiB + 1) = 1,048,592 bytes, so `--size 1MiB` is
    refused with InvalidArgument."""
    monkeypatch.delenv("HOPLITE_INLINE_THRESHOLD", raising=False)
    monkeypatch.setattr(calibrate_mod, "LocalCluster", _NoCluster)
    try:
        calibrate_mod.calibrate(large=1 << 20, repeats=1)
    except _Reached:
        return
    except InvalidArgument as exc:
        pytest.fail(f"a 1 MiB calibration was refused although docs/command-line.md allows it: {exc}")
