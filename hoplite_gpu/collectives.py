"""Collectives as thin compositions of put / get / reduce, as in the Hoplite paper.

Participants need no group object: they agree on a `name` for this one
collective call (e.g. ``f"grads-step-{step}"``), their `rank` and the `size`.
Object ids are derived from the name, so nobody has to exchange ids. A name must
be used for one call only (objects are immutable); `delete` frees its objects.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from . import api, device
from .errors import InvalidArgument
from .ids import ObjectID


def input_id(name: str, rank: int) -> ObjectID:
    return ObjectID.from_name(f"{name}/in/{rank}")


def _check(rank: int, size: int, root: int = 0) -> None:
    if not (isinstance(size, int) and size >= 1):
        raise InvalidArgument(f"size must be a positive int; got {size!r}")
    for what, r in (("rank", rank), ("root", root)):
        if not (isinstance(r, int) and 0 <= r < size):
            raise InvalidArgument(f"{what} must be an int in [0, {size}); got {r!r}")


def broadcast(value: Any, *, name: str, rank: int, size: int, root: int = 0,
              timeout: float | None = None) -> Any:
    """Root's value on every rank (receiver-driven, pipelined)."""
    _check(rank, size, root)
    oid = ObjectID.from_name(f"{name}/bcast")
    if rank == root:
        api.put(value, oid)
        return value
    return api.get(oid, timeout=timeout)


def _reduce_ids(name: str, size: int, op: str, num_objects: int | None) -> tuple[list, ObjectID]:
    ids = [input_id(name, r) for r in range(size)]
    k = size if num_objects is None else num_objects
    return ids, ObjectID.from_name(f"{name}/reduce/{op}/{k}")


def reduce(value: Any, *, name: str, rank: int, size: int, root: int = 0, op: str = "sum",
           num_objects: int | None = None, timeout: float | None = None) -> Any:
    """The reduction of the first `num_objects` ready values, returned on `root` (None elsewhere)."""
    _check(rank, size, root)
    ids, target = _reduce_ids(name, size, op, num_objects)
    # Idempotent across ranks; the root's own input takes the tree's root, so
    # the result is produced where it is wanted (no extra hop to fetch it).
    api.reduce(ids, op, num_objects=num_objects, object_id=target, root_input=ids[root])
    api.put(value, ids[rank])
    return api.get(target, timeout=timeout) if rank == root else None


# An allreduce of a large array is split into one slice per rank. Slice s is
# reduced with rank s's piece at the tree's root, then every rank pulls every
# reduced slice: a reduce-scatter then an allgather, so each host's link
# carries about 2(N-1)/N * S each way instead of the 2 S of reduce-then-
# broadcast, and the work of every root is spread over all ranks. Smaller
# slices would cost more in per-object messages than they save in bytes.
SLICE_MIN_BYTES = 1 << 20


def allreduce(value: Any, *, name: str, rank: int, size: int, op: str = "sum",
              num_objects: int | None = None, timeout: float | None = None) -> Any:
    """The reduction of every rank's value (or of the first `num_objects` ready), on every rank.

    Arrays of at least `size` MiB are reduced slice by slice (see
    SLICE_MIN_BYTES) and returned as a new array; smaller values, and subset
    reductions (`num_objects` < size, where every slice must use the same
    inputs), are reduced whole and then broadcast while still being reduced.
    Every rank must pass the same dtype and shape, as for any reduce."""
    _check(rank, size)
    if _sliced(value, size, num_objects):
        return _sliced_allreduce(value, name, rank, size, op, timeout)
    ids, target = _reduce_ids(name, size, op, num_objects)
    api.reduce(ids, op, num_objects=num_objects, object_id=target)
    api.put(value, ids[rank])
    return api.get(target, timeout=timeout)


def _sliced(value: Any, size: int, num_objects: int | None) -> bool:
    if size < 2 or num_objects not in (None, size):
        return False
    if not (isinstance(value, np.ndarray) or device.is_device_array(value)):
        return False
    return int(value.nbytes) >= size * SLICE_MIN_BYTES


def _slice_ids(name: str, size: int, op: str, s: int) -> tuple[list[ObjectID], ObjectID]:
    ids = [ObjectID.from_name(f"{name}/in/{r}/slice/{s}") for r in range(size)]
    return ids, ObjectID.from_name(f"{name}/reduce/{op}/{size}/slice/{s}")


def _bounds(n: int, size: int) -> list[tuple[int, int]]:
    """Element ranges of the `size` slices of an array of n elements (equal within one)."""
    q, r = divmod(n, size)
    starts = [s * q + min(s, r) for s in range(size + 1)]
    return list(zip(starts[:-1], starts[1:]))


async def _all(coros: Any) -> list[Any]:
    """Await every coroutine; on the first error cancel the rest (no orphaned pulls)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


def _sliced_allreduce(value: Any, name: str, rank: int, size: int, op: str,
                      timeout: float | None) -> Any:
    rt = api.runtime()
    limit = api._timeout(rt, timeout)
    flat = value.reshape(-1)
    bounds = _bounds(int(flat.shape[0]), size)
    plan = [_slice_ids(name, size, op, s) for s in range(size)]
    # Our own slice first, then the others in ring order so that ranks start on
    # different trees.
    order = [(rank + i) % size for i in range(size)]

    async def run() -> list[Any]:
        await _all(rt.node.reduce(ids, op, size, target, ids[s])
                   for s, (ids, target) in enumerate(plan))
        for s in order:
            lo, hi = bounds[s]
            await rt.node.put(flat[lo:hi], plan[s][0][rank])
        return await _all(rt.node.get(target, limit) for _, target in plan)

    parts = rt.call(run(), limit)
    xp = np if isinstance(parts[0], np.ndarray) else device.cupy()
    return xp.concatenate(parts).reshape(value.shape)


def gather(value: Any, *, name: str, rank: int, size: int, root: int = 0,
           timeout: float | None = None) -> list[Any] | None:
    """Every rank's value, in rank order, on `root` (None elsewhere)."""
    _check(rank, size, root)
    api.put(value, input_id(name, rank))
    if rank != root:
        return None
    return [api.get(input_id(name, r), timeout=timeout) for r in range(size)]


def delete(name: str, *, size: int, op: str = "sum", num_objects: int | None = None) -> None:
    """Free every object that one call named `name` made (its inputs, a
    broadcast value, a reduce's result, an allreduce's slices), on every node.
    Call it once, from any rank, after every rank has its result: a training
    loop that deletes step k-1 at step k keeps its memory flat, and the freed
    buffers are reused."""
    _check(0, size)
    ids, target = _reduce_ids(name, size, op, num_objects)
    oids = [ObjectID.from_name(f"{name}/bcast"), target, *ids]
    if num_objects in (None, size):
        for s in range(size):
            slice_ids, slice_target = _slice_ids(name, size, op, s)
            oids += [slice_target, *slice_ids]
    rt = api.runtime()

    async def run() -> None:
        await _all(rt.node.delete(oid) for oid in oids)

    rt.call(run(), rt.config.timeout_s)


def allgather(value: Any, *, name: str, rank: int, size: int,
              timeout: float | None = None) -> list[Any]:
    """Every rank's value, in rank order, on every rank."""
    _check(rank, size)
    api.put(value, input_id(name, rank))
    return [api.get(input_id(name, r), timeout=timeout) for r in range(size)]
