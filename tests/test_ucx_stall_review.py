"""Review of the UCX send stall deadline (`UCXStream._sent_within`,
set per pull by the data server through `Stream.send_stall_s`) and the one
garbage collection `Node._make_room` runs before it reports StoreFull.
Loopback only; every wait is bounded (`run_nodes`' bound, asyncio.timeout)."""

from __future__ import annotations

import asyncio
import gc
import time

import numpy as np
import pytest
import transport_checks as tc
from in_process import eventually, run_nodes

import hoplite_gpu as hg
from hoplite_gpu.auth import client_handshake
from hoplite_gpu.protocol import send_msg
from hoplite_gpu.transports import get_backend

ucx_only = pytest.mark.parametrize(
    "scheme", [p for p in tc.scheme_params() if p.values[0] == "ucx"])

KiB = 1 << 10
MiB = 1 << 20
STALL = 1.0


def config(**settings) -> hg.Config:
    base = dict(shared_memory=False, chunk_size=MiB, timeout_s=10.0, stall_timeout_s=STALL)
    base.update(settings)
    return hg.Config(**base)


@ucx_only
def test_a_puller_of_a_small_range_that_never_reads_still_pins_the_copy(scheme):
    """A puller over UCX asks for the last 12 KiB of a 64 MiB object (a pull
    resumed near its end; any range, or any `chunk_size`, whose frames carry
    at most INLINE_MAX = 16 KiB) and then takes nothing. Each frame's payload
    then travels *inside* the head, so `UCXStream.send` takes its head-only
    path (`await self._guard("send", self._send(head, _LANE_HEAD))`), which
    never looks at `send_stall_s`: only `_post_then_wait` applies the stall
    deadline. A head of about 8 KiB or more is a rendezvous message in UCX
    (measured here: an 8 KiB inline head to a peer that posts no receive
    never completes), so the serve blocks for as long as the peer lives,
    holding its view of the copy, as with no deadline at all. The node can
    never evict that copy: a get that needs the room fails with StoreFull
    ("could not evict enough"), and docs/fault-tolerance.md's promise that
    over UCX such a send is cut after the pull's stall timeout does not
    hold."""

    async def body(directory, origin, reader):
        big = hg.ObjectID.from_name("ucx-stall-big")
        small = hg.ObjectID.from_name("ucx-stall-small")
        await origin.put(np.full(64 * MiB, 1, np.uint8), big)
        await origin.put(np.full(8 * MiB, 2, np.uint8), small)
        await reader.fetch(big, 10)  # a pulled copy: evictable, its origin holds it
        stream = await get_backend(scheme).connect(reader.server.address, 2)
        try:
            await client_handshake(stream, "tok", 2)
            await send_msg(stream, {"op": "pull", "oid": big.binary, "offset": 64 * MiB - 12 * KiB,
                                    "end": 64 * MiB, "stall": STALL})
            # ... and never read
            assert await eventually(lambda: reader.server.serving(big), 2.0), "not served"
            await asyncio.sleep(3 * STALL)  # the serve's stall deadline is long past
            try:
                got = await reader.get(small, 5, "numpy")
            except hg.StoreFull as exc:
                raise AssertionError(
                    f"get failed with StoreFull: the serve of a 12 KiB range to a peer that "
                    f"reads nothing was not cut after {STALL:g}s (still serving: "
                    f"{reader.server.serving(big)}), so its view pins the copy: {exc}") from None
            assert int(got[0]) == 2
        finally:
            await stream.close()

    run_nodes([config(transport=scheme), config(transport=scheme, store_bytes=70 * MiB)],
              body, bound=30)


def test_inline_puts_over_the_store_limit_do_not_each_run_a_full_collection():
    """Once a node with `store_bytes` holds more than its limit in objects
    it cannot evict (its own inline puts: an inline object is made without
    asking for room), every further inline put (or inline get, via
    `_store_inline`) schedules `_trim`, which calls `_make_room(0, ...)`;
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
