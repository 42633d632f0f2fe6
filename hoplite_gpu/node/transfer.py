"""The data plane: a server that streams byte ranges of complete *and partial*
objects as their bytes become ready, and the client side that pulls a range
straight into the destination buffer.

Wire: after the handshake the puller sends ``{"op": "pull", "oid", "offset",
"end", "stall", "bare"}``; the server answers with the transport's messages
of ``bare`` bytes each (the puller's chunk size) in order until ``end``,
then a data frame header (see `protocol.FRAME`) whose length is the bytes
sent; empty data frames (keepalives) while it waits for bytes, or one error
frame instead. ``stall`` is the puller's stall timeout: the server's
keepalives come at least three times within it, even where the server's own
is longer. A connection serves one pull at a time and goes back to the pool
afterwards.

Between nodes on one host (`shm`) the pull goes over a Unix socket and may
carry ``"shm": true``; the server then answers with one byte first: ``F``
with the buffer's file descriptor attached, after which each data frame's
length says how many more bytes are ready in the mapping, or ``B``:
messages as above. How each mode's bytes move, on both sides, is in
`pull_modes`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from hoplite_gpu import device
from hoplite_gpu import messages as m
from hoplite_gpu.auth import client_handshake, server_handshake
from hoplite_gpu.config import Config
from hoplite_gpu.errors import (
    ConfigError,
    ConnectionRefused,
    HopliteError,
    ObjectNotFound,
    ProtocolError,
    Timeout,
    TransportError,
)
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.protocol import (
    FRAME,
    FRAME_DATA,
    LENGTH,
    SMALL_MESSAGE,
    message_length,
    recv_msg,
    send_error_frame,
    send_msg,
)
from hoplite_gpu.transports import Bind, Listener, SendWindow, Stream, get_backend, split_address
from hoplite_gpu.transports.tls import TLS

from . import shm
from .pull_modes import (  # noqa: F401  (STEP, SHM_STEP, POSTED_RECEIVES: named here too)
    POSTED_RECEIVES,
    SHM_STEP,
    STEP,
    Messages,
    PullAsk,
    SharedCopy,
    SharedMap,
    Sink,
    announce_ready,
    receiving_mode,
    sending_mode,
    stream_messages,
)
from .store import ChunkStore, StoredObject

log = logging.getLogger("hoplite_gpu.transfer")
T = TypeVar("T")

#: Idle connections a node keeps to one peer, and to all peers together (the
#: longest idle are closed first): a connection is kept for the next pull
#: from that peer, but not every one that was ever open at once.
IDLE_PER_PEER = 4
IDLE_TOTAL = 64
#: Ids a data server remembers as dropped here (see `DataServer.dropped_here`).
_DROPPED_KEPT = 4096


class DataServer:
    """Serves this node's objects to peers, chunk by chunk, as bytes become ready."""

    def __init__(self, store: ChunkStore, token: str, config: Config, *,
                 tls: TLS | None = None) -> None:
        self.store = store
        self.token = token
        self.config = config
        #: TLS on its transport's connections (not the same-host ones)
        self.tls = tls
        self._listeners: list[Listener] = []
        #: where it listens: one address per host of `node_host` (a rail
        #: each), the first the node's own
        self.addresses: list[str] = []
        self.address = ""
        #: bytes sent by pulls served over the transport, per address of this
        #: end ("host:port": which rail carried them)
        self.sent: collections.Counter[str] = collections.Counter()
        #: oid -> the tasks serving a pull of it now (see `release`).
        self._serving: dict[ObjectID, set[asyncio.Task]] = {}
        #: this host's listener for pulls through shared memory (`listen_local`)
        self._local: Listener | None = None
        #: ids that left this node's store lately (at most `_DROPPED_KEPT`)
        self._dropped: collections.OrderedDict[ObjectID, None] = collections.OrderedDict()
        #: whether this node is making `oid` now (a pull, a reduce step, a
        #: put): set by the node
        self.making: Callable[[ObjectID], bool] = lambda oid: True

    @property
    def _listener(self) -> Listener | None:
        """The listener of the node's own address (benchmarks/fuzz_peer.py
        counts its connections)."""
        return self._listeners[0] if self._listeners else None

    def dropped_here(self, oid: ObjectID) -> None:
        """`oid` left the store: a pull of it that comes later is refused at
        once, not kept waiting with keepalives for bytes that never come."""
        self._dropped[oid] = None
        self._dropped.move_to_end(oid)
        while len(self._dropped) > _DROPPED_KEPT:
            self._dropped.popitem(last=False)

    async def start(self) -> str:
        """Listen on each host of `node_host` (each on a port of its own);
        the first address is the node's."""
        backend = get_backend(self.config.transport, self.tls)
        try:
            for host, _ in self.config.node_hosts():
                self._listeners.append(await backend.listen(host, 0, self._serve))
        except BaseException:
            await self.close()
            raise
        self.addresses = [listener.address for listener in self._listeners]
        self.address = self.addresses[0]
        return self.address

    async def listen_local(self, address: str) -> None:
        """Also serve pulls from this host through shared memory, on the
        same-host transport, named after `address` (the data address peers
        are given)."""
        if self._local is not None:
            return
        _, host, port = split_address(address)
        try:
            self._local = await get_backend("local").listen(host, port, self._serve)
        except (ConfigError, TransportError) as exc:
            # e.g. the name is taken: pulls from this host use the transport
            log.warning("no same-host data socket for %s (%s): peers on this host pull "
                        "through the transport", address, exc)

    async def close(self) -> None:
        if self._local is not None:
            await self._local.close()
            self._local = None
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            await listener.close()

    async def _serve(self, stream: Stream) -> None:
        try:
            await server_handshake(stream, self.token, self.config.connect_timeout_s)
            while True:
                req = await self._next_request(stream)
                if isinstance(req, m.Invalid):
                    raise ProtocolError(f"expected a pull from {stream.peer}: {req.message}")
                await self._serve_pull(stream, req)
        except HopliteError as exc:
            log.debug("data connection from %s ended: %s", stream.peer, exc)

    async def _next_request(self, stream: Stream) -> m.Pull | m.Invalid:
        """The next pull request. A pooled connection may idle for long
        between requests; one whose request has begun (its length is in)
        has `stall_timeout_s` for the rest, or is dropped (a peer that sends
        part of one and stops would hold the connection and this task)."""
        n = message_length(await stream.recv_exactly(LENGTH.size), stream.peer)
        if n > SMALL_MESSAGE:  # (a pull request is small)
            raise ProtocolError(f"message of {n} bytes from {stream.peer} where at most "
                                f"{SMALL_MESSAGE} may come")
        try:
            async with asyncio.timeout(self.config.stall_timeout_s):
                body = await stream.recv_exactly(n)
        except TimeoutError:
            raise Timeout(f"{stream.peer} began a pull request of {n} bytes and did not "
                          f"send the rest within {self.config.stall_timeout_s:g}s") from None
        return m.decode_pull(stream.peer, body)

    async def _serve_pull(self, stream: Stream, req: m.Pull) -> None:
        ask = PullAsk.from_wire(req)
        stall = self._stall_for(ask.stall)
        # A puller gives up once no byte came for `stall`; one that stops
        # reading (stopped, hung, cut off) must not hold this serve, and the
        # view of our copy it keeps (which makes the copy unevictable), longer.
        stream.send_stall_s = stall
        mode = sending_mode(ask, stream.caps)
        if mode is SharedMap:
            await SharedMap.send(self, stream, ask, stall)
            return
        obj = self.store.get(ask.oid)
        if obj is None:
            # A reduce parent may ask before our own step has created its output.
            if mode is SharedCopy:  # (bytes, then: there is nothing to map yet)
                await shm.send_mode(stream, b"B", None, self.config.stall_timeout_s)
                mode = Messages
            obj = await self._find(stream, ask.oid, stall)
            if obj is None:
                return
        log.debug("serve %s [%d, %d) to %s: %d bytes ready", ask.oid.hex(), ask.offset, ask.end,
                  stream.peer, obj.ready)
        task = asyncio.current_task()
        serving = self._serving.setdefault(ask.oid, set())
        serving.add(task)
        try:
            await mode.send(self, stream, obj, ask, stall)
        finally:
            serving.discard(task)
            if not serving and self._serving.get(ask.oid) is serving:
                del self._serving[ask.oid]
            # (a cancelled serve's task keeps its error, whose traceback holds
            # this frame and so `obj`: the frame must not hold the task too,
            # or that cycle keeps the copy's memory until a full pass of the
            # garbage collector)
            del task

    async def _find(self, stream: Stream, oid: ObjectID, stall: float) -> StoredObject | None:
        """`oid` once it is made here; None (after an error frame) if it is not."""
        try:
            if oid in self._dropped and not self.making(oid):
                # The directory sent the puller here just before our copy
                # went: at once, so it fails over to another sender.
                raise ObjectNotFound(f"object {oid.hex()} was dropped by this node")
            return await self._await_object(stream, oid, stall)
        except HopliteError as exc:
            await send_error_frame(stream, type(exc).__name__, str(exc))
            return None

    async def refuse_range(self, stream: Stream, obj: StoredObject, ask: PullAsk) -> bool:
        """Whether the range asked lies outside `obj` (then an error frame went)."""
        if 0 <= ask.offset <= ask.end <= obj.size:
            return False
        await send_error_frame(stream, "ProtocolError",
                               f"range [{ask.offset}, {ask.end}) outside object of {obj.size} bytes")
        return True

    def _stall_for(self, theirs: object) -> float:
        """The stall timeout a pull is served under: the shorter of ours and
        the puller's (a puller that gives up sooner must hear from us sooner)."""
        own = self.config.stall_timeout_s
        if type(theirs) in (int, float) and 0.01 <= theirs < own:
            return float(theirs)
        return own

    async def _await_ack(self, stream: Stream, op: str) -> None:
        """The puller's word that it no longer reads our mapping (``copied``) or
        holds its own lock on the pages (``kept``). Copying a whole object can
        take far longer than a stall, so it gets the call deadline."""
        try:
            async with asyncio.timeout(self.config.timeout_s):
                msg = await recv_msg(stream, SMALL_MESSAGE, m.decode_ack)
        except TimeoutError:
            raise Timeout(f"{stream.peer} did not say {op!r} within "
                          f"{self.config.timeout_s:g}s") from None
        if isinstance(msg, m.Invalid) or m.op(msg) != op:
            got = msg.op if isinstance(msg, m.Invalid) else m.op(msg)
            raise ProtocolError(f"expected {op!r}, got {got!r}")

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
                            stall: float, size: int | None) -> bool:
        """Send bytes [pos, end) of `obj` as they become ready, in messages of
        `size` bytes (`pull_modes.stream_messages`); with `size` None only how
        many more are ready in the mapping the puller holds
        (`pull_modes.announce_ready`). False if it ended with an error frame
        instead."""
        if size is None:
            return await announce_ready(self, stream, obj, pos, end, stall)
        done = await stream_messages(self, stream, obj, pos, end, size, stall)
        if done and not stream.caps.local:
            self.sent[stream.local] += end - pos
        return done

    async def _await_object(self, stream: Stream, oid: ObjectID, stall: float) -> StoredObject:
        """Wait up to `timeout_s` for `oid` to be made here, with keepalives: the
        puller would give up at its stall timeout long before."""
        return await self._keepalive(stream.send, lambda t: self.store.wait_for(oid, t),
                                     ObjectNotFound, stall)

    async def _wait_or_keepalive(self, out: SendWindow, obj: StoredObject, need: int,
                                 stall: float, start: int = 0) -> bool:
        """Wait until bytes [start, need) of `obj` are ready, for up to
        `timeout_s` (past its watermark too: a range of a copy that a plan of
        several sub-flows fills, `StoredObject.wait_range`).

        A partial copy can be slow for good reasons (its own upstream, or a reduce
        waiting for inputs); keepalives tell the receiver we are alive, so only a
        sender that is itself stuck trips its stall timeout. False (after an
        error frame) if the bytes never came.
        """
        try:
            await self._keepalive(out.send, lambda t: obj.wait_range(start, need, t), Timeout,
                                  stall)
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

    def __init__(self, token: str, config: Config, *, tls: TLS | None = None) -> None:
        self.token = token
        self.config = config
        #: TLS on transport connections (same-host ones never leave the host)
        self.tls = tls
        #: (address, same-host?, where it starts) -> idle connections
        self._idle: dict[tuple[str, bool, Bind | None], list[Stream]] = {}
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
        self._idle_order: collections.OrderedDict[Stream, tuple[str, bool, Bind | None]] = \
            collections.OrderedDict()

    async def acquire(self, address: str, local: bool = True, bind: Bind | None = None) -> Stream:
        """A connection to the peer at `address`: over the same-host
        transport where `local` allows and the peer is here (host objects:
        see `shm`), else over the address's own (device objects keep UCX's
        own paths, e.g. CUDA IPC), from where `bind` says (a rail of this
        node, a source port of a path: `transports.Bind`); an idle one is
        reused only for the same `bind`."""
        local = local and self.config.shared_memory and address not in self._remote
        # (an idle transport connection to a peer here, left by a device pull,
        # must not carry a host object: only a same-host stream's can be mapped)
        key = (address, local, None if local else bind)  # (a same-host stream has no route)
        idle = self._idle.get(key)
        while idle:
            stream = idle.pop()
            if not idle:  # (drained: a departed peer's key would stay for good)
                del self._idle[key]
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
            backend = get_backend(scheme, self.tls)
            stream = await (backend.connect(address, timeout) if bind is None
                            else backend.connect(address, timeout, bind))
        try:
            await client_handshake(stream, self.token, timeout)
        except BaseException:
            await stream.close()
            raise
        return stream

    def release(self, address: str, stream: Stream, bind: Bind | None = None) -> None:
        if stream.closed:
            return
        key = (address, stream.caps.local, None if stream.caps.local else bind)
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

    def _ended(self, key: tuple[str, bool, Bind | None], stream: Stream) -> None:
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


#: What `_connect_local` returns when the peer's same-host socket is here but
#: its backlog stays full: this pull goes through the transport, later ones
#: try again.
BUSY = object()
#: Seconds to retry a same-host connect whose peer's backlog is full.
_BUSY_S = 0.5


async def _connect_local(address: str) -> Stream | object | None:
    """A connection to the data server at `address` over the same-host
    transport; None where there is none (the peer is on another host or in
    another network namespace, runs without shared memory, or is another
    user's); BUSY if the peer's backlog stayed full (a burst of pulls at once)."""
    try:
        return await get_backend("local").connect(address, _BUSY_S)
    except Timeout:
        return BUSY
    except (ConnectionRefused, ConfigError):
        return None


async def map_object(pool: PeerPool, address: str, oid: ObjectID, nbytes: int,
                     config: Config) -> shm.SharedMap | None:
    """A same-host sender's complete copy of `oid`, mapped read-only to keep
    as ours (no byte copied), or None: the sender is elsewhere, has no
    complete shared copy, or the mapping could not be had; then pull as usual."""
    stream = await pool.acquire(address)
    if not stream.caps.local:
        pool.release(address, stream)
        return None
    reusable = False
    try:
        mapped, reusable = await SharedMap.take(stream, oid, nbytes, address, pool, config)
        return mapped
    finally:
        await _put_back(pool, address, stream, reusable)


async def fetch_range(pool: PeerPool, address: str, obj: StoredObject, end: int,
                      config: Config, on_progress: Callable[[int], None], *,
                      start: int | None = None, sink: Sink | None = None,
                      message: int = 0, bind: Bind | None = None,
                      opened: Callable[[Stream], None] | None = None) -> None:
    """Pull bytes [start, end) of `obj` (from its watermark `obj.ready` by
    default) from the peer at `address` into its buffer, recording each
    piece in `sink` (the object's own watermark by default; a plan's
    sub-flow passes its place in the plan's ledger), in messages of
    `message` bytes (0: the chunk size for the object), on a connection
    from where `bind` says (`PeerPool.acquire`); `opened` hears which
    connection it is.

    The mode (`pull_modes`) is chosen once, from the connection's
    capabilities. Every message or frame must come within the stall
    timeout, or the peer counts as failed. On any error the connection is
    closed, never reused.
    """
    host = not device.is_device_buffer(obj.buffer)
    stream = await pool.acquire(address, local=host, bind=bind)
    log.debug("pull %s: connection to %s in hand", obj.oid.hex(), address)
    reusable = False
    try:
        if opened is not None:
            opened(stream)
        pos = obj.ready if start is None else start
        mode = receiving_mode(stream.caps, host=host)
        pull = mode(stream, obj, obj if sink is None else sink, pos, end, address, config,
                    on_progress, pool=pool, message=message)
        await send_msg(stream, pull.request())
        reusable = await pull.receive()
    finally:
        await _put_back(pool, address, stream, reusable, bind)


async def _put_back(pool: PeerPool, address: str, stream: Stream, reusable: bool,
                    bind: Bind | None = None) -> None:
    """A connection a pull is done with goes back to the pool, or (after an
    error, where it may be mid-message) is closed."""
    if reusable:
        pool.release(address, stream, bind)
    else:
        with contextlib.suppress(Exception):
            await stream.close()
