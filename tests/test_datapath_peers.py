"""The data path (transfer.py, shm.py) against a data peer that misbehaves.

Each test drives `fetch_range` / `map_object` against a hand-written peer
that misbehaves in one precise way, or a real `DataServer`, and bounds
every wait with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

import msgpack
import numpy as np
import pytest

from hoplite_gpu.auth import new_token, server_handshake
from hoplite_gpu.config import Config
from hoplite_gpu.errors import HopliteError
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.node import shm, transfer
from hoplite_gpu.node.store import ChunkStore
from hoplite_gpu.protocol import FRAME, FRAME_DATA, FRAME_ERROR, recv_msg
from hoplite_gpu.transports import get_backend, local
from hoplite_gpu.values import Layout

MiB = 1 << 20
#: every test's hard bound: a hang fails the test instead of stalling the run
BOUND = 5.0
STALL = 0.5


def layout(n: int) -> Layout:
    return Layout("bytes", "uint8", (n,), n)


def config(**overrides) -> Config:
    base = dict(timeout_s=2.0, stall_timeout_s=STALL, connect_timeout_s=2.0, chunk_size=MiB)
    base.update(overrides)
    return Config.from_env({}, **base)


@contextlib.asynccontextmanager
async def fake_peer(token: str, answer):
    """A TCP data peer that runs the real handshake, reads one pull request and
    then lets `answer(stream, req)` reply as it likes."""
    async def handler(stream):
        with contextlib.suppress(HopliteError, asyncio.CancelledError):
            await server_handshake(stream, token, BOUND)
            req = await recv_msg(stream)
            await answer(stream, req)
            await asyncio.sleep(BOUND * 2)  # hold the connection open, send nothing more

    listener = await get_backend("tcp").listen("127.0.0.1", 0, handler)
    try:
        yield listener.address
    finally:
        await listener.close()


@contextlib.asynccontextmanager
async def fake_local_peer(token: str, answer):
    """As `fake_peer`, but on the same-host Unix socket (the shared-memory path)."""
    address = f"tcp://127.0.0.1:{40000 + os.getpid() % 20000}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(local.socket_name(address))
    sock.listen(8)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    tasks = []

    async def handler(conn):
        stream = local.LocalStream(conn, "fake")
        try:
            with contextlib.suppress(HopliteError, asyncio.CancelledError):
                await server_handshake(stream, token, BOUND)
                req = await recv_msg(stream)
                await answer(stream, req)
                await asyncio.sleep(BOUND * 2)
        finally:
            await stream.close()

    async def accept():
        while True:
            conn, _ = await loop.sock_accept(sock)
            tasks.append(asyncio.create_task(handler(conn)))

    acceptor = asyncio.create_task(accept())
    try:
        yield address
    finally:
        acceptor.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(acceptor, *tasks, return_exceptions=True)
        sock.close()


async def pull(address: str, token: str, cfg: Config, size: int, store: ChunkStore | None = None):
    """fetch_range of a fresh object of `size` bytes from `address`; returns the object."""
    store = store or ChunkStore(64 * MiB, shared=cfg.shared_memory)
    obj = store.create(ObjectID.random(), layout(size))
    pool = transfer.PeerPool(token, cfg)
    try:
        await transfer.fetch_range(pool, address, obj, size, cfg, lambda pos: None)
    finally:
        await pool.close()
    return obj


# -- error frames that are not well-formed -----------------------------------------------------


@pytest.mark.parametrize("body", [
    msgpack.packb([1, 2, 3]),                       # a body that is not a map
    msgpack.packb("ObjectNotFound"),                # a bare string
    b"\xc1\xc1\xc1",                                 # undecodable msgpack
    msgpack.packb({"error": "x"}) + b"\x01",       # trailing bytes (ExtraData)
], ids=["list", "str", "undecodable", "extra-data"])
def test_a_malformed_error_frame_is_a_hoplite_error(body):
    """A peer's error frame whose body is not a msgpack map must fail the pull
    with a HopliteError (ProtocolError / PeerLost), so the node fails over;
    a raw AttributeError / msgpack exception escapes every `except` that
    decides about failover."""
    token = new_token()

    async def answer(stream, req):
        await stream.send(FRAME.pack(FRAME_ERROR, len(body)), body)

    async def main():
        async with asyncio.timeout(BOUND):
            async with fake_peer(token, answer) as address:
                await pull(address, token, config(shared_memory=False), 4096)

    with pytest.raises(HopliteError):
        asyncio.run(main())


# -- a peer that stalls inside an error frame (shared-memory path) -----------------------------


def test_a_same_host_peer_stalling_inside_an_error_frame_trips_the_stall_timeout():
    """On the shared-memory path (mode F) the header of each frame has a stall
    deadline, but the body of an error frame is read with none: a sender that
    stops after an error frame's header hangs the pull for good."""
    token = new_token()
    size = 2 * MiB
    owner = shm.shared_buffer(size)
    assert owner is not None

    async def answer(stream, req):
        assert req.get("shm")
        await shm.send_mode(stream, b"F", shm.shared_map(owner).fd, BOUND)
        await stream.send(FRAME.pack(FRAME_DATA, MiB))  # first half ready
        await stream.send(FRAME.pack(FRAME_ERROR, 100))  # then an error frame's head, and nothing

    async def main():
        async with fake_local_peer(token, answer) as address:
            try:
                async with asyncio.timeout(STALL * 6):
                    await pull(address, token, config(), size)
            except HopliteError:
                return "failed over"
            except TimeoutError:
                return "hung"
            return "completed"

    assert asyncio.run(main()) == "failed over"


# -- a puller that stops reading while the object is deleted -----------------------------------


def test_a_deleted_object_is_not_kept_sending_to_a_puller_that_stopped_reading():
    """docs/fault-tolerance.md: a puller that does not read has its connection
    cut after a second, and "a data server stops sending any object that left
    its store (dropped or deleted) the same way". Only `reclaim` (lent inputs)
    calls `DataServer.release`; after a plain delete the serve stays blocked in
    its send for as long as the peer does not read: no deadline, and the
    deleted object's buffer stays referenced by the serve's memoryview."""
    import hoplite_gpu as hg
    from hoplite_gpu.auth import client_handshake
    from hoplite_gpu.directory.server import DirectoryServer
    from hoplite_gpu.node.node import Node
    from hoplite_gpu.protocol import send_msg

    async def main():
        directory = DirectoryServer("tok")
        address = await directory.start()
        origin = Node(hg.Config(shared_memory=False, chunk_size=MiB, timeout_s=10,
                                stall_timeout_s=1.0), "tok", address)
        stream = None
        try:
            await origin.start()
            oid = hg.ObjectID.random()
            size = 64 * MiB  # far more than the socket buffers hold
            await origin.put(np.ones(size, np.uint8), oid)
            stream = await get_backend("tcp").connect(origin.server.address, 2)
            await client_handshake(stream, "tok", 2)
            await send_msg(stream, {"op": "pull", "oid": oid.binary, "offset": 0, "end": size})
            # ... and never read: the serve blocks once the socket buffers are full
            for _ in range(100):
                await asyncio.sleep(0.02)
                if origin.server._serving.get(oid):
                    break
            assert origin.server._serving.get(oid), "the pull is being served"
            await asyncio.sleep(0.5)  # the socket buffers fill: the serve blocks in a send
            await origin.delete(oid)
            await asyncio.sleep(2.5)  # well past "cut after a second"
            still = bool(origin.server._serving.get(oid))  # still blocked sending it
        finally:
            if stream is not None:
                await stream.close()
            await origin.close()
            await directory.close()
        return still

    assert asyncio.run(asyncio.wait_for(main(), 30)) is False


# -- an object that appears on the server after the puller asked -------------------------------


@pytest.mark.parametrize("shared", [False, True], ids=["tcp", "same-host"])
def test_a_pull_waits_as_long_as_the_server_waits_for_the_object_to_appear(shared):
    """The server waits up to `timeout_s` for an object that is not in its
    store yet ("a reduce parent may ask before our own step has created its
    output", transfer.py `_serve_pull`), but sends no keepalive (and, on the
    same-host socket, not even the mode byte) meanwhile, so the puller's
    stall timeout fires first: an object that appears after `stall_timeout_s`
    but well within `timeout_s` fails the pull with Timeout."""
    cfg = config(shared_memory=shared, timeout_s=4.0)
    assert asyncio.run(_pull_made_late(shared, cfg, cfg, "object")) is True


@pytest.mark.parametrize("shared", [False, True], ids=["tcp", "same-host"])
@pytest.mark.parametrize("late", ["object", "bytes"])
def test_a_server_with_a_longer_stall_timeout_keeps_a_quicker_puller_waiting(shared, late):
    """Nodes need not share one stall timeout. A server configured with 6 s
    used to send its keepalives every 2 s (a third of its own), so a puller
    with 0.5 s took the healthy server for stalled and gave up on an object
    (or its bytes) that came 1.5 s later. The pull request now says the
    puller's stall timeout, and the server beats within it."""
    puller_cfg = config(shared_memory=shared, timeout_s=4.0)
    server_cfg = config(shared_memory=shared, timeout_s=4.0, stall_timeout_s=6.0)
    assert asyncio.run(_pull_made_late(shared, server_cfg, puller_cfg, late)) is True


async def _pull_made_late(shared: bool, server_cfg: Config, puller_cfg: Config,
                          late: str) -> bool:
    """Pull a 2 MiB object from a real DataServer whose object (`late` =
    "object") or whose bytes ("bytes") come 1.5 stall timeouts after the
    puller asked; whether every byte arrived."""
    token = new_token()
    size = 2 * MiB
    store = ChunkStore(64 * MiB, shared=shared)
    server = transfer.DataServer(store, token, server_cfg)
    await server.start()
    if shared:
        await server.listen_local(server.address)
    oid = ObjectID.random()
    obj = store.create(oid, layout(size)) if late == "bytes" else None

    async def fill_late():
        await asyncio.sleep(STALL * 3)  # late, but well within timeout_s
        made = obj if obj is not None else store.create(oid, layout(size))
        made.buffer[:] = 7
        made.advance(size)

    maker = asyncio.create_task(fill_late())
    mine = ChunkStore(64 * MiB, shared=shared).create(oid, layout(size))
    pool = transfer.PeerPool(token, puller_cfg)
    try:
        async with asyncio.timeout(BOUND):
            await transfer.fetch_range(pool, server.address, mine, size, puller_cfg,
                                       lambda pos: None)
        return bool((mine.buffer == 7).all())
    finally:
        await maker
        await pool.close()
        await server.close()
