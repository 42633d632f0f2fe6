"""A node's connection to the directory: requests with ids, one-way notices,
and pushed commands (drop)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hoplite_gpu import messages as m
from hoplite_gpu.auth import client_handshake
from hoplite_gpu.errors import (
    DirectoryUnavailable,
    HopliteError,
    ProtocolError,
    Timeout,
    TransportError,
)
from hoplite_gpu.protocol import Outbox, read_messages, recv_msg, send_msg
from hoplite_gpu.timers import Expired, until
from hoplite_gpu.transports import Stream, get_backend, split_address

from .wire import raise_for_error

if TYPE_CHECKING:
    from hoplite_gpu.transports.tls import TLS

log = logging.getLogger("hoplite_gpu.client")


class DirectoryClient:
    def __init__(self, stream: Stream, on_push: Callable[[m.Message], None], *,
                 stall_s: float | None = None) -> None:
        self._stream = stream
        self._on_push = on_push
        self._ids = itertools.count(1)
        #: rid -> (the future of its reply, the kind of request it answers)
        self._pending: dict[int, tuple[asyncio.Future, type]] = {}
        self._lost: BaseException | None = None
        self._closing = False
        self._outbox = Outbox(stream, self._fail, stall_s=stall_s)
        #: the directory's node lease, if it said (register's answer)
        self.lease_s: float | None = None
        #: the other nodes registered there when we did (register's answer)
        self.peers = 0
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def connect(cls, address: str, *, token: str, node: str, data_address: str,
                      timeout: float, on_push: Callable[[m.Message], None],
                      stall_s: float | None = None, tls: TLS | None = None,
                      rails: Sequence[str] = (), rack: str | None = None) -> DirectoryClient:
        """Connect (in TLS, given `tls`), authenticate and register within
        `timeout` seconds in all, with every data address the node listens
        on where it has several (`rails`, `data_address` first), and its
        `rack`. A directory that then takes no message for `stall_s`
        seconds is lost."""
        scheme, _, _ = split_address(address)
        deadline = time.monotonic() + timeout  # one deadline for the whole: connect, handshake, register
        try:
            stream = await get_backend(scheme, tls).connect(address, timeout)
        except (TransportError, Timeout) as exc:
            # Refused or silent alike: UCX sometimes lets a connect to a closed
            # port run to its timeout instead of refusing it.
            raise DirectoryUnavailable(
                f"cannot reach the directory at {address}: {exc}. "
                "Is `hoplite-gpu directory` running there?") from exc
        try:
            left = max(deadline - time.monotonic(), 0.0)
            async with asyncio.timeout(left):
                await client_handshake(stream, token, left)
                await send_msg(stream, m.Register(node=node, address=data_address,
                                                  addresses=list(rails) if len(rails) > 1 else [],
                                                  rack=rack or ""))
                answer = raise_for_error(m.read_reply(m.Register, await recv_msg(stream)))
        except (TimeoutError, Timeout) as exc:
            await stream.close()
            raise Timeout(
                f"the directory at {address} did not accept us within {timeout:g}s (if it "
                "serves another transport, use its full address, e.g. ucx://host:port, or "
                "the same HOPLITE_CONTROL_TRANSPORT"
                f"{'' if tls else '; if it runs TLS, set HOPLITE_TLS_* here too'})") from exc
        except BaseException:
            await stream.close()
            raise
        client = cls(stream, on_push, stall_s=stall_s)
        client.peers = answer.nodes
        if answer.lease_s > 0:
            client.lease_s = float(answer.lease_s)
        return client

    async def request(self, msg: m.Message, timeout: float) -> m.Body:
        """Send a request and wait for its reply (the body `messages.REPLIES`
        names for it); errors in the reply are raised."""
        rid = next(self._ids)
        fut = self.start(msg, rid)
        try:
            body = await until(fut, time.monotonic() + timeout)
        except Expired:
            self.post(m.Cancel(request=rid))  # (one that waits would wait on)
            raise Timeout(f"the directory did not answer {m.op(msg)!r} within {timeout:g}s") from None
        except asyncio.CancelledError:
            self.post(m.Cancel(request=rid))
            raise
        finally:
            self._pending.pop(rid, None)
        return raise_for_error(body)

    def start(self, msg: m.Message, rid: int | None = None) -> asyncio.Future:
        """Send a request now; return the future of its reply body (a
        `Failure` not raised yet)."""
        if self._lost is not None:
            raise DirectoryUnavailable(f"lost the directory connection: {self._lost}")
        rid = next(self._ids) if rid is None else rid
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = (fut, type(msg))
        self._outbox.post(m.with_rid(msg, rid))
        return fut

    def forget(self, rid: int) -> None:
        """Stop waiting for the reply to request `rid` (its caller gave up)."""
        fut, _ = self._pending.pop(rid, (None, None))
        if fut is not None and not fut.done():
            fut.cancel()

    def next_id(self) -> int:
        return next(self._ids)

    def post(self, msg: m.Message) -> None:
        """Send a one-way notice; dropped silently once the directory is gone."""
        if self._lost is None:
            self._outbox.post(msg)

    async def _read_loop(self) -> None:
        try:
            await read_messages(self._stream, self._received)
        except HopliteError as exc:
            self._fail(exc)

    def _received(self, msg: dict[str, Any]) -> None:
        rid = msg.get("rid")
        if rid is not None:
            fut, kind = self._pending.pop(rid, (None, None))
            if fut is None or fut.done():
                return
            try:
                fut.set_result(m.read_reply(kind, msg))
            except ProtocolError as exc:  # (that request fails; the connection serves on)
                fut.set_exception(exc)
        else:
            try:
                self._on_push(m.read_push(msg))
            except Exception:  # one bad push must not cost the node its directory
                log.warning("ignored a push the node could not take: %.200r", msg,
                            exc_info=True)

    def _fail(self, exc: BaseException) -> None:
        if self._lost is None:
            self._lost = exc
            if not self._closing:
                log.warning("lost the directory connection: %s", exc)
        err = DirectoryUnavailable(f"lost the directory connection: {exc}")
        for fut, _ in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        with contextlib.suppress(Exception):
            self._on_push(m.DirectoryLost(reason=str(exc)))

    async def close(self) -> None:
        self._closing = True
        self._outbox.finish()
        await self._outbox.drain(1.0)
        await self._stream.close()
        await self._outbox.close()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        if self._lost is None:
            self._lost = DirectoryUnavailable("the client was closed")
