"""Smoke test of the emulated multi-host harness: 2 namespaces, shaped links,
a small broadcast across them. Skips where namespaces cannot be created."""

from __future__ import annotations

import subprocess

import pytest

from benchmarks.emulated import EmulatedCluster, EmulationUnavailable
from benchmarks.netbench import hoplite_broadcast


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return out.stdout.split()


@pytest.mark.timeout(180)
def test_broadcast_crosses_shaped_links_and_cleans_up():
    try:
        cluster = EmulatedCluster(3, 200e6)
        with cluster:
            link = cluster.measure_link(8 << 20)
            assert 100e6 < link < 260e6, f"shaping not in effect: {link / 1e6:.0f} Mbit/s"
            row = hoplite_broadcast(cluster, 4 << 20, "smoke")
            # 4 MiB at 200 Mbit/s is 0.17 s: far slower than loopback, so the bytes
            # really crossed the shaped veths, and a pipelined chain stays near S/B
            assert 1.0 < row["ratio_to_bound"] < 4.0, row
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    assert not [ns for ns in _namespaces() if ns.startswith(cluster.prefix)]
