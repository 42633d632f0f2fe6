"""Object lifetime on a node: gets, reduce restarts and buffer reuse."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from in_process import run_nodes

import hoplite_gpu as hg
import hoplite_gpu.node.flows as flows
from hoplite_gpu.errors import PeerLost

MiB = 1 << 20


def test_a_root_waiting_on_its_result_survives_a_reduce_restart(monkeypatch):
    """The root's own get waits (in its locate) for the result while a child
    stream fails: the restart's drop cancels that pull, and the pull, given up,
    must not tell the directory that the root dropped the result the new
    tree's step is making there, or the reduce never finishes."""
    real = flows.fetch_range
    failed = []

    async def fails_once(pool, address, obj, end, config, progress, **kw):
        if not failed:
            failed.append(obj.oid)
            raise PeerLost("a child stream failed (test)")
        return await real(pool, address, obj, end, config, progress, **kw)

    # (a reduce step pulls its children through the node's flows, as gets do)
    monkeypatch.setattr(flows, "fetch_range", fails_once)
    config = hg.Config(shared_memory=False, chunk_size=MiB)

    async def body(directory, root, a, b):
        ids = [hg.ObjectID.from_name(f"restart-root-{i}") for i in range(3)]
        target = hg.ObjectID.from_name("restart-root-t")
        for node, oid, value in zip((root, a, b), ids, (1, 2, 3), strict=True):
            await node.put(np.full(3 * MiB, value, np.float32), oid)
        # as collectives.reduce's root does: ask, then wait for the result here
        await root.reduce(ids, "sum", 3, target, root_input=ids[0])
        got = await root.get(target, 8, "numpy")
        assert failed, "the child stream did not fail: nothing was tested"
        assert failed[0] not in (*ids, target), "a get failed, not a child stream"
        assert got.min() == got.max() == 6

    run_nodes([config] * 3, body, bound=30)


def test_unreceived_memory_is_not_written_by_the_pull_still_running():
    """`unreceived` hands a caller's `receive_into` array back: the pull that
    was filling it must stop writing there, or the caller's own bytes change
    under it afterwards."""
    config = hg.Config(shared_memory=False, chunk_size=MiB)

    async def body(directory, origin, reader):
        x = hg.ObjectID.from_name("unreceived-x")
        await origin.put(np.full(64 * MiB, 7, np.uint8), x)
        mine = np.zeros(64 * MiB, np.uint8)
        assert reader.receive_into(x, mine)
        obj = reader.store.get(x)
        get = asyncio.ensure_future(reader.get(x, 10, "numpy"))
        deadline = asyncio.get_running_loop().time() + 10
        while obj.ready == 0:  # the pull is under way, writing into `mine`
            assert asyncio.get_running_loop().time() < deadline, "the pull never started"
            await asyncio.sleep(0)
        assert obj.ready < obj.size, "the pull ended before it could be given up"
        reader.unreceived(x)
        mine[:] = 1  # the caller's memory again
        with pytest.raises(hg.HopliteError):
            await asyncio.wait_for(get, 10)
        await asyncio.sleep(0.2)
        assert np.count_nonzero(mine != 1) == 0, "the pull kept writing into the caller's array"

    run_nodes([config] * 2, body, bound=30)
