"""Review of the store limit (`store_bytes`) and eviction: what a memory-limited
process sees when a call cannot get room, or reads a copy while it is being
evicted."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from in_process import eventually, run_nodes

import hoplite_gpu as hg
from hoplite_gpu import messages

MiB = 1 << 20


def test_a_get_that_cannot_get_room_evicts_nothing_when_the_directory_keeps_a_copy():
    """docs/guide-memory.md: a call that cannot make room "fails with StoreFull ...
    and changes nothing"; `Memory.make_room`: "Nothing is evicted for a call
    that cannot get room". The node only checks that all its candidates
    together would do, then offers them; the directory frees the ones it may
    (a) and keeps the others (b: its origin is gone, this is the only copy).
    The get still fails with StoreFull, but a is gone from the node: the user
    loses a cached copy for a call that failed anyway, and the next get of it
    pulls it over the network again."""

    async def body(directory, origin, origin2, reader):
        a, b, c = (hg.ObjectID.from_name(f"review-keep-{n}") for n in "abc")
        await origin.put(np.full(2 * MiB, 1, np.uint8), a)
        await origin2.put(np.full(2 * MiB, 2, np.uint8), b)
        await origin.put(np.full(5 * MiB, 3, np.uint8), c)
        await reader.fetch(a, 10)
        await reader.fetch(b, 10)  # 4 MiB held of 6: c needs 3 MiB more, a and b together 4
        await origin2.close()  # b's only other copy goes: the directory keeps the reader's
        assert await eventually(lambda: origin2.node_id not in directory.state.nodes)
        with pytest.raises(hg.StoreFull):
            await reader.get(c, 10, "numpy")
        # the failed get changed nothing: a is still here, and nothing was evicted
        assert reader.store.get(a) is not None, "a was evicted by a get that failed anyway"
        assert reader.evicted == 0

    config = hg.Config(shared_memory=False, chunk_size=MiB, timeout_s=10.0)
    run_nodes([config, config, config.replace(store_bytes=6 * MiB)], body, bound=30)


def test_a_copy_read_while_its_eviction_is_asked_is_kept_or_read_anew():
    """docs/guide-memory.md: "The node offers only copies that no get result of
    this process still views." The refcount check is made when the copy is
    offered, but the copy is freed when the directory's answer comes, without
    looking again. A get of x that returns in between (another thread or
    task of a memory-limited actor reading its cache while a get of z makes
    room) gets a view of x, and then x is dropped from the store anyway: the
    store no longer counts memory the user's array keeps alive, and the next
    get of x pulls a second copy, so the process holds more than
    HOPLITE_STORE_BYTES while `held_bytes` says it does not."""

    async def body(directory, origin, reader):
        x, y, z = (hg.ObjectID.from_name(f"review-viewed-{n}") for n in "xyz")
        for i, oid in enumerate((x, y, z)):
            await origin.put(np.full(2 * MiB, i + 1, np.uint8), oid)
        await reader.fetch(x, 10)  # the oldest: the one a get of z offers
        await reader.fetch(y, 10)
        asking = reader.client.start
        readers: list[asyncio.Task] = []

        def start(msg, rid=None):
            fut = asking(msg, rid)
            if messages.op(msg) == "evict" and not readers:
                # another task reads x from the cache while the eviction is asked
                readers.append(asyncio.ensure_future(reader.get(x, 10, "numpy")))
            return fut

        reader.client.start = start
        try:
            got = await reader.get(z, 10, "numpy")
        finally:
            reader.client.start = asking
        assert int(got[0]) == 3 and readers
        view = await asyncio.wait_for(readers[0], 10)
        assert int(view[0]) == 1
        held = reader.store.get(x)
        # x is viewed: the store still holds (and counts) the copy the user reads
        assert held is not None, "x was evicted while a get result viewed it"
        assert np.shares_memory(held.buffer, view)
        assert reader.store.held <= 5 * MiB

    config = hg.Config(shared_memory=False, chunk_size=MiB, timeout_s=10.0)
    run_nodes([config, config.replace(store_bytes=5 * MiB)], body, bound=30)
