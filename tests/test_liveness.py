"""Leases in the state machine, and failover of real processes that die or stall."""

from __future__ import annotations

import os
import signal
import time

import cluster_tasks as t
import pytest

from hoplite_gpu.cluster import LocalCluster
from hoplite_gpu.directory import state as s


def test_lease_expiry_declares_a_node_dead_and_drops_its_holdings():
    d = s.Directory(lease_s=5.0)
    d.handle(s.NodeJoined("a", "tcp://a:1", now=0.0))
    d.handle(s.NodeJoined("b", "tcp://b:1", now=0.0))
    d.handle(s.Put("a", 1, b"k" * 20, 1 << 20, {"kind": "bytes"}))
    d.handle(s.Completed("a", b"k" * 20))
    d.handle(s.Heartbeat("a", 4.0))
    assert d.handle(s.Tick(4.5)) == []
    out = d.handle(s.Tick(5.5))  # b last seen at 0.0: expired; a renewed at 4.0: alive
    assert [c for c in out if isinstance(c, s.Disconnect)] == [s.Disconnect("b", out[0].reason)]
    assert "b" not in d.nodes and "a" in d.nodes
    out = d.handle(s.Tick(9.5))
    assert any(isinstance(c, s.Disconnect) and c.node == "a" for c in out)
    assert b"k" * 20 not in d.objects  # its only holder died: the object is lost


def test_heartbeat_from_an_unknown_node_is_ignored():
    d = s.Directory(lease_s=1.0)
    d.handle(s.Heartbeat("ghost", 1.0))
    assert d.handle(s.Tick(10.0)) == []


@pytest.fixture
def fast_cluster():
    with LocalCluster(5, chunk_size=1 << 20, stall_timeout_s=1.0, heartbeat_interval_s=0.2,
                      node_lease_s=1.5) as c:
        yield c


def test_stopped_sender_is_replaced_within_the_stall_timeout(fast_cluster):
    """SIGSTOP the node that others pull from: they move to another sender."""
    c = fast_cluster
    size = 96 << 20
    crc = c.run(0, t.put_pattern, "stall", size)
    assert c.run(1, t.get_summary, "stall")[0] == crc  # a second complete copy, on node 1
    c.submit(2, t.get_summary, "stall", 30.0)
    c.submit(3, t.get_summary, "stall", 30.0)
    time.sleep(0.05)
    os.kill(c.pid(0), signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        results = [c.result(w, 30.0) for w in (2, 3)]
    finally:
        os.kill(c.pid(0), signal.SIGCONT)
    assert all(r[0] == crc for r in results)
    assert time.monotonic() - t0 < 1.0 + 1.0 + 2.0  # stall timeout + 1 s, plus the transfer


def test_killed_relay_mid_broadcast_others_finish(fast_cluster):
    c = fast_cluster
    size = 128 << 20
    crc = c.run(0, t.put_pattern, "kill", size)
    for w in (1, 2, 3, 4):
        c.submit(w, t.get_summary, "kill", 60.0)
    time.sleep(0.08)
    c.kill(2)
    survivors = [c.result(w, 60.0) for w in (1, 3, 4)]
    assert all(r[0] == crc for r in survivors)


def test_reduce_survives_a_stalled_participant(fast_cluster):
    """Input 2's node stops (SIGSTOP) before the reduce runs: the tree is rebuilt
    without it, the backup input takes its place, and the result matches the
    oracle over exactly the inputs reported."""
    import numpy as np

    c = fast_cluster
    n = (16 << 20) // 4
    names = [f"ft-{w}" for w in range(1, 5)]
    for w in range(1, 5):
        c.run(w, t.put_float32, names[w - 1], n, w)
    os.kill(c.pid(2), signal.SIGSTOP)
    try:
        value, used = c.run(0, t.reduce_and_get, names, "sum", 3, "ft-out", 30.0, timeout=40)
    finally:
        os.kill(c.pid(2), signal.SIGCONT)
    seeds = [int(names[i].split("-")[1]) for i in used]
    assert 2 not in seeds and len(seeds) == 3
    expected = sum(np.random.default_rng(s).standard_normal(n).astype(np.float32).astype(np.float64)
                   for s in seeds)
    np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-4)


def test_directory_restart_mid_broadcast_and_reduce(fast_cluster):
    """Kill the directory while a broadcast and a reduce are in flight: nodes
    reconnect, re-register what they hold, and both finish correctly."""
    import numpy as np

    c = fast_cluster
    crc = c.run(0, t.put_pattern, "dr-bcast", 64 << 20)
    n = (8 << 20) // 4
    names = ["dr-in-1", "dr-in-2", "dr-in-3"]
    for w in (1, 2):
        c.run(w, t.put_float32, names[w - 1], n, w)
    c.submit(4, t.reduce_and_get, names, "sum", 3, "dr-out", 30.0)
    for w in (1, 2):
        c.submit(w, t.get_summary, "dr-bcast", 30.0)
    time.sleep(0.05)
    c.restart_directory()
    c.run(3, t.put_float32, names[2], n, 3)  # the last input arrives after the restart
    assert [c.result(w, 40)[0] for w in (1, 2)] == [crc, crc]
    value, used = c.result(4, 40)
    assert sorted(used) == [0, 1, 2]
    expected = sum(np.random.default_rng(s).standard_normal(n).astype(np.float32).astype(np.float64)
                   for s in (1, 2, 3))
    np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-4)
    assert c.run(3, t.get_summary, "dr-bcast", 30.0)[0] == crc  # a get after the restart


def test_a_node_beats_within_the_directorys_lease_whatever_its_own_settings():
    """Only the directory's lease counts: a node configured for 5 s beats
    against a 1 s lease would be declared dead again and again. It beats at
    least three times per lease the directory tells it at register."""
    import asyncio

    from hoplite_gpu.config import Config
    from hoplite_gpu.directory.server import DirectoryServer
    from hoplite_gpu.node.node import Node

    async def main() -> None:
        server = DirectoryServer("tok", lease_s=1.0, heartbeat_interval_s=0.2)
        address = await server.start()
        node = Node(Config(heartbeat_interval_s=5.0, node_lease_s=20.0, timeout_s=5.0,
                           shared_memory=False), "tok", address)
        try:
            await node.start()
            first = node.client
            assert first.lease_s == 1.0
            await asyncio.sleep(2.5)  # two and a half leases
            assert node.client is first, "the node was declared dead and had to reconnect"
            assert node.node_id in server.state.nodes
        finally:
            await node.close()
            await server.close()

    asyncio.run(main())
