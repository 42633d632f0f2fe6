"""Talking to a directory over a raw TCP stream, as a node's client would,
for tests of its wire handling."""

from __future__ import annotations

import asyncio

from hoplite_gpu.auth import client_handshake
from hoplite_gpu.protocol import recv_msg, send_msg
from hoplite_gpu.transports import get_backend

TOKEN = "tok"


def run(coro_fn, bound: float = 30.0) -> None:
    """Run `coro_fn()` in a fresh event loop, at most `bound` seconds."""
    async def main():
        async with asyncio.timeout(bound):
            await coro_fn()
    asyncio.run(main())


async def authenticated(address: str, token: str = TOKEN):
    """A raw TCP stream to the directory, past the handshake."""
    stream = await get_backend("tcp").connect(address, 5)
    await client_handshake(stream, token, 5)
    return stream


async def registered(address: str, node: str, token: str = TOKEN):
    """A raw stream registered as node `node` (its data address is never dialled)."""
    stream = await authenticated(address, token)
    await send_msg(stream, {"op": "register", "node": node, "address": f"tcp://127.0.0.1:1{len(node)}"})
    async with asyncio.timeout(5):
        reply = await recv_msg(stream)
    assert reply["ok"] is True and reply["node"] == node, reply
    assert set(reply) <= {"ok", "node", "lease_s", "nodes"}, reply  # ("nodes" left out when 0)
    assert reply["lease_s"] > 0 and reply.get("nodes", 0) >= 0
    return stream


async def memory_held_for_unproven_peers(server, scheme: str, announce, peers: int = 3) -> int:
    """Bytes the directory `server` (started here, closed after) holds once
    `peers` connections over `scheme` each read its hello and then
    `await announce(stream)` (e.g. a length that promises a large message
    that never comes), without proving the token."""
    import tracemalloc

    address = await server.start()
    streams = []
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(peers):
            stream = await get_backend(scheme).connect(address, 5)
            streams.append(stream)
            async with asyncio.timeout(5):
                await recv_msg(stream)  # the directory's hello
            await announce(stream)
        await asyncio.sleep(0.5)
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        for s in streams:
            await s.close()
        await server.close()
