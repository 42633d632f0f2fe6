"""The pulls a node runs: one task per object being pulled here, shared by
every get of it, each get waiting on a future of its own; the sender comes
from the directory, the bytes through the pull engine (`engine.run_plan`),
a large pull spread over the rails this node shares with its senders and
over ECMP paths (`ways`)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager

import numpy as np

from hoplite_gpu import device
from hoplite_gpu import messages as m
from hoplite_gpu.config import Config
from hoplite_gpu.errors import HopliteError, ObjectNotFound, Timeout
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.timers import Expired, until
from hoplite_gpu.values import Layout

from .engine import plan_for, run_plan
from .flows import PEER_FAILURES, Flows
from .holdings import complete_msg
from .plan import Plan, SubFlow
from .pool import MIN_POOLED
from .pull_modes import Sink
from .retry import Retry
from .store import ChunkStore, StoredObject
from .tasks import TaskSet
from .transfer import PeerPool, map_object
from .ways import Ways

log = logging.getLogger("hoplite_gpu.node")

#: Why a pull's locate ran to its deadline (see `_locate`, `await_pull`).
_NOT_AVAILABLE = "nobody has put it yet, or every copy is busy"
#: How often a pulling node tells the directory how far it got.
_PROGRESS_EVERY_S = 0.1


class Pulls:
    """Gets and the pulls they share. What it needs of the rest of the node
    comes in as callables: `post` and `wait_reply` reach the directory;
    `room` makes room in the store for a copy (`Memory.room`), `trim_soon`
    trims after an inline one; `offered(oid)` is an eviction offer's answer
    while awaited; `settled(oid)` tells that a reduce's final result is here;
    `let_go(oid, reason)` removes a copy and tells the directory;
    `forgets()` and `forgot_since(oid, count)` tell whether a drop of `oid`
    came after a locate was asked."""

    def __init__(self, store: ChunkStore, pool: PeerPool, config: Config, *,
                 post: Callable[[m.Message], None],
                 wait_reply: Callable[[m.Request, float], Awaitable[m.Body]],
                 room: Callable[[Layout, str], AbstractAsyncContextManager[None]],
                 trim_soon: Callable[[], None],
                 offered: Callable[[ObjectID], asyncio.Future | None],
                 settled: Callable[[ObjectID], None],
                 let_go: Callable[..., None],
                 forgets: Callable[[], int],
                 forgot_since: Callable[[ObjectID, int], bool]) -> None:
        self.store, self.pool, self.config = store, pool, config
        self._post, self._wait_reply = post, wait_reply
        self._room, self._trim_soon, self._offered = room, trim_soon, offered
        self._settled, self._let_go = settled, let_go
        self._forgets, self._forgot_since = forgets, forgot_since
        self._pulls: dict[ObjectID, asyncio.Task] = {}
        #: The gets waiting on each pull, woken by the pull itself as it ends.
        self._pull_waiters: dict[ObjectID, list[asyncio.Future]] = {}
        #: Why a pull was cancelled from outside (drop, directory lost), for its waiters.
        self._pull_errors: dict[ObjectID, BaseException] = {}
        #: the latest deadline of the gets waiting on each pull (a patient get
        #: that joins a hasty one's pull extends it)
        self._pull_deadlines: dict[ObjectID, float] = {}
        #: (object, when a pull failed, when bytes flowed again) of recent failovers
        self.failovers: deque[tuple[ObjectID, float, float]] = deque(maxlen=1000)
        self._failed_at: dict[ObjectID, float] = {}
        #: inline copies a pull just stored for gets that have not taken them yet:
        #: not evictable until one has (the eviction their store may start
        #: runs before the gets do)
        self._fresh: set[ObjectID] = set()
        #: the newest striped assignment pushed for each pull (`restripe`);
        #: the pull tasks waiting inside a plan, which a newer one stops; the
        #: pulls so stopped, until they take it
        self._restripes: dict[ObjectID, m.Restripe] = {}
        self._planning: dict[ObjectID, asyncio.Task] = {}
        self._moving: set[ObjectID] = set()
        self._tasks = TaskSet()
        self._closed: BaseException | None = None
        #: how large pulls reach their senders: rails and ECMP paths
        self.ways = Ways(config)
        #: sub-flows fetched over them (a reduce step's child pulls too)
        self.flows = Flows(pool, config, self.ways, post)
        #: per plan running, what its sub-flows call as bytes land (`_progress`)
        self._reporting: dict[ObjectID, Callable[[int], None]] = {}

    # (read only, for the node's own checks and tests)
    @property
    def running(self) -> Mapping[ObjectID, asyncio.Task]:
        return self._pulls

    @property
    def waiters(self) -> Mapping[ObjectID, list[asyncio.Future]]:
        return self._pull_waiters

    @property
    def errors(self) -> Mapping[ObjectID, BaseException]:
        return self._pull_errors

    @property
    def failed_at(self) -> Mapping[ObjectID, float]:
        return self._failed_at

    def making(self, oid: ObjectID) -> bool:
        """Whether a pull here is making `oid`."""
        return oid in self._pulls

    def busy(self) -> set[ObjectID]:
        """Fresh copies no get has taken yet: none may be evicted."""
        return set(self._fresh)

    def close(self, reason: BaseException) -> list[asyncio.Task]:
        """Stop every pull (its gets fail with `reason`): the cancelled tasks,
        for the node to await."""
        self._closed = reason
        return self._tasks.cancel()

    def cancel_all(self, reason: BaseException) -> None:
        """Stop every pull running here (the directory stayed away)."""
        for oid in list(self._pulls):
            self.cancel(oid, reason)

    def _check_open(self) -> None:
        if self._closed is not None:
            raise self._closed

    async def fetch(self, oid: ObjectID, timeout: float,
                    asked: float | None = None) -> StoredObject:
        """Make `oid` complete in the local store (pulling it if needed) and return it."""
        self._check_open()
        deadline = time.monotonic() + timeout
        timeout = timeout if asked is None else asked  # (from here on: for messages)
        try:
            while True:
                obj = self.store.get(oid)
                offered = self._offered(oid) if obj is not None else None
                if offered is not None:
                    # Our copy is being offered for eviction: a view handed out now
                    # would outlive it uncounted. Its fate first, then look again.
                    await asyncio.wait({offered}, timeout=max(0.0, deadline - time.monotonic()))
                    if offered.done():
                        continue
                if obj is None or not obj.complete:
                    try:
                        obj = await self.await_pull(oid, deadline, timeout)
                    except Retry:
                        continue  # the object is being rebuilt (a reduce restarted): ask again
                if obj.reduce_tag is not None and not await self._confirm(obj, deadline, timeout):
                    if self.store.get(oid) is obj:  # a copy of a tree that was rebuilt: pull again
                        self._let_go(oid, Retry("the reduce restarted"))
                    continue
                # A final copy of a reduce's result: a restarted directory learns of
                # it from its holders, so the reduce need not be asked for again.
                self._settled(oid)
                obj.used = time.monotonic()
                return obj
        finally:
            # (a caller views the copy before it next awaits, or has given up)
            self._fresh.discard(oid)

    async def _confirm(self, obj: StoredObject, deadline: float, timeout: float) -> bool:
        """Is this complete copy of a reduce result from the tree that finished?
        A failover can rebuild the tree after our copy completed but before the
        directory heard that its root did; that copy would not match
        `reduced_inputs`. Confirmed once, the copy is final."""
        tag = obj.reduce_tag
        msg = m.ReduceConfirm(rid=0, target=obj.oid.binary, tag=tag)
        try:
            current = (await self._wait_reply(msg, deadline)).current
        except Timeout:
            raise Timeout(f"get of object {obj.oid.hex()}: the reduce producing it did not "
                          f"finish within {timeout:g}s") from None
        if current and obj.reduce_tag == tag:
            obj.reduce_tag = None
        return current

    async def await_pull(self, oid: ObjectID, deadline: float, timeout: float) -> StoredObject:
        """Join the pull of `oid` (starting it if none runs). Each get waits on
        its own future, so its deadline or cancellation leaves the pull, which
        other gets may share, running."""
        loop = asyncio.get_running_loop()
        if oid not in self._pulls:
            self._start_pull(oid, deadline)
        else:
            self._pull_deadlines[oid] = max(self._pull_deadlines.get(oid, deadline), deadline)
        waiter = loop.create_future()
        waiters = self._pull_waiters[oid]
        waiters.append(waiter)
        try:
            # A little later than the pull's own deadline, so its more precise error wins.
            return await until(waiter, deadline + 0.25)
        except Timeout as exc:
            if time.monotonic() < deadline - 0.01:
                raise Retry from None  # the pull ran to the deadline of a less patient get
            if getattr(exc, "not_available", False):  # (in this get's own terms: a
                # pull it joined, or asked again, started after it)
                raise Timeout(f"object {oid.hex()} was not available within {timeout:g}s: "
                              f"{_NOT_AVAILABLE}") from None
            raise  # the pull's own, more precise deadline error
        except Expired:
            raise Timeout(f"get of object {oid.hex()} did not finish within {timeout:g}s") from None
        finally:
            if (not waiter.done() or waiter.cancelled()
                    or isinstance(waiter.exception(), Expired)):  # this get gave up
                waiters.remove(waiter)
                if not waiters and self._pull_waiters.get(oid) is waiters:
                    # the last one: nobody wants this pull any more (a get that
                    # joins it as it ends asks again)
                    self.cancel(oid, Retry(
                        f"the pull of object {oid.hex()} was abandoned by its gets"))

    def _start_pull(self, oid: ObjectID, deadline: float, located: m.Located | None = None) -> None:
        self._pull_errors.pop(oid, None)  # from an earlier pull of this id
        self._pull_deadlines[oid] = deadline
        self._pull_waiters[oid] = []
        task = self._tasks.spawn(self._run_pull(oid, deadline, located))
        self._pulls[oid] = task
        task.add_done_callback(lambda t, oid=oid: self._pull_ended(oid, t))

    def located(self, msg: m.Located) -> None:
        """The directory's answer to a locate one of our threads asked
        directly (`hoplite_gpu.direct`): pull now, from the sender it names;
        the thread's get joins this pull. A pull already running asked (or
        will ask) the directory itself, which then superseded this answer."""
        oid = ObjectID(msg.oid)
        if self._closed is not None or oid in self._pulls:
            return
        obj = self.store.get(oid)
        if obj is not None and obj.complete:
            self._post(complete_msg(obj))  # we hold it: free the sender's slot
            return
        self._start_pull(oid, time.monotonic() + self.config.timeout_s, msg)

    async def _run_pull(self, oid: ObjectID, deadline: float,
                        located: m.Located | None = None) -> StoredObject:
        """The pull, waking its waiters in the same step it ends in (no extra
        loop iteration for a done-callback)."""
        me = asyncio.current_task()
        try:
            obj = await self._pull(oid, deadline, located)
        except asyncio.CancelledError:
            self._pull_ended(oid, me, self._abandoned(oid))
            raise
        except BaseException as exc:
            self._pull_ended(oid, me, exc)
            raise
        finally:  # (no cycle task -> error -> traceback -> this frame -> task:
            me = None  # it would keep the buffer until the collector's full pass)
        self._pull_ended(oid, asyncio.current_task(), result=obj)
        return obj

    def _abandoned(self, oid: ObjectID) -> BaseException:
        return self._pull_errors.get(oid) or self._closed or ObjectNotFound(
            f"the pull of object {oid.hex()} was abandoned")

    def _pull_ended(self, oid: ObjectID, task: asyncio.Task | None,
                    error: BaseException | None = None, result: StoredObject | None = None) -> None:
        """Forget the pull and wake its waiters; also the done-callback, for a
        pull cancelled before it ran (its body then never starts)."""
        if task is not None and task.done() and not task.cancelled():
            task.exception()  # retrieved: the waiters re-raise it
        if task is None or self._pulls.get(oid) is not task:
            return
        del self._pulls[oid]
        if result is None and error is None:
            if task.cancelled():
                error = self._abandoned(oid)
            elif (error := task.exception()) is None:
                result = task.result()
        # (this pull's leftovers: none may outlive it)
        self._restripes.pop(oid, None)
        self.ways.forget(oid)
        self._pull_errors.pop(oid, None)
        self._failed_at.pop(oid, None)
        self._pull_deadlines.pop(oid, None)
        for waiter in self._pull_waiters.pop(oid, ()):
            if not waiter.done():
                if error is not None:
                    waiter.set_exception(error)
                else:
                    waiter.set_result(result)

    async def _pull(self, oid: ObjectID, deadline: float,
                    located: m.Located | None = None) -> StoredObject:
        self._check_open()
        failures = 0
        while True:
            deadline = self._pull_deadlines.get(oid, deadline)  # (a patient get may have joined)
            reply = located if located is not None else await self._locate(oid, deadline)
            located = None
            log.debug("pull %s: located at %s", oid.hex(), reply.address or "(here)")
            layout = Layout.from_wire(reply.layout)
            inline = reply.inline if isinstance(reply, m.Location) else None
            if inline is not None:
                self._fresh.add(oid)
                return self.store_inline(oid, layout, inline)
            obj = self.store.get(oid)
            if reply.local:
                if layout.nbytes == 0:
                    obj = obj or self.store.create(oid, layout)
                    return obj
                if obj is not None and obj.complete:
                    return obj
                # The directory thinks we hold it but we do not: correct it, ask again.
                self._post(m.Dropped(oid=oid.binary))
                continue
            address = reply.address
            if obj is not None and obj.own and obj.error is None:
                # Put here meanwhile: that copy is the object, not one to pull
                # into; once it is whole, `complete` frees the sender's slot.
                await obj.wait_ready(obj.size, max(0.001, deadline - time.monotonic()))
                self._post(complete_msg(obj))
                return obj
            if obj is None or obj.error is not None:
                obj, mapped = await self._buffer_for(oid, layout, address)
                if mapped:  # the sender's complete copy, mapped: nothing to pull
                    obj.reduce_tag = reply.reduce_tag
                    self._post(complete_msg(obj))
                    return obj
            obj.reduce_tag = reply.reduce_tag
            try:
                await self._pull_assigned(obj, reply)
            except PEER_FAILURES:  # (reported: `_flow_failed`)
                failures += 1
                if not await self._retry_after(obj, failures, deadline):
                    raise
                continue
            except BaseException:
                self._drop_partial(obj)
                raise
            self._post(complete_msg(obj))
            log.debug("pull %s: complete", oid.hex())
            return obj

    async def _buffer_for(self, oid: ObjectID, layout: Layout,
                          address: str) -> tuple[StoredObject, bool]:
        """The copy to pull `oid` into, and whether it is already whole: a
        same-host sender's complete copy kept mapped (True), or a buffer here."""
        try:
            async with self._room(layout, f"get of object {oid.hex()}"):
                mapped = await self._map_from(oid, layout, address)
                if mapped is not None:
                    return mapped, True
                obj = self.store.get(oid)  # (made here meanwhile, e.g. by `receive_into`)
                if obj is None or obj.error is not None:
                    obj = self.store.create(oid, layout)
                    log.debug("pull %s: buffer of %d bytes made", oid.hex(), layout.nbytes)
                return obj, False
        except BaseException:
            self._post(m.Dropped(oid=oid.binary))  # free the sender's slot
            raise

    async def _retry_after(self, obj: StoredObject, failures: int, deadline: float) -> bool:
        """After the `failures`-th failed attempt to fill `obj`: False past the
        pull's deadline (the copy is let go: receivers pulling from it fail
        over at once), else True after a short back-off (the directory may
        hand us the same sender again)."""
        deadline = self._pull_deadlines.get(obj.oid, deadline)
        if time.monotonic() >= deadline:
            self._let_go(obj.oid)
            return False
        try:
            await asyncio.sleep(min(0.01 * 2 ** failures, 0.5,
                                    max(0.0, deadline - time.monotonic())))
        except BaseException:  # given up here: the partial copy goes, as in `_pull`
            self._drop_partial(obj)
            raise
        return True

    async def _map_from(self, oid: ObjectID, layout: Layout, address: str) -> StoredObject | None:
        """Keep a same-host sender's complete copy as ours, mapped read-only
        (`transfer.map_object`): None where that cannot be (then pull)."""
        if (not self.config.shared_memory or layout.nbytes < MIN_POOLED
                or (layout.kind == "device" and device.gpu_present())):
            return None
        try:
            mapped = await map_object(self.pool, address, oid, layout.nbytes, self.config)
        except (HopliteError, OSError) as exc:  # the pull that follows meets it too, and fails over
            log.info("mapping %s from %s failed: %s", oid.hex(), address, exc)
            return None
        if mapped is None:
            return None
        existing = self.store.get(oid)
        if existing is not None and existing.error is None:
            return None  # made here while we asked (`receive_into`, a put): keep that one
        obj = self.store.create(oid, layout, np.frombuffer(mapped, dtype=np.uint8))
        obj.advance(obj.size)
        return obj

    async def _locate(self, oid: ObjectID, deadline: float) -> m.Location:
        since = self._forgets()
        try:
            return await self._wait_reply(m.Locate(rid=0, oid=oid.binary), deadline)
        except Timeout as exc:
            self.withdrawn(oid)
            late = Timeout(f"object {oid.hex()} was not available within {exc.args[0]:.3g}s: "
                           f"{_NOT_AVAILABLE}")
            late.not_available = True  # (said in the get's own terms by `await_pull`)
            raise late from None
        except asyncio.CancelledError:
            # Cancelled by a drop or delete (`_forget`), the directory forgot
            # this node's part already, and may have made it a holder anew
            # since (a restarted reduce's root): then nothing is withdrawn.
            if not self._forgot_since(oid, since):
                self.withdrawn(oid)
            raise

    def restripe(self, msg: m.Restripe) -> None:
        """The directory moved a stripe of a pull of ours to another sender:
        the pull goes on from the newest assignment (`_pull_assigned`). One
        for an object no pull here makes any more is void."""
        oid = ObjectID(msg.oid)
        if oid not in self._pulls:
            return
        newest = self._restripes.get(oid)
        if newest is not None and msg.seq <= newest.seq:
            return
        self._restripes[oid] = msg
        task = self._planning.get(oid)
        if task is not None and oid not in self._moving:
            # (the pull task waits inside its plan: it stops there, `_pull_assigned`
            # takes it back, and what is missing comes from the new senders)
            self._moving.add(oid)
            task.cancel(f"the pull of {oid.hex()} goes on from other senders")

    async def _pull_assigned(self, obj: StoredObject, reply: m.Location | m.Located) -> None:
        """Fill `obj` from the senders `reply` names. A striped object's
        receiver may be told newer senders while it pulls (`restripe`): the
        plan then stops, keeping every byte written, and what is missing
        comes from the newest assignment. (A pull of the whole object from
        one sender may be so told too: the directory stripes an object once
        enough receivers came.)"""
        oid, seq = obj.oid, reply.seq  # (the task is never kept in this frame: `_run_pull`)
        sender, address = reply.sender, reply.address
        also = [(s.sender, s.address) for s in reply.also]
        stripes = [(s.start, s.end, s.sender, s.address) for s in reply.stripes]
        piece, rails = reply.piece, reply.rails
        while not obj.complete:
            newest = self._restripes.get(oid)
            if newest is not None and newest.seq > seq:
                seq, piece, also, rails = newest.seq, newest.piece, [], newest.rails
                stripes = [(s.start, s.end, s.sender, s.address) for s in newest.stripes]
            missing = obj.size - (obj.ready if obj.ledger is None else obj.ledger.written)
            senders = (list(dict.fromkeys((s[2], s[3]) for s in stripes)) if stripes
                       else [(sender, address), *also])
            routes, held = self.ways.routes(oid, missing, senders, rails)
            plan = plan_for(obj, sender, address, also, stripes, piece, routes)
            self._planning[oid] = asyncio.current_task()
            try:
                await self.pull_plan(obj, plan)
                return
            except asyncio.CancelledError:
                # Stopped by `restripe` alone (not given up from outside as
                # well): go on. Else the cancel is the pull's.
                if oid not in self._moving or asyncio.current_task().cancelling() > 1:
                    raise
                asyncio.current_task().uncancel()
            finally:
                self._planning.pop(oid, None)
                self._moving.discard(oid)
                self.ways.release(held)

    def withdrawn(self, oid: ObjectID) -> None:
        """A locate given up. The directory may have named a sender just
        before (made this node a holder pulling from it, in one of that
        sender's slots), and its answer is dropped unread: `dropped` frees
        that (a non-holder's is ignored). A partial copy of an earlier try
        goes too; a copy made here (a put still copying, a reduce step's
        output, a caller's receiving array) stays."""
        obj = self.store.get(oid)
        if obj is None or not (obj.complete or obj.own or obj.receiving):
            self._let_go(oid)

    async def pull_plan(self, obj: StoredObject, plan: Plan) -> None:
        """Fill `obj` (in the store) as `plan` says (`engine.run_plan`): each
        sub-flow's failure is reported to the directory, and its rest moves
        to another of the plan's senders; with none left, this raises."""
        self._reporting[obj.oid] = self._progress(obj)
        try:
            await run_plan(plan, obj, functools.partial(self._fetch_from, obj),
                           functools.partial(self._flow_failed, obj), PEER_FAILURES)
        finally:
            self._reporting.pop(obj.oid, None)

    async def _fetch_from(self, obj: StoredObject, flow: SubFlow, sink: Sink) -> None:
        """Pull one sub-flow of `obj` (`flows.Flows.fetch`), its progress
        told as the plan's."""
        progress = self._reporting.get(obj.oid) or self._progress(obj)
        await self.flows.fetch(obj, flow, sink, progress)

    def _flow_failed(self, obj: StoredObject, flow: SubFlow, exc: BaseException) -> None:
        self.ways.failed(obj.oid, flow)
        log.info("pull of %s from %s failed at %d bytes: %s", obj.oid.hex(), flow.sender,
                 obj.ready, exc)
        self._failed_at.setdefault(obj.oid, time.time())
        self._post(m.Failed(oid=obj.oid.binary, sender=flow.sender, have=obj.ready))

    def _progress(self, obj: StoredObject) -> Callable[[int], None]:
        """What a plan's sub-flows call as their bytes land (one for the
        whole plan, `_reporting`): now and then the directory hears how
        much of the object is ready here (relays may start from it)."""
        last = [time.monotonic()]

        def progress(pos: int) -> None:
            failed_at = self._failed_at.pop(obj.oid, None)
            if failed_at is not None:
                self.failovers.append((obj.oid, failed_at, time.time()))
            now = time.monotonic()
            if now - last[0] >= _PROGRESS_EVERY_S:
                last[0] = now
                self._post(m.Progress(oid=obj.oid.binary, nbytes=obj.ready))

        return progress

    def store_inline(self, oid: ObjectID, layout: Layout, data: bytes) -> StoredObject:
        obj = self.store.get(oid)
        if obj is None or obj.error is not None:
            obj = self.store.create(oid, layout, np.frombuffer(bytearray(data), dtype=np.uint8))
            self._trim_soon()
        elif not obj.complete:  # a caller's array to receive into (`receive_into`)
            obj.buffer[:] = np.frombuffer(data, dtype=np.uint8)
        obj.advance(obj.size)
        return obj

    def _drop_partial(self, obj: StoredObject) -> None:
        """A pull given up: its copy goes if it is still ours (a put's stays)."""
        if self.store.get(obj.oid) is obj and not obj.own:
            self._let_go(obj.oid)

    def cancel(self, oid: ObjectID, reason: BaseException) -> None:
        task = self._pulls.get(oid)
        if task is not None and not task.done():
            self._pull_errors[oid] = reason
            task.cancel(str(reason))
