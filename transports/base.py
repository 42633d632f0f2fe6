"""The transport interface: a stream with exact-size receives and a message
lane, and a listener.

Everything above this layer speaks in buffers; everything below it (sockets,
UCX endpoints) stays here, and its errors are converted at this boundary into
`TransportClosed`, `ConnectionRefused` or `Timeout`.

Besides its bytes (`send`, `recv_into`) every stream carries **messages**: a
message is one or more frames (buffers, device buffers where the transport
moves them), received into buffers the receiver provides, each exactly its
frame's size (`send_message`, `post_message`, `recv_message`). Beside them
come **heads** (`HEAD`: a kind and a length), which the protocol above uses
for its own frames (`hoplite_gpu.protocol`) and reads with `recv_head`;
`recv_next` waits for whichever comes first, a posted message or a head.
UCX carries messages on a lane of their own; a byte stream (TCP, the
same-host socket) puts a head of a message kind before each frame's bytes
and sorts what it reads (`transports/lane.py`).
"""

from __future__ import annotations

import abc
import asyncio
import collections
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

Buffer = bytes | bytearray | memoryview

#: A head (docs/protocol.md, "Framing"): one byte of kind, eight of length,
#: big-endian. Kinds 0 and 1 are the protocol's frames (data, error:
#: `hoplite_gpu.protocol`); on a byte stream the message kinds below carry a
#: message's bytes, and never reach `recv_head`.
HEAD = struct.Struct(">BQ")
#: The next `length` bytes of a message's frame; more of that frame follow
#: (`send_message_part`).
HEAD_PART = 2
#: The last `length` bytes of a frame; another frame of the message follows.
HEAD_FRAME = 3
#: The last `length` bytes of the message.
HEAD_END = 4
MESSAGE_KINDS = (HEAD_PART, HEAD_FRAME, HEAD_END)
#: A head as `recv_head` returns it: (kind, length).
Head = tuple[int, int]
#: How often, in bytes, a receive reports progress to its `on_step` by default.
STEP = 1 << 18


@dataclass(frozen=True)
class StreamCaps:
    """What a stream can do, read once per pull to choose how its bytes move
    (`hoplite_gpu.node.pull_modes`)."""

    #: Whether a receive may take part of a sent buffer as cheaply as all of it
    #: (a byte stream such as TCP). Message transports (UCX) receive a whole
    #: message in place and would copy through a bounce buffer otherwise.
    partial_receive: bool = True
    #: Whether a message may be sent in parts as its bytes become ready
    #: (`send_message_part`), with heads between them: a byte stream. A
    #: message transport (UCX) sends each frame whole.
    message_parts: bool = False
    #: Whether device buffers may be passed to send/recv_into as they are (UCX).
    device: bool = False
    #: A same-host connection that can pass a file descriptor with a byte
    #: (`send_descriptor`/`recv_descriptor`: `transports.local`).
    local: bool = False


class Stream(abc.ABC):
    """A reliable, ordered, bidirectional stream between two processes: bytes,
    heads and messages (see the module doc)."""

    #: Human-readable peer address, for error messages.
    peer: str = "?"
    #: This end's address, "host:port" where the transport has one ("" else).
    local: str = ""
    #: What this kind of stream can do.
    caps: ClassVar[StreamCaps] = StreamCaps()
    #: Whether its bytes travel in TLS (`transports.tls`).
    tls: ClassVar[bool] = False
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

    # -- messages and heads ----------------------------------------------------

    @abc.abstractmethod
    async def send_message(self, *frames: Any) -> None:
        """Send one message of `frames` (at least one; device buffers where
        `caps.device`). Messages keep their order among themselves. Raises
        InvalidArgument for what the stream cannot send, TransportClosed."""

    async def send_message_part(self, part: Buffer, *, last: bool) -> None:
        """Send the next bytes of a one-frame message; `last` ends it. Heads
        (`send`) may go between the parts, another message may not. Only
        where `caps.message_parts` (a byte stream)."""
        raise NotImplementedError(f"{type(self).__name__} sends each message whole")

    @abc.abstractmethod
    def post_message(self, *buffers: Any, on_step: Callable[[int], None] | None = None,
                     step: int = STEP) -> None:
        """Post a receive of the next message into `buffers`, one a frame, each
        exactly its frame's size (in place, no copy). Several may be posted:
        messages fill them in the order they were posted. `on_step(n)` hears
        how many bytes of the message are in, whenever `step` more are (a
        byte stream) or once it is whole, always before `recv_next` reports
        it. A message that does not fit its buffers ends the stream
        (TransportClosed, naming the sizes; UCX cannot tell one shorter than
        its buffer, see transports/ucx.py). `recv_next` reports each posted
        message in turn."""

    @abc.abstractmethod
    async def recv_message(self, *buffers: Any, on_step: Callable[[int], None] | None = None,
                           step: int = STEP) -> None:
        """Receive the next message into `buffers`, as `post_message` does, and
        wait for it. Heads that come meanwhile are kept for `recv_head`."""

    @abc.abstractmethod
    async def recv_head(self) -> Head:
        """The next head, (kind, length). Anything that follows it (a body the
        kind announces) is read with `recv_into` before the next call; on a
        byte stream nothing more is read until then."""

    @abc.abstractmethod
    async def recv_next(self) -> Head | None:
        """Wait for what comes first: None once the oldest message posted with
        `post_message` is in (each is reported once, in order), or a head (as
        `recv_head`). The heads of a byte stream come in order with its
        messages; on UCX a head may pass a message."""

    async def send_descriptor(self, tag: bytes, fd: int | None, timeout: float) -> None:
        """Send one byte, with the file descriptor `fd` attached where given.
        Only where `caps.local`."""
        raise NotImplementedError(f"{type(self).__name__} cannot pass descriptors")

    async def recv_descriptor(self, timeout: float) -> tuple[bytes, list[int]]:
        """One byte `send_descriptor` sent (b"": the peer closed) and the
        descriptors that came with it (the caller closes them). Only where
        `caps.local`."""
        raise NotImplementedError(f"{type(self).__name__} cannot pass descriptors")

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


class BytesOnly(Stream):
    """A base for streams that carry bytes only (stand-ins in tests and
    fuzzers that replay recorded bytes): the message calls say so."""

    async def send_message(self, *frames: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} carries bytes only")

    def post_message(self, *buffers: Any, on_step: Any = None, step: int = 0) -> Any:
        raise NotImplementedError(f"{type(self).__name__} carries bytes only")

    async def recv_message(self, *buffers: Any, on_step: Any = None, step: int = 0) -> None:
        raise NotImplementedError(f"{type(self).__name__} carries bytes only")

    async def recv_head(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} carries bytes only")

    async def recv_next(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} carries bytes only")


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

    async def send_message(self, *frames: Any) -> None:
        """`stream.send_message(*frames)`, in the window."""
        await self._post(self._stream.send_message(*frames))

    async def send_message_part(self, part: Buffer, *, last: bool) -> None:
        """`stream.send_message_part(part, last=last)`, in the window."""
        await self._post(self._stream.send_message_part(part, last=last))

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


@dataclass(frozen=True)
class Bind:
    """Where a connection starts (`Backend.connect`): from this host's
    address `host` ("": the kernel's choice), and from the first of `ports`
    that is free (none given: any port). A port in use, or one whose
    connection to this peer exists already, is skipped for the next."""

    host: str = ""
    ports: tuple[int, ...] = ()


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
    async def connect(self, address: str, timeout: float, bind: Bind | None = None) -> Stream:
        """Connect to ``address`` (``scheme://host:port`` or ``host:port``),
        from where `bind` says (a transport that cannot choose raises
        ConfigError if one is asked of it)."""

    def with_tls(self, tls: Any) -> Backend:
        """This transport with every connection in TLS (`transports.tls.TLS`).
        TCP does; a transport without TLS returns itself: UCX moves its bytes
        as they are (docs/security.md), and the same-host one never leaves
        the host."""
        return self


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
