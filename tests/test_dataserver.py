"""A node's data server (transfer.py `DataServer`) facing buggy or
hostile peers on loopback: each test talks to a real node's data server over
a raw TCP stream, past the real handshake where it needs to, and bounds
every wait with a deadline."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import transport_checks as tc
from in_process import eventually, run_nodes

import hoplite_gpu as hg
from hoplite_gpu.auth import client_handshake
from hoplite_gpu.protocol import send_msg
from hoplite_gpu.transports import get_backend

KiB, MiB = 1 << 10, 1 << 20
STALL = 1.0


def config(**settings) -> hg.Config:
    base = dict(shared_memory=False, chunk_size=MiB, timeout_s=10.0, stall_timeout_s=STALL)
    base.update(settings)
    return hg.Config(**base)


async def authenticated(address: str, scheme: str = "tcp"):
    """A raw stream to a node's data server, past the handshake."""
    stream = await get_backend(scheme).connect(address, 2)
    await client_handshake(stream, "tok", 2)
    return stream


@pytest.mark.parametrize("scheme", tc.scheme_params())
@pytest.mark.parametrize("bare,offset", [(None, 0), (MiB, 0), (None, 64 * MiB - 12 * KiB)],
                         ids=["servers-size", "asked-size", "small-range"])
def test_a_puller_that_never_reads_pins_the_copy_so_the_node_cannot_evict_it(scheme, bare,
                                                                             offset):
    """A puller asks for a 64 MiB object and then takes no byte (a stopped or
    hung process: its socket stays open). The data server has no deadline on
    its sends (`_stream_range` -> `SendWindow.send` -> `sock_sendall`, no
    timeout): once the socket buffers are full the serve blocks for good,
    long after the puller's own stall timeout (which the request carries)
    has made it give up. The blocked serve keeps a view of the copy's
    buffer, and `ChunkStore.evictable` skips a buffer anyone else views, so
    a node with HOPLITE_STORE_BYTES can never evict that copy: the next get
    that needs room fails with StoreFull although the copy is a pulled one
    its origin also holds. The user sees StoreFull ("could not evict
    enough") on a node that holds nothing but evictable copies, for as long
    as the stuck peer lives. (Now a send that moves nothing for the pull's
    stall timeout closes the stream: `Stream.send_stall_s`; over UCX, whose
    sends report only their end, one that waits that long while no send of
    the connection completes. A view of the copy that the failed send's
    traceback keeps in a reference cycle is freed by the one garbage
    collection `_make_room` runs before it gives up. The small range: a
    12 KiB answer over UCX, which rode inside message heads when answers
    were frames, whose send took no deadline; a head of 8 KiB or more waits
    for the peer like data.)"""

    if offset and scheme == "tcp":
        pytest.skip("12 KiB fits a socket's buffers: over TCP nothing blocks")

    async def body(directory, origin, reader):
        big, small = hg.ObjectID.from_name("review-ds-big"), hg.ObjectID.from_name("review-ds-small")
        await origin.put(np.full(64 * MiB, 1, np.uint8), big)
        await origin.put(np.full(8 * MiB, 2, np.uint8), small)
        await reader.fetch(big, 10)  # a pulled copy: evictable, its origin holds it
        stream = await authenticated(reader.server.address, scheme)
        pull = {"op": "pull", "oid": big.binary, "offset": offset, "end": 64 * MiB,
                "stall": STALL}
        try:
            if bare is not None:  # (the size of the answer's messages)
                pull["bare"] = bare
            await send_msg(stream, pull)
            # ... and never read: the serve blocks once the socket buffers are full
            assert await eventually(lambda: reader.server.serving(big), 2.0), "not served"
            await asyncio.sleep(3 * STALL)  # the puller would have given up long ago
            try:
                got = await reader.get(small, 5, "numpy")
            except hg.StoreFull as exc:
                raise AssertionError(
                    f"get failed with StoreFull: the copy a stuck peer was being sent "
                    f"could not be evicted (its serve still runs: "
                    f"{reader.server.serving(big)}): {exc}") from None
            assert int(got[0]) == 2
        finally:
            await stream.close()

    run_nodes([config(transport=scheme), config(transport=scheme, store_bytes=70 * MiB)],
              body, bound=30)
