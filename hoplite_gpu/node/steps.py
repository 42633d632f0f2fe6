"""The reduce steps a node runs (pushed by the directory), and the reduces it
asked for, which it asks again of a restarted directory."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, NamedTuple

from hoplite_gpu import messages as m
from hoplite_gpu.config import Config
from hoplite_gpu.errors import (
    DirectoryUnavailable,
    ObjectNotFound,
    PeerLost,
    ProtocolError,
    StoreFull,
    Timeout,
    TransportError,
)
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.values import Layout

from .holdings import complete_msg
from .reducer import run_step
from .retry import Retry
from .store import ChunkStore, StoredObject
from .tasks import TaskSet
from .transfer import PeerPool

log = logging.getLogger("hoplite_gpu.node")

#: Pull all of a copy from a sender (its address, its rails) over the node's
#: ways, told to the directory as a pull of a reduce's target
#: (`flows.Flows.pull_child`).
PullOver = Callable[[StoredObject, str, str, Mapping[str, Sequence[str]], ObjectID],
                    Awaitable[None]]
#: Reduces this node asked for that it re-asks a restarted directory, at most.
MAX_REMEMBERED_REDUCES = 4096


class _Step(NamedTuple):
    """A reduce step running here: its task and its command."""

    task: asyncio.Task
    msg: m.ReduceStep


class Steps:
    """Runs each `reduce_step` the directory pushes as a task of its own (a
    newer step for the same output replaces it), and remembers the reduces
    this node asked for. `post` and `request` reach the directory; `make_room`
    evicts for a step's output; `forgot_since(oid, count)`: whether `oid` was
    forgotten here after the node's `forgets` was `count`; `pull_child`
    pulls a child's stream over the node's rails and paths
    (`flows.Flows.pull_child`)."""

    def __init__(self, store: ChunkStore, pool: PeerPool, config: Config, node_id: str, *,
                 post: Callable[[m.Message], None],
                 request: Callable[[Any, float], Awaitable[m.Body]],
                 make_room: Callable[[int, str], Awaitable[int]],
                 forgot_since: Callable[[ObjectID, int], bool],
                 pull_child: PullOver | None = None) -> None:
        self.store, self.pool, self.config, self.node_id = store, pool, config, node_id
        self._post, self._request = post, request
        self._make_room, self._forgot_since = make_room, forgot_since
        self._pull_child = pull_child
        #: reduce steps running here, by the object they produce
        self._steps: dict[ObjectID, _Step] = {}
        #: reduces this node asked for, re-sent to a restarted directory
        self._my_reduces: dict[ObjectID, m.Reduce] = {}
        self._tasks = TaskSet()
        self._closed = False

    @property
    def running(self) -> Mapping[ObjectID, _Step]:
        """The steps running here, by the object each produces (read only)."""
        return self._steps

    @property
    def remembered(self) -> Mapping[ObjectID, m.Reduce]:
        """The reduces a restarted directory is asked again (read only)."""
        return self._my_reduces

    def making(self, oid: ObjectID) -> bool:
        """Whether a step here produces `oid`."""
        return oid in self._steps

    def busy(self) -> set[ObjectID]:
        """Objects the steps running here read or write: none may be evicted."""
        busy = set(self._steps)
        for _, step in self._steps.values():
            busy.add(ObjectID(step.input))
            busy.update(ObjectID(child.oid) for child in step.children)
        return busy

    def close(self) -> list[asyncio.Task]:
        """Stop every step: the cancelled tasks, for the node to await."""
        self._closed = True
        return self._tasks.cancel()

    def forget(self, oid: ObjectID, reason: BaseException) -> None:
        """`oid` ends here: its step stops, and (unless it is being rebuilt)
        the reduce making it is not asked for again."""
        if not isinstance(reason, Retry):
            self._my_reduces.pop(oid, None)  # deleted, failed or lost: nothing to ask for
        step = self._steps.pop(oid, None)
        if step is not None:
            step.task.cancel(str(reason))

    def settled(self, oid: ObjectID) -> None:
        """A final copy of a reduce's result is here: a restarted directory
        learns of it from its holders, so the reduce need not be asked again."""
        self._my_reduces.pop(oid, None)

    def announce(self, client: Any) -> None:
        """Ask a new directory again for the reduces this node asked for."""
        for msg in self._my_reduces.values():
            client.start(msg)  # "already exists" answers are fine: nobody waits

    # ------------------------------------------------------------- asking ---
    async def reduce(self, inputs: list[ObjectID], op: str, num_objects: int,
                     target: ObjectID, root_input: ObjectID | None = None,
                     relay: bool = False) -> ObjectID:
        msg = self.reduce_msg(inputs, op, num_objects, target, root_input, relay)
        # Remembered first: a call given up while the answer was on its way
        # may have started the reduce, which a restarted directory must hear of.
        before = self._my_reduces.get(target)
        self.remember_reduce(target, msg)
        try:
            await self._request(msg, self.config.timeout_s)
        except (asyncio.CancelledError, Timeout, DirectoryUnavailable):
            raise
        except BaseException:  # refused: nothing new to ask again
            if self._my_reduces.get(target) is msg:
                del self._my_reduces[target]
                if before is not None:
                    self._my_reduces[target] = before
            raise
        return target

    @staticmethod
    def reduce_msg(inputs: list[ObjectID], op: str, num_objects: int, target: ObjectID,
                   root_input: ObjectID | None = None, relay: bool = False) -> m.Reduce:
        return m.Reduce(rid=0, target=target.binary, inputs=[i.binary for i in inputs],
                        op_name=op, num_objects=num_objects,
                        root_input=None if root_input is None else root_input.binary, relay=relay)

    def remember_reduce(self, target: ObjectID, msg: m.Reduce, since: int | None = None) -> None:
        """Ask `msg` again of a restarted directory, until this node sees the
        final result, deletes it or hears it dropped; the oldest are forgotten
        past MAX_REMEMBERED_REDUCES (a rank that never reads the result, as a
        non-root of `collectives.reduce`, would otherwise grow this forever).
        `since`: see `Node.keep_inline`."""
        if since is not None and self._forgot_since(target, since):
            return  # deleted or dropped since it was asked: nothing to ask again
        self._my_reduces[target] = msg
        while len(self._my_reduces) > MAX_REMEMBERED_REDUCES:
            del self._my_reduces[next(iter(self._my_reduces))]

    async def reduced_inputs(self, target: ObjectID, timeout: float) -> list[ObjectID]:
        try:
            body = await self._request(m.ReducedInputs(rid=0, target=target.binary), timeout)
        except Timeout:
            body = await self._why_not_done(target, timeout)
        # Done: its result's holder announces it to a restarted directory, so
        # it need not be asked for again (a non-root rank of a collective
        # reduce never holds the result, and is not the one that deletes it).
        self._my_reduces.pop(target, None)
        return [ObjectID(i) for i in body.inputs]

    async def _why_not_done(self, target: ObjectID, timeout: float) -> m.Body:
        """After `reduced_inputs` of `target` waited `timeout` seconds: the
        directory's word, at once, on why (no such reduce; so many inputs
        came), raised as the Timeout; its answer if the reduce has just ended."""
        what = f"reduced_inputs({target.hex()}, timeout={timeout:g})"
        try:
            return await self._request(
                m.ReducedInputs(rid=0, target=target.binary, wait=False),
                min(timeout, self.config.connect_timeout_s))
        except (Timeout, ObjectNotFound) as exc:
            raise Timeout(f"{what}: {exc}") from None

    # ------------------------------------------------------------ running ---
    def start(self, msg: m.ReduceStep) -> None:
        """A `reduce_step` push: run it, in place of an older step for its output."""
        out = ObjectID(msg.output)
        old = self._steps.pop(out, None)
        if old is not None:
            old.task.cancel("replaced by a new step")
        stale = self.store.get(out)
        # (A first step into memory set aside by `receive_into` keeps it.)
        fresh = stale is not None and stale.receiving and old is None and not stale.ready
        # The target's id is the same in every tree: a copy made here by an
        # earlier tree's root step (this node was declared dead meanwhile,
        # and the step finished all the same) holds other inputs, complete
        # or not, and must not be taken for this step's output.
        earlier = (stale is not None and out.binary == msg.target
                   and stale.reduce_tag is not None and stale.reduce_tag != msg.tag)
        if stale is not None and (not stale.complete or earlier) and not fresh:
            # a partial result of an earlier tree (e.g. before a directory restart)
            # may hold other inputs: start over; its readers ask again
            self.store.remove(out, Retry("the reduce restarted"))
        task = self._tasks.spawn(self._run(msg))
        self._steps[out] = _Step(task, msg)
        task.add_done_callback(lambda t, out=out: self._step_done(out, t))

    def _pull(self, target: ObjectID, child: m.StepChild, copy: StoredObject) -> Awaitable[None]:
        """A child of a step of the reduce making `target`, pulled into `copy`."""
        sender = child.node or child.address
        return self._pull_child(copy, sender, child.address,
                                {sender: child.rails} if child.rails else {}, target)

    def _step_done(self, out: ObjectID, task: asyncio.Task) -> None:
        step = self._steps.get(out)
        if step is not None and step.task is task:
            del self._steps[out]

    async def _run(self, step: m.ReduceStep) -> None:
        if self._closed:
            return
        target = step.target
        try:
            await self._room_for(step)
            out = await run_step(step, self.store, self.pool, self.config, self.config.timeout_s,
                                 None if self._pull_child is None else functools.partial(
                                     self._pull, ObjectID(step.target)))
        except asyncio.CancelledError:
            raise
        except (TransportError, PeerLost, Timeout, ObjectNotFound, ProtocolError) as exc:
            # a child died or stalled: the directory rebuilds the tree without it
            log.info("reduce step for %s lost a child: %r", target.hex(), exc)
            self._drop_unfinished(step)
            self._post(m.StepLost(target=target, tag=step.tag,
                                  message=f"on node {self.node_id}: {type(exc).__name__}: {exc}"))
            return
        except Exception as exc:  # any other failure must reach every waiter, not vanish here
            log.warning("reduce step for %s failed: %r", target.hex(), exc)
            self._drop_unfinished(step)
            self._post(m.ReduceFailed(target=target, tag=step.tag,
                                      message=f"a reduce step on node {self.node_id} failed: "
                                              f"{type(exc).__name__}: {exc}"))
            return
        if step.early:
            # Its input was this position's early result, read by this step
            # only: free it now rather than when the whole reduce ends.
            self.store.remove(ObjectID(step.input), ObjectNotFound(
                f"partial result {step.input.hex()} was folded into the next one"))
        if out.oid.binary == target:
            self._post(complete_msg(out))
        else:  # an intermediate result: its parent is already pulling it
            self._post(m.Complete(oid=out.oid.binary))

    def _drop_unfinished(self, step: m.ReduceStep) -> None:
        """A failed step's output, if it is half made: nothing will finish it.
        Its readers (a get here waiting on its watermark, a parent pulling
        it) ask again. The directory drops it too when it rebuilds the tree,
        but not on a node it has declared dead meanwhile, whose step may fail
        only after it is back: such a copy would be kept, and taken by this
        node's own gets for a put under way, for good."""
        out = ObjectID(step.output)
        obj, mine = self.store.get(out), self._steps.get(out)
        if (obj is not None and not obj.complete and not obj.receiving
                and mine is not None and mine.msg is step):  # (not a newer step's)
            self.store.remove(out, Retry("its reduce step failed"))

    async def _room_for(self, step: m.ReduceStep) -> None:
        """Evict, as a get would, for the output a reduce step is about to
        make (it makes it as soon as it starts, with no await between).
        Nothing to do for a leaf (its output shares its input's buffer), an
        output already here, or device memory. Where no eviction makes room
        the step goes over the limit: failing would fail the reduce for every
        rank over one node's cache, and later calls evict again."""
        layout = Layout.from_wire(step.layout)
        leaf = not step.children and not step.count
        if (leaf or not self.store.on_host(layout)
                or self.store.get(ObjectID(step.output)) is not None):
            return
        try:
            await self._make_room(layout.nbytes, "a reduce step")
        except StoreFull as exc:
            log.info("reduce step for %s goes over the store limit: %s",
                     ObjectID(step.output).hex(), exc)
