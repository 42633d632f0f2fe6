"""A reduce whose ROOT node misses its lease while alive: the
directory declares it dead, rebuilds the tree without it, and the node
reconnects and announces what it holds. The old root's step had already
made the reduce's target object on that node (it is the step's output).

Each test fails on the code it was written against, for the reason in its
docstring.
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
from in_process import eventually, hold_child_pulls, miss_the_lease

import hoplite_gpu as hg

KiB = 1 << 10


def reduce_of_four(name: str):
    """Four input ids, the target id and the inputs' values (1, 2, 3, 4)."""
    ids = [hg.ObjectID.from_name(f"{name}-in-{i}") for i in range(4)]
    values = [np.full(64 * KiB, i + 1, np.float32) for i in range(4)]
    return ids, hg.ObjectID.from_name(f"{name}-out"), values


@contextlib.asynccontextmanager
async def cluster(count: int, monkeypatch):
    """A directory (1 s lease, 0.2 s heartbeats), `count` TCP nodes, and the
    event that lets reduce steps' child pulls go (`hold_child_pulls`)."""
    gate = hold_child_pulls(monkeypatch)
    gate["event"] = asyncio.Event()
    from hoplite_gpu.directory.server import DirectoryServer
    from hoplite_gpu.node.node import Node

    server = DirectoryServer("tok", lease_s=1.0, heartbeat_interval_s=0.2)
    address = await server.start()
    config = hg.Config(heartbeat_interval_s=0.2, node_lease_s=1.0, timeout_s=5.0,
                       shared_memory=False)
    nodes: list = []
    try:
        for _ in range(count):
            node = Node(config, "tok", address)
            await node.start()
            nodes.append(node)
        yield server, nodes, gate["event"]
    finally:
        for node in reversed(nodes):
            await node.close()
        await server.close()


def test_every_rank_reads_the_result_after_the_old_root_missed_its_lease(monkeypatch):
    """An allreduce's node operations on four ranks (each asks for the
    reduce, puts its 256 KiB input and gets the target, k = 4: a binary
    tree whose root, position 2, is the third input to arrive). The root's
    node r has made the target (its final step runs, the children's
    streams still on their way) when it misses its lease while alive. The
    directory forgets r as the target's holder before `_restart_reduce`
    drops the target's holders, so r is never told to drop its half-made
    target; r announces only complete objects when it comes back, and its
    old step, whose child stream was dropped, never finishes it. The
    rebuilt tree's root is another node (r's input comes back last: a
    leaf), and the other ranks get the sum. r's own get locates the result
    and is given a sender, but `Pulls._pull` takes the stale copy (`own`:
    a step made it) for "put here meanwhile" and waits for its watermark,
    which never moves: r's get ends in `Timeout` (its allreduce fails
    while every other rank's succeeds), and r keeps the 256 KiB buffer
    for good, listed by the directory as a holder of the result that
    never completes (a sender other readers may be sent to)."""
    async def main() -> None:
        async with cluster(4, monkeypatch) as (server, nodes, release):
            n0, n1, r, n3 = nodes
            ids, target, values = reduce_of_four("lease-root")
            for node in nodes:
                await node.reduce(ids, "sum", 4, target)
            for node, oid, value in zip(nodes, ids, values, strict=True):
                await node.put(value, oid)
            task = server.state.reduces[target.binary]
            assert task.degree == 2 and task.slot(2)[1] == r.node_id  # r hosts the root
            assert await eventually(lambda: r.store.get(target) is not None, 3.0), \
                "the root's final step did not start"
            gets = [asyncio.ensure_future(node.get(target, 6.0, "numpy")) for node in nodes]
            await miss_the_lease(server, r)  # declared dead, then back
            release.set()
            got = await asyncio.gather(*gets, return_exceptions=True)
            want = np.sum(values, axis=0)
            used = sorted(ids.index(i) for i in await n0.reduced_inputs(target, 3.0))
            assert used == [0, 1, 2, 3], used
            assert task.slot(2)[1] != r.node_id, "r took the root again: nothing was tested"
            for rank in (0, 1, 3):
                np.testing.assert_array_equal(got[rank], want)
            stale = r.store.get(target)
            entry = server.state.objects[target.binary]
            assert not isinstance(got[2], BaseException), (
                f"the old root's rank got {type(got[2]).__name__}: {got[2]} (it holds a stale "
                f"target, {stale.ready} of {stale.size} bytes made; the directory lists it "
                f"as a holder: {r.node_id in entry.holders})")
            np.testing.assert_array_equal(got[2], want)

    asyncio.run(asyncio.wait_for(main(), 40))


def test_a_rebuilt_root_on_the_old_roots_node_does_not_reuse_the_old_trees_result(monkeypatch):
    """`collectives.reduce`'s shape: 3 of 4 inputs, the root rank's input
    (`root_input`) takes the tree's root. Node r put two inputs, 0 and 1
    (the root's); node c input 2, node d input 3 (a backup). r's final
    step is under way (its child stream from c on its way) when r is cut
    off from the directory (its pings stop, it cannot reconnect for a
    moment: a partition, one of the causes docs/fault-tolerance.md names)
    while its data links work. The directory declares r dead, inputs 0
    and 1 are lost with it, and the tree is rebuilt from 2 and 3, the
    root waiting. Meanwhile r's old step finishes the target: 1+2+3.
    When r is back it announces its objects; input 0 takes the free root,
    so the new root step (inputs 0, 2 and 3) runs on r. The `reduce_step`
    push drops only an INCOMPLETE stale output, and `run_step` takes the
    complete one for its output: `_fold` starts at its watermark (the
    end), so the step folds nothing and reports the OLD tree's bytes
    under the new tree's tag. The reduce finishes with 6 in every
    element while `reduced_inputs` names inputs 0, 2 and 3 (1+3+4 = 8):
    a silently wrong sum (docs: "a get and reduced_inputs always
    agree")."""
    async def main() -> None:
        async with cluster(4, monkeypatch) as (server, nodes, release):
            reader, r, c, d = nodes
            ids, target, values = reduce_of_four("lease-reuse")
            await reader.reduce(ids, "sum", 3, target, root_input=ids[1])
            for node, i in ((r, 0), (r, 1), (c, 2), (d, 3)):
                await node.put(values[i], ids[i])
            task = server.state.reduces[target.binary]
            assert task.degree == 2 and task.slot(1) == (ids[1].binary, r.node_id)
            assert await eventually(lambda: r.store.get(target) is not None, 3.0), \
                "the root's final step did not start"
            # r is cut off from the directory: no pings, no reconnection
            address = r.directory_address
            r.link.heartbeat.cancel()
            r.directory_address = "tcp://127.0.0.1:1"
            assert await eventually(lambda: r.node_id not in server.state.nodes, 4.0)
            release.set()  # its data links work: the old step finishes
            assert await eventually(lambda: r.store.get(target).complete, 3.0)
            r.directory_address = address  # the partition heals
            assert await eventually(lambda: r._connected.is_set()
                                    and r.node_id in server.state.nodes, 4.0)
            r.link.start_heartbeat()
            got = await reader.get(target, 4.0, "numpy")
            used = sorted(ids.index(i) for i in await reader.reduced_inputs(target, 3.0))
            assert task.restarts == 1 and task.slot(1)[1] == r.node_id, \
                "the rebuilt root is not on r: nothing was tested"
            want = np.sum([values[u] for u in used], axis=0)
            assert got[0] == want[0], (
                f"the result is {got[0]:g} in every element, but reduced_inputs names "
                f"inputs {used} (sum {want[0]:g}): the old tree's result was reused")

    asyncio.run(asyncio.wait_for(main(), 40))
