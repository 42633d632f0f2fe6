"""Pull failover over the TCP data path between nodes: resumes, failovers,
stalls and what a pull leaves behind. Nodes run in this process
(`in_process.run_nodes`) with shared memory off, so every byte crosses a TCP
connection."""

from __future__ import annotations

import asyncio

import numpy as np
from in_process import cut_halfway, eventually, run_nodes

import hoplite_gpu as hg

MiB = 1 << 20


def config(**settings) -> hg.Config:
    base = dict(shared_memory=False, chunk_size=MiB, timeout_s=10, stall_timeout_s=1.0)
    base.update(settings)
    return hg.Config(**base)


def cut_first_serve_halfway(server) -> list:
    """Make `server` (a DataServer) send only the first half of the range of
    its first pull, then close the connection (a sender dying mid-pull);
    later pulls are served whole. Returns the ranges cut."""
    return cut_halfway(server, lambda _stream, asked: asked == 0)


def test_a_get_given_up_while_its_pull_backs_off_leaves_no_partial_copy():
    """A get's pull fails half-way (its sender's connection dies) and backs
    off (20 ms, doubling) before asking the directory again. If the get is
    given up in that pause (cancelled: `get_async` cancelled, a blocking
    call's task cancelled), the pull is cancelled inside its `except` block,
    where no handler removes the partial copy: the half-filled buffer stays
    in the store for good (no pull fills it, it is never evictable as it is
    not complete), and the directory still lists this node as a holder.
    docs/fault-tolerance.md: "the last get to give up cancels it, and the
    partial copy is dropped (dropped)". The user sees memory that never
    comes back (counted against HOPLITE_STORE_BYTES), and receivers relayed
    from that copy get keepalives for it until `timeout_s`."""

    async def body(directory, origin, reader):
        oid = hg.ObjectID.from_name("backoff-cancelled")
        await origin.put(np.full(8 * MiB, 7, np.uint8), oid)
        cut_first_serve_halfway(origin.server)
        get = asyncio.ensure_future(reader.get(oid, 8, "numpy"))
        # the pull failed half-way and is in its back-off pause
        assert await eventually(lambda: oid in reader._failed_at, 5.0), "the pull did not fail"
        obj = reader.store.get(oid)
        assert obj is not None and 0 < obj.ready < obj.size, "no partial copy: nothing tested"
        get.cancel()
        await asyncio.gather(get, return_exceptions=True)
        assert await eventually(lambda: oid not in reader._pulls, 2.0)
        await asyncio.sleep(0.3)  # (the dropped notice reaches the directory)
        left = reader.store.get(oid)
        entry = directory.state.objects.get(oid.binary)
        holders = [] if entry is None else list(entry.holders)
        assert left is None, (f"the given-up pull left a partial copy: {left.ready} of "
                              f"{left.size} bytes, {reader.store.held} bytes held")
        assert reader.node_id not in holders, "the directory still lists the reader as a holder"

    run_nodes([config()] * 2, body, bound=30)


def test_a_receiver_sent_to_a_copy_that_was_just_dropped_fails_over_within_the_stall_timeout():
    """With one receiver per sender (the default), C is sent to B, which is
    still pulling the object from its origin A. B's get gives up before C's
    pull request reaches it, so B drops its partial copy (and tells the
    directory, which frees A). B's data server does not know the id any
    more and waits for it to appear "as a reduce parent may ask before our
    own step has created its output" (transfer.py `_serve_pull` ->
    `_await_object`), sending keepalives every `stall_timeout_s / 3` for up
    to `timeout_s`. C's stall timeout never fires: C waits out B's
    `timeout_s` (300 s by default) although A holds a complete copy and is
    free, and C's get ends with Timeout. A sender that will never have the
    bytes is kept alive by its keepalives."""

    async def body(directory, a, b, c):
        oid = hg.ObjectID.from_name("dropped-relay")
        await a.put(np.full(8 * MiB, 5, np.uint8), oid)
        real_serve = a.server._stream_range
        serves = []

        async def slow_first(stream, obj, pos, end, stall, size):
            serves.append(pos)
            if len(serves) == 1:
                await asyncio.sleep(1.0)  # B's pull from A is still under way when C asks
            return await real_serve(stream, obj, pos, end, stall, size)

        a.server._stream_range = slow_first
        get_b = asyncio.ensure_future(b.get(oid, 8, "numpy"))
        assert await eventually(lambda: b.store.get(oid) is not None, 5.0)
        real_fetch = c.pulls._fetch_from
        senders = []

        async def b_gives_up_first(obj, flow, sink):
            senders.append(flow.address)
            if flow.address == b.server.address and len(senders) == 1:
                get_b.cancel()  # B's get gives up just before C's request reaches B
                await asyncio.gather(get_b, return_exceptions=True)
                assert b.store.get(oid) is None
                await asyncio.sleep(0.2)
            return await real_fetch(obj, flow, sink)

        c.pulls._fetch_from = b_gives_up_first
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            got = await c.get(oid, 5, "numpy")
        except hg.Timeout as exc:
            assert senders[:1] == [b.server.address], f"C was not sent to B: {senders}"
            raise AssertionError(
                f"C's get timed out after {loop.time() - started:.1f}s on B, which had "
                f"dropped its copy, while A held a complete one: {exc}") from None
        assert senders[:1] == [b.server.address], "C was not sent to B: nothing tested"
        assert int(got[0]) == 5 and int(got[-1]) == 5
        assert loop.time() - started < 3.5, "C did not fail over within the stall timeout"

    run_nodes([config()] * 3, body, bound=30)
