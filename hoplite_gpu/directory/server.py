"""The asyncio directory service: a thin driver around the pure `state.Directory`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from hoplite_gpu import messages as m
from hoplite_gpu.auth import server_handshake
from hoplite_gpu.errors import HopliteError, InvalidArgument, ProtocolError, Timeout
from hoplite_gpu.protocol import SMALL_MESSAGE, Outbox, read_messages, recv_msg, send_msg
from hoplite_gpu.transports import Stream, get_backend, split_address

from . import state
from .wire import to_event

if TYPE_CHECKING:
    from hoplite_gpu.transports.tls import TLS

log = logging.getLogger("hoplite_gpu.directory")


class _Peer:
    """One registered node: its stream and outbox, so the state machine never
    waits on a slow node."""

    def __init__(self, node: str, stream: Stream, stall_s: float) -> None:
        self.node = node
        self.stream = stream
        # A node that takes no message for a lease is as good as lost.
        self.outbox = Outbox(stream, self._lost, stall_s=stall_s)
        #: the node's direct connections (docs/protocol.md, "Direct calls")
        self.directs: set[_Direct] = set()

    def _lost(self, exc: HopliteError) -> None:
        log.warning("cannot write to node %s: %s", self.node, exc)

    async def disconnect(self) -> None:
        """A lease expired: send what is queued (briefly), then close, which
        ends the read loop too."""
        self.outbox.finish()
        await self.outbox.drain(1.0)
        await self.stream.close()


class _Direct:
    """A connection on which one thread of a registered node makes its own
    blocking requests. Its requests are the node's, under request ids of the
    directory's own choosing (negative, so they never meet the node's), and
    their replies come back here."""

    def __init__(self, peer: _Peer, stream: Stream, stall_s: float) -> None:
        self.peer = peer
        self.stream = stream
        self.outbox = Outbox(stream, self._lost, stall_s=stall_s)
        #: the thread's request id -> the id the state machine knows it by
        self.requests: dict[int, int] = {}

    def _lost(self, exc: HopliteError) -> None:
        log.info("cannot write to a direct connection of node %s: %s", self.peer.node, exc)


#: What a direct connection may ask: a caller's own puts and gets of small
#: objects, and the reduces of collectives of them.
_DIRECT_OPS = (m.Locate, m.Put, m.Reduce, m.ReducedInputs)


def _inline_reduce(cmd: state.InlineReduce) -> state.Event:
    """Small objects are reduced here, in the directory, without a data connection."""
    from hoplite_gpu import kernels
    from hoplite_gpu.values import Layout, numpy_dtype

    try:
        dtype = numpy_dtype(Layout.from_wire(cmd.layout))
        acc = np.frombuffer(bytearray(cmd.inputs[0]), dtype=dtype).copy()
        for data in cmd.inputs[1:]:
            kernels.reduce_into(acc, np.frombuffer(data, dtype=dtype), cmd.op)
        kernels.finalize(acc, cmd.op, len(cmd.inputs))
    except Exception as exc:  # whatever went wrong, every waiter must hear of it
        return state.ReduceFailed("", cmd.target, f"{type(exc).__name__}: {exc}")
    return state.InlineReduced(cmd.target, acc.tobytes())


#: The most file descriptors a directory asks for (`_raise_fd_limit`).
FD_WANTED = 1 << 16


def _raise_fd_limit() -> None:
    """Every node keeps a connection to the directory, and each thread of it
    that makes direct calls one more: a directory under the usual soft limit
    of 1,024 descriptors would refuse nodes from about a hundred busy ones.
    Raise the soft limit to the hard one (at most `FD_WANTED`), as servers do."""
    try:
        import resource
    except ImportError:  # (not POSIX)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FD_WANTED if hard == resource.RLIM_INFINITY else min(hard, FD_WANTED)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:
            log.debug("could not raise the descriptor limit from %d to %d: %s", soft, want, exc)


class DirectoryServer:
    """Serve the directory on ``transport://host:port``; `address` is set by `start`."""

    def __init__(self, token: str, *, host: str = "127.0.0.1", port: int = 0,
                 transport: str = "tcp", handshake_timeout: float = 10.0,
                 max_receivers_per_sender: int = 1, latency_s: float = 1e-4,
                 bytes_per_s: float = 1.25e9, chunk_size: int = 4 << 20,
                 lease_s: float = 5.0, heartbeat_interval_s: float = 1.0,
                 max_sources: int = 1, multi_source_bytes: int = 16 << 20,
                 stripes: int = 1, relay_bytes: int = 0,
                 tls: TLS | None = None) -> None:
        self.token = token
        self.host, self.port, self.transport = host, port, transport
        #: every connection in TLS (`hoplite_gpu.tls.load`), or none; its
        #: handshake within `handshake_timeout` too
        self.tls = None if tls is None else dataclasses.replace(tls, handshake_s=handshake_timeout)
        self.handshake_timeout = handshake_timeout
        self.state = state.Directory(max_receivers_per_sender=max_receivers_per_sender,
                                     latency_s=latency_s, bytes_per_s=bytes_per_s,
                                     chunk_size=chunk_size, lease_s=lease_s,
                                     instance=os.urandom(8), tick_s=heartbeat_interval_s / 2,
                                     max_sources=max_sources,
                                     multi_source_bytes=multi_source_bytes,
                                     stripes=stripes, relay_bytes=relay_bytes)
        self.heartbeat_interval_s = heartbeat_interval_s
        self._ticker: asyncio.Task | None = None
        self.peers: dict[str, _Peer] = {}
        #: request ids of direct connections' requests (all negative) -> whose
        self._direct_requests: dict[int, tuple[_Direct, int]] = {}
        self._direct_ids = itertools.count(1)
        self._closers: set[asyncio.Task] = set()
        self.address = ""
        self._listener = None

    async def start(self) -> str:
        _raise_fd_limit()
        backend = get_backend(self.transport, self.tls)
        self._listener = await backend.listen(self.host, self.port, self._serve)
        self.address = self._listener.address
        self._ticker = asyncio.get_running_loop().create_task(self._tick_loop())
        log.info("directory listening on %s", self.address)
        return self.address

    async def _tick_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.heartbeat_interval_s / 2)
            self.apply(state.Tick(loop.time()))

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
            self._ticker = None
        if self._listener is not None:
            await self._listener.close()
            self._listener = None

    def apply(self, event: state.Event) -> None:
        # An inline reduce's result is applied at once, before the commands
        # after it, depth first; without recursion, as a chain of reduces each
        # reading the one before finishes in one go when its first input comes.
        pending = [iter(self.state.handle(event))]
        while pending:
            cmd = next(pending[-1], None)
            if cmd is None:
                pending.pop()
            elif isinstance(cmd, state.InlineReduce):
                pending.append(iter(self.state.handle(_inline_reduce(cmd))))
            else:
                self._carry_out(cmd)

    def _carry_out(self, cmd: state.Command) -> None:
        peer = self.peers.get(cmd.node)
        if peer is None:
            return  # the node left; the state machine has forgotten it too
        if isinstance(cmd, state.Disconnect):
            log.warning("node %s declared dead: %s", cmd.node, cmd.reason)
            task = asyncio.get_running_loop().create_task(peer.disconnect())
            self._closers.add(task)
            task.add_done_callback(self._closers.discard)
            return
        if isinstance(cmd, state.Reply):
            if cmd.request < 0:
                self._reply_direct(cmd)
            else:
                peer.outbox.post(m.answering(cmd.body, cmd.request))
        elif isinstance(cmd, state.StartReduceStep):
            peer.outbox.post(cmd.step)
        elif isinstance(cmd, state.PushLocated | state.PushRestripe):
            peer.outbox.post(cmd.body)
        else:
            peer.outbox.post(m.Drop(oid=cmd.oid, reason=cmd.reason, retry=cmd.retry,
                                    kind=None if cmd.kind == "ObjectNotFound" else cmd.kind,
                                    lost=cmd.lost))

    async def _serve(self, stream: Stream) -> None:
        authenticated = False
        try:
            await server_handshake(stream, self.token, self.handshake_timeout)
            authenticated = True
            try:
                async with asyncio.timeout(self.handshake_timeout):
                    hello = await recv_msg(stream, SMALL_MESSAGE, m.decode_hello)
            except TimeoutError:
                raise Timeout(f"{stream.peer} sent no 'register' within "
                              f"{self.handshake_timeout:g}s of its handshake") from None
            if isinstance(hello, m.Attach):
                await self._serve_direct(stream, hello.node)
                return
            if not isinstance(hello, m.Register):
                raise ProtocolError(f"expected 'register' or 'attach' from {stream.peer}, got "
                                    f"{hello.op!r}: {hello.message}")
            node, address = hello.node, hello.address
            rails = tuple(hello.addresses)
            if rails and rails[0] != address:
                raise ProtocolError(f"a register's addresses begin with its address {address!r}; "
                                    f"got {list(rails)!r}")
            try:
                for one in rails or (address,):
                    split_address(one)  # (other nodes will dial it)
            except InvalidArgument as exc:
                raise ProtocolError(f"bad data address: {exc}") from None
        except HopliteError as exc:
            log.warning("refused connection from %s: %s", stream.peer, exc)
            if authenticated:
                # Say why (a handshake that failed has said so already), or the
                # peer sees only that the connection closed.
                with contextlib.suppress(HopliteError, OSError, TimeoutError):
                    async with asyncio.timeout(1.0):
                        await send_msg(stream, m.Failure(error=type(exc).__name__,
                                                         message=str(exc)))
            return
        if node in self.peers:
            await send_msg(stream, m.Failure(error="ProtocolError",
                                             message=f"node id {node} is already registered"))
            return
        peer = self.peers[node] = _Peer(node, stream, self.state.lease_s)
        # (our lease, which the node beats well within, whatever its own settings)
        peer.outbox.post(m.Registered(ok=True, node=node, lease_s=self.state.lease_s,
                                      nodes=len(self.peers) - 1))
        self.apply(state.NodeJoined(node, address, asyncio.get_running_loop().time(), rails,
                                    hello.rack or None))
        try:
            await self._read_loop(peer)
        except HopliteError as exc:
            log.info("node %s disconnected: %s", node, exc)
        finally:
            del self.peers[node]
            if node in self.state.nodes:
                self.apply(state.NodeLost(node))
            for direct in list(peer.directs):  # their node is gone: so are they
                await direct.stream.close()
            await peer.outbox.close()

    async def _serve_direct(self, stream: Stream, node: str) -> None:
        peer = self.peers.get(node)
        if peer is None or node not in self.state.nodes:  # (or its lease just ended)
            await send_msg(stream, m.Failure(error="ProtocolError",
                                             message=f"node id {node} is not registered here"))
            return
        direct = _Direct(peer, stream, self.state.lease_s)
        peer.directs.add(direct)
        direct.outbox.post(m.Attached(ok=True, node=node))
        try:
            await read_messages(stream, functools.partial(self._received_direct, direct),
                                decoder=m.decode_to_directory)
        except HopliteError as exc:
            log.debug("a direct connection of node %s ended: %s", node, exc)
        finally:
            peer.directs.discard(direct)
            for rid in list(direct.requests.values()):  # withdraw what it still waits for
                self._direct_requests.pop(rid, None)
                if node in self.state.nodes:
                    self.apply(state.CancelLocate(node, rid))
            direct.requests.clear()
            await direct.outbox.close()

    def _received_direct(self, direct: _Direct, msg: m.Message | m.Invalid) -> None:
        node = direct.peer.node
        if node not in self.state.nodes or self.peers.get(node) is not direct.peer:
            return  # its node is gone (this connection is being closed): nothing is its
        if isinstance(msg, m.Invalid):
            direct.outbox.post(_refusal(msg.rid, msg.message))
            return
        if isinstance(msg, m.Cancel):
            rid = direct.requests.pop(msg.request, None)
            if rid is not None:
                self._direct_requests.pop(rid, None)
                self.apply(state.CancelLocate(direct.peer.node, rid))
            return
        if isinstance(msg, m.Dropped):  # a put given up, withdrawn behind it (`DirectLink.requests`)
            self.apply(to_event(direct.peer.node, msg))
            return
        theirs = msg.rid if isinstance(msg, m.Request) else 0
        if (not isinstance(msg, _DIRECT_OPS) or theirs in direct.requests
                or (isinstance(msg, m.Put) and msg.inline is None)):
            direct.outbox.post(_refusal(
                theirs, f"a direct connection cannot ask {m.op(msg)!r} so (it "
                        f"may ask {', '.join(m.op(t) for t in _DIRECT_OPS)}, "
                        "cancel, puts with their bytes inline, one request id at a time)"))
            return
        rid = -next(self._direct_ids)
        if isinstance(msg, m.Locate):
            msg = msgspec.structs.replace(msg, rid=rid, direct=True)
        else:
            msg = msgspec.structs.replace(msg, rid=rid)
        event = to_event(direct.peer.node, msg)
        direct.requests[theirs] = rid
        self._direct_requests[rid] = (direct, theirs)
        self.apply(event)

    def _reply_direct(self, cmd: state.Reply) -> None:
        found = self._direct_requests.pop(cmd.request, None)
        if found is None:
            return  # its connection ended meanwhile
        direct, theirs = found
        direct.requests.pop(theirs, None)
        direct.outbox.post(m.answering(cmd.body, theirs))

    async def _read_loop(self, peer: _Peer) -> None:
        await read_messages(peer.stream, functools.partial(self._received, peer),
                            decoder=m.decode_to_directory)

    def _received(self, peer: _Peer, msg: m.Message | m.Invalid) -> None:
        if isinstance(msg, m.Invalid):
            peer.outbox.post(_refusal(msg.rid, msg.message))
            return
        rid = msg.rid if isinstance(msg, m.Request | m.Ping | m.Nodes) else None
        if isinstance(rid, int) and rid < 0 or isinstance(msg, m.Locate) and msg.direct:
            # (negative request ids and direct locates are the direct connections' own)
            peer.outbox.post(_refusal(0, "a node's request ids are positive, and only a direct "
                                         "connection's locates are direct"))
            return
        if isinstance(msg, m.Ping):
            self.apply(state.Heartbeat(peer.node, asyncio.get_running_loop().time()))
            if msg.rid is not None:
                peer.outbox.post(m.Done(rid=msg.rid, ok=True))
            return
        if isinstance(msg, m.Nodes):
            peer.outbox.post(m.NodeList(rid=msg.rid, nodes=dict(self.state.nodes)))
            return
        self.apply(to_event(peer.node, msg))


def _refusal(rid: int, message: str) -> m.Failure:
    return m.Failure(rid=rid, error="ProtocolError", message=message)
