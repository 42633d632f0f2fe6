"""The one benchmark entry point, `python -m benchmarks`
(benchmarks/__main__.py and the modules it registers), as a user reruns it.
Quick: argument parsing, tiny pure computations and stand-ins for the
clusters and processes a real run would start; no benchmark runs here."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import benchmarks.__main__ as entry
from benchmarks import degree_sweep, fault, memory
from benchmarks import reduce as reduce_bench

MiB = 1 << 20


class _Started(Exception):
    """Raised by the stand-ins: the benchmark began work it should have refused."""


class _NoCluster:
    def __init__(self, *args, **kwargs):
        raise _Started(f"a LocalCluster was started with {args} {kwargs}")


def _no_process(*args, **kwargs):
    raise _Started(f"a process was started: {args[0] if args else kwargs}")


@pytest.fixture
def nothing_starts(monkeypatch, tmp_path):
    """Any cluster or child process the benchmark starts raises `_Started`;
    results would go to a temporary folder, not benchmarks/results/."""
    import hoplite_gpu.cluster

    monkeypatch.setattr(hoplite_gpu.cluster, "LocalCluster", _NoCluster)
    monkeypatch.setattr(reduce_bench, "LocalCluster", _NoCluster)
    monkeypatch.setattr(fault, "LocalCluster", _NoCluster)
    monkeypatch.setattr(subprocess, "Popen", _no_process)
    monkeypatch.setattr(subprocess, "run", _no_process)
    monkeypatch.setattr(entry, "RESULTS", tmp_path)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv", [
    # ran for 4 s, printed "-1 MiB ... ratio 3.29 ... ok yes" (an empty object
    # timed), exit 0, and would have saved size_bytes -1048576
    ["broadcast", "--workers", "3", "--sizes", "-1", "--repeats", "1"],
    # HopliteError traceback "no worker 1: this cluster has workers 0 to 0"
    ["broadcast", "--workers", "1", "--sizes", "8", "--repeats", "1"],
    ["reduce", "--workers", "1", "--size", "8", "--repeats", "1"],
    # runs the untimed warm-up, then StatisticsError "no median for empty data"
    ["reduce", "--workers", "3", "--size", "8", "--repeats", "0"],
    # one receiver is never a relay: 60 s, then TimeoutError traceback
    ["fault", "--workers", "2", "--size", "16", "--repeats", "1"],
    # StatisticsError traceback after starting a directory and a putter
    ["coldget", "--calls-hot", "0", "--calls-cold", "3"],
    # subprocess.TimeoutExpired "timed out after -11.0 seconds"
    ["latency", "--ranks", "2", "--calls", "70", "--warmup", "1", "--period", "-1"],
    # IndexError traceback from rss[-1]
    ["memory", "--objects", "0", "--size", "8", "--limit", "16", "--repeats", "1"],
    # every setting's row is the same child error, exit status 0
    ["progress", "--workers", "1", "--seconds", "0.5", "--repeats", "10"],
    # ValueError: max() arg is an empty sequence
    ["machine", "--procs", "0", "--mib", "8", "--big-gib", "1"],
    # ValueError: invalid literal for int() ... '12X'
    ["degree-sweep", "--sizes", "12X", "--inputs", "4"],
    # ValueError: could not convert string to float: 'fast'
    ["degree-sweep", "--sizes", "1M", "--inputs", "4", "--links", "fast"],
    # ZeroDivisionError in the simulator
    ["degree-sweep", "--sizes", "1M", "--inputs", "4", "--chunk", "0"],
    # ValueError: min() arg is an empty sequence
    ["degree-sweep", "--sizes", "1M", "--inputs", "4", "--max-degree", "0"],
], ids=lambda a: " ".join(a))
def test_arguments_it_cannot_run_are_refused_with_a_message(argv, nothing_starts, capsys):
    """Arguments no run can use (a negative size, one worker where a receiver
    or a relay is needed, zero repeats/objects/processes, a size or link
    that does not parse, a zero chunk or degree, a negative period) must be
    refused up front with a usage message and a non-zero exit, before any
    cluster or process starts. Today none of these is checked
    (benchmarks/__main__.py's parsers use bare `type=int`/`float`;
    coldget/memory/machine/progress/degree_sweep's `add_arguments` likewise):
    the user gets a raw traceback after the benchmark started clusters and
    processes (or, for fault --workers 2, after 60 s), and for
    `broadcast --sizes -1` a table of an empty object's times labelled
    "-1 MiB", exit status 0."""
    with pytest.raises(SystemExit) as info:
        entry.main(list(argv) + ["--no-save"])
    assert info.value.code not in (0, None)


@pytest.mark.timeout(30)
def test_memory_limit_zero_is_not_reported_as_a_limited_variant(monkeypatch, tmp_path):
    """`memory --limit 0`: store_bytes 0 means "no limit", so both variants
    run unlimited, yet the table labels the second "limit 0 MiB" and prints
    "limited / unlimited: peak RSS 1.00 x" as if a limit had been measured
    (benchmarks/memory.py, run(): `variants = {"no limit": 0,
    f"limit {args.limit} MiB": limit}` with limit = 0). Seen: "limit 0 MiB |
    65 MiB | ... | held 24 MiB | evicted 0". A limit below 1 MiB must be
    refused, or at least the limited variant must run with a limit."""
    stores = []

    def fake_launch(size, count, limit, seed):
        stores.append(limit)
        return {"seconds": [0.01] * count, "rss": [1 << 26] * count, "peak": 1 << 26,
                "held_bytes": size * count, "evicted": 0, "byte_identical": True}

    monkeypatch.setattr(memory, "_launch", fake_launch)
    monkeypatch.setattr(entry, "RESULTS", tmp_path)
    try:
        entry.main(["memory", "--objects", "3", "--size", "8", "--limit", "0", "--repeats", "1",
                    "--no-save"])
    except SystemExit as exc:  # refused: fine
        assert exc.code not in (0, None)
        return
    assert stores[1:] and all(s > 0 for s in stores[1:]), \
        f"the 'limit 0 MiB' variant ran with store limits {stores[1:]} (0 = unlimited)"


def test_fault_benchmark_moves_bytes_where_a_relay_can_be_caught_halfway(monkeypatch):
    """`python -m benchmarks fault` fails at every setting, its defaults
    included: after 60 s, `TimeoutError: no relay reached half of the
    object` (seen for --workers 3 --size 16, --workers 3 --size 256 and the
    default 7 x 256 MiB). benchmarks/fault.py:run builds
    `LocalCluster(workers, **settings)` with shared memory on (the default
    since same-host pulls went through shared memory): each receiver then
    copies the object whole from a memfd, so the directory sees its bytes
    jump from 0 to complete and `_kill_a_relay_halfway` never finds a
    serving, incomplete holder at >= half. Its last saved result
    (fault-loopback-2026-11-22.json) predates shared memory. The benchmark
    must run its cluster with shared memory off (bytes over TCP, where a
    relay holds part of the object)."""
    seen = {}

    class Recorder:
        def __init__(self, workers, **kwargs):
            seen.update(kwargs, env=os.environ.get("HOPLITE_SHARED_MEMORY"))
            raise _Started

    monkeypatch.setattr(fault, "LocalCluster", Recorder)
    with pytest.raises(_Started):
        fault.run(3, 16 * MiB, 1, None, stall_timeout_s=2.0, heartbeat_interval_s=0.5,
                  node_lease_s=2.0)
    assert seen.get("shared_memory") is False or seen["env"] == "0", \
        f"the fault benchmark's cluster runs with shared memory on: {seen}"


def _degree_sweep_result() -> dict:
    rows = degree_sweep.sweep([64 * 1024], [3], [(1.25e9, 1e-4)])
    return {"benchmark": "degree-sweep", "rows": rows, "summary": degree_sweep.summarize(rows)}


@pytest.mark.timeout(60)
def test_plot_draws_the_results_beside_a_degree_sweep(tmp_path):
    """`python -m benchmarks plot` (and `make bench`, which runs it) crashes on
    the repository's own results since degree-sweep-2026-11-24.json was
    saved: `TypeError: string indices must be integers, not 'str'` in
    benchmarks/plots.py:_summary_plots. plot_all takes any JSON with a
    "summary" key for the emulated schema (a list of entries), but
    degree-sweep's "summary" is a dict; every file sorted after it
    (all the emulated-* results) is left unplotted."""
    pytest.importorskip("matplotlib")
    from benchmarks.plots import plot_all

    (tmp_path / "degree-sweep-2026-11-24.json").write_text(json.dumps(_degree_sweep_result()))
    (tmp_path / "broadcast-loopback-2026-11-25.json").write_text(json.dumps({
        "benchmark": "broadcast-loopback", "rows": [{
            "size_bytes": 8 * MiB, "workers": 3, "receivers": 2, "repeats": 1,
            "shared_memory": False, "p2p_s": [0.005], "broadcast_s": [0.013],
            "p2p_median_s": 0.005, "broadcast_median_s": 0.013,
            "ratio_broadcast_to_p2p": 2.6, "byte_identical": True, "edges": []}]}))
    made = plot_all(tmp_path)
    assert "broadcast-loopback-2026-11-25.png" in [p.name for p in made]


@pytest.mark.timeout(60)
def test_a_rerun_on_the_same_day_keeps_the_earlier_result(monkeypatch, tmp_path):
    """benchmarks/__main__.py promises results saved "so a rerun can be
    compared side by side", but it writes `<name>-<date>.json` with
    `out.write_text` (main(), `RESULTS / f"{stem}-{dt.date.today()...}.json"`):
    a second run the same day, with other arguments or not, silently
    replaces the first. Today (2026-11-24) a plain `python -m benchmarks
    degree-sweep` or `allreduce` overwrites the committed
    degree-sweep-2026-11-24.json / allreduce-loopback-shm-2026-11-24.json
    that benchmarks/README.md and docs cite. Here two tiny degree sweeps
    leave one file, holding only the second command."""
    monkeypatch.setattr(entry, "RESULTS", tmp_path)
    base = ["degree-sweep", "--sizes", "64K", "--inputs", "3", "--links", "1.25e9:1e-4"]
    assert entry.main(base + ["--gap-factor", "2"]) == 0
    assert entry.main(base + ["--gap-factor", "3"]) == 0
    commands = sorted(json.loads(p.read_text())["command"] for p in tmp_path.glob("*.json"))
    assert len(commands) == 2, f"one run's result was overwritten; left: {commands}"
