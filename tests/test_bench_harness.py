"""The benchmark harness's statistics, bounds, checks and arguments
(benchmarks/emurun.py, netbench.py, payload.py). Pure functions called on
synthetic data: no namespaces, no processes, no network."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import emurun, netbench
from benchmarks.payload import check, link_volume, make_input

MiB = 1 << 20


def _row(samples: list[float], system: str = "hoplite-gpu") -> dict:
    return {"system": system, "op": "allreduce", "hosts": 8, "size_bytes": 256 * MiB,
            "bandwidth_bps": 1e9, "samples_s": samples, "lower_bound_s": 1.0,
            "cpu": None, "cpu_s_per_call": None}


def test_summary_quartiles_stay_within_the_calls():
    # Two calls (--steady 2 or --repeats 2): p25/p75 must lie between min and max;
    # the 'exclusive' quantile method extrapolates to 0.75 and 2.25 here.
    (e,) = emurun.summarize([_row([1.0, 2.0])])
    assert e["min_s"] <= e["p25_s"] <= e["median_s"] <= e["p75_s"] <= e["max_s"], e


@pytest.mark.parametrize("op, world, floor", [
    ("reduce", 2, 1),         # rank 0's sum needs all S bytes of rank 1 on host 0's downlink
    ("allreduce", 2, 2),      # each of the two hosts needs the other's S bytes
    ("allreduce", 8, 14),     # the docstring: 2(N-1)/N S per rank, N ranks
])
def test_link_volume_floor_is_what_the_op_needs(op, world, floor):
    s = 64 * MiB
    assert link_volume(op, world, s) >= floor * s


@pytest.mark.parametrize("op", ["reduce", "gather"])
def test_result_check_catches_a_wrong_chunk_outside_the_windows(op):
    # Only rank 0 holds a reduce's or a gather's result, so the CRC agreement
    # across ranks compares rank 0's CRC with itself: a 4 KiB run of wrong
    # values between the checked windows must still fail the check.
    nbytes, world = 1 * MiB, 2
    xs = [make_input(r, nbytes) for r in range(world)]
    if op == "reduce":
        result = xs[0] + xs[1]
        result[50_000:51_024] = 0.0
    else:
        result = [xs[0].copy(), xs[1].copy()]
        result[1][50_000:51_024] = 0.0
    ok, _ = check(op, world, result, nbytes, 0)
    assert not ok


def test_bad_size_argument_is_a_usage_error(capsys):
    # --latency-max is parsed by parse_size at parse time; --sizes is not, so a
    # typo surfaces later in run() as an ArgumentTypeError traceback.
    p = argparse.ArgumentParser(prog="emulated")
    emurun.add_arguments(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--sizes", "12X"])


def test_small_sizes_time_the_number_of_calls_asked_for(monkeypatch):
    # benchmarks/README.md: sizes up to --latency-max are timed as --iters calls (fewer only to
    # fit --latency-budget); --iters 3 must not become 5.
    seen = {}

    def fake_run_launch(cluster, system, op, size, **kw):
        seen.update(kw)
        return {}

    monkeypatch.setattr(netbench, "run_launch", fake_run_launch)
    p = argparse.ArgumentParser()
    emurun.add_arguments(p)
    args = p.parse_args(["--iters", "3"])
    emurun._measure(object(), "hoplite-gpu", "broadcast", 1024, "t", args)
    assert seen["iters"] == 3


def test_rayemu_refuses_a_setting_without_a_value(capsys):
    from benchmarks import rayemu

    with pytest.raises(SystemExit) as info:
        rayemu.main(["collectives", "--set", "object_spilling_threshold"])
    assert info.value.code == 2
    assert "expected NAME=VALUE" in capsys.readouterr().err
