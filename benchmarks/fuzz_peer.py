"""The two sides of a fuzz run: a hostile peer that talks raw bytes with a
deadline on every wait, the checks of what a server did with each input
(`Outcome`), the well-behaved clients that check the server still serves
(`directory_alive`, `data_alive`), and a server run on its own event loop
in a thread (`Served`) that records any exception its connection handler
let out and any record logged at ERROR.

What a server may do with a hostile input, and nothing else: answer with a
clear refusal (a `Failure` reply or error frame naming the error), close
that connection, or (for an input that happens to be a valid message) serve
it as usual; each within the deadline. A connection that stays silent past
it is a hang; a handshake that accepts a peer without the token is a breach.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
import traceback
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hoplite_gpu import messages as m
from hoplite_gpu.auth import check_verdict, client_answer
from hoplite_gpu.errors import HopliteError
from hoplite_gpu.protocol import FRAME, FRAME_DATA, FRAME_ERROR
from hoplite_gpu.transports import split_address
from hoplite_gpu.transports.base import MESSAGE_KINDS

from .fuzz_inputs import LENGTH, frame

#: The request id of the ping sent after an input, to see the connection
#: still answers (chosen so no corpus message uses it).
SENTINEL = 0x7FFF_FFF1


class Hang(AssertionError):
    """The server neither answered nor closed within the deadline."""


@dataclass
class Outcome:
    """What one hostile input came to: `kind` is ``refused`` (a clear error
    reply or frame, then maybe a close), ``closed`` (closed without one),
    ``answered`` (served as a valid request), ``hang``, ``breach`` (a peer
    without the token was let in) or ``unclear`` (a refusal that names no
    error); `detail` says more."""

    kind: str
    detail: str = ""
    #: the peer's local port (the server names the connection by it)
    port: int = 0

    @property
    def bad(self) -> bool:
        return self.kind in ("hang", "breach", "unclear")


class RawPeer:
    """A blocking TCP connection whose every receive has a deadline."""

    def __init__(self, address: str, deadline: float) -> None:
        _, host, port = split_address(address)
        self.deadline = deadline
        self.sock = socket.create_connection((host, port), timeout=self._left())
        self.port = self.sock.getsockname()[1]
        self._buf = bytearray()
        self.ended = False  # the server closed (or reset) the connection

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise Hang("deadline passed")
        return left

    def send(self, pieces: list[bytes], pause: float = 0.0) -> None:
        """Send each piece in its own write; a refused write (the server
        closed already) ends sending quietly."""
        try:
            for piece in pieces:
                self.sock.settimeout(self._left())
                self.sock.sendall(piece)
                if pause:
                    time.sleep(pause)
        except (BrokenPipeError, ConnectionResetError):
            self.ended = True
        except TimeoutError:
            raise Hang("the server took no bytes within the deadline") from None

    def finish_writing(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def _fill(self, n: int) -> bool:
        """At least `n` bytes buffered; False if the connection ended first."""
        while len(self._buf) < n:
            if self.ended:
                return False
            try:
                self.sock.settimeout(self._left())
                got = self.sock.recv(1 << 16)
            except TimeoutError:
                raise Hang("no answer and no close within the deadline") from None
            except (ConnectionResetError, BrokenPipeError):
                got = b""
            if not got:
                self.ended = True
                return False
            self._buf += got
        return True

    def take(self, n: int) -> bytes | None:
        if not self._fill(n):
            return None
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def recv_message(self) -> Any:
        """The next message as a map (or whatever it decodes to); None once closed."""
        head = self.take(LENGTH.size)
        if head is None:
            return None
        (n,) = LENGTH.unpack(head)
        body = self.take(n)
        return None if body is None else m.decode_map("server", body)

    def recv_frame(self) -> tuple[int, bytes] | None:
        """The next head on a data connection and what follows it: (kind,
        payload) for an error frame or a message's bytes, (kind, b"") for a
        data frame (its length counts bytes, none follow); None once closed."""
        head = self.take(FRAME.size)
        if head is None:
            return None
        kind, n = FRAME.unpack(head)
        if kind == FRAME_DATA:
            return kind, b""
        body = self.take(n)
        return None if body is None else (kind, body)

    def handshake(self, token: str) -> None:
        s_nonce, c_nonce, proof = client_answer(self.recv_message() or {}, token, "server")
        self.send([frame(m.encode(proof))])
        check_verdict(self.recv_message() or {}, token, s_nonce, c_nonce, "server")

    def close(self) -> None:
        self.sock.close()


def _clear(reply: dict) -> bool:
    """A refusal that names its error and says what was wrong."""
    return (isinstance(reply.get("error"), str) and bool(reply["error"])
            and isinstance(reply.get("message"), str) and bool(reply["message"]))


def _until_closed(peer: RawPeer, seen: list[Any]) -> None:
    while (msg := peer.recv_message()) is not None:
        seen.append(msg)


# ------------------------------------------------------ one input per phase ---
def _connected(address: str, deadline_s: float, run: Callable[[RawPeer], Outcome]) -> Outcome:
    """`run(peer)` on a new connection, its outcome tagged with the peer's port."""
    peer = RawPeer(address, time.monotonic() + deadline_s)
    try:
        outcome = run(peer)
    finally:
        peer.close()
    outcome.port = peer.port
    return outcome


def before_handshake(address: str, pieces: list[bytes], hold: bool, deadline_s: float) -> Outcome:
    """`pieces` instead of the handshake's proof; with `hold` the connection
    is left open (the server's handshake deadline must end it)."""
    return _connected(address, deadline_s, lambda peer: _before_handshake(peer, pieces, hold))


def _before_handshake(peer: RawPeer, pieces: list[bytes], hold: bool) -> Outcome:
    try:
        peer.recv_message()  # the challenge
        peer.send(pieces)
        if not hold:
            peer.finish_writing()
        seen: list[Any] = []
        _until_closed(peer, seen)
    except Hang as exc:
        return Outcome("hang", str(exc))
    except HopliteError as exc:  # (the server's own bytes: never expected to be bad)
        return Outcome("unclear", f"{type(exc).__name__}: {exc}")
    if any(isinstance(v, dict) and v.get("ok") for v in seen):
        return Outcome("breach", f"accepted without the token: {seen!r:.200}")
    if any(isinstance(v, dict) and v.get("ok") is False for v in seen):
        return Outcome("refused", str(seen[-1].get("error")))
    return Outcome("closed")


def after_handshake(address: str, token: str, pieces: list[bytes], finish: str,
                    deadline_s: float, node: str | None = None) -> Outcome:
    """`pieces` on a directory connection past the handshake: as its first
    message (`node` None) or after registering as `node`. `finish`: ``close``
    (stop writing), ``hold`` (stay silent) or ``ping`` (then ask for
    request `SENTINEL`, which a connection still open must answer)."""
    return _connected(address, deadline_s,
                      lambda peer: _after_handshake(peer, token, pieces, finish, node))


def _after_handshake(peer: RawPeer, token: str, pieces: list[bytes], finish: str,
                     node: str | None) -> Outcome:
    seen: list[Any] = []
    try:
        peer.handshake(token)
        if node is not None:
            peer.send([frame(m.encode(m.Register(node=node, address="tcp://127.0.0.1:9")))])
            reply = peer.recv_message()
            if not (isinstance(reply, dict) and reply.get("ok")):
                return Outcome("unclear", f"could not register {node}: {reply!r:.200}")
        peer.send(pieces)
        if finish == "ping" and not peer.ended:
            peer.send([frame(m.encode(m.Ping(rid=SENTINEL)))])
        if finish != "hold":
            peer.finish_writing()
        while (msg := peer.recv_message()) is not None:
            seen.append(msg)
            if not isinstance(msg, dict):
                return Outcome("unclear", f"a reply that is no map: {msg!r:.200}")
            if "error" in msg and not _clear(msg):
                return Outcome("unclear", f"a refusal that names nothing: {msg!r:.200}")
            if msg.get("rid") == SENTINEL or (node is None and msg.get("ok") is True):
                return Outcome("answered", f"{sum('error' in s for s in seen)} refusals")
    except Hang as exc:
        return Outcome("hang", f"{exc}; seen {seen!r:.300}")
    except HopliteError as exc:
        return Outcome("unclear", f"{type(exc).__name__}: {exc}")
    refusals = [s for s in seen if "error" in s]
    return Outcome("refused", refusals[-1]["message"]) if refusals else Outcome("closed")


def data_request(address: str, token: str, pieces: list[bytes], finish: str,
                 deadline_s: float, sentinel: m.Pull | None = None) -> Outcome:
    """`pieces` on a data connection past the handshake, then (`finish`
    ``ping``) the pull `sentinel`; the first frame back (data, a keepalive
    or an error frame) or the close ends it. (An empty range is answered
    with no frame at all: the sentinel's frame answers then.)"""
    return _connected(address, deadline_s,
                      lambda peer: _data_request(peer, token, pieces, finish, sentinel))


def _data_request(peer: RawPeer, token: str, pieces: list[bytes], finish: str,
                  sentinel: m.Pull | None) -> Outcome:
    try:
        peer.handshake(token)
        peer.send(pieces)
        if finish == "ping" and sentinel is not None and not peer.ended:
            peer.send([frame(m.encode(sentinel))])
        if finish != "hold":
            peer.finish_writing()
        got = peer.recv_frame()
    except Hang as exc:
        return Outcome("hang", str(exc))
    except HopliteError as exc:
        return Outcome("unclear", f"{type(exc).__name__}: {exc}")
    if got is None:
        return Outcome("closed")
    kind, body = got
    if kind == FRAME_DATA or kind in MESSAGE_KINDS:
        return Outcome("answered", f"a head of kind {kind}, {len(body)} bytes after it")
    if kind != FRAME_ERROR:
        return Outcome("unclear", f"a frame of kind {kind}")
    reply = m.decode_map("server", body)
    return Outcome("refused", reply["message"]) if _clear(reply) else \
        Outcome("unclear", f"an error frame that names nothing: {reply!r:.200}")


# ------------------------------------------------------- well-behaved clients ---
def directory_alive(address: str, token: str, node: str, deadline_s: float = 5.0) -> None:
    """Register as `node`, put a small object, locate it: AssertionError
    (or Hang) unless each answer is right."""
    peer = RawPeer(address, time.monotonic() + deadline_s)
    try:
        peer.handshake(token)
        oid = os.urandom(20)
        data = os.urandom(8)
        layout = {"kind": "bytes", "dtype": "|u1", "shape": [8], "nbytes": 8}
        peer.send([frame(m.encode(msg)) for msg in (
            m.Register(node=node, address="tcp://127.0.0.1:9"),
            m.Put(rid=1, oid=oid, size=8, layout=layout, inline=data),
            m.Locate(rid=2, oid=oid))])
        replies = {}
        while len(replies) < 3:
            msg = peer.recv_message()
            assert msg is not None, f"the directory closed on a well-behaved node: {replies}"
            replies[msg.get("rid")] = msg
        assert replies[None].get("ok") is True, replies
        assert replies[1].get("ok") is True, replies
        assert replies[2].get("inline") == data, replies
    finally:
        peer.close()


def data_alive(address: str, token: str, oid: bytes, expected: bytes,
               deadline_s: float = 5.0) -> None:
    """Pull all of `oid` and compare with `expected`."""
    peer = RawPeer(address, time.monotonic() + deadline_s)
    try:
        peer.handshake(token)
        peer.send([frame(m.encode(m.Pull(oid=oid, offset=0, end=len(expected),
                                         bare=max(1, len(expected)))))])
        got = bytearray()
        while True:  # message bytes under their heads, keepalives, then the end frame
            head = peer.take(FRAME.size)
            assert head is not None, f"the data server closed after {len(got)} bytes"
            kind, n = FRAME.unpack(head)
            if kind in MESSAGE_KINDS:
                body = peer.take(n)
                assert body is not None, f"the data server closed after {len(got)} bytes"
                got += body
            elif kind == FRAME_DATA and n == len(expected):
                break  # the end of the answer
            elif kind == FRAME_DATA:
                assert n == 0, f"a data frame of {n} bytes, neither a keepalive nor the end"
            else:
                body = peer.take(n) or b""
                raise AssertionError(f"an error frame: {m.decode_map('server', body)}")
        assert bytes(got) == expected, "the data server sent other bytes"
    finally:
        peer.close()


# ------------------------------------------------------------ the server ---
@dataclass
class Crash:
    """An exception a server let out: `peer` is the connection it came from
    (``host:port``) where known."""

    peer: str
    text: str


class _Errors(logging.Handler):
    def __init__(self, sink: Callable[[Crash], None]) -> None:
        super().__init__(logging.ERROR)
        self._sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + "".join(traceback.format_exception(*record.exc_info))
        self._sink(Crash("", f"{record.name}: {text}"))


@dataclass
class Served:
    """A directory (`kind` ``directory``) or a data server holding one object
    of `size` random bytes (``data``) on its own event loop in a thread, with
    short deadlines so that a peer that stays silent is dropped quickly."""

    kind: str
    token: str = "fuzz-token"
    handshake_s: float = 0.5
    lease_s: float = 1.0
    size: int = 1 << 16
    crashes: list[Crash] = field(default_factory=list)
    address: str = ""
    oid: bytes = b""
    data: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"fuzz-{self.kind}")
        self._server: Any = None
        self._lock = threading.Lock()
        self._handler = _Errors(self._crashed)

    def _crashed(self, crash: Crash) -> None:
        with self._lock:
            self.crashes.append(crash)

    def call(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def __enter__(self) -> Served:
        logging.getLogger().addHandler(self._handler)
        self._loop.set_exception_handler(
            lambda loop, ctx: self._crashed(Crash("", f"loop: {ctx.get('message')}: "
                                                      f"{ctx.get('exception')!r}")))
        self._thread.start()
        self.address = self.call(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.call(self._server.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
            logging.getLogger().removeHandler(self._handler)

    async def _start(self) -> str:
        if self.kind == "directory":
            from hoplite_gpu.directory.server import DirectoryServer

            self._server = DirectoryServer(self.token, handshake_timeout=self.handshake_s,
                                           lease_s=self.lease_s,
                                           heartbeat_interval_s=self.lease_s / 4)
        else:
            self._server = self._data_server()
        real = self._server._serve

        async def guarded(stream: Any) -> None:
            try:
                await real(stream)
            except asyncio.CancelledError:
                raise
            except BaseException:  # noqa: BLE001 - what we are here to find
                self._crashed(Crash(stream.peer, traceback.format_exc()))

        self._server._serve = guarded  # (read by start(): the listener calls it)
        return await self._server.start()

    def _data_server(self) -> Any:
        from hoplite_gpu.config import Config
        from hoplite_gpu.ids import ObjectID
        from hoplite_gpu.node.store import ChunkStore
        from hoplite_gpu.node.transfer import DataServer
        from hoplite_gpu.values import Layout

        store = ChunkStore()
        oid = ObjectID.random()
        self.oid, self.data = oid.binary, os.urandom(self.size)
        obj = store.create(oid, Layout(kind="bytes", dtype="|u1", shape=(self.size,),
                                       nbytes=self.size))
        memoryview(obj.buffer).cast("B")[:] = self.data
        obj.advance(self.size)
        # A pull of an object that never comes gets a keepalive within a
        # third of the stall timeout, and an error frame after timeout_s.
        config = Config(timeout_s=self.lease_s, stall_timeout_s=min(self.lease_s, 0.3),
                        connect_timeout_s=self.handshake_s, shared_memory=False)
        return DataServer(store, self.token, config)

    def take_crashes(self) -> list[Crash]:
        with self._lock:
            out, self.crashes[:] = list(self.crashes), []
        return out

    def connections(self) -> int:
        """How many connections the server is handling now."""
        return len(self._server._listener._tasks)


def peer_name(port: int) -> str:
    return f"127.0.0.1:{port}"


def _settled(count: Callable[[], int], seconds: float = 3.0) -> int:
    """`count()` once it has not changed for 0.2 s (a loaded machine may
    take a while to drop what it drops), or after `seconds`."""
    deadline = time.monotonic() + seconds
    last, since = count(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 0.2:
            break
    return last


def held_per_unproven_peer(served: Served, peers: int, announce: int) -> tuple[float, int]:
    """Bytes this process holds per connection (tracemalloc: the server's
    side, and the peers' own sockets too, so an upper bound) once `peers`
    connections each read the challenge, announced a proof of `announce`
    bytes and sent one byte of it; and how many connections the server
    then still serves. The server's handshake deadline must be longer than
    this takes."""
    before_handshake(served.address, [b"warm"], False, 5.0)  # (first-use allocations)
    opened: list[RawPeer] = []
    tracemalloc.start(32)
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(peers):
            peer = RawPeer(served.address, time.monotonic() + 5.0)
            opened.append(peer)
            peer.recv_message()
            peer.send([LENGTH.pack(announce) + b"\x82"])
        serving = _settled(served.connections)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
        for peer in opened:
            peer.close()
    # Not tracemalloc's own, nor log records a test runner keeps (which also
    # keep what they name: tests/test_fuzz_servers.py turns them off).
    ignore = [tracemalloc.Filter(False, pattern, all_frames=True)
              for pattern in ("*/logging/*", "*/_pytest/*", tracemalloc.__file__)]
    grown = sum(d.size_diff for d in after.filter_traces(ignore).compare_to(
        before.filter_traces(ignore), "filename"))
    return grown / peers, serving


__all__ = ["SENTINEL", "Crash", "Hang", "Outcome", "RawPeer", "Served", "after_handshake",
           "before_handshake", "data_alive", "data_request", "directory_alive",
           "held_per_unproven_peer", "peer_name"]
