"""Puts of one id with other bytes: from two nodes while a reader pulls (a
get never returns a mix of two puts), and after a directory restart (the
fingerprint of the first put is still enforced)."""

from __future__ import annotations

import asyncio

import numpy as np
from in_process import eventually, run_nodes

import hoplite_gpu as hg
from hoplite_gpu.config import Config
from hoplite_gpu.ids import ObjectID

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


def test_a_put_of_other_bytes_is_refused_after_a_directory_restart_too():
    """a404ac1 refuses a second put of an id with other bytes (docs/api.md: "with
    ... other bytes it raises ObjectExists"), because a reader failing over
    between the two copies resumes mid-object and returns a mix. The
    fingerprint lives only in the directory's entry, taken from the first
    `put`. After a directory restart the entry is rebuilt from the nodes'
    `complete` announcements, which carry none (`Entry.fingerprint` stays
    None), so the next put of the id with other bytes is accepted as one
    more origin: the mix a404ac1 fixed comes back after any restart."""
    from hoplite_gpu.directory.server import DirectoryServer
    from hoplite_gpu.node.node import Node

    config = Config(shared_memory=False, chunk_size=256 * 1024, connect_timeout_s=2.0,
                    timeout_s=10.0)
    oid = ObjectID.from_name("review-scheduling-print-after-restart")

    async def main() -> None:
        first = DirectoryServer("tok")
        address = await first.start()
        port = int(address.rpartition(":")[2])
        a, b = Node(config, "tok", address), Node(config, "tok", address)
        second = None
        try:
            await a.start()
            await b.start()
            await a.put(np.full(8 * MiB, 1, np.uint8), oid)
            await first.close()
            second = DirectoryServer("tok", port=port)
            await second.start()
            assert await eventually(lambda: oid.binary in second.state.objects
                                and {a.node_id, b.node_id} <= set(second.state.nodes), 8.0), \
                "the nodes did not come back to the restarted directory"
            try:
                await b.put(np.full(8 * MiB, 2, np.uint8), oid)
            except hg.ObjectExists:
                return  # refused, as before the restart
            origins = [n for n, h in second.state.objects[oid.binary].holders.items() if h.origin]
            raise AssertionError(
                f"after a directory restart a put of other bytes under an existing id was "
                f"accepted: origins {origins} now hold different bytes, and a reader failing "
                f"over between them returns a mix")
        finally:
            await b.close()
            await a.close()
            if second is not None:
                await second.close()
            await first.close()

    asyncio.run(asyncio.wait_for(main(), 40))
