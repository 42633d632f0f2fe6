"""Reduces end to end under failures and odd orders, through in-process nodes:
an input that leaves the cluster while the tree needs it, and messages of a
superseded tree incarnation (a completion, a lost stream) that reach the
directory after a failover rebuilt the tree. Each result is checked exactly
against NumPy over the inputs `reduced_inputs` names."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from in_process import eventually, hold_child_pulls, run_nodes

import hoplite_gpu as hg
import hoplite_gpu.node.reducer as reducer
from hoplite_gpu import messages

MiB = 1 << 20
CONFIG = hg.Config(shared_memory=False, chunk_size=MiB, timeout_s=10)


async def check_result(reader, target, ids, values, timeout=3.0):
    got = await reader.get(target, timeout, "numpy")
    used = [ids.index(i) for i in await reader.reduced_inputs(target, timeout)]
    want = np.stack([values[u] for u in used]).sum(0)
    np.testing.assert_array_equal(got, want)
    return used


def test_a_chosen_input_deleted_before_its_parent_pulls_it_is_replaced_by_a_backup():
    """3 of 4 inputs: the first one is deleted after it took the chain's leaf
    but before the step above it pulled it. The directory keeps it in the
    tree, and that step waits `timeout_s` on a node that no longer has it,
    so the get times out although a backup input is ready."""
    async def body(directory, *nodes):
        ids = [hg.ObjectID.from_name(f"del-leaf-{i}") for i in range(4)]
        target = hg.ObjectID.from_name("del-leaf-t")
        values = [np.full(MiB, i + 1, np.float32) for i in range(4)]
        await nodes[0].reduce(ids, "sum", 3, target)
        await nodes[0].put(values[0], ids[0])  # takes the leaf
        await nodes[0].delete(ids[0])
        for i in (1, 2, 3):
            await nodes[i].put(values[i], ids[i])
        used = await check_result(nodes[1], target, ids, values)
        assert sorted(used) == [1, 2, 3]

    run_nodes([CONFIG] * 4, body, bound=30)


@pytest.mark.parametrize("how", ["delete", "reclaim"])
def test_an_input_that_leaves_while_its_own_step_folds_it_is_replaced_by_a_backup(
        monkeypatch, how):
    """3 of 4 inputs on a chain: node 1 folds its own input with its child's
    stream when that input leaves the cluster (deleted, or a lent input
    reclaimed: "as if its task had died", docs/fault-tolerance.md). The
    step reads the recycled (empty) buffer and the whole reduce fails with
    `ReduceFailed` claiming the inputs' shapes differ, instead of being
    rebuilt over the backup input."""
    gate = hold_child_pulls(monkeypatch)

    async def body(directory, *nodes):
        gate["event"] = asyncio.Event()
        ids = [hg.ObjectID.from_name(f"leave-{how}-{i}") for i in range(4)]
        target = hg.ObjectID.from_name(f"leave-{how}-t")
        values = [np.full(MiB, i + 1, np.float32) for i in range(4)]
        await nodes[0].reduce(ids, "sum", 3, target)
        await nodes[0].put(values[0], ids[0])  # leaf
        await nodes[1].put(values[1], ids[1], lend=how == "reclaim")  # interior step
        assert await eventually(lambda: nodes[1]._steps), "node 1's step did not start"
        if how == "delete":
            await nodes[1].delete(ids[1])
        else:
            await nodes[1].reclaim(ids[1])
        for i in (2, 3):
            await nodes[i].put(values[i], ids[i])
        gate["event"].set()
        used = await check_result(nodes[2], target, ids, values)
        assert sorted(used) == [0, 2, 3]

    run_nodes([CONFIG] * 4, body, bound=30)


def test_a_stale_completion_of_the_root_does_not_finish_the_rebuilt_tree(monkeypatch):
    """The root finishes tree 1 and says `complete`; before the directory
    reads it, the leaf's node is lost and the tree is rebuilt with the same
    root node. That completion is taken for tree 2's: the reduce is declared
    done while tree 2 runs, its partial results are dropped under its root,
    and the get of the result never finishes (docs/fault-tolerance.md
    promises a copy completed "before the directory heard that the root
    did" is superseded)."""
    gate = hold_child_pulls(monkeypatch)

    async def body(directory, n0, n1, n2, n3, reader):
        gate["event"] = asyncio.Event()
        gate["event"].set()
        ids = [hg.ObjectID.from_name(f"stale-done-{i}") for i in range(4)]
        target = hg.ObjectID.from_name("stale-done-t")
        values = [np.full(MiB, i + 1, np.float32) for i in range(4)]
        held: list[dict] = []
        post = n2._post

        def holding(msg):  # n2's completion of the result is slow on the wire
            if messages.as_map(msg).get("op") == "complete" and messages.as_map(msg).get("oid") == target.binary:
                held.append(msg)
            else:
                post(msg)

        n2._post = holding
        # chain: n0's input the leaf, n1's the middle, n2's the root; n3's a backup
        await reader.reduce(ids, "sum", 3, target, root_input=ids[2])
        for node, oid, value in zip((n0, n1, n2, n3), ids, values, strict=True):
            await node.put(value, oid)
        assert await eventually(lambda: held), "tree 1 did not finish on n2"
        gate["event"].clear()  # tree 2's steps stay under way for a moment
        await n0.close()
        task = directory.state.reduces[target.binary]
        assert await eventually(lambda: task.restarts == 1 and target in n2._steps)
        n2._post = post
        post(held[0])  # tree 1's completion arrives now
        await asyncio.sleep(0.2)
        gate["event"].set()
        used = await check_result(reader, target, ids, values)
        assert sorted(used) == [1, 2, 3]

    run_nodes([CONFIG] * 5, body, bound=30)


def test_a_lost_stream_of_a_superseded_tree_does_not_rebuild_the_new_one(monkeypatch):
    """One lost node rebuilds the tree once. The root of the old tree, still
    pulling the middle step's output when that step is dropped, reports
    `step_lost` before its own drop arrives; `step_lost` names no tree, so
    the directory rebuilds the new tree again (its partial results and
    readers' copies dropped, one more of the reduce's restarts spent)."""
    held_from: set[str] = set()
    gate = hold_child_pulls(monkeypatch, only_from=held_from)

    async def body(directory, n0, n1, n2, n3, reader):
        gate["event"] = asyncio.Event()  # never set: n0's input is never pulled
        held_from.add(n0._data_address)  # n1's step waits on its leaf: its output stays empty
        ids = [hg.ObjectID.from_name(f"stale-lost-{i}") for i in range(4)]
        target = hg.ObjectID.from_name("stale-lost-t")
        values = [np.full(MiB, i + 1, np.float32) for i in range(4)]
        await reader.reduce(ids, "sum", 3, target)
        for node, oid, value in zip((n0, n1, n2, n3), ids, values, strict=True):
            await node.put(value, oid)
        assert await eventually(lambda: target in n2._steps and n1._steps)
        await asyncio.sleep(0.1)  # n2's step is connected to n1, pulling its output
        handle = n2.client._on_push
        loop = asyncio.get_running_loop()

        def late_drops(msg):  # the directory's drops reach n2 late
            if isinstance(msg, messages.Drop):
                loop.call_later(0.3, handle, msg)
            else:
                handle(msg)

        n2.client._on_push = late_drops
        await n0.close()
        used = await check_result(reader, target, ids, values)
        assert sorted(used) == [1, 2, 3]
        assert directory.state.reduces[target.binary].restarts == 1

    run_nodes([CONFIG] * 5, body, bound=30)


@pytest.mark.parametrize("size,pieces", [(MiB, 4), (4 * MiB, 8), (16 * MiB, 16)])
def test_a_host_step_hands_on_a_small_result_in_pieces(size, pieces):
    """A host step folds and hands on its output in `fold_unit` pieces: a
    1 MiB output in four (each level of a tree then adds a quarter of the
    object's time after the last input, not all of it), a large one in
    1 MiB pieces. Every piece is the exact sum."""
    from hoplite_gpu.ids import ObjectID
    from hoplite_gpu.node.store import StoredObject
    from hoplite_gpu.values import to_buffer

    n = size // 4
    arrays = [np.arange(n, dtype=np.float32) * (i + 1) for i in range(3)]
    objs = []
    for i, a in enumerate(arrays):
        buf, layout = to_buffer(a)
        obj = StoredObject(ObjectID.from_name(f"pieces-in-{i}"), layout,
                           np.frombuffer(buf, np.uint8).copy())
        obj.advance(obj.size)
        objs.append(obj)
    out = StoredObject(ObjectID.from_name("pieces-out"), objs[0].layout, np.empty(size, np.uint8))
    marks: list[int] = []
    real = out.advance
    out.advance = lambda ready: (marks.append(ready), real(ready))

    asyncio.run(reducer._fold(objs[0], objs[1:], None, out, "sum", 0, np.dtype(np.float32),
                              hg.Config(), 5.0, []))
    assert len(marks) == pieces and marks[-1] == size, marks
    np.testing.assert_array_equal(out.buffer.view(np.float32), np.sum(arrays, axis=0))
