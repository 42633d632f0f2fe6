"""A node's store limit (`store_bytes`): pulled copies that another node also
holds are evicted, least recently used first, to make room; what no eviction
can make room for fails with `StoreFull`, and nothing is lost."""

from __future__ import annotations

import zlib

import cluster_tasks as t
import pytest

import hoplite_gpu as hg
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
