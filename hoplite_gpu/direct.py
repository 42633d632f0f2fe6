"""Direct calls: blocking calls of small objects made on the caller's own
thread, over a TCP connection of its own to the directory.

A blocking call otherwise hands its work to the runtime's loop thread and
waits to be handed the answer back: two thread wake-ups on every call, which
on a busy machine cost more than the round trip itself (benchmarks/README,
"The floor under these numbers"). An object at most `inline_threshold` bytes
travels inside directory messages, so neither side needs the loop for it.

What goes direct (docs/architecture.md, "Direct calls"): a put of a host
value of at most `inline_threshold` bytes; a get of an object this node does
not hold (its bytes come back if it is inline; otherwise the directory tells
the node's own connection where to pull it from, and the loop's get joins
that pull); the small collectives' steps, in one write. Anything else (a
larger put, a device value, a connection that broke, a directory that does
not know this node yet) is done by the loop as before, with the time left.
The connection is attached to this process's node: its puts are the node's,
held in the node's store once registered (see `Node.keep_inline`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import messages as m
from .auth import check_verdict, client_answer
from .directory.wire import raise_for_error
from .errors import HopliteError, Timeout, TransportClosed, TransportError
from .ids import ObjectID
from .protocol import LENGTH, MAX_MESSAGE, check_length, decode, pack
from .transports import split_address
from .transports.tls import TLS, shutdown, wrap_blocking
from .values import Layout, fingerprint, from_buffer, to_buffer

if TYPE_CHECKING:
    from .node.node import Node

log = logging.getLogger("hoplite_gpu.direct")

#: What a direct call returns when the loop's path must do the call instead.
MISS = object()
#: A value the loop must finish getting (the rest of the call is done): the
#: directory told the node where to pull it from, the node holds or pulls it
#: already, or it is a device object.
PULL = object()
#: Idle connections kept open for the next call, at most (a call borrows one).
_KEEP = 8
#: Seconds to send the withdrawal of requests whose deadline passed.
_CANCEL_S = 1.0
#: Bytes asked of one receive (an inline object's answer fits).
_RECV_BYTES = 256 * 1024
#: A link idle this long is closed rather than reused (a silent middlebox may
#: have dropped it; a fresh one costs a connect and a handshake).
_IDLE_S = 30.0
#: After a connection could not be made, the loop's path for this long.
_BACKOFF_S = 1.0

#: Bumped in a forked child, whose copies of the links and the loop are not
#: usable (cheaper to compare on every call than asking the pid).
_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


class _Expired(Exception):
    """The request's deadline passed (its withdrawal has been sent)."""


class DirectLink:
    """One blocking connection to the directory, attached to node `node_id`.
    Used by one thread at a time; one request at a time."""

    def __init__(self, host: str, port: int, token: str, node_id: str, timeout: float,
                 tls: TLS | None = None) -> None:
        self.peer = f"{host}:{port}"
        self.last_used = time.monotonic()
        self._next_rid = 1
        self._buf = bytearray()
        deadline = time.monotonic() + timeout
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise TransportError(f"cannot connect to the directory at {self.peer}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot connect to the directory at {self.peer}: {exc}") from exc
        self._sock = sock if tls is None else wrap_blocking(
            sock, tls, self.peer, max(0.001, deadline - time.monotonic()))
        try:
            s_nonce, c_nonce, answer = client_answer(self._recv(deadline), token, self.peer)
            self._send_all([answer], deadline)
            check_verdict(self._recv(deadline), token, s_nonce, c_nonce, self.peer)
            self._send_all([m.Attach(node=node_id)], deadline)
            raise_for_error(m.read_reply(m.Attach, self._recv(deadline)))
        except _Expired:
            self.close()
            raise Timeout(f"the directory at {self.peer} did not accept a direct connection "
                          f"within {timeout:g}s") from None
        except BaseException:
            self.close()
            raise

    def requests(self, msgs: list[m.Request], deadline: float) -> list[m.Body]:
        """Send `msgs` in order, in one write, and return their replies in the
        same order. At `deadline` the unanswered ones are withdrawn and
        `_Expired` raised; the link stays usable. (A locate's answer that
        crossed its withdrawal is skipped: a sender it named was also told to
        the node, which pulls, see `Locate.direct`.)

        Every small call runs this, mostly in a thread just woken from a
        sleep, where each Python call costs several times what it does in a
        tight loop (`python -m benchmarks coldget`): hence few calls here."""
        first = self._next_rid
        self._next_rid = first + len(msgs)
        self._send(b"".join(pack(m.with_rid(msg, first + i)) for i, msg in enumerate(msgs)),
                   deadline)
        replies: list[m.Body | None] = [None] * len(msgs)
        waiting = len(msgs)
        while waiting:
            try:
                reply = self._recv(deadline)
            except _Expired:
                # A put given up is withdrawn here, behind it on this link: on
                # the node's own connection `dropped` could overtake it.
                self._send(b"".join(
                    pack(m.Cancel(request=first + i)) + (
                        pack(m.Dropped(oid=msgs[i].oid)) if isinstance(msgs[i], m.Put) else b"")
                    for i, r in enumerate(replies) if r is None),
                    time.monotonic() + _CANCEL_S)
                raise
            i = reply.get("rid")
            i = i - first if type(i) is int else -1
            if 0 <= i < len(replies) and replies[i] is None:
                replies[i] = m.read_reply(type(msgs[i]), reply)
                waiting -= 1
            # else the late answer to a request withdrawn before: skip it
        return replies  # type: ignore[return-value]

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def fileno(self) -> int:
        return self._sock.fileno()

    def interrupt(self) -> None:
        """Wake a thread blocked on this link (from another thread): its
        receive ends as if the directory had closed the connection."""
        shutdown(self._sock)

    def _send_all(self, msgs: list, deadline: float) -> None:
        self._send(b"".join(pack(msg) for msg in msgs), deadline)

    def _send(self, data: bytes, deadline: float) -> None:
        try:
            self._sock.settimeout(max(0.001, deadline - time.monotonic()))
            self._sock.sendall(data)
        except OSError as exc:  # a timeout too: part of a message may be out
            raise TransportClosed(f"the directory connection to {self.peer} broke: {exc}") from exc

    def _recv(self, deadline: float) -> dict[str, Any]:
        """The next message, read with as few receives as it takes (a reply
        usually comes whole in one). Bytes of a message that the deadline
        cut short stay buffered for the next call."""
        buf = self._buf
        while True:
            have = len(buf)
            if have >= 4:
                n = LENGTH.unpack_from(buf)[0]
                if n > MAX_MESSAGE:
                    check_length(self.peer, n)
                if have >= 4 + n:
                    body = buf[4:4 + n]  # (a copy: the buffer shrinks next)
                    del buf[:4 + n]
                    return decode(self.peer, body)
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Expired
            try:
                self._sock.settimeout(left)
                chunk = self._sock.recv(_RECV_BYTES)
            except TimeoutError:
                continue  # the loop checks the deadline
            except OSError as exc:
                raise TransportClosed(f"the directory connection to {self.peer} broke: {exc}") from exc
            if not chunk:
                raise TransportClosed(f"the directory at {self.peer} closed the connection")
            buf += chunk


def _locate(oid: ObjectID) -> m.Locate:
    return m.Locate(rid=0, oid=oid.binary)  # (direct: the directory knows from the connection)


def _not_available(oids: list[ObjectID], timeout: float) -> str:
    if len(oids) == 1:
        return (f"object {oids[0].hex()} was not available within {timeout:.3g}s: "
                "nobody has put it yet, or every copy is busy")
    return (f"{len(oids)} objects were not all available within {timeout:.3g}s: "
            "not every one has been put yet, or every copy is busy")


class DirectCalls:
    """The direct path of one runtime: a few open links, lent to calling threads."""

    def __init__(self, node: Node, loop: asyncio.AbstractEventLoop, token: str) -> None:
        scheme, _, _ = split_address(node.directory_address)
        # A plain socket speaks only the TCP transport.
        self.enabled = node.config.direct_calls and scheme == "tcp"
        self._node, self._loop, self._token = node, loop, token
        self._forks = _forks  # a forked child has the links but not the loop: not usable
        self._threshold = node.config.inline_threshold
        self._connect_timeout = node.config.connect_timeout_s
        self._idle: list[DirectLink] = []
        #: links lent to calling threads now (woken by `close`)
        self._busy: set[DirectLink] = set()
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self._closed = False
        #: ids put here whose bytes are on their way to the loop's store (`_keep`)
        self._keeping: dict[ObjectID, int] = {}
        #: calls answered here, not by the loop (node_stats "direct_puts"/"direct_gets")
        self.puts = self.gets = 0

    def _usable(self) -> bool:
        return self.enabled and not self._closed and self._forks == _forks

    def _count(self, puts: int = 0, gets: int = 0) -> None:
        with self._lock:
            self.puts += puts
            self.gets += gets

    # ------------------------------------------------------------- verbs ---
    def put(self, value: Any, oid: ObjectID, timeout: float) -> bool:
        """Register a small host `value` as `oid` from this thread; False when
        the loop's path must do it (nothing registered then, nothing lost)."""
        put = self._put_msg(value, oid)
        if put is None:
            return False
        since = self._node.forgotten.count  # (read here, on the caller's thread)
        try:
            reply = self._ask([put[0]], timeout,
                              lambda: f"the directory did not answer 'put' within {timeout:g}s")
        except Timeout:
            raise  # (withdrawn on its link: `DirectLink.requests`)
        except BaseException:  # interrupted (Ctrl-C) mid-request: the link is gone
            # Sent, so perhaps registered, with nothing kept here: withdrawn,
            # as the loop's put given up is (the caller was told it failed).
            self._on_loop(self._node.withdraw, oid)
            raise
        if reply is MISS:
            return False  # re-putting the same bytes is harmless if this one got through
        raise_for_error(reply[0])
        self._keep(put, since)
        self._count(puts=1)
        return True

    def get(self, oid: ObjectID, timeout: float, array_type: str) -> Any:
        """The value of `oid`, asked for by this thread, if it travels inline;
        else MISS, and the loop's get finishes the call: it joins the pull
        the directory has started this node on, or uses the node's copy."""
        if not self._usable() or self._node.store.get(oid) is not None:
            return MISS
        # (get_all's work for one object, with fewer calls: see DirectLink.requests)
        replies = self._ask([_locate(oid)], timeout,
                            lambda: _not_available([oid], timeout))
        if replies is MISS:
            return MISS
        value = self._value(raise_for_error(replies[0]), array_type)
        if value is PULL:
            return MISS
        with self._lock:
            self.gets += 1
        return value

    def get_all(self, oids: list[ObjectID], timeout: float, array_type: str = "cupy") -> Any:
        """The values of `oids`, asked for at once: a list of the values (PULL
        for those the loop must finish), or MISS."""
        if not self._usable():
            return MISS
        replies = self._ask([_locate(oid) for oid in oids], timeout,
                           lambda: _not_available(oids, timeout))
        if replies is MISS:
            return MISS
        values = [self._value(raise_for_error(r), array_type) for r in replies]
        self._count(gets=sum(v is not PULL for v in values))
        return values

    def reduce(self, request: m.Reduce, value: Any, mine: ObjectID, then: str | None,
               timeout: float) -> Any:
        """A collective's reduce of small host inputs, from this thread: the
        `request` (a node's "reduce" message), the put of our input `value` as
        `mine`, and with `then` "get" the result (or PULL), with "wait" None
        once the reduce is done; all in one write. MISS: the
        loop's path does the call (asking again what was asked here is
        harmless: a reduce and a put of the same bytes may be repeated)."""
        put = self._put_msg(value, mine)
        if put is None:
            return MISS
        target = ObjectID(request.target)
        since = self._node.forgotten.count  # (read here, on the caller's thread)
        msgs = [request, put[0]]
        if then == "get":
            msgs.append(_locate(target))
        elif then == "wait":
            msgs.append(m.ReducedInputs(rid=0, target=request.target))
        try:
            replies = self._ask(msgs, timeout, lambda: f"the reduce producing {target.hex()} "
                                                       f"did not finish within {timeout:g}s")
        except BaseException:  # past its deadline, or interrupted (Ctrl-C)
            # Sent, so perhaps started: a restarted directory must hear of it
            # (as of a reduce the loop's path gave up waiting for).
            self._on_loop(self._node.remember_reduce, target, request, since)
            raise
        if replies is MISS:
            return MISS
        for reply in replies:
            raise_for_error(reply)
        self._keep(put, since)
        result = self._value(replies[2], "cupy") if then == "get" else None
        if result is PULL or then is None:
            # Asked again of a restarted directory until the result is in
            # hand, as the node's own reduces are (a result here inline is).
            # Not once "wait" is answered: the reduce is done, and its
            # result's holder announces it to a restarted directory.
            self._on_loop(self._node.remember_reduce, target, request, since)
        self._count(puts=1, gets=then == "get" and result is not PULL)
        return result

    def _put_msg(self, value: Any, oid: ObjectID) -> tuple[m.Put, ObjectID, Layout, bytes] | None:
        """The put message of a small host value not held here yet, else None."""
        from . import device

        if not self._usable() or device.is_device_array(value):
            return None
        try:
            nbytes = len(value) if isinstance(value, bytes | bytearray) else getattr(value, "nbytes", 0)
        except ValueError:  # (a released memoryview: `to_buffer` says what is wrong)
            nbytes = 0
        if isinstance(nbytes, int) and nbytes > self._threshold:
            return None  # large: not even flattened here
        buf, layout = to_buffer(value)
        if layout.nbytes > self._threshold or self.held(oid):
            return None  # large, or here already (the loop's path checks its layout)
        data = bytes(buf)
        msg = m.Put(rid=0, oid=oid.binary, size=layout.nbytes, layout=layout.to_wire(),
                    inline=data, print_=fingerprint(data))
        return msg, oid, layout, data

    def held(self, oid: ObjectID) -> bool:
        """Whether this node holds `oid`, or a put of it from a thread here is
        on its way into the store (the loop may not have run since)."""
        return self._node.store.get(oid) is not None or oid in self._keeping

    def _keep(self, put: tuple[m.Put, ObjectID, Layout, bytes], since: int) -> None:
        # The node holds what it put (for its reconnects and local gets): hand
        # the bytes to the loop, which keeps them before any later call of ours.
        _, oid, layout, data = put
        with self._lock:
            self._keeping[oid] = self._keeping.get(oid, 0) + 1
        self._on_loop(self._kept, oid, layout, data, since)

    def _kept(self, oid: ObjectID, layout: Layout, data: bytes, since: int) -> None:
        try:
            self._node.keep_inline(oid, layout, data, since)
        finally:
            with self._lock:
                left = self._keeping.pop(oid, 1) - 1
                if left:
                    self._keeping[oid] = left

    def _on_loop(self, fn: Any, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed meanwhile: the node is gone with it
            pass

    @staticmethod
    def _value(body: m.Body, array_type: str) -> Any:
        """An inline host object's value; else PULL: the node pulls it (it
        was told where from, `pushed`), holds or pulls it already (`held`),
        or it is a device object, made on the device by the loop, in its
        stream order."""
        if not isinstance(body, m.Location) or body.inline is None:
            return PULL
        layout = Layout.from_wire(body.layout)
        return PULL if layout.kind == "device" else from_buffer(body.inline, layout, array_type)

    # ------------------------------------------------------------- links ---
    def _ask(self, msgs: list[m.Request], timeout: float, expired: Callable[[], str]) -> Any:
        """The replies to `msgs`, sent together; Timeout(`expired()`) when they do
        not all come within `timeout` (the rest are withdrawn); MISS when no
        link could carry them (the caller then takes the loop's path)."""
        deadline = time.monotonic() + timeout
        link = self._take(deadline)
        if link is None:
            if time.monotonic() >= deadline:
                # A new link's handshake with a stalled directory took the
                # whole call: its own Timeout, not the loop's with 1 ms left.
                raise Timeout(expired())
            return MISS
        try:
            replies = link.requests(msgs, deadline)
        except _Expired:
            self._give(link)
            raise Timeout(expired()) from None
        except HopliteError as exc:
            log.info("direct %s to the directory failed (%s): the loop's path takes it",
                     "/".join(m.op(msg) for msg in msgs), exc)
            self._drop(link)
            return MISS
        except BaseException:  # e.g. KeyboardInterrupt mid-request: the link's state is unknown
            self._drop(link)
            raise
        self._give(link)
        return replies

    def _take(self, deadline: float) -> DirectLink | None:
        with self._lock:
            # Every link idle too long goes, not only one taken: after a burst
            # of calls one at a time would reuse the newest link for ever
            # and keep the others open on the directory.
            now = time.monotonic()
            stale = [old for old in self._idle if now - old.last_used > _IDLE_S]
            self._idle = [kept for kept in self._idle if now - kept.last_used <= _IDLE_S]
            link = self._idle.pop() if self._idle else None
            if link is not None:
                self._busy.add(link)
            retry = self._closed or time.monotonic() < self._retry_at
        for old in stale:
            old.close()
        if link is not None or retry:
            return link
        try:  # (within the call's deadline, which then covers the request too)
            # (the directory in use now: the node may have moved to a standby)
            _, host, port = split_address(self._node.directory_address)
            link = DirectLink(host, port, self._token, self._node.node_id,
                              max(0.001, min(self._connect_timeout, deadline - time.monotonic())),
                              self._node.tls)
        except HopliteError as exc:  # e.g. a restarted directory that has not met our node yet
            log.info("no direct connection to the directory (%s): calls take the loop's path "
                     "for %gs", exc, _BACKOFF_S)
            with self._lock:
                self._retry_at = time.monotonic() + _BACKOFF_S
            return None
        with self._lock:
            if not self._closed:
                self._busy.add(link)
                return link
        link.close()  # shut down meanwhile
        return None

    def _give(self, link: DirectLink) -> None:
        link.last_used = time.monotonic()
        with self._lock:
            self._busy.discard(link)
            if not self._closed and len(self._idle) < _KEEP:
                self._idle.append(link)
                return
        link.close()

    def _drop(self, link: DirectLink) -> None:
        with self._lock:
            self._busy.discard(link)
        link.close()

    def descriptors(self) -> list[int]:
        """The links' socket descriptors (for a forked child to let go of)."""
        return [link.fileno() for link in [*self._idle, *self._busy]]

    def close(self) -> None:
        """Close every link; a thread waiting on one is woken and its call
        ends with the runtime's RuntimeClosed (through the loop's path)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = list(self._busy)
        for link in idle:
            link.close()
        for link in busy:
            link.interrupt()
