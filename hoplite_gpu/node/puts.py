"""The puts a node runs: a caller's value stored here (copied, or lent) and
registered with the directory."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import numpy as np

from hoplite_gpu import device
from hoplite_gpu import messages as m
from hoplite_gpu.config import Config
from hoplite_gpu.errors import (
    DirectoryUnavailable,
    HopliteError,
    InvalidArgument,
    ObjectExists,
    ObjectNotFound,
    Timeout,
)
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.timers import Expired, until
from hoplite_gpu.values import Layout, fingerprint, fingerprint_windows, host_nbytes, to_buffer

from .holdings import complete_msg
from .memory import beyond_limit
from .retry import Retry
from .store import ChunkStore, StoredObject
from .transfer import DataServer

log = logging.getLogger("hoplite_gpu.node")


class Puts:
    """Stores and registers callers' values, one put of an id at a time.
    `request` and `post` reach the directory; `room` and `trim_soon` keep the
    store within its limit (`Memory`); `let_go(oid, reason)` removes a copy
    and tells the directory, `forget(oid, reason)` ends everything of an id
    here, `stop_serving(oid)` stops the serves of a copy that left the
    store; `check_open` raises once the node is closed."""

    def __init__(self, store: ChunkStore, server: DataServer, config: Config, *,
                 request: Callable[[Any, float], Awaitable[dict]],
                 post: Callable[[m.Message], None],
                 room: Callable[[Layout, str], AbstractAsyncContextManager[None]],
                 trim_soon: Callable[[], None],
                 let_go: Callable[..., None],
                 forget: Callable[[ObjectID, BaseException], None],
                 stop_serving: Callable[[ObjectID], None],
                 check_open: Callable[[], None]) -> None:
        self.store, self.server, self.config = store, server, config
        self._request, self._post = request, post
        self._room, self._trim_soon = room, trim_soon
        self._let_go, self._forget, self._stop_serving = let_go, forget, stop_serving
        self._check_open = check_open
        #: puts under way here, each ended (set) when it has (`put`)
        self._puts: dict[ObjectID, asyncio.Future] = {}

    def making(self, oid: ObjectID) -> bool:
        """Whether a put of `oid` is under way here."""
        return oid in self._puts

    async def put(self, value: Any, oid: ObjectID, *, lend: bool = False,
                  timeout: float | None = None, same_bytes: bool = False) -> ObjectID:
        """Store `value` as `oid` and register it, the directory's answer awaited
        for `timeout` seconds (default `timeout_s`). With `lend`, a host array's own
        memory backs the object instead of a copy: the caller must leave the
        array unchanged until it calls `reclaim(oid)`, which ends the object here.
        A blocking collective lends its input for the length of the call.
        An id held here already returns at once if the layout is the same;
        with `same_bytes` (the public `put`), other host bytes raise
        ObjectExists, as the directory answers a put from another node. (A
        collective called again under its name returns its first objects.)"""
        self._check_open()
        self._check_size(value, oid, lend)
        buf, layout = to_buffer(value)
        running = self._puts.get(oid)
        if running is not None:
            # Another put of this id is under way here: its outcome decides
            # ours (done: so is this one; given up: this one puts the value).
            try:
                await until(asyncio.shield(running), time.monotonic() + self.config.timeout_s)
            except Expired:
                raise Timeout(f"put of object {oid.hex()}: another put of it here did not "
                              f"end within {self.config.timeout_s:g}s") from None
            return await self.put(value, oid, lend=lend, timeout=timeout, same_bytes=same_bytes)
        existing = self.store.get(oid)
        if existing is not None and self._put_finds(existing, layout, buf, same_bytes):
            return oid
        inline = layout.nbytes <= self.config.inline_threshold
        if inline and device.is_device_buffer(buf):
            buf = memoryview(device.to_host(buf))
        # Device values are always copied: a copy is queued on the producer's
        # stream (see `_fill`), lent device memory could be read before it is written.
        lent = lend and not inline and not device.is_device_buffer(buf)
        data = (np.frombuffer(bytearray(buf), dtype=np.uint8) if inline
                else np.frombuffer(buf, dtype=np.uint8) if lent else None)
        if data is None:
            async with self._room(layout, f"put of object {oid.hex()}"):
                if self.store.get(oid) is not None:  # put here meanwhile, by another call
                    return await self.put(value, oid, lend=lend, timeout=timeout,
                                          same_bytes=same_bytes)
                obj = self.store.create(oid, layout)
        else:
            obj = self.store.create(oid, layout, data, borrowed=lent)
            self._trim_soon()
        obj.lent = lent
        obj.own = True
        if inline or lent:
            obj.advance(obj.size)
        ended = self._puts[oid] = asyncio.get_running_loop().create_future()
        try:
            return await self._register(obj, buf, inline, lent, timeout)
        finally:
            del self._puts[oid]
            ended.set_result(None)

    async def put_pieces(self, oid: ObjectID, nbytes: int,
                         pieces: Sequence[tuple[int, memoryview]], *,
                         timeout: float | None = None,
                         registered: Callable[[], None] | None = None) -> ObjectID:
        """Store one host object of `nbytes` bytes laid out from `pieces`,
        (offset, bytes) in offset order, every other byte zero, and register
        it as `put` does. Each piece is copied once, straight into the store's
        own buffer (pooled, mappable by pullers on this host): a value made
        of many arrays, a weight channel's version, is put without first
        being assembled in memory of its own. As with `put`, the object is
        registered before its bytes are copied in (`registered()` is called
        then) and pullers stream its front while the rest is copied; the
        pieces are read until this returns. The id must be new here."""
        self._check_open()
        layout = Layout("numpy", "|u1", (nbytes,), nbytes)
        if nbytes <= self.config.inline_threshold:  # (travels inline: a small copy)
            return await self.put(_assembled(nbytes, pieces, 0, nbytes), oid, timeout=timeout)
        if oid in self._puts or self.store.get(oid) is not None:
            raise ObjectExists(f"object {oid.hex()} is already here: a put of pieces needs "
                               "a new id")
        _check_pieces(oid, nbytes, pieces)
        async with self._room(layout, f"put of object {oid.hex()}"):
            obj = self.store.create(oid, layout)
        obj.own = True
        ended = self._puts[oid] = asyncio.get_running_loop().create_future()
        try:
            # (the bytes the registration's fingerprint reads, ahead of the rest)
            for start, stop in fingerprint_windows(nbytes):
                obj.buffer[start:stop] = _assembled(nbytes, pieces, start, stop)
            return await self._register(obj, memoryview(obj.buffer), False, False, timeout,
                                        fill=lambda: self._fill_pieces(obj, pieces),
                                        registered=registered)
        finally:
            del self._puts[oid]
            ended.set_result(None)

    async def _fill_pieces(self, obj: StoredObject,
                           pieces: Sequence[tuple[int, memoryview]]) -> None:
        """Copy `pieces` into `obj`'s buffer in offset order and zero the gaps
        between them, moving the watermark and letting the loop run after
        every chunk's worth of bytes."""
        dst, chunk = obj.buffer, self.config.chunk_size
        at = 0
        for offset, piece in pieces:
            src = np.frombuffer(piece, dtype=np.uint8)
            dst[at:offset] = 0
            for start in range(0, src.nbytes, chunk):
                stop = min(start + chunk, src.nbytes)
                dst[offset + start:offset + stop] = src[start:stop]
                if offset + stop - obj.ready >= chunk:
                    obj.advance(offset + stop)
                    await asyncio.sleep(0)
            at = offset + src.nbytes
        dst[at:] = 0
        obj.advance(obj.size)

    def _check_size(self, value: Any, oid: ObjectID, lend: bool) -> None:
        """Refuse a host value larger than the whole store limit before any
        work: `to_buffer` would first make a contiguous copy of a
        non-contiguous one (seconds for gigabytes), only for the store to
        refuse it. (A lent value is not copied into the store; an inline one
        is not counted.)"""
        limit = self.config.store_bytes
        if not limit or lend:
            return
        need = host_nbytes(value)
        if need is not None and need > max(limit, self.config.inline_threshold):
            raise beyond_limit(f"put of object {oid.hex()}", need, limit)

    def _put_finds(self, existing: StoredObject, layout: Layout, buf: memoryview,
                   same_bytes: bool) -> bool:
        """Whether a put finds its object here already (then it is done), or
        ObjectExists where that holds other bytes; False: a copy a get here
        is still pulling, which the put's value replaces."""
        oid = existing.oid
        if existing.layout != layout:
            raise ObjectExists(f"object {oid.hex()} already exists here with layout {existing.layout}")
        if (same_bytes and existing.complete and not device.is_device_buffer(existing.buffer)
                and not device.is_device_buffer(buf)
                and fingerprint(existing.buffer) != fingerprint(buf)):
            raise ObjectExists(f"object {oid.hex()} already exists here with other bytes; "
                               "objects are immutable: use a new ObjectID (or delete it "
                               "first)")
        if existing.complete or existing.own or existing.receiving:
            return True
        # A copy a get here is still pulling: the put's value takes its
        # place (a get that gave up would otherwise take the value with it);
        # the get asks again and finds the put's copy.
        self._forget(oid, Retry(f"object {oid.hex()} was put here while being pulled"))
        self._post(m.Dropped(oid=oid.binary))
        return False

    async def _register(self, obj: StoredObject, buf: memoryview, inline: bool,
                        lent: bool, timeout: float | None = None,
                        fill: Callable[[], Awaitable[None]] | None = None,
                        registered: Callable[[], None] | None = None) -> ObjectID:
        """The rest of a put: register `obj` and copy its value in (`fill`:
        how, if not from `buf`; `registered`: told once the directory has
        the object)."""
        oid, layout = obj.oid, obj.layout
        # (device bytes are not sampled: it would wait for their producer;
        # inline ones have one too, for nodes of another inline threshold)
        msg = m.Put(rid=0, oid=oid.binary, size=layout.nbytes, layout=layout.to_wire(),
                    inline=bytes(buf) if inline else None,
                    print_=None if device.is_device_buffer(buf) else fingerprint(buf))
        try:
            await self._request(msg, self.config.timeout_s if timeout is None else timeout)
        except (Timeout, DirectoryUnavailable, asyncio.CancelledError):
            self._let_go(oid)  # unanswered: in case the put did register
            raise
        except HopliteError as exc:
            # Refused (e.g. ObjectExists): the directory registered nothing of
            # this put, so there is nothing to withdraw; a `dropped` now could
            # instead cancel what a get of the id here has since been given.
            if self.store.get(oid) is obj:
                self.store.remove(oid, exc)
                self._stop_serving(oid)
            raise
        except BaseException:
            self._let_go(oid)
            raise
        log.debug("put %s: registered (%d bytes)", oid.hex(), layout.nbytes)
        if registered is not None:
            registered()
        if self.store.get(oid) is not obj:
            # Reclaimed meanwhile (its "dropped" follows our put to the
            # directory), or deleted right after the put: nothing to copy or
            # announce.
            return oid
        if not inline:
            if not lent:
                try:
                    await (self._fill(obj, buf) if fill is None else fill())
                except BaseException:
                    # Given up half-way (cancelled, past its deadline): a partial
                    # copy left here would never complete, yet a later put of the
                    # id would take it for its own and readers would wait on it.
                    if self.store.get(oid) is obj:
                        self._let_go(oid, ObjectNotFound(
                            f"the put of object {oid.hex()} was given up before its value "
                            "was copied; put it again"))
                    raise
            if self.store.get(oid) is not obj:
                return oid  # deleted while it was being copied
            self._post(complete_msg(obj))
            log.debug("put %s: complete", oid.hex())
        return oid

    def is_lent(self, oid: ObjectID) -> bool:
        """Whether `oid` is here as a `put(lend=True)` of a caller's memory."""
        obj = self.store.get(oid)
        return obj is not None and obj.lent

    async def reclaim(self, oid: ObjectID) -> None:
        """End the loan of a `put(lend=True)`: the object leaves this node (the
        directory forgets it), and this returns once no peer reads the caller's
        memory any more. After a finished reduce nobody is reading it; after a
        failed call a parent may still be pulling it, and that pull is stopped
        (the reduce then lacks the input, as if its task had died). A put still
        registering sees that and stops; objects not lent are left alone."""
        if self.is_lent(oid):
            self._let_go(oid, ObjectNotFound(
                f"object {oid.hex()} was an input lent to a collective call that has returned"))
            # A peer that reads stops at its next frame; one that does not is
            # cut off after a second, well within the blocking call's grace.
            await self.server.release(oid, min(1.0, self.config.stall_timeout_s))

    async def _fill(self, obj: StoredObject, src: memoryview) -> None:
        """Copy a put value in chunk-sized steps; peers pull the front while we copy the rest."""
        # A device value is copied on the device, queued on this thread's stream
        # after the work that produced it (see hoplite_gpu.device on stream order).
        on_device = device.is_device_buffer(src)
        srcarr = src if on_device else np.frombuffer(src, dtype=np.uint8)
        dst, chunk = obj.buffer, self.config.chunk_bytes(on_device)
        for start in range(0, obj.size, chunk):
            stop = min(start + chunk, obj.size)
            dst[start:stop] = srcarr[start:stop]
            obj.advance(stop)
            await asyncio.sleep(0)


def _check_pieces(oid: ObjectID, nbytes: int, pieces: Sequence[tuple[int, memoryview]]) -> None:
    at = 0
    for offset, piece in pieces:
        n = memoryview(piece).nbytes
        if offset < at or offset + n > nbytes:
            raise InvalidArgument(f"put of object {oid.hex()}: a piece of {n} bytes at {offset} "
                                  f"overlaps another or ends past the object's {nbytes} bytes")
        at = offset + n


def _assembled(nbytes: int, pieces: Sequence[tuple[int, memoryview]], start: int,
               stop: int) -> np.ndarray:
    """Bytes [start, stop) of what `pieces` lay out, gaps zero (a small
    object sent inline, or the bytes a fingerprint reads)."""
    out = np.zeros(stop - start, dtype=np.uint8)
    for offset, piece in pieces:
        src = np.frombuffer(piece, dtype=np.uint8)
        if offset + src.nbytes > nbytes:
            raise InvalidArgument(f"a piece of {src.nbytes} bytes at {offset} ends past the "
                                  f"object's {nbytes} bytes")
        lo, hi = max(start, offset), min(stop, offset + src.nbytes)
        if lo < hi:
            out[lo - start:hi - start] = src[lo - offset:hi - offset]
    return out
