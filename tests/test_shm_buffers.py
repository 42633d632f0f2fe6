"""Same-host sharing and buffer management (`node/shm.py`, `node/pool.py`,
`node/store.py` and how `node/node.py` uses them): buffers and connections
let go of, each test bounded by a deadline, on in-process nodes."""

from __future__ import annotations

import asyncio
import os

import numpy as np
from in_process import run_nodes

from hoplite_gpu.config import Config
from hoplite_gpu.errors import ObjectExists
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.node.pool import BufferPool

MiB = 1 << 20
BOUND = 20.0


def config(**overrides) -> Config:
    base = dict(shared_memory=True, timeout_s=3.0, stall_timeout_s=0.5, connect_timeout_s=2.0,
                chunk_size=MiB)
    base.update(overrides)
    return Config.from_env({}, **base)


def _links() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # (the listing's own descriptor, closed meanwhile)
    return out


def _memfds() -> int:
    return sum(1 for link in _links() if link.startswith("/memfd:hoplite-gpu"))


def test_a_refused_put_racing_a_get_leaves_no_copy_the_directory_does_not_know():
    # B puts an id that A holds with another layout (refused: ObjectExists)
    # while a get of that id on B is already asking where it is. The refused
    # put's clean-up tells the directory "dropped" after the directory made
    # B a receiver, so B's pulled copy becomes one the directory does not
    # know: a delete misses it, `held_bytes` never returns to 0, and after the
    # id is put again B's get returns the deleted object's bytes.
    async def body(directory, a, b):
        oid = ObjectID.random()
        await a.put(np.full(2 * MiB, 1, np.uint8), oid)
        put, got = await asyncio.gather(b.put(np.full(3 * MiB, 2, np.uint8), oid),
                                         b.get(oid, 3.0, "numpy"), return_exceptions=True)
        assert isinstance(put, ObjectExists)
        assert isinstance(got, np.ndarray) and got[0] == 1
        del got
        await a.delete(oid)
        for _ in range(100):
            if b.store.get(oid) is None:
                break
            await asyncio.sleep(0.01)
        assert b.store.get(oid) is None, "B kept a copy of a deleted object"
        assert b.store.held == 0
        await a.put(np.full(2 * MiB, 9, np.uint8), oid)
        again = await b.get(oid, 3.0, "numpy")
        assert again[0] == 9, "B returned the deleted object's bytes"

    run_nodes([config(), config()], body, bound=BOUND)


def test_closing_a_node_lets_go_of_its_pooled_shared_buffers():
    # Freed buffers the pool keeps for reuse (up to HOPLITE_POOL_BYTES, 1 GiB
    # by default) are memfd mappings, two descriptors each; a closed node
    # reuses nothing, yet keeps them (after `shutdown()` until the cyclic
    # garbage collector happens to free the runtime).
    before = _memfds()
    kept = []

    async def body(directory, a):
        kept.append(a)
        for _ in range(2):
            oid = ObjectID.random()
            await a.put(np.ones(2 * MiB, np.uint8), oid)
            await a.delete(oid)
        assert a.store.pool.pooled == 2 * MiB  # (the second put reused the first buffer)

    run_nodes([config()], body, bound=BOUND)
    assert kept  # (the closed node is still referenced here)
    assert _memfds() <= before, "a closed node still holds its pooled memfd buffers"


def test_lent_buffers_stay_within_the_pool_budget():
    # `lend` documents that lent buffers count against the budget as kept
    # ones do, but it only forgets older lent buffers, never free ones: with
    # the budget full of free buffers the pool keeps budget + the lent one.
    pool = BufferPool(4 * MiB, shared=True)
    a, b = pool.acquire(2 * MiB), pool.acquire(2 * MiB)
    assert pool.release(a) and pool.release(b)
    del a, b
    result = pool.acquire(3 * MiB)  # as a sliced allreduce's output
    pool.lend(result)
    assert pool.pooled + pool.lent <= pool.budget, (pool.pooled, pool.lent, pool.budget)


def test_idle_same_host_connections_to_a_dead_peer_are_closed():
    # B pulled from A through A's Unix socket; the connection went back to
    # B's pool of idle connections, keyed by A's address. A dies: nothing
    # ever takes that connection again (a new node gets a new address), so
    # its descriptor stays open for B's whole life, one more per dead peer.
    async def body(directory, a, b, c):
        oid = ObjectID.random()
        await a.put(np.ones(2 * MiB, np.uint8), oid)
        got = await b.get(oid, 3.0, "numpy")
        assert b.pool.local_maps == 1
        del got
        idle = [s for (address, local, _bind), streams in b.pool._idle.items()
                if local and address == a.server.address for s in streams]
        assert idle, "expected an idle same-host connection to A"
        sockets = {f"socket:[{os.fstat(s._sock.fileno()).st_ino}]" for s in idle}
        await a.close()  # A is gone (its process died)
        # B goes on working with another peer.
        other = ObjectID.random()
        await c.put(np.ones(2 * MiB, np.uint8), other)
        await b.get(other, 3.0, "numpy")
        await asyncio.sleep(0.3)
        left = sockets & set(_links())
        assert not left, f"B still holds {len(left)} connection(s) to the dead peer"

    run_nodes([config(), config(), config()], body, bound=BOUND)


def test_a_puller_gone_before_the_descriptor_was_passed_does_not_pin_the_buffer():
    # A same-host puller asks for a mapping and goes away before the answer:
    # passing the descriptor fails (EPIPE), so nobody can map the buffer. The
    # server still treats it as handed to a puller that never confirmed
    # (`shm.abandon`): the buffer is never reused, and where it is a copy the
    # server keeps of another node's pages (a relay) those stay pinned, with
    # the owner's reuse, until the process exits.
    from hoplite_gpu.auth import client_handshake, new_token
    from hoplite_gpu.node import shm, transfer
    from hoplite_gpu.node.store import ChunkStore
    from hoplite_gpu.protocol import send_msg
    from hoplite_gpu.values import to_buffer

    async def main():
        token = new_token()
        store = ChunkStore(64 * MiB, shared=True)
        server = transfer.DataServer(store, token, config(timeout_s=2.0))
        await server.start()
        await server.listen_local(server.address)
        try:
            _, layout = to_buffer(np.zeros(2 * MiB, np.uint8))
            oid = ObjectID.random()
            obj = store.create(oid, layout)
            obj.buffer[:] = 5
            obj.advance(obj.size)
            stream = await transfer._connect_local(server.address)
            await client_handshake(stream, token, 5)
            await send_msg(stream, {"op": "pull", "oid": oid.binary, "offset": 0,
                                    "end": obj.size, "shm": True, "map": True})
            await stream.close()  # gone before any descriptor came
            for _ in range(200):
                if not server._local._tasks:
                    break
                await asyncio.sleep(0.01)
            assert not server._local._tasks
            assert not shm.abandoned(obj.buffer), "no descriptor left, yet the buffer is pinned"
            store.remove(oid)
            assert store.pool.pooled == 2 * MiB  # kept for reuse
        finally:
            await server.close()

    asyncio.run(asyncio.wait_for(main(), BOUND))
