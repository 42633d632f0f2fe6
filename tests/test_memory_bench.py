"""`python -m benchmarks memory` runs end to end: both variants, every copy
byte-identical, and the reader under a limit holds no more than it."""

from __future__ import annotations

import argparse
import io

from rich.console import Console

from benchmarks import memory

MiB = 1 << 20


def test_the_memory_benchmark_runs_both_variants_and_the_limit_holds():
    args = argparse.Namespace(objects=5, size=4, limit=12, repeats=1)
    result = memory.run(args, Console(file=io.StringIO()))
    free, bounded = result["rows"]
    assert free["byte_identical"] and bounded["byte_identical"]
    assert (free["held_bytes"], free["evicted"]) == (5 * 4 * MiB, 0)
    assert (bounded["held_bytes"], bounded["evicted"]) == (12 * MiB, 2)
    assert len(bounded["launches"][0]["seconds"]) == 5
