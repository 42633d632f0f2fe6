"""The chunk store's watermark and its buffer reuse."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu import messages
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.node.pool import BufferPool, host_buffer
from hoplite_gpu.node.store import ChunkStore
from hoplite_gpu.values import Layout

MiB = 1 << 20


def layout(n: int) -> Layout:
    return Layout("bytes", "uint8", (n,), n)


def test_waiters_wake_at_their_watermark():
    async def main():
        store = ChunkStore()
        obj = store.create(ObjectID.random(), layout(100))
        order = []

        async def wait(n):
            await obj.wait_ready(n, 5)
            order.append(n)

        tasks = [asyncio.create_task(wait(n)) for n in (80, 10, 50)]
        await asyncio.sleep(0)
        for step in (20, 60, 100):
            obj.advance(step)
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(main()) == [10, 50, 80]


def test_wait_ready_times_out_and_fail_wakes_everyone():
    async def main():
        store = ChunkStore()
        obj = store.create(ObjectID.random(), layout(100))
        with pytest.raises(hg.Timeout, match="only 0 of 100"):
            await obj.wait_ready(50, 0.05)
        waiter = asyncio.create_task(obj.wait_ready(100, 5))
        await asyncio.sleep(0)
        store.remove(obj.oid, hg.ObjectNotFound("gone"))
        with pytest.raises(hg.ObjectNotFound, match="gone"):
            await waiter

    asyncio.run(main())


def test_a_wait_for_an_object_made_and_removed_before_it_ran_is_not_found():
    async def main():
        store = ChunkStore()
        oid = ObjectID.random()
        waiter = asyncio.create_task(store.wait_for(oid, 5))
        await asyncio.sleep(0)
        store.create(oid, layout(100))
        store.remove(oid)  # in the same loop turn: the waiter wakes to nothing
        with pytest.raises(hg.ObjectNotFound, match="not held by this node"):
            await waiter

    asyncio.run(main())


def test_pool_reuses_only_unreferenced_buffers():
    pool = BufferPool(64 * MiB)
    buf = pool.acquire(2 * MiB)
    assert pool.release(buf)
    assert pool.acquire(2 * MiB) is buf
    view = buf[:16]
    assert not pool.release(buf), "a buffer a view still refers to must not be reused"
    del view
    assert not pool.release(np.empty(1024, dtype=np.uint8))  # too small to pool


def test_large_buffers_are_plain_maps_and_views_of_them_block_reuse():
    import mmap

    buf = host_buffer(2 * MiB)
    assert isinstance(buf.base, memoryview) and isinstance(buf.base.obj, mmap.mmap)
    assert buf.flags.writeable and buf.nbytes == 2 * MiB
    buf[:] = 3  # the memory is really there
    assert host_buffer(1000).base is None  # small ones stay ordinary arrays
    pool = BufferPool(64 * MiB)
    for make in (lambda b: b[1:], lambda b: b[:8].view(np.int32), memoryview):
        view = make(buf)
        assert not pool.release(buf), f"reused under a live {type(view).__name__}"
        del view
        assert pool.release(buf) and pool.acquire(2 * MiB) is buf
    part = np.frombuffer(mmap.mmap(-1, 4 * MiB), dtype=np.uint8)[:2 * MiB]
    assert not pool.release(part), "part of a larger map is not a buffer of its own"
    assert pool.release(buf) and pool.acquire(2 * MiB) is buf


def test_lent_buffers_come_back_once_nobody_refers_to_them():
    pool = BufferPool(8 * MiB)
    buf = pool.acquire(2 * MiB)
    pool.lend(buf)
    result = buf.view(np.float32).reshape(4, -1)  # what a caller gets
    del buf
    part = result[1:]
    del result
    assert pool.acquire(2 * MiB) is not part.base, "reused under a live view"
    first = id(part.base)
    del part
    assert id(pool.acquire(2 * MiB)) == first  # dropped: taken back
    assert pool.pooled == 0 and pool.hits == 1


def test_reusable_says_whether_acquire_would_reuse_a_free_or_lent_buffer():
    """Regression: the training-loop test waited for `pooled` (free buffers
    only) before each step, so whenever the buffer to reuse was a lent one
    let go it waited out its whole 15 s; `reusable` counts both."""
    pool = BufferPool(8 * MiB)
    assert not pool.reusable(2 * MiB)
    buf = pool.acquire(2 * MiB)
    pool.lend(buf)
    view = buf[1:]
    del buf
    assert not pool.reusable(2 * MiB), "a lent buffer under a live view"
    del view
    assert pool.reusable(2 * MiB) and not pool.reusable(4 * MiB)
    again = pool.acquire(2 * MiB)
    assert pool.reclaimed == 1 and not pool.reusable(2 * MiB)
    assert pool.release(again) and pool.reusable(2 * MiB)


def test_lent_buffers_make_room_oldest_first():
    pool = BufferPool(4 * MiB)
    held = [pool.acquire(2 * MiB) for _ in range(3)]
    for i in range(3):
        pool.lend(held[i])  # the third forgets the first: the budget holds two
    assert (pool.lent, pool.pooled) == (4 * MiB, 0)
    assert pool.release(pool.acquire(2 * MiB))  # room made for a free one: the second goes
    assert (pool.lent, pool.pooled) == (2 * MiB, 2 * MiB) and pool.hits == 0
    third = id(held[2])
    del held
    assert id(pool.acquire(2 * MiB)) != third  # the free one first
    assert id(pool.acquire(2 * MiB)) == third and pool.hits == 2
    pool.lend(np.empty(4 * MiB, dtype=np.uint8)[:2 * MiB])  # not a buffer of its own: ignored
    assert pool.pooled == pool.lent == 0


def test_a_buffer_still_read_when_its_object_goes_is_reused_once_let_go():
    """A dropped object's buffer that a send under way still referred to was
    let go for good: the pool refused it and never saw it again, so the next
    object of that size made fresh memory (a training loop under load reused
    fewer buffers than it should). It is tracked as lent and taken back once
    the reader lets go; reused only then, and tracked once."""
    store = ChunkStore(pool_bytes=16 * MiB)
    obj = store.create(ObjectID.random(), layout(2 * MiB))
    sending = memoryview(obj.buffer)  # (a send's view)
    store.remove(obj.oid)
    assert (store.pool.pooled, store.pool.lent) == (0, 2 * MiB)
    assert store.pool.acquire(2 * MiB) is not sending.obj, "reused under a live view"
    base = sending.obj
    assert not store.pool.release(base)  # (still read: tracked once, not freed)
    assert store.pool.lent == 2 * MiB
    first, sending, base = id(sending.obj), None, None
    assert id(store.pool.acquire(2 * MiB)) == first and store.pool.reclaimed == 1


def test_pool_respects_its_budget():
    pool = BufferPool(3 * MiB)
    a, b = pool.acquire(2 * MiB), pool.acquire(2 * MiB)
    assert pool.release(a)
    assert not pool.release(b)


def test_user_views_survive_delete_and_reuse():
    hg.init(pool_bytes=256 * MiB)
    try:
        first = hg.put(np.full(4 * MiB, 7, dtype=np.uint8))
        kept = hg.get(first)
        hg.delete(first)
        second = hg.put(np.full(4 * MiB, 9, dtype=np.uint8))
        assert int(kept.min()) == int(kept.max()) == 7  # not overwritten by the new object
        assert int(hg.get(second)[0]) == 9
    finally:
        hg.shutdown()


def test_a_reduce_leaf_shares_its_input_and_follows_its_watermark():
    """A leaf's partial result is its input: same buffer, no copy, and readable
    only as far as the input (a put still copying it) is."""
    from hoplite_gpu.config import Config
    from hoplite_gpu.node.reducer import run_step
    from hoplite_gpu.node.transfer import PeerPool

    async def main():
        store = ChunkStore(64 * MiB)
        lay = Layout("numpy", "<f4", (4 * MiB,), 16 * MiB)
        own = store.create(ObjectID.random(), lay)
        own.buffer[:] = 7
        out_id = ObjectID.random()
        step = messages.ReduceStep(layout=lay.to_wire(), input=own.oid.binary,
                                   output=out_id.binary, target=out_id.binary, children=[],
                                   reduce_op="sum", count=0, size=lay.nbytes, tag=b"t")
        task = asyncio.ensure_future(run_step(step, store, PeerPool("tok", Config()), Config(), 5))
        await asyncio.sleep(0.01)
        out = store.get(out_id)
        assert out is not None and out.ready == 0 and not task.done()
        own.advance(5 * MiB)
        await asyncio.sleep(0.01)
        assert out.ready == 5 * MiB  # what the input has, not more
        own.advance(own.size)
        assert await asyncio.wait_for(task, 5) is out
        assert out.complete and out.reduce_tag == b"t"
        assert np.shares_memory(out.buffer, own.buffer)
        # Freeing one of them must not hand the shared buffer to a new object.
        store.remove(out_id)
        assert store.pool.pooled == 0
        store.remove(own.oid)  # the last holder: now it may be reused
        assert store.pool.pooled == 16 * MiB
    asyncio.run(main())


@pytest.mark.parametrize("window", [1, 2], ids=["one-send", "two-sends-in-flight"])
def test_release_stops_every_pull_of_an_object_before_it_returns(window):
    """An object that left the store (a lent input, once its call returned) is
    no longer sent: a pull that is reading stops with an error frame at its
    next frame, one whose peer does not read is cancelled at the deadline, and
    nothing is sent after `release` returns (the memory may be the caller's)."""
    from hoplite_gpu.config import Config
    from hoplite_gpu.node.transfer import DataServer
    from hoplite_gpu.protocol import FRAME, FRAME_ERROR
    from hoplite_gpu.transports import StreamCaps

    class Peer:  # a data connection whose reader takes one message or frame per opening of `gate`
        peer = "test"
        caps = StreamCaps()  # (messages go whole, as over UCX)
        send_window = window  # as a stream that overlaps sends (UCX) says

        def __init__(self):
            self.frames, self.gate = [], asyncio.Event()

        async def send(self, *buffers):
            await self.gate.wait()
            self.gate.clear()
            self.frames.append(FRAME.unpack(bytes(buffers[0]))[0])

        async def send_message(self, *frames):
            await self.gate.wait()
            self.gate.clear()
            self.frames.append("message")

    async def main():
        store = ChunkStore()
        server = DataServer(store, "token", Config(chunk_size=MiB))
        oid = ObjectID.random()
        store.create(oid, layout(8 * MiB)).advance(8 * MiB)
        reading, stuck = Peer(), Peer()
        req = messages.Pull(oid=oid.binary, offset=0, end=8 * MiB)
        pulls = [asyncio.create_task(server._serve_pull(p, req)) for p in (reading, stuck)]
        reading.gate.set()
        await asyncio.sleep(0.01)
        store.remove(oid, hg.ObjectNotFound("the call that lent it returned"))

        async def read():
            while not pulls[0].done():
                reading.gate.set()
                await asyncio.sleep(0.001)

        reader = asyncio.create_task(read())
        await server.release(oid, 0.2)
        assert all(p.done() for p in pulls) and pulls[1].cancelled()
        assert reading.frames[-1] == FRAME_ERROR
        # The messages in flight at most (`window` of them, each let through by a gate opening).
        assert 1 <= reading.frames.count("message") <= 1 + window
        sent = list(stuck.frames)
        stuck.gate.set()
        await asyncio.sleep(0.01)
        assert stuck.frames == sent and not server._serving
        await reader

    asyncio.run(main())


@pytest.mark.parametrize("shared", [False, True])
def test_memory_the_machine_cannot_give_is_a_store_full_error(shared):
    huge = Layout(kind="bytes", dtype="|u1", shape=(1 << 50,), nbytes=1 << 50)  # 1 PiB
    store = ChunkStore(pool_bytes=0, shared=shared)
    with pytest.raises(hg.StoreFull, match="no memory for an object of 1125899906842624 bytes"):
        store.create(ObjectID.random(), huge)
    assert (len(store), store.held) == (0, 0)


def test_the_store_counts_only_memory_it_owns_and_picks_idle_pulled_copies_oldest_first():
    store = ChunkStore(pool_bytes=0)
    layout = Layout(kind="bytes", dtype="|u1", shape=(1000,), nbytes=1000)
    mine, old, new, viewed = (store.create(ObjectID.random(), layout) for _ in range(4))
    lent = store.create(ObjectID.random(), layout, np.zeros(1000, np.uint8), borrowed=True)
    for i, obj in enumerate((mine, old, new, viewed, lent)):
        obj.advance(obj.size)
        obj.used = float(i)
    mine.own = True
    view = viewed.buffer[:10]  # a get result still looking at it
    assert store.held == 4000
    assert store.evictable() == [old, new]
    assert store.evictable(busy={old.oid}) == [new]
    store.remove(old.oid)
    assert store.held == 3000 and view.sum() >= 0
