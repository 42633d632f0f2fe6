"""Sub-flows on this node's ways: each connection starts where its route
says (a rail of this node, a source port of an ECMP path: `ways.Ways.bind`)
and is told to the directory once (`ways.Ways.tell`). A get's pull and a
reduce step's pull of a child both fetch their sub-flows here; a child is
pulled whole by `pull_child`, over the same ways as a get's pull
(docs/fabric.md, "Rails and paths")."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence

from hoplite_gpu import messages as m
from hoplite_gpu.config import Config
from hoplite_gpu.errors import ObjectNotFound, PeerLost, ProtocolError, Timeout, TransportError
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.transports import Stream

from .engine import plan_for, run_plan
from .plan import Route, SubFlow
from .pull_modes import Sink
from .store import StoredObject
from .transfer import PeerPool, fetch_range
from .ways import Ways

log = logging.getLogger("hoplite_gpu.node")

#: What a pull's sender may fail with: the pull reports it and asks again (a
#: peer that sends what we cannot read is as good as lost).
PEER_FAILURES = (TransportError, Timeout, ObjectNotFound, PeerLost, ProtocolError)


def _quiet(_pos: int) -> None:
    """A child's pull tells nobody how far it got (its step's output does)."""


class Flows:
    """Fetches sub-flows over this node's `ways`, through its connection
    `pool`; `post` sends the directory a notice."""

    def __init__(self, pool: PeerPool, config: Config, ways: Ways,
                 post: Callable[[m.Message], None]) -> None:
        self.pool, self.config, self.ways, self._post = pool, config, ways, post

    async def fetch(self, obj: StoredObject, flow: SubFlow, sink: Sink,
                    progress: Callable[[int], None], about: ObjectID | None = None) -> None:
        """Pull `flow`'s bytes of `obj` into `sink`, on a connection from
        where its route says; the directory hears of that connection (as
        one of a pull of `about`, default `obj`'s id) once."""
        bind = self.ways.bind(flow)
        await fetch_range(self.pool, flow.address, obj, flow.end, self.config, progress,
                          start=flow.start, sink=sink, message=flow.piece, bind=bind,
                          opened=None if bind is None else functools.partial(
                              self._opened, obj.oid, flow, about))

    def _opened(self, oid: ObjectID, flow: SubFlow, about: ObjectID | None,
                stream: Stream) -> None:
        notice = self.ways.tell(oid, flow, stream, about)
        if notice is not None:
            self._post(notice)

    async def pull_child(self, obj: StoredObject, sender: str, address: str,
                         rails: Mapping[str, Sequence[str]], about: ObjectID) -> None:
        """Fill `obj` (a reduce step's copy of a child's stream) from
        `sender` at `address` (`rails`: its addresses, where it has
        several), split over this node's rails and paths as a get's pull
        of that size would be (`Ways.routes`, `plan_for`). A sub-flow that
        fails has its rail pair or path left out, and what is still
        missing goes over the routes left, at once: a cut path costs the
        step nothing. Once every route of a plan failed (the sender is
        lost), that error is raised: the step's. The connections are told
        as a pull of `about` (the reduce's target)."""
        oid = obj.oid
        try:
            while True:
                missing = obj.size - (obj.ready if obj.ledger is None else obj.ledger.written)
                routes, held = self.ways.routes(oid, missing, [(sender, address)], rails)
                plan = plan_for(obj, sender, address, routes=routes)
                broken: set[Route] = set()

                def failed(flow: SubFlow, exc: BaseException, broken: set = broken) -> None:
                    self.ways.failed(oid, flow)
                    broken.add(flow.route)
                    log.info("pull of %s from %s on %s failed: %s", oid.hex(), sender,
                             flow.route[2:], exc)

                try:
                    await run_plan(plan, obj, lambda flow, sink: self.fetch(
                        obj, flow, sink, _quiet, about), failed, PEER_FAILURES)
                    return
                except PEER_FAILURES:
                    if broken >= set(plan.routes):
                        raise
                finally:
                    self.ways.release(held)
        finally:
            self.ways.forget(oid)
