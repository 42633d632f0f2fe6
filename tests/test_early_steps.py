"""Early reduce steps (directory/state.py `_start_ready_steps`): a tree position
whose input is in while only some of its children are gets a step that folds
those children ahead, and the position's next step takes that partial result
as its input. The state machine is driven directly; the simulator and real
nodes check the time it saves and the bytes it makes, and that a node
declared dead while alive does not keep its early partial result."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from in_process import eventually, miss_the_lease

import hoplite_gpu as hg
from hoplite_gpu import messages as m
from hoplite_gpu.directory import state as s
from hoplite_gpu.directory.reduce_plan import fold_unit, inorder_tree
from hoplite_gpu.simulator import simulate_reduce

MiB = 1 << 20
#: One fold piece (`reduce_plan.fold_unit`): at 125 MB/s the model picks
#: trees of degree 2 and more for these, where a larger object, folded in
#: pieces, would get a chain.
SIZE = MiB // 4
LAYOUT = {"kind": "numpy", "dtype": "<f4", "shape": [SIZE // 4], "nbytes": SIZE}
TARGET = (100).to_bytes(20, "big")


def oid(i: int) -> bytes:
    return i.to_bytes(20, "big")


def directory(nodes: int = 12) -> s.Directory:
    d = s.Directory(bytes_per_s=1.25e8)
    for i in range(nodes):
        d.handle(s.NodeJoined(f"n{i}", f"tcp://127.0.0.1:{1000 + i}"))
    return d


def arrive(d: s.Directory, i: int) -> list:
    """Input i, on node n(i+1), put and complete."""
    out = d.handle(s.Put(f"n{i + 1}", 1, oid(i), SIZE, LAYOUT))
    return out + d.handle(s.Completed(f"n{i + 1}", oid(i)))


def steps(cmds: list) -> list[s.StartReduceStep]:
    return [c for c in cmds if isinstance(c, s.StartReduceStep)]


def test_a_position_folds_its_early_child_ahead_and_its_last_step_takes_that_as_input():
    """k = 3 on a binary tree: position 1 (the root) has children 0 and 2.
    When the root's input comes, child 0 is in and child 2 is not: the root's
    node folds input 1 with input 0 at once, and when input 2 comes the last
    step reads that partial result (on its own node) and one stream more."""
    d = directory()
    d.handle(s.ReduceRequested("n0", 1, TARGET, (oid(0), oid(1), oid(2)), "sum", 3))
    assert steps(arrive(d, 0)) == []
    task = d.reduces[TARGET]
    assert task.degree == 2, "256 KiB inputs at 125 MB/s: a binary tree"
    early = steps(arrive(d, 1))
    assert [c.node for c in early] == ["n2"]
    first = early[0].step
    assert first.input == oid(1) and not first.early
    assert [c.oid for c in first.children] == [oid(0)]
    assert first.output == s.step_id(TARGET, 1, task.tag, 0) and first.count == 0
    assert TARGET not in d.objects, "the result exists only once the last step starts"
    last = steps(arrive(d, 2))
    assert [c.node for c in last] == ["n2"]
    root = last[0].step
    assert root.early is True and root.input == first.output
    assert [c.oid for c in root.children] == [oid(2)]
    assert root.output == TARGET and root.count == 3
    assert d.objects[TARGET].holders["n2"].origin
    # once the result is complete, the early result is freed with the others
    done = d.handle(s.Completed("n2", TARGET))
    drops = {(c.node, c.oid) for c in done if isinstance(c, s.Drop)}
    assert ("n2", first.output) in drops


def test_inputs_all_at_once_fold_each_child_once():
    """Seven inputs in order on a binary tree: every position's steps, early
    ones and its last, name each of its children exactly once, and each
    step's input is the output of the one before it at that position."""
    d = directory()
    d.handle(s.ReduceRequested("n0", 1, TARGET, tuple(oid(i) for i in range(7)), "sum", 7))
    cmds = []
    for i in range(7):
        cmds += steps(arrive(d, i))
    task = d.reduces[TARGET]
    _check_every_child_folded_once(task, cmds)


def _check_every_child_folded_once(task: s.ReduceTask, cmds: list[s.StartReduceStep]) -> None:
    parent, children = inorder_tree(task.k, task.degree)
    by_node: dict[str, list[m.ReduceStep]] = {}
    for c in cmds:
        by_node.setdefault(c.node, []).append(c.step)
    for pos in range(task.k):
        if not children[pos] and parent[pos] is not None:
            continue  # a leaf: its parent pulls its input
        own, node = task.slot(pos)
        chain = by_node.get(node, [])
        assert chain, f"position {pos} never started"
        assert chain[0].input == own
        for before, after in itertools.pairwise(chain):
            assert after.input == before.output and after.early is True
        final = chain[-1].output
        assert final == (TARGET if parent[pos] is None else s.step_id(TARGET, pos, task.tag))
        folded = [k.oid for step in chain for k in step.children]
        want = [s.step_id(TARGET, c, task.tag) if children[c] else task.slot(c)[0]
                for c in children[pos]]
        assert sorted(folded) == sorted(want) and len(set(folded)) == len(folded), (
            f"position {pos} folded {len(folded)} streams for {len(want)} children")


@settings(max_examples=60, deadline=None)
@given(data=st.data(), k=st.integers(3, 11))
def test_any_arrival_order_folds_each_child_once(data, k):
    order = data.draw(st.permutations(range(k)))
    d = directory(nodes=k + 1)
    d.handle(s.ReduceRequested("n0", 1, TARGET, tuple(oid(i) for i in range(k)), "sum", k))
    cmds = []
    for i in order:
        cmds += steps(arrive(d, i))
    task = d.reduces[TARGET]
    assert task.degree > 1 or all(not c.step.early for c in cmds)
    _check_every_child_folded_once(task, cmds)


def test_a_restart_drops_the_early_results_too():
    d = directory()
    d.handle(s.ReduceRequested("n0", 1, TARGET, tuple(oid(i) for i in range(4)), "sum", 3))
    arrive(d, 0)
    first = steps(arrive(d, 1))[0].step  # the root's early step, on n2
    out = d.handle(s.NodeLost("n1"))  # input 0's holder: its stream is gone
    drops = {(c.node, c.oid) for c in out if isinstance(c, s.Drop)}
    assert ("n2", first.output) in drops
    assert d.reduces[TARGET].phases == {} and d.reduces[TARGET].folded == {}


def test_a_failed_reduce_drops_the_early_results_too():
    d = directory()
    d.handle(s.ReduceRequested("n0", 1, TARGET, tuple(oid(i) for i in range(3)), "sum", 3))
    arrive(d, 0)
    first = steps(arrive(d, 1))[0].step
    out = d.handle(s.ReduceFailed("n2", TARGET, "a kernel failed", d.reduces[TARGET].tag))
    drops = {(c.node, c.oid) for c in out if isinstance(c, s.Drop)}
    assert ("n2", first.output) in drops


@pytest.mark.parametrize("size,k,chunk", [(16 * MiB, 64, MiB), (MiB, 8, 4 * MiB)])
def test_late_inputs_on_a_tree_end_sooner_than_when_each_position_waited(size, k, chunk):
    """In the simulator, inputs 2 S/B apart: folded ahead, the positions above
    the last input each pull one stream after it, not `d`: after the last
    input the tree takes S/B plus a chunk time and a hop per level (before:
    2.256 x S/B for the first row, 3.86 x for the second)."""
    bw, lat = 1.25e8, 1e-4
    r = simulate_reduce(k, size, bandwidth=bw, latency=lat, chunk=chunk,
                        arrivals=[i * 2 * size / bw for i in range(k)])
    assert r.degree > 1
    after = r.done_at - r.last_arrival
    per_level = lat + fold_unit(size, chunk) / bw
    bound = size / bw + r.depth * per_level + 10 * lat
    assert after <= bound, (f"{after * 1e3:.1f} ms after the last input; S/B and a chunk "
                            f"and a hop per level is {bound * 1e3:.1f} ms")
    assert np.isfinite(after)


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4], [4, 2, 0, 3, 1]], ids=["in-order", "shuffled"])
def test_real_nodes_reduce_inputs_that_trickle_in_and_free_the_early_results(order):
    """Five nodes on loopback, 256 KiB float32 inputs put 0.15 s apart: the
    directory's defaults pick a degree-3 tree, so positions get early
    steps. The result is the NumPy sum, and once it is complete no node
    holds a partial result (an early one is freed when the next step at its
    position has read it, the last ones by the directory's drops)."""
    import asyncio

    from in_process import eventually, run_nodes

    import hoplite_gpu as hg

    n = SIZE // 4
    values = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(5)]
    ids = [hg.ObjectID.from_name(f"early-in-{i}") for i in range(5)]
    target = hg.ObjectID.from_name("early-out")
    config = hg.Config(shared_memory=False, timeout_s=20.0, stall_timeout_s=5.0)

    async def body(directory, *nodes):
        await nodes[0].reduce(ids, "sum", 5, target)
        for i in order:
            await asyncio.sleep(0.15)
            await nodes[i].put(values[i], ids[i])
        task = directory.state.reduces[target.binary]
        assert task.degree == 3 and task.phases, "no early step: nothing tested"
        got = await nodes[0].get(target, 20, "numpy")
        np.testing.assert_allclose(got, np.sum(values, axis=0), rtol=1e-5, atol=1e-5)
        mine = {*ids, target}

        def no_partial_results() -> bool:
            return all(obj.oid in mine for node in nodes for obj in node.store.objects())

        assert await eventually(no_partial_results, 5.0), [
            [obj.oid.hex()[:8] for obj in node.store.objects() if obj.oid not in mine]
            for node in nodes]

    run_nodes([config] * 5, body, bound=60)


def test_a_step_never_waits_on_inputs_that_have_not_arrived():
    """Seven 2 MiB inputs on a binary tree (root 3; its later child 5 roots
    positions 4 to 6). Input 6 comes three call timeouts after the others.
    A step that named position 5 as soon as 5 was placed would pull its
    output while that waited for input 6: the data server gives up on bytes
    that do not come within `timeout_s`, the step reports a lost child and
    the tree is rebuilt, over and over for a slow enough trickle. A child is
    folded only once its whole subtree is in, so the reduce ends with no
    restart and the right sum."""
    import asyncio

    from in_process import run_nodes

    import hoplite_gpu as hg

    n = (2 * MiB) // 4
    values = [np.full(n, i + 1, np.float32) for i in range(7)]
    ids = [hg.ObjectID.from_name(f"trickle-in-{i}") for i in range(7)]
    target = hg.ObjectID.from_name("trickle-out")
    timeout = 1.5
    config = hg.Config(shared_memory=False, timeout_s=timeout, stall_timeout_s=0.5)

    async def body(directory, *nodes):
        # (a directory told of 1 ms links gives these a binary tree; with
        # 0.1 ms, 2 MiB folded in eighths goes down a chain)
        directory.state.latency_s = 1e-3
        await nodes[0].reduce(ids, "sum", 7, target)
        for i in range(6):
            await nodes[i].put(values[i], ids[i])
        task = directory.state.reduces[target.binary]
        assert task.degree == 2, "not the binary tree this test is about"
        await asyncio.sleep(3 * timeout)
        await nodes[6].put(values[6], ids[6])
        got = await nodes[0].get(target, 10, "numpy")
        np.testing.assert_array_equal(got, np.sum(values, axis=0))
        assert task.restarts == 0, (
            f"the tree was rebuilt {task.restarts} times while input 6 was on its way")

    run_nodes([config] * 7, body, bound=60)


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
