"""A node: the chunk store, the data server and the pull engine of one process,
tied to the directory. Every method runs on the node's event loop."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

import numpy as np

from hoplite_gpu import messages as m
from hoplite_gpu.config import Config
from hoplite_gpu.directory.client import DirectoryClient
from hoplite_gpu.errors import (
    HopliteError,
    InvalidArgument,
    ObjectNotFound,
    ReduceFailed,
    RuntimeClosed,
    Timeout,
)
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.tls import load as load_tls
from hoplite_gpu.transports import split_address
from hoplite_gpu.transports.tls import TLS
from hoplite_gpu.values import Layout, fingerprint, from_buffer, to_buffer

from . import shm
from .forgotten import Forgotten
from .holdings import complete_msg
from .link import DirectoryLink
from .memory import Memory
from .plan import Plan
from .pulls import Pulls
from .puts import Puts
from .retry import Retry as _Retry
from .steps import Steps
from .store import ChunkStore, StoredObject
from .tasks import TaskSet
from .transfer import DataServer, PeerPool

log = logging.getLogger("hoplite_gpu.node")


#: Ids per `delete_many` message (about 90 KB of them).
_DELETE_BATCH = 4096


class Node:
    """One process's node, a facade over its parts: the directory link
    (`link`), the pulls and gets (`pulls`), the puts (`puts`), the reduce
    steps (`steps`) and the store's room (`memory`), each owning its state
    and its tasks. The node builds them, hands each the few calls it needs
    of the others, and keeps what spans them: forgetting an id everywhere
    (`_forget`), deletes, channels and the public calls of the runtime."""

    def __init__(self, config: Config, token: str, directory_address: str, *,
                 tls: TLS | None = None) -> None:
        self.config = config
        self.token = token
        #: TLS for its TCP connections (`hoplite_gpu.tls`): read from `config`
        #: unless its runtime read it already
        self.tls = tls if tls is not None else load_tls(config)
        # A bare "host:port" means the control transport (HOPLITE_CONTROL_TRANSPORT);
        # several, comma-separated: standby directories, dialled in turn when
        # the one in use is gone (`DirectoryLink`).
        address = ",".join(full_address(one, config.control_transport)
                           for one in directory_addresses(directory_address))
        self.node_id = f"{os.uname().nodename}-{os.getpid()}-{os.urandom(3).hex()}"
        if config.shared_memory and not shm.usable():  # (not Linux): every byte over the transport
            config = self.config = config.replace(shared_memory=False)
        self.store = ChunkStore(config.pool_bytes, shared=config.shared_memory)
        #: Nodes with the same (non-empty) value run on one host, in one
        #: network namespace: bytes between them cross no network link.
        self.host_key = shm.domain()
        self.server = DataServer(self.store, token, config, tls=self.tls)
        # (a pull of an id this node dropped is refused at once, unless the
        # node is making it again: see `DataServer.making`)
        self.server.making = self.making
        self.pool = PeerPool(token, config, tls=self.tls)
        self._closed: BaseException | None = None
        #: the newest version of each channel this node published or fetched whole,
        #: re-announced to a restarted directory
        self._channels: dict[str, int] = {}
        #: `_forget`s so far, and when each recent id was: a caller's thread
        #: reads the count before its direct put, so the loop can tell a
        #: drop that overtook the put (`keep_inline`)
        self.forgotten = Forgotten()
        #: serves of objects that left the store, being stopped (`_stop_serving`),
        #: and other work beside a caller (`in_background`)
        self._background = TaskSet()
        self._build_parts(address)

    def _build_parts(self, address: str) -> None:
        """The node's parts, each handed the calls it needs of the others
        (fetched at call time, so that a test may stand in for one on the node)."""
        config, token = self.config, self.token
        #: the directory: requests, notices, heartbeat, reconnection, pushes
        self.link = DirectoryLink(address, token, self.node_id, config, tls=self.tls,
                                  announce=self._announce,
                                  gone=lambda error: self.pulls.cancel_all(error))
        #: puts under way here
        self.puts = Puts(self.store, self.server, config,
                         request=lambda msg, timeout: self._request(msg, timeout),
                         post=lambda msg: self._post(msg),
                         room=lambda layout, what: self.memory.room(layout, what),
                         trim_soon=lambda: self.memory.trim_soon(),
                         let_go=self._let_go, forget=self._forget,
                         stop_serving=self._stop_serving, check_open=self._check_open)
        #: the pulls running here, shared by the gets of each object
        self.pulls = Pulls(self.store, self.pool, config,
                           post=lambda msg: self._post(msg),
                           wait_reply=lambda msg, deadline: self._wait_reply(msg, deadline),
                           room=lambda layout, what: self.memory.room(layout, what),
                           trim_soon=lambda: self.memory.trim_soon(),
                           offered=lambda oid: self.memory.offered(oid),
                           settled=lambda oid: self.steps.settled(oid),
                           let_go=self._let_go,
                           forgets=lambda: self.forgotten.count,
                           forgot_since=self.forgotten.since)
        #: the reduce steps running here, and the reduces this node asked for
        self.steps = Steps(self.store, self.pool, config, self.node_id,
                           post=lambda msg: self._post(msg),
                           request=lambda msg, timeout: self._request(msg, timeout),
                           make_room=lambda need, what: self.memory.make_room(need, what),
                           forgot_since=self.forgotten.since,
                           pull_child=lambda *args: self.pulls.flows.pull_child(*args))
        #: room in the store under `store_bytes` (evictions, trimming)
        self.memory = Memory(self.store, config, self.node_id,
                             lambda msg: self.link.ask(msg), self._step_reads)
        self.link.handle(m.Drop, self._on_drop)
        self.link.handle(m.ReduceStep, self.steps.start)
        self.link.handle(m.Located, self.pulls.located)
        self.link.handle(m.Restripe, self.pulls.restripe)

    def making(self, oid: ObjectID) -> bool:
        """Whether `oid` is being made here (pulled, reduced or put): a pull
        of an id this node dropped is refused at once unless it is
        (`DataServer.making`)."""
        return self.pulls.making(oid) or self.steps.making(oid) or self.puts.making(oid)

    @property
    def client(self) -> DirectoryClient | None:
        """The directory client now connected (a new one after each reconnection)."""
        return self.link.client

    @property
    def directory_address(self) -> str:
        return self.link.address

    @directory_address.setter
    def directory_address(self, address: str) -> None:  # (where a reconnection dials)
        self.link.addresses = address.split(",")
        self.link.address = self.link.addresses[0]

    @property
    def registrations(self) -> deque[tuple[str, float]]:
        """(directory address, wall time) of each registration with a
        directory: the first, then one per reconnection (`DirectoryLink`)."""
        return self.link.registrations

    # (read only, for tests: the link's state)
    @property
    def _connected(self) -> asyncio.Event:
        return self.link.connected

    @property
    def failovers(self) -> deque[tuple[ObjectID, float, float]]:
        """(object, when a pull failed, when bytes flowed again) of recent failovers."""
        return self.pulls.failovers

    # (read only, for tests: the pulls' tables)
    @property
    def _pulls(self) -> Mapping[ObjectID, asyncio.Task]:
        return self.pulls.running

    @property
    def _pull_waiters(self) -> Mapping[ObjectID, list[asyncio.Future]]:
        return self.pulls.waiters

    @property
    def _failed_at(self) -> Mapping[ObjectID, float]:
        return self.pulls.failed_at

    @property
    def _steps(self) -> Mapping[ObjectID, Any]:
        """The reduce steps running here (read only: `Steps.running`)."""
        return self.steps.running

    @property
    def _my_reduces(self) -> Mapping[ObjectID, m.Reduce]:
        """The reduces re-asked of a restarted directory (read only: `Steps.remembered`)."""
        return self.steps.remembered

    @property
    def forgets(self) -> int:
        """`_forget`s so far (safe to read from any thread: `Forgotten.count`)."""
        return self.forgotten.count

    @property
    def evicted(self) -> int:
        """Copies freed so far to make room under `store_bytes`."""
        return self.memory.evicted

    async def start(self) -> None:
        self.pulls.ways.check()
        await self.server.start()
        #: every address this node's data server listens on (a rail each; the first its own)
        self.data_addresses = [advertised(one, self.directory_address)
                               for one in self.server.addresses]
        # (kept for reconnects: the same-host socket is named after it)
        self._data_address = address = self.data_addresses[0]
        self.pulls.ways.listening(self.data_addresses)
        if self.config.shared_memory:
            await self.server.listen_local(address)  # pullers on this host find it by that address
        await self.link.connect(address, self.data_addresses)

    async def drain(self, grace: float) -> int:
        """Wait, at most `grace` seconds, until no peer needs this node to stay:
        none pulls from it, and no object of which it holds the only complete
        copy has a holder still filling its own (a receiver the directory sent
        here that has not connected yet counts). Returns how many objects were
        waited for. Nothing needed: it returns at once."""
        deadline = time.monotonic() + grace
        limit = self.config.inline_threshold  # (inline copies live in the directory)
        needed = [obj.oid for obj in self.store.objects()
                  if obj.complete and not obj.lent and obj.size > limit]
        if grace <= 0 or not needed or self._closed is not None:
            return 0
        needed = await self._needed(needed, deadline)
        waited = len(needed)
        if needed:
            log.info("shutdown: waiting up to %.3gs for peers pulling %d objects only this "
                     "node holds whole", grace, len(needed))
        asked = time.monotonic()
        while needed and time.monotonic() < deadline:
            await asyncio.sleep(min(0.02, max(0.0, deadline - time.monotonic())))
            if time.monotonic() - asked >= 0.1:  # (the directory's view, every 100 ms)
                needed, asked = await self._needed(needed, deadline), time.monotonic()
            else:
                needed = [oid for oid in needed if self.store.get(oid) is not None]
        return waited

    async def _needed(self, oids: list[ObjectID], deadline: float) -> list[ObjectID]:
        """Those of `oids` a peer still needs from this node: pulled from it
        now, or held nowhere else whole while another holder is filling it."""
        async def needed(oid: ObjectID) -> bool:
            if self.server.serving(oid):
                return True
            try:
                body = await self._request(m.Query(rid=0, oid=oid.binary),
                                           max(0.001, min(1.0, deadline - time.monotonic())))
            except HopliteError:  # (unknown, or no directory: nobody is sent here)
                return False
            others = [h for h in getattr(body, "holders", ()) if h.node != self.node_id]
            return (self.store.get(oid) is not None and not any(h.complete for h in others)
                    and any(not h.complete for h in others))

        flags = await asyncio.gather(*[needed(oid) for oid in oids])
        return [oid for oid, flag in zip(oids, flags, strict=True) if flag]

    async def close(self) -> None:
        if self._closed is not None:
            return
        self._closed = RuntimeClosed("the hoplite-gpu runtime was shut down")
        # (every part's tasks are cancelled before any is awaited)
        tasks = [*self.pulls.close(self._closed), *self.steps.close(),
                 *self.link.stop(self._closed), *self.memory.close(), *self._background.cancel()]
        await TaskSet.wait(tasks)
        self.store.close(self._closed)
        self.store.pool.clear()  # (its buffers, and the descriptors of shared ones, go now)
        await self.link.close()
        await self.pool.close()
        await self.server.close()

    def _check_open(self) -> None:
        if self._closed is not None:
            raise self._closed

    # (Directory calls of the node's parts go through these, so that a test
    # may stand in for one on the node.)
    def _post(self, msg: m.Message | dict) -> None:
        """A one-way notice to the directory (`DirectoryLink.post`)."""
        self.link.post(msg)

    async def _request(self, msg: m.Request | m.Nodes, timeout: float) -> m.Body:
        """A request to the directory, asked again after a reconnection (`DirectoryLink.request`)."""
        return await self.link.request(msg, timeout)

    async def _wait_reply(self, msg: m.Request, deadline: float) -> m.Body:
        """A request answered when something exists (`DirectoryLink.wait_reply`)."""
        return await self.link.wait_reply(msg, deadline)

    # ---------------------------------------------------------------- put ---
    async def put(self, value: Any, oid: ObjectID, *, lend: bool = False,
                  timeout: float | None = None, same_bytes: bool = False) -> ObjectID:
        """Store `value` as `oid` and register it (see `Puts.put`)."""
        return await self.puts.put(value, oid, lend=lend, timeout=timeout, same_bytes=same_bytes)

    async def put_pieces(self, oid: ObjectID, nbytes: int,
                         pieces: Sequence[tuple[int, memoryview]], *,
                         timeout: float | None = None,
                         registered: Callable[[], None] | None = None) -> ObjectID:
        """Store one host object laid out from `pieces` (see `Puts.put_pieces`)."""
        return await self.puts.put_pieces(oid, nbytes, pieces, timeout=timeout,
                                          registered=registered)

    def receive_into(self, oid: ObjectID, value: np.ndarray) -> bool:
        """Let the pull, or the reduce step, that makes `oid` here write into
        `value`'s memory (a writable, C-contiguous host array of its layout)
        instead of a buffer of the store's; False if `oid` is already here.
        The object then lives in the caller's memory: the caller must not
        write to it while the object is here (until `delete`)."""
        self._check_open()
        if self.store.get(oid) is not None:
            return False
        buf, layout = to_buffer(value)
        obj = self.store.create(oid, layout, np.frombuffer(buf, dtype=np.uint8), borrowed=True)
        obj.receiving = True
        return True

    def unreceived(self, oid: ObjectID) -> None:
        """Undo `receive_into` for an object that did not complete (a call that
        gave up): it leaves this node, and the directory hears so."""
        obj = self.store.get(oid)
        if obj is not None and not obj.complete:
            # The pull or the reduce step filling it must stop writing into
            # the caller's memory, which is the caller's again.
            # Everything a drop does (`_forget`), and the directory hears.
            self._forget(oid, ObjectNotFound(
                f"the call receiving object {oid.hex()} into its own array gave up"))
            self._post(m.Dropped(oid=oid.binary))

    def forget_copy(self, oid: ObjectID) -> None:
        """Drop this node's copy of `oid` if it was fetched from elsewhere (not
        put or made here), and the directory hears so: a later get fetches
        the object anew (a small object read before it was deleted and put
        again under its id)."""
        obj = self.store.get(oid)
        if obj is not None and not obj.own and obj.complete and not self.making(oid):
            self._forget(oid, ObjectNotFound(f"object {oid.hex()} was let go by this node"))
            self._post(m.Dropped(oid=oid.binary))

    def is_lent(self, oid: ObjectID) -> bool:
        """Whether `oid` is here as a `put(lend=True)` of a caller's memory."""
        return self.puts.is_lent(oid)

    async def reclaim(self, oid: ObjectID) -> None:
        """End the loan of a `put(lend=True)` (see `Puts.reclaim`)."""
        await self.puts.reclaim(oid)

    # ---------------------------------------------------------------- get ---
    async def get(self, oid: ObjectID, timeout: float, array_type: str = "cupy",
                  asked: float | None = None) -> Any:
        """`asked`: the caller's whole timeout, named in a Timeout's message
        (`timeout` is what is left of it, after a direct try)."""
        deadline = time.monotonic() + timeout
        log.debug("get %s: asked", oid.hex())
        obj = await self.fetch(oid, timeout, asked)
        while obj.buffer.nbytes != obj.layout.nbytes:  # its buffer was recycled meanwhile
            if not isinstance(obj.removed, _Retry) or time.monotonic() >= deadline:
                raise ObjectNotFound(f"object {oid.hex()} was deleted while this get returned it"
                                     f" ({obj.removed})")
            # dropped because it is being rebuilt (a reduce restarted): ask again
            obj = await self.fetch(oid, deadline - time.monotonic(),
                                   timeout if asked is None else asked)
        return from_buffer(obj.buffer, obj.layout, array_type)

    async def fetch(self, oid: ObjectID, timeout: float,
                    asked: float | None = None) -> StoredObject:
        """Make `oid` complete in the local store (pulling it if needed) and return it."""
        return await self.pulls.fetch(oid, timeout, asked)

    def withdraw(self, oid: ObjectID) -> None:
        """A direct call's put given up after it was sent (`hoplite_gpu.direct`)."""
        self.pulls.withdrawn(oid)

    # ----------------------------------------------------------- channels ---
    def channel_seen(self, name: str, version: int) -> None:
        """`version` of channel `name` is complete here (fetched or published):
        a restarted directory hears of it, so versions numbered after the
        restart are newer than what this node's readers already have."""
        self._channels[name] = max(version, self._channels.get(name, -1))

    async def channel_publish(self, name: str, version: int) -> int:
        self.channel_seen(name, version)
        body = await self._request(m.ChannelPublish(rid=0, name=name, version=version),
                                   self.config.timeout_s)
        return body.head

    async def channel_head(self, name: str, newer_than: int, timeout: float,
                           wait: bool = True) -> int:
        msg = m.ChannelHead(rid=0, name=name, newer_than=newer_than, wait=wait)
        try:
            body = await self._wait_reply(msg, time.monotonic() + timeout)
        except Timeout as exc:
            raise Timeout(f"channel {name!r} had no version newer than {newer_than} "
                          f"within {exc.args[0]:.3g}s") from None
        return body.head

    async def pull_plan(self, obj: StoredObject, plan: Plan) -> None:
        """Fill `obj` (in the store) as `plan` says (see `Pulls.pull_plan`)."""
        await self.pulls.pull_plan(obj, plan)

    def keep_inline(self, oid: ObjectID, layout: Layout, data: bytes, since: int) -> None:
        """Hold an inline object that a caller's thread put directly (registered
        already, `hoplite_gpu.direct`), as a put here would have; `since` is
        `forgets` when the put was sent. A drop of `oid` after that (a delete
        elsewhere that overtook this call) means the object is gone: keeping
        it would leave a copy the directory does not know, which a later put
        of the id would take for its own and not register."""
        if (self._closed is None and self.store.get(oid) is None
                and not self.forgotten.since(oid, since)):
            self.pulls.store_inline(oid, layout, data).own = True

    # ------------------------------------------------------------- delete ---
    async def delete(self, oid: ObjectID) -> None:
        await self._delete([oid], m.Delete(rid=0, oid=oid.binary))

    async def delete_many(self, oids: list[ObjectID]) -> None:
        """`delete` of every id in `oids`, in one message (a collective's
        objects: N^2 of them for a sliced allreduce of N ranks)."""
        for start in range(0, len(oids), _DELETE_BATCH):
            batch = oids[start:start + _DELETE_BATCH]
            await self._delete(batch, m.DeleteMany(rid=0, oids=[o.binary for o in batch]))

    async def _delete(self, oids: list[ObjectID], msg: m.Delete | m.DeleteMany) -> None:
        answered = False
        try:
            await self._request(msg, self.config.timeout_s)
            answered = True
        finally:
            # The directory sends no drop to us: everything a drop would do,
            # here, also for a call given up while the answer was on its way
            # (the delete may have happened: a copy kept would be served as
            # the id's after a new put of it). Unanswered, `dropped` tells the
            # directory this node holds nothing, in case it never heard.
            for oid in oids:
                self._forget(oid, ObjectNotFound(f"object {oid.hex()} was deleted"))
                if not answered:
                    self._post(m.Dropped(oid=oid.binary))

    def _forget(self, oid: ObjectID, reason: BaseException) -> None:
        """Everything of `oid` on this node ends: its reduce step, its copy, its
        pull, and (unless it is being rebuilt) the reduce we would re-ask for."""
        self.forgotten.record(oid)
        self.steps.forget(oid, reason)
        self.store.remove(oid, reason)
        self._stop_serving(oid)
        self.pulls.cancel(oid, reason)

    def _stop_serving(self, oid: ObjectID) -> None:
        """`oid` left the store: a pull of it being served stops at its next
        frame, and one whose puller does not read (its send blocked) is cut
        off after a second, so the freed buffer is not held or read on."""
        self.server.dropped_here(oid)
        if self.server.serving(oid) and self._closed is None:
            self.in_background(self.server.release(oid, min(1.0, self.config.stall_timeout_s)))

    def in_background(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run `coro` (which must end by itself: every wait in it has a
        deadline) beside the caller; it is cancelled when the node closes."""
        return self._background.spawn(coro)

    def _step_reads(self) -> set[ObjectID]:
        """Objects the reduce steps running here read or write, and fresh
        copies no get has taken yet: none may be evicted."""
        return self.steps.busy() | self.pulls.busy()

    def _let_go(self, oid: ObjectID, reason: BaseException | None = None) -> None:
        """Remove our copy of `oid` and tell the directory we no longer hold it."""
        self.store.remove(oid, reason)
        self._stop_serving(oid)
        self._post(m.Dropped(oid=oid.binary))

    async def stats(self) -> dict[str, Any]:
        """This node's counters (see `api.node_stats`)."""
        return {"objects": len(self.store), "shared_memory": self.config.shared_memory,
                "kept_mappings": self.pool.local_maps,
                "copied_from_mappings": self.pool.local_pulls,
                "bytes_copied_from_mappings": self.pool.local_bytes,
                "pool_hits": self.store.pool.hits, "pooled_bytes": self.store.pool.pooled,
                "pool_reclaimed": self.store.pool.reclaimed,
                "held_bytes": self.store.held, "store_bytes": self.config.store_bytes,
                "evicted": self.memory.evicted,
                "failovers": len(self.pulls.failovers),
                "bytes_sent_by_address": dict(self.server.sent)}

    async def query(self, oid: ObjectID) -> dict:
        """What the directory knows of `oid`, as the map `object_info` gives users."""
        body = await self._request(m.Query(rid=0, oid=oid.binary), self.config.timeout_s)
        info = m.as_map(body)
        info.pop("rid", None)
        return info

    async def nodes(self) -> dict[str, str]:
        return (await self._request(m.Nodes(), self.config.timeout_s)).nodes

    # ------------------------------------------------------------- reduce ---
    async def reduce(self, inputs: list[ObjectID], op: str, num_objects: int,
                     target: ObjectID, root_input: ObjectID | None = None,
                     relay: bool = False) -> ObjectID:
        return await self.steps.reduce(inputs, op, num_objects, target, root_input, relay)

    reduce_msg = staticmethod(Steps.reduce_msg)

    def remember_reduce(self, target: ObjectID, msg: m.Reduce, since: int | None = None) -> None:
        """See `Steps.remember_reduce` (also called from a caller's thread's
        direct reduce, on the loop)."""
        self.steps.remember_reduce(target, msg, since)

    async def reduced_inputs(self, target: ObjectID, timeout: float) -> list[ObjectID]:
        return await self.steps.reduced_inputs(target, timeout)

    # ------------------------------------------------------- reconnection ---
    def _announce(self, client: DirectoryClient) -> None:
        for obj in self.store.objects():
            if not obj.complete or self.steps.making(obj.oid):
                continue
            if obj.size <= self.config.inline_threshold:
                data = obj.buffer.tobytes()
                client.start(m.Put(rid=0, oid=obj.oid.binary, size=obj.size,
                                   layout=obj.layout.to_wire(), inline=data,
                                   print_=fingerprint(data)))
            else:
                client.post(complete_msg(obj))
        self.steps.announce(client)
        for name, version in self._channels.items():
            client.start(m.ChannelPublish(rid=0, name=name, version=version))

    # ------------------------------------------------------------- pushes ---
    def _on_push(self, msg: m.Message) -> None:
        """A push from the directory (`DirectoryLink.on_push`)."""
        self.link.on_push(msg)

    def _on_drop(self, msg: m.Drop) -> None:
        oid = ObjectID(msg.oid)
        text = msg.reason or f"object {oid.hex()} was dropped"
        if msg.retry and self.puts.making(oid):
            # (a completion of ours that crossed a removal is dropped with
            # `retry`; a put of the id under way here came after it)
            return
        if msg.lost and (obj := self.store.get(oid)) is not None and obj.complete:
            return  # lost as this copy completed: its `complete`, on its way, brings it back
        error = (_Retry(text) if msg.retry
                 else ReduceFailed(text) if msg.kind == "ReduceFailed"
                 else ObjectNotFound(text))
        self._forget(oid, error)


def directory_addresses(address: str) -> list[str]:
    """The directories of an `init` address: one, or several comma-separated
    (standbys, in the order they are tried); InvalidArgument naming the bad one."""
    if not isinstance(address, str) or not address.strip():
        raise InvalidArgument(f"a directory address is a str like 'host:port' or several "
                              f"comma-separated; got {address!r}")
    parts = [part.strip() for part in address.split(",")]
    if not all(parts):
        raise InvalidArgument(f"an empty directory address in {address!r}")
    for part in parts:
        split_address(part)  # (raises InvalidArgument naming it)
    return parts


def full_address(address: str, default_scheme: str) -> str:
    """`address` with its scheme (`default_scheme` for a bare host:port)."""
    scheme, host, port = split_address(address, default_scheme)
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def advertised(address: str, directory_address: str) -> str:
    """A wildcard bind (0.0.0.0, ::) is not an address peers can dial: advertise
    the local IP this host uses to reach the directory instead."""
    scheme, host, port = split_address(address)
    if host not in ("0.0.0.0", "::", ""):
        return address
    _, dhost, dport = split_address(directory_address)
    family = socket.AF_INET6 if ":" in dhost else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((dhost, dport))  # UDP connect sends nothing; it only picks a route
        local = probe.getsockname()[0]
    return f"{scheme}://[{local}]:{port}" if ":" in local else f"{scheme}://{local}:{port}"
