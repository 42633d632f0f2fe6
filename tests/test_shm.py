"""Pulls between nodes on one host through shared memory (`hoplite_gpu.node.shm`)."""

from __future__ import annotations

import asyncio
import os
import socket

import cluster_tasks as t
import numpy as np
import pytest

from hoplite_gpu.cluster import LocalCluster
from hoplite_gpu.errors import PeerLost
from hoplite_gpu.node import shm
from hoplite_gpu.node.pool import BufferPool, host_buffer
from hoplite_gpu.transports import local

MiB = 1 << 20


def test_shared_buffers_are_memfd_maps_and_small_ones_are_not():
    buf = host_buffer(2 * MiB, shared=True)
    mapped = shm.shared_map(buf)
    assert mapped is not None and os.fstat(mapped.fd).st_size == 2 * MiB
    assert shm.shared_map(buf[1:]) is None  # only a whole mapping can be handed out
    assert shm.shared_map(host_buffer(2 * MiB)) is None
    assert shm.shared_map(host_buffer(1000, shared=True)) is None
    assert shm.shared_map(np.zeros(2 * MiB, np.uint8)) is None


def test_the_pool_does_not_reuse_a_buffer_a_puller_may_still_read():
    pool = BufferPool(64 * MiB, shared=True)
    kept = pool.acquire(2 * MiB)
    assert pool.release(kept)
    again = pool.acquire(2 * MiB)
    assert again is kept
    del kept
    shm.shared_map(again).readers += 1
    assert pool.release(again)  # kept, but not handed out while a puller copies from it
    assert pool.acquire(2 * MiB) is not again
    shm.shared_map(again).readers -= 1  # it said it is done
    assert pool.acquire(2 * MiB) is again


def test_a_passed_descriptor_maps_the_same_bytes():
    async def main():
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        left, right = local.LocalStream(a, "left"), local.LocalStream(b, "right")
        buf = host_buffer(2 * MiB, shared=True)
        buf[:] = np.arange(2 * MiB, dtype=np.uint8)
        await shm.send_mode(left, b"F", shm.shared_map(buf).fd, 5)
        mode, fd = await shm.recv_mode(right, 5)
        assert mode == b"F"
        view = shm.map_readonly(fd, 2 * MiB)
        assert bytes(view[:1000]) == buf[:1000].tobytes() and view[-1] == buf[-1]
        view.close()
        await shm.send_mode(left, b"B", None, 5)
        assert await shm.recv_mode(right, 5) == (b"B", None)
        await shm.send_mode(left, b"F", None, 5)  # a mode that needs a descriptor, without one
        with pytest.raises(PeerLost):
            await shm.recv_mode(right, 5)
        await left.send(b"x")  # anything else is a broken peer, not a mode
        with pytest.raises(PeerLost):
            await shm.recv_mode(right, 5)
        await left.close()
        with pytest.raises(PeerLost):  # closed: no mode comes
            await shm.recv_mode(right, 5)
        await right.close()

    asyncio.run(main())


def test_a_kept_mapping_stops_the_owner_reusing_the_buffer():
    pool = BufferPool(64 * MiB, shared=True)
    owner = pool.acquire(2 * MiB)
    owner[:] = 7
    mine = shm.shared_map(owner)
    kept = shm.map_kept(os.dup(mine.fd), 2 * MiB)  # as a puller on this host does
    assert kept is not None and kept[0] == 7 and kept[-1] == 7
    with pytest.raises(TypeError):
        kept[0] = 1  # read-only
    mine.kept_elsewhere = True
    assert shm.read_elsewhere(owner)
    assert pool.release(owner)
    other = pool.acquire(2 * MiB)
    assert other is not owner  # its pages are someone's copy: not handed out
    del kept
    import gc

    gc.collect()  # the keeper's mapping goes, and its lock with it
    assert not shm.read_elsewhere(owner)
    assert pool.acquire(2 * MiB) is owner


def test_a_buffer_a_puller_never_confirmed_is_never_reused():
    pool = BufferPool(64 * MiB, shared=True)
    buf = pool.acquire(2 * MiB)
    mapped = shm.shared_map(buf)
    mapped.readers += 1
    assert pool.release(buf)  # pooled while a puller copies from it
    shm.abandon(mapped)  # and that puller never says it is done
    del mapped
    assert pool.acquire(2 * MiB) is not buf
    assert pool.pooled == 0  # let go, not kept forever
    assert not pool.release(buf)


def test_kept_copies_stop_at_their_share_of_descriptors(monkeypatch):
    owner = host_buffer(2 * MiB, shared=True)
    monkeypatch.setattr(shm, "_fd_budget", lambda: 2 * shm._live)  # no room for one more
    fd = os.dup(shm.shared_map(owner).fd)
    assert shm.map_kept(fd, 2 * MiB) is None  # the puller copies instead
    with pytest.raises(OSError):
        os.fstat(fd)  # and the passed descriptor is closed


def test_the_owner_reuses_its_buffer_once_receivers_let_go():
    with LocalCluster(3, chunk_size=MiB) as c:
        for r in range(3):
            crc = c.run(0, t.put_pattern, f"shm-reuse-{r}", 16 * MiB)
            got = c.map(t.get_summary, [(f"shm-reuse-{r}",)] * 2, workers=range(1, 3))
            assert all(g[0] == crc for g in got)
            c.run(0, t.delete, f"shm-reuse-{r}")
        assert c.map(t.local_pulls, [()] * 2, workers=range(1, 3)) == [3, 3]
        # The receivers kept mappings of worker 0's pages; deleted, their locks
        # went, and worker 0's next put reused the buffer.
        assert c.run(0, t.pool_hits) >= 1


@pytest.mark.parametrize("shared", [True, False])
def test_broadcast_on_one_host_goes_through_shared_memory(shared):
    with LocalCluster(4, chunk_size=MiB, shared_memory=shared) as c:
        for r in range(2):
            crc = c.run(0, t.put_pattern, f"shm-bcast-{r}", 64 * MiB + 5)
            got = c.map(t.get_summary, [(f"shm-bcast-{r}",)] * 3, workers=range(1, 4))
            assert all(g[0] == crc for g in got)
            c.run(0, t.delete, f"shm-bcast-{r}")
        pulls = c.map(t.local_pulls, [()] * 3, workers=range(1, 4))
        if shared:  # each receiver kept a mapping of a complete copy, or copied from one
            assert all(p >= 2 for p in pulls), pulls
        else:
            assert pulls == [0, 0, 0]


def test_reduce_on_one_host_goes_through_shared_memory():
    with LocalCluster(3, chunk_size=MiB) as c:
        names = [f"shm-red-{i}" for i in range(3)]
        n = 4 * MiB  # float32 elements: 16 MiB objects
        c.map(t.put_float32, [(names[i], n, i) for i in range(3)], workers=range(3))
        value, used = c.run(0, t.reduce_and_get, names, "sum", 3, "shm-red-out")
        want = sum(np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(3))
        np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-5)
        assert sorted(used) == [0, 1, 2]
        pulls = c.map(t.local_pulls, [()] * 3, workers=range(3))
        assert sum(pulls) >= 2, pulls  # a chain's two hops, at least


def test_a_shared_buffer_cannot_be_cut_short_under_its_mapping():
    mapped = shm.shared_map(host_buffer(2 * MiB, shared=True))
    with pytest.raises(PermissionError):  # sealed: a puller could otherwise SIGBUS us
        os.ftruncate(mapped.fd, MiB)


def test_shared_buffers_stop_at_their_share_of_descriptors(monkeypatch):
    monkeypatch.setattr(shm, "_fd_budget", lambda: 2 * shm._live)  # no room for one more
    assert shm.shared_buffer(2 * MiB) is None
    assert shm.shared_map(host_buffer(2 * MiB, shared=True)) is None  # plain memory instead
    assert host_buffer(2 * MiB, shared=True).nbytes == 2 * MiB


@pytest.mark.parametrize("ours", [True, False])
def test_a_puller_uses_only_its_own_users_socket(monkeypatch, ours):
    from hoplite_gpu.node import transfer

    address = f"tcp://127.0.0.1:1{os.getpid() % 10000}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(local.socket_name(address))
    listener.listen(1)
    # As if another user had bound the name first: we must not talk to it.
    monkeypatch.setattr(local, "same_user", lambda sock: ours)

    async def main():
        return await transfer._connect_local(address)

    try:
        stream = asyncio.run(main())
        assert (stream is not None) == ours
        if stream is not None:
            asyncio.run(stream.close())
    finally:
        listener.close()
    assert asyncio.run(transfer._connect_local("tcp://127.0.0.1:1")) is None  # nobody there


def test_a_puller_that_vanishes_with_the_descriptor_leaves_the_buffer_unreused():
    from hoplite_gpu.auth import client_handshake, new_token
    from hoplite_gpu.config import Config
    from hoplite_gpu.ids import ObjectID
    from hoplite_gpu.node import transfer
    from hoplite_gpu.node.store import ChunkStore
    from hoplite_gpu.protocol import send_msg
    from hoplite_gpu.values import to_buffer

    async def main():
        token = new_token()
        store = ChunkStore(64 * MiB, shared=True)
        server = transfer.DataServer(store, token, Config.from_env({}, timeout_s=2.0))
        await server.start()
        await server.listen_local(server.address)
        src, layout = to_buffer(np.full(2 * MiB, 5, dtype=np.uint8))
        oid = ObjectID.random()
        obj = store.create(oid, layout)
        obj.buffer[:] = np.frombuffer(src, dtype=np.uint8)
        obj.advance(obj.size)
        mapped = shm.shared_map(obj.buffer)
        stream = await transfer._connect_local(server.address)
        await client_handshake(stream, token, 5)
        await send_msg(stream, {"op": "pull", "oid": oid.binary, "offset": 0, "end": obj.size,
                                "shm": True, "map": True})
        mode, fd = await shm.recv_mode(stream, 5)
        assert mode == b"M"
        await stream.close()  # gone before saying it holds its own lock
        for _ in range(200):
            if mapped.poisoned:
                break
            await asyncio.sleep(0.01)
        assert mapped.poisoned  # it may still map these pages: never reused
        store.remove(oid)
        assert store.pool.pooled == 0
        os.close(fd)
        await server.close()

    asyncio.run(main())
