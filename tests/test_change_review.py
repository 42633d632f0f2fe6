"""Review of the changes since ca783e5: a broadcast's root called again under
one name (`collectives._held_here`), and all-or-nothing eviction with a get
waiting for an offered copy's fate (`Memory.make_room`, `Directory._on_Evict`).
Each test fails on the code as it is, for the reason its docstring gives."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from in_process import ThreadedDirectory, run_nodes

import hoplite_gpu as hg
from hoplite_gpu import collectives

TOKEN = "change-review-token"
MiB = 1 << 20


def _Directory(port: int = 0) -> ThreadedDirectory:
    return ThreadedDirectory(TOKEN, port)


@pytest.mark.timeout(60)
def test_a_broadcast_root_called_twice_in_a_row_returns_the_first_calls_value():
    """docs/api.md "Collectives": "a second call under the same name returns the
    first call's objects, on every rank (a broadcast's root included)".
    `collectives._held_here` decides that from the node's store, but a small
    root value goes through a direct put, whose copy the thread only hands
    to the loop (`DirectCalls._keep` -> `Node.keep_inline`, queued with
    call_soon_threadsafe). A root that calls again at once, before the loop
    has run that (a busy loop; with an idle one it already loses the race
    about 19 times in 20, since the caller's thread keeps the GIL), finds
    nothing held, puts again and returns its NEW argument, while every other
    rank gets the first call's bytes: the two ranks of one broadcast
    silently return different arrays."""
    directory = _Directory()
    try:
        hg.init(directory.address, token=TOKEN, timeout_s=5)
        rt = hg.runtime()
        rt._loop.call_soon_threadsafe(time.sleep, 0.5)  # the node's loop is busy a moment
        first = collectives.broadcast(np.arange(4), name="review-twice", rank=0, size=2,
                                      timeout=5)
        again = collectives.broadcast(np.arange(4) + 100, name="review-twice", rank=0, size=2,
                                      timeout=5)
        other = collectives.broadcast(None, name="review-twice", rank=1, size=2, timeout=5)
        np.testing.assert_array_equal(first, np.arange(4))
        np.testing.assert_array_equal(other, np.arange(4))
        assert np.array_equal(again, other), (
            f"the root's second call returned {again}, the other rank got {other}: one "
            "broadcast, two different values")
    finally:
        hg.shutdown()
        directory.close()


def test_two_gets_making_room_at_once_both_get_it_when_enough_copies_may_go():
    """docs/guide-memory.md: a get past HOPLITE_STORE_BYTES evicts pulled copies
    held elsewhere, and fails with StoreFull only when it cannot make room.
    A node with a 4 MiB limit holds two pulled 2 MiB copies (a, b), both also
    on their origin; two gets (c, d, 2 MiB each) run at once, e.g. an async
    actor gathering two `get_async`. Both offer [a, b] (`Memory.make_room`
    offers every candidate, and skips none already offered by the other call:
    `_offered` knows them). The directory frees a for the first; for the
    second it counts a again, although this node no longer holds it
    (`Directory._may_evict` says yes to a copy whose node is no holder), so
    `need` is met by a alone and b is kept. The node frees nothing for that
    answer (a is gone already), tried both, and the second get fails with
    StoreFull although evicting b would have made room for it."""

    async def body(directory, origin, reader):
        a, b, c, d = (hg.ObjectID.from_name(f"review-room-{n}") for n in "abcd")
        for i, oid in enumerate((a, b, c, d)):
            await origin.put(np.full(2 * MiB, i + 1, np.uint8), oid)
        await reader.fetch(a, 10)
        await reader.fetch(b, 10)  # 4 MiB held of 4: each new get must evict one copy
        got = await asyncio.gather(reader.get(c, 5, "numpy"), reader.get(d, 5, "numpy"),
                                   return_exceptions=True)
        failed = [g for g in got if isinstance(g, BaseException)]
        assert not failed, (
            f"a get failed with {failed[0]!r}, though b (a pulled copy its origin also "
            f"holds) could have been evicted; store holds {reader.store.held // MiB} MiB")
        assert [int(g[0]) for g in got] == [3, 4]

    config = hg.Config(shared_memory=False, chunk_size=MiB, timeout_s=10.0)
    run_nodes([config, config.replace(store_bytes=4 * MiB)], body, bound=30)


def test_an_inline_object_a_get_just_pulled_is_not_evicted_under_its_result():
    """docs/guide-memory.md: "The node offers only copies that no `get` result of
    this process still views" (docs/fault-tolerance.md: "a copy a `get`
    result still views is kept"). A node with a 100 KiB limit holds the
    result of a get of z1 (60 KiB, inline) and gets z2 (60 KiB, inline):
    `Pulls.store_inline` goes over the limit and starts `_trim` in the
    background, which runs before the get's task resumes and offers z2 (z1
    is viewed). `fetch` waits for an offered copy's fate only when it finds
    the copy in the store, not for the copy its pull just returned, so the
    get hands out a view of z2 and the directory's answer then evicts it. The
    user's array outlives the store's copy: `held_bytes` no longer counts
    it, and the next get of z2 pulls a second copy, so the process holds
    more than HOPLITE_STORE_BYTES while its stats say it does not."""
    KiB = 1 << 10

    async def body(directory, origin, reader):
        z1, z2 = (hg.ObjectID.from_name(f"review-inline-{n}") for n in "12")
        await origin.put(np.full(60 * KiB, 1, np.uint8), z1)
        await origin.put(np.full(60 * KiB, 2, np.uint8), z2)
        first = await reader.get(z1, 5, "numpy")
        second = await reader.get(z2, 5, "numpy")
        await asyncio.sleep(0.3)  # the background eviction's answer is in
        assert int(first[0]) == 1 and int(second[0]) == 2
        held = reader.store.get(z2)
        assert held is not None and np.shares_memory(held.buffer, second), (
            f"z2 was evicted ({reader.evicted} copies evicted) while the get's result "
            f"viewed it; the store counts {reader.store.held // KiB} KiB, the process "
            f"holds {(first.nbytes + second.nbytes) // KiB} KiB in get results")

    config = hg.Config(shared_memory=False, timeout_s=10.0)
    run_nodes([config, config.replace(store_bytes=100 * (1 << 10))], body, bound=30)
