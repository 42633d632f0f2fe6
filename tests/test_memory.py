"""A node's store limit (`store_bytes`): pulled copies that another node also
holds are evicted, least recently used first, to make room; what no eviction
can make room for fails with `StoreFull`, and nothing is lost."""

from __future__ import annotations

import asyncio
import zlib

import cluster_tasks as t
import numpy as np
import pytest
from in_process import run_nodes

import hoplite_gpu as hg
from hoplite_gpu import messages
from hoplite_gpu.cluster import LocalCluster

MiB = 1 << 20
LIMIT = 5 * MiB
OBJ = 2 * MiB


@pytest.fixture(scope="module", params=[True, False], ids=["shared-memory", "tcp"])
def cluster(request):
    # Workers have the limit; this test process (the driver) has none and
    # holds the origin copies.
    with LocalCluster(3, chunk_size=MiB, store_bytes=LIMIT, shared_memory=request.param) as c:
        hg.init(c.address, token=c.token, chunk_size=MiB)
        try:
            yield c
        finally:
            hg.shutdown()


def holders(name: str) -> set[str]:
    return {h["node"] for h in hg.object_info(hg.ObjectID.from_name(name))["holders"]}


def put(name: str, seed: int = 0) -> int:
    data = t.pattern(OBJ, seed)
    hg.put(data, hg.ObjectID.from_name(name))
    return zlib.crc32(data)


def test_the_least_recently_used_pulled_copy_makes_room(cluster):
    crc = {name: put(name, seed) for seed, name in enumerate(["lru-a", "lru-b", "lru-c"])}
    me = cluster.run(0, t.node_id)
    for name in ["lru-a", "lru-b", "lru-c"]:
        assert cluster.run(0, t.get_summary, name)[0] == crc[name]
    stats = cluster.run(0, t.node_stats)
    assert (stats["evicted"], stats["held_bytes"], stats["store_bytes"]) == (1, 2 * OBJ, LIMIT)
    assert me not in holders("lru-a") and me in holders("lru-b") and me in holders("lru-c")
    # gone from here only: it comes back from the driver's copy, pushing out b
    assert cluster.run(0, t.get_summary, "lru-a")[0] == crc["lru-a"]
    assert me not in holders("lru-b") and me in holders("lru-a")
    assert cluster.run(0, t.node_stats)["held_bytes"] == 2 * OBJ


def test_a_copy_a_get_result_still_views_is_kept(cluster):
    for seed, name in enumerate(["view-p", "view-q", "view-r"]):
        put(name, seed)
    me = cluster.run(1, t.node_id)
    cluster.run(1, t.get_and_keep, "view-p")  # the oldest, but still in use
    cluster.run(1, t.get_summary, "view-q")
    cluster.run(1, t.get_summary, "view-r")
    assert me in holders("view-p") and me not in holders("view-q")


def test_what_cannot_be_made_room_for_fails_clearly_and_loses_nothing(cluster):
    put("full-a")
    crcs = [cluster.run(2, t.put_pattern, name, OBJ, seed)
            for seed, name in enumerate(["full-x", "full-y"])]
    me = cluster.run(2, t.node_id)
    error = cluster.run(2, t.get_error_text, "full-a")
    assert error.startswith("StoreFull: get of object") and "HOPLITE_STORE_BYTES" in error
    info = hg.object_info(hg.ObjectID.from_name("full-a"))
    assert me not in holders("full-a") and all(not h["serving"] for h in info["holders"])
    # the node's own objects are whole, and the get works once there is room
    assert [cluster.run(0, t.get_summary, n)[0] for n in ["full-x", "full-y"]] == crcs
    cluster.run(2, t.delete, "full-x")
    assert cluster.run(2, t.get_summary, "full-a")[0] == zlib.crc32(t.pattern(OBJ, 0))


def test_a_put_larger_than_the_limit_is_refused_before_it_registers(cluster):
    error = cluster.run(2, t.put_error, "too-big", LIMIT + 4)
    assert error.startswith("StoreFull: put of object") and "whole store limit" in error
    assert not cluster.run(0, t.object_exists, "too-big")


# In one process, nodes and a directory on one loop: the eviction's round trip
# can be interrupted exactly where a caller would give up.
def with_nodes(limit: int, body) -> None:
    """Run `body(directory, origin, reader)`: the reader has the store limit."""
    config = hg.Config(shared_memory=False, chunk_size=MiB)
    run_nodes([config, config.replace(store_bytes=limit)], body)


def test_a_caller_giving_up_during_an_eviction_still_frees_what_the_directory_forgot():
    async def body(directory, origin, reader):
        x, y, z = (hg.ObjectID.from_name(f"cancel-{n}") for n in "xyz")
        for i, oid in enumerate((x, y, z)):
            await origin.put(np.full(OBJ, i + 1, np.uint8), oid)
        await reader.fetch(x, 10)
        await reader.fetch(y, 10)  # 4 MiB held: z needs room
        asking = reader.client.start

        def start_then_give_up(msg, rid=None):
            fut = asking(msg, rid)
            if messages.op(msg) == "evict":
                asyncio.get_running_loop().call_soon(get.cancel)
            return fut

        reader.client.start = start_then_give_up
        get = asyncio.ensure_future(reader.get(z, 10, "numpy"))
        with pytest.raises(asyncio.CancelledError):
            await get
        reader.client.start = asking
        for _ in range(500):  # the directory's answer comes on its own (within 5 s)
            if reader.evicted:
                break
            await asyncio.sleep(0.01)
        holders = {h.node for h in directory.state.describe(x.binary).holders}
        # the directory forgot the reader's x, and so did the reader
        assert reader.node_id not in holders and reader.store.get(x) is None
        assert reader.evicted == 1
        await origin.delete(x)
        await origin.put(np.full(OBJ, 9, np.uint8), x)  # the same id, new bytes
        assert int((await reader.get(x, 10, "numpy"))[0]) == 9

    with_nodes(5 * MiB, body)


def test_a_call_that_cannot_get_room_evicts_nothing():
    async def body(directory, origin, reader):
        x, big, mine = (hg.ObjectID.from_name(f"nothing-{n}") for n in ("x", "big", "mine"))
        await origin.put(np.ones(OBJ, np.uint8), x)
        await origin.put(np.ones(2 * OBJ, np.uint8), big)
        await reader.put(np.ones(OBJ, np.uint8), mine)  # its own: never evicted
        await reader.fetch(x, 10)  # 4 MiB held; big needs 4 more and only x (2) may go
        with pytest.raises(hg.StoreFull, match="could not evict enough"):
            await reader.get(big, 10, "numpy")
        assert reader.store.get(x) is not None and reader.evicted == 0

    with_nodes(5 * MiB, body)


def test_gets_at_the_same_time_cannot_both_take_the_last_room():
    async def body(directory, origin, reader):
        a, b, mine = (hg.ObjectID.from_name(f"race-{n}") for n in ("a", "b", "mine"))
        await origin.put(np.ones(OBJ, np.uint8), a)
        await origin.put(np.ones(OBJ, np.uint8), b)
        await reader.put(np.ones(OBJ, np.uint8), mine)  # its own: 3 MiB of room left
        mapping = reader.pulls._map_from

        async def slow_map(*args):  # a same-host mapping attempt: time between check and copy
            await asyncio.sleep(0.05)
            return await mapping(*args)

        reader.pulls._map_from = slow_map
        got = await asyncio.gather(reader.get(a, 10, "numpy"), reader.get(b, 10, "numpy"),
                                   return_exceptions=True)
        assert sorted(type(g).__name__ for g in got) == ["StoreFull", "ndarray"]
        assert reader.store.held == 2 * OBJ and reader.store.reserved == 0

    with_nodes(5 * MiB, body)


def test_a_reduce_step_makes_room_for_its_result():
    async def body(directory, origin, reader):
        x, theirs, mine, total = (hg.ObjectID.from_name(f"step-{n}")
                                  for n in ("x", "theirs", "mine", "total"))
        await origin.put(np.ones(OBJ, np.uint8), x)
        await reader.fetch(x, 10)
        await origin.put(np.full(OBJ, 2, np.uint8), theirs)
        await reader.put(np.full(OBJ, 3, np.uint8), mine)  # 4 MiB held: the result needs 2 more
        await reader.reduce([theirs, mine], "sum", 2, total, root_input=mine)
        got = await reader.get(total, 10, "numpy")
        assert got.min() == got.max() == 5
        assert reader.evicted == 1 and reader.store.get(x) is None
        assert reader.store.held == 2 * OBJ <= 5 * MiB

    with_nodes(5 * MiB, body)


def test_small_objects_that_fill_the_store_make_room_in_the_background():
    async def body(directory, origin, reader):
        x, y = (hg.ObjectID.from_name(f"small-{n}") for n in "xy")
        for oid in (x, y):
            await origin.put(np.ones(OBJ, np.uint8), oid)
            await reader.fetch(oid, 10)
        small = reader.config.inline_threshold
        # one more than the room left (inline objects take no room first)
        for i in range((5 * MiB - 2 * OBJ) // small + 1):
            await reader.put(np.ones(small, np.uint8), hg.ObjectID.from_name(f"small-{i}"))
        for _ in range(500):  # the eviction runs in the background (within 5 s)
            if reader.evicted:
                break
            await asyncio.sleep(0.01)
        assert reader.evicted == 1 and reader.store.get(x) is None
        assert reader.store.held <= 5 * MiB

    with_nodes(5 * MiB, body)


def test_a_non_contiguous_put_beyond_the_limit_is_refused_before_any_copy(monkeypatch):
    """Regression: a put of a non-contiguous array larger than the whole
    store limit first made a contiguous copy of it (4 s for 2 GB under
    HOPLITE_STORE_BYTES=1GiB), only for the store to refuse it."""
    from hoplite_gpu import values

    copies = []
    real = values._copied
    monkeypatch.setattr(values, "_copied", lambda copy, n: (copies.append(n), real(copy, n))[1])

    async def body(directory, origin, reader):
        strided = np.zeros(8 * MiB, np.uint8)[::2]  # 4 MiB, not contiguous
        assert not strided.flags.c_contiguous
        with pytest.raises(hg.StoreFull, match="whole store limit"):
            await reader.put(strided, hg.ObjectID.from_name("strided-too-big"))
        assert copies == [], "the value was copied before the store refused it"
        assert reader.store.used == 0
        small = np.zeros(2 * MiB, np.uint8)[::2]  # fits: copied as before
        await reader.put(small, hg.ObjectID.from_name("strided-fits"))
        assert copies == [MiB]

    with_nodes(3 * MiB, body)
