"""A striped broadcast between real nodes (in-process, over TCP): the
directory (two stripes forced) hands each receiver one sender per stripe,
moves pulls as the trees grow (`restripe` pushes), and each node runs its
stripes as a pinned plan, one sub-flow per stripe. Every copy must come out
byte-identical with every byte written once, each receiver must have pulled
from several senders, and a relay that dies mid-pull must leave every other
receiver complete."""

from __future__ import annotations

import asyncio

import numpy as np
from in_process import count_writes, eventually, run_nodes

import hoplite_gpu as hg
from hoplite_gpu import messages as m
from hoplite_gpu.node.holdings import complete_msg
from hoplite_gpu.values import to_buffer

MiB = 1 << 20
CONFIG = hg.Config(shared_memory=False, chunk_size=256 << 10, timeout_s=20, stall_timeout_s=2.0)
#: the directory: two stripes for every object of 1 MiB or more
STRIPED = {"stripes": 2, "multi_source_bytes": MiB}


class HeldBack:
    """An object `origin` holds but makes only as the test says: the
    receivers are all placed in the trees before a byte moves."""

    def __init__(self, origin, oid, value) -> None:
        self.origin, self.oid, self.value = origin, oid, value
        _, self.layout = to_buffer(value)

    async def register(self) -> None:
        self.obj = self.origin.store.create(self.oid, self.layout)
        self.obj.own = True
        await self.origin._request(m.Put(rid=0, oid=self.oid.binary, size=self.layout.nbytes,
                                         layout=self.layout.to_wire()), 5)

    def make(self, upto: int) -> None:
        """Bytes [.., upto) are there now."""
        self.obj.buffer[self.obj.ready:upto] = self.value[self.obj.ready:upto]
        self.obj.advance(upto)
        if upto == self.obj.size:
            self.origin._post(complete_msg(self.obj))


def _senders(info: dict, node) -> set[str]:
    return {s for r, s in info["edges"] if r == node.node_id}


async def _whole_from_several(receivers, gets, counts, value, oid) -> dict:
    """Every get ends with `value`, each byte written once, and each
    receiver pulled from at least two senders; the object's info."""
    got = await asyncio.gather(*gets)
    for n, obj in zip(receivers, got, strict=True):
        np.testing.assert_array_equal(np.asarray(obj.buffer), value)
        assert (counts[n.node_id] == 1).all(), "a byte was written twice, or never"
    info = await receivers[0].query(oid)
    for n in receivers:
        assert len(_senders(info, n)) >= 2, (n.node_id, info["edges"])
    return info


def test_every_receiver_pulls_its_stripes_from_several_senders_byte_identical():
    size = 8 * MiB
    value = (np.arange(size) % 251).astype(np.uint8)

    async def body(directory, origin, *receivers):
        oid = hg.ObjectID.from_name("striped")
        held = HeldBack(origin, oid, value)
        await held.register()
        counts = {n.node_id: np.zeros(size, np.int64) for n in receivers}
        for n in receivers:
            count_writes(n, counts[n.node_id])
        gets = [asyncio.ensure_future(n.fetch(oid, 15)) for n in receivers]
        trees = None

        def placed() -> bool:
            nonlocal trees
            entry = directory.state.objects.get(oid.binary)
            trees = entry and entry.stripes
            return trees is not None and len(trees.up) == len(receivers)

        assert await eventually(placed), "the receivers were not all placed in the trees"
        held.make(size // 2)
        await asyncio.sleep(0.05)
        held.make(size)
        info = await _whole_from_several(receivers, gets, counts, value, oid)
        ids = {n.node_id for n in receivers}
        assert {s for _, s in info["edges"]} & ids, "no receiver relayed a stripe"

    run_nodes([CONFIG] * 5, body, bound=60, **STRIPED)


def test_a_relay_dying_mid_pull_leaves_every_other_receiver_complete():
    """A receiver that relays a stripe to others dies once bytes flow: the
    directory moves its receivers to other senders (each told by a
    `restripe` push, its bytes kept), and each of them completes
    byte-identical."""
    size = 8 * MiB
    value = (np.arange(size) % 247).astype(np.uint8)

    async def body(directory, origin, *receivers):
        oid = hg.ObjectID.from_name("striped-relay-dies")
        held = HeldBack(origin, oid, value)
        await held.register()
        gets = {n.node_id: asyncio.ensure_future(n.fetch(oid, 15)) for n in receivers}
        entry = None

        def placed() -> bool:
            nonlocal entry
            entry = directory.state.objects.get(oid.binary)
            return (entry is not None and entry.stripes is not None
                    and len(entry.stripes.up) == len(receivers))

        assert await eventually(placed)
        trees = entry.stripes
        relay = next(n for n in receivers if any(trees.kids.get(n.node_id, ())))
        children = {c for kids in trees.kids[relay.node_id] for c in kids}
        held.make(size // 4)
        assert await eventually(lambda: all(
            n.store.get(oid) is not None and n.store.get(oid).ready > 0
            for n in receivers if n.node_id in children))
        pushed: dict[str, list[str]] = {}
        real = directory._carry_out

        def carry_out(cmd):
            if isinstance(cmd.body if hasattr(cmd, "body") else None, m.Restripe):
                pushed[cmd.node] = [s.sender for s in cmd.body.stripes]
            real(cmd)

        directory._carry_out = carry_out
        gets.pop(relay.node_id).cancel()
        await relay.close()
        held.make(size)
        others = [n for n in receivers if n is not relay]
        got = await asyncio.gather(*(gets[n.node_id] for n in others))
        for obj in got:
            np.testing.assert_array_equal(np.asarray(obj.buffer), value)
        info = await others[0].query(oid)
        assert relay.node_id not in {h["node"] for h in info["holders"]}
        for child in children:  # told its new senders, none of them the dead relay
            assert child in pushed and relay.node_id not in pushed[child], (child, pushed)

    run_nodes([CONFIG] * 7, body, bound=60, **STRIPED)


def test_pulls_of_the_whole_object_are_moved_into_stripes_once_enough_receivers_come():
    """The cost model's choice (`stripes` 0) with TCP's relay step: the first
    seven receivers of an 8 MiB object form a chain, the eighth makes two
    stripes the better schedule; the chain's pulls, each from one sender,
    are told their stripes' senders and go on from those."""
    size = 8 * MiB
    value = (np.arange(size) % 241).astype(np.uint8)

    async def body(directory, origin, *receivers):
        oid = hg.ObjectID.from_name("striped-later")
        held = HeldBack(origin, oid, value)
        await held.register()
        counts = {n.node_id: np.zeros(size, np.int64) for n in receivers}
        gets = []
        entry = directory.state.objects[oid.binary]
        for i, n in enumerate(receivers):  # (one after another: the chain, then the trees)
            count_writes(n, counts[n.node_id])
            gets.append(asyncio.ensure_future(n.fetch(oid, 15)))
            assert await eventually(lambda n=n: n.store.get(oid) is not None)
            assert (entry.stripes is None) == (i < 7), i
        assert entry.stripes is not None and set(entry.stripes.up) == {
            n.node_id for n in receivers}
        held.make(size)
        await _whole_from_several(receivers, gets, counts, value, oid)

    run_nodes([CONFIG] * 9, body, bound=60, stripes=0, multi_source_bytes=MiB,
              relay_bytes=256 << 10)
