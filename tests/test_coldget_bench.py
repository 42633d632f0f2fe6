"""`python -m benchmarks coldget` runs end to end: a directory, a putting node
and a calling process, each of the three ways of fetching checked for the
right value, every call timed."""

from __future__ import annotations

import argparse
import io

from rich.console import Console

from benchmarks import coldget


def test_every_way_is_timed_back_to_back_and_after_a_sleep():
    args = argparse.Namespace(calls_hot=5, calls_cold=3, period=0.01)
    result = coldget.run(args, Console(file=io.StringIO()))
    hot, cold = result["rows"]
    assert (hot["sleep_s"], cold["sleep_s"]) == (0.0, 0.01)
    for row, calls in ((hot, 5), (cold, 3)):
        for way in coldget.WAYS:
            assert len(row[f"{way}_cpu_s"]) == calls
            assert 0 < row[f"{way}_wall_median_s"] < 1.0
        assert row["directory_cpu_s_per_locate"] >= 0
