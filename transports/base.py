"""The transport interface: a byte stream with exact-size receives, and a listener.

Everything above this layer speaks in buffers; everything below it (sockets,
UCX endpoints) stays here, and its errors are converted at this boundary into
`TransportClosed`, `ConnectionRefused` or `Timeout`.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable

Buffer = bytes | bytearray | memoryview


class Stream(abc.ABC):
    """A reliable, ordered, bidirectional byte stream between two processes."""

    #: Human-readable peer address, for error messages.
    peer: str = "?"
    #: Whether a receive may take part of a sent buffer as cheaply as all of it
    #: (a byte stream such as TCP). Message transports (UCX) receive a whole
    #: message in place and would copy through a bounce buffer otherwise.
    partial_receive: bool = True

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

    async def recv_exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        if n:
            await self.recv_into(memoryview(buf))
        return bytes(buf)

    @abc.abstractmethod
    async def close(self) -> None:
        """Close the stream; idempotent. Pending sends/receives raise TransportClosed."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...


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

    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = default_scheme, address
    host, colon, port = rest.rpartition(":")
    if not colon or not host or not port.isdigit():
        raise InvalidArgument(f"expected an address like 'host:port' or 'tcp://host:port'; got {address!r}")
    return scheme, host.strip("[]"), int(port)
