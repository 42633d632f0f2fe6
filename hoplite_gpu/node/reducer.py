"""One reduce tree position on a node: fold this node's input and the streams of
its children's partial results, chunk by chunk, into an output object that the
parent (or, at the root, any reader of the result) pulls while it grows.

A position whose children arrive at different times gets one step per group
of them: each early step folds the children that have arrived into a partial
result of its own, which the next step there takes as its input (``early``
in the command), chunk by chunk as it grows."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import numpy as np

from hoplite_gpu import kernels
from hoplite_gpu import messages as m
from hoplite_gpu.config import Config
from hoplite_gpu.device import element_view, is_device_buffer
from hoplite_gpu.directory.reduce_plan import FOLD_STEP, fold_unit
from hoplite_gpu.errors import ObjectNotFound
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.values import Layout, numpy_dtype

from .store import ChunkStore, StoredObject
from .transfer import PeerPool, fetch_range

#: Pull a child's whole stream into a copy of it (`flows.Flows.pull_child`).
PullChild = Callable[[m.StepChild, StoredObject], Awaitable[None]]


async def run_step(step: m.ReduceStep, store: ChunkStore, pool: PeerPool, config: Config,
                   timeout: float, pull: PullChild | None = None) -> StoredObject:
    """Carry out one `reduce_step` command; returns the finished output
    object. `pull` pulls a remote child (by default one flow from its
    address)."""
    layout = Layout.from_wire(step.layout)
    dtype = numpy_dtype(layout)
    own = store.get(ObjectID(step.input))
    if own is None and step.early:
        # The output of this position's early step, which is starting too
        # (it may still be making room for that output).
        own = await store.wait_for(ObjectID(step.input), timeout)
    if own is None:
        raise LookupError(f"input {step.input.hex()} is not held by this node")
    out_oid = ObjectID(step.output)
    out = store.get(out_oid)
    if out is None and not step.children and not step.count:
        # A leaf's partial result is its input: share the input's buffer (both
        # are immutable) instead of copying it into a fresh one.
        out = store.create(out_oid, layout, own.buffer, borrowed=True)
        out.own = True
        if out_oid.binary == step.target:
            out.reduce_tag = step.tag
        await _follow(own, out, timeout)
        return out
    if out is None:
        out = store.create(out_oid, layout)
    out.own = True
    if out_oid.binary == step.target:
        out.reduce_tag = step.tag
    kids, pulls, inplace = [], [], None
    loop = asyncio.get_running_loop()
    for child in step.children:
        oid = ObjectID(child.oid)
        local = store.get(oid)
        if local is not None:
            kids.append(local)
            continue
        if inplace is None and out.ready == 0:
            # The first remote child streams straight into our output buffer, and the
            # fold adds the rest to it in place: one pass over the data fewer than
            # copying our input there first. `out`'s own watermark still guards what
            # the parent may read.
            copy = inplace = StoredObject(oid, layout, out.buffer)
        else:
            # A private copy: not in the store, so the directory never routes anyone to it.
            copy = StoredObject(oid, layout, store.alloc(layout))
        kids.append(copy)
        pulls.append(loop.create_task(
            pull(child, copy) if pull is not None else
            fetch_range(pool, child.address, copy, copy.size, config, lambda _pos: None)))
    try:
        await _fold(own, kids, inplace, out, step.reduce_op, step.count, dtype,
                    config, timeout, pulls)
    finally:
        for task in pulls:
            task.cancel()
        await asyncio.gather(*pulls, return_exceptions=True)
        for kid in kids:
            if kid is not inplace and store.get(kid.oid) is not kid:  # private: reusable
                store.recycle(kid)
    return out


async def _fold(own: StoredObject, kids: list[StoredObject], inplace: StoredObject | None,
                out: StoredObject, op: str, count: int, dtype: np.dtype, config: Config,
                timeout: float, pulls: list[asyncio.Task]) -> None:
    # Host folds go in pieces of at most FOLD_STEP (smaller objects in
    # eighths, `fold_unit`), so the parent can pull each at once; device
    # folds keep whole chunks (fewer kernel launches; a GPU adds fast).
    chunk = config.chunk_bytes(True) if is_device_buffer(out.buffer) \
        else fold_unit(out.size, min(config.chunk_size, FOLD_STEP))
    chunk = max(dtype.itemsize, chunk - chunk % dtype.itemsize)
    for pos in range(out.ready, out.size, chunk):
        end = min(pos + chunk, out.size)
        for src in (own, *kids):
            await _ready_or_failed(src, end, timeout, pulls)
            if src.removed is not None:  # deleted or reclaimed here: its buffer is gone
                raise ObjectNotFound(f"reduce input {src.oid.hex()} left this node during its "
                                     f"step: {src.removed}")
        # On a GPU node these are CuPy views and the kernels run on the device,
        # queued on the current stream before the watermark moves.
        acc, kind = element_view(out.buffer[pos:end], dtype)
        if inplace is None:
            acc[...] = element_view(own.buffer[pos:end], dtype)[0]
        else:  # acc already holds the in-place child's bytes
            kernels.reduce_into(acc, element_view(own.buffer[pos:end], dtype)[0], op, dtype=kind)
        for kid in kids:
            if kid is not inplace:
                kernels.reduce_into(acc, element_view(kid.buffer[pos:end], dtype)[0], op,
                                    dtype=kind)
        if count:
            kernels.finalize(acc, op, count, dtype=kind)
        out.advance(end)
        await asyncio.sleep(0)  # let the parent's pull send what is ready


async def _follow(own: StoredObject, out: StoredObject, timeout: float) -> None:
    """Move `out`'s watermark with its input's (a put may still be copying it)."""
    step = max(FOLD_STEP, out.size // 64)
    while out.ready < out.size:
        await own.wait_ready(min(out.ready + step, out.size), timeout)
        out.advance(own.ready)


async def _ready_or_failed(src: StoredObject, end: int, timeout: float,
                           pulls: list[asyncio.Task]) -> None:
    """Wait for `src` to reach `end`, but fail at once if any child pull failed."""
    if src.ready >= end:
        return
    waiter = asyncio.ensure_future(src.wait_ready(end, timeout))
    try:
        done, _ = await asyncio.wait([waiter, *pulls], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not waiter and task.exception() is not None:
                raise task.exception()
        if waiter in done:
            waiter.result()
        else:
            await waiter
    finally:
        if not waiter.done():
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
