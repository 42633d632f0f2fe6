"""Rack-aware sender choice (hoplite_gpu/directory/racks.py): receivers
that said their rack get a sender in it first, and one that would cross
takes the place of a fresh receiver of another rack below a holder of its
own, so a broadcast's chain crosses between racks once per rack. Driven
through `sim_directory.BroadcastDirector`, the real state machine."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from in_process import count_writes, eventually, run_nodes

import hoplite_gpu as hg
from hoplite_gpu import messages as m
from hoplite_gpu.config import Config
from hoplite_gpu.directory import state as s
from hoplite_gpu.errors import ConfigError
from hoplite_gpu.sim_directory import OBJECT, BroadcastDirector, Pull

MiB = 1 << 20


def _run(racks: list[str | None] | None, order: list[int], receivers: int | None = None,
         **kw) -> tuple[BroadcastDirector, list[Pull]]:
    """A broadcast from n0 whose receivers ask in `order`; every pull made."""
    d = BroadcastDirector(receivers or len(order), 64 * MiB, racks=racks, **kw)
    d.start()
    pulls = []
    for i in order:
        pulls += d.locate(f"n{i}")
    return d, pulls


def _upstreams(d: BroadcastDirector) -> dict[str, str]:
    entry = d.directory.objects[OBJECT]
    return {n: h.upstream for n, h in entry.holders.items() if h.upstream is not None}


def _crossings(d: BroadcastDirector, racks: list[str]) -> list[tuple[str, str]]:
    rack = {f"n{i}": r for i, r in enumerate(racks)}
    return sorted((up, n) for n, up in _upstreams(d).items() if rack[up] != rack[n])


def _chain_from_root(d: BroadcastDirector) -> list[str]:
    """The receivers in chain order from n0 (each serves at most one)."""
    below = {up: n for n, up in _upstreams(d).items()}
    assert len(below) == len(_upstreams(d)), "a holder serves two: over the per-sender limit"
    chain, node = [], "n0"
    while node in below:
        node = below[node]
        chain.append(node)
    return chain


def test_a_chain_of_receivers_arriving_from_two_racks_in_turn_crosses_once():
    racks = ["A", "B"] * 4  # n0 (the root) in A; receivers alternate B, A, B, ...
    d, pulls = _run(racks, list(range(1, 8)))
    assert _crossings(d, racks) == [("n6", "n1")]  # A's tail feeds B's head: once
    assert _chain_from_root(d) == ["n2", "n4", "n6", "n1", "n3", "n5", "n7"]
    # each receiver of A took the place of n1 (B's first) in turn, told by a push
    assert [p for p in pulls if p.moved] == [Pull("n1", "n2", True), Pull("n1", "n4", True),
                                             Pull("n1", "n6", True)]


def test_three_racks_are_each_entered_once():
    racks = ["A", "B", "C"] * 3
    d, _ = _run(racks, list(range(1, 9)))
    crossings = _crossings(d, racks)
    rack = {f"n{i}": r for i, r in enumerate(racks)}
    assert len(crossings) == 2 and sorted(rack[n] for _, n in crossings) == ["B", "C"]
    assert len(_chain_from_root(d)) == 8  # (one chain: every receiver, none twice)


def test_without_racks_the_chain_is_the_order_of_arrival_and_nobody_is_moved():
    """The default: no rack told, or the same rack for all, chooses exactly
    as before (the emulated broadcast figures depend on it)."""
    order = [3, 1, 7, 2, 6, 4, 5]
    d, pulls = _run(None, order)
    assert pulls == [Pull(f"n{i}", f"n{j}") for j, i in zip([0, *order], order, strict=False)]
    replies = d.directory.handle(s.Locate("n1", 9, OBJECT))  # (asked again)
    assert all(not r.body.seq for r in replies if isinstance(r, s.Reply))
    same, same_pulls = _run(["A"] * 8, order)
    assert same_pulls == pulls and _upstreams(same) == _upstreams(d)
    assert same.directory.objects[OBJECT].moves == 0


def test_a_complete_copy_in_the_receivers_rack_beats_an_earlier_one_outside_it():
    racks = ["A", "B", "B"]
    d = BroadcastDirector(2, 64 * MiB, racks=racks, max_receivers_per_sender=2)
    d.start()
    assert d.locate("n1") == [Pull("n1", "n0")]
    d.completed("n1")
    assert d.locate("n2") == [Pull("n2", "n1")]  # (n0 is the earliest complete copy)


def test_a_receiver_far_along_is_not_moved_and_the_newcomer_crosses():
    """A receiver of another rack with more than a relay step (4 MiB) in is
    left where it is: the newcomer takes the crossing instead."""
    racks = ["A", "B", "A"]
    d = BroadcastDirector(2, 64 * MiB, racks=racks)
    d.start()
    assert d.locate("n1") == [Pull("n1", "n0")]
    d.progress("n1", 8 * MiB)
    assert d.locate("n2") == [Pull("n2", "n1")]
    assert _crossings(d, racks) == [("n0", "n1"), ("n1", "n2")]


def test_a_moved_receiver_whose_new_sender_dies_fails_over_and_replies_outrank_the_push():
    """n2 takes n1's place below n0, then dies: n1 asks again and is given
    a live sender, in a reply numbered at least as the push that moved it
    (a node keeps the newer of the two)."""
    racks = ["A", "B", "A"]
    d, pulls = _run(racks, [1, 2])
    assert Pull("n1", "n2", moved=True) in pulls
    moves = d.directory.objects[OBJECT].moves
    d.directory.handle(s.NodeLost("n2"))
    [reply] = [c for c in d.directory.handle(s.Locate("n1", 7, OBJECT))
               if isinstance(c, s.Reply)]
    assert reply.body.sender == "n0" and reply.body.seq == moves
    assert _upstreams(d) == {"n1": "n0"}


def test_a_rack_is_registered_and_a_bad_one_refused_naming_the_setting():
    with pytest.raises(ConfigError, match="HOPLITE_RACK"):
        Config.from_env({"HOPLITE_RACK": "leaf 0"})
    with pytest.raises(ConfigError, match="HOPLITE_RACK"):
        Config.from_env({"HOPLITE_RACK": "x" * 65})
    assert Config.from_env({"HOPLITE_RACK": ""}).rack is None
    d = s.Directory()
    d.handle(s.NodeJoined("n0", "tcp://h:1", rack="leaf0"))
    d.handle(s.NodeJoined("n1", "tcp://h:2"))
    assert d.racks == {"n0": "leaf0"}
    d.handle(s.NodeLost("n0"))
    assert d.racks == {}


def test_a_receiver_moved_mid_pull_completes_from_its_new_sender_byte_identical():
    """Real nodes: b (rack B) pulls from the origin (rack A), which makes
    the bytes only later; c (rack A) then takes b's place, and b's pull
    goes on from c (a `restripe` push of one stripe), every byte once."""
    size = 8 * MiB
    value = (np.arange(size) % 251).astype(np.uint8)
    base = dict(shared_memory=False, chunk_size=MiB, timeout_s=20, stall_timeout_s=5.0)

    async def body(directory, origin, b, c):
        assert directory.state.racks == {origin.node_id: "A", b.node_id: "B", c.node_id: "A"}
        oid = hg.ObjectID.from_name("racks-moved")
        obj = origin.store.create(oid, hg.values.to_buffer(value)[1])
        obj.own = True
        await origin._request(m.Put(rid=0, oid=oid.binary, size=size,
                                    layout=obj.layout.to_wire()), 5)
        counts = np.zeros(size, np.int64)
        count_writes(b, counts)
        got_b = asyncio.ensure_future(b.fetch(oid, 15))
        entry = directory.state.objects[oid.binary]
        assert await eventually(lambda: b.node_id in entry.holders)
        got_c = asyncio.ensure_future(c.fetch(oid, 15))
        assert await eventually(lambda: entry.moves == 1)
        obj.buffer[:] = value
        obj.advance(size)
        origin._post(hg.node.holdings.complete_msg(obj))
        for got in await asyncio.gather(got_b, got_c):
            np.testing.assert_array_equal(np.asarray(got.buffer), value)
        assert (counts == 1).all(), "a byte was written twice, or never"
        edges = [tuple(e) for e in (await b.query(oid))["edges"]]
        assert (c.node_id, origin.node_id) in edges and (b.node_id, c.node_id) in edges

    run_nodes([Config(rack="A", **base), Config(rack="B", **base), Config(rack="A", **base)],
              body, bound=30)


def test_a_rack_taken_from_the_address_is_its_subnet():
    """`HOPLITE_RACK=subnet/N`: the rack is the node's data address's
    network, N bits long, so hosts on one leaf's subnet share a rack
    without each being told its label; a name instead of an address, or N
    longer than the address, is refused naming the setting."""
    from hoplite_gpu.config import rack_label

    assert rack_label(None, "10.88.1.3") is None
    assert rack_label("leaf0", "10.88.1.3") == "leaf0"
    assert rack_label("subnet/24", "10.88.1.3") == "10.88.1.0/24"
    assert rack_label("subnet/24", "10.88.1.200") == rack_label("subnet/24", "10.88.1.3")
    assert rack_label("subnet/24", "10.88.0.3") != rack_label("subnet/24", "10.88.1.3")
    assert rack_label("subnet/64", "[fd00:1:2:3::7]") == "fd00:1:2:3::/64"
    with pytest.raises(ConfigError, match=r"HOPLITE_RACK='subnet/24'.*'gpu-host-1'.*HOPLITE_NODE_HOST"):
        rack_label("subnet/24", "gpu-host-1")
    with pytest.raises(ConfigError, match="IPv4 address has 1 to 32 bits"):
        rack_label("subnet/33", "10.0.0.1")
    assert Config.from_env({"HOPLITE_RACK": "subnet/24"}).rack == "subnet/24"
    with pytest.raises(ConfigError, match="subnet/N takes N bits"):
        Config.from_env({"HOPLITE_RACK": "subnet/129"})

    async def body(directory, a, b):
        assert directory.state.racks == {a.node_id: "127.0.0.0/24", b.node_id: "127.0.0.0/24"}

    run_nodes([Config(rack="subnet/24", shared_memory=False)] * 2, body, bound=20)
