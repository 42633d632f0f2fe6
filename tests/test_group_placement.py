"""Where a Group's ranks sit on its topology: each rank saying its own node
(`node=`), every rank's list (`members=`), or rank r on the r-th node; and
the first call's check that the ranks agree."""

from __future__ import annotations

import pytest

import hoplite_gpu as hg
from hoplite_gpu.errors import GroupMismatch, InvalidArgument
from hoplite_gpu.topology import fixture, from_json

MiB = 1 << 20
MESH = from_json({"nodes": [0, 1, 2, 3], "links": [
    {"a": 0, "b": 1, "capacity": 1}, {"a": 0, "b": 2, "capacity": 1},
    {"a": 0, "b": 3, "capacity": 1}, {"a": 1, "b": 2, "capacity": 2},
    {"a": 2, "b": 3, "capacity": 2}, {"a": 1, "b": 3, "capacity": 2}]}, source="mesh")


@pytest.mark.parametrize("kw, says", [
    ({"members": [0, 1]}, "give topology= too"),
    ({"node": 2}, "give topology= too"),
    ({"topology": MESH, "node": 1, "members": [1, 0]}, "not both"),
    ({"topology": MESH, "node": 9}, "node 9 is not a node of topology 'mesh'"),
    ({"topology": MESH, "node": True}, "node True is not a node"),
    ({"topology": MESH, "members": [0, 0]}, "members must be distinct"),
    ({"topology": MESH, "members": [0, 7]}, "[7] are not nodes of topology 'mesh'"),
])
def test_a_place_that_cannot_be_is_refused_when_the_group_is_made(kw, says):
    with pytest.raises(InvalidArgument, match="Group 'g'") as info:
        hg.Group("g", rank=0, size=2, **kw)
    assert says in str(info.value)


def _placed(places, rank=0, **kw):
    group = hg.Group("g", rank=rank, size=len(places), **kw)
    group._placed(places)
    return group


def test_the_first_call_takes_each_ranks_own_node():
    group = _placed([3, 0, 2], topology=MESH, node=3)
    assert group.members == (3, 0, 2)
    assert _placed([0, 1, 2], topology=MESH, rank=1).members == (0, 1, 2)  # rank r on node r
    assert _placed([None, None]).members is None  # no topology anywhere: nothing to place


@pytest.mark.parametrize("places, kw, says", [
    ([1, 1, 2], {"node": 1}, "ranks 0, 1 on node 1"),
    ([0, None, None], {"node": 0}, "ranks 1, 2 made the group without a topology, rank 0 "
                                   "with one"),
    ([None, 2], {}, "rank 0 made the group without a topology, rank 1 with one"),
    ([0, 5], {"node": 0}, "rank 1 sit on nodes that this rank's topology 'mesh' lacks ([5])"),
    ([0, 2, 1], {"members": [0, 1, 2]}, "ranks 1, 2 said [2, 1] where rank 0's members put "
                                         "[1, 2]"),
])
def test_ranks_that_disagree_on_their_places_are_named(places, kw, says):
    if kw or places[0] is not None:
        kw = {"topology": MESH, **kw}
    with pytest.raises(GroupMismatch, match="the ranks' places on the topology differ") as info:
        _placed(places, **kw)
    assert says in str(info.value)


def test_ranks_that_say_their_own_nodes_broadcast_over_the_trees_of_those_nodes():
    """Ranks 0-3 on nodes 2, 0, 3, 1 (each knowing only its own): every rank
    learns the same members and the broadcast from rank 1 (node 0) goes over
    the trees; then a group where two ranks say node 2 fails its first call
    on every rank, naming both."""
    import cluster_tasks as t

    from hoplite_gpu.cluster import LocalCluster

    nodes, size = [2, 0, 3, 1], 4
    clash = [2, 0, 3, 2]
    with LocalCluster(size, shared_memory=False) as c:
        out = c.map(t.group_placed, [("placed", r, size, nodes[r], 2 * MiB, clash[r])
                                     for r in range(size)], timeout=120)
    for rank, got in enumerate(out):
        assert got["right"] and got["how"] == "trees", (rank, got)
        assert got["members"] == nodes
        kind, text = got["error"]
        assert kind == "GroupMismatch" and "ranks 0, 3 on node 2" in text, (rank, text)


def test_the_dgx1v_fixture_places_by_gpu_index():
    gpus = fixture("dgx1v")
    assert _placed([4, 0, 7], topology=gpus, node=4).members == (4, 0, 7)
