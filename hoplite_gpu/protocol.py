"""Message framing shared by control and data connections.

A message is a 4-byte big-endian length followed by a msgpack map. On data
connections an answer's bytes travel as the transport's messages, each
received straight into place, and its keepalives, errors and end as frames:
a transport head (`transports.HEAD`: kind, length) of a frame kind, and for
an error frame its body.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import struct
from collections.abc import Callable
from typing import Any

from . import messages as m
from .errors import HopliteError, ProtocolError, Timeout, TransportClosed, TransportError
from .transports import HEAD, SendWindow, Stream

#: A message's head: its body's length in bytes.
LENGTH = struct.Struct(">I")
#: A frame's header is a transport head (9 bytes: kind, length).
FRAME = HEAD
FRAME_DATA = 0
FRAME_ERROR = 1
#: Control messages stay small; inline objects are at most a few hundred KiB.
MAX_MESSAGE = 64 * 1024 * 1024


def pack(msg: m.Message | dict[str, Any]) -> bytes:
    """A message with its length in front: a typed one (`hoplite_gpu.messages`)
    travels as the map of its fields, tagged by `op`."""
    body = m.encode(msg)
    return LENGTH.pack(len(body)) + body


async def send_msg(stream: Stream, msg: m.Message | dict[str, Any]) -> None:
    await stream.send(pack(msg))


#: The most a handshake or a connection's first message may take: a peer that
#: has proved nothing yet must not make us allocate MAX_MESSAGE.
SMALL_MESSAGE = 4096


#: Turns one message's body from a peer into what its reader takes: a map
#: (`decode`), or a typed message (`hoplite_gpu.messages`).
Decode = Callable[[str, "bytes | bytearray | memoryview"], Any]


async def recv_msg(stream: Stream, limit: int = MAX_MESSAGE,
                   decoder: Decode | None = None) -> Any:
    n = message_length(await stream.recv_exactly(LENGTH.size), stream.peer)
    if n > limit:
        raise ProtocolError(f"message of {n} bytes from {stream.peer} where at most {limit} "
                            "may come")
    return (decoder or decode)(stream.peer, await stream.recv_exactly(n))


def message_length(head: bytes | bytearray | memoryview, peer: str) -> int:
    """The body length a message's 4-byte head announces, checked."""
    (n,) = LENGTH.unpack(head)
    check_length(peer, n)
    return n


def check_length(peer: str, n: int) -> None:
    if n > MAX_MESSAGE:
        raise ProtocolError(f"message of {n} bytes from {peer} exceeds {MAX_MESSAGE}")


#: A message read as a plain map (`messages.decode_map`).
decode = m.decode_map


async def read_messages(stream: Stream, on_message: Callable[[Any], None],
                        size: int = 64 * 1024, decoder: Decode | None = None) -> None:
    """Hand every message from `stream` to `on_message`, in order, until the
    stream ends: raises TransportClosed then, ProtocolError for a bad message,
    or what `on_message` raised. On a byte stream (TCP) one receive takes
    whatever has arrived, often several messages, and the messages are handed
    over from the receive itself: a control connection costs one system call
    per burst, and no task wake-up. Other streams are read one message at a time."""
    decoder = decoder or decode
    if not stream.caps.partial_receive:
        while True:
            on_message(await recv_msg(stream, decoder=decoder))
    framer = _Framer(stream, on_message, size, decoder)
    await stream.receive_continuously(framer.space, framer.received)


class _Framer:
    """Cuts received bytes into messages. The buffer grows for a message larger
    than it and shrinks back once that message is out."""

    def __init__(self, stream: Stream, on_message: Callable[[Any], None], size: int,
                 decode: Decode) -> None:
        self._stream = stream
        self._decode = decode
        self._on_message = on_message
        self._size = size
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = self._end = 0

    def space(self) -> memoryview:
        return self._view[self._end:]

    def received(self, n: int) -> None:
        self._end += n
        need = LENGTH.size  # bytes of the next message's length, then of the whole message
        while self._end - self._start >= LENGTH.size:
            (body,) = LENGTH.unpack_from(self._buf, self._start)
            check_length(self._stream.peer, body)
            need = LENGTH.size + body
            if self._end - self._start < need:
                break
            at = self._start + LENGTH.size
            self._start = at + body
            msg = self._decode(self._stream.peer, self._view[at:self._start])
            need = LENGTH.size
            self._on_message(msg)
        self._make_room(need)

    def _make_room(self, need: int) -> None:
        """Room from `_start` for `need` bytes (the next message, whole), or,
        for a message larger than the buffer, for about as many bytes again
        as have come of it: what a peer makes us allocate grows with what it
        sends, not with the length it announces."""
        have = self._end - self._start
        if have == 0:
            self._start = self._end = 0
            if len(self._buf) > self._size:
                self._resize(self._size)
        elif self._start + need > len(self._buf):
            if need > len(self._buf):
                self._resize(min(need, max(2 * have, have + self._size)))
            else:  # move it to the front
                self._buf[:have] = self._buf[self._start:self._end]
                self._start, self._end = 0, have

    def _resize(self, size: int) -> None:
        have = self._end - self._start
        buf = bytearray(size)
        buf[:have] = self._buf[self._start:self._end]
        self._buf, self._view = buf, memoryview(buf)
        self._start, self._end = 0, have


#: The most an outbox holds for a peer that does not take its messages: past
#: it, a peer that then takes nothing for a second is cut off, so one stuck
#: peer cannot grow its sender for ever (a burst is queued whole first, and
#: the second is timed once the burst is over).
MAX_QUEUED = 4 * MAX_MESSAGE
#: A pile-up check that runs this much later than due found the loop busy
#: (the writer may not have had its turn): it looks again instead of cutting.
LATE_CHECK_S = 0.1
#: A queued message is written in pieces of at most this many bytes, each
#: within the stall deadline: a slow but steady reader of a large reply (a
#: 16 MiB inline object) makes progress and is not cut off, a stuck one is.
STALL_PIECE = 256 << 10


class Outbox:
    """Messages to one peer, in order, without making the poster wait: written
    at once while the stream takes them, else queued for a writer task. A
    control connection so costs no task switch per message. `on_lost` hears
    of a failed write, once.

    A peer that takes no bytes for `stall_s` seconds while messages wait, or
    lets more than `limit` bytes pile up and then takes nothing for a second
    (`min(stall_s, 1)`), is cut off: the outbox fails and closes the stream,
    which ends its reader too. That second is timed from the end of the
    poster's burst, when the writer can run: a burst to a peer that reads is
    not cut, however long the poster takes to post it."""

    def __init__(self, stream: Stream, on_lost: Callable[[HopliteError], None], *,
                 stall_s: float | None = None, limit: int = MAX_QUEUED) -> None:
        self._stream = stream
        self._on_lost = on_lost
        self._stall_s = stall_s
        self._limit = limit
        self._queue: collections.deque[bytes | memoryview | None] = collections.deque()
        self._queued = 0  # bytes in _queue
        self._progress = 0  # writes (or pieces of one) that ended: the peer took bytes
        self._watch: asyncio.Handle | None = None  # the pile-up check, while one is armed
        self._wake = asyncio.Event()
        self._writing = False
        self._finished = False
        self._closer: asyncio.Task | None = None
        self.failed: HopliteError | None = None
        self._task = asyncio.get_running_loop().create_task(self._write_loop())

    def post(self, msg: m.Message | dict[str, Any]) -> None:
        """Send `msg` after everything posted before it; dropped once the stream
        failed or `finish` was called."""
        if self.failed is not None or self._finished:
            return
        data: bytes | memoryview = pack(msg)
        if not self._queue and not self._writing:
            try:
                n = self._stream.send_nowait(data)
            except HopliteError as exc:
                self._fail(exc)
                return
            if n == len(data):
                return
            data = memoryview(data)[n:]
            if n:
                self._progress += 1
        self._queued += len(data)
        self._queue.append(data)
        self._wake.set()
        if self._queued > self._limit and self._stall_s is not None and self._watch is None:
            # (armed once the poster's burst is over: time it spends posting
            # is no time the writer had to send)
            self._watch = asyncio.get_running_loop().call_soon(self._arm_watch)

    def _arm_watch(self, since: float | None = None) -> None:
        """Check in a second whether the peer took anything of a pile-up
        (`since`: when the peer was last seen taking nothing, if it was)."""
        loop = asyncio.get_running_loop()
        wait = self._pile_wait()
        self._watch = loop.call_later(wait, self._judge_pile, self._progress, loop.time() + wait,
                                      loop.time() if since is None else since)

    def _pile_wait(self) -> float:
        return min(self._stall_s, 1.0) if self._stall_s else 1.0

    def _judge_pile(self, progress: int, due: float, since: float) -> None:
        """Cut the peer off if, over the limit, it took nothing since `progress`.
        A check the loop ran late (a busy loop: the writer may not have had
        its turn) looks again, up to `stall_s` since `since`."""
        self._watch = None
        if self.failed is not None or self._queued <= self._limit:
            return
        now = asyncio.get_running_loop().time()
        if self._progress != progress:
            self._arm_watch()
        elif now - due > LATE_CHECK_S and now - since < max(self._stall_s or 0.0, 1.0):
            self._arm_watch(since)
        else:
            self._cut(TransportError(
                f"{self._stream.peer} took no message for {self._pile_wait():g}s "
                f"while {self._queued} bytes of them piled up (more than {self._limit}); cut off"))

    def finish(self) -> None:
        """Stop the writer once everything posted so far is sent; later posts are dropped."""
        self._finished = True
        self._queue.append(None)
        self._wake.set()

    async def drain(self, timeout: float) -> None:
        """Wait (at most `timeout` s) for the writer to send what `finish` closed."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._task)

    async def close(self) -> None:
        self._finished = True  # (later posts are dropped)
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        if self._closer is not None:
            await asyncio.gather(self._closer, return_exceptions=True)

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                data = self._queue.popleft()
                if data is None:
                    return
                self._queued -= len(data)
                self._writing = True
                try:
                    if self._stall_s is None:
                        await self._stream.send(data)
                    else:
                        await self._send_steadily(data, self._stall_s)
                    self._progress += 1
                except TimeoutError:
                    self._cut(Timeout(f"{self._stream.peer} took no bytes for "
                                      f"{self._stall_s:g}s; cut off"))
                    return
                except HopliteError as exc:
                    self._fail(exc)
                    return
                finally:
                    self._writing = False

    async def _send_steadily(self, data: bytes | memoryview, stall_s: float) -> None:
        """Send `data`; TimeoutError if one piece of it waits more than `stall_s`."""
        view = memoryview(data)
        for start in range(0, max(len(view), 1), STALL_PIECE):
            async with asyncio.timeout(stall_s):
                await self._stream.send(view[start:start + STALL_PIECE])
            self._progress += 1

    def _fail(self, exc: HopliteError) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self.failed is None:
            self.failed = exc
            self._queue.clear()
            self._queued = 0
            self._on_lost(exc)

    def _cut(self, exc: HopliteError) -> None:
        self._fail(exc)
        if self._closer is None:
            self._closer = asyncio.get_running_loop().create_task(self._stream.close())


async def send_error_frame(stream: Stream | SendWindow, kind: str, message: str) -> None:
    body = m.encode(m.Failure(error=kind, message=message))
    await stream.send(FRAME.pack(FRAME_ERROR, len(body)), body)


async def recv_frame_header(stream: Stream) -> tuple[int, int]:
    kind, n = await stream.recv_head()
    check_frame(stream, kind)
    return kind, n


def check_frame(stream: Stream, kind: int) -> None:
    """A head's kind must be a frame's."""
    if kind not in (FRAME_DATA, FRAME_ERROR):
        raise ProtocolError(f"unknown frame kind {kind} from {stream.peer}")


async def recv_error_body(stream: Stream, n: int) -> dict[str, Any]:
    if n > MAX_MESSAGE:
        raise ProtocolError(f"error frame of {n} bytes from {stream.peer}")
    return decode(stream.peer, await stream.recv_exactly(n))


def field(msg: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """Read a required field of a given type, or raise ProtocolError."""
    try:
        value = msg[name]
    except KeyError:
        raise ProtocolError(f"message {msg.get('op', '?')!r} lacks field {name!r}") from None
    if not isinstance(value, kind):
        raise ProtocolError(
            f"field {name!r} of {msg.get('op', '?')!r} should be {kind}, got {type(value).__name__}"
        )
    return value


__all__ = [
    "FRAME", "FRAME_DATA", "FRAME_ERROR", "Outbox", "TransportClosed", "check_frame", "field",
    "pack", "recv_error_body",
    "read_messages", "recv_frame_header", "recv_msg", "send_error_frame", "send_msg",
]
