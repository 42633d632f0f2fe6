"""A long-running directory (days of uptime, millions of objects, thousands of
node joins and leaves) and a long-lived node must not grow without bound.

The directory's pure state machine is driven directly (as
tests/test_directory_state.py does) in loops of a few thousand iterations,
and the total size of its containers is compared with a baseline taken before
the loop: `_footprint` sums len() of every container attribute of the
`Directory`, recursing into the records they hold (entries, holders, reduce
tasks), so a structure added later is covered too. `gone` is left out: it is
capped by design (`_GONE_KEPT`). The node side is driven through its own
objects (`BufferPool`, `PeerPool`), in-process nodes and a put/delete loop
in one process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import tracemalloc
import weakref
from collections import deque

import numpy as np
from in_process import local_mode

import hoplite_gpu as hg
from hoplite_gpu.config import Config
from hoplite_gpu.directory.state import (
    ChannelHead,
    ChannelPublish,
    Completed,
    Directory,
    Locate,
    NodeJoined,
    NodeLost,
    Put,
)
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.node import shm
from hoplite_gpu.node.pool import MIN_POOLED, BufferPool
from hoplite_gpu.node.store import StoredObject
from hoplite_gpu.values import to_buffer

LAYOUT = {"kind": "bytes", "nbytes": 1000}

MiB = 1 << 20


def _footprint(value: object, depth: int = 0) -> int:
    """Elements in `value`'s containers, nested ones and those of the records
    (dataclasses) they hold included."""
    if depth > 6:
        return 0
    if isinstance(value, dict):
        return len(value) + sum(_footprint(v, depth + 1) for v in value.values())
    if isinstance(value, list | set | frozenset | deque | tuple):
        return len(value) + sum(_footprint(v, depth + 1) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(_footprint(getattr(value, f.name), depth + 1)
                   for f in dataclasses.fields(value))
    return 0


def sizes(d: Directory) -> dict[str, int]:
    """Per container attribute of the directory (every one but the capped
    `gone`), its footprint."""
    return {name: _footprint(value) for name, value in vars(d).items()
            if isinstance(value, dict | list | set | deque) and name != "gone"}


def grown(before: dict[str, int], after: dict[str, int]) -> dict[str, tuple[int, int]]:
    return {k: (before.get(k, 0), v) for k, v in after.items() if v > before.get(k, 0)}


def make(nodes: int = 3) -> Directory:
    d = Directory(max_receivers_per_sender=1)
    for i in range(nodes):
        d.handle(NodeJoined(f"n{i}", f"addr{i}"))
    return d


# ------------------------------------------------------------- directory ---
def test_a_long_lived_object_keeps_a_record_of_every_pull_ever_made():
    """A long-lived object (a model's weights, a dataset shard) that nodes
    join, pull and leave for days: the directory keeps one (receiver, sender)
    pair in `Entry.edges` for every sender it ever assigned, for nodes long
    gone too (state.py `_assign`: `entry.edges.append(...)`, never trimmed).
    Nothing else of those nodes is left, yet the entry grows by one pair per
    pull (and per failover retry) for as long as the object lives, and
    `object_info`/`query` sends the whole list back in every reply. What the
    user sees: a directory whose memory climbs with every pull of a hot
    object, and `object_info` replies that grow without end."""
    d = make()
    k = bytes(range(20))
    d.handle(Put("n0", 1, k, 1000, LAYOUT))
    d.handle(Completed("n0", k))
    before = sizes(d)
    for i in range(3000):
        node = f"worker-{i}"
        d.handle(NodeJoined(node, f"w{i}"))
        d.handle(Locate(node, 1, k))
        d.handle(Completed(node, k))
        d.handle(NodeLost(node))
    assert set(d.nodes) == {"n0", "n1", "n2"}
    assert list(d.objects[k].holders) == ["n0"]  # every worker's record is gone...
    assert not grown(before, sizes(d)), (
        f"...but the directory grew: {grown(before, sizes(d))}; "
        f"{len(d.objects[k].edges)} pull edges of departed nodes kept for one object")


def test_channel_waiters_of_departed_nodes_leave_an_entry_per_channel():
    """A reader that waits for a channel's next version (`fetch(newer_than=)`)
    and whose process then dies or leaves: `_forget_node` (state.py
    `for name, waiters in self.channel_waiters.items(): self.channel_waiters[name]
    = [...]`) filters the node out but leaves the channel's key behind with an
    empty list, where a cancel (`_on_CancelLocate`) or a publish pops it. With
    readers of per-run or per-request channels coming and going, the
    directory keeps one dead key per channel name for ever, and every later
    node loss walks all of them."""
    d = make()
    before = sizes(d)
    for i in range(3000):
        node = f"reader-{i}"
        d.handle(NodeJoined(node, f"r{i}"))
        assert d.handle(ChannelHead(node, 1, f"run-{i}/policy", newer_than=-1)) == []
        d.handle(NodeLost(node))
    assert not grown(before, sizes(d)), (
        f"the directory grew: {grown(before, sizes(d))}; "
        f"{sum(1 for w in d.channel_waiters.values() if not w)} channel_waiters keys "
        "with no waiter left")
    # (the same channels, waited on and cancelled or published, leave nothing)
    d.handle(NodeJoined("r", "r"))
    d.handle(ChannelHead("r", 2, "x", newer_than=-1))
    d.handle(ChannelPublish("n0", 3, "x", 0))
    assert "x" not in d.channel_waiters


# ------------------------------------------------------------------ node ---
def test_buffer_pool_keeps_an_entry_for_every_buffer_size_ever_reused():
    """`BufferPool.acquire` pops a reused buffer off `_free[nbytes]` but never
    deletes the list once it is empty (pool.py `return free.pop(i)`), so a
    node whose large objects vary in size (token batches, serialized
    records, sliced allreduces of changing shapes) keeps one dead
    size -> [] entry per distinct size of 1 MiB or more it ever reused, for
    the whole life of the process."""
    pool = BufferPool(budget=1 << 30)
    for i in range(3000):
        n = MIN_POOLED + i  # every object a little different in size
        buf = pool.acquire(n)
        assert pool.release(buf)
        del buf
        again = pool.acquire(n)  # reused: the pool holds nothing now
        assert pool.hits == i + 1 and pool.pooled == 0
        del again
    assert pool._free == {}, (
        f"{len(pool._free)} empty size entries kept in BufferPool._free, "
        f"{sum(len(v) for v in pool._free.values())} buffers in them")


def _run(body, bound: float = 30.0) -> None:
    from hoplite_gpu.directory.server import DirectoryServer
    from hoplite_gpu.node.node import Node

    async def main() -> None:
        directory = DirectoryServer("tok")
        address = await directory.start()
        try:
            await asyncio.wait_for(body(directory, address, Node), bound)
        finally:
            await directory.close()

    asyncio.run(main())


def test_a_node_remembers_every_remote_peer_it_ever_pulled_from():
    """`PeerPool._remote` (transfer.py `acquire`: `self._remote.add(address)`)
    records each peer that has no same-host socket: every peer on another
    host, or one running without shared memory. Nothing ever removes an
    address from it, so a long-lived node (a learner, a parameter server)
    that pulls from workers which come and go keeps one address per worker
    that ever existed, for as long as it runs. Here 40 workers without shared
    memory each hand one object to a long-lived node and leave."""
    if not shm.usable():
        import pytest

        pytest.skip("needs shared memory (Linux)")

    async def body(directory, address, Node) -> None:
        server_cfg = Config(timeout_s=5.0, shared_memory=True)
        worker_cfg = Config(timeout_s=5.0, shared_memory=False)
        learner = Node(server_cfg, "tok", address)
        await learner.start()
        try:
            for i in range(40):
                worker = Node(worker_cfg, "tok", address)
                await worker.start()
                try:
                    oid = ObjectID.from_name(f"growth-review/grad/{i}")
                    await worker.put(np.full(200_000, i, np.uint8), oid)
                    got = await learner.get(oid, 5.0, "numpy")
                    assert got[0] == i
                    await learner.delete(oid)
                finally:
                    await worker.close()
            await asyncio.sleep(0.2)
            assert len(learner.pool._remote) <= 4, (
                f"a node that pulled from 40 workers, all gone, still lists "
                f"{len(learner.pool._remote)} of their addresses in PeerPool._remote")
        finally:
            await learner.close()

    _run(body)


def test_a_failed_pull_on_a_reused_connection_leaves_the_peer_key_behind():
    """`PeerPool.acquire` pops a reused idle connection off `_idle[(address,
    local)]` and leaves the list there, empty (transfer.py `idle.pop()`); a
    pull that then fails closes the connection instead of releasing it
    (`fetch_range`'s `finally`), and with no connection left idle nothing
    watches that peer any more, so the empty entry stays after the peer has
    gone: one per departed peer whose last pull failed (a sender that died
    mid-pull, the everyday failover, or one that had just dropped the
    copy, as here)."""

    async def body(directory, address, Node) -> None:
        from hoplite_gpu.errors import ObjectNotFound
        from hoplite_gpu.node.transfer import fetch_range

        cfg = Config(timeout_s=5.0, shared_memory=False)
        a = Node(cfg, "tok", address)
        await a.start()
        try:
            peer = Node(cfg, "tok", address)
            await peer.start()
            try:
                first = ObjectID.from_name("growth-review/idle/first")
                await peer.put(np.ones(100_000, np.uint8), first)
                await a.get(first, 5.0, "numpy")  # leaves a connection to the peer idle
                peer_address = peer.server.address
                assert any(key[0] == peer_address for key in a.pool._idle)
                # The directory sent us to the peer just as it dropped the copy.
                gone = ObjectID.from_name("growth-review/idle/gone")
                peer.server.dropped_here(gone)
                _, layout = to_buffer(np.empty(1000, np.uint8))
                obj = StoredObject(gone, layout, np.empty(1000, np.uint8))
                try:
                    await fetch_range(a.pool, peer_address, obj, obj.size, cfg, lambda pos: None)
                except ObjectNotFound:
                    pass
                else:
                    raise AssertionError("the pull of a dropped copy succeeded")
            finally:
                await peer.close()
            await asyncio.sleep(0.3)
            left = {key: streams for key, streams in a.pool._idle.items()
                    if key[0] == peer_address}
            assert not left, (f"the peer left, yet PeerPool._idle keeps {left} for it "
                              "(and one such entry per peer that ever failed us)")
        finally:
            await a.close()

    _run(body)


def test_a_put_and_delete_loop_of_non_contiguous_arrays_keeps_its_memory_flat():
    """A learner that puts a transposed or strided view of its weights each
    step (`w.T`, `w[:, ::2]`) and deletes the previous step's object keeps
    the contiguous copy of every value it put: `values._copied`, which makes
    that copy, sits under a `functools.lru_cache` (the decorator of
    `_numpy_layout`, left above `_copied` when `_copied` was inserted). The
    cache keys on the fresh lambda (or bound method) of each call, so it
    never hits, and holds the last 256 copies: here 20 puts of a 4 MiB view
    leave 80 MiB allocated after `delete` and `gc.collect()` (with 100 MiB
    of weights, 25 GiB after 256 steps). A non-contiguous memoryview's
    exporter, the caller's own buffer, is kept alive too."""
    with local_mode(timeout_s=10):
        oid = hg.ObjectID.from_name("review-interleave-strided-weights")
        weights = np.ones((1024, 2048), np.float32)  # 8 MiB; each step puts a 4 MiB view
        tracemalloc.start()
        try:
            hg.put(weights.T[:, ::2], oid)
            hg.delete(oid)
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(20):
                hg.put(weights.T[:, ::2], oid)
                hg.delete(oid)
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert grown < 16 * MiB, (f"20 put/delete steps of a 4 MiB strided view left "
                                  f"{grown / MiB:.0f} MiB allocated")

        raw = np.zeros(2 * MiB, np.uint8)
        exporter = weakref.ref(raw)
        view = memoryview(raw)[::2]  # not contiguous: put copies it
        hg.put(view, oid)
        hg.delete(oid)
        del view, raw
        gc.collect()
        assert exporter() is None, ("the caller's buffer behind a non-contiguous memoryview "
                                    "it put stays alive after the object was deleted and "
                                    "every reference dropped")
