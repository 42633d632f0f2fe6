"""Same-host streams: Unix sockets in the abstract namespace, which can pass
file descriptors (scheme ``local``).

A listener is named after a host and a port: a node's data server listens
here under its data address's, so a puller on the same host finds it by the
address it was given (`connect` takes any scheme's address and uses only
its host and port). "Same host" means the same network namespace: abstract
Unix sockets belong to one, so nodes in different namespaces (containers,
the emulated hosts of `benchmarks/emulated.py`) never find each other this
way. Only processes of the same user talk (SO_PEERCRED, checked on both
sides: any user may bind a name first).

A stream is a byte stream (`TCPStream`'s calls, messages in parts
included) that can also pass a descriptor with a byte (`caps.local`:
`send_descriptor`, `recv_descriptor`): what the same-host pull modes map
(`hoplite_gpu.node.shm`).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import random
import socket
import struct
import sys
import time

from hoplite_gpu.errors import (
    ConfigError,
    ConnectionRefused,
    Timeout,
    TransportClosed,
    TransportError,
)

from .base import Backend, Bind, Handler, Listener, Stream, StreamCaps, split_address
from .tcp import TCPListener, TCPStream, resolve

_NAME = "hoplite-gpu-data "
#: Tries to find a free name when asked to listen on port 0.
_FREE_TRIES = 64


def usable() -> bool:
    """Whether this platform has abstract Unix sockets and SO_PEERCRED (Linux)."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_PEERCRED") \
        and hasattr(socket, "AF_UNIX")


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def socket_name(address: str) -> bytes:
    """The abstract Unix socket of the listener for `address` (``host:port``
    with any scheme, or none: only the host and port name it)."""
    _, host, port = split_address(address, "local")
    return b"\0" + (_NAME + _host_port(host, port)).encode()


def same_user(sock: socket.socket) -> bool:
    """Whether the peer of a connected Unix socket runs as our user (a
    listener checks who connected; a client checks who listens, since any
    user can bind a name in the abstract namespace first)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()


class LocalStream(TCPStream):
    """A stream over this host's Unix socket: a byte stream that can pass a
    file descriptor with a byte."""

    caps = StreamCaps(partial_receive=True, message_parts=True, local=True)

    async def send_descriptor(self, tag: bytes, fd: int | None, timeout: float) -> None:
        if fd is None:
            await self.send(tag)
            return
        if self.closed:
            raise TransportClosed(f"connection to {self.peer} closed before a descriptor went")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        while True:
            try:
                self._sock.sendmsg([tag], rights)
                return
            except (BlockingIOError, InterruptedError):
                if loop.time() > deadline:
                    raise Timeout(f"could not pass a descriptor within {timeout:g}s") from None
                await asyncio.sleep(0.001)
            except OSError as exc:
                await self.close()
                raise TransportClosed(f"connection to {self.peer} failed: {exc}") from exc

    async def recv_descriptor(self, timeout: float) -> tuple[bytes, list[int]]:
        self._plain()
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        loop.add_reader(self._sock, lambda: ready.done() or ready.set_result(None))
        try:
            async with asyncio.timeout(timeout):
                await ready
        except TimeoutError:
            raise Timeout(f"peer {self.peer} sent nothing for {timeout:g}s "
                          "(stall timeout)") from None
        finally:
            with contextlib.suppress(ValueError, OSError):  # (closed meanwhile)
                loop.remove_reader(self._sock)
        size = struct.calcsize("i")
        try:
            msg, anc, _flags, _addr = self._sock.recvmsg(1, socket.CMSG_SPACE(size))
        except OSError as exc:
            raise TransportClosed(f"connection to {self.peer} failed: {exc}") from exc
        fds = [struct.unpack("i", data[:size])[0] for level, kind, data in anc
               if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS and len(data) >= size]
        return msg, fds


class LocalListener(TCPListener):
    """Accepts same-host streams of our own user."""

    def _accepted(self, conn: socket.socket, addr: object) -> TCPStream | None:
        try:
            ours = same_user(conn)
        except OSError:
            ours = False
        if not ours:  # (the token handshake follows for the rest)
            conn.close()
            return None
        return LocalStream(conn, f"{self.address} (same host)")


class LocalBackend(Backend):
    scheme = "local"

    def __init__(self) -> None:
        if not usable():
            raise RuntimeError("same-host streams need Linux (abstract Unix sockets, "
                               "SO_PEERCRED)")

    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        if not (isinstance(port, int) and 0 <= port <= 65535):
            raise ConnectionRefused(f"cannot listen on {host}:{port}: ports are 0 to 65535")
        try:
            await resolve(host, port, socket.AI_PASSIVE)  # (a name of this host, or refused)
        except OSError as exc:
            raise ConnectionRefused(f"cannot listen on {host}:{port}: {exc}") from exc
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            port = _bind(sock, host, port)
        except OSError as exc:
            sock.close()
            raise ConnectionRefused(f"cannot listen on local://{_host_port(host, port)}: "
                                    f"{exc}") from exc
        sock.listen(128)
        sock.setblocking(False)
        return LocalListener(sock, handler, f"local://{_host_port(host, port)}")

    async def connect(self, address: str, timeout: float, bind: Bind | None = None) -> Stream:
        """A stream to the listener named after `address`'s host and port.
        ConnectionRefused where there is none here (another host, another
        namespace, nobody listening) or it is another user's; Timeout when
        its backlog stays full for `timeout` (a burst of connections). A
        Unix socket has no source address to choose (`bind`: ConfigError)."""
        if bind is not None:
            raise ConfigError("the same-host transport cannot choose where a connection starts")
        name = socket_name(address)
        peer = f"{address} (same host)"
        give_up, pause = time.monotonic() + timeout, 0.001
        while True:
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            except OSError as exc:  # e.g. no descriptor left: not a refusal
                raise TransportError(f"cannot open a socket to {address}: "
                                     f"{exc.strerror or exc}") from exc
            sock.setblocking(False)
            try:
                # (a Unix socket connects at once or fails: no asyncio wait, which
                # takes a full backlog's EAGAIN for "in progress", then "connected")
                sock.connect(name)
                if not same_user(sock):
                    raise ConnectionRefused(f"{address}: its same-host socket is another "
                                            "user's")
                return LocalStream(sock, peer)
            except BlockingIOError:
                sock.close()
                if time.monotonic() >= give_up:
                    raise Timeout(f"{address}: its same-host socket's backlog stayed full for "
                                  f"{timeout:g}s") from None
            except OSError as exc:
                sock.close()
                raise ConnectionRefused(f"no same-host socket for {address}: "
                                        f"{exc.strerror or exc}") from exc
            except BaseException:
                sock.close()
                raise
            await asyncio.sleep(pause)
            pause = min(2 * pause, 0.05)


def _bind(sock: socket.socket, host: str, port: int) -> int:
    """Bind `sock` to the name of (host, port); port 0: a free one. Returns the port."""
    if port:
        sock.bind(socket_name(f"{_host_port(host, port)}"))
        return port
    for _ in range(_FREE_TRIES):
        candidate = random.randint(1024, 65535)
        try:
            sock.bind(socket_name(_host_port(host, candidate)))
        except OSError:
            continue
        return candidate
    raise OSError(f"no free same-host name for {host} after {_FREE_TRIES} tries")
