"""Standby directories: a node given several directory addresses
(`init("hostA:7777,hostB:7777")`) uses the first that answers and, when the
one in use is gone, moves to the next and re-announces what it holds, as
after a restart. Nodes and two directories on one loop, over TCP; then
separate processes, the first directory SIGKILLed."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import cluster_tasks as t
import numpy as np
import pytest
from in_process import eventually

import hoplite_gpu as hg
from hoplite_gpu.cluster import LocalCluster
from hoplite_gpu.config import Config
from hoplite_gpu.directory.server import DirectoryServer
from hoplite_gpu.errors import InvalidArgument
from hoplite_gpu.node.link import DirectoryLink
from hoplite_gpu.node.node import Node, directory_addresses

MiB = 1 << 20
CONFIG = Config(shared_memory=False, chunk_size=MiB, timeout_s=20.0, stall_timeout_s=2.0,
                heartbeat_interval_s=0.2, node_lease_s=1.0)


def test_a_list_of_directories_is_checked_naming_the_bad_one():
    assert directory_addresses("a:1, tcp://b:2") == ["a:1", "tcp://b:2"]
    with pytest.raises(InvalidArgument, match="empty"):
        directory_addresses("a:1,,b:2")
    with pytest.raises(InvalidArgument, match="'b:x'"):
        directory_addresses("a:1,b:x")


def _run(body, nodes: int = 3, first_up: bool = True) -> None:
    async def main() -> None:
        first = DirectoryServer("tok", lease_s=1.0, heartbeat_interval_s=0.2)
        second = DirectoryServer("tok", lease_s=1.0, heartbeat_interval_s=0.2)
        a1, a2 = await first.start(), await second.start()
        if not first_up:
            await first.close()
        started = []
        try:
            for _ in range(nodes):
                node = Node(CONFIG, "tok", f"{a1},{a2}")
                await node.start()
                started.append(node)
            await asyncio.wait_for(body(first, second, *started), 60)
        finally:
            for node in reversed(started):
                await node.close()
            await first.close()
            await second.close()

    asyncio.run(main())


def test_a_node_starts_with_the_first_directory_that_answers():
    async def body(first, second, a, b, c):
        assert a.directory_address == b.directory_address == second.address
        oid = await a.put(np.arange(1000), hg.ObjectID.from_name("standby-first"))
        np.testing.assert_array_equal(await b.get(oid, 5.0, "numpy"), np.arange(1000))

    _run(body, first_up=False)


def test_nodes_move_to_the_standby_when_the_directory_goes_during_a_broadcast():
    """The first directory closes while two receivers pull a 32 MiB object
    in a chain (the origin holds its bytes back until it has): every node
    moves to the second and re-announces what it holds, and both receivers
    end with byte-identical copies."""
    value = (np.arange(32 * MiB) % 233).astype(np.uint8)

    async def body(first, second, origin, r1, r2):
        oid = await origin.put(value, hg.ObjectID.from_name("standby-broadcast"))
        go = asyncio.Event()
        real = origin.server._stream_range

        async def held_back(*args):  # (the pulls are under way when the directory goes)
            await go.wait()
            return await real(*args)

        origin.server._stream_range = held_back
        gets = [asyncio.ensure_future(r.get(oid, 30.0, "numpy")) for r in (r1, r2)]
        holders = first.state.objects[oid.binary].holders
        assert await eventually(lambda: all(r.node_id in holders for r in (r1, r2)), 5.0), \
            "the receivers were not given senders"
        await first.close()
        go.set()
        for got in await asyncio.gather(*gets):
            np.testing.assert_array_equal(got, value)
        assert all(n.directory_address == second.address for n in (origin, r1, r2))
        assert await eventually(lambda: oid.binary in second.state.objects
                                and second.state.objects[oid.binary].holders[
                                    origin.node_id].complete, 5.0)
        # the standby serves new requests: a reduce of the three nodes' inputs
        ids = [hg.ObjectID.from_name(f"standby-in-{i}") for i in range(3)]
        for node, i in ((origin, 0), (r1, 1), (r2, 2)):
            await node.put(np.full(1000, i + 1, np.float32), ids[i])
        target = await r1.reduce(ids, "sum", 3, hg.ObjectID.from_name("standby-sum"))
        np.testing.assert_array_equal(await r2.get(target, 10.0, "numpy"),
                                      np.full(1000, 6, np.float32))

    _run(body)


def _holders(c: LocalCluster, worker: int, name: str) -> set[str]:
    return {h["node"] for h in c.run(worker, t.object_info, name)["holders"]}


def _moves_to(c: LocalCluster, worker: int, address: str, within_s: float) -> bool:
    """Whether `worker` uses the directory at `address` within `within_s`:
    a node reconnects on its own loop, after the kill is seen, so a check
    made at once may come before it."""
    deadline = time.monotonic() + within_s
    while c.run(worker, t.directory_in_use)[0] != address:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_processes_move_to_the_standby_when_the_first_directory_is_killed():
    """Two `hoplite-gpu directory` processes and five nodes, each its own
    process. The first directory is SIGKILLed while two receivers pull a
    32 MiB object over TCP (its origin stopped for that moment, so that the
    pulls are under way) and while a reduce waits for its last input, which
    is put only after the kill: every node registers with the standby, both
    receivers end byte-identical and the reduce's result is the sum of its
    three inputs. The first, started again on its port, is then the standby
    that nodes move back to when the second is killed (each node is waited
    for, up to a deadline: read once at once, a node still reconnecting
    failed the test under load)."""
    settings = dict(shared_memory=False, chunk_size=MiB, stall_timeout_s=3.0,
                    heartbeat_interval_s=0.2, node_lease_s=1.5, timeout_s=30.0)
    with LocalCluster(5, standbys=1, **settings) as c:
        first, standby = c.directory_addresses
        crc = c.run(0, t.put_pattern, "sb-bcast", 32 * MiB)
        n = MiB
        names = ["sb-in-1", "sb-in-2", "sb-in-3"]
        for w in (1, 2):
            c.run(w, t.put_float32, names[w - 1], n, w)
        c.submit(4, t.reduce_and_get, names, "sum", 3, "sb-out", 30.0)
        receivers = {c.node_ids[1], c.node_ids[2]}
        os.kill(c.pid(0), signal.SIGSTOP)
        try:
            for w in (1, 2):
                c.submit(w, t.get_summary, "sb-bcast", 30.0)
            deadline = time.monotonic() + 10
            while not receivers <= _holders(c, 3, "sb-bcast"):
                assert time.monotonic() < deadline, "the receivers were not given a sender"
                time.sleep(0.02)
            killed_at = time.time()
            c.kill_directory(0)
        finally:
            os.kill(c.pid(0), signal.SIGCONT)
        c.run(3, t.put_float32, names[2], n, 3)
        assert [c.result(w, 40)[0] for w in (1, 2)] == [crc, crc]
        value, used = c.result(4, 40)
        assert sorted(used) == [0, 1, 2]
        expected = sum(np.random.default_rng(s).standard_normal(n).astype(np.float32)
                       .astype(np.float64) for s in (1, 2, 3))
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-4)
        for w in range(5):
            assert _moves_to(c, w, standby, 15.0), f"worker {w} did not move to the standby"
            address, registrations = c.run(w, t.directory_in_use)
            assert address == standby, f"worker {w} uses {address}, not the standby"
            assert [a for a, _ in registrations] == [first, standby]
            assert registrations[-1][1] >= killed_at
        assert c.run(3, t.get_summary, "sb-bcast", 30.0)[0] == crc  # served by the standby
        # the first, started again, is the standby now: nodes move back to it
        c.restart_directory(0)
        c.kill_directory(1)
        assert c.run(1, t.get_summary, "sb-out", 30.0)[0] == c.run(4, t.get_summary, "sb-out")[0]
        for w in range(5):
            assert _moves_to(c, w, first, 15.0), f"worker {w} did not move back to {first}"


def test_a_node_tries_the_first_directory_at_once_when_the_second_goes():
    """A node on the second of two directories (it had moved there) waited
    a backoff before trying the first when the second went: the round was
    counted from the first address, not from where it began. One round,
    begun at the second, reaches the first with no wait."""

    async def main() -> None:
        first = DirectoryServer("tok", lease_s=1.0, heartbeat_interval_s=0.2)
        up = await first.start()
        down = DirectoryServer("tok")
        gone = await down.start()
        await down.close()
        link = DirectoryLink(f"{up},{gone}", "tok", "n-round", CONFIG,
                             announce=lambda client: None, gone=lambda exc: None)
        link._data_address = "tcp://127.0.0.1:1"
        try:
            client = await link._join(1, fail=False)
            assert client is not None and link.address == up
            await client.close()
            await first.close()
            assert await link._join(1, fail=False) is None  # (a whole round failed)
        finally:
            await first.close()

    asyncio.run(main())


def test_a_node_joining_after_the_first_directory_came_back_joins_the_others():
    """A node started after the first directory came back registered with
    it, empty, while the others had moved to the standby: two clusters,
    neither seeing the other's objects (a multitree broadcast in the chaos
    suite waited out its deadline for a card put on the other side). It
    joins the directory that has other nodes, and a restarted node the same."""

    async def body(first, second, a, b, c):
        await first.close()
        assert await eventually(lambda: all(n.directory_address == second.address
                                            for n in (a, b, c)), 10.0)
        again = DirectoryServer("tok", port=int(first.address.rsplit(":", 1)[1]),
                                lease_s=1.0, heartbeat_interval_s=0.2)
        await again.start()
        late = Node(CONFIG, "tok", f"{first.address},{second.address}")
        try:
            await late.start()
            assert late.directory_address == second.address
            oid = await late.put(np.arange(1000), hg.ObjectID.from_name("standby-late"))
            np.testing.assert_array_equal(await a.get(oid, 5.0, "numpy"), np.arange(1000))
            assert not again.state.nodes
        finally:
            await late.close()
            await again.close()

    _run(body)


def test_a_standby_ignores_the_old_trees_result_from_its_own_trees_root():
    """The directory in use died while a reduce's root step ran on node n3.
    The standby built its own tree from the re-sent reduce and the
    re-announced inputs, its root on n3 again; then n3's old step finished
    and reported the target complete with the old directory's tag. The
    standby took that for the result (finished the reduce, dropped its
    tree's partial results), while n3, given the new root step, replaced
    the old copy and its new step failed on the dropped children: the
    standby listed n3 as the result's holder with no copy there, and gets
    of the result waited until their deadline."""
    from hoplite_gpu.directory import state as s

    size, layout = 16 * MiB, {"kind": "numpy", "dtype": "<f4", "shape": [4 * MiB],
                              "nbytes": 16 * MiB}
    d = s.Directory(instance=b"standby!")
    for i in range(4):
        d.handle(s.NodeJoined(f"n{i}", f"tcp://127.0.0.1:{1000 + i}"))
    target, inputs = b"t" * 20, [bytes([i]) * 20 for i in range(1, 4)]
    d.handle(s.ReduceRequested("n0", 1, target, tuple(inputs), "sum", 3))  # asked again
    out = []
    for i, key in enumerate(inputs):  # re-announced by their holders
        out += d.handle(s.Completed(f"n{i + 1}", key, size, layout, own=True))
    root = [c for c in out if isinstance(c, s.StartReduceStep) and c.step.output == target]
    assert [c.node for c in root] == ["n3"]
    old_tag = b"firstdir" + (1).to_bytes(8, "big")
    out = d.handle(s.Completed("n3", target, size, layout, own=True, tag=old_tag))
    assert not d.reduces[target].done
    assert not [c for c in out if isinstance(c, s.Drop)], "the new tree's steps were dropped"
    d.handle(s.Completed("n3", target, size, layout, own=True, tag=root[0].step.tag))
    assert d.reduces[target].done and d.objects[target].holders["n3"].complete
