"""How a pull's bytes move: one small strategy per pull mode, each with its
receiving side (the puller) and its sending side (the data server).

- `Framed`: data frames with their bytes (docs/protocol.md), received in
  steps on a byte stream or whole on a message transport.
- `Staged`: the same frames, for device memory over a host-only transport:
  each chunk goes through pinned host memory.
- `Bare`: one message per chunk and no frame headers (UCX; `Config.bare_pulls`).
- `SharedCopy`: a same-host sender passes its buffer's descriptor (mode ``F``)
  and then only announces how many more bytes are ready; the puller copies
  them out of the mapping. It may answer ``B`` instead: framed bytes follow.
- `SharedMap`: a same-host sender's complete copy, kept mapped as the
  puller's own (mode ``M``); no byte is copied.

The puller picks its mode once per pull (`receiving_mode`) from the stream's
capabilities (`Stream.caps`) and the config; the request it sends names the
mode (`pull_request`, the one place a request is built), and the data server
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

from hoplite_gpu import device
from hoplite_gpu import messages as m
from hoplite_gpu.config import Config
from hoplite_gpu.directory.wire import raise_for_error
from hoplite_gpu.errors import HopliteError, ObjectNotFound, PeerLost, ProtocolError, Timeout
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.protocol import (
    FRAME,
    FRAME_DATA,
    recv_error_body,
    recv_frame_header,
    send_error_frame,
    send_msg,
)
from hoplite_gpu.transports import SendWindow, Stream, StreamCaps

from . import shm
from .store import StoredObject

if TYPE_CHECKING:
    from .transfer import DataServer, PeerPool

log = logging.getLogger("hoplite_gpu.transfer")

#: Pipelining granularity. A frame carries up to `chunk_size` bytes, but a relay
#: makes received bytes servable every STEP bytes and serves as soon as STEP
#: bytes are ready, so each hop of a chain adds about STEP / B, not chunk / B.
#: On the emulated 8-host, 1 Gbit/s cluster a 256 MiB broadcast took 2.33 s
#: with 1 MiB steps and 2.28 s with 256 KiB (a 7-hop chain fills 4x sooner).
STEP = 1 << 18
#: Bare receives a pull keeps posted at once (answers in bare messages).
BARE_RECEIVES = 2
#: Copies out of a same-host sender's mapping go in pieces of this size, each
#: servable downstream at once.
SHM_STEP = 1 << 20


class Sink(Protocol):
    """Where a pull's bytes are recorded as they land: the object itself
    (`StoredObject.advance`: its watermark) for a pull that fills it from its
    watermark on, or a sub-flow's cursor in a plan's ledger (`engine.FlowSink`)."""

    def advance(self, ready: int) -> None: ...


# -- the request: built in one place, read in one place ------------------------


def pull_request(oid: ObjectID, offset: int, end: int, stall: float, *, shm: bool = False,
                 map: bool = False, bare: int | None = None) -> m.Pull:
    """The pull request on the wire (docs/protocol.md)."""
    return m.Pull(oid=oid.binary, offset=offset, end=end, stall=stall, shm=shm,
                  map=shm and map, bare=None if shm else bare)


@dataclass(frozen=True)
class PullAsk:
    """A pull request as the data server reads it. `bare` and `stall` are
    kept as sent: each is checked where it is used."""

    oid: ObjectID
    offset: int
    end: int
    stall: Any
    shm: bool
    map: bool
    bare: Any

    @classmethod
    def from_wire(cls, req: m.Pull) -> PullAsk:
        return cls(ObjectID(req.oid), req.offset, req.end, req.stall, req.shm, req.map,
                   req.bare)


# -- choosing a mode -----------------------------------------------------------


def receiving_mode(caps: StreamCaps, config: Config, *, host: bool, reduce_input: bool,
                   empty: bool) -> type[Framed | Staged | Bare | SharedCopy]:
    """The mode a puller asks for: over a same-host socket a host object is
    copied out of the sender's mapping; device memory over a host-only
    transport is staged; bare messages where the config wants them and the
    transport has them (not for an empty range); else frames."""
    bare = config.bare_pull(not host, reduce_input)
    if host and caps.local:
        return SharedCopy
    if not host and not caps.device:
        return Staged
    if bare and not caps.partial_receive and not empty:
        return Bare
    return Framed


def sending_mode(ask: PullAsk, caps: StreamCaps) -> type[Framed | Bare | SharedCopy | SharedMap]:
    """The mode a request asks the data server for. The same-host modes are
    honoured only on a same-host socket (elsewhere no descriptor can pass)."""
    if ask.shm and caps.local:
        return SharedMap if ask.map else SharedCopy
    if ask.bare is not None:
        return Bare
    return Framed


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
    one mode. `request` is what the mode adds to the pull request; `receive`
    takes the answer, recording each piece in `sink` and `on_progress`.
    Returns whether the connection may be reused."""

    def __init__(self, stream: Stream, obj: StoredObject, sink: Sink, pos: int, end: int,
                 address: str, config: Config, on_progress: Callable[[int], None],
                 pool: PeerPool | None = None) -> None:
        self.stream, self.obj, self.sink = stream, obj, sink
        self.pos, self.end = pos, end
        self.address, self.config, self.on_progress = address, config, on_progress
        self.pool = pool
        self.view = sendable(obj.buffer, stream.caps)

    def request(self) -> dict:
        return pull_request(self.obj.oid, self.pos, self.end, self.config.stall_timeout_s)

    async def receive(self) -> bool:
        raise NotImplementedError

    def landed(self, pos: int) -> None:
        self.sink.advance(pos)
        self.on_progress(pos)

    def stalled(self) -> Timeout:
        return Timeout(f"peer {self.address} sent nothing for "
                       f"{self.config.stall_timeout_s:g}s (stall timeout)")


class Framed(Receiver):
    """Data frames, each received in place (see the module doc)."""

    async def receive(self) -> bool:
        stall = self.config.stall_timeout_s
        while self.pos < self.end:
            pos = self.pos
            try:
                async with asyncio.timeout(stall):
                    kind, n = await recv_frame_header(self.stream)
                    if kind != FRAME_DATA:
                        raise_peer_error(self.address, await recv_error_body(self.stream, n))
                    if n > self.end - pos:
                        raise ProtocolError(f"{self.address} sent {n} bytes at {pos}; "
                                            f"wanted at most {self.end - pos}")
                    if n == 0:
                        continue  # a keepalive: the sender is alive, its bytes are not ready yet
                    await self.take(pos, n)
            except Timeout:
                raise  # the peer reported its own timeout in an error frame
            except TimeoutError:
                raise self.stalled() from None
            log.debug("pull %s: frame of %d bytes at %d in", self.obj.oid.hex(), n, pos)
            self.pos = pos + n
            self.landed(self.pos)
            # sock_recv_into returns without suspending while data keeps
            # coming; yield so the tasks serving this chunk downstream can run
            # now (pipelining) instead of after the whole object arrived.
            await asyncio.sleep(0)
        return True

    async def take(self, pos: int, n: int) -> None:
        """Receive one frame's `n` bytes, which go at `pos`."""
        view = self.view[pos:pos + n]
        if not self.stream.caps.partial_receive:  # whole messages (UCX)
            await self.stream.recv_into(view)
            return
        # A byte stream: in steps, each servable downstream as soon as it is in.
        sink = self.sink
        await self.stream.recv_steps(view, min(self.config.chunk_size, STEP),
                                     lambda upto: sink.advance(pos + upto))

    @staticmethod
    async def send(server: DataServer, stream: Stream, obj: StoredObject, ask: PullAsk,
                   stall: float) -> None:
        if await server.refuse_range(stream, obj, ask):
            return
        await server._stream_range(stream, obj, ask.offset, ask.end, stall)


class Staged(Framed):
    """Framed, into device memory over a host-only transport: each frame
    lands in pinned host memory and is uploaded from there. The wire is
    `Framed`'s, so a sender cannot tell: its own side stages (in
    `stream_frames`) where its buffer is on a device and the transport is not."""

    staging: Any = None

    async def take(self, pos: int, n: int) -> None:
        if self.staging is None:
            self.staging = device.staging(self.config.chunk_size)
        if n > len(self.staging):
            self.staging = device.staging(n)
        await self.stream.recv_into(memoryview(self.staging)[:n])
        device.upload(self.obj.buffer[pos:pos + n], self.staging)


async def stream_frames(server: DataServer, stream: Stream, obj: StoredObject, pos: int,
                        end: int, stall: float, announce: bool = False) -> bool:
    """The sending side of `Framed`, `Staged` and `SharedCopy`: bytes [pos,
    end) of `obj` as they become ready, in chunk-sized frames; with
    `announce` (the puller maps our buffer) only how many more are ready.
    False if it ended with an error frame instead."""
    src = sendable(obj.buffer, stream.caps)
    # Device memory that the transport moves itself goes in device-sized chunks.
    chunk = server.config.chunk_bytes(device.is_device_buffer(src))
    step = min(chunk, STEP)
    staging = device.staging(chunk) if src is None else None  # device bytes over TCP
    # Every frame goes out through the window (a staging buffer is reused
    # for each chunk, so it allows one send at a time).
    async with SendWindow(stream, 1 if staging is not None else None) as out:
        while pos < end:
            if not await server._wait_or_keepalive(out, obj, min(pos + step, end), stall):
                return False
            # Send everything that is ready, in chunk-sized frames.
            upto = min(obj.ready, end)
            while pos < upto:
                if obj.removed is not None:  # dropped, deleted or reclaimed meanwhile
                    await send_error_frame(out, "ObjectNotFound", str(obj.removed))
                    return False
                if announce:
                    await out.send(FRAME.pack(FRAME_DATA, upto - pos))
                    pos = upto
                    break
                n = min(chunk, upto - pos)
                if staging is None:
                    payload = src[pos:pos + n]
                else:
                    payload = device.download(obj.buffer[pos:pos + n], staging)
                await out.send(FRAME.pack(FRAME_DATA, n), payload)
                log.debug("serve %s: frame of %d bytes at %d handed over", obj.oid.hex(), n, pos)
                pos += n
                await asyncio.sleep(0)  # let other pulls of this node progress too
    return True


class Bare(Receiver):
    """An answer in bare messages: each `chunk_bytes` (the last one the rest)
    straight into the buffer, with `BARE_RECEIVES` receives posted at once.

    Heads (keepalives, an error frame, the end marker) are listened for only
    while a message is slow to come (after `poll` seconds), and for the end:
    a receive left posted is polled by ucxx on every turn of the loop, which
    made each 64 MiB message on an H100 take twice as long. Each wait allows
    `stall_timeout_s`; a keepalive starts it again."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.size = self.config.chunk_bytes(device.is_device_buffer(self.obj.buffer))
        self.start, self.ended = self.pos, False
        self.head: asyncio.Future | None = None

    def request(self) -> dict:
        return pull_request(self.obj.oid, self.pos, self.end, self.config.stall_timeout_s,
                            bare=self.size)

    async def receive(self) -> bool:
        # Two receives posted at once: UCX starts fetching the next message as
        # soon as it is announced, without waiting for this loop to post it.
        flying: collections.deque[tuple[int, int, asyncio.Future]] = collections.deque()
        posted = self.pos
        poll = min(self.config.stall_timeout_s / 3, 0.05)

        def post() -> None:
            nonlocal posted
            while len(flying) < BARE_RECEIVES and posted < self.end:
                n = min(self.size, self.end - posted)
                flying.append((posted, n, asyncio.ensure_future(
                    self.stream.recv_message(self.view[posted:posted + n]))))
                posted += n

        try:
            post()
            while flying:
                at, n, data = flying[0]
                done, _ = await asyncio.wait({data}, timeout=poll)
                if not done:  # slow: the sender may be waiting for bytes, or failing
                    await self.wait_heads(data)
                data.result()
                flying.popleft()
                post()
                log.debug("pull %s: bare message of %d bytes at %d in", self.obj.oid.hex(), n, at)
                self.pos = at + n
                self.landed(self.pos)
                await asyncio.sleep(0)  # relays of these bytes can serve them now
            await self.wait_heads(None)
        finally:
            # (Only after a failure: the stream then closes.)
            for pending in [f for _, _, f in flying] + [self.head]:
                if pending is not None and not pending.done():
                    pending.cancel()
                if pending is not None:
                    with contextlib.suppress(BaseException):
                        await pending
        return True

    async def on_head(self) -> None:
        """A head came: a keepalive, the end marker, or an error frame."""
        assert self.head is not None
        kind, n = self.head.result()
        self.head = None
        stall = self.config.stall_timeout_s
        if kind != FRAME_DATA:
            try:
                async with asyncio.timeout(stall):
                    body = await recv_error_body(self.stream, n)
            except TimeoutError:
                raise Timeout(f"peer {self.address} sent half an error frame ({stall:g}s)") from None
            raise_peer_error(self.address, body)
        if n == self.end - self.start:
            self.ended = True  # (it may come before the last messages: lanes are matched apart)
        elif n:
            raise ProtocolError(f"{self.address} ended an answer of {self.end - self.start} "
                                f"bytes with {n}")
        # else a keepalive: the sender is alive, its bytes are not ready yet

    async def wait_heads(self, pending: asyncio.Future | None) -> None:
        """Wait for `pending` (or, None, the end marker) while taking heads."""
        while not (self.ended if pending is None else pending.done()):
            if self.head is None and not self.ended:
                self.head = asyncio.ensure_future(recv_frame_header(self.stream))
            waiting = {f for f in (pending, self.head) if f is not None}
            done, _ = await asyncio.wait(waiting, timeout=self.config.stall_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise self.stalled()
            if self.head is not None and self.head in done:
                await self.on_head()

    @staticmethod
    async def send(server: DataServer, stream: Stream, obj: StoredObject, ask: PullAsk,
                   stall: float, mapped: bool = False) -> None:
        if await server.refuse_range(stream, obj, ask):
            return
        size = ask.bare
        if (type(size) is not int or size < 1 or mapped or ask.offset == ask.end
                or stream.caps.partial_receive or sendable(obj.buffer, stream.caps) is None):
            await send_error_frame(stream, "ProtocolError",
                                   f"cannot answer in bare messages of {size!r} bytes")
            return
        await stream_bare(server, stream, obj, ask.offset, ask.end, size, stall)


async def stream_bare(server: DataServer, stream: Stream, obj: StoredObject, pos: int, end: int,
                      size: int, stall: float) -> bool:
    """Send bytes [pos, end) of `obj` as bare messages of `size` bytes (the
    last one the rest), each once it is ready, then a data frame header
    whose length is the bytes sent: the end of the answer. Heads in
    between are keepalives, or an error frame that ends it instead."""
    src = sendable(obj.buffer, stream.caps)
    start = pos
    async with SendWindow(stream) as out:
        while pos < end:
            upto = min(pos + size, end)
            if not await server._wait_or_keepalive(out, obj, upto, stall):
                return False
            if obj.removed is not None:  # dropped, deleted or reclaimed meanwhile
                await send_error_frame(out, "ObjectNotFound", str(obj.removed))
                return False
            await out.send_message(src[pos:upto])
            log.debug("serve %s: bare message of %d bytes at %d handed over",
                      obj.oid.hex(), upto - pos, pos)
            pos = upto
            await asyncio.sleep(0)  # let other pulls of this node progress too
        await out.send(FRAME.pack(FRAME_DATA, end - start))
    return True


class SharedCopy(Receiver):
    """Copy out of a same-host sender's mapping what it announces (mode
    ``F``), or take frames (``B``) where it has nothing to map."""

    def request(self) -> dict:
        return pull_request(self.obj.oid, self.pos, self.end, self.config.stall_timeout_s,
                            shm=True)

    async def receive(self) -> bool:
        mode, fd = await self.stream.recv_mode(self.config.stall_timeout_s)
        if mode not in (b"F", b"B"):
            if fd is not None:
                os.close(fd)
            raise ProtocolError(f"{self.address} answered a pull with mode {mode!r}")
        if fd is None:
            framed = Framed(self.stream, self.obj, self.sink, self.pos, self.end, self.address,
                            self.config, self.on_progress)
            return await framed.receive()
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
                        body = await recv_error_body(self.stream, n) if kind != FRAME_DATA else None
                except TimeoutError:
                    raise self.stalled() from None
                if body is not None:
                    raise_peer_error(self.address, body)
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
                await stream.send_mode(b"B" if mapped is None else b"F",
                                       None if mapped is None else mapped.fd,
                                       server.config.stall_timeout_s)
            except BaseException:
                done = True  # the descriptor never went: nobody reads through it
                raise
            if ask.bare is not None:  # (never asked with the mode: refused)
                await Bare.send(server, stream, obj, ask, stall, mapped=mapped is not None)
                return
            if await server.refuse_range(stream, obj, ask):
                return
            sent = await server._stream_range(stream, obj, ask.offset, ask.end, stall,
                                              announce=mapped is not None)
            if sent and mapped is not None:
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
        await send_msg(stream, pull_request(oid, 0, nbytes, config.stall_timeout_s,
                                            shm=True, map=True))
        mode, fd = await stream.recv_mode(config.stall_timeout_s)
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
            await stream.send_mode(b"N", None, server.config.stall_timeout_s)
            return
        # Until it says it holds its own lock, our count (and, if we are not
        # the owner, our own lock: `obj` stays referenced) keeps the pages.
        mapped.readers += 1
        mapped.kept_elsewhere = True
        done = False
        try:
            try:
                await stream.send_mode(b"M", mapped.fd, server.config.stall_timeout_s)
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
