"""Which pulls are split over ECMP paths (and rails), besides a get's plain
pull: a reduce step's pull of a child's stream and a striped pull, with
the same machinery (`Ways.routes`, `plan_for`, the engine's dealt plans;
docs/fabric.md, "Rails and paths").

Loopback stands for the fabric, as in tests/test_rails.py: with
`HOPLITE_PATHS=2` each path is a class of source ports, so the sender sees
which path every byte came over by the port its puller connected from."""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pytest
from in_process import count_writes, cut_halfway, free_ports, run_nodes

import hoplite_gpu as hg
from hoplite_gpu.config import Config
from hoplite_gpu.errors import PeerLost
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.node import engine
from hoplite_gpu.node.plan import Ledger, Plan, SubFlow
from hoplite_gpu.node.store import ChunkStore
from hoplite_gpu.node.ways import Ways
from hoplite_gpu.values import Layout

MiB = 1 << 20
OID = ObjectID(b"s" * 20)
_BASE = dict(shared_memory=False, chunk_size=MiB, timeout_s=20, stall_timeout_s=5.0,
             multi_source_bytes=4 * MiB)


def _stored(size: int):
    return ChunkStore(0).create(OID, Layout("bytes", "uint8", (size,), size))


# -- plans, pure ------------------------------------------------------------------


def test_a_striped_pull_deals_each_stripe_over_its_senders_routes():
    """Each stripe's bytes are dealt over its own sender's routes (an equal
    share each, in the stripe's messages), and a route two stripes share
    alternates between them; a stripe whose sender has one route stays a
    sub-flow per missing range."""
    obj = _stored(8 * MiB)
    a = [("a", "tcp://a:1", "", 0), ("a", "tcp://a:1", "", 1)]
    stripes = [(0, 4 * MiB, "a", "tcp://a:1"), (4 * MiB, 8 * MiB, "a", "tcp://a:1")]
    plan = engine.plan_for(obj, "a", "tcp://a:1", stripes=stripes, piece=65536, routes=a)
    assert plan.pinned and plan.serial and not plan.spares
    by_route = collections.defaultdict(list)
    for flow in plan.flows:
        by_route[flow.route].append((flow.start, flow.end))
        assert flow.piece == 65536
    # 4 MiB a stripe over 2 routes: 4 pieces of 1 MiB (`engine.PIECE_MIN`); a
    # route takes every other one of each stripe, the two stripes in turn
    assert by_route[a[0]] == [(0, MiB), (4 * MiB, 5 * MiB), (2 * MiB, 3 * MiB),
                              (6 * MiB, 7 * MiB)]
    assert sum(e - s for s, e in by_route[a[1]]) == sum(e - s for s, e in by_route[a[0]])
    one = [("b", "tcp://b:1", "", -1)]
    plain = engine.plan_for(obj, "a", "tcp://a:1", stripes=[(0, 8 * MiB, "b", "tcp://b:1")],
                            routes=one)
    assert [(f.start, f.end, f.route) for f in plain.flows] == [(0, 8 * MiB, one[0])]
    assert not plain.serial  # (today's striped plan)


def test_ways_leave_a_failed_path_out_of_the_next_plan_and_the_kernels_port_last():
    ways = Ways(Config(paths=2, multi_source_bytes=MiB))
    senders = [("a", "tcp://127.0.0.1:9")]
    routes, held = ways.routes(OID, 8 * MiB, senders, {})
    assert [r[3] for r in routes] == [0, 1] and [h[2] for h in held] == [4 * MiB] * 2
    ways.release(held)
    ways.failed(OID, SubFlow(0, MiB, "a", "tcp://127.0.0.1:9", path=1))
    routes, held = ways.routes(OID, 8 * MiB, senders, {})
    assert routes == [("a", "tcp://127.0.0.1:9", "", 0)] and held == [("", 0, 8 * MiB)]
    ways.release(held)
    ways.failed(OID, SubFlow(0, MiB, "a", "tcp://127.0.0.1:9", path=0))
    # every path failed: the sender's own address from the kernel's port
    assert ways.routes(OID, 8 * MiB, senders, {}) == ([("a", "tcp://127.0.0.1:9", "", -1)], [])
    ways.forget(OID)
    assert sorted(r[3] for r in ways.routes(OID, 8 * MiB, senders, {})[0]) == [0, 1]


# -- the engine: a dealt plan -------------------------------------------------------


def test_a_dealt_plans_routes_pull_their_own_pieces_in_order_one_at_a_time():
    obj = _stored(800)
    routes = [("a", "x", "", 0), ("a", "x", "", 1)]
    plan = Plan.dealt(obj.oid, 800, routes, piece=100)
    running: collections.Counter = collections.Counter()
    most: collections.Counter = collections.Counter()
    order = []

    async def fetch(flow, sink):
        running[flow.path] += 1
        most[flow.path] = max(most[flow.path], running[flow.path])
        await asyncio.sleep(0.001 * (1 + flow.path))
        sink.advance(flow.end)
        order.append((flow.path, flow.start))
        running[flow.path] -= 1

    asyncio.run(engine.run_plan(plan, obj, fetch, lambda f, e: None, (PeerLost,)))
    assert obj.complete and most == {0: 1, 1: 1}
    assert [s for p, s in order if p == 0] == [0, 200, 400, 600]
    assert [s for p, s in order if p == 1] == [100, 300, 500, 700]


def test_a_route_that_fails_hands_its_rest_and_its_later_pieces_back():
    """Path 1 fails half-way through its second piece: that piece's rest
    and its later pieces go back; path 0 (the same sender, out now) stops
    after the piece in hand, its next one not asked for; the plan fails
    with the bytes kept (the next plan pulls only what is missing)."""
    obj = _stored(800)
    plan = Plan.dealt(obj.oid, 800, [("a", "x", "", 0), ("a", "x", "", 1)], piece=100)
    failed = []

    async def fetch(flow, sink):
        if flow.path == 1 and flow.start == 300:
            sink.advance(350)
            raise PeerLost("path 1 cut (test)")
        await asyncio.sleep(0.01 if flow.path == 0 else 0)
        sink.advance(flow.end)

    with pytest.raises(PeerLost):
        asyncio.run(engine.run_plan(plan, obj, fetch, lambda f, e: failed.append(f.path),
                                    (PeerLost,)))
    assert failed == [1]
    assert obj.ledger.runs == [(0, 200), (300, 350)]


# -- real pulls: a reduce step's child ------------------------------------------------


def _served(node) -> list[tuple[str, int, int]]:
    """(puller's host:port, start, end) of every range `node` serves from now on."""
    seen: list[tuple[str, int, int]] = []
    real = node.server._stream_range

    async def serve(stream, obj, pos, end, stall, size):
        seen.append((stream.peer, pos, end))
        return await real(stream, obj, pos, end, stall, size)

    node.server._stream_range = serve
    return seen


def _reduce_on_two(cut: bool) -> dict:
    """Input 0 on node a, input 1 on node b (the root: it pulls a's stream,
    8 MiB, over two paths); with `cut`, a cuts what it sends over path 1
    halfway. The result is checked; what was served and seen is returned."""
    size = 8 * MiB
    ports = free_ports(6)
    low = int(ports.split("-")[0])
    root = Config(paths=2, path_ports=ports, **_BASE)
    values = [np.arange(size // 4, dtype=np.float32) * (i + 1) for i in range(2)]
    seen: dict = {"low": low}

    async def body(directory, a, b):
        seen.update(a=a.node_id, b=b.node_id, served=_served(a))
        seen["cuts"] = cut_halfway(a.server, lambda stream, _asked: stream.peer.endswith(
            f":{low + 1}")) if cut else []
        counts = np.zeros(size, np.int64)
        count_writes(b, counts)
        ids = [hg.ObjectID.from_name(f"split-reduce-{cut}-{i}") for i in range(2)]
        target = hg.ObjectID.from_name(f"split-reduce-{cut}-t")
        await b.reduce(ids, "sum", 2, target, root_input=ids[1])
        await a.put(values[0], ids[0])
        await b.put(values[1], ids[1])
        got = await b.get(target, 15, "numpy")
        np.testing.assert_array_equal(got, values[0] + values[1])
        assert (counts == 1).all(), "a byte of the child was written twice, or never"
        assert directory.state.reduces[target.binary].restarts == 0
        seen["info"] = await b.query(target)

    run_nodes([Config(**_BASE), root], body, bound=30)
    return seen


def test_a_reduce_steps_pull_of_a_child_is_split_over_the_paths():
    """The root's pull of its child's stream: pieces dealt over both paths,
    an equal share each, from the ports chosen; object_info of the target
    names both connections."""
    seen = _reduce_on_two(cut=False)
    low, per_port = seen["low"], collections.Counter()
    for peer, start, end in seen["served"]:
        per_port[peer] += end - start
    assert per_port == {f"127.0.0.1:{low}": 4 * MiB, f"127.0.0.1:{low + 1}": 4 * MiB}
    assert sorted((p["receiver"], p["sender"], p["local"], p["path"])
                  for p in seen["info"]["paths"]) == [
        (seen["b"], seen["a"], f"127.0.0.1:{low}", 0),
        (seen["b"], seen["a"], f"127.0.0.1:{low + 1}", 1)]


def test_a_path_cut_mid_transfer_leaves_the_reduce_step_running_on_the_other():
    """Path 1's first piece is cut halfway (a link going down): the step
    pulls the rest over path 0 alone, every byte once, and the reduce is not
    rebuilt (no `step_lost`)."""
    seen = _reduce_on_two(cut=True)
    path0, path1 = (f"127.0.0.1:{seen['low'] + k}" for k in (0, 1))
    assert seen["cuts"] == [(MiB, 2 * MiB)]  # (pieces of 1 MiB: path 1's first)
    peers = [p for p, _, _ in seen["served"]]
    assert peers.count(path1) == 1 and set(peers[peers.index(path1) + 1:]) == {path0}
    # path 0 was asked for everything but what path 1 landed of its cut piece
    ledger = Ledger(8 * MiB)
    for p, start, end in seen["served"]:
        if p == path0:
            ledger.write(start, end)  # (no byte asked twice)
    assert all(MiB <= a and b <= MiB + MiB // 2 for a, b in ledger.missing())


# -- real pulls: a striped broadcast ------------------------------------------------


def test_a_striped_pull_splits_each_stripe_over_the_paths():
    """Two stripes forced: each receiver pulls each stripe from its sender
    over both paths (pieces dealt), byte-identical, every byte once, each
    connection in object_info."""
    size = 8 * MiB
    value = (np.arange(size) % 251).astype(np.uint8)
    ports = free_ports(8)
    receiver = Config(paths=2, path_ports=ports, **_BASE)

    async def body(directory, origin, *receivers):
        counts = {n.node_id: np.zeros(size, np.int64) for n in receivers}
        for n in receivers:
            count_writes(n, counts[n.node_id])
        oid = hg.ObjectID.from_name("split-stripes")
        await origin.put(value, oid)
        got = await asyncio.gather(*(n.fetch(oid, 15) for n in receivers))
        for n, obj in zip(receivers, got, strict=True):
            np.testing.assert_array_equal(np.asarray(obj.buffer), value)
            assert (counts[n.node_id] == 1).all(), "a byte was written twice, or never"
        info = await origin.query(oid)
        assert directory.state.objects[oid.binary].stripes is not None  # (striped)
        for n in receivers:
            mine = {(p["sender"], p["path"]) for p in info["paths"] if p["receiver"] == n.node_id}
            senders = {s for s, _ in mine}
            assert senders and mine == {(s, k) for s in senders for k in (0, 1)}, info["paths"]

    run_nodes([Config(**_BASE), receiver, receiver], body, bound=30, stripes=2,
              multi_source_bytes=MiB)
