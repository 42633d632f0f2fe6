"""The message lane of a byte stream (TCP, the same-host socket).

A byte stream has one lane, so a message travels in it as heads of a message
kind (`base.HEAD_PART`, `HEAD_FRAME`, `HEAD_END`), each followed by that many
of the frame's bytes, among the protocol's own heads. `Lane` reads the
stream from a reader callback while anyone waits on it: a message's bytes go
straight into the oldest posted buffer, any other head is handed to whoever
waits for heads, and reading stops there, since the bytes that follow a head
(an error frame's body) are its reader's, until `recv_head` or `recv_next` is
called again. A pull so costs one future and one wake-up per message, and no
task.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from collections.abc import Callable
from typing import Protocol

from hoplite_gpu.errors import TransportClosed

from .base import HEAD, HEAD_END, HEAD_FRAME, HEAD_PART, MESSAGE_KINDS, Head


class Owner(Protocol):
    """What the lane needs of its stream."""

    peer: str

    def expect(self, rest: int) -> None:
        """Wake for the next `rest` bytes of a receive (SO_RCVLOWAT)."""

    def add_reader(self, callback: Callable[[], None]) -> None:
        """Have the loop call `callback` whenever the stream may have bytes to read."""

    def shut(self) -> None:
        """Close the stream now (after a failure of the lane)."""


class Posted:
    """A posted receive: its buffers (flat byte views), where it stands, and
    who hears of it."""

    __slots__ = ("views", "on_step", "step", "waiter", "index", "got", "total", "mark")

    def __init__(self, views: list[memoryview], on_step: Callable[[int], None] | None, step: int,
                 waiter: asyncio.Future | None) -> None:
        self.views, self.on_step, self.step, self.waiter = views, on_step, step, waiter
        self.index = self.got = self.total = self.mark = 0

    @property
    def started(self) -> bool:
        return self.index > 0 or self.got > 0


class Lane:
    """Demultiplexes one byte stream's messages and heads (see the module doc)."""

    def __init__(self, owner: Owner, sock: socket.socket) -> None:
        self._owner = owner
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._posted: collections.deque[Posted] = collections.deque()
        self._head = bytearray(HEAD.size)
        self._head_view = memoryview(self._head)
        self._head_got = 0
        #: bytes of the current message head still to read (None: at a head)
        self._part: int | None = None
        self._kind = 0
        self._checked = False
        #: a head handed over: nothing is read until the next recv_head/recv_next
        self._held = False
        self._heads: collections.deque[Head] = collections.deque()
        #: posted messages in, not yet reported by recv_next
        self._landed = 0
        self._head_waiter: asyncio.Future | None = None
        self._next_waiter: asyncio.Future | None = None
        self._reading = False
        self.failed: BaseException | None = None

    # -- what the stream asks ---------------------------------------------------

    @property
    def quiet(self) -> bool:
        """Whether a plain receive may read the socket now: the lane reads
        nothing and stands between a head and the next."""
        return not self._reading and self._head_got == 0 and self._part is None

    def post(self, views: list[memoryview], on_step: Callable[[int], None] | None, step: int,
             waiter: asyncio.Future | None = None) -> Posted:
        self._raise_if_failed()
        posted = Posted(views, on_step, max(1, step), waiter)
        self._posted.append(posted)
        if self._part is not None and len(self._posted) == 1 and self._want():
            self._readable()  # (a message head waited for this: its bytes may all be in)
        else:
            self._update()
        return posted

    async def recv_message(self, views: list[memoryview], on_step: Callable[[int], None] | None,
                           step: int) -> None:
        waiter = self._loop.create_future()
        posted = self.post(views, on_step, step, waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if posted in self._posted:
                if posted.started:  # (half in: the stream is out of step)
                    self.fail(TransportClosed(f"a receive from {self._owner.peer} was cancelled "
                                              "half-way; connection closed"))
                else:  # not begun: withdrawn, the next receive takes its message
                    self._posted.remove(posted)
                    self._update()
            raise

    async def recv_head(self) -> Head:
        if self._heads:
            return self._heads.popleft()
        self._raise_if_failed()
        self._held = False
        if self._head_waiter is not None:
            raise RuntimeError("recv_head is already waiting on this stream")
        self._head_waiter = waiter = self._loop.create_future()
        return await self._wait(waiter)

    async def recv_next(self) -> Head | None:
        if self._landed:
            self._landed -= 1
            return None
        if self._heads:
            return self._heads.popleft()
        self._raise_if_failed()
        self._held = False
        if self._next_waiter is not None:
            raise RuntimeError("recv_next is already waiting on this stream")
        self._next_waiter = waiter = self._loop.create_future()
        return await self._wait(waiter)

    async def _wait(self, waiter: asyncio.Future) -> Head | None:
        self._update()
        try:
            return await waiter
        except asyncio.CancelledError:
            # What it was handed just before the cancel is not lost.
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                got = waiter.result()
                if got is None:
                    self._landed += 1
                else:
                    self._heads.appendleft(got)
            raise
        finally:
            if self._head_waiter is waiter:
                self._head_waiter = None
            if self._next_waiter is waiter:
                self._next_waiter = None
            self._update()

    def fail(self, exc: BaseException) -> None:
        """The lane (and its stream) ends: everyone waiting gets `exc`."""
        if self.failed is not None:
            return
        self.failed = exc
        self._stop()
        waiters = [p.waiter for p in self._posted] + [self._head_waiter, self._next_waiter]
        self._posted.clear()
        for waiter in waiters:
            if waiter is not None and not waiter.done():
                waiter.set_exception(exc)
        self._owner.shut()

    def _raise_if_failed(self) -> None:
        if self.failed is not None:
            raise TransportClosed(f"connection to {self._owner.peer} closed "
                                  f"({self.failed})") from self.failed

    # -- reading ----------------------------------------------------------------

    def _want(self) -> bool:
        if self.failed is not None or self._held:
            return False
        if self._part is not None:  # a message's bytes: only into a posted buffer
            return bool(self._posted)
        return bool(self._posted) or self._head_waiter is not None \
            or self._next_waiter is not None

    def _update(self) -> None:
        want = self._want()
        if want and not self._reading:
            self._expect_next()  # (a plain receive meanwhile may have set another)
            self._owner.add_reader(self._readable)
            self._reading = True
        elif not want and self._reading:
            self._stop()

    def _expect_next(self) -> None:
        """Be woken for what comes next: the rest of a part (in SO_RCVLOWAT
        steps), or a head (any byte). Set whenever the lane goes back to
        waiting: a mark left from a long part would keep the socket quiet
        while the few bytes of a head or a short part lie in it."""
        self._owner.expect(self._part or 1)

    def _stop(self) -> None:
        if self._reading:
            self._reading = False
            try:
                self._loop.remove_reader(self._sock.fileno())
            except (OSError, ValueError):  # (closed meanwhile)
                pass

    def _readable(self) -> None:
        """The reader callback: read heads and message bytes while the lane
        wants them and the socket has them."""
        try:
            while self._want():
                if not (self._read_head() if self._part is None else self._read_part()):
                    break
        except BaseException as exc:  # noqa: BLE001 - a caller's on_step too: the waiter gets it
            self.fail(exc)
            return
        self._expect_next()
        self._update()

    def _recv(self, view: memoryview) -> int:
        """Receive into `view` what has arrived (0: nothing yet)."""
        try:
            n = self._sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            return 0
        except (OSError, ValueError) as exc:
            raise TransportClosed(f"connection to {self._owner.peer} closed during "
                                  f"receive: {exc}") from exc
        if n == 0:
            raise TransportClosed(self._ended())
        return n

    def _ended(self) -> str:
        peer = self._owner.peer
        if not self._posted or not self._posted[0].started:
            return f"connection to {peer} ended"
        p = self._posted[0]
        want = sum(len(v) for v in p.views)
        return f"connection to {peer} ended after {p.total} of {want} bytes of a message"

    def _read_head(self) -> bool:
        n = self._recv(self._head_view[self._head_got:])
        if n == 0:
            return False
        self._head_got += n
        if self._head_got < HEAD.size:
            return True
        self._head_got = 0
        kind, length = HEAD.unpack(self._head)
        if kind not in MESSAGE_KINDS:
            self._hand_over((kind, length))
            return False
        self._part, self._kind, self._checked = length, kind, False
        return True

    def _hand_over(self, head: Head) -> None:
        self._held = True
        for waiter in (self._head_waiter, self._next_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_result(head)
                return
        self._heads.append(head)

    def _read_part(self) -> bool:
        posted = self._posted[0]
        if not self._checked:
            self._check(posted)
        rest = self._part
        if rest:
            view = posted.views[posted.index]
            n = self._recv(view[posted.got:posted.got + rest])
            if n == 0:
                return False
            posted.got += n
            posted.total += n
            self._part = rest = rest - n
            if posted.on_step is not None and posted.total - posted.mark >= posted.step:
                posted.mark = posted.total
                posted.on_step(posted.total)
        if rest == 0:
            self._end_part(posted)
        return True

    def _check(self, posted: Posted) -> None:
        """A message head against the buffer posted for its bytes."""
        room = len(posted.views[posted.index]) - posted.got
        length, kind = self._part, self._kind
        more = posted.index < len(posted.views) - 1
        fits = length <= room if kind == HEAD_PART else (
            length == room and (kind == HEAD_FRAME) == more)
        if not fits:
            sizes = "+".join(str(len(v)) for v in posted.views)
            raise TransportClosed(
                f"connection to {self._owner.peer} closed: a message does not fit the "
                f"buffers posted for it ({sizes} bytes): after {posted.total} bytes came "
                f"{length} more, {'ending a frame' if kind != HEAD_PART else 'of a frame'}"
                f"{' and the message' if kind == HEAD_END else ''}")
        self._checked = True

    def _end_part(self, posted: Posted) -> None:
        kind, self._part = self._kind, None
        if kind == HEAD_PART:
            return
        if kind == HEAD_FRAME:
            posted.index += 1
            posted.got = 0
            return
        assert kind == HEAD_END
        self._posted.popleft()
        if posted.on_step is not None and posted.mark < posted.total:
            posted.mark = posted.total
            posted.on_step(posted.total)
        if posted.waiter is not None:
            if not posted.waiter.done():
                posted.waiter.set_result(None)
        elif self._next_waiter is not None and not self._next_waiter.done():
            self._next_waiter.set_result(None)
        else:
            self._landed += 1
