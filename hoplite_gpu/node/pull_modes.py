"""How a pull's bytes move: one small strategy per pull mode, each with its
receiving side (the puller) and its sending side (the data server).

- `Messages`: the ordinary answer, on every transport: messages of the size
  the puller asked for (its chunk size), each received straight into place,
  with frame headers only for keepalives, an error and the end
  (docs/protocol.md, "Data connections").
- `Staged`: the same messages, for device memory over a host-only
  transport: each lands in pinned host memory and is uploaded from there.
- `SharedCopy`: a same-host sender passes its buffer's descriptor (mode ``F``)
  and then only announces how many more bytes are ready; the puller copies
  them out of the mapping. It may answer ``B`` instead: messages follow.
- `SharedMap`: a same-host sender's complete copy, kept mapped as the
  puller's own (mode ``M``); no byte is copied.

The puller picks its mode once per pull (`receiving_mode`) from the stream's
capabilities (`Stream.caps`); the request it sends names the mode
(`pull_request`, the one place a request is built), and the data server
dispatches on it (`sending_mode`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from hoplite_gpu import device
from hoplite_gpu import messages as m
from hoplite_gpu.config import RELAY_STEP, Config
from hoplite_gpu.directory.wire import raise_for_error
from hoplite_gpu.errors import HopliteError, ObjectNotFound, PeerLost, ProtocolError, Timeout
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.protocol import (
    FRAME,
    FRAME_DATA,
    check_frame,
    recv_error_body,
    recv_frame_header,
    send_error_frame,
    send_msg,
)
from hoplite_gpu.transports import Head, SendWindow, Stream, StreamCaps

from . import shm
from .store import StoredObject

if TYPE_CHECKING:
    from .transfer import DataServer, PeerPool

log = logging.getLogger("hoplite_gpu.transfer")

#: Pipelining granularity. A message carries up to the puller's chunk size,
#: but a relay makes received bytes servable every STEP bytes, and over a
#: byte stream serves them as soon as STEP bytes are ready (a message in
#: parts), so each hop of a chain adds about STEP / B, not chunk / B. On the
#: emulated 8-host, 1 Gbit/s cluster a 256 MiB broadcast took 2.33 s with
#: 1 MiB steps and 2.28 s with 256 KiB (a 7-hop chain fills 4x sooner).
#: (The directory's broadcast model counts in it too: config.RELAY_STEP.)
STEP = RELAY_STEP
#: Message receives a pull keeps posted at once: UCX starts fetching the next
#: message as soon as it is announced, and a byte stream reads on into it
#: without waiting for the pull's task.
POSTED_RECEIVES = 2
#: Copies out of a same-host sender's mapping go in pieces of this size, each
#: servable downstream at once.
SHM_STEP = 1 << 20


class Sink(Protocol):
    """Where a pull's bytes are recorded as they land: the object itself
    (`StoredObject.advance`: its watermark) for a pull that fills it from its
    watermark on, or a sub-flow's cursor in a plan's ledger (`engine.FlowSink`)."""

    def advance(self, ready: int) -> None: ...


# -- the request: built in one place, read in one place ------------------------


def pull_request(oid: ObjectID, offset: int, end: int, stall: float, size: int | None, *,
                 shm: bool = False, map: bool = False) -> m.Pull:
    """The pull request on the wire (docs/protocol.md): `size` is the size of
    the answer's messages (the wire calls it ``bare``; None for a mapping)."""
    return m.Pull(oid=oid.binary, offset=offset, end=end, stall=stall, shm=shm,
                  map=shm and map, bare=size)


@dataclass(frozen=True)
class PullAsk:
    """A pull request as the data server reads it. `size` (the wire's
    ``bare``) and `stall` are kept as sent: each is checked where it is used."""

    oid: ObjectID
    offset: int
    end: int
    stall: Any
    shm: bool
    map: bool
    size: Any

    @classmethod
    def from_wire(cls, req: m.Pull) -> PullAsk:
        return cls(ObjectID(req.oid), req.offset, req.end, req.stall, req.shm, req.map,
                   req.bare)


# -- choosing a mode -----------------------------------------------------------


def receiving_mode(caps: StreamCaps, *, host: bool) -> type[Messages | Staged | SharedCopy]:
    """The mode a puller asks for: over a same-host socket a host object is
    copied out of the sender's mapping; device memory over a host-only
    transport is staged; everything else comes in messages."""
    if host and caps.local:
        return SharedCopy
    if not host and not caps.device:
        return Staged
    return Messages


def sending_mode(ask: PullAsk, caps: StreamCaps) -> type[Messages | SharedCopy | SharedMap]:
    """The mode a request asks the data server for. The same-host modes are
    honoured only on a same-host socket (elsewhere no descriptor can pass)."""
    if ask.shm and caps.local:
        return SharedMap if ask.map else SharedCopy
    return Messages


def sendable(buffer: Any, caps: StreamCaps) -> Any:
    """What to hand a stream for `buffer`'s bytes: a memoryview of host memory,
    the device array itself where the transport moves device memory (UCX), or
    None: device memory over a host-only transport, staged through pinned memory."""
    if not device.is_device_buffer(buffer):
        return memoryview(buffer)
    return buffer if caps.device else None


def raise_peer_error(address: str, body: dict) -> None:
    """An error frame: the object is gone there (ObjectNotFound), or the peer
    cannot serve it for another reason, which for us means that peer is lost."""
    try:
        raise_for_error(body)
    except ObjectNotFound:
        raise
    except HopliteError as exc:
        raise PeerLost(f"{address} could not serve: {type(exc).__name__}: {exc}") from exc
    raise ProtocolError(f"{address} sent an error frame without an error")


# -- the receiving side --------------------------------------------------------


class Receiver:
    """One pull of bytes [pos, end) of `obj` from `address` over `stream`, in
    one mode. `request` is the pull request; `receive` takes the answer,
    recording each piece in `sink` and `on_progress`. Returns whether the
    connection may be reused."""

    def __init__(self, stream: Stream, obj: StoredObject, sink: Sink, pos: int, end: int,
                 address: str, config: Config, on_progress: Callable[[int], None],
                 pool: PeerPool | None = None, message: int = 0) -> None:
        self.stream, self.obj, self.sink = stream, obj, sink
        self.pos, self.end = pos, end
        self.address, self.config, self.on_progress = address, config, on_progress
        self.pool = pool
        self.view = sendable(obj.buffer, stream.caps)
        #: the size of the answer's messages: the chunk size for this object,
        #: or what the pull asks (a striped pull's piece)
        self.size = message or config.chunk_bytes(device.is_device_buffer(obj.buffer))

    def request(self) -> m.Pull:
        return pull_request(self.obj.oid, self.pos, self.end, self.config.stall_timeout_s,
                            self.size)

    async def receive(self) -> bool:
        raise NotImplementedError

    def landed(self, pos: int) -> None:
        self.sink.advance(pos)
        self.on_progress(pos)

    def stalled(self) -> Timeout:
        return Timeout(f"peer {self.address} sent nothing for "
                       f"{self.config.stall_timeout_s:g}s (stall timeout)")

    async def error_frame(self, n: int) -> None:
        """Read an error frame's body (within the stall timeout) and raise it."""
        stall = self.config.stall_timeout_s
        try:
            async with asyncio.timeout(stall):
                body = await recv_error_body(self.stream, n)
        except TimeoutError:
            raise Timeout(f"peer {self.address} sent half an error frame ({stall:g}s)") from None
        raise_peer_error(self.address, body)


class Messages(Receiver):
    """The answer in messages of `size` bytes (the last one the rest), each
    straight into the buffer, `POSTED_RECEIVES` posted at once; between them
    frame headers: keepalives, an error frame, and the end (whose length is
    the bytes sent; over UCX it may pass the last messages). The stall
    timeout counts from the last thing heard: a keepalive, a message, or
    (over a byte stream) a step of a message still coming, so a message
    slower than the stall timeout on a busy link is not taken for a stalled
    sender. An empty range gets no answer at all."""

    async def receive(self) -> bool:
        if self.pos >= self.end:
            return True
        self._loop = asyncio.get_running_loop()
        #: when this pull last heard from its sender (loop time)
        self.heard = self._loop.time()
        start, posted, ended = self.pos, self.pos, False
        flying: collections.deque[tuple[int, int]] = collections.deque()
        step = min(self.size, STEP)
        while True:
            while len(flying) < POSTED_RECEIVES and posted < self.end:
                upto = min(posted + self.size, self.end)
                self.post(posted, upto, step)
                flying.append((posted, upto))
                posted = upto
            if ended and not flying:
                return True
            head = await self.next()
            if head is None:  # the oldest message is in
                at, upto = flying.popleft()
                self.arrived(at, upto)
                log.debug("pull %s: message of %d bytes at %d in", self.obj.oid.hex(),
                          upto - at, at)
                self.pos = upto
                self.landed(upto)
            else:
                ended = await self.on_head(head, self.end - start) or ended

    def post(self, at: int, upto: int, step: int) -> None:
        """Post the receive of the message of bytes [at, upto)."""
        sink, hear = self.sink, self.hear

        def on_step(n: int) -> None:
            hear()
            sink.advance(at + n)

        self.stream.post_message(self.view[at:upto], step=step, on_step=on_step)

    def hear(self, _n: int = 0) -> None:
        """Bytes or a frame came from the sender: the stall timeout starts again."""
        self.heard = self._loop.time()

    def arrived(self, at: int, upto: int) -> None:
        """The message of bytes [at, upto) is in."""

    async def next(self) -> Head | None:
        stall = self.config.stall_timeout_s
        while True:
            try:
                # (recv_next keeps what a cancel interrupts: waiting again loses nothing)
                async with asyncio.timeout_at(self.heard + stall):
                    got = await self.stream.recv_next()
            except Timeout:
                raise  # (ours, from the stream)
            except TimeoutError:
                if self._loop.time() >= self.heard + stall:
                    raise self.stalled() from None
                continue  # (a step of a message came meanwhile)
            self.hear()
            return got

    async def on_head(self, head: Head, total: int) -> bool:
        """A frame header: a keepalive (False), the end (True) or an error frame."""
        kind, n = head
        check_frame(self.stream, kind)
        if kind != FRAME_DATA:
            await self.error_frame(n)
        if n == total:
            return True
        if n:
            raise ProtocolError(f"{self.address} ended an answer of {total} bytes with {n}")
        return False  # a keepalive: the sender is alive, its bytes are not ready yet

    @staticmethod
    async def send(server: DataServer, stream: Stream, obj: StoredObject, ask: PullAsk,
                   stall: float) -> None:
        if await server.refuse_range(stream, obj, ask):
            return
        size = ask.size
        if size is None:  # (a puller that did not say: our own chunk size)
            size = server.config.chunk_bytes(
                device.is_device_buffer(sendable(obj.buffer, stream.caps)))
        if type(size) is not int or size < 1:
            await send_error_frame(stream, "ProtocolError",
                                   f"cannot answer in messages of {size!r} bytes")
            return
        await server._stream_range(stream, obj, ask.offset, ask.end, stall, size)


class Staged(Messages):
    """Messages into device memory over a host-only transport: each lands in
    pinned host memory and is uploaded from there. The wire is `Messages'`,
    so a sender cannot tell: its own side stages (`Pieces`) where its buffer
    is on a device and the transport is not."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.free: list[np.ndarray] = []
        self.staged: collections.deque[np.ndarray] = collections.deque()

    def post(self, at: int, upto: int, step: int) -> None:
        staging = self.free.pop() if self.free else device.staging(self.size)
        self.staged.append(staging)
        # (its steps count as heard; it lands when uploaded)
        self.stream.post_message(memoryview(staging)[:upto - at], step=step, on_step=self.hear)

    def arrived(self, at: int, upto: int) -> None:
        staging = self.staged.popleft()
        device.upload(self.obj.buffer[at:upto], staging)
        self.free.append(staging)


# -- the sending side ----------------------------------------------------------


class Pieces:
    """Where an answer in messages of `size` bytes stands, from `pos` to
    `end`: the next piece to send. Over a byte stream a message goes in parts
    as its bytes become ready (each at least a STEP, or the message's rest);
    over UCX each message goes whole, once all its bytes are."""

    def __init__(self, obj: StoredObject, caps: StreamCaps, pos: int, end: int, size: int,
                 chunk: int) -> None:
        self.obj, self.start, self.pos, self.end, self.size = obj, pos, pos, end, size
        self.src = sendable(obj.buffer, caps)
        self.parts = caps.message_parts
        self.step = min(size, STEP)
        #: device bytes over a host-only transport go through one pinned buffer
        self.staging = None if self.src is not None else device.staging(
            min(size, chunk) if self.parts else size)

    def message_end(self) -> int:
        done = (self.pos - self.start) // self.size + 1
        return min(self.start + done * self.size, self.end)

    def need(self) -> int:
        """How many of the object's bytes must be ready for the next piece."""
        end = self.message_end()
        return min(self.pos + self.step, end) if self.parts else end

    def next(self, ready: int) -> tuple[int, int, bool] | None:
        """The next piece, (start, end, whether it ends its message), that
        the `ready` bytes allow, or None."""
        end = self.message_end()
        if not self.parts:
            upto = end if end <= ready else self.pos
        else:
            upto = min(ready, end)
            if self.staging is not None:
                upto = min(upto, self.pos + len(self.staging))
        if upto <= self.pos:
            return None
        at, self.pos = self.pos, upto
        return at, upto, upto == end

    def payload(self, at: int, upto: int) -> Any:
        if self.staging is None:
            return self.src[at:upto]
        return device.download(self.obj.buffer[at:upto], self.staging)


async def stream_messages(server: DataServer, stream: Stream, obj: StoredObject, pos: int,
                          end: int, size: int, stall: float) -> bool:
    """The sending side of `Messages` and `Staged`: bytes [pos, end) of `obj`
    as they become ready, in messages of `size` bytes, then a data frame
    header whose length is the bytes sent (the end); keepalives while it
    waits. False if it ended with an error frame instead. An empty range is
    answered with nothing."""
    if pos >= end:
        return True
    pieces = Pieces(obj, stream.caps, pos, end, size, server.config.chunk_size)
    # Every message and frame goes out through the window (a staging buffer is
    # reused for each piece, so it allows one send at a time).
    async with SendWindow(stream, 1 if pieces.staging is not None else None) as out:
        while pieces.pos < end:
            if not await server._wait_or_keepalive(out, obj, pieces.need(), stall, pieces.pos):
                return False
            # (bytes ready from here on: past the watermark too, for a range of
            # a copy that several sub-flows fill, such as a tree's of a multi-
            # tree broadcast)
            while (piece := pieces.next(min(obj.ready_from(pieces.pos), end))) is not None:
                if obj.removed is not None:  # dropped, deleted or reclaimed meanwhile
                    await send_error_frame(out, "ObjectNotFound", str(obj.removed))
                    return False
                at, upto, last = piece
                if pieces.parts:
                    await out.send_message_part(pieces.payload(at, upto), last=last)
                else:
                    await out.send_message(pieces.payload(at, upto))
                log.debug("serve %s: %d bytes at %d handed over", obj.oid.hex(), upto - at, at)
                await asyncio.sleep(0)  # let other pulls of this node progress too
        await out.send(FRAME.pack(FRAME_DATA, end - pos))
    return True


async def announce_ready(server: DataServer, stream: Stream, obj: StoredObject, pos: int,
                         end: int, stall: float) -> bool:
    """The sending side of `SharedCopy` (mode ``F``): how many more of bytes
    [pos, end) are ready in the mapping the puller holds, in data frame
    headers, as they become ready. False if it ended with an error frame."""
    step = min(server.config.chunk_size, STEP)
    async with SendWindow(stream) as out:
        while pos < end:
            if not await server._wait_or_keepalive(out, obj, min(pos + step, end), stall, pos):
                return False
            if obj.removed is not None:  # dropped, deleted or reclaimed meanwhile
                await send_error_frame(out, "ObjectNotFound", str(obj.removed))
                return False
            upto = min(obj.ready_from(pos), end)
            await out.send(FRAME.pack(FRAME_DATA, upto - pos))
            pos = upto
            await asyncio.sleep(0)
    return True


class SharedCopy(Receiver):
    """Copy out of a same-host sender's mapping what it announces (mode
    ``F``), or take messages (``B``) where it has nothing to map."""

    def request(self) -> m.Pull:
        return pull_request(self.obj.oid, self.pos, self.end, self.config.stall_timeout_s,
                            self.size, shm=True)

    async def receive(self) -> bool:
        mode, fd = await shm.recv_mode(self.stream, self.config.stall_timeout_s)
        if mode not in (b"F", b"B"):
            if fd is not None:
                os.close(fd)
            raise ProtocolError(f"{self.address} answered a pull with mode {mode!r}")
        if fd is None:
            return await Messages(self.stream, self.obj, self.sink, self.pos, self.end,
                                  self.address, self.config, self.on_progress).receive()
        try:
            mapped = shm.map_readonly(fd, self.end)
        except (OSError, ValueError) as exc:
            raise PeerLost(f"cannot map the buffer {self.address} passed: {exc}") from exc
        if self.pool is not None:
            self.pool.local_pulls += 1
            self.pool.local_bytes += self.end - self.pos
        try:
            await self.copy_announced(memoryview(mapped))
        finally:
            with contextlib.suppress(BufferError):  # (a view still held: freed when collected)
                mapped.close()
        try:  # the sender may reuse its buffer now
            await send_msg(self.stream, m.Copied())
        except HopliteError:  # (then it never will; our copy is complete all the same)
            return False
        return True

    async def copy_announced(self, source: memoryview) -> None:
        """Copy bytes out of a same-host sender's mapping as it announces them."""
        stall = self.config.stall_timeout_s
        view = None
        try:
            view = memoryview(self.obj.buffer).cast("B")
            pos, end = self.pos, self.end
            while pos < end:
                try:
                    async with asyncio.timeout(stall):
                        kind, n = await recv_frame_header(self.stream)
                except TimeoutError:
                    raise self.stalled() from None
                if kind != FRAME_DATA:
                    await self.error_frame(n)
                if n > end - pos:
                    raise ProtocolError(f"{self.address} announced {n} bytes at {pos}; "
                                        f"wanted at most {end - pos}")
                upto = pos + n
                while pos < upto:
                    step = min(SHM_STEP, upto - pos)
                    view[pos:pos + step] = source[pos:pos + step]
                    pos += step
                    self.pos = pos
                    self.landed(pos)
                    await asyncio.sleep(0)  # relays of these bytes can serve them now
        finally:
            source.release()
            if view is not None:
                view.release()

    @staticmethod
    async def send(server: DataServer, stream: Stream, obj: StoredObject, ask: PullAsk,
                   stall: float) -> None:
        valid = 0 <= ask.offset <= ask.end <= obj.size
        mapped = shm.shared_map(obj.buffer) if valid else None
        if mapped is not None:
            mapped.readers += 1  # not reused until the puller says it is done
        done = False
        try:
            try:
                await shm.send_mode(stream, b"B" if mapped is None else b"F",
                                    None if mapped is None else mapped.fd,
                                    server.config.stall_timeout_s)
            except BaseException:
                done = True  # the descriptor never went: nobody reads through it
                raise
            if mapped is None:  # bytes, then
                await Messages.send(server, stream, obj, ask, stall)
                return
            sent = await server._stream_range(stream, obj, ask.offset, ask.end, stall, None)
            if sent:
                await server._await_ack(stream, "copied")
                done = True
        finally:
            if mapped is not None:
                settle(mapped, done)


class SharedMap:
    """A same-host sender's complete copy, kept mapped as ours (mode ``M``),
    or no offer (``N``): then the puller pulls as usual."""

    @staticmethod
    async def take(stream: Stream, oid: ObjectID, nbytes: int, address: str,
                   pool: PeerPool, config: Config) -> tuple[shm.SharedMap | None, bool]:
        """The mapping (or None), and whether `stream` may be reused."""
        await send_msg(stream, pull_request(oid, 0, nbytes, config.stall_timeout_s, None,
                                            shm=True, map=True))
        mode, fd = await shm.recv_mode(stream, config.stall_timeout_s)
        if mode not in (b"M", b"N"):
            if fd is not None:
                os.close(fd)
            raise ProtocolError(f"{address} answered a mapping request with mode {mode!r}")
        if fd is None:
            return None, True
        mapped = shm.map_kept(fd, nbytes)
        if mapped is not None:
            pool.local_maps += 1
        try:  # (failed or not: its count goes down)
            await send_msg(stream, m.Kept())
        except HopliteError:  # the sender went away: what we keep stays valid
            return mapped, False
        return mapped, True

    @staticmethod
    async def send(server: DataServer, stream: Stream, ask: PullAsk, stall: float) -> None:
        """Hand a same-host puller our complete copy to keep mapped as its own."""
        try:
            # We may be a receiver ourselves that has just been asked to relay:
            # one that keeps a mapping creates its copy complete, at once.
            # (Answered before the puller's own wait for the mode runs out.)
            obj = await server.store.wait_for(ask.oid, stall / 2)
        except HopliteError:
            obj = None
        mapped = shm.shared_map(obj.buffer) if obj is not None and obj.complete else None
        if mapped is None or len(mapped) < obj.size:
            await shm.send_mode(stream, b"N", None, server.config.stall_timeout_s)
            return
        # Until it says it holds its own lock, our count (and, if we are not
        # the owner, our own lock: `obj` stays referenced) keeps the pages.
        mapped.readers += 1
        mapped.kept_elsewhere = True
        done = False
        try:
            try:
                await shm.send_mode(stream, b"M", mapped.fd, server.config.stall_timeout_s)
            except BaseException:
                done = True  # the descriptor never went: nobody holds the pages through it
                raise
            await server._await_ack(stream, "kept")
            done = True
        finally:
            settle(mapped, done)


def settle(mapped: shm.SharedMap, done: bool) -> None:
    """A puller we handed `mapped` to is done with it, or never said so."""
    if done:
        mapped.readers -= 1
    else:
        shm.abandon(mapped)
