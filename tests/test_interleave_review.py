"""Review of interleaved workloads on one cluster: ids reused after delete,
puts of one id from two nodes, nodes leaving while others pull from them,
and a put/delete loop of the kind a learner or a parameter server runs."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
import weakref

import numpy as np
from in_process import eventually, local_mode, run_nodes

import hoplite_gpu as hg

MiB = 1 << 20


def test_a_get_never_returns_a_mix_of_two_puts_of_one_id():
    """Two nodes put the same id with the same layout and different bytes
    (e.g. a retried task, or two replicas that each derive the id by name,
    as the README suggests). The directory accepts both puts silently (no
    `ObjectExists`: only the layout is compared) and counts both nodes as
    origins. A reader pulling from one of them fails over to the other when
    that node leaves (clean `shutdown`), and resumes at the byte it reached:
    its `get` returns an array whose first bytes are the first put's and the
    rest the second put's, a value nobody put. Either the second put must be
    refused with a clear error, or a get must return one put's value whole.
    (Now a put carries a fingerprint of its bytes, and one that differs from
    the first put's is refused; the same bytes again are one more copy.)"""

    async def body(directory, a, b, reader):
        oid = hg.ObjectID.from_name("review-interleave-two-putters")
        n = 64 * MiB
        await a.put(np.full(n, 1, np.uint8), oid)
        try:
            await b.put(np.full(n, 2, np.uint8), oid)
        except hg.ObjectExists as exc:
            assert "other bytes" in str(exc), exc  # refused, clearly: nothing can mix
            assert b.store.get(oid) is None  # and the refused put left nothing behind
            await reader.put(np.full(n, 1, np.uint8), oid)  # the same bytes: one more copy
            assert int((await b.get(oid, 10, "numpy"))[-1]) == 1
            return
        entry = directory.state.objects[oid.binary]
        assert await eventually(lambda: all(h.complete for h in entry.holders.values()), 5)
        got = asyncio.ensure_future(reader.get(oid, 15, "numpy"))
        # the reader has its first bytes: the node it pulls from leaves
        assert await eventually(lambda: reader.store.get(oid) is not None
                                and reader.store.get(oid).ready > 0, 5)
        holder = entry.holders.get(reader.node_id)
        sender = {a.node_id: a, b.node_id: b}[holder.upstream]
        await sender.close()
        value = await asyncio.wait_for(got, 15)
        fills, counts = np.unique(value, return_counts=True)
        assert len(fills) == 1, (
            f"the get returned a mix of both puts: {dict(zip(fills.tolist(), counts.tolist(), strict=True))} "
            "(bytes of value: count)")

    config = hg.Config(shared_memory=False, chunk_size=256 * 1024, timeout_s=10)
    run_nodes([config] * 3, body, bound=40)


def test_a_put_and_delete_loop_of_non_contiguous_arrays_keeps_its_memory_flat():
    """A learner that puts a transposed or strided view of its weights each
    step (`w.T`, `w[:, ::2]`) and deletes the previous step's object keeps
    the contiguous copy of every value it put: `values._copied`, which makes
    that copy, sits under a `functools.lru_cache` (the decorator of
    `_numpy_layout`, left above `_copied` when `_copied` was inserted). The
    cache keys on the fresh lambda (or bound method) of each call, so it
    never hits, and holds the last 256 copies: here 20 puts of a 4 MiB view
    leave 80 MiB allocated after `delete` and `gc.collect()` (with 100 MiB
    of weights, 25 GiB after 256 steps). A non-contiguous memoryview's
    exporter, the caller's own buffer, is kept alive too."""
    with local_mode(timeout_s=10):
        oid = hg.ObjectID.from_name("review-interleave-strided-weights")
        weights = np.ones((1024, 2048), np.float32)  # 8 MiB; each step puts a 4 MiB view
        tracemalloc.start()
        try:
            hg.put(weights.T[:, ::2], oid)
            hg.delete(oid)
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(20):
                hg.put(weights.T[:, ::2], oid)
                hg.delete(oid)
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert grown < 16 * MiB, (f"20 put/delete steps of a 4 MiB strided view left "
                                  f"{grown / MiB:.0f} MiB allocated")

        raw = np.zeros(2 * MiB, np.uint8)
        exporter = weakref.ref(raw)
        view = memoryview(raw)[::2]  # not contiguous: put copies it
        hg.put(view, oid)
        hg.delete(oid)
        del view, raw
        gc.collect()
        assert exporter() is None, ("the caller's buffer behind a non-contiguous memoryview "
                                    "it put stays alive after the object was deleted and "
                                    "every reference dropped")
