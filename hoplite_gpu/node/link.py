"""A node's link to the directory: the client, the heartbeat that renews the
node's lease, reconnection after the directory is lost (to it again, or to
a standby directory), and the pushes the directory sends, handed to
whichever part of the node registered for them."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from hoplite_gpu import messages as m
from hoplite_gpu.config import Config, rack_label
from hoplite_gpu.directory.client import DirectoryClient
from hoplite_gpu.directory.wire import raise_for_error
from hoplite_gpu.errors import DirectoryUnavailable, HopliteError, PeerLost, Timeout
from hoplite_gpu.timers import Expired, until
from hoplite_gpu.transports import split_address
from hoplite_gpu.transports.tls import TLS

from .tasks import TaskSet

log = logging.getLogger("hoplite_gpu.node")


class DirectoryLink:
    """`address` names one directory, or several comma-separated: standbys,
    each just another `hoplite-gpu directory` with the same token. The link
    uses one at a time (`address`); when it is gone, reconnection tries it
    and the others in turn. `announce(client)` tells a new directory (or the
    one restarted) what this node holds (the directory keeps only soft
    state); `gone(error)` runs when none came back before the
    reconnection's deadline."""

    def __init__(self, address: str, token: str, node_id: str, config: Config, *,
                 announce: Callable[[DirectoryClient], None],
                 gone: Callable[[BaseException], None], tls: TLS | None = None) -> None:
        #: every directory this link may use, in the order they are tried
        self.addresses = address.split(",")
        #: the one in use (or tried last)
        self.address = self.addresses[0]
        #: (address, wall time) of each registration with a directory: the
        #: first, then one per reconnection (the latest last)
        self.registrations: deque[tuple[str, float]] = deque(maxlen=64)
        self.token, self.node_id, self.config = token, node_id, config
        self.tls = tls
        self._announce, self._gone = announce, gone
        self.client: DirectoryClient | None = None
        #: set while a client is connected (cleared from a loss to the reconnection)
        self.connected = asyncio.Event()
        #: the task renewing this node's lease (`start_heartbeat`)
        self.heartbeat: asyncio.Task | None = None
        self._reconnector: asyncio.Task | None = None
        self._handlers: dict[type, Callable[[m.Message], None]] = {}
        self._data_address = ""
        self._rails: tuple[str, ...] = ()
        self._rack: str | None = None
        self._tasks = TaskSet()
        self._closed: BaseException | None = None

    def handle(self, kind: type[m.Message], handler: Callable[[m.Message], None]) -> None:
        """Hand the directory's pushes of `kind` to `handler`."""
        self._handlers[kind] = handler

    async def connect(self, data_address: str, rails: Sequence[str] = ()) -> None:
        """Register this node (its data server at `data_address`, and at each
        of `rails` where it listens on several) with the first directory that
        answers (`_join`), and start beating."""
        self._data_address = data_address
        self._rails = tuple(rails)
        #: the rack this node registers (`config.rack_label`)
        self._rack = rack_label(self.config.rack, split_address(data_address)[1])
        self.client = await self._join(0, fail=True)
        self.registrations.append((self.address, time.time()))
        self.connected.set()
        self.start_heartbeat()

    async def _join(self, first: int, *, fail: bool) -> DirectoryClient | None:
        """A client of the first directory that answers, trying `addresses`
        from index `first` round: or, if that one has no other node and a
        later one has some, of that one (nodes that moved to a standby while
        the first was away stay there; a node joining then must find them,
        not the first restarted empty). None if none answers, unless `fail`
        (then the last one's error)."""
        count = len(self.addresses)
        chosen: DirectoryClient | None = None
        for i in range(count):
            address = self.addresses[(first + i) % count]
            try:
                client = await self._connect(address)
            except HopliteError as exc:
                log.info("the directory at %s did not take us: %s", address, exc)
                if fail and chosen is None and i == count - 1:
                    raise
                continue
            if chosen is None:
                chosen, self.address = client, address
                if client.peers > 0:
                    break
            elif client.peers > 0:  # (the empty one held nothing of ours: leaving it costs nothing)
                log.warning("the directory at %s has no other node; joining the one at %s, "
                            "which has %d", self.address, address, client.peers)
                await chosen.close()
                chosen, self.address = client, address
                break
            else:
                await client.close()
        return chosen

    def _connect(self, address: str):  # (a coroutine: the client once connected)
        return DirectoryClient.connect(
            address, token=self.token, node=self.node_id,
            data_address=self._data_address, rails=self._rails, rack=self._rack,
            timeout=self.config.connect_timeout_s, on_push=self.on_push,
            stall_s=self.config.stall_timeout_s, tls=self.tls)

    def start_heartbeat(self) -> None:
        """Renew this node's lease from now on (again, after the heartbeat was stopped)."""
        self.heartbeat = self._tasks.spawn(self.beat())

    async def beat(self) -> None:
        """Renew this node's lease; a node that stops beating is declared dead.
        Beats come at least three times per lease of the directory's (its
        settings count, not this process's)."""
        while True:
            lease = self.client.lease_s if self.client is not None else None
            interval = self.config.heartbeat_interval_s
            await asyncio.sleep(interval if lease is None else min(interval, lease / 3))
            self.post(m.Ping())

    def stop(self, reason: BaseException) -> list[asyncio.Task]:
        """Refuse further requests with `reason` and stop the heartbeat and
        any reconnection: the cancelled tasks, for the node to await."""
        self._closed = reason
        return self._tasks.cancel()

    async def close(self) -> None:
        """Close the client (after `stop`)."""
        if self.client is not None:
            await self.client.close()

    def _check_open(self) -> None:
        if self._closed is not None:
            raise self._closed

    # ----------------------------------------------------------- requests ---
    def post(self, msg: m.Message) -> None:
        """A one-way notice to the directory (lost if it is away; holdings are
        re-announced when we reconnect)."""
        if self.client is not None:
            self.client.post(msg)

    def ask(self, msg: m.Request) -> asyncio.Future:
        """Start a request to the directory, its answer a future (no wait, no
        asking again: DirectoryUnavailable while it is away)."""
        assert self.client is not None
        return self.client.start(msg)

    async def request(self, msg: m.Request | m.Nodes, timeout: float) -> m.Body:
        """A request to the directory; if the directory goes away, wait for the
        reconnection and ask again, all within `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            self._check_open()
            try:
                assert self.client is not None
                return await self.client.request(msg, max(0.001, deadline - time.monotonic()))
            except DirectoryUnavailable:
                await self._wait_connected(deadline)

    async def wait_reply(self, msg: m.Request, deadline: float) -> m.Body:
        """A request the directory may answer much later (it waits for something to
        exist). At the deadline the request is withdrawn and Timeout(seconds) raised;
        if the directory goes away meanwhile, the request is asked again of the new one."""
        started = time.monotonic()
        while True:
            self._check_open()
            client = self.client
            assert client is not None
            rid = client.next_id()
            try:
                return raise_for_error(await until(client.start(msg, rid), deadline))
            except DirectoryUnavailable:
                await self._wait_connected(deadline)  # then ask the new directory
            except Expired:
                client.forget(rid)
                client.post(m.Cancel(request=rid))
                raise Timeout(max(0.0, deadline - started)) from None
            except asyncio.CancelledError:  # withdraw the request, or it waits on
                client.forget(rid)
                client.post(m.Cancel(request=rid))
                raise

    async def _wait_connected(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DirectoryUnavailable("the directory is unreachable and the deadline passed")
        try:
            async with asyncio.timeout(remaining):
                await self.connected.wait()
        except TimeoutError:
            raise DirectoryUnavailable(
                f"the directory at {self.address} stayed unreachable until the "
                "deadline") from None
        self._check_open()

    # ------------------------------------------------------------- pushes ---
    def on_push(self, msg: m.Message) -> None:
        handler = self._handlers.get(type(msg))
        if handler is not None:
            handler(msg)
        elif isinstance(msg, m.DirectoryLost):
            self._lost(msg.reason)
        else:
            log.warning("ignoring push %r: nothing here takes it", m.op(msg))

    # ------------------------------------------------------- reconnection ---
    def _lost(self, reason: str) -> None:
        if self._closed is not None or not self.connected.is_set():
            return
        self.connected.clear()
        log.warning("lost the directory (%s); reconnecting", reason)
        self._reconnector = self._tasks.spawn(self._reconnect())

    async def _reconnect(self) -> None:
        """Reconnect with backoff, to the directory in use or, failing that,
        the next of `addresses` in turn (`_join`); then tell the new
        directory what we hold: the directory keeps only soft state, so
        nodes rebuild it."""
        deadline = time.monotonic() + self.config.timeout_s
        delay = 0.05
        old = self.client
        at = self.addresses.index(self.address) if self.address in self.addresses else 0
        while self._closed is None and time.monotonic() < deadline:
            client = await self._join(at, fail=False)
            if client is None:  # (a whole round failed: back off)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            self.client = client
            if old is not None:
                await old.close()
            self._announce(client)
            self.registrations.append((self.address, time.time()))
            self.connected.set()
            log.warning("reconnected to the directory at %s", self.address)
            return
        self._gone(PeerLost(f"the directory at {', '.join(self.addresses)} stayed unreachable"))
