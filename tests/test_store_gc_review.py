"""Review of the one garbage collection `Memory.make_room` runs before it
reports StoreFull (the UCX send stall deadline beside it is checked in
tests/test_dataserver_review.py and the transport conformance suite).
Loopback only; every wait is bounded (`run_nodes`' bound, asyncio.timeout)."""

from __future__ import annotations

import asyncio
import gc
import time

import numpy as np
from in_process import run_nodes

import hoplite_gpu as hg

KiB = 1 << 10
MiB = 1 << 20
STALL = 1.0


def config(**settings) -> hg.Config:
    base = dict(shared_memory=False, chunk_size=MiB, timeout_s=10.0, stall_timeout_s=STALL)
    base.update(settings)
    return hg.Config(**base)


def test_inline_puts_over_the_store_limit_do_not_each_run_a_full_collection():
    """Once a node with `store_bytes` holds more than its limit in objects
    it cannot evict (its own inline puts: an inline object is made without
    asking for room), every further inline put (or inline get, via
    `Pulls.store_inline`) schedules `Memory._trim`, which calls `make_room(0, ...)`;
    that found nothing to evict and then ran `gc.collect()` on
    the node's event loop before giving up, on every call. The put itself
    succeeds, so this is the hot path that must never collect.
    A full collection walks the whole process heap and stalls the loop that
    also serves pulls and heartbeats: measured here, 30 such puts of 60 KiB
    took 2.36 s with a 3-million-object heap in the process, against 0.12 s
    without the limit (about 80 ms of collection per put)."""
    collections: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info.get("generation") == 2:
            collections.append(1)

    async def body(directory, node):
        for i in range(20):  # 1.2 MiB of inline objects: over the 1 MiB limit
            await node.put(np.full(60 * KiB, i, np.uint8), hg.ObjectID.from_name(f"gc-a{i}"))
        await asyncio.sleep(0.1)
        assert node.store.used > node.config.store_bytes, "not over the limit: no test"
        gc.callbacks.append(count)
        try:
            started = time.monotonic()
            for i in range(30):
                await node.put(np.full(60 * KiB, i, np.uint8), hg.ObjectID.from_name(f"gc-b{i}"))
            await asyncio.sleep(0.1)  # (the background trims have run)
            took = time.monotonic() - started
        finally:
            gc.callbacks.remove(count)
        assert len(collections) <= 3, (
            f"30 inline puts that all succeeded ran {len(collections)} full garbage "
            f"collections on the node's loop ({took:.2f}s): `_trim` -> `_make_room(0)` "
            "collects every time the store is over its limit")

    run_nodes([config(store_bytes=MiB)], body, bound=30)
