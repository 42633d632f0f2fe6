"""The transport interface: a byte stream with exact-size receives, and a listener.

Everything above this layer speaks in buffers; everything below it (sockets,
UCX endpoints) stays here, and its errors are converted at this boundary into
`TransportClosed`, `ConnectionRefused` or `Timeout`.
"""

from __future__ import annotations

import abc
import asyncio
import collections
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import ClassVar

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class StreamCaps:
    """What a stream can do, read once per pull to choose how its bytes move
    (`hoplite_gpu.node.pull_modes`)."""

    #: Whether a receive may take part of a sent buffer as cheaply as all of it
    #: (a byte stream such as TCP). Message transports (UCX) receive a whole
    #: message in place and would copy through a bounce buffer otherwise.
    partial_receive: bool = True
    #: Whether `send_bare`/`recv_bare` exist: a buffer sent as one message with
    #: no head, received whole into a buffer of exactly its size, on a lane of
    #: its own beside `send`/`recv_into` (UCX). A byte stream has no use for them.
    bare_messages: bool = False
    #: Whether device buffers may be passed to send/recv_into as they are (UCX).
    device: bool = False
    #: A same-host connection that can pass file descriptors and say how a
    #: pull is served with one mode byte (`send_mode`/`recv_mode`).
    local: bool = False


class Stream(abc.ABC):
    """A reliable, ordered, bidirectional byte stream between two processes."""

    #: Human-readable peer address, for error messages.
    peer: str = "?"
    #: What this kind of stream can do.
    caps: ClassVar[StreamCaps] = StreamCaps()
    #: How many `send` calls may usefully be in flight at once (see
    #: `SendWindow`). 1: each send is worth finishing before the next starts
    #: (a byte stream is busy until its bytes are written). More: overlapping
    #: sends still leave in call order, and the next one's announcement reaches
    #: the peer while the previous one's bytes move (UCX rendezvous).
    send_window: int = 1
    #: While set, a `send` whose bytes stop moving for this many seconds (the
    #: peer reads nothing) closes the stream and raises Timeout: a server's
    #: guard against a peer that asks and never reads, which would otherwise
    #: hold the sending task, its connection and the buffer it reads for good.
    #: TCP counts the bytes still queued in the kernel; UCX, which reports only
    #: a message's end, counts the stream's completed sends. None: sends wait
    #: as long as the peer lives.
    send_stall_s: float | None = None

    def authenticated(self) -> None:
        """The peer proved the cluster token (the handshake's end): from now
        on it may send what makes this side allocate more (see UCXStream)."""
        return None  # (a byte stream allocates nothing on a peer's word)

    @abc.abstractmethod
    async def send(self, *buffers: Buffer) -> None:
        """Send every byte of each buffer, in order. Raises TransportClosed."""

    @abc.abstractmethod
    async def recv_into(self, buffer: memoryview) -> None:
        """Fill `buffer` exactly, writing straight into it. Raises TransportClosed
        if the stream ends first (the buffer is then partly written)."""

    async def recv_steps(self, buffer: memoryview, step: int,
                         on_step: Callable[[int], None]) -> None:
        """Fill `buffer` exactly, calling `on_step(n)` whenever at least `step`
        more bytes (or the last ones) are in, `n` being how many are in so far:
        a relay can serve each step while the rest is still on its way. This
        default receives step by step; byte streams override it to wake the
        caller once for the whole buffer."""
        want = len(buffer)
        for got in range(0, want, step):
            upto = min(got + step, want)
            await self.recv_into(buffer[got:upto])
            on_step(upto)

    async def recv_some(self, buffer: memoryview) -> int:
        """Receive at least one byte into `buffer`, as many as have arrived, and
        return how many. Only byte streams (`partial_receive`) implement it."""
        raise NotImplementedError(f"{type(self).__name__} receives whole messages only")

    async def receive_continuously(self, space: Callable[[], memoryview],
                                   received: Callable[[int], None]) -> None:
        """Until the stream ends, receive what has arrived into `space()` and
        call `received(n)` with how many bytes that was. Never returns: raises
        TransportClosed at the end, or what `received` raised. Byte streams
        only; this default loops on `recv_some`, and a stream may instead call
        `received` straight from its readiness callback (TCP does)."""
        while True:
            received(await self.recv_some(space()))

    def send_nowait(self, data: bytes | memoryview) -> int:
        """Send what the stream takes at once, without waiting; return how many
        bytes that was (0: none, or this stream cannot; send the rest with
        `send`). Raises TransportClosed."""
        return 0

    async def send_bare(self, buffer: Buffer) -> None:
        """Send `buffer` as one message on the bare lane (see `bare_messages`);
        bare messages keep their order among themselves, not with `send`'s.
        Raises TransportClosed."""
        raise NotImplementedError(f"{type(self).__name__} has no bare messages")

    async def recv_bare(self, buffer: Buffer) -> None:
        """Receive the next bare message into `buffer`, which it must fill
        exactly. Several may wait at once: messages fill them in the order the
        calls began. Raises TransportClosed (a message too large for `buffer`
        too)."""
        raise NotImplementedError(f"{type(self).__name__} has no bare messages")

    async def recv_exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        if n:
            await self.recv_into(memoryview(buf))
        return bytes(buf)

    def watch_idle(self, on_end: Callable[[], None]) -> None:
        """While the stream lies unused, call `on_end()` once the peer closes it
        (or sends anything unasked: it is then of no more use), so a pool of
        idle connections lets go of dead peers. Transports that cannot tell
        do nothing. Stop with `unwatch_idle` before using the stream again."""
        return None

    def unwatch_idle(self) -> None:
        """The stream is in use again (see `watch_idle`)."""
        return None

    @abc.abstractmethod
    async def close(self) -> None:
        """Close the stream; idempotent. Pending sends/receives raise TransportClosed."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...


class SendWindow:
    """Sends on one stream, up to `depth` of them in flight at once.

    Use it as ``async with SendWindow(stream) as window: await window.send(...)``,
    and send *everything* in that block through the window: its sends start in
    call order, but a direct ``stream.send`` could overtake one not yet started.
    ``send`` returns once fewer than `depth` sends are unfinished, and raises the
    first failure of an earlier one. Leaving the block waits for the rest; an
    exception (or cancellation) in the block cancels them instead. The caller
    must keep every buffer it passed unchanged until the block ends.
    Depth 1 (the default for byte streams) is a plain ``await stream.send``."""

    def __init__(self, stream: Stream, depth: int | None = None) -> None:
        self._stream = stream
        self._depth = max(1, stream.send_window if depth is None else depth)
        self._flying: collections.deque[asyncio.Task] = collections.deque()

    async def send(self, *buffers: Buffer) -> None:
        await self._post(self._stream.send(*buffers))

    async def send_bare(self, buffer: Buffer) -> None:
        """`stream.send_bare(buffer)`, in the window."""
        await self._post(self._stream.send_bare(buffer))

    async def _post(self, sending: Awaitable[None]) -> None:
        if self._depth == 1:
            await sending
            return
        self._flying.append(asyncio.ensure_future(sending))
        while len(self._flying) >= self._depth:
            await self._flying.popleft()

    async def drain(self) -> None:
        """Wait until every send so far has finished (raising the first failure)."""
        while self._flying:
            await self._flying.popleft()

    async def __aenter__(self) -> SendWindow:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            try:
                await self.drain()
                return
            except BaseException:
                await self._cancel_rest()
                raise
        await self._cancel_rest()

    async def _cancel_rest(self) -> None:
        """Cancel the unfinished sends and wait until they are gone, so that
        none reads its buffer after the block; their errors are superseded."""
        flying, self._flying = list(self._flying), collections.deque()
        for task in flying:
            task.cancel()
        if flying:
            await asyncio.gather(*flying, return_exceptions=True)


Handler = Callable[[Stream], Awaitable[None]]


class Listener(abc.ABC):
    """Accepts streams and hands each to a handler task it owns."""

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """The URI peers connect to, e.g. ``tcp://127.0.0.1:40123``."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop accepting, close open streams and wait for their handlers."""


class Backend(abc.ABC):
    """One transport family, selected by URI scheme through the registry."""

    scheme: str
    #: Whether listen/connect accept IPv6 addresses.
    ipv6: bool = True

    @abc.abstractmethod
    async def listen(self, host: str, port: int, handler: Handler) -> Listener: ...

    @abc.abstractmethod
    async def connect(self, address: str, timeout: float) -> Stream:
        """Connect to ``address`` (``scheme://host:port`` or ``host:port``)."""


def split_address(address: str, default_scheme: str = "tcp") -> tuple[str, str, int]:
    """``"tcp://h:1"`` -> ("tcp", "h", 1); a bare ``"h:1"`` gets the default scheme."""
    from hoplite_gpu.errors import InvalidArgument

    if not isinstance(address, str):
        raise InvalidArgument(f"an address is a str like 'host:port' or 'tcp://host:port'; "
                              f"got {address!r}")
    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = default_scheme, address
    host, colon, port = rest.rpartition(":")
    if not colon or not host or not (port.isascii() and port.isdigit()) \
            or int(port) > 65535:
        raise InvalidArgument(f"expected an address like 'host:port' or 'tcp://host:port' "
                              f"(port 0-65535); got {address!r}")
    return scheme, host.strip("[]"), int(port)
