"""Review of early reduce steps: a tree position whose input is in
while only some of its children are folds those ahead into a partial result
of its own, which its next step takes as its input (`"early": true`).

Each test fails on the code it was written against, for the reason in its
docstring.
"""

from __future__ import annotations

import asyncio

import numpy as np
from in_process import eventually, miss_the_lease

import hoplite_gpu as hg
from hoplite_gpu.directory import state as s

MiB = 1 << 20


def test_a_node_declared_dead_while_alive_keeps_its_early_partial_result_forever():
    """Three nodes, three 256 KiB inputs (a binary tree: the root, position 1,
    has children 0 and 2). Inputs 0 and 1 are in, so node b (the root's)
    runs an early step and holds its output. Then b misses its lease while
    alive and reconnects. `_restart_reduce` sends its drops only to live
    nodes ("not to the node lost"), and the node re-announces every complete
    object it holds, partial results included (`own`, so the directory even
    registers it as an object b put, one it never evicts). The reduce
    finishes on the rebuilt tree with the right sum, but b keeps the old
    tree's early result, 256 KiB of memory nothing will ever free or read,
    after every lease blip (docs/fault-tolerance.md: "a node declared dead
    while alive keeps no stale copy")."""
    from hoplite_gpu.directory.server import DirectoryServer
    from hoplite_gpu.node.node import Node

    async def main() -> None:
        server = DirectoryServer("tok", lease_s=1.0, heartbeat_interval_s=0.2)
        address = await server.start()
        config = hg.Config(heartbeat_interval_s=0.2, node_lease_s=1.0, timeout_s=5.0,
                           shared_memory=False)
        nodes: list[Node] = []
        try:
            for _ in range(3):
                node = Node(config, "tok", address)
                await node.start()
                nodes.append(node)
            a, b, c = nodes
            ids = [hg.ObjectID.from_name(f"early-lease-in-{i}") for i in range(3)]
            target = hg.ObjectID.from_name("early-lease-out")
            values = [np.full(MiB // 16, i + 1, np.float32) for i in range(3)]
            await a.reduce(ids, "sum", 3, target)
            await a.put(values[0], ids[0])
            await b.put(values[1], ids[1])  # the root's input: folds input 0 ahead
            task = server.state.reduces[target.binary]
            assert await eventually(lambda: task.phases == {1: 1}, 3.0), task.phases
            assert task.degree == 2 and task.slot(1)[1] == b.node_id
            early = hg.ObjectID(s.step_id(target.binary, 1, task.tag, 0))
            assert await eventually(
                lambda: b.store.get(early) is not None and b.store.get(early).complete, 3.0)
            await miss_the_lease(server, b)  # declared dead, then back
            await c.put(values[2], ids[2])
            got = await a.get(target, 5.0, "numpy")
            np.testing.assert_array_equal(got, np.sum(values, axis=0))
            freed = await eventually(lambda: b.store.get(early) is None, 3.0)
            assert freed, (
                f"node b still holds the old tree's early result {early.hex()[:12]} "
                f"({b.store.get(early).size} bytes) after the reduce finished; the directory "
                f"lists it as an object: {early.binary in server.state.objects}")
        finally:
            for node in reversed(nodes):
                await node.close()
            await server.close()

    asyncio.run(asyncio.wait_for(main(), 30))
