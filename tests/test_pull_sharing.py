"""Pulls shared by several gets on a node: gets of different patience,
failover between senders, a put of an id being pulled, and what an ended
pull leaves behind."""

from __future__ import annotations

import asyncio

import numpy as np
from in_process import run_nodes

import hoplite_gpu as hg
from hoplite_gpu.errors import PeerLost

MiB = 1 << 20


def with_nodes(n: int, body, **settings) -> None:
    """Run `body(directory, *nodes)`: an in-process directory and `n` nodes."""
    config = hg.Config(shared_memory=False, chunk_size=MiB, timeout_s=10, **settings)
    run_nodes([config] * n, body, bound=30)


def test_a_patient_get_survives_a_sender_lost_after_a_hasty_get_gave_up():
    """Two gets share one pull; the hasty one (which started the pull) gives
    up, then the sender is lost. The pull still runs under the hasty get's
    deadline, so it raises the transport error instead of failing over, and
    the patient get, with seconds left and another complete copy in the
    cluster, fails with PeerLost."""

    async def body(directory, origin, helper, reader):
        oid = hg.ObjectID.from_name("hasty-patient")
        await origin.put(np.full(4 * MiB, 3, np.uint8), oid)
        await helper.fetch(oid, 5)  # a second complete copy
        real = reader.pulls._fetch_from
        calls = []

        async def lost_once(obj, flow, sink):
            calls.append(flow.address)
            if len(calls) == 1:
                await asyncio.sleep(0.6)  # past the hasty get's deadline
                raise PeerLost("the sender died mid-pull (test)")
            return await real(obj, flow, sink)

        reader.pulls._fetch_from = lost_once
        hasty = asyncio.ensure_future(reader.get(oid, 0.2, "numpy"))
        await asyncio.sleep(0)
        patient = asyncio.ensure_future(reader.get(oid, 8, "numpy"))
        got = await asyncio.gather(hasty, patient, return_exceptions=True)
        assert isinstance(got[0], hg.Timeout), got[0]
        assert not isinstance(got[1], BaseException), f"the patient get failed: {got[1]!r}"
        assert int(got[1][0]) == 3 and len(calls) == 2

    with_nodes(3, body)


def test_a_get_joining_a_pull_its_last_get_just_abandoned_is_not_failed():
    """The only get of a pull gives up (cancelled); the pull is cancelled but
    has not ended yet when another get of the id joins it. The new get is
    woken with the pull's 'abandoned by its gets' error: ObjectNotFound for
    an object that exists, from a get that gave up nothing."""

    async def body(directory, origin, reader):
        oid = hg.ObjectID.from_name("abandoned-join")
        first = asyncio.ensure_future(reader.get(oid, 5, "numpy"))
        # the first get waits in its locate: the object is not put yet
        for _ in range(500):
            if oid in reader._pulls:
                break
            await asyncio.sleep(0.01)
        first.cancel()
        second = asyncio.ensure_future(reader.get(oid, 5, "numpy"))
        await asyncio.sleep(0.1)
        await origin.put(np.full(2 * MiB, 4, np.uint8), oid)
        try:
            got = await asyncio.wait_for(second, 8)
        except hg.ObjectNotFound as exc:
            raise AssertionError(f"the second get failed: {exc!r}") from None
        assert int(got[0]) == 4

    with_nodes(2, body)


def test_a_put_of_an_id_being_pulled_here_keeps_the_value_it_was_given():
    """A put finds a partial copy that a get here is pulling, with its layout,
    and returns as if done: the node holds no copy of its own. The get then
    gives up (its partial copy goes) and the origin is lost: the value the
    put was handed is nowhere, though the put succeeded."""

    async def body(directory, origin, node):
        oid = hg.ObjectID.from_name("put-while-pulled")
        value = np.full(64 * MiB, 5, np.uint8)
        await origin.put(value, oid)
        get = asyncio.ensure_future(node.get(oid, 5, "numpy"))
        for _ in range(100_000):
            obj = node.store.get(oid)
            if obj is not None and 0 < obj.ready < obj.size:
                break
            await asyncio.sleep(0)
        assert obj is not None and 0 < obj.ready < obj.size, "no pull under way: nothing tested"
        assert await node.put(value, oid) == oid
        get.cancel()
        await asyncio.gather(get, return_exceptions=True)
        await origin.close()  # the other copy is lost
        got = await node.get(oid, 3, "numpy")
        assert got.size == value.size and int(got[-1]) == 5

    with_nodes(2, body)


def test_a_given_up_pull_leaves_no_error_behind():
    """`Pulls.cancel` records why a pull was stopped, for its waiters; nothing
    removes that record when the pull ends, so every id whose get was given
    up (or dropped while pulled) stays in `_pull_errors` for good."""

    async def body(directory, origin, reader):
        for i in range(3):
            oid = hg.ObjectID.from_name(f"given-up-{i}")
            get = asyncio.ensure_future(reader.get(oid, 5, "numpy"))  # never put
            for _ in range(500):
                if oid in reader._pulls:
                    break
                await asyncio.sleep(0.01)
            get.cancel()
            await asyncio.gather(get, return_exceptions=True)
        await asyncio.sleep(0.1)
        assert not reader._pulls
        assert not reader.pulls.errors, f"{len(reader.pulls.errors)} records of ended pulls kept"

    with_nodes(2, body)


def test_a_pull_that_failed_for_good_is_not_counted_as_a_later_failover():
    """A pull whose sender failed records when (`_failed_at`), to time the
    failover once bytes flow again. If the get gives up instead, the record
    stays: a later, healthy get of the id counts as a failover, timed from
    the old failure."""

    async def body(directory, origin, reader):
        oid = hg.ObjectID.from_name("failed-for-good")
        await origin.put(np.full(2 * MiB, 6, np.uint8), oid)
        real = reader.pulls._fetch_from

        async def lost(obj, flow, sink):
            raise PeerLost("the sender died (test)")

        reader.pulls._fetch_from = lost
        try:
            await reader.get(oid, 0.3, "numpy")
        except (PeerLost, hg.Timeout):
            pass
        reader.pulls._fetch_from = real
        got = await reader.get(oid, 5, "numpy")  # healthy: no failover
        assert int(got[0]) == 6
        assert (await reader.stats())["failovers"] == 0, list(reader.failovers)

    with_nodes(2, body)
