"""Smoke test of the emulated multi-host harness: 2 namespaces, shaped links,
a small broadcast across them. Skips where namespaces cannot be created."""

from __future__ import annotations

import pytest
from namespaces import (
    check_a_killed_runs_namespaces_are_swept,
    dead_tag,
    namespaces,
)

from benchmarks.emulated import EmulatedCluster, EmulationUnavailable, sweep_stale
from benchmarks.netbench import link_timeline, run_launch


@pytest.mark.timeout(180)
def test_broadcast_crosses_shaped_links_and_cleans_up():
    try:
        cluster = EmulatedCluster(3, 200e6)
        with cluster:
            link = cluster.measure_link(8 << 20)
            assert 100e6 < link < 260e6, f"shaping not in effect: {link / 1e6:.0f} Mbit/s"
            with cluster.link_sampler(0.01) as links:
                # (a warm-up call, then the median of three: one cold call
                # timed its connections' start on a slow machine, 5.5 x S/B)
                row = run_launch(cluster, "hoplite-gpu", "broadcast", 4 << 20, tag="smoke",
                                 iters=3, warmup=1, sync=True)
            # the sampler saw the bytes leave the root's host (rank 0, host 0)
            assert len(links.samples) >= 2
            (t_a, first), (t_b, last) = links.samples[0], links.samples[-1]
            assert t_b > t_a and last[0][1] - first[0][1] >= 4 << 20
            # 4 MiB at 200 Mbit/s is 0.17 s: far slower than loopback, so the bytes
            # really crossed the shaped veths, and a pipelined chain stays near S/B
            assert len(row["samples_s"]) == 3
            assert 1.0 < row["ratio_to_bound"] < 4.0, row
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    assert not [ns for ns in namespaces() if ns.startswith(cluster.prefix)]


@pytest.mark.timeout(180)
def test_group_calls_in_a_loop_cross_the_shaped_links():
    """The `hoplite-gpu-group` system: every rank calls the collective on a
    `Group` after the group's own barrier, with no delete; each call's
    result is checked on every rank (run_launch raises otherwise)."""
    try:
        cluster = EmulatedCluster(3, 200e6)
        with cluster:
            for op in ("broadcast", "allreduce"):
                row = run_launch(cluster, "hoplite-gpu-group", op, 2 << 20, tag=f"group-{op}",
                                 iters=3, warmup=1, sync=True)
                assert row["sync"] and len(row["samples_s"]) == 3, row
                assert row["link_bytes_down"] >= row["link_bytes_floor"] > 0
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    assert not [ns for ns in namespaces() if ns.startswith(cluster.prefix)]


@pytest.mark.timeout(120)
def test_each_host_link_is_shaped_to_its_own_rate():
    try:
        cluster = EmulatedCluster(3, 75e6, rates_bps=[300e6, 75e6, 300e6])
        with cluster:
            slow = cluster.measure_link(2 << 20, src=0, dst=1)
            fast = cluster.measure_link(4 << 20, src=0, dst=2)
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    # 4 x apart as shaped; a busy machine can slow the fast link, never speed the slow one
    assert slow < 130e6, f"host 1 not shaped to its own rate: {slow / 1e6:.0f} Mbit/s"
    assert fast > 2 * slow, f"host 2: {fast / 1e6:.0f} Mbit/s against {slow / 1e6:.0f}"


@pytest.mark.timeout(60)
def test_namespaces_of_a_killed_run_are_swept_and_live_ones_kept():
    dead = dead_tag()
    check_a_killed_runs_namespaces_are_swept(
        sweep_stale, [f"hg{dead}n0", f"hg{dead}sw"], f"{EmulatedCluster(2).prefix}n9")


def test_link_timeline_reports_each_hosts_use():
    # two hosts at 1 Gbit/s, sampled every 50 ms: host 0 sends flat out, host 1
    # at half the rate, and both idle after 1 s; one call from 0.0 s to 1.0 s
    per_s, every = 1e9 / 8, 0.05
    samples = [(k * every, [(0, int(per_s * min(k * every, 1.0))),
                            (0, int(per_s / 2 * min(k * every, 1.0)))]) for k in range(31)]
    out = link_timeline(samples, 1e9, [0.0], [1.0], marks=[0.5])
    assert out["link_timeline"]["marks"] == [0.5]
    assert out["link_use_up_mean"] == [pytest.approx(0.75, abs=0.01)]
    assert out["link_use_up_min"] == [pytest.approx(0.5, abs=0.01)]
    series = out["link_timeline"]
    assert series["calls"] == [[0.0, 1.0]]
    busy = [u for t, u in zip(series["t_s"], series["up"], strict=True) if t < 0.95]
    assert busy and all(u == [pytest.approx(1.0, abs=0.02), pytest.approx(0.5, abs=0.02)]
                        for u in busy)
    assert all(d == [0.0, 0.0] for d in series["down"])


def test_link_timeline_without_samples_is_empty():
    out = link_timeline([], 1e9, [0.0], [1.0])
    assert out == {"link_timeline": None, "link_use_up_mean": [], "link_use_up_min": []}
