"""Smoke test of Ray on emulated hosts (benchmarks/rayemu.py): 2 namespaces, one
Ray node in each, Ray's broadcast of a small object across the shaped link, and
hoplite-gpu inside the Ray actors bound to each namespace's address; afterwards
no process of the run is left and its temp dir is gone. Skips where namespaces
cannot be created or Ray is not installed."""

from __future__ import annotations

import os
import subprocess

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install -e .[ray])")

from benchmarks.emulated import EmulatedCluster, EmulationUnavailable  # noqa: E402
from benchmarks.rayemu import RayOnEmulated, _naming  # noqa: E402


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return out.stdout.split()


@pytest.mark.slow  # Ray started on emulated hosts: ~25 s (`make test-slow`)
@pytest.mark.timeout(180)
def test_ray_broadcast_crosses_shaped_link_and_cleans_up():
    size = 4 << 20
    cluster = EmulatedCluster(2, 200e6)
    try:
        with cluster, RayOnEmulated(cluster, object_store_bytes=256 << 20,
                                    head_object_store_bytes=256 << 20) as rc:
            root = rc.root
            res = rc.driver({"workload": "collectives", "size": size, "ops": ["broadcast"],
                             "repeats": 1, "label": "ray", "ray_config": {},
                             "bandwidth_bps": 200e6}, timeout=150)
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    # each Ray node and the hoplite-gpu node in its actor live on their own host
    for i, where in enumerate(res["placement"]):
        assert where["ray_node_ip"] == cluster.address(i), where
        assert where["hoplite_data_address"].startswith(f"tcp://{cluster.address(i)}:"), where
    assert res["directory"].startswith(f"tcp://{cluster.address(0)}:")
    (row,) = res["rows"]
    # the object crossed the veths: host 0 sent it, host 1 received it, at the shaped rate
    sent, got = row["nic_bytes"][0]["tx_bytes"], row["nic_bytes"][1]["rx_bytes"]
    assert size <= sent < 1.2 * size and size <= got < 1.2 * size, row["nic_bytes"]
    assert row["link_bytes_down"] >= row["link_bytes_floor"] == size, row
    assert 0.9 < row["ratio_to_bound"] < 6.0, row  # 4 MiB at 200 Mbit/s: 0.17 s, not loopback
    assert row["check"] == "exact" and row["system"] == "ray"
    assert not _naming(root), "a Ray process of the run is still alive"
    assert not os.path.exists(root)
    assert not [ns for ns in _namespaces() if ns.startswith(cluster.prefix)]
