"""`python -m benchmarks allreduce` runs end to end: every setting, every
result the exact sum, and arguments it cannot run refused."""

from __future__ import annotations

import argparse
import io

import pytest
from rich.console import Console

from benchmarks import allreduce


@pytest.mark.slow  # an end-to-end launch of the benchmark
def test_the_allreduce_benchmark_runs_every_setting_exactly():
    # 12 MiB among 3 ranks: 4 MiB slices, one chunk each, so "auto" slices
    args = argparse.Namespace(ranks=3, size=12, calls=2, rounds=1,
                              slicing=["off", "adaptive", "auto"], shared_memory="on")
    result = allreduce.run(args, Console(file=io.StringIO()))
    assert [r["slicing"] for r in result["rows"]] == ["off", "adaptive", "auto"]
    assert all(r["byte_identical"] for r in result["rows"])
    assert all(len(r["launch_medians_s"]) == 1 and r["median_s"] > 0 for r in result["rows"])
    assert result["file_stem"] == "allreduce-loopback-shm"


@pytest.mark.parametrize("argv", [["--ranks", "1"], ["--calls", "1"], ["--size", "0"],
                                  ["--slicing", "on"]])
def test_the_allreduce_benchmark_refuses_what_it_cannot_run(argv):
    p = argparse.ArgumentParser()
    allreduce.add_arguments(p)
    with pytest.raises(SystemExit):
        p.parse_args(argv)
