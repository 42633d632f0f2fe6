"""Room in a node's store under `store_bytes`: copies pulled from others are
evicted, least recently used first, with the directory's consent."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable

from hoplite_gpu import messages as m
from hoplite_gpu.config import Config
from hoplite_gpu.errors import DirectoryUnavailable, HopliteError, ObjectNotFound, StoreFull
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.timers import Expired, until
from hoplite_gpu.values import Layout

from .store import ChunkStore, StoredObject
from .tasks import TaskSet

log = logging.getLogger("hoplite_gpu.node")



def beyond_limit(what: str, need: int, limit: int) -> StoreFull:
    """The error for an object larger than the whole store limit: no
    eviction could make room for it."""
    return StoreFull(f"{what}: the object has {need} bytes, more than this node's whole "
                     f"store limit (HOPLITE_STORE_BYTES={limit}); raise the limit")

class Memory:
    """Makes room in `store` for objects about to be made, and keeps it
    within its limit after objects made without asking. `ask` starts a
    request to the directory (its answer a future); `busy` names the objects
    that may not go now (read or written by a reduce step, or fresh copies
    no get has taken yet)."""

    def __init__(self, store: ChunkStore, config: Config, node_id: str,
                 ask: Callable[[m.Evict], asyncio.Future],
                 busy: Callable[[], set[ObjectID]]) -> None:
        self.store = store
        self.config = config
        self.node_id = node_id
        self._ask = ask
        self._busy = busy
        #: copies freed to make room under `store_bytes`
        self.evicted = 0
        #: copies offered for eviction -> the directory's answer, until it comes
        self._offered: dict[ObjectID, asyncio.Future] = {}
        #: the eviction running in the background (`trim_soon`)
        self._trimming: asyncio.Task | None = None
        self._tasks = TaskSet()
        self._closed = False

    def offered(self, oid: ObjectID) -> asyncio.Future | None:
        """The directory's answer to an eviction offer of `oid`'s copy, while it is awaited."""
        return self._offered.get(oid)

    def close(self) -> list[asyncio.Task]:
        """Stop trimming: the cancelled tasks, for the node to await."""
        self._closed = True
        return self._tasks.cancel()

    @contextlib.asynccontextmanager
    async def room(self, layout: Layout, what: str) -> AsyncIterator[None]:
        """Room under `store_bytes` for an object of `layout`, kept for it
        (`ChunkStore.reserved`) until the block, which makes it, ends: calls
        making objects at the same time cannot both take the last of it."""
        need = await self.make_room(layout.nbytes, what) if self.store.on_host(layout) else 0
        self.store.reserved += need
        try:
            yield
        finally:
            self.store.reserved -= need

    async def make_room(self, need: int, what: str, collect: bool = True) -> int:
        """Make room under `store_bytes` for `need` more bytes of host
        objects: evict pulled copies that another node also holds, least
        recently used first, with the directory's consent; else raise
        `StoreFull`. Nothing is evicted for a call that cannot get room.
        Returns the bytes that count against the limit (0 without one).
        `collect`: run the garbage collector once before giving up (see below;
        not for a background trim, which runs after every inline object made
        while the store is over its limit and gives up quietly)."""
        limit = self.config.store_bytes
        if not limit:
            return 0
        if self.store.used + need <= limit:
            return need
        if need > limit:
            raise beyond_limit(what, need, limit)
        tried: set[ObjectID] = set()
        give_up = time.monotonic() + self.config.timeout_s
        collected = not collect
        while self.store.used + need > limit:
            over = self.store.used + need - limit
            # (copies another call offers now are its: their fate comes first)
            candidates = [obj for obj in self.store.evictable(busy=self._busy())
                          if obj.oid not in tried and obj.oid not in self._offered]
            if sum(obj.size for obj in candidates) < over:
                others = set(self._offered.values())
                if not others and not collected:
                    # A view kept only by a reference cycle (the traceback of a
                    # send that failed mid-message, a get result dropped inside
                    # one) counts as a user until the collector runs: run it
                    # once before giving up, never on the way that succeeds.
                    collected = True
                    log.debug("%s: collecting garbage before evicting (%d free candidate "
                              "bytes, %d needed)", what, sum(o.size for o in candidates), over)
                    gc.collect()
                    continue
                if not others or time.monotonic() >= give_up:
                    break  # even all of them would not do: keep them
                await asyncio.wait(others, timeout=give_up - time.monotonic())
                continue
            if not await self._offer(candidates, over, tried):
                break
        if self.store.used + need > limit:
            raise StoreFull(
                f"{what} needs {need} bytes, but this node holds {self.store.used} bytes of "
                f"objects (limit HOPLITE_STORE_BYTES={limit}) and could not evict enough: only "
                "copies pulled from others, held by another node too and used by no get "
                "result here, can go. Delete objects you no longer need, drop references "
                "to get results, or raise the limit")
        return need

    async def _offer(self, candidates: list[StoredObject], over: int, tried: set[ObjectID]) -> bool:
        """Offer all of `candidates` for eviction, least recently used first:
        the directory frees the first that may go and make `over` bytes of
        room together, or none. False where it could not answer."""
        offered = {obj.oid: obj for obj in candidates}
        tried.update(offered)
        msg = m.Evict(rid=0, oids=[oid.binary for oid in offered], need=over)
        try:
            reply = self._ask(msg)
        except DirectoryUnavailable:
            return False
        # The directory forgets the copies it agrees to as it answers, so
        # they go whatever becomes of this call (cancelled, timed out):
        # a copy kept past that would miss the object's deletion.
        for oid in offered:
            self._offered[oid] = reply
        reply.add_done_callback(lambda fut, offered=offered: self._evicted(fut, offered))
        try:
            await until(asyncio.shield(reply), time.monotonic() + self.config.timeout_s)
        except (Expired, DirectoryUnavailable):
            return False
        return True

    def trim_soon(self) -> None:
        """An object made without asking for room first (an inline one, at
        most `inline_threshold` bytes, or a reduce step's output that no
        eviction could make room for) left this node over `store_bytes`:
        evict in the background what the limit allows, as a get would."""
        limit = self.config.store_bytes
        if (limit and self.store.used > limit and self._trimming is None
                and not self._closed):
            self._trimming = self._tasks.spawn(self._trim())

    async def _trim(self) -> None:
        try:
            await self.make_room(0, "keeping the store within its limit", collect=False)
        except HopliteError as exc:  # nothing may go now; the next call tries again
            log.debug("store over its limit: %s", exc)
        finally:
            self._trimming = None

    def _evicted(self, reply: asyncio.Future, offered: dict[ObjectID, StoredObject]) -> None:
        """Free the copies the directory agreed to evict (it no longer counts them)."""
        for oid in offered:
            if self._offered.get(oid) is reply:
                del self._offered[oid]
        if reply.cancelled() or reply.exception() is not None:
            return  # no answer: the directory kept them, or a new one hears of them
        body = reply.result()
        for raw in body.evicted if isinstance(body, m.Evicted) else ():
            oid = ObjectID(raw)
            if self.store.get(oid) is not offered.get(oid):
                continue  # (made here anew since: not the copy offered)
            self.store.remove(oid, ObjectNotFound(
                f"object {oid.hex()} was evicted from node {self.node_id} to make room "
                "(HOPLITE_STORE_BYTES); get it again"))
            self.evicted += 1
            log.debug("evicted %s", oid.hex())
