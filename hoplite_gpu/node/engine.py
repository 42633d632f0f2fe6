"""The pull engine: runs a `Plan`'s sub-flows into one object's buffer.

Each sub-flow writes its range in place. A plan of one sub-flow that starts
at the object's watermark (today's pull) records its bytes in the watermark
itself, as it always did: no ledger, no task. A plan of several runs one task
per sub-flow in a task group and records every piece in the object's
`Ledger`, whose prefix moves the watermark (so a partial copy is relayed as
it fills). A sub-flow that fails is reported, and what it had not written yet
moves to another of the plan's senders; with none left the failure is the
pull's, and the caller asks the directory again (the ledger stays with the
object, so the next plan pulls only what is missing).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from .plan import Ledger, Plan, SubFlow, next_sender
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
            self.obj.advance(prefix)


def plan_for(obj: StoredObject, sender: str, address: str) -> Plan:
    """The plan that fills what `obj` still misses from one sender: today's
    pull (from the watermark on), or, after a plan of several sub-flows
    failed, each range its ledger lacks."""
    if obj.ledger is None:
        return Plan.single(obj.oid, obj.size, sender, address, start=obj.ready)
    return Plan(obj.oid, obj.size, tuple(SubFlow(a, b, sender, address)
                                         for a, b in obj.ledger.missing()))


async def run_plan(plan: Plan, obj: StoredObject, fetch: Fetch, failed: Failed,
                   retry_on: tuple[type[BaseException], ...]) -> None:
    """Fill `obj` as `plan` says. `fetch` pulls one sub-flow; an error of a
    `retry_on` type is a sub-flow's failure (`failed` hears of it), others
    end the pull at once. Raises the failure that left a sub-flow no sender."""
    flows = plan.flows
    if len(flows) == 1 and obj.ledger is None and flows[0].start == obj.ready:
        # Today's pull: the watermark is the only record, no task in between.
        try:
            await fetch(flows[0], obj)
        except retry_on as exc:
            failed(flows[0], exc)
            raise
        return
    if obj.ledger is None:
        obj.ledger = Ledger(obj.size, obj.ready)
    ledger, lost = obj.ledger, set()
    try:
        async with asyncio.TaskGroup() as tasks:
            for flow in flows:
                tasks.create_task(_run_flow(plan, flow, obj, ledger, fetch, failed, retry_on, lost))
    except BaseExceptionGroup as group:
        # (one sub-flow's error is the pull's; the others were cancelled for it)
        raise _first(group) from None
    if ledger.complete:
        obj.ledger = None


async def _run_flow(plan: Plan, flow: SubFlow, obj: StoredObject, ledger: Ledger, fetch: Fetch,
                    failed: Failed, retry_on: tuple[type[BaseException], ...],
                    lost: set[str]) -> None:
    """One sub-flow, and whatever of it fails over to other senders."""
    pending = [flow]
    while pending:
        flow = pending.pop(0)
        try:
            await fetch(flow, FlowSink(obj, ledger, flow.start))
            continue
        except retry_on as exc:
            failed(flow, exc)
            lost.add(flow.sender)
            rest = ledger.rest(flow)
            if not rest:
                continue  # (it failed after its last byte was in)
            to = next_sender(plan, lost)
            if to is None:
                raise
            log.info("pull %s: bytes %d to %d move from %s to %s", obj.oid.hex(),
                     rest[0].start, rest[-1].end, flow.sender, to[0])
            pending[:0] = [piece.moved(*to) for piece in rest]


def _first(group: BaseExceptionGroup) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
