"""Functions the tests send to LocalCluster workers (must be importable by name)."""

from __future__ import annotations

import concurrent.futures
import time
import zlib

import numpy as np

import hoplite_gpu as hg


def pattern(size: int, seed: int = 0) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(size), dtype=np.uint8)


def put_pattern(name: str, size: int, seed: int = 0) -> int:
    data = pattern(size, seed)
    hg.put(data, hg.ObjectID.from_name(name))
    return zlib.crc32(data)


def put_value(name: str, value) -> None:
    hg.put(value, hg.ObjectID.from_name(name))


def put_array(name: str, raw: bytes, descr, shape: tuple) -> None:
    """Rebuild the array here: pickling on the way in may normalise its byte order."""
    from numpy.lib.format import descr_to_dtype

    value = np.frombuffer(raw, dtype=descr_to_dtype(descr)).reshape(shape)
    hg.put(value, hg.ObjectID.from_name(name))


def object_info(name: str) -> dict:
    return hg.object_info(hg.ObjectID.from_name(name))


def put_after(name: str, size: int, delay: float) -> int:
    time.sleep(delay)
    return put_pattern(name, size)


def get_summary(name: str, timeout: float = 60.0) -> tuple[int, str, tuple, int]:
    value = hg.get(hg.ObjectID.from_name(name), timeout=timeout)
    return zlib.crc32(np.ascontiguousarray(value).view(np.uint8)), str(value.dtype), value.shape, value.nbytes


def get_value(name: str, timeout: float = 60.0):
    """The value, as (dtype.str, shape, raw bytes) for arrays: pickling back to
    the test process must not be what decides whether the dtype survived."""
    value = hg.get(hg.ObjectID.from_name(name), timeout=timeout)
    if isinstance(value, np.ndarray):
        return value.dtype.str, value.dtype.descr, value.shape, value.tobytes()
    return value


def get_error(name: str, timeout: float) -> str:
    try:
        hg.get(hg.ObjectID.from_name(name), timeout=timeout)
    except hg.HopliteError as exc:
        return type(exc).__name__
    return "no error"


def get_many(names: list[str], timeout: float = 60.0) -> dict[str, int]:
    """Get several objects at once from threads: many pulls in flight on one node."""
    def one(name: str) -> tuple[str, int]:
        value = hg.get(hg.ObjectID.from_name(name), timeout=timeout)
        return name, zlib.crc32(value)

    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        return dict(pool.map(one, names))


def delete(name: str) -> None:
    hg.delete(hg.ObjectID.from_name(name))


def node_id() -> str:
    return hg.node_id()


def put_float32(name: str, size: int, seed: int, delay: float = 0.0) -> None:
    time.sleep(delay)
    hg.put(np.random.default_rng(seed).standard_normal(size).astype(np.float32),
           hg.ObjectID.from_name(name))


def reduce_and_get(names: list[str], op: str, k: int, target: str, timeout: float = 60.0):
    ids = [hg.ObjectID.from_name(n) for n in names]
    rid = hg.reduce(ids, op, num_objects=k, object_id=hg.ObjectID.from_name(target))
    value = np.array(hg.get(rid, timeout=timeout))
    used = [ids.index(u) for u in hg.reduced_inputs(rid, timeout=timeout)]
    return value, used


def get_reduce_error(names: list[str], op: str, target: str, timeout: float = 20.0) -> str:
    ids = [hg.ObjectID.from_name(n) for n in names]
    rid = hg.reduce(ids, op, object_id=hg.ObjectID.from_name(target))
    try:
        hg.get(rid, timeout=timeout)
    except hg.HopliteError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def allreduce_worker(name: str, rank: int, size: int, n: int, delay: float, op: str = "sum"):
    from hoplite_gpu import collectives

    time.sleep(delay)
    value = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
    out = collectives.allreduce(value, name=name, rank=rank, size=size, op=op, timeout=120)
    return zlib.crc32(np.ascontiguousarray(out)), float(out[:1000].astype(np.float64).sum())


def sliced_allreduce_worker(name: str, rank: int, size: int, n: int):
    """An allreduce large enough to be sliced; reports the result's checksum, this
    node, and for every slice its result's origins and its (receiver, sender) edges."""
    from hoplite_gpu import collectives

    value = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
    out = collectives.allreduce(value, name=name, rank=rank, size=size, timeout=120)
    _, results, _ = collectives._slice_ids(name, size, "sum")
    slices = []
    for oid in results:
        info = hg.object_info(oid)
        slices.append(([h["node"] for h in info["holders"] if h["origin"]],
                       sorted({tuple(e) for e in info["edges"]})))
    # every slice landed in the returned array itself: no copy, no second buffer
    in_place = all(np.may_share_memory(out, hg.get(oid, timeout=10)) for oid in results)
    return (zlib.crc32(np.ascontiguousarray(out)), node_id(), slices, out.shape,
            out[::4099].astype(np.float64), in_place, out.flags.writeable)


def reduce_worker(name: str, rank: int, size: int, root: int, n: int, delay: float):
    """collectives.reduce of float32 values after `delay`; the root reports the
    result's checksum and which nodes produced it (the reduce tree's root)."""
    from hoplite_gpu import collectives

    time.sleep(delay)
    value = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
    out = collectives.reduce(value, name=name, rank=rank, size=size, root=root, timeout=120)
    if out is None:
        return None
    target = hg.ObjectID.from_name(f"{name}/reduce/sum/{size}")
    origins = [h["node"] for h in hg.object_info(target)["holders"] if h["origin"]]
    return float(out[:1000].astype(np.float64).sum()), origins, node_id()


def _wait_pooled(nbytes: int, seconds: float) -> None:
    """Until this node's buffer pool would reuse a buffer of `nbytes` (at most
    `seconds`): a free one, or a lent one let go (counting free ones alone
    waited out `seconds` whenever the buffer to reuse was a lent one)."""
    from hoplite_gpu import api

    pool = api.runtime().node.store.pool
    deadline = time.monotonic() + seconds
    while not pool.reusable(nbytes) and time.monotonic() < deadline:
        time.sleep(0.005)


def allreduce_steps(name: str, rank: int, size: int, n: int, steps: int,
                    keep_first: bool = False) -> dict:
    """A training loop's allreduces: step k deletes step k-1's objects (rank 0,
    after an allgather barrier). Reports sums, the pool's reuse and whether the
    deleted result is gone; with `keep_first`, the first step's result stays
    held (a view, as a user's would be) and its values are reported at the end:
    later steps may reuse buffers of results dropped, never of that one."""
    from hoplite_gpu import api, collectives

    sums, first = [], None
    for k in range(steps):
        collectives.allgather(np.zeros(1), name=f"{name}/sync/{k}", rank=rank, size=size)
        if rank == 0 and k:
            collectives.delete(f"{name}/{k - 1}", size=size)
        if k and not keep_first:  # (the delete reaches other nodes a moment
            # later, and a send still under way holds its buffer that long:
            # wait, bounded, until a buffer of the step's size is back in this
            # node's pool; a sliced allreduce's pieces are of other sizes)
            _wait_pooled(n * 4, 15.0)
        value = np.full(n, rank + k, dtype=np.float32)
        out = collectives.allreduce(value, name=f"{name}/{k}", rank=rank, size=size, timeout=60)
        sums.append(float(out[-1]))
        if keep_first and first is None:
            first = out[1:]
        del out  # a user view would keep the buffer out of the pool
    collectives.allgather(np.zeros(1), name=f"{name}/sync/end", rank=rank, size=size)
    gone = None
    if rank == 0:
        collectives.delete(f"{name}/{steps - 1}", size=size)
        try:
            hg.object_info(hg.ObjectID.from_name(f"{name}/{steps - 1}/reduce/sum/{size}"))
            gone = False
        except hg.ObjectNotFound:
            gone = True
    return {"sums": sums, "pool_hits": api.runtime().node.store.pool.hits, "gone": gone,
            "first": None if first is None else np.unique(first).tolist(),
            "reclaimed": hg.node_stats()["pool_reclaimed"]}


def collective_worker(kind: str, name: str, rank: int, size: int):
    from hoplite_gpu import collectives

    value = np.full(100_000 + rank, rank, dtype=np.int32)
    fn = getattr(collectives, kind)
    if kind == "broadcast":
        out = fn(value, name=name, rank=rank, size=size)
        return int(out[0]), out.shape
    out = fn(value, name=name, rank=rank, size=size)
    if out is None:
        return None
    if isinstance(out, list):
        return [(int(o[0]), o.shape) for o in out]
    return int(out[0]), out.shape


def publish_versions(channel: str, count: int, size: int, gap: float = 0.0, keep: int = 2) -> list[int]:
    """Publish `count` versions whose arrays all hold the version number."""
    from hoplite_gpu.channel import WeightChannel

    ch, out = WeightChannel(channel, keep=keep), []
    for _ in range(count):
        v = ch.latest_version() + 1
        weights = {f"layer{i}": np.full(size // 4, v, dtype=np.float32) for i in range(3)}
        out.append(ch.publish(weights, version=v))
        time.sleep(gap)
    return out


def fetch_consistent(channel: str, until: int, timeout: float = 30.0) -> list[int]:
    """Fetch newer versions until `until`; every fetched set must be one version
    throughout (versions may be skipped)."""
    from hoplite_gpu.channel import WeightChannel

    ch, seen, last = WeightChannel(channel), [], -1
    while last < until:
        version, weights = ch.fetch(newer_than=last, timeout=timeout)
        assert list(weights) == ["layer0", "layer1", "layer2"], list(weights)
        for name, arr in weights.items():
            assert arr.min() == arr.max() == version, (name, version, arr.min(), arr.max())
        seen.append(version)
        last = version
    return seen


def fetch_latest(channel: str) -> int:
    from hoplite_gpu.channel import WeightChannel

    version, weights = WeightChannel(channel).fetch(timeout=30)
    assert all(a.min() == a.max() == version for a in weights.values())
    return version


# --- device (GPU) objects: used by test_gpu_objects.py, only where CuPy sees a GPU ---


def device_values(seed: int, n: int, dtype: str):
    """Deterministic values (as NumPy float64 and as the device array that is put)."""
    import cupy

    host = np.random.default_rng(seed).uniform(0.5, 1.5, n)
    if dtype == "bfloat16":
        import torch

        dev = torch.tensor(host, dtype=torch.bfloat16, device="cuda")
        return dev.float().cpu().double().numpy(), dev
    dev = cupy.asarray(host.astype(dtype))
    return cupy.asnumpy(dev).astype(np.float64), dev


def put_device(name: str, seed: int, n: int, dtype: str) -> None:
    _, dev = device_values(seed, n, dtype)
    hg.put(dev, hg.ObjectID.from_name(name))
    dev[...] = 0  # put copied it: this must not change what peers receive


def get_device(name: str, array_type: str = "cupy") -> dict:
    """Get a device object; report where it lives and its values as float64."""
    value = hg.get(hg.ObjectID.from_name(name), array_type=array_type)
    kind = type(value).__module__.split(".")[0]
    if kind == "torch":
        on_gpu, host = value.is_cuda, value.float().cpu().double().numpy()
    elif kind == "cupy":
        import cupy

        on_gpu, host = True, cupy.asnumpy(value).astype(np.float64)
    else:
        on_gpu, host = False, np.asarray(value, dtype=np.float64)
    return {"kind": kind, "on_gpu": on_gpu, "values": host}


def reduce_device(names: list[str], op: str, target: str, array_type: str = "cupy") -> dict:
    ids = [hg.ObjectID.from_name(n) for n in names]
    hg.reduce(ids, op, object_id=hg.ObjectID.from_name(target))
    return get_device(target, array_type)


def object_exists(name: str) -> bool:
    return object_exists_id(hg.ObjectID.from_name(name))


def delete_sliced(name: str, size: int) -> list[bool]:
    """collectives.delete of a sliced allreduce; whether each slice's result and
    each rank's barrier marker (only delete removes those) exist before, and
    after."""
    from hoplite_gpu import collectives

    _, results, ready = collectives._slice_ids(name, size, "sum")
    before = [object_exists_id(oid) for oid in [*results, *ready]]
    collectives.delete(name, size=size)
    return before, [object_exists_id(oid) for oid in [*results, *ready]]


def object_exists_id(oid) -> bool:
    try:
        hg.object_info(oid)
    except hg.ObjectNotFound:
        return False
    return True


def local_pulls() -> int:
    """Pulls this node made through a same-host sender's shared memory
    (copied from its mapping, or kept as a mapping of its complete copy)."""
    stats = hg.node_stats()
    return stats["kept_mappings"] + stats["copied_from_mappings"]


def pool_hits() -> int:
    """Buffers this node's pool handed out again."""
    return hg.node_stats()["pool_hits"]


def node_stats() -> dict:
    return hg.node_stats()


#: get results a test asks a worker to keep referring to (`get_and_keep`)
KEPT: list = []


def get_and_keep(name: str) -> int:
    value = hg.get(hg.ObjectID.from_name(name), timeout=60)
    KEPT.append(value)
    return zlib.crc32(value)


def put_error(name: str, size: int) -> str:
    try:
        put_pattern(name, size)
    except hg.HopliteError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def get_error_text(name: str, timeout: float = 30.0) -> str:
    try:
        hg.get(hg.ObjectID.from_name(name), timeout=timeout)
    except hg.HopliteError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def broadcast_and_leave(name: str, size: int, receivers: int) -> tuple[int, int]:
    """A broadcast's root that shuts down as soon as its put returns, once the
    directory has sent `receivers` peers to pull the object (bounded wait):
    the value's checksum, and how many receivers were still filling their copy
    when it left."""
    from hoplite_gpu import collectives

    data = pattern(size, seed=7)
    collectives.broadcast(data, name=name, rank=0, size=receivers + 1)
    oid = hg.ObjectID.from_name(f"{name}/bcast")
    deadline = time.monotonic() + 30
    while True:
        others = [h for h in hg.object_info(oid)["holders"] if h["node"] != hg.node_id()]
        if len(others) >= receivers or time.monotonic() > deadline:
            break
        time.sleep(0.002)
    filling = sum(not h["complete"] for h in others)
    hg.shutdown()
    return zlib.crc32(data), filling


def broadcast_receive(name: str, rank: int, size: int) -> int:
    from hoplite_gpu import collectives

    return zlib.crc32(collectives.broadcast(None, name=name, rank=rank, size=size, timeout=60))


def group_allreduce_loop(name: str, rank: int, size: int, calls: int, nbytes: int) -> dict:
    """`calls` allreduces of `nbytes` through one Group, with no delete:
    this node's held bytes after the loop and after `close`, and whether every
    result was right."""
    group = hg.Group(name, rank=rank, size=size, timeout=120)
    value = np.full(nbytes // 4, rank + 1, dtype=np.float32)
    right = True
    for _ in range(calls):
        out = group.allreduce(value)
        right = right and float(out[0]) == float(out[-1]) == size * (size + 1) / 2
    del out  # (a view of the node's copy)
    held = hg.node_stats()["held_bytes"]
    group.close()
    return {"held": held, "after_close": hg.node_stats()["held_bytes"], "right": right}


def group_tree_broadcasts(name: str, rank: int, size: int, calls: int, nbytes: int) -> dict:
    """`calls` broadcasts of a Group over the 4-member mesh of
    tests/test_multitree.py, then what this node holds."""
    import numpy as np

    import hoplite_gpu as hg
    from hoplite_gpu.topology import from_json

    mesh = from_json({"nodes": [0, 1, 2, 3], "links": [
        {"a": 0, "b": 1, "capacity": 1}, {"a": 0, "b": 2, "capacity": 1},
        {"a": 0, "b": 3, "capacity": 1}, {"a": 1, "b": 2, "capacity": 2},
        {"a": 2, "b": 3, "capacity": 2}, {"a": 1, "b": 3, "capacity": 2}]}, source="mesh")
    right = True
    with hg.Group(name, rank=rank, size=size, topology=mesh, timeout=60) as group:
        for i in range(calls):
            value = (np.arange(nbytes) % (251 - i)).astype(np.uint8)
            got = group.broadcast(value if rank == 0 else None)
            right = right and np.array_equal(got, value)
        held = hg.node_stats()["held_bytes"]
    return {"right": right, "held": held, "after_close": hg.node_stats()["held_bytes"]}


def group_tree_reduces(name: str, rank: int, size: int, calls: int, n: int) -> dict:
    """One `multitree_allreduce` without a group, then `calls` allreduces and
    `calls` reduces (rooted at rank 1) of `n` float32 per rank by a Group
    over the 4-member mesh of tests/test_multitree.py, then one small
    allreduce; whether each result was right, how each group call went
    (`Group._how`), and what this node holds."""
    import numpy as np

    import hoplite_gpu as hg
    from hoplite_gpu.topology import from_json

    mesh = from_json({"nodes": [0, 1, 2, 3], "links": [
        {"a": 0, "b": 1, "capacity": 1}, {"a": 0, "b": 2, "capacity": 1},
        {"a": 0, "b": 3, "capacity": 1}, {"a": 1, "b": 2, "capacity": 2},
        {"a": 2, "b": 3, "capacity": 2}, {"a": 1, "b": 3, "capacity": 2}]}, source="mesh")
    from hoplite_gpu.multitree_reduce import call_ids, multitree_allreduce

    # the same call without a group first; rank 0 frees it once every rank
    # is past the group's first call
    got = multitree_allreduce(np.full(n, rank, np.int32), name=f"{name}-alone", rank=rank,
                              size=size, topology=mesh, op="max", timeout=60)
    right, ways = np.array_equal(got, np.full(n, size - 1)), []
    del got
    with hg.Group(name, rank=rank, size=size, topology=mesh, timeout=60) as group:
        for i in range(calls):
            mine = (np.arange(n) % (13 + i) + rank).astype(np.float32)
            want = sum((np.arange(n) % (13 + i) + r).astype(np.float32) for r in range(size))
            got = group.allreduce(mine)
            ways.append(group._last[2])
            right = right and np.array_equal(got, want) and not got.flags.writeable
            if i == 0 and rank == 0:
                for oid in call_ids(f"{name}-alone", size):
                    hg.delete(oid)
            got = group.reduce(mine, root=1, op="max")
            ways.append(group._last[2])
            right = right and (np.array_equal(got, mine + (size - 1 - rank)) if rank == 1
                               else got is None)
        right = right and np.array_equal(group.allreduce(np.ones(4, np.int64)),
                                         np.full(4, size))
        ways.append(group._last[2])
        held = hg.node_stats()["held_bytes"]
    return {"right": right, "ways": ways, "held": held,
            "after_close": hg.node_stats()["held_bytes"]}


def directory_in_use() -> tuple[str, list[tuple[str, float]]]:
    """The directory this node uses now, and (address, wall time) of each of
    its registrations with one."""
    node = hg.runtime().node
    return node.directory_address, list(node.registrations)


def tree_broadcast_crc(name: str, rank: int, size: int, nbytes: int, seed: int,
                       timeout: float) -> int:
    """One `multitree_broadcast` of `size` ranks over the DGX-1V fixture's
    first `size` GPUs (rank 0 the root); the crc32 of what this rank holds."""
    from hoplite_gpu.multitree import multitree_broadcast
    from hoplite_gpu.topology import fixture

    value = pattern(nbytes, seed) if rank == 0 else None
    got = multitree_broadcast(value, name=name, rank=rank, size=size,
                              topology=fixture("dgx1v"), timeout=timeout)
    return zlib.crc32(np.ascontiguousarray(got).view(np.uint8))


def tree_allreduce_outcome(name: str, rank: int, size: int, n: int,
                           timeout: float) -> tuple[str, float]:
    """One `multitree_allreduce` of `n` int32 (each rank's rank + 1) over the
    DGX-1V fixture's first `size` GPUs: ("right" or the error's type and
    text, seconds it took)."""
    from hoplite_gpu.multitree_reduce import multitree_allreduce
    from hoplite_gpu.topology import fixture

    began = time.monotonic()
    try:
        got = multitree_allreduce(np.full(n, rank + 1, np.int32), name=name, rank=rank,
                                  size=size, topology=fixture("dgx1v"), timeout=timeout)
    except hg.HopliteError as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - began
    right = np.array_equal(got, np.full(n, size * (size + 1) // 2))
    return "right" if right else "wrong", time.monotonic() - began


def tree_reduce_cards_posted(name: str, size: int, timeout: float) -> int:
    """Wait (bounded) until every rank of the multitree reduce or allreduce
    `name` has posted its card; how many there are."""
    from hoplite_gpu.multitree_reduce import call_ids

    cards = call_ids(name, size)[2:]
    for oid in cards:
        hg.get(oid, timeout=timeout)
    return len(cards)


def tree_cards_posted(name: str, size: int, timeout: float) -> int:
    """Wait (bounded) until every rank of the multitree broadcast `name` has
    posted its card; how many there are."""
    from hoplite_gpu.multitree import call_ids

    cards = call_ids(name, size)[1:]
    for oid in cards:
        hg.get(oid, timeout=timeout)
    return len(cards)


def group_placed(name: str, rank: int, size: int, node: object, nbytes: int,
                 clash: object) -> dict:
    """A Group on the 4-member mesh of tests/test_multitree.py whose ranks
    each say only their own node (`node`): one broadcast from rank 1, whether
    it was right and went over the trees, and the members every rank learned.
    Then a second group where this rank says `clash` instead: the error its
    first call raised (type and text), or None."""
    import numpy as np

    import hoplite_gpu as hg
    from hoplite_gpu.topology import from_json

    mesh = from_json({"nodes": [0, 1, 2, 3], "links": [
        {"a": 0, "b": 1, "capacity": 1}, {"a": 0, "b": 2, "capacity": 1},
        {"a": 0, "b": 3, "capacity": 1}, {"a": 1, "b": 2, "capacity": 2},
        {"a": 2, "b": 3, "capacity": 2}, {"a": 1, "b": 3, "capacity": 2}]}, source="mesh")
    value = (np.arange(nbytes) % 253).astype(np.uint8)
    with hg.Group(name, rank=rank, size=size, topology=mesh, node=node, timeout=60) as group:
        got = group.broadcast(value if rank == 1 else None, root=1)
        out = {"right": bool(np.array_equal(got, value)), "how": group._last[2],
               "members": list(group.members)}
    error = None
    group = hg.Group(f"{name}-clash", rank=rank, size=size, topology=mesh, node=clash,
                     timeout=20)
    try:
        group.barrier()
    except hg.HopliteError as exc:
        error = (type(exc).__name__, str(exc))
    finally:
        group.close()
    return {**out, "error": error}
