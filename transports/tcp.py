"""TCP transport on raw non-blocking sockets driven by the asyncio loop.

``loop.sock_recv_into`` writes straight into the destination buffer, which on a
2-core machine moves several GB/s over loopback; asyncio streams
(``readexactly``) copy every byte through an internal buffer and reach about a
tenth of that, so they are not used on the data path.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import socket
import struct
import termios
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from hoplite_gpu.errors import (
    ConnectionRefused,
    InvalidArgument,
    Timeout,
    TransportClosed,
    TransportError,
)

from .base import (
    HEAD,
    HEAD_END,
    HEAD_FRAME,
    HEAD_PART,
    STEP,
    Backend,
    Bind,
    Buffer,
    Handler,
    Head,
    Listener,
    Stream,
    StreamCaps,
    split_address,
)
from .lane import Lane

if TYPE_CHECKING:
    from .tls import TLS

log = logging.getLogger("hoplite_gpu.transports.tcp")

_SOCKBUF = 4 * 1024 * 1024
#: A large receive wakes the loop only when this much has arrived (SO_RCVLOWAT).
#: On a link slower than the CPU the loop would otherwise wake for every few
#: packets, and each wake-up costs tens of microseconds of Python; the kernel
#: still wakes us earlier under memory pressure or a closed window.
_LOWAT = 256 * 1024
#: Receives smaller than this keep the default (wake on any byte): control
#: messages and headers then cost no extra system call.
_LOWAT_FROM = 64 * 1024
_CLOSED = "hoplite: stream closed"
T = TypeVar("T")


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKBUF)


def _queued(fd: int) -> int | None:
    """Bytes written to socket `fd` that its peer has not yet taken (None:
    this system cannot say)."""
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, AttributeError):
        return None


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def host_bytes(call: str, buf: Any) -> memoryview:
    """`buf` as a flat byte view, for a transport that moves host memory only."""
    if hasattr(buf, "__cuda_array_interface__"):
        raise InvalidArgument(f"{call}: this transport moves host memory only; got a device "
                              "buffer (stage it through host memory, or use ucx)")
    view = memoryview(buf)
    if not view.c_contiguous:
        raise InvalidArgument(f"{call}: a buffer must be contiguous; got a strided view")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class TCPStream(Stream):
    #: A byte stream: receives take part of a send as cheaply as all of it, and
    #: a message may go in parts (`send_message_part`).
    caps = StreamCaps(partial_receive=True, message_parts=True)
    #: Whether asyncio's own socket calls (sock_sendall, sock_recv_into) may
    #: move this stream's bytes: a plain socket's, not a TLS one's.
    _loop_io: ClassVar[bool] = True

    def __init__(self, sock: socket.socket, peer: str) -> None:
        _tune(sock)
        self._sock = sock
        with contextlib.suppress(OSError, IndexError):
            name = sock.getsockname()
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                self.local = (f"{name[0]}:{name[1]}" if sock.family == socket.AF_INET
                              else f"[{name[0]}]:{name[1]}")
        self._closed = False
        self._lowat = 1
        self.peer = peer
        #: Tasks inside send/recv_into, woken by close() (the loop would not wake them).
        self._busy: set[asyncio.Task] = set()
        #: Sends that overlap (a SendWindow deeper than 1) go out one after another,
        #: so the bytes of one never land between another's.
        self._send_lock = asyncio.Lock()
        #: messages and heads, sorted as they are read (`transports.lane`)
        self._lane = Lane(self, sock)

    @property
    def closed(self) -> bool:
        return self._closed

    def _lost(self, exc: BaseException | None, what: str) -> TransportClosed:
        reason = f": {exc}" if exc else ""
        return TransportClosed(f"connection to {self.peer} closed during {what}{reason}")

    async def send(self, *buffers: Buffer) -> None:
        if self._closed:
            raise self._lost(None, "send")
        loop = asyncio.get_running_loop()
        async with self._send_lock:
            for buf in buffers:
                # sock_sendall counts progress in bytes against len(), which is in
                # items for a typed view: always send a flat byte view.
                view = memoryview(buf)
                if view.format != "B" or view.ndim != 1:
                    view = view.cast("B")
                if not len(view):
                    continue
                if self.send_stall_s is None and self._loop_io:
                    await self._guarded("send", loop.sock_sendall(self._sock, view))
                else:
                    await self._guarded("send", self._send_steadily(view, self.send_stall_s))

    async def _send_steadily(self, view: memoryview, stall: float | None) -> None:
        """Send all of `view`, failing if the peer takes no byte for `stall`
        seconds (None: no limit): write what the kernel takes, and wait for room between
        writes. The kernel says "writable" only once a good part of the send
        buffer has drained, which a slow but steady reader may take longer
        than `stall` to do: so a wait that runs out asks the kernel how many
        bytes are still queued, and waits on while that number falls. No more
        system calls than sock_sendall makes while the peer keeps up."""
        loop = asyncio.get_running_loop()
        fd = self._sock.fileno()
        while len(view):
            try:
                view = view[self._sock.send(view):]
                continue
            except (BlockingIOError, InterruptedError):
                pass
            room = loop.create_future()
            loop.add_writer(fd, _wake, room)
            queued = _queued(fd)
            try:
                while True:
                    try:
                        async with asyncio.timeout(stall):
                            await asyncio.shield(room)
                        break
                    except TimeoutError:
                        now = _queued(fd)
                        if now is None or queued is None or now >= queued:
                            await self.close()  # (mid-frame: nothing more can go on it)
                            raise Timeout(f"{self.peer} took no bytes for {stall:g}s; "
                                          "cut off") from None
                        queued = now  # (it reads, slowly: wait on)
            finally:
                if not self._closed:
                    loop.remove_writer(fd)

    # -- messages ----------------------------------------------------------------

    async def send_message(self, *frames: Any) -> None:
        if not frames:
            raise InvalidArgument("send_message: a message has at least one frame")
        views = [host_bytes("send_message", f) for f in frames]
        last = len(views) - 1
        wire: list[Buffer] = []
        for i, view in enumerate(views):
            wire += [HEAD.pack(HEAD_END if i == last else HEAD_FRAME, len(view)), view]
        await self.send(*wire)

    async def send_message_part(self, part: Buffer, *, last: bool) -> None:
        view = host_bytes("send_message_part", part)
        await self.send(HEAD.pack(HEAD_END if last else HEAD_PART, len(view)), view)

    def _views(self, call: str, buffers: tuple) -> list[memoryview]:
        if self._closed:
            raise self._lost(None, "receive")
        if not buffers:
            raise InvalidArgument(f"{call}: a message has at least one frame")
        return [host_bytes(call, b) for b in buffers]

    def post_message(self, *buffers: Any, on_step: Callable[[int], None] | None = None,
                     step: int = STEP) -> None:
        self._lane.post(self._views("post_message", buffers), on_step, step)

    async def recv_message(self, *buffers: Any, on_step: Callable[[int], None] | None = None,
                           step: int = STEP) -> None:
        await self._lane.recv_message(self._views("recv_message", buffers), on_step, step)

    async def recv_head(self) -> Head:
        if self._closed:
            raise self._lost(None, "receive")
        return await self._lane.recv_head()

    async def recv_next(self) -> Head | None:
        if self._closed:
            raise self._lost(None, "receive")
        return await self._lane.recv_next()

    # -- bytes ---------------------------------------------------------------------

    def add_reader(self, callback: Callable[[], None]) -> None:
        """Have the loop call `callback` whenever the stream may have bytes to
        read (until the socket's reader is removed)."""
        asyncio.get_running_loop().add_reader(self._sock.fileno(), callback)

    def buffered(self) -> bool:
        """Whether bytes already taken off the socket wait to be received (TLS
        decrypts whole records): a reader takes them before it waits on the
        socket again."""
        return False

    def _plain(self) -> None:
        """A plain receive may read the socket now (see `Lane.quiet`)."""
        if self._closed:
            raise self._lost(None, "receive")
        if not self._lane.quiet:
            raise TransportError(f"a plain receive from {self.peer} while its messages are "
                                 "being received (read a head's body only after recv_head)")

    async def recv_into(self, buffer: memoryview) -> None:
        self._plain()
        view = memoryview(buffer).cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer
        got, want = 0, len(view)
        while got < want:
            self.expect(want - got)
            n = await self._wait_recv(view[got:])
            if n == 0:
                await self.close()
                raise TransportClosed(f"connection to {self.peer} ended after {got} of {want} bytes")
            got += n

    async def recv_steps(self, buffer: memoryview, step: int,
                         on_step: Callable[[int], None]) -> None:
        """Fill `buffer` from a reader callback that stays registered until it is
        full: one wake-up of the caller per buffer, where `recv_into` per step
        costs a task wake-up, a future and two epoll_ctl calls per step."""
        self._plain()
        view = memoryview(buffer).cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer
        want = len(view)
        if want == 0:
            return
        got = mark = 0

        def received(n: int) -> bool:
            nonlocal got, mark
            got += n
            if got - mark >= step or got == want:
                mark = got
                on_step(got)
            if got < want:
                self.expect(want - got)
            return got == want

        self.expect(want)
        await self._read_on_readiness(
            lambda: view[got:], received,
            lambda: f"connection to {self.peer} ended after {got} of {want} bytes", eager=True)

    async def receive_continuously(self, space: Callable[[], memoryview],
                                   received: Callable[[int], None]) -> None:
        """A reader callback that stays registered for the stream's life: each
        burst costs one receive and a call of `received` from the loop itself,
        where a task awaiting each receive also pays a wake-up, a future and
        two epoll_ctl calls."""
        self._plain()
        self._set_lowat(1)

        def take(n: int) -> bool:
            received(n)
            return False  # never done: reading ends with the stream, or with an error

        await self._read_on_readiness(space, take, lambda: "the peer closed the connection",
                                      eager=False)

    async def _read_on_readiness(self, space: Callable[[], memoryview],
                                 received: Callable[[int], bool], ended_why: Callable[[], str],
                                 eager: bool) -> None:
        """Whenever the socket is readable (and at once, if `eager`), receive
        what has arrived into `space()` and call `received(n)`, until it returns
        True. One reader callback stays registered throughout. What `received`
        raises is raised here as it is; the socket's errors, its end and a
        close() from elsewhere become TransportClosed."""
        loop = asyncio.get_running_loop()
        ended = loop.create_future()
        failed: list[BaseException] = []
        sock = self._sock

        def readable() -> None:
            while not ended.done():
                try:
                    n = sock.recv_into(space())
                except (BlockingIOError, InterruptedError):
                    return
                except (OSError, ValueError) as exc:
                    ended.set_exception(exc)
                    return
                if n == 0:
                    ended.set_exception(ConnectionResetError(ended_why()))
                    return
                try:
                    if received(n):
                        ended.set_result(None)
                except BaseException as exc:  # noqa: BLE001 - the caller's error, raised below
                    failed.append(exc)
                    ended.set_result(None)
                if not self.buffered():
                    return  # (a plain socket: one receive per wake-up)

        if eager:
            readable()  # often some of it is there already
        fd = None
        if not ended.done():
            fd = sock.fileno()
            self.add_reader(readable)
        try:
            await self._guarded("receive", ended)  # errors become TransportClosed
        finally:
            if fd is not None and not self._closed:
                loop.remove_reader(fd)
        if failed:
            raise failed[0]

    async def _wait_recv(self, view: memoryview) -> int:
        """One receive through the loop (0: the peer closed)."""
        return await self._guarded("receive", asyncio.get_running_loop().sock_recv_into(
            self._sock, view))

    async def _guarded(self, what: str, op: Awaitable[T]) -> T:
        """Await a socket operation; its errors, and a close() from elsewhere
        (which wakes it), become TransportClosed."""
        task = asyncio.current_task()
        self._busy.add(task)
        try:
            return await op
        except Timeout:  # (a TimeoutError, so an OSError: ours, already said)
            raise
        except (OSError, ValueError) as exc:  # ValueError: socket closed under us
            await self.close()
            raise self._lost(exc, what) from exc
        except asyncio.CancelledError as exc:
            raise self._woken(task, exc, what) from None
        finally:
            self._busy.discard(task)
            # A cancelled task keeps its error, whose traceback holds this
            # frame: a frame that also holds the task makes a cycle that only
            # a full pass of the garbage collector frees (see UCXStream._guard).
            del task

    def send_nowait(self, data: bytes | memoryview) -> int:
        if self._closed:
            raise self._lost(None, "send")
        try:
            return self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0
        except (OSError, ValueError) as exc:
            raise self._lost(exc, "send") from exc

    def expect(self, rest: int) -> None:
        """Wake for the next `rest` bytes of a receive in SO_RCVLOWAT steps."""
        self._set_lowat(min(rest, _LOWAT) if rest >= _LOWAT_FROM else 1)

    def _set_lowat(self, nbytes: int) -> None:
        # Never more than the rest of this message: the peer may send nothing more.
        if nbytes != self._lowat:
            self._lowat = nbytes
            with contextlib.suppress(OSError):
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)

    def _woken(self, task: asyncio.Task | None, exc: asyncio.CancelledError,
               what: str) -> BaseException:
        """A cancel sent by close() becomes TransportClosed; any other stays a cancel."""
        if exc.args == (_CLOSED,) and task is not None:
            task.uncancel()
            return self._lost(None, what)
        return exc

    def watch_idle(self, on_end: Callable[[], None]) -> None:
        # (an unused data connection is never readable unless its peer left)
        try:
            asyncio.get_running_loop().add_reader(self._sock.fileno(), on_end)
        except (OSError, ValueError):  # closed meanwhile
            on_end()

    def unwatch_idle(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            asyncio.get_running_loop().remove_reader(self._sock.fileno())

    async def close(self) -> None:
        self.shut()

    def shut(self) -> None:
        """Close now (`close` does no more; the lane calls this after a failure)."""
        if not self._closed:
            self._closed = True
            self._lane.fail(self._lost(None, "receive"))
            loop = asyncio.get_running_loop()
            with contextlib.suppress(OSError, ValueError):
                # Unregister before closing, so no stale selector entry outlives
                # the fd number, which the next socket may reuse.
                fd = self._sock.fileno()
                loop.remove_reader(fd)
                loop.remove_writer(fd)
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
            me = asyncio.current_task()
            for task in list(self._busy):
                if task is not me:
                    task.cancel(_CLOSED)


class TCPListener(Listener):
    def __init__(self, sock: socket.socket, handler: Handler, address: str | None = None) -> None:
        self._sock = sock
        self._handler = handler
        self._tasks: set[asyncio.Task] = set()
        self._streams: set[TCPStream] = set()
        if address is None:
            host, port = sock.getsockname()[:2]
            address = f"tcp://{host}:{port}" if ":" not in host else f"tcp://[{host}]:{port}"
        self._address = address
        self._accepter = asyncio.get_running_loop().create_task(self._accept_loop())

    @property
    def address(self) -> str:
        return self._address

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(self._sock)
            except OSError as exc:
                if self._sock.fileno() < 0 or exc.errno in (errno.EBADF, errno.EINVAL):
                    return  # closed
                # Out of descriptors or buffers, or a new connection's own
                # error passed on (accept(2): retry those): the listener
                # lives on, or no node could ever connect again.
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ECONNABORTED):
                    log.warning("accept on %s failed (%s); retrying", self._address, exc)
                await asyncio.sleep(0.05)
                continue
            stream = self._accepted(conn, addr)
            if stream is None:
                continue
            self._streams.add(stream)
            task = loop.create_task(self._serve(stream))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _accepted(self, conn: socket.socket, addr: Any) -> TCPStream | None:
        """The stream of an accepted connection (None: refused, and closed)."""
        return TCPStream(conn, f"{addr[0]}:{addr[1]}")

    async def _serve(self, stream: TCPStream) -> None:
        try:
            await self._handler(stream)
        finally:
            self._streams.discard(stream)
            await stream.close()

    async def close(self) -> None:
        self._accepter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._accepter
        self._sock.close()
        for stream in list(self._streams):
            await stream.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


async def resolve(host: str, port: int, flags: int = 0) -> list:
    """getaddrinfo, without a thread for an address given as numbers (nearly
    always): the loop's thread pool is shut down once the main thread ends,
    while other threads of the program may still be connecting."""
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                  flags=flags | socket.AI_NUMERICHOST)
    except socket.gaierror:
        pass  # a name: ask the resolver, off the loop
    except (UnicodeError, ValueError) as exc:  # e.g. an empty label: no name at all
        raise OSError(f"not a host name: {exc}") from exc
    try:
        return await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                            flags=flags)
    except (UnicodeError, ValueError) as exc:
        raise OSError(f"not a host name: {exc}") from exc


#: A source port that cannot be had for this connection: taken (by any
#: socket, or one of ours in TIME_WAIT that a bound socket may not reuse),
#: or its connection to this peer exists already.
_PORT_TAKEN = (errno.EADDRINUSE, errno.EADDRNOTAVAIL)


def _socket(family: int, peer: str) -> socket.socket:
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:  # e.g. no file descriptor left
        raise ConnectionRefused(f"cannot open a socket to {peer}: "
                                f"{exc.strerror or exc}") from exc
    sock.setblocking(False)
    return sock


async def _dial(family: int, addr: Any, bind: Bind | None, peer: str) -> socket.socket:
    """A socket connected to `addr`, from where `bind` says: bound before it
    connects, to the first of its ports that can be had. SO_REUSEADDR lets a
    port serve connections to several peers (distinct 5-tuples); a port
    another process holds, or whose connection to this peer exists, is
    skipped. ConnectionRefused if none can be had, or the peer refuses."""
    loop = asyncio.get_running_loop()
    ports: tuple[int | None, ...] = (None,) if bind is None else (bind.ports or (0,))
    for src in ports:
        sock = _socket(family, peer)
        try:
            if bind is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((bind.host, src))
                except OSError as exc:
                    if src and exc.errno == errno.EADDRINUSE:
                        sock.close()
                        continue
                    raise ConnectionRefused(f"cannot connect to {peer} from "
                                            f"{bind.host or 'any address'}:{src}: "
                                            f"{exc.strerror or exc}") from exc
            try:
                await loop.sock_connect(sock, addr)
            except OSError as exc:
                if src and exc.errno in _PORT_TAKEN:
                    sock.close()
                    continue
                raise ConnectionRefused(f"cannot connect to {peer}: "
                                        f"{exc.strerror or exc}") from exc
            return sock
        except BaseException:  # refused, or cancelled (its caller gave up): the socket goes
            sock.close()
            raise
    raise ConnectionRefused(f"cannot connect to {peer} from {bind.host or 'any address'}: "
                            f"every source port asked ({len(ports)}, {ports[0]} to "
                            f"{ports[-1]}) is in use")


class TCPBackend(Backend):
    scheme = "tcp"

    def __init__(self, tls: TLS | None = None) -> None:
        #: every connection in TLS (`transports.tls`), or none
        self.tls = tls

    def with_tls(self, tls: TLS) -> Backend:
        return TCPBackend(tls)

    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        if not (isinstance(port, int) and 0 <= port <= 65535):
            raise ConnectionRefused(f"cannot listen on {host}:{port}: ports are 0 to 65535")
        try:
            infos = await resolve(host, port, socket.AI_PASSIVE)
        except OSError as exc:
            raise ConnectionRefused(f"cannot listen on {host}:{port}: {exc}") from exc
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            sock.close()
            raise ConnectionRefused(f"cannot listen on {host}:{port}: {exc}") from exc
        sock.listen(512)
        sock.setblocking(False)
        if self.tls is not None:
            from .tls import TLSListener

            return TLSListener(sock, handler, self.tls)
        return TCPListener(sock, handler)

    async def connect(self, address: str, timeout: float, bind: Bind | None = None) -> Stream:
        _, host, port = split_address(address)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout
        try:
            async with asyncio.timeout(timeout):
                infos = await resolve(host, port)
        except TimeoutError as exc:
            raise Timeout(f"resolving {host!r} took longer than {timeout:g}s") from exc
        except OSError as exc:
            raise ConnectionRefused(f"cannot resolve {host!r}: {exc}") from exc
        family, _, _, _, addr = infos[0]
        try:
            async with asyncio.timeout(timeout):
                sock = await _dial(family, addr, bind, f"{host}:{port}")
        except TimeoutError as exc:
            raise Timeout(f"connecting to {host}:{port} took longer than {timeout:g}s") from exc
        if self.tls is None:
            return TCPStream(sock, f"{host}:{port}")
        from .tls import connect

        return await connect(sock, f"{host}:{port}", self.tls, max(0.0, give_up - loop.time()))
