"""The chunk store: one buffer per object with a "bytes ready" watermark.

Bytes below the watermark are final and may be served to peers while the rest
is still arriving; waiters are futures keyed by the watermark they need, woken
by `advance` (never polled). A pull of one sub-flow moves the watermark
itself; one of several records its pieces in the object's `Ledger` (bytes
past the watermark too), whose prefix is the watermark. All methods run on
the node's event loop thread.
"""

from __future__ import annotations

import asyncio
import errno
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hoplite_gpu import device
from hoplite_gpu.errors import ObjectNotFound, StoreFull, Timeout
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.timers import Expired, until
from hoplite_gpu.values import Layout

from .plan import Ledger
from .pool import BufferPool, touched_buffer


@dataclass(eq=False)
class StoredObject:
    oid: ObjectID
    layout: Layout
    buffer: Any  # 1-D uint8, layout.nbytes long: a NumPy array, or CuPy for device objects
    ready: int = 0
    error: BaseException | None = None
    #: For a reduce result: the tree it came from, until the directory confirms
    #: that tree finished (a `get` hands the copy out only then).
    reduce_tag: bytes | None = None
    #: Why the store let go of it (a drop's reason), once it has.
    removed: BaseException | None = None
    #: Its buffer is a caller's memory, lent for one call (`Node.put(lend=True)`).
    lent: bool = False
    #: Its buffer is a caller's memory to be filled (`Node.receive_into`).
    receiving: bool = False
    #: Put or made here (a put, a reduce step's output), not pulled: never evicted.
    own: bool = False
    #: Its bytes count against the store's limit: host memory it holds that is
    #: neither a caller's nor another object's buffer.
    counted: bool = False
    #: When this node last made or read it (monotonic): eviction goes oldest first.
    used: float = 0.0
    #: The bytes written, past the watermark too, while a plan of several
    #: sub-flows fills it (`engine.run_plan`); None: only [0, ready) is.
    ledger: Ledger | None = None
    _waiters: list[tuple[int, asyncio.Future]] = field(default_factory=list)
    #: waits for bytes past the watermark: (start, need, future) (`wait_range`)
    _range_waiters: list[tuple[int, int, asyncio.Future]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.buffer)

    @property
    def complete(self) -> bool:
        return self.ready >= self.size and self.error is None

    def advance(self, ready: int) -> None:
        """Bytes [0, ready) are now final; wake everyone waiting for at most that."""
        if ready <= self.ready:
            return
        self.ready = min(ready, self.size)
        keep = []
        for need, fut in self._waiters:
            if need <= self.ready:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((need, fut))
        self._waiters = keep
        if self._range_waiters:
            self.landed()

    def ready_from(self, start: int) -> int:
        """Where the bytes written from `start` on end: the watermark for a
        start below it, else the end of the ledger's run that holds `start`
        (`start` itself if none does). A relay of one range of a plan-filled
        copy (a tree of a multi-tree broadcast) serves up to there."""
        if start <= self.ready:
            return self.ready
        return start if self.ledger is None else self.ledger.run_end(start)

    def landed(self) -> None:
        """Bytes past the watermark were written (a plan's sub-flow): wake
        the waits of ranges now written."""
        if not self._range_waiters:
            return
        keep = []
        for start, need, fut in self._range_waiters:
            if self.ready_from(start) >= need:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((start, need, fut))
        self._range_waiters = keep

    async def wait_range(self, start: int, need: int, timeout: float) -> None:
        """Wait until bytes [start, need) are written (`wait_ready` where
        `start` is under the watermark)."""
        if start <= self.ready:
            return await self.wait_ready(need, timeout)
        need = min(need, self.size)
        if self.error is not None:
            raise self.error
        if self.ready_from(start) >= need:
            return
        fut = asyncio.get_running_loop().create_future()
        self._range_waiters.append((start, need, fut))
        try:
            await until(fut, time.monotonic() + timeout)
        except Expired:
            raise Timeout(
                f"object {self.oid.hex()}: waited {timeout:g}s for bytes {start} to {need}, "
                f"only up to {self.ready_from(start)} arrived") from None
        finally:
            if not fut.done():
                fut.cancel()
            self._range_waiters = [w for w in self._range_waiters if w[2] is not fut]

    def fail(self, exc: BaseException) -> None:
        """The object will never fill: every waiter gets `exc`."""
        self.error = exc
        for fut in [f for _, f in self._waiters] + [f for _, _, f in self._range_waiters]:
            if not fut.done():
                fut.set_exception(exc)
        self._waiters, self._range_waiters = [], []

    def reset(self, ready: int = 0) -> None:
        """Roll the watermark back (a partial result is being rebuilt)."""
        self.ready = min(ready, self.ready)
        self.error = None
        self.ledger = None

    async def wait_ready(self, need: int, timeout: float) -> None:
        need = min(need, self.size)
        if self.error is not None:
            raise self.error
        if self.ready >= need:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((need, fut))
        try:
            await until(fut, time.monotonic() + timeout)  # (a relay waits once per step)
        except Expired:
            raise Timeout(
                f"object {self.oid.hex()}: waited {timeout:g}s for {need} bytes, "
                f"only {self.ready} of {self.size} arrived"
            ) from None
        finally:
            if not fut.done():
                fut.cancel()
            self._waiters = [w for w in self._waiters if w[1] is not fut]


_RELEASED = np.empty(0, dtype=np.uint8)


class ChunkStore:
    """Objects this node holds, complete or partial."""

    def __init__(self, pool_bytes: int = 0, shared: bool = False) -> None:
        self._objects: dict[ObjectID, StoredObject] = {}
        self._appear: dict[ObjectID, list[asyncio.Future]] = {}
        #: Bytes of the counted objects (see `StoredObject.counted`), and of
        #: objects about to be made that room was made for (`Memory.room`).
        self.held = 0
        self.reserved = 0
        #: `shared`: large host buffers are memfd mappings that pulls from
        #: this host can map (`shm`)
        self.pool = BufferPool(pool_bytes, shared)
        #: sizes of the buffers `prepare` is making; set once closed
        self._preparing: set[int] = set()
        self._closed = False

    async def prepare(self, nbytes: int) -> bool:
        """Keep a buffer of `nbytes`, its pages already touched, free in the
        pool for the next object of that size (a weight channel's next
        version), unless one is free already or the pool's budget is full:
        the page faults of fresh memory are paid now, in a thread, instead of
        while the object arrives. Whether one was made."""
        if nbytes in self._preparing or not self.pool.wants(nbytes):
            return False
        self._preparing.add(nbytes)
        try:
            # (in a list the futures hold: the pool keeps only a buffer nothing else refers to)
            box = await asyncio.to_thread(lambda: [touched_buffer(nbytes, self.pool.shared)])
            buffer = box.pop()
            return not self._closed and self.pool.wants(nbytes) and self.pool.release(buffer)
        finally:
            self._preparing.discard(nbytes)

    def recycle(self, obj: StoredObject) -> None:
        """Give `obj`'s buffer back to the pool. One still referred to (a
        send under way, a caller's view) is tracked as lent instead, and taken
        back once they let go (`BufferPool.acquire`). The object is left with
        an empty buffer, so a late reader fails loudly instead of seeing
        another object's bytes."""
        buffer, obj.buffer = obj.buffer, _RELEASED
        if not device.is_device_buffer(buffer):  # CuPy's memory pool reuses device memory
            if not self.pool.release(buffer):
                self.pool.lend(buffer)

    def __contains__(self, oid: ObjectID) -> bool:
        return oid in self._objects

    def __len__(self) -> int:
        return len(self._objects)

    def objects(self) -> list[StoredObject]:
        return list(self._objects.values())

    def get(self, oid: ObjectID) -> StoredObject | None:
        return self._objects.get(oid)

    def alloc(self, layout: Layout) -> Any:
        """A buffer for an object of `layout`: device memory for a device object
        when this process has a GPU, else a (pooled) host buffer."""
        if not self.on_host(layout):
            return device.empty(layout.nbytes)
        try:
            return self.pool.acquire(layout.nbytes)
        except (MemoryError, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno != errno.ENOMEM:
                raise
            raise StoreFull(
                f"this machine has no memory for an object of {layout.nbytes} bytes ({exc}); "
                "delete objects you no longer need, or set HOPLITE_STORE_BYTES so that this "
                "node evicts copies held elsewhere before it runs out") from None

    @property
    def used(self) -> int:
        """Bytes that count against the limit: held and reserved."""
        return self.held + self.reserved

    @staticmethod
    def on_host(layout: Layout) -> bool:
        """Whether an object of `layout` is held in host memory here."""
        return layout.kind != "device" or not device.gpu_present()

    def create(self, oid: ObjectID, layout: Layout, buffer: Any = None, *,
               borrowed: bool = False) -> StoredObject:
        """Hold a new object. `borrowed`: `buffer` is memory the store does not
        own (a caller's array, another object's buffer), so it does not count
        against the limit."""
        if buffer is None:
            buffer = self.alloc(layout)
        elif layout.kind == "device" and device.gpu_present() and \
                not device.is_device_buffer(buffer):
            buffer = device.from_host(buffer)  # an inline device object: back on the GPU
        obj = StoredObject(oid, layout, buffer, used=time.monotonic())
        if not borrowed and not device.is_device_buffer(buffer):
            obj.counted = True
            self.held += layout.nbytes
        self._objects[oid] = obj
        for fut in self._appear.pop(oid, []):
            if not fut.done():
                fut.set_result(None)
        return obj

    def remove(self, oid: ObjectID, reason: BaseException | None = None) -> StoredObject | None:
        obj = self._objects.pop(oid, None)
        if obj is not None:
            if obj.counted:
                self.held -= obj.layout.nbytes
            obj.removed = reason or ObjectNotFound(f"object {oid.hex()} was dropped from this node")
            if not obj.complete:
                obj.fail(obj.removed)
            self.recycle(obj)
        return obj

    def evictable(self, busy: Any = ()) -> list[StoredObject]:
        """Copies this node could free, least recently used first: complete,
        pulled (not put or made here), counted against the limit, and used
        by nobody (no reader's view, no send in progress, not read or made
        by a reduce step: `busy`). The directory has the last word."""
        found = [obj for oid, obj in self._objects.items()
                 if obj.counted and not obj.own and obj.complete and obj.reduce_tag is None
                 and oid not in busy
                 # 2: the object's reference and getrefcount's argument
                 and sys.getrefcount(obj.buffer) <= 2]
        found.sort(key=lambda obj: obj.used)
        return found

    async def wait_for(self, oid: ObjectID, timeout: float) -> StoredObject:
        """Wait for `oid` to be created here (a peer may ask before our own reply arrives)."""
        obj = self._objects.get(oid)
        if obj is not None:
            return obj
        fut = asyncio.get_running_loop().create_future()
        self._appear.setdefault(oid, []).append(fut)
        try:
            await until(fut, time.monotonic() + timeout)
        except Expired:
            raise ObjectNotFound(f"object {oid.hex()} is not held by this node") from None
        finally:
            waiters = self._appear.get(oid)
            if waiters and fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    del self._appear[oid]
        obj = self._objects.get(oid)
        if obj is None:  # made and removed again before this waiter ran
            raise ObjectNotFound(f"object {oid.hex()} is not held by this node")
        return obj

    def close(self, reason: BaseException) -> None:
        self._closed = True
        for oid in list(self._objects):
            self.remove(oid, reason)
        for futs in self._appear.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(reason)
        self._appear.clear()
