"""Operations given up part-way (cancelled, past their deadline, failed) must
leave no state behind: no partial object, no reservation, no directory
holder or serving slot, no lent caller memory, no half-published version."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from in_process import eventually, run_nodes

import hoplite_gpu as hg
from hoplite_gpu import messages

MiB = 1 << 20


def with_nodes(n: int, body, **settings) -> None:
    """Run `body(directory, *nodes)`: an in-process directory and `n` nodes."""
    config = hg.Config(shared_memory=False, chunk_size=MiB, timeout_s=10, **settings)
    run_nodes([config] * n, body)


def slow_answers(node, op: str, delay: float = 0.5):
    """Make the directory's answers to `node`'s `op` requests spend `delay`
    seconds on the wire (the directory has acted on them at once). Returns
    the real `start`, to put back."""
    asking = node.client.start
    loop = asyncio.get_running_loop()

    def start(msg, rid=None):
        fut = asking(msg, rid)
        if messages.op(msg) != op:
            return fut
        late = loop.create_future()

        def relay(f):
            if late.done() or f.cancelled():
                return
            if f.exception() is None:
                late.set_result(f.result())
            else:
                late.set_exception(f.exception())
        fut.add_done_callback(lambda f: loop.call_later(delay, relay, f))
        return late

    node.client.start = start
    return asking


def holders(directory, oid) -> dict:
    info = messages.as_map(directory.state.describe(oid.binary))  # (the map a query answers)
    return {h["node"]: h for h in info.get("holders", ())}


def test_a_get_cancelled_while_its_locate_answer_is_on_the_wire_frees_the_senders_slot():
    """The directory may assign a sender to a pull (making the puller a holder
    and taking one of the sender's slots) just before the get is cancelled;
    the answer then arrives after the pull withdrew its request and is
    dropped. The puller must still tell the directory that it pulls nothing,
    or the slot stays taken and other receivers are sent to a 'holder' that
    has no copy."""

    async def body(directory, origin, reader, other):
        oid = hg.ObjectID.from_name("locate-race")
        await origin.put(np.full(4 * MiB, 7, np.uint8), oid)
        asking = slow_answers(reader, "locate")
        get = asyncio.ensure_future(reader.get(oid, 10, "numpy"))
        # the directory has answered: the reader pulls from the origin, there
        assert await eventually(lambda: holders(directory, oid).get(reader.node_id, {})
                                .get("upstream") == origin.node_id)
        get.cancel()  # before the answer reaches the reader
        with pytest.raises(asyncio.CancelledError):
            await get
        await asyncio.sleep(1.0)  # the late answer, the withdrawal: all in
        reader.client.start = asking
        assert reader.store.get(oid) is None
        held = holders(directory, oid)
        assert reader.node_id not in held, held
        assert held[origin.node_id]["serving"] == [], held
        # and another reader is not sent to the reader, which has no copy
        got = await other.get(oid, 3, "numpy")
        assert int(got[0]) == 7

    with_nodes(3, body)


def test_a_put_that_finds_another_put_of_its_id_under_way_survives_its_cancellation():
    """A put finding the id already here, half-copied by another put, returns
    at once as if done. If that other put is then given up, its partial copy
    goes, and the put that returned 'done' left nothing: gets of the id wait
    for a put that never comes."""

    async def body(directory, node, other):
        oid = hg.ObjectID.from_name("two-puts")
        value = np.full(8 * MiB, 5, np.uint8)
        first = asyncio.ensure_future(node.put(value, oid))
        while (obj := node.store.get(oid)) is None or not 0 < obj.ready < obj.size:
            await asyncio.sleep(0)
        second = asyncio.ensure_future(node.put(value, oid))
        await asyncio.sleep(0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await asyncio.wait_for(second, 10) == oid  # this put says: done
        got = await other.get(oid, 3, "numpy")
        assert got.size == value.size and int(got[-1]) == 5

    with_nodes(2, body)


def test_a_publish_that_fails_part_way_does_not_leak_into_the_next_version():
    """A publish whose second put fails (here: the store limit) has put its
    first array already, under the version it meant to publish, and the head
    did not move; the next publish takes the same version number, finds that
    array's id taken with the same layout and keeps the stale bytes: readers
    get a version made of arrays the learner never published together."""
    from hoplite_gpu.channel import WeightChannel

    hg.init(chunk_size=MiB, timeout_s=10, store_bytes=3 * MiB)
    try:
        ch = WeightChannel("half-published")
        with pytest.raises(hg.StoreFull):
            ch.publish({"a": np.full(MiB, 1, np.uint8), "b": np.zeros(4 * MiB, np.uint8)})
        version = ch.publish({"a": np.full(MiB, 2, np.uint8)})
        got_version, weights = ch.fetch(timeout=5)
        assert got_version == version
        assert int(weights["a"][0]) == 2, "the reader got the failed publish's array"
    finally:
        hg.shutdown()


def test_a_delete_given_up_after_the_directory_applied_it_drops_the_local_copy():
    """`Node.delete` drops its own copy only once the directory's reply is in
    (the directory sends the deleting node no drop). Given up while that
    reply is on the wire, the delete has happened in the cluster but the
    node keeps its copy: its gets return the deleted bytes even after the id
    is put anew elsewhere."""

    async def body(directory, node, other):
        oid = hg.ObjectID.from_name("half-deleted")
        await node.put(np.full(2 * MiB, 1, np.uint8), oid)
        asking = slow_answers(node, "delete")
        delete = asyncio.ensure_future(node.delete(oid))
        assert await eventually(lambda: oid.binary not in directory.state.objects)
        delete.cancel()  # e.g. the blocking call's deadline, while the reply is on the wire
        with pytest.raises(asyncio.CancelledError):
            await delete
        node.client.start = asking
        await other.put(np.full(2 * MiB, 2, np.uint8), oid)  # the id, put anew
        got = await node.get(oid, 3, "numpy")
        assert int(got[0]) == 2, "the node kept the deleted copy"

    with_nodes(2, body)


def test_a_publish_whose_head_answer_came_too_late_is_still_freed_later():
    """The directory moved the head, but its answer came after the publish's
    deadline: publish raises, without recording the version among those it
    frees later, so its arrays stay in the cluster for good."""
    from hoplite_gpu.channel import WeightChannel

    rt = hg.init(chunk_size=MiB, timeout_s=1)
    try:
        ch = WeightChannel("late-head", keep=1)

        async def slow_heads():
            return slow_answers(rt.node, "channel_publish", delay=2.0)

        asking = rt.call(slow_heads(), 5)
        with pytest.raises(hg.Timeout):
            ch.publish({"w": np.full(MiB, 0, np.uint8)})

        async def restore():
            rt.node.client.start = asking

        rt.call(restore(), 5)
        assert ch.latest_version() == 0  # it was published after all
        for _ in range(2):
            ch.publish({"w": np.full(MiB, 1, np.uint8)})
        assert ch.latest_version() == 2
        with pytest.raises(hg.ObjectNotFound):  # keep=1: version 1 is freed...
            hg.object_info(hg.ObjectID.from_name("hoplite-channel/late-head/1/pack/0"))
        with pytest.raises(hg.ObjectNotFound):  # ...and so must version 0 be
            hg.object_info(hg.ObjectID.from_name("hoplite-channel/late-head/0/pack/0"))
    finally:
        hg.shutdown()



def test_a_reduce_given_up_while_its_answer_was_on_the_wire_is_asked_again_after_a_restart():
    """The directory may have started a reduce whose request the caller gave
    up waiting for: the node must remember it like an answered one, so that
    a restarted directory is asked for it again."""

    async def body(directory, node):
        a, b, target = (hg.ObjectID.from_name(f"late-reduce-{n}") for n in ("a", "b", "t"))
        for oid in (a, b):
            await node.put(np.ones(2 * MiB, np.uint8), oid)
        asking = slow_answers(node, "reduce")
        call = asyncio.ensure_future(node.reduce([a, b], "sum", 2, target))
        assert await eventually(lambda: target.binary in directory.state.reduces)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        node.client.start = asking
        assert target in node._my_reduces
        # a refused one is not remembered, and leaves the remembered one as it was
        with pytest.raises(hg.ObjectExists):
            await node.reduce([a, b], "max", 2, target)
        assert node._my_reduces[target].op_name == "sum"

    with_nodes(1, body)
