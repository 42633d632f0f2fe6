"""The pull engine: runs a `Plan`'s sub-flows into one object's buffer.

Each sub-flow writes its range in place. A plan of one sub-flow that starts
at the object's watermark (today's pull) records its bytes in the watermark
itself, as it always did: no ledger, no task. A plan of several records
every piece in the object's `Ledger`, whose prefix moves the watermark (so a
partial copy is relayed as it fills), and runs as a queue: one worker per
route takes the next sub-flow whenever it is done with one (a pinned plan's
workers start with their own: one sub-flow each, or, dealt over one
sender's rails and paths, each route its pieces in turn). A sub-flow that fails is
reported, its sender is out, and what it had not written yet goes back to
the queue for the others; with none left the failure is the pull's, and the
caller asks the directory again (the ledger stays with the object, so the
next plan pulls only what is missing).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Sequence

from hoplite_gpu.errors import PeerLost

from .plan import Ledger, Plan, Route, SubFlow, as_route
from .pull_modes import Sink
from .store import StoredObject

log = logging.getLogger("hoplite_gpu.engine")

#: Pull a sub-flow's range, recording each piece that landed in the sink.
Fetch = Callable[[SubFlow, Sink], Awaitable[None]]
#: A sub-flow failed with this error (reported before its bytes move on).
Failed = Callable[[SubFlow, BaseException], None]


class FlowSink:
    """One sub-flow's place in the ledger: each piece it lands is recorded
    (refused if any byte of it was written before), and the object's
    watermark follows the ledger's prefix."""

    __slots__ = ("obj", "ledger", "pos")

    def __init__(self, obj: StoredObject, ledger: Ledger, pos: int) -> None:
        self.obj, self.ledger, self.pos = obj, ledger, pos

    def advance(self, ready: int) -> None:
        if ready <= self.pos:
            return
        self.ledger.write(self.pos, ready)
        self.pos = ready
        prefix = self.ledger.prefix
        if prefix > self.obj.ready:
            self.obj.advance(prefix)  # (which wakes the range waits too)
        else:
            self.obj.landed()


#: A pull from several senders goes in equal pieces, a whole number of them
#: per sender (at least 4, so that a faster sender takes more and a failed
#: one's rest is shared), of at most PIECE_MAX bytes (each piece's request, a
#: round trip, costs little) and at least PIECE_MIN. A count that is not a
#: multiple of the senders would leave the last piece on one sender alone:
#: 16 pieces over 3 equal senders take 6/16 of one sender's time, not 1/3.
PIECE_MIN, PIECE_MAX, PIECES_PER_SENDER = 1 << 20, 16 << 20, 4


def plan_for(obj: StoredObject, sender: str, address: str,
             also: Sequence[tuple[str, str]] = (),
             stripes: Sequence[tuple[int, int, str, str]] = (), piece: int = 0,
             routes: Sequence[Route] = ()) -> Plan:
    """The plan that fills what `obj` still misses: from one sender, today's
    pull (from the watermark on), or, after a plan of several sub-flows
    failed, each range its ledger lacks; with `also` other senders, pieces
    that the senders take in turn (`Plan.pieces`); with `stripes` (start,
    end, sender, address), each stripe's missing bytes from its sender, in
    messages of `piece` bytes (`Plan.striped`). `routes`, where given, are
    the ways to the senders (several per sender: its rails and paths):
    pieces go to them in turn, and one sender's several routes share its
    bytes equally, pieces dealt to them in turn and each route pulling its
    own one after another, all routes at once (`Plan.dealt`), a stripe's
    bytes too."""
    missing = None if obj.ledger is None else obj.ledger.missing()
    if stripes:
        return Plan.striped(obj.oid, obj.size, stripes,
                            [(obj.ready, obj.size)] if missing is None else missing, piece,
                            routes, piece_size)
    ranges = [(obj.ready, obj.size)] if missing is None else missing
    ways = list(routes) or [as_route(s) for s in [(sender, address), *also]]
    nbytes = sum(b - a for a, b in ranges)
    if also:
        return Plan.pieces(obj.oid, obj.size, ways, missing=ranges,
                           piece=piece_size(nbytes, len(ways)))
    if len(ways) > 1:
        return Plan.dealt(obj.oid, obj.size, ways, missing=ranges,
                          piece=piece_size(nbytes, len(ways)))
    if missing is None:
        flow = SubFlow(obj.ready, obj.size, sender, ways[0][1], local=ways[0][2],
                       path=ways[0][3])
        return Plan(obj.oid, obj.size, (flow,))
    return Plan(obj.oid, obj.size, tuple(SubFlow(a, b, sender, ways[0][1], local=ways[0][2],
                                                 path=ways[0][3]) for a, b in missing))


def piece_size(nbytes: int, senders: int) -> int:
    """The piece a pull of `nbytes` from `senders` senders goes in (see
    PIECES_PER_SENDER): equal pieces, as many per sender, all within bounds."""
    rounds = max(PIECES_PER_SENDER, -(-nbytes // (senders * PIECE_MAX)))
    return max(PIECE_MIN, -(-nbytes // (rounds * senders)))


async def run_plan(plan: Plan, obj: StoredObject, fetch: Fetch, failed: Failed,
                   retry_on: tuple[type[BaseException], ...]) -> None:
    """Fill `obj` as `plan` says. `fetch` pulls one sub-flow; an error of a
    `retry_on` type is a sub-flow's failure (`failed` hears of it), others
    end the pull at once. Raises the failure that left a sub-flow no sender."""
    flows = plan.flows
    if (len(flows) == 1 and obj.ledger is None and flows[0].start == obj.ready
            and len(plan.routes) == 1):
        # Today's pull: the watermark is the only record, no task in between.
        try:
            await fetch(flows[0], obj)
        except retry_on as exc:
            failed(flows[0], exc)
            raise
        return
    if obj.ledger is None:
        obj.ledger = Ledger(obj.size, obj.ready)
    queue = _Queue(plan, obj, obj.ledger, fetch, failed, retry_on)
    try:
        async with asyncio.TaskGroup() as tasks:
            if plan.pinned:  # each route's own sub-flows from it, all routes at once
                own = queue.take_all()
                for route, flows in own:
                    tasks.create_task(queue.work(route, flows))
                named = {route for route, _ in own}
                for route in plan.routes:  # spares: only for what fails
                    if route not in named:
                        tasks.create_task(queue.work(route))
            else:
                for route in plan.routes:
                    tasks.create_task(queue.work(route))
    except BaseExceptionGroup as group:
        # (one sub-flow's error is the pull's; the others were cancelled for it)
        raise _first(group) from None
    if not obj.ledger.complete:
        if queue.error is not None:
            raise queue.error
        # (a plan that names no sender for some bytes: asking again finds one)
        raise PeerLost(f"pull of {obj.oid.hex()}: no sender for bytes "
                       f"{obj.ledger.missing()[:4]} (the plan named none)")
    obj.ledger = None


class _Queue:
    """A plan's sub-flows as a queue that one worker per route takes from,
    the next one whenever it is done with one: a faster sender takes more.
    (A pinned plan's workers start with their own sub-flows, on their own
    routes: one each, or with `serial` all of that route's, one after
    another; they take from the queue only what failed ones left.) A
    sender that fails, on any of its routes, is out: what its sub-flow had
    not written goes back to the front of the queue for the others, and
    its other routes leave theirs there too once done with the one in
    hand. The workers end when the queue is empty and none is pulling;
    `error` is the last failure, the pull's if some bytes were left with
    no sender to take them."""

    def __init__(self, plan: Plan, obj: StoredObject, ledger: Ledger, fetch: Fetch,
                 failed: Failed, retry_on: tuple[type[BaseException], ...]) -> None:
        self.flows = collections.deque(plan.flows)
        self.serial = plan.serial
        #: whether a worker done with its own sub-flows takes what failed ones left
        self.spares = plan.spares
        #: who takes what failed ones left all the same (`Plan.backups`)
        self.backups = {(b[0], b[1]) for b in plan.backups}
        self.obj, self.ledger, self.fetch, self.failed = obj, ledger, fetch, failed
        self.retry_on = retry_on
        self.busy = 0
        self.error: BaseException | None = None
        self.lost: set[str] = set()
        self.changed = asyncio.Condition()

    def take_all(self) -> list[tuple[Route, list[SubFlow]]]:
        """Every sub-flow, now its route's worker's own (a pinned plan): one
        worker per sub-flow, or with `serial` per route, its sub-flows in
        order. The queue keeps only what failed ones leave, and counts the
        workers as pulling."""
        flows, self.flows = list(self.flows), collections.deque()
        if self.serial:
            own: dict[Route, list[SubFlow]] = {}
            for flow in flows:
                own.setdefault(flow.route, []).append(flow)
            workers = list(own.items())
        else:
            workers = [(flow.route, [flow]) for flow in flows]
        self.busy = len(workers)
        return workers

    async def work(self, route: Route, own: Sequence[SubFlow] = ()) -> None:
        sender, address, local, path = route
        if own:  # (counted as pulling by `take_all`)
            mine = collections.deque(own)
            try:
                while mine:
                    if sender in self.lost:  # (failed on another route: for the others)
                        self.flows.extend(mine)
                        break
                    flow = mine.popleft()
                    if not await self._pull(flow, sender, mine):
                        return
            finally:
                async with self.changed:
                    self.busy -= 1
                    self.changed.notify_all()
        while self.spares or (sender, address) in self.backups:
            async with self.changed:
                await self.changed.wait_for(lambda: self.flows or not self.busy)
                if not self.flows or sender in self.lost:
                    return  # (nothing left, and nobody pulling may hand back any)
                flow = self.flows.popleft().moved(sender, address, local=local, path=path)
                self.busy += 1
            try:
                if not await self._pull(flow, sender):
                    return
            finally:
                async with self.changed:
                    self.busy -= 1
                    self.changed.notify_all()

    async def _pull(self, flow: SubFlow, sender: str, after: Sequence[SubFlow] = ()) -> bool:
        """Pull `flow`; False if it failed (its sender is out, and what it
        had not written goes back to the queue, then the sub-flows `after`
        it that were its route's own)."""
        try:
            await self.fetch(flow, FlowSink(self.obj, self.ledger, flow.start))
        except self.retry_on as exc:
            self.failed(flow, exc)
            self.error = exc
            self.lost.add(sender)
            rest = self.ledger.rest(flow)
            if rest:
                log.info("pull %s: bytes %d to %d of %s go back to the other senders",
                         self.obj.oid.hex(), rest[0].start, rest[-1].end, sender)
            self.flows.extendleft(reversed([*rest, *after]))
            return False
        return True


def _first(group: BaseExceptionGroup) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
