"""TLS on the TCP transport (`TCPBackend.with_tls`): every connection mutual,
each side's certificate checked against the cluster's own CA.

A TLS stream is a `TCPStream` over a non-blocking `ssl.SSLSocket`, so the
data path, its lane and its reader callbacks stay as they are. What
differs is kept here, in `TLSSocket` and `TLSStream`:

- a receive or send that must wait raises BlockingIOError, as a plain
  socket's does (the ssl module raises SSLWantReadError/SSLWantWriteError);
- a TLS write that had to wait must be retried with the same bytes, so a
  send writes at most `_PIECE` bytes: its callers retry with the same view,
  hence the same piece;
- bytes may wait decrypted in the TLS layer while the socket has nothing
  to read (a record larger than the receive that took part of it), so a
  reader registered then is also called at once (`TLSStream.add_reader`);
- the kernel's receive low-water mark counts encrypted bytes, not the
  plaintext a receive waits for, so it stays at its default of one byte.

Nodes are addressed by IP and certificates name hosts, if anything, so
host names are not checked: a peer is whoever shows a certificate that the
cluster's CA signed (docs/security.md). The cluster token's handshake runs
inside TLS as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from hoplite_gpu.errors import AuthenticationFailed, HopliteError, Timeout, TransportClosed

from .base import Handler
from .tcp import TCPListener, TCPStream, _wake

log = logging.getLogger("hoplite_gpu.transports.tls")

#: Most bytes one TLS write takes (a retry after a wait repeats the same piece).
_PIECE = 256 * 1024


@dataclass(frozen=True)
class TLS:
    """The TLS a process speaks: its server and client contexts (each with
    its certificate and the cluster's CA, both requiring the peer's), and how
    long an accepted connection may take to finish its TLS handshake."""

    server: ssl.SSLContext
    client: ssl.SSLContext
    handshake_s: float = 10.0


def describe(exc: ssl.SSLError) -> str:
    """What a TLS failure means for the one who reads it."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (f"its certificate was refused: {exc.verify_message} (a peer needs a "
                f"certificate signed by the cluster's CA)")
    reason = (exc.reason or "").upper()
    if "ALERT" in reason:
        return (f"it refused the TLS session ({exc.reason}): it does not accept this "
                f"process's certificate, or speaks no TLS version we do")
    if reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "UNKNOWN_PROTOCOL",
                  "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST"):
        return f"it does not speak TLS ({exc.reason}): is it running without TLS?"
    if reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
        return "it showed no certificate (is it running without TLS settings of its own?)"
    return str(exc)


class TLSSocket:
    """A non-blocking `ssl.SSLSocket` as `TCPStream` and its lane use a plain
    socket (see the module doc)."""

    def __init__(self, ssock: ssl.SSLSocket) -> None:
        self._s = ssock
        self.family = ssock.family

    def fileno(self) -> int:
        return self._s.fileno()

    def setblocking(self, flag: bool) -> None:
        self._s.setblocking(flag)

    def setsockopt(self, *args: Any) -> None:
        self._s.setsockopt(*args)

    def getsockname(self) -> Any:
        return self._s.getsockname()

    def pending(self) -> int:
        """Bytes decrypted and not yet received."""
        return self._s.pending()

    def do_handshake(self) -> None:
        self._s.do_handshake()

    def recv_into(self, view: memoryview) -> int:
        try:
            return self._s.recv_into(view)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError(errno.EAGAIN, "no whole TLS record yet") from None
        except ssl.SSLError as exc:
            raise ConnectionAbortedError(f"TLS: {describe(exc)}") from exc

    def send(self, view: memoryview) -> int:
        try:
            return self._s.send(view[:_PIECE])
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
            raise BlockingIOError(errno.EAGAIN, "TLS write must wait") from None
        except ssl.SSLError as exc:
            raise ConnectionAbortedError(f"TLS: {describe(exc)}") from exc

    def shutdown(self, how: int) -> None:
        # The socket's own shutdown: SSLSocket.shutdown would also drop its TLS
        # state under a receive another task may still be in.
        socket.socket.shutdown(self._s, how)

    def close(self) -> None:
        self._s.close()


class TLSStream(TCPStream):
    """A TCP stream in TLS (see the module doc). `handshake` must end before use."""

    tls: ClassVar[bool] = True
    _loop_io: ClassVar[bool] = False
    _sock: TLSSocket

    def add_reader(self, callback: Callable[[], None]) -> None:
        super().add_reader(callback)
        if self._sock.pending():
            # (decrypted bytes wait: the socket may never become readable for them)
            asyncio.get_running_loop().call_soon(callback)

    def buffered(self) -> bool:
        return self._sock.pending() > 0

    def expect(self, rest: int) -> None:
        return None  # (see the module doc: the low-water mark counts encrypted bytes)

    def _set_lowat(self, nbytes: int) -> None:
        return None

    def watch_idle(self, on_end: Callable[[], None]) -> None:
        if self.buffered():  # (it sent something unasked: of no more use)
            on_end()
            return
        super().watch_idle(on_end)

    async def _wait_recv(self, view: memoryview) -> int:
        while True:
            try:
                return self._sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                pass
            except (OSError, ValueError) as exc:
                await self.close()
                raise self._lost(exc, "receive") from exc
            await self._guarded("receive", self._ready())

    async def _ready(self, writable: bool = False) -> None:
        """Wait until the socket is readable (or writable)."""
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = self._sock.fileno()
        (loop.add_writer if writable else loop.add_reader)(fd, _wake, ready)
        try:
            await ready
        finally:
            if not self.closed:
                (loop.remove_writer if writable else loop.remove_reader)(fd)

    async def handshake(self, timeout: float) -> None:
        """Run the TLS handshake within `timeout` seconds; on failure the stream
        is closed and AuthenticationFailed (the peer's certificate, or ours, was
        refused; the peer speaks no TLS), TransportClosed or Timeout raised."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        self._sock.do_handshake()
                        return
                    except ssl.SSLWantReadError:
                        await self._ready()
                    except ssl.SSLWantWriteError:
                        await self._ready(writable=True)
        except TimeoutError:
            await self.close()
            raise Timeout(f"TLS handshake with {self.peer} took longer than {timeout:g}s (a "
                          "peer without TLS, or one that stopped)") from None
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError) as exc:
            await self.close()
            raise TransportClosed(f"{self.peer} closed the connection during the TLS "
                                  "handshake") from exc
        except ssl.SSLError as exc:
            await self.close()
            raise AuthenticationFailed(f"TLS handshake with {self.peer} failed: "
                                       f"{describe(exc)}") from exc
        except (OSError, ValueError) as exc:
            await self.close()
            raise TransportClosed(f"connection to {self.peer} closed during the TLS "
                                  f"handshake: {exc}") from exc
        except BaseException:  # (cancelled: its caller gave up)
            await self.close()
            raise


class TLSListener(TCPListener):
    """Accepts TLS streams: each one's handshake runs in its own task, within
    `TLS.handshake_s`, before the handler sees it; one that fails is logged
    (naming the peer and the cause) and closed."""

    def __init__(self, sock: socket.socket, handler: Handler, tls: TLS) -> None:
        self._tls = tls
        super().__init__(sock, handler)

    def _accepted(self, conn: socket.socket, addr: Any) -> TCPStream | None:
        peer = f"{addr[0]}:{addr[1]}"
        try:
            ssock = self._tls.server.wrap_socket(conn, server_side=True,
                                                 do_handshake_on_connect=False)
        except (OSError, ValueError) as exc:  # (e.g. it is gone already)
            conn.close()
            log.info("dropped a connection from %s before TLS: %s", peer, exc)
            return None
        return TLSStream(TLSSocket(ssock), peer)

    async def _serve(self, stream: TCPStream) -> None:
        assert isinstance(stream, TLSStream)
        try:
            await stream.handshake(self._tls.handshake_s)
        except HopliteError as exc:
            log.warning("refused a connection from %s: %s", stream.peer, exc)
            self._streams.discard(stream)
            return
        await super()._serve(stream)


async def connect(sock: socket.socket, peer: str, tls: TLS, timeout: float) -> TLSStream:
    """The TLS stream over `sock`, connected to `peer`: handshake done within
    `timeout` seconds, else `sock` closed and the failure raised."""
    try:
        ssock = tls.client.wrap_socket(sock, server_side=False, do_handshake_on_connect=False)
    except (OSError, ValueError) as exc:
        sock.close()
        raise TransportClosed(f"connection to {peer} closed before TLS: {exc}") from exc
    stream = TLSStream(TLSSocket(ssock), peer)
    await stream.handshake(timeout)
    return stream


def wrap_blocking(sock: socket.socket, tls: TLS, peer: str, timeout: float) -> ssl.SSLSocket:
    """`sock` (connected, blocking) in TLS as a client, its handshake done
    within `timeout` seconds; on failure `sock` is closed and
    AuthenticationFailed, TransportClosed or Timeout raised."""
    try:
        ssock = tls.client.wrap_socket(sock, server_side=False, do_handshake_on_connect=False)
    except (OSError, ValueError) as exc:
        sock.close()
        raise TransportClosed(f"connection to {peer} closed before TLS: {exc}") from exc
    try:
        ssock.settimeout(timeout)
        ssock.do_handshake()
    except TimeoutError:
        ssock.close()
        raise Timeout(f"TLS handshake with {peer} took longer than {timeout:g}s") from None
    except (ssl.SSLEOFError, ssl.SSLZeroReturnError) as exc:
        ssock.close()
        raise TransportClosed(f"{peer} closed the connection during the TLS handshake") from exc
    except ssl.SSLError as exc:
        ssock.close()
        raise AuthenticationFailed(f"TLS handshake with {peer} failed: {describe(exc)}") from exc
    except OSError as exc:
        ssock.close()
        raise TransportClosed(f"connection to {peer} closed during the TLS handshake: "
                              f"{exc}") from exc
    return ssock


def shutdown(sock: socket.socket) -> None:
    """Shut a socket down, plain or TLS, leaving a TLS socket's state to a
    receive that another thread may still be in (which then sees the end)."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
