"""The data plane: a server that streams byte ranges of complete *and partial*
objects as their bytes become ready, and the client side that pulls a range
straight into the destination buffer.

Wire: after the handshake the puller sends ``{"op": "pull", "oid", "offset",
"end", "stall"}``; the server answers with frames (see `protocol.FRAME`): data frames
in order until ``end``, or one error frame. ``stall`` is the puller's stall
timeout: the server's keepalives come at least three times within it, even
where the server's own is longer. A connection serves one pull at a
time and goes back to the pool afterwards.

Between nodes on one host (`shm`) the pull goes over a Unix socket and may
carry ``"shm": true``; the server then answers with one byte first: ``F``
with the buffer's file descriptor attached, after which each data frame's
length says how many more bytes are ready in the mapping and no payload
follows, or ``B``: frames as above, with their bytes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from hoplite_gpu import device
from hoplite_gpu.auth import client_handshake, server_handshake
from hoplite_gpu.config import Config
from hoplite_gpu.directory.wire import raise_for_error
from hoplite_gpu.errors import (
    ConnectionRefused,
    HopliteError,
    ObjectNotFound,
    PeerLost,
    ProtocolError,
    Timeout,
)
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.protocol import (
    FRAME,
    FRAME_DATA,
    SMALL_MESSAGE,
    field,
    recv_error_body,
    recv_frame_header,
    recv_msg,
    send_error_frame,
    send_msg,
)
from hoplite_gpu.transports import SendWindow, Stream, get_backend, split_address

from . import shm
from .store import ChunkStore, StoredObject

log = logging.getLogger("hoplite_gpu.transfer")
T = TypeVar("T")

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
#: Idle connections a node keeps to one peer, and to all peers together (the
#: longest idle are closed first): a connection is kept for the next pull
#: from that peer, but not every one that was ever open at once.
IDLE_PER_PEER = 4
IDLE_TOTAL = 64
#: Ids a data server remembers as dropped here (see `DataServer.dropped_here`).
_DROPPED_KEPT = 4096


class DataServer:
    """Serves this node's objects to peers, chunk by chunk, as bytes become ready."""

    def __init__(self, store: ChunkStore, token: str, config: Config) -> None:
        self.store = store
        self.token = token
        self.config = config
        self._listener = None
        self.address = ""
        #: oid -> the tasks serving a pull of it now (see `release`).
        self._serving: dict[ObjectID, set[asyncio.Task]] = {}
        #: this host's Unix socket for pulls through shared memory, and its connections
        self._local: socket.socket | None = None
        #: when a failed same-host accept was last logged (loop time)
        self._accept_warned = float("-inf")
        self._local_tasks: set[asyncio.Task] = set()
        #: ids that left this node's store lately (at most `_DROPPED_KEPT`)
        self._dropped: collections.OrderedDict[ObjectID, None] = collections.OrderedDict()
        #: whether this node is making `oid` now (a pull, a reduce step, a
        #: put): set by the node
        self.making: Callable[[ObjectID], bool] = lambda oid: True

    def dropped_here(self, oid: ObjectID) -> None:
        """`oid` left the store: a pull of it that comes later is refused at
        once, not kept waiting with keepalives for bytes that never come."""
        self._dropped[oid] = None
        self._dropped.move_to_end(oid)
        while len(self._dropped) > _DROPPED_KEPT:
            self._dropped.popitem(last=False)

    async def start(self) -> str:
        backend = get_backend(self.config.transport)
        self._listener = await backend.listen(self.config.node_host, 0, self._serve)
        self.address = self._listener.address
        return self.address

    def listen_local(self, address: str) -> None:
        """Also serve pulls from this host through shared memory, on the Unix
        socket named after `address` (the data address peers are given)."""
        if self._local is not None:
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(shm.socket_name(address))
            sock.listen(128)
        except OSError as exc:  # e.g. the name is taken: pulls from this host use the transport
            log.warning("no same-host data socket for %s (%s): peers on this host pull "
                        "through the transport", address, exc)
            sock.close()
            return
        sock.setblocking(False)
        self._local = sock
        asyncio.get_running_loop().add_reader(sock, self._accept_local)

    def _accept_local(self) -> None:
        assert self._local is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = self._local.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of descriptors: pause rather than spin
                now = loop.time()
                if now - self._accept_warned >= 10.0:  # (not ten lines a second)
                    self._accept_warned = now
                    log.warning("accept on the same-host data socket failed: %s", exc)
                loop.remove_reader(self._local)
                loop.call_later(0.1, self._resume_accept, self._local)
                return
            if not shm.same_user(conn):  # the token handshake follows for the rest
                conn.close()
                continue
            stream = shm.LocalStream(conn, f"{self.address} (same host)")
            task = loop.create_task(self._serve_local(stream))
            self._local_tasks.add(task)
            task.add_done_callback(self._local_tasks.discard)

    def _resume_accept(self, sock: socket.socket) -> None:
        if self._local is sock:  # (not closed meanwhile)
            asyncio.get_running_loop().add_reader(sock, self._accept_local)

    async def _serve_local(self, stream: Stream) -> None:
        try:
            await self._serve(stream)
        finally:
            await stream.close()

    async def close(self) -> None:
        if self._local is not None:
            asyncio.get_running_loop().remove_reader(self._local)
            self._local.close()
            self._local = None
        for task in list(self._local_tasks):
            task.cancel()
        if self._local_tasks:
            await asyncio.wait(list(self._local_tasks))
        if self._listener is not None:
            await self._listener.close()
            self._listener = None

    async def _serve(self, stream: Stream) -> None:
        try:
            await server_handshake(stream, self.token, self.config.connect_timeout_s)
            while True:
                req = await recv_msg(stream, SMALL_MESSAGE)  # (a pull request is small)
                if req.get("op") != "pull":
                    raise ProtocolError(f"expected 'pull', got {req.get('op')!r}")
                await self._serve_pull(stream, req)
        except HopliteError as exc:
            log.debug("data connection from %s ended: %s", stream.peer, exc)

    async def _serve_pull(self, stream: Stream, req: dict) -> None:
        oid = ObjectID(field(req, "oid", bytes))
        offset, end = field(req, "offset", int), field(req, "end", int)
        stall = self._stall_for(req)
        # A puller gives up once no byte came for `stall`; one that stops
        # reading (stopped, hung, cut off) must not hold this serve, and the
        # view of our copy it keeps (which makes the copy unevictable), longer.
        stream.send_stall_s = stall
        bare = req.get("bare")  # the puller's message size, for an answer in bare messages
        # A same-host puller asked for the mode byte first (see the module doc).
        moded = bool(req.get("shm")) and getattr(stream, "local", False)
        if moded and req.get("map"):
            await self._offer_map(stream, oid, stall)
            return
        obj = self.store.get(oid)
        if obj is None:
            # A reduce parent may ask before our own step has created its output.
            if moded:  # (bytes, then: there is nothing to map yet)
                await stream.send_mode(b"B", None, self.config.stall_timeout_s)
                moded = False
            try:
                if oid in self._dropped and not self.making(oid):
                    # The directory sent the puller here just before our copy
                    # went: at once, so it fails over to another sender.
                    raise ObjectNotFound(f"object {oid.hex()} was dropped by this node")
                obj = await self._await_object(stream, oid, stall)
            except HopliteError as exc:
                await send_error_frame(stream, type(exc).__name__, str(exc))
                return
        log.debug("serve %s [%d, %d) to %s: %d bytes ready", oid.hex(), offset, end,
                  stream.peer, obj.ready)
        valid = 0 <= offset <= end <= obj.size
        mapped = shm.shared_map(obj.buffer) if moded and valid else None
        if mapped is not None:
            mapped.readers += 1  # not reused until the puller says it is done
        done = False
        task = asyncio.current_task()
        serving = self._serving.setdefault(oid, set())
        serving.add(task)
        try:
            if moded:
                try:
                    await stream.send_mode(b"B" if mapped is None else b"F",
                                           None if mapped is None else mapped.fd,
                                           self.config.stall_timeout_s)
                except BaseException:
                    done = True  # the descriptor never went: nobody reads through it
                    raise
            if not valid:
                await send_error_frame(stream, "ProtocolError",
                                       f"range [{offset}, {end}) outside object of {obj.size} bytes")
                return
            if bare is not None:
                if (type(bare) is not int or bare < 1 or mapped is not None or offset == end
                        or not stream.bare_messages or _sendable(obj.buffer, stream) is None):
                    await send_error_frame(stream, "ProtocolError",
                                           f"cannot answer in bare messages of {bare!r} bytes")
                    return
                await self._stream_bare(stream, obj, offset, end, bare, stall)
                return
            sent = await self._stream_range(stream, obj, offset, end, stall,
                                            announce=mapped is not None)
            if sent and mapped is not None:
                await self._await_ack(stream, "copied")
                done = True
        finally:
            if mapped is not None:
                _settle(mapped, done)
            serving.discard(task)
            if not serving and self._serving.get(oid) is serving:
                del self._serving[oid]

    def _stall_for(self, req: dict) -> float:
        """The stall timeout a pull is served under: the shorter of ours and
        the puller's (a puller that gives up sooner must hear from us sooner)."""
        theirs = req.get("stall")
        own = self.config.stall_timeout_s
        if type(theirs) in (int, float) and 0.01 <= theirs < own:
            return float(theirs)
        return own

    async def _offer_map(self, stream: Stream, oid: ObjectID, stall: float) -> None:
        """Hand a same-host puller our complete copy of `oid` to keep mapped as
        its own (mode ``M``), or say no (``N``): then it pulls as usual."""
        try:
            # We may be a receiver ourselves that has just been asked to relay:
            # one that keeps a mapping creates its copy complete, at once.
            # (Answered before the puller's own wait for the mode runs out.)
            obj = await self.store.wait_for(oid, stall / 2)
        except HopliteError:
            obj = None
        mapped = shm.shared_map(obj.buffer) if obj is not None and obj.complete else None
        if mapped is None or len(mapped) < obj.size:
            await stream.send_mode(b"N", None, self.config.stall_timeout_s)
            return
        # Until it says it holds its own lock, our count (and, if we are not
        # the owner, our own lock: `obj` stays referenced) keeps the pages.
        mapped.readers += 1
        mapped.kept_elsewhere = True
        done = False
        try:
            try:
                await stream.send_mode(b"M", mapped.fd, self.config.stall_timeout_s)
            except BaseException:
                done = True  # the descriptor never went: nobody holds the pages through it
                raise
            await self._await_ack(stream, "kept")
            done = True
        finally:
            _settle(mapped, done)

    async def _await_ack(self, stream: Stream, op: str) -> None:
        """The puller's word that it no longer reads our mapping (``copied``) or
        holds its own lock on the pages (``kept``). Copying a whole object can
        take far longer than a stall, so it gets the call deadline."""
        try:
            async with asyncio.timeout(self.config.timeout_s):
                msg = await recv_msg(stream, SMALL_MESSAGE)
        except TimeoutError:
            raise Timeout(f"{stream.peer} did not say {op!r} within "
                          f"{self.config.timeout_s:g}s") from None
        if msg.get("op") != op:
            raise ProtocolError(f"expected {op!r}, got {msg.get('op')!r}")

    def serving(self, oid: ObjectID) -> bool:
        """Whether a pull of `oid` is being served now."""
        return bool(self._serving.get(oid))

    async def release(self, oid: ObjectID, timeout: float) -> None:
        """Return once no pull of `oid` is being served any more. Call it after
        `oid` left the store: each such pull stops before its next frame (with
        an error frame), and any still going after `timeout` (a peer that does
        not read) is cancelled, so none reads the object's memory afterwards.
        That memory may be a caller's array, lent for one call."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._serving.get(oid) and loop.time() < deadline:
            await asyncio.sleep(0.001)
        stuck = list(self._serving.get(oid, ()))
        for task in stuck:
            task.cancel()  # its connection ends; the peer's pull fails and asks again
        if stuck:
            await asyncio.wait(stuck)

    async def _stream_range(self, stream: Stream, obj: StoredObject, pos: int, end: int,
                            stall: float, announce: bool = False) -> bool:
        """Send bytes [pos, end) of `obj` as they become ready; with `announce`
        (the puller maps our buffer) only how many more are ready. False if it
        ended with an error frame instead."""
        src = _sendable(obj.buffer, stream)
        # Device memory that the transport moves itself goes in device-sized chunks.
        chunk = self.config.chunk_bytes(device.is_device_buffer(src))
        step = min(chunk, STEP)
        staging = device.staging(chunk) if src is None else None  # device bytes over TCP
        # Every frame goes out through the window (a staging buffer is reused
        # for each chunk, so it allows one send at a time).
        async with SendWindow(stream, 1 if staging is not None else None) as out:
            while pos < end:
                if not await self._wait_or_keepalive(out, obj, min(pos + step, end), stall):
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

    async def _stream_bare(self, stream: Stream, obj: StoredObject, pos: int, end: int,
                           size: int, stall: float) -> bool:
        """Send bytes [pos, end) of `obj` as bare messages of `size` bytes (the
        last one the rest), each once it is ready, then a data frame header
        whose length is the bytes sent: the end of the answer. Heads in
        between are keepalives, or an error frame that ends it instead."""
        src = _sendable(obj.buffer, stream)
        start = pos
        async with SendWindow(stream) as out:
            while pos < end:
                upto = min(pos + size, end)
                if not await self._wait_or_keepalive(out, obj, upto, stall):
                    return False
                if obj.removed is not None:  # dropped, deleted or reclaimed meanwhile
                    await send_error_frame(out, "ObjectNotFound", str(obj.removed))
                    return False
                await out.send_bare(src[pos:upto])
                log.debug("serve %s: bare message of %d bytes at %d handed over",
                          obj.oid.hex(), upto - pos, pos)
                pos = upto
                await asyncio.sleep(0)  # let other pulls of this node progress too
            await out.send(FRAME.pack(FRAME_DATA, end - start))
        return True

    async def _await_object(self, stream: Stream, oid: ObjectID, stall: float) -> StoredObject:
        """Wait up to `timeout_s` for `oid` to be made here, with keepalives: the
        puller would give up at its stall timeout long before."""
        return await self._keepalive(stream.send, lambda t: self.store.wait_for(oid, t),
                                     ObjectNotFound, stall)

    async def _wait_or_keepalive(self, out: SendWindow, obj: StoredObject, need: int,
                                 stall: float) -> bool:
        """Wait until `need` bytes of `obj` are ready, for up to `timeout_s`.

        A partial copy can be slow for good reasons (its own upstream, or a reduce
        waiting for inputs); keepalives tell the receiver we are alive, so only a
        sender that is itself stuck trips its stall timeout. False (after an
        error frame) if the bytes never came.
        """
        try:
            await self._keepalive(out.send, lambda t: obj.wait_ready(need, t), Timeout, stall)
        except HopliteError as exc:
            await send_error_frame(out, type(exc).__name__, str(exc))
            return False
        return True

    async def _keepalive(self, send: Callable[[bytes], Awaitable[None]],
                         wait: Callable[[float], Awaitable[T]], expired: type[Exception],
                         stall: float) -> T:
        """`wait(seconds)` again and again until it returns, for up to
        `timeout_s` in all, with an empty frame every third of `stall` while
        it raises `expired`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.timeout_s
        beat = stall / 3
        while True:
            try:
                return await wait(min(beat, max(0.001, deadline - loop.time())))
            except expired:
                if loop.time() >= deadline:
                    raise
                await send(FRAME.pack(FRAME_DATA, 0))


class PeerPool:
    """Authenticated data connections to peers, reused across pulls."""

    def __init__(self, token: str, config: Config) -> None:
        self.token = token
        self.config = config
        #: (address, same-host?) -> idle connections
        self._idle: dict[tuple[str, bool], list[Stream]] = {}
        #: peers whose same-host socket is not there (another host or namespace)
        self._remote: set[str] = set()
        #: pulls served through a same-host sender's mapping, and their bytes
        self.local_pulls = 0
        self.local_bytes = 0
        #: objects kept as mappings of a same-host sender's copy (`map_object`)
        self.local_maps = 0
        #: closes of idle connections whose peer left
        self._closing: set[asyncio.Task] = set()
        #: every idle connection, the longest idle first
        self._idle_order: collections.OrderedDict[Stream, tuple[str, bool]] = \
            collections.OrderedDict()

    async def acquire(self, address: str, local: bool = True) -> Stream:
        """A connection to the peer at `address`: through this host's Unix
        socket where `local` allows and the peer is here (host objects: see
        `shm`), else through the transport (device objects keep UCX's own
        paths, e.g. CUDA IPC)."""
        local = local and self.config.shared_memory and address not in self._remote
        # (an idle transport connection to a peer here, left by a device pull,
        # must not carry a host object: only a Unix socket's can be mapped)
        idle = self._idle.get((address, local))
        while idle:
            stream = idle.pop()
            if not idle:  # (drained: a departed peer's key would stay for good)
                del self._idle[(address, local)]
            stream.unwatch_idle()
            self._idle_order.pop(stream, None)
            if not stream.closed:
                return stream
        scheme, _, _ = split_address(address)
        # A peer that cannot finish connecting within the stall timeout is as
        # good as a stalled sender: fail over instead of waiting out the whole
        # connect timeout. (Over TCP the kernel accepts for a stopped process
        # and the handshake hangs; over UCX the endpoint's wire-up does.)
        timeout = min(self.config.connect_timeout_s, self.config.stall_timeout_s)
        stream = None
        if local:
            stream = await _connect_local(address)
            if stream is None:
                self._remote.add(address)
            elif stream is BUSY:
                stream = None
        if stream is None:
            stream = await get_backend(scheme).connect(address, timeout)
        try:
            await client_handshake(stream, self.token, timeout)
        except BaseException:
            await stream.close()
            raise
        return stream

    def release(self, address: str, stream: Stream) -> None:
        if stream.closed:
            return
        key = (address, bool(getattr(stream, "local", False)))
        idle = self._idle.setdefault(key, [])
        if len(idle) >= IDLE_PER_PEER:
            # Kept, as many as were ever open to this peer at once would stay
            # open for good: on 64 nodes over a thousand descriptors a node.
            self._ended(key, stream)
            return
        idle.append(stream)
        self._idle_order[stream] = key
        # A peer that dies or leaves while this lies idle: close it then,
        # not never (nothing asks for a dead peer's address again).
        stream.watch_idle(functools.partial(self._ended, key, stream))
        while len(self._idle_order) > IDLE_TOTAL:  # the longest idle goes
            oldest, where = next(iter(self._idle_order.items()))
            self._ended(where, oldest)

    def _ended(self, key: tuple[str, bool], stream: Stream) -> None:
        stream.unwatch_idle()
        self._idle_order.pop(stream, None)
        idle = self._idle.get(key)
        if idle and stream in idle:
            idle.remove(stream)
            if not idle:
                del self._idle[key]
                # (nothing left to this peer: if it comes back, e.g. another
                # process on its port, whether it is on this host is asked anew)
                self._remote.discard(key[0])
        task = asyncio.get_running_loop().create_task(stream.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for streams in self._idle.values():
            for stream in streams:
                stream.unwatch_idle()
                await stream.close()
        self._idle.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


#: What `_connect_local` returns when the peer's Unix socket is here but its
#: backlog stays full: this pull goes through the transport, later ones try again.
BUSY = object()
#: Seconds to retry a same-host connect whose peer's backlog is full.
_BUSY_S = 0.5


async def _connect_local(address: str) -> Stream | object | None:
    """A connection to the data server at `address` through this host's Unix
    socket; None where there is none (the peer is on another host or in
    another network namespace, or runs without shared memory); BUSY if the
    peer's backlog stayed full (a burst of pulls at once)."""
    name = shm.socket_name(address)
    give_up, pause = time.monotonic() + _BUSY_S, 0.001
    while True:
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as exc:  # e.g. no file descriptor left: the transport would fail alike
            raise ConnectionRefused(f"cannot open a socket to {address}: "
                                    f"{exc.strerror or exc}") from exc
        sock.setblocking(False)
        try:
            # (a Unix socket connects at once or fails: no asyncio wait, which
            # takes a full backlog's EAGAIN for "in progress", then "connected")
            sock.connect(name)
            # Only our own user's node: any user may bind the name first, and a
            # node of another user refuses us (both then use the transport).
            if shm.same_user(sock):
                return shm.LocalStream(sock, f"{address} (same host)")
            sock.close()
            return None
        except BlockingIOError:
            sock.close()
            if time.monotonic() >= give_up:
                return BUSY
        except OSError:
            sock.close()
            return None
        await asyncio.sleep(pause)
        pause = min(2 * pause, 0.05)


def _settle(mapped: shm.SharedMap, done: bool) -> None:
    """A puller we handed `mapped` to is done with it, or never said so."""
    if done:
        mapped.readers -= 1
    else:
        shm.abandon(mapped)


async def map_object(pool: PeerPool, address: str, oid: ObjectID, nbytes: int,
                     config: Config) -> shm.SharedMap | None:
    """A same-host sender's complete copy of `oid`, mapped read-only to keep
    as ours (no byte copied), or None: the sender is elsewhere, has no
    complete shared copy, or the mapping could not be had; then pull as usual."""
    stream = await pool.acquire(address)
    if not getattr(stream, "local", False):
        pool.release(address, stream)
        return None
    ok = False
    try:
        await send_msg(stream, {"op": "pull", "oid": oid.binary, "offset": 0, "end": nbytes,
                                "shm": True, "map": True, "stall": config.stall_timeout_s})
        mode, fd = await stream.recv_mode(config.stall_timeout_s)
        if mode not in (b"M", b"N"):
            if fd is not None:
                os.close(fd)
            raise ProtocolError(f"{address} answered a mapping request with mode {mode!r}")
        mapped = None
        if fd is not None:
            mapped = shm.map_kept(fd, nbytes)
            if mapped is not None:
                pool.local_maps += 1
            try:  # (failed or not: its count goes down)
                await send_msg(stream, {"op": "kept"})
            except HopliteError:  # the sender went away: what we keep stays valid
                return mapped
        ok = True
        return mapped
    finally:
        if ok:
            pool.release(address, stream)
        else:
            with contextlib.suppress(Exception):
                await stream.close()


async def fetch_range(pool: PeerPool, address: str, obj: StoredObject, end: int,
                      config: Config, on_progress: Callable[[int], None],
                      reduce_input: bool = False) -> None:
    """Pull bytes [obj.ready, end) of `obj` from the peer at `address` into its buffer
    (for a reduce step, one of its children: `reduce_input`, see `Config.bare_pulls`).

    Every frame must start within the stall timeout, or the peer counts as
    failed. On any error the connection is closed, never reused.
    """
    host = not device.is_device_buffer(obj.buffer)
    stream = await pool.acquire(address, local=host)
    log.debug("pull %s: connection to %s in hand", obj.oid.hex(), address)
    ok = False
    mapped = None
    try:
        pos = obj.ready
        moded = host and getattr(stream, "local", False)
        view = _sendable(obj.buffer, stream)
        # One message per chunk, no frame headers (UCX; device objects by
        # default, `Config.bare_pulls`): docs/protocol.md.
        bare = (config.chunk_bytes(not host)
                if config.bare_pull(not host, reduce_input) and not moded
                and stream.bare_messages and view is not None and pos < end else None)
        req = {"op": "pull", "oid": obj.oid.binary, "offset": pos, "end": end,
               "stall": config.stall_timeout_s}
        if moded:
            req["shm"] = True
        elif bare is not None:
            req["bare"] = bare
        await send_msg(stream, req)
        if moded:
            mode, fd = await stream.recv_mode(config.stall_timeout_s)
            if mode not in (b"F", b"B"):
                if fd is not None:
                    os.close(fd)
                raise ProtocolError(f"{address} answered a pull with mode {mode!r}")
            if fd is not None:
                try:
                    mapped = shm.map_readonly(fd, end)
                except (OSError, ValueError) as exc:
                    raise PeerLost(f"cannot map the buffer {address} passed: {exc}") from exc
                pool.local_pulls += 1
                pool.local_bytes += end - pos
                await _copy_announced(stream, obj, memoryview(mapped), pos, end, address, config,
                                      on_progress)
                mapped.close()
                mapped = None
                try:  # the sender may reuse its buffer now
                    await send_msg(stream, {"op": "copied"})
                except HopliteError:  # (then it never will; our copy is complete all the same)
                    return
                ok = True
                return
        if bare is not None:
            await _fetch_bare(stream, obj, view, pos, end, bare, address, config, on_progress)
            ok = True
            return
        staging = device.staging(config.chunk_size) if view is None else None
        # A transport without partial receives takes each frame whole.
        step = min(config.chunk_size, STEP) if stream.partial_receive else None
        stall = config.stall_timeout_s
        while pos < end:
            try:
                async with asyncio.timeout(stall):
                    kind, n = await recv_frame_header(stream)
                    if kind != FRAME_DATA:
                        _raise_peer_error(address, await recv_error_body(stream, n))
                    if n > end - pos:
                        raise ProtocolError(f"{address} sent {n} bytes at {pos}; wanted at most {end - pos}")
                    if n == 0:
                        continue  # a keepalive: the sender is alive, its bytes are not ready yet
                    if staging is None and step is None:  # whole messages (UCX)
                        await stream.recv_into(view[pos:pos + n])
                    elif staging is None:
                        # In steps, each servable downstream as soon as it is in.
                        await stream.recv_steps(view[pos:pos + n], step,
                                                lambda upto, at=pos: obj.advance(at + upto))
                    else:  # device bytes over a host-only transport
                        if n > len(staging):
                            staging = device.staging(n)
                        await stream.recv_into(memoryview(staging)[:n])
                        device.upload(obj.buffer[pos:pos + n], staging)
            except Timeout:
                raise  # the peer reported its own timeout in an error frame
            except TimeoutError:
                raise Timeout(f"peer {address} sent nothing for {stall:g}s (stall timeout)") from None
            log.debug("pull %s: frame of %d bytes at %d in", obj.oid.hex(), n, pos)
            pos += n
            obj.advance(pos)
            on_progress(pos)
            # sock_recv_into returns without suspending while data keeps
            # coming; yield so the tasks serving this chunk downstream can run
            # now (pipelining) instead of after the whole object arrived.
            await asyncio.sleep(0)
        ok = True
    finally:
        if mapped is not None:
            with contextlib.suppress(BufferError):  # (a view still held: freed when collected)
                mapped.close()
        if ok:
            pool.release(address, stream)
        else:
            with contextlib.suppress(Exception):
                await stream.close()


async def _fetch_bare(stream: Stream, obj: StoredObject, view: Any, pos: int, end: int,
                      size: int, address: str, config: Config,
                      on_progress: Callable[[int], None]) -> None:
    """Receive an answer in bare messages (`DataServer._stream_bare`): each
    `size` bytes (the last one the rest) straight into `view`, with
    `BARE_RECEIVES` receives posted at once.

    Heads (keepalives, an error frame, the end marker) are listened for only
    while a message is slow to come (after `poll` seconds), and for the end:
    a receive left posted is polled by ucxx on every turn of the loop, which
    made each 64 MiB message on an H100 take twice as long. Each wait allows
    `stall_timeout_s`; a keepalive starts it again."""
    stall = config.stall_timeout_s
    poll = min(stall / 3, 0.05)
    start, ended = pos, False
    head: asyncio.Future | None = None

    async def on_head() -> None:
        """A head came: a keepalive, the end marker, or an error frame."""
        nonlocal head, ended
        kind, n = head.result()
        head = None
        if kind != FRAME_DATA:
            try:
                async with asyncio.timeout(stall):
                    body = await recv_error_body(stream, n)
            except TimeoutError:
                raise Timeout(f"peer {address} sent half an error frame ({stall:g}s)") from None
            _raise_peer_error(address, body)
        if n == end - start:
            ended = True  # (it may come before the last messages: lanes are matched apart)
        elif n:
            raise ProtocolError(f"{address} ended an answer of {end - start} bytes with {n}")
        # else a keepalive: the sender is alive, its bytes are not ready yet

    async def wait_heads(pending: asyncio.Future | None) -> None:
        """Wait for `pending` (or, None, the end marker) while taking heads."""
        nonlocal head
        while not (ended if pending is None else pending.done()):
            if head is None and not ended:
                head = asyncio.ensure_future(recv_frame_header(stream))
            waiting = {f for f in (pending, head) if f is not None}
            done, _ = await asyncio.wait(waiting, timeout=stall,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise Timeout(f"peer {address} sent nothing for {stall:g}s (stall timeout)")
            if head is not None and head in done:
                await on_head()

    # Two receives posted at once: UCX starts fetching the next message as
    # soon as it is announced, without waiting for this loop to post it.
    flying: collections.deque[tuple[int, int, asyncio.Future]] = collections.deque()
    posted = pos

    def post() -> None:
        nonlocal posted
        while len(flying) < BARE_RECEIVES and posted < end:
            n = min(size, end - posted)
            flying.append((posted, n, asyncio.ensure_future(
                stream.recv_bare(view[posted:posted + n]))))
            posted += n

    try:
        post()
        while flying:
            at, n, data = flying[0]
            done, _ = await asyncio.wait({data}, timeout=poll)
            if not done:  # slow: the sender may be waiting for bytes, or failing
                await wait_heads(data)
            data.result()
            flying.popleft()
            post()
            log.debug("pull %s: bare message of %d bytes at %d in", obj.oid.hex(), n, at)
            pos = at + n
            obj.advance(pos)
            on_progress(pos)
            await asyncio.sleep(0)  # relays of these bytes can serve them now
        await wait_heads(None)
    finally:
        # (Only after a failure: the stream then closes.)
        for pending in [f for _, _, f in flying] + [head]:
            if pending is not None and not pending.done():
                pending.cancel()
            if pending is not None:
                with contextlib.suppress(BaseException):
                    await pending


async def _copy_announced(stream: Stream, obj: StoredObject, source: memoryview, pos: int,
                          end: int, address: str, config: Config,
                          on_progress: Callable[[int], None]) -> None:
    """Copy bytes out of a same-host sender's mapping as it announces them."""
    stall = config.stall_timeout_s
    view = None
    try:
        view = memoryview(obj.buffer).cast("B")
        while pos < end:
            try:
                async with asyncio.timeout(stall):
                    kind, n = await recv_frame_header(stream)
                    body = await recv_error_body(stream, n) if kind != FRAME_DATA else None
            except TimeoutError:
                raise Timeout(f"peer {address} sent nothing for {stall:g}s (stall timeout)") from None
            if body is not None:
                _raise_peer_error(address, body)
            if n > end - pos:
                raise ProtocolError(f"{address} announced {n} bytes at {pos}; wanted at most {end - pos}")
            upto = pos + n
            while pos < upto:
                step = min(SHM_STEP, upto - pos)
                view[pos:pos + step] = source[pos:pos + step]
                pos += step
                obj.advance(pos)
                on_progress(pos)
                await asyncio.sleep(0)  # relays of these bytes can serve them now
    finally:
        source.release()
        if view is not None:
            view.release()


def _sendable(buffer: Any, stream: Stream) -> Any:
    """What to hand `stream` for `buffer`'s bytes: a memoryview of host memory,
    the device array itself where the transport moves device memory (UCX), or
    None: device memory over a host-only transport, staged through pinned memory."""
    if not device.is_device_buffer(buffer):
        return memoryview(buffer)
    return buffer if getattr(stream, "supports_device", False) else None


def _raise_peer_error(address: str, body: dict) -> None:
    """An error frame: the object is gone there (ObjectNotFound), or the peer
    cannot serve it for another reason, which for us means that peer is lost."""
    try:
        raise_for_error(body)
    except ObjectNotFound:
        raise
    except HopliteError as exc:
        raise PeerLost(f"{address} could not serve: {type(exc).__name__}: {exc}") from exc
    raise ProtocolError(f"{address} sent an error frame without an error")
