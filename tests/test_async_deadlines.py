"""Deadlines of the asyncio twins: the weight channel's `publish(timeout=...)`
bounds the whole call (its clean-up included) as coroutines on the runtime's
loop, and a cancelled `broadcast_async` stops reading the caller's array.
Each test fails on the code it was written against; every wait is bounded."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from in_process import channel_object_exists, run_nodes

import hoplite_gpu as hg
from hoplite_gpu import api, collectives, messages
from hoplite_gpu.channel import WeightChannel, _oid
from hoplite_gpu.channel import _exists as channel_exists


def _directory_dies_before(name: str):
    """A node.put that closes the (embedded) directory just before the put of
    version 0's manifest: the publish is then past its claim and its pack."""
    rt = api.runtime()
    real_put = rt.node.put

    async def put(value, oid, *args, **kwargs):
        if oid == _oid(name, 0, "manifest"):
            await rt.directory.close()  # (the node keeps trying to reconnect)
        return await real_put(value, oid, *args, **kwargs)

    return put


@pytest.fixture
def short():
    """Local mode with timeout_s=2 (300 s by default)."""
    rt = hg.init(timeout_s=2)
    try:
        yield rt
    finally:
        hg.shutdown()


# --------------------------------------------- publish's `timeout` bound ---


def test_publish_async_timeout_bounds_the_call_when_the_directory_goes_away(short, monkeypatch):
    """docs/guide-weight-channel.md: "`publish(..., timeout=t)` bounds the whole call". When the
    deadline passes, the failure cleanup (`_publish_steps`' except) deletes
    each array put so far and the claim one after another, each waiting up to
    `timeout_s` for the lost directory (300 s by default), outside the
    deadline; `call_async` has no bound of its own, so publish_async(timeout=1)
    here takes 1 + 2 x 2 s (10 min with the default timeout_s)."""
    monkeypatch.setattr(short.node, "put", _directory_dies_before("gone-a"))
    ch = WeightChannel("gone-a")

    async def main():
        start = time.monotonic()
        with pytest.raises(TimeoutError) as info:  # (wait_for's own, if it is still running)
            await asyncio.wait_for(
                ch.publish_async({"a": np.ones(10), "b": np.ones(10)}, timeout=1), 3.5)
        return time.monotonic() - start, info.value

    elapsed, error = asyncio.run(main())
    assert elapsed < 3.0, f"publish_async(timeout=1) took {elapsed:.1f}s"
    assert isinstance(error, hg.Timeout)


def test_blocking_publish_timeout_is_the_channels_and_on_time_when_the_directory_goes_away(
        short, monkeypatch):
    """The same for the blocking publish: it ends only when `Runtime.call`'s
    grace runs out (or the cleanup ends, 1 + 2 x 2 s here), not at its 1 s,
    and (with timeout_s above 3 s) with "the runtime did not answer within
    6s" instead of the channel's own Timeout."""
    monkeypatch.setattr(short.node, "put", _directory_dies_before("gone-b"))
    ch = WeightChannel("gone-b")
    start = time.monotonic()
    with pytest.raises(hg.Timeout) as info:
        ch.publish({"a": np.ones(10), "b": np.ones(10)}, timeout=1)
    elapsed = time.monotonic() - start
    assert elapsed < 3.0, f"publish(timeout=1) took {elapsed:.1f}s ({info.value})"
    assert "channel 'gone-b'" in str(info.value)


# ------------------------------ state left half-changed by a cut-off call ---


def _late_deletes(node, delay: float, count: int = 1) -> None:
    """The directory takes `delay` s to hear `node`'s first `count` delete
    requests (any that go through `Node._request`, one id or many)."""
    real, seen = node._request, []

    async def request(msg, timeout):
        if messages.op(msg).startswith("delete") and len(seen) < count:
            seen.append(msg)
            await asyncio.sleep(delay)
        return await real(msg, timeout)

    node._request = request  # (an instance attribute: the node's own calls take it)


def test_a_publish_timing_out_while_freeing_an_old_version_does_not_leak_it():
    """`_free_old` pops the old version from `_published` before deleting its
    objects; the whole-call deadline (or a cancelled publish_async) can now
    cut those deletes off, and the old version (kept by the reader that
    fetched it) is then never freed by any later publish: keep=1, head 3,
    version 0 still in the cluster."""
    cfg = hg.Config(shared_memory=False, timeout_s=5)

    async def body(directory, learner, reader):
        ch = WeightChannel("free-cut", keep=1)
        w = {"a": np.zeros(10), "b": np.zeros(10)}
        assert await ch._publish(learner, w, None, 5.0) == 0
        await WeightChannel("free-cut")._fetch(reader, -1, 5.0)  # the reader holds version 0
        _late_deletes(learner, 1.5)
        with pytest.raises(hg.Timeout):
            await ch._publish(learner, w, None, 0.5)  # (the head moves to 1 all the same)
        del learner._request
        assert await ch._publish(learner, w, None, 5.0) == 2
        assert await ch._publish(learner, w, None, 5.0) == 3
        left = [p for p in ("pack/0", "manifest", "claim")
                if await channel_exists(reader, _oid("free-cut", 0, p))]
        assert not left, f"version 0 (keep=1, head 3) still holds {left}"

    run_nodes([cfg, cfg], body, bound=20)


def test_a_restarted_publisher_whose_first_publish_times_out_still_adopts(short, monkeypatch):
    """docs/guide-weight-channel.md: "a restarted publisher frees its predecessor's too". `_adopt`
    sets `_adopted` before it looks; cut off by the publish's deadline (a
    directory slow to answer, or a cancelled publish_async), it never looks
    again, so the predecessor's versions are never freed."""
    node = short.node
    WeightChannel("adopt-cut", keep=1).publish({"w": np.zeros(10)})  # the old learner: v0
    restarted = WeightChannel("adopt-cut", keep=1)
    real_query, calls = node.query, []

    async def slow_query(oid):  # the directory answers the first query late
        calls.append(oid)
        if len(calls) == 1:
            await asyncio.sleep(1.5)
        return await real_query(oid)

    monkeypatch.setattr(node, "query", slow_query)
    with pytest.raises(hg.Timeout):
        restarted.publish({"w": np.ones(10)}, timeout=0.5)
    monkeypatch.setattr(node, "query", real_query)
    v1 = restarted.publish({"w": np.ones(10)})
    v2 = restarted.publish({"w": np.ones(10)})
    assert v2 > v1 > 0
    assert not channel_object_exists("adopt-cut", 0), "the predecessor's version 0 was never freed"


def test_a_publish_whose_deadline_passes_during_its_cleanup_still_deletes_what_it_put(
        short, monkeypatch):
    """docs/guide-weight-channel.md: "A publish that fails part-way (a full store, a deadline)
    deletes what it put". The cleanup runs inside the whole-call deadline
    (`asyncio.timeout` in `_publish`): a put failing near the deadline starts
    it, the deadline cancels its first delete, and the CancelledError (not a
    HopliteError) skips the rest: the other arrays and the claim stay for
    good (no later publish frees a version it never published)."""
    node = short.node
    real_put = node.put

    async def put(value, oid, *args, **kwargs):
        if oid == _oid("cut-clean", 0, "manifest"):
            await asyncio.sleep(0.4)
            raise hg.StoreFull("no room for the manifest")
        return await real_put(value, oid, *args, **kwargs)

    monkeypatch.setattr(node, "put", put)
    _late_deletes(node, 0.2, count=3)
    try:
        with pytest.raises(hg.HopliteError):
            WeightChannel("cut-clean").publish({k: np.ones(10) for k in "abc"}, timeout=0.5)
    finally:
        del node._request
    deadline = time.monotonic() + 2  # (a cleanup left to finish on its own may take a moment)
    left = ["pack/0", "claim"]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if channel_object_exists("cut-clean", 0, p)]
    assert not left, f"the failed publish left {left} of version 0"


# ------------------------------------- the caller's memory after a cancel ---


def test_a_cancelled_broadcast_async_stops_reading_the_callers_array(monkeypatch):
    """docs/api.md: cancelling a twin "gives the call up as its timeout would ...
    before the cancellation completes" (runtime.py: "the caller's memory must
    be its own again when the call has returned"). The root's put is
    shielded (`collectives._finish`) and goes on copying the caller's array
    chunk by chunk after the cancellation has returned (`ended` waits for
    `_joint` only): a caller that then reuses its buffer makes the broadcast
    object (what every receiver gets) a mix of two values."""
    hg.init(timeout_s=20, chunk_size=4096)
    try:
        node = api.runtime().node
        value = np.ones(4_000_000)  # 32 MB: 7813 chunks, a loop iteration each
        oid = hg.ObjectID.from_name("torn/bcast")

        async def main():
            task = asyncio.ensure_future(collectives.broadcast_async(
                value, name="torn", rank=0, size=2, timeout=10))
            deadline, copying = time.monotonic() + 5, False
            while not copying and time.monotonic() < deadline:
                await asyncio.sleep(0.0005)
                obj = node.store.get(oid)
                copying = obj is not None and 0 < obj.ready < obj.size
            assert copying, "(the put's copy was not seen under way)"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            value[:] = 2  # the caller's buffer is its own again: reused

        asyncio.run(main())
        if node.store.get(oid) is not None:  # (the put may also have been undone)
            got = hg.get(oid, timeout=5, array_type="numpy")
            twos = int((got == 2).sum())
            assert twos == 0, f"the broadcast value holds {twos} of {got.size} elements " \
                              "written after the cancellation"
    finally:
        hg.shutdown()
