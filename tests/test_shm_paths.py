"""Which path a same-host pull takes (`node/shm.py`, its use in
`node/transfer.py` and `node/node.py`, and the store's buffers): shared memory
kept on under a burst of pulls, host objects kept off an idle transport
connection, and what memory the machine cannot give; each test bounded by a
deadline, on in-process nodes or a bare store."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from in_process import run_nodes

import hoplite_gpu as hg
from hoplite_gpu.config import Config
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.node.store import ChunkStore
from hoplite_gpu.values import Layout

MiB = 1 << 20
BOUND = 30.0


def config(**overrides) -> Config:
    base = dict(shared_memory=True, timeout_s=10.0, stall_timeout_s=2.0, connect_timeout_s=5.0,
                chunk_size=MiB)
    base.update(overrides)
    return Config.from_env({}, **base)


def _machine_bytes() -> int:
    """RAM plus swap, from /proc/meminfo."""
    total = 0
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "SwapTotal"):
                total += int(rest.split()[0]) * 1024
    return total


def test_an_object_larger_than_the_machine_is_store_full_with_shared_memory_on():
    """docs/guide-memory.md: "With or without a limit, memory the machine ... cannot
    give also raises `StoreFull`". Without shared memory it does: the plain
    anonymous map of a store buffer is refused up front by the kernel's
    overcommit check. With shared memory on (the Linux default) a large store
    buffer is a memfd (`shm.shared_buffer`), and memfd files are created
    with VM_NORESERVE: `ftruncate` and `mmap` of twice the machine's memory
    both succeed, so `create` hands out a buffer that can never be filled.
    The user's put or get then starts writing into it and the process is
    OOM-killed (or the machine swaps to a halt) instead of getting
    `StoreFull`. (The test only creates the buffer; it never touches it.)"""
    size = 2 * _machine_bytes() + MiB
    huge = Layout(kind="bytes", dtype="|u1", shape=(size,), nbytes=size)
    plain = ChunkStore(pool_bytes=0, shared=False)
    try:
        plain.create(ObjectID.random(), huge)
    except hg.StoreFull:
        pass
    else:  # (vm.overcommit_memory=1: the kernel refuses nothing up front)
        pytest.skip("this kernel overcommits without limit: plain memory is not refused either")
    shared = ChunkStore(pool_bytes=0, shared=True)
    obj = None
    try:
        with pytest.raises(hg.StoreFull, match="no memory for an object"):
            obj = shared.create(ObjectID.random(), huge)
    finally:
        if obj is not None:
            shared.remove(obj.oid)
            del obj


def test_a_burst_of_concurrent_pulls_does_not_turn_shared_memory_off_for_that_peer():
    """Many gets at once from one same-host peer each open a connection to
    its Unix socket (docs/protocol.md: "Concurrent pulls to the same peer
    open more connections"). Past the listener's backlog (128) a
    non-blocking connect fails with EAGAIN; asyncio's `sock_connect` then
    reports success on a socket that is not connected, `same_user` reads
    uid -1 from SO_PEERCRED, and `transfer._connect_local` returns None, so
    `PeerPool.acquire` adds the peer to `_remote` for good. Every later pull
    from that peer goes over loopback TCP: a large object is copied instead
    of kept as a mapping (`node_stats()["kept_mappings"]` stays 0), and a
    256 MiB broadcast takes ~0.6 s instead of ~10 ms, silently."""

    async def body(directory, a, b):
        small = [ObjectID.random() for _ in range(200)]
        for i, oid in enumerate(small):  # above the inline threshold, below 1 MiB
            await a.put(np.full(128 * 1024, i % 251, np.uint8), oid)
        got = await asyncio.gather(*(b.get(oid, 10.0, "numpy") for oid in small))
        assert all(int(g[0]) == i % 251 for i, g in enumerate(got))
        del got
        big = ObjectID.random()
        await a.put(np.full(4 * MiB, 3, np.uint8), big)
        value = await b.get(big, 10.0, "numpy")
        assert int(value[0]) == 3
        stats = await b.stats()
        assert a.server.address not in b.pool._remote, \
            "a burst of concurrent pulls marked a same-host peer as remote for good"
        assert stats["kept_mappings"] == 1, stats

    run_nodes([config(), config()], body, bound=BOUND)


def test_an_idle_transport_connection_does_not_carry_same_host_host_objects():
    """`PeerPool.acquire(address, local=True)` takes an idle *transport*
    connection to the peer when no idle Unix-socket one is there (it tries
    the keys (address, True) then (address, False)). A pull of a device
    object goes over the transport (`fetch_range` asks with `local=False`)
    and leaves such a connection idle; on a GPU host every later pull of a
    host object from that peer then takes it: `map_object` sees a non-local
    stream and gives up, and the bytes go over TCP/UCX instead of shared
    memory, though docs/guide-gpus-and-ucx.md says host objects between such processes "go
    through HOPLITE_SHARED_MEMORY". Here the device pull's leftover is made
    as `fetch_range` makes it (acquire with local=False, then release)."""

    async def body(directory, a, b):
        address = a.server.address
        stream = await b.pool.acquire(address, local=False)  # a device object's pull
        b.pool.release(address, stream)
        big = ObjectID.random()
        await a.put(np.full(4 * MiB, 5, np.uint8), big)
        value = await b.get(big, 10.0, "numpy")
        assert int(value[0]) == 5
        stats = await b.stats()
        assert stats["kept_mappings"] + stats["copied_from_mappings"] == 1, \
            f"a same-host host object went over the transport: {stats}"

    run_nodes([config(), config()], body, bound=BOUND)
