"""A broadcast over packed spanning trees (`hoplite_gpu.multitree`): the
plan each rank pulls (pure), and real broadcasts between in-process nodes
over TCP, every range from its tree's parent, one of them dying midway."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from in_process import cut_halfway, run_nodes

import hoplite_gpu as hg
from hoplite_gpu import messages as m
from hoplite_gpu import multitree
from hoplite_gpu.errors import InvalidArgument
from hoplite_gpu.topology import from_json
from hoplite_gpu.trees import pack

MiB = 1 << 20
#: Four members, every pair linked, links of two speeds: the root's rate
#: (R* = 3) takes more than one tree.
MESH = from_json({"nodes": [0, 1, 2, 3], "links": [
    {"a": 0, "b": 1, "capacity": 1}, {"a": 0, "b": 2, "capacity": 1},
    {"a": 0, "b": 3, "capacity": 1}, {"a": 1, "b": 2, "capacity": 2},
    {"a": 2, "b": 3, "capacity": 2}, {"a": 1, "b": 3, "capacity": 2}]}, source="mesh")


def test_every_rank_pulls_each_trees_range_from_its_parent_in_that_tree():
    plan = pack(MESH, 0)
    assert len(plan.trees) >= 2 and plan.rate == pytest.approx(plan.bound)
    size = 3 * MiB + 5
    cards = {n: m.TreeMember(node=f"node{n}", address=f"tcp://h{n}:1") for n in range(4)}
    covered = {n: [] for n in (1, 2, 3)}
    for member in (1, 2, 3):
        for flow in multitree.flows_for(plan, size, member, cards):
            covered[member].append((flow.start, flow.end))
            tree = next(t for t, r in zip(plan.trees, plan.split(size), strict=True)
                        if r == (flow.start, flow.end))
            assert (int(flow.sender.removeprefix("node")), member) in tree.edges
    for ranges in covered.values():  # all of the object, once
        assert sorted(ranges)[0][0] == 0 and sum(b - a for a, b in ranges) == size


def test_members_are_checked():
    with pytest.raises(InvalidArgument, match="distinct"):
        multitree.members_of(MESH, 2, [1, 1])
    with pytest.raises(InvalidArgument, match="not nodes"):
        multitree.members_of(MESH, 2, [0, 9])
    with pytest.raises(InvalidArgument, match="3 ranks need 3"):
        multitree.members_of(MESH, 3, [0, 1])


def _run(nodes, value, plan, name, chosen=(0, 1, 2, 3)):

    async def one(rank, node):
        return await multitree._broadcast(node, value if rank == 0 else None, name, rank, 0,
                                          chosen, plan, 20.0, "numpy")

    return [one(rank, node) for rank, node in enumerate(nodes)]


def test_a_multitree_broadcast_reaches_every_rank_byte_identical():
    value = (np.arange(24 * MiB) % 241).astype(np.uint8)
    plan = pack(MESH, 0)
    config = hg.Config(shared_memory=False, chunk_size=MiB, timeout_s=20, stall_timeout_s=2.0)

    async def body(directory, *nodes):
        served = {n.node_id: [] for n in nodes}
        for n in nodes:
            real = n.server._stream_range

            async def counted(stream, obj, pos, end, stall, size, real=real,
                              mine=served[n.node_id]):
                mine.append((pos, end))
                return await real(stream, obj, pos, end, stall, size)

            n.server._stream_range = counted
        results = await asyncio.gather(*_run(nodes, value, plan, "mt-ok"))
        for got in results[1:]:
            np.testing.assert_array_equal(got, value)
        # each tree's parents served its range: bytes came from more than the root
        assert sum(bool(v) for v in served.values()) >= 2, served
        oid = multitree._ids("mt-ok", 0)[0]
        holders = directory.state.objects[oid.binary].holders
        assert await _eventually(lambda: all(holders[n.node_id].complete for n in nodes))

    run_nodes([config] * 4, body, bound=60)


def test_a_parent_dying_midway_leaves_its_range_to_the_others_or_the_directory():
    """A relay cuts every range it serves half-way: its children finish the
    rest from another parent of their plan, or from the directory's choice,
    and every copy is whole."""
    value = (np.arange(24 * MiB) % 239).astype(np.uint8)
    plan = pack(MESH, 0)
    config = hg.Config(shared_memory=False, chunk_size=MiB, timeout_s=20, stall_timeout_s=2.0)

    async def body(directory, *nodes):
        cut_halfway(nodes[1].server)
        results = await asyncio.gather(*_run(nodes, value, plan, "mt-dies"))
        for got in results[1:]:
            np.testing.assert_array_equal(got, value)

    run_nodes([config] * 4, body, bound=60)


def test_a_relay_that_serves_nothing_leaves_its_ranges_to_the_root():
    """A relay SIGKILLed during a broadcast over the DGX-1V fixture's first
    seven GPUs left its children's ranges to their other parents, who were
    below it in those trees and waited on the same bytes from them: every
    survivor waited out its deadline (found by the chaos suite). What a
    failed parent leaves comes from the root."""
    from hoplite_gpu.topology import fixture

    chosen = tuple(range(7))
    plan = pack(fixture("dgx1v"), 0, chosen)
    # the member that is a parent most often, not the root
    counts = {n: sum(p == n for tree in plan.trees for p, _ in tree.edges) for n in chosen[1:]}
    victim = max(counts, key=counts.get)
    value = (np.arange(12 * MiB) % 241).astype(np.uint8)
    config = hg.Config(shared_memory=False, chunk_size=MiB, timeout_s=20, stall_timeout_s=1.0)

    async def body(directory, *nodes):
        async def dead(stream, *args):
            await stream.close()
            return False

        nodes[victim].server._stream_range = dead
        results = await asyncio.gather(*_run(nodes, value, plan, "mt-dead", chosen))
        for rank, got in enumerate(results):
            np.testing.assert_array_equal(got, value, err_msg=f"rank {rank}")

    run_nodes([config] * 7, body, bound=60)


async def _eventually(check, timeout=5.0):
    from in_process import eventually

    return await eventually(check, timeout)


def test_a_group_on_a_topology_broadcasts_over_its_trees_and_frees_each_call():
    import cluster_tasks as t

    from hoplite_gpu.cluster import LocalCluster

    size, calls, nbytes = 4, 4, 8 * MiB
    with LocalCluster(size, shared_memory=False) as c:
        out = c.map(t.group_tree_broadcasts, [("mt-group", r, size, calls, nbytes)
                                              for r in range(size)], timeout=120)
    for node in out:
        assert node["right"]
        assert node["held"] <= 2 * nbytes, f"{node['held']} bytes held after {calls} calls"
        assert node["after_close"] == 0
