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
    assert reply == {"ok": True, "node": node, "lease_s": reply.get("lease_s")}
    assert reply["lease_s"] > 0
    return stream
