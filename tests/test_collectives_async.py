"""The collectives' asyncio twins: awaited from an event loop of the caller's
own (as in a Ray async actor), several ranks on one loop."""

import asyncio
import time

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu import collectives


@pytest.fixture
def runtime():
    rt = hg.init(timeout_s=20, chunk_size=4096)
    yield rt
    hg.shutdown()


def _values(size, n):
    return [np.random.default_rng(r).standard_normal(n) for r in range(size)]


@pytest.mark.parametrize("n", [100, 30_000])  # inline, and pulled (240 kB)
def test_every_async_collective_gives_what_the_blocking_one_does(runtime, n):
    size = 3
    values = _values(size, n)

    async def ranks(call, name, **kw):
        return await asyncio.gather(*[call(values[r], name=f"{name}-{n}", rank=r, size=size, **kw)
                                      for r in range(size)])

    async def main():
        bcast = await ranks(collectives.broadcast_async, "bcast", root=1)
        reduced = await ranks(collectives.reduce_async, "reduce", root=2, op="max")
        allreduced = await ranks(collectives.allreduce_async, "allreduce")
        gathered = await ranks(collectives.gather_async, "gather")
        allgathered = await ranks(collectives.allgather_async, "allgather")
        return bcast, reduced, allreduced, gathered, allgathered

    bcast, reduced, allreduced, gathered, allgathered = asyncio.run(main())
    assert all(np.array_equal(b, values[1]) for b in bcast)
    assert reduced[:2] == [None, None]
    np.testing.assert_array_equal(reduced[2], np.maximum.reduce(values))
    for got in allreduced:
        np.testing.assert_allclose(got, sum(values))
    assert gathered[1:] == [None, None]
    for got in [gathered[0], *allgathered]:
        assert len(got) == size and all(np.array_equal(g, v) for g, v in zip(got, values, strict=True))

    asyncio.run(collectives.delete_async(f"allreduce-{n}", size=size))
    with pytest.raises(hg.ObjectNotFound):
        hg.object_info(collectives._reduce_ids(f"allreduce-{n}", size, "sum", None)[1])


def test_a_sliced_allreduce_can_be_awaited():
    hg.init(timeout_s=20, chunk_size=4096, allreduce_slicing="auto")
    try:
        values = _values(3, 30_001)

        async def main():
            return await asyncio.gather(*[collectives.allreduce_async(
                values[r], name="sliced-async", rank=r, size=3) for r in range(3)])

        for got in asyncio.run(main()):
            np.testing.assert_allclose(got, sum(values))
            assert not got.flags.writeable
    finally:
        hg.shutdown()


def test_an_async_collective_leaves_the_callers_loop_free(runtime):
    """While one rank waits for the others, its loop runs other work."""
    async def main():
        ticks = 0
        waiting = asyncio.ensure_future(collectives.allreduce_async(
            np.ones(30_000), name="free-loop", rank=0, size=2, timeout=5))
        start = time.monotonic()
        while time.monotonic() - start < 0.5:
            await asyncio.sleep(0.01)
            ticks += 1
        assert not waiting.done()
        other = await collectives.allreduce_async(np.ones(30_000), name="free-loop", rank=1,
                                                  size=2, timeout=5)
        return ticks, await waiting, other

    ticks, first, second = asyncio.run(main())
    assert ticks >= 20
    assert (first == 2).all() and (second == 2).all()


def test_cancelling_an_async_allreduce_gives_its_input_back_at_once(runtime):
    """A cancelled call is given up as a timed-out one is: its lent input is
    reclaimed (nobody can pull the caller's memory afterwards), and the
    cancellation does not wait for the call's timeout."""
    value = np.ones(30_000)  # lent, not copied: large enough not to travel inline
    mine = collectives.input_id("cancelled", 0)

    async def main():
        task = asyncio.ensure_future(collectives.allreduce_async(
            value, name="cancelled", rank=0, size=2, timeout=15))
        for _ in range(200):  # until the input is registered
            await asyncio.sleep(0.01)
            try:
                await hg.object_info_async(mine)
                break
            except hg.ObjectNotFound:
                continue
        start = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - start

    assert asyncio.run(main()) < 3
    with pytest.raises(hg.ObjectNotFound):
        hg.object_info(mine)
    assert not hg.api.runtime().node.is_lent(mine)


def test_async_collectives_check_their_arguments_before_anything_is_sent(runtime):
    async def main():
        with pytest.raises(hg.InvalidArgument, match="rank"):
            await collectives.broadcast_async(np.ones(3), name="bad", rank=2, size=2)
        with pytest.raises(hg.InvalidArgument, match="size"):
            await collectives.allgather_async(np.ones(3), name="bad", rank=0, size=True)
        with pytest.raises(hg.HopliteError):
            await collectives.reduce_async(np.ones(3), name="bad", rank=0, size=1, op="nope")
        with pytest.raises(hg.HopliteError):
            await collectives.delete_async("bad", size=1, op="nope")

    asyncio.run(main())


def test_an_async_collective_times_out_with_the_projects_error(runtime):
    async def main():
        start = time.monotonic()
        with pytest.raises(hg.Timeout):
            await collectives.gather_async(np.ones(10), name="alone", rank=0, size=2,
                                           timeout=0.5)
        return time.monotonic() - start

    assert asyncio.run(main()) < 3


def test_ctrl_c_in_a_blocking_allreduce_returns_only_once_its_input_is_given_back(runtime):
    """The same for the blocking call and KeyboardInterrupt: when it reaches the
    caller, the caller's array is no longer lent to the cluster."""
    import signal
    import threading

    value = np.ones(30_000)
    mine = collectives.input_id("interrupted", 0)
    # Ctrl-C as Python in a terminal takes it (tests started in the background
    # by a shell have SIGINT ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    # (a real signal: a blocked wait is interrupted by one, not by interrupt_main)
    timer = threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident,
                                                       signal.SIGINT))
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            collectives.allreduce(value, name="interrupted", rank=0, size=2, timeout=15)
        assert time.monotonic() - start < 5
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert not hg.api.runtime().node.is_lent(mine)
    with pytest.raises(hg.ObjectNotFound):
        hg.object_info(mine)
