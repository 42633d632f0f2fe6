"""Reduces: each reduce's tree, built on the fly as its inputs arrive, its
steps, its restarts when a node or an input goes, and its result.

Owns the reduce tasks and the indexes kept with them (the unfinished ones,
which reduces wait for each input, the failures, the `reduced_inputs` asked
before their reduce). The result and the inputs are objects: they are read
and written through the objects part's methods.
"""

from __future__ import annotations

from hoplite_gpu import messages as m

from .commands import Command, Drop, InlineReduce, Reply, StartReduceStep, error_body
from .events import (
    InlineReduced,
    Key,
    NodeId,
    ReduceConfirm,
    ReducedInputs,
    ReduceFailed,
    ReduceRequested,
    StepLost,
)
from .leases import Leases
from .objects import Objects
from .reduce_plan import inorder_tree
from .reduce_task import ReduceTask, check_input, check_reduce_args, step_command, step_outputs
from .requests import Requests
from .settings import Settings


class Reduces:
    """The reduce tasks by target, and what waits on them."""

    def __init__(self, settings: Settings, leases: Leases, requests: Requests,
                 objects: Objects, instance: bytes = b"") -> None:
        self.settings = settings
        #: the live nodes (`Leases.nodes`, read here, written there only)
        self._nodes = leases.nodes
        #: the addresses of nodes with several (`Leases.rails`, read here)
        self._rails = leases.rails
        self._requests = requests
        self._objects = objects
        #: distinguishes this directory's trees from a previous incarnation's
        self.instance = instance
        self._trees = 0
        self.reduces: dict[Key, ReduceTask] = {}
        #: `reduced_inputs` asked of a target no reduce produces yet: they
        #: wait for its reduce (as a get of it waits), then on it
        self.reduce_pending: dict[Key, list[tuple[NodeId, int]]] = {}
        #: targets of reduces that may be unfinished (a superset, cleaned when
        #: met): a node's loss looks among these, not among every reduce kept
        #: for `reduced_inputs`
        self.unfinished: dict[Key, None] = {}
        #: input -> targets of reduces waiting for it
        self.watching: dict[Key, set[Key]] = {}
        #: targets whose reduce failed -> why (answers later gets at once)
        self.failed: dict[Key, str] = {}

    # ------------------------------------------------------------- events ---
    def requested(self, ev: ReduceRequested, out: list[Command]) -> None:
        old = self.reduces.get(ev.target)
        if old is not None:
            self._asked_again(old, ev, out)
            return
        problem = check_reduce_args(ev)
        if problem or self._objects.known(ev.target):
            out.append(Reply(ev.node, ev.request, error_body(
                "InvalidArgument", problem or f"object {ev.target.hex()} already exists")))
            return
        task = self.reduces[ev.target] = ReduceTask(ev.target, ev.inputs, ev.op, ev.num_objects)
        self.unfinished[ev.target] = None
        task.root_input = ev.root_input if ev.root_input in ev.inputs else None
        task.relay = ev.relay
        task.tag = self._next_tag()
        self.failed.pop(ev.target, None)
        task.waiters.extend(self.reduce_pending.pop(ev.target, ()))
        out.append(Reply(ev.node, ev.request, m.Done(ok=True)))
        for oid in ev.inputs:
            self.watching.setdefault(oid, set()).add(ev.target)
        for oid in ev.inputs:
            holder = self._objects.ready_holder(oid)
            if holder is not None:
                self._add_input(task, oid, holder, out)

    @staticmethod
    def _asked_again(old: ReduceTask, ev: ReduceRequested, out: list[Command]) -> None:
        """A reduce into a target that a reduce produces already."""
        # The same reduce, its inputs in any order (a relayed one's order
        # is its chain's: that must match).
        same = (old.inputs == ev.inputs or (not old.relay and not ev.relay
                                             and sorted(old.inputs) == sorted(ev.inputs)))
        if same and (old.op, old.k) == (ev.op, ev.num_objects) and old.failed:
            # Said now, not at the get: a late rank of a collective fails
            # fast, and a user sees how to ask again.
            out.append(Reply(ev.node, ev.request, error_body(
                "ReduceFailed", f"{old.failed} (this reduce into {ev.target.hex()} failed "
                "before; delete the target id to ask for it again)")))
        elif same and (old.op, old.k) == (ev.op, ev.num_objects):
            if old.root_input is None and ev.root_input in old.inputs:
                old.root_input = ev.root_input  # still honoured if the root is free
            out.append(Reply(ev.node, ev.request, m.Done(ok=True)))  # same reduce asked twice
        else:
            out.append(Reply(ev.node, ev.request, error_body(
                "ObjectExists", f"a different reduce already produces {ev.target.hex()}")))

    def step_failed(self, ev: ReduceFailed, out: list[Command]) -> None:
        task = self.reduces.get(ev.target)
        if task is not None and not self._stale(task, ev.tag):
            self._fail(task, ev.message, out)

    def inline_reduced(self, ev: InlineReduced, out: list[Command]) -> None:
        task = self.reduces.get(ev.target)
        if task is None or task.failed or self._objects.known(ev.target) or task.layout is None:
            return
        self._objects.add_inline(ev.target, task.size, task.layout, ev.data)
        self._finish(task, out)
        self._objects.serve_pending(ev.target, out)
        self.input_ready(ev.target, "", out)

    def reduced_inputs(self, ev: ReducedInputs, out: list[Command]) -> None:
        task = self.reduces.get(ev.target)
        removed = task is None and self._objects.removed(ev.target)
        if task is None and (removed or self._objects.known(ev.target)):
            out.append(Reply(ev.node, ev.request, error_body(
                "ObjectNotFound", f"no reduce produces {ev.target.hex()}"
                + (" (it was deleted or lost)" if removed else
                   " (it is an object that was put)"))))
        elif task is None and not ev.wait:
            out.append(Reply(ev.node, ev.request, error_body(
                "ObjectNotFound", f"no such reduce: nobody asked for a reduce producing "
                f"{ev.target.hex()}")))
        elif task is None:  # (its reduce not asked for yet: waits for it, as a get does)
            self.reduce_pending.setdefault(ev.target, []).append((ev.node, ev.request))
            self._requests.wait(ev.node, ev.request, "reduce", ev.target)
        elif task.failed:
            out.append(Reply(ev.node, ev.request, error_body("ReduceFailed", task.failed)))
        elif task.done:
            task.told = True
            out.append(Reply(ev.node, ev.request, m.Inputs(inputs=task.chosen)))
        elif not ev.wait:
            out.append(Reply(ev.node, ev.request, error_body(
                "Timeout", f"the reduce producing {ev.target.hex()} is not done: "
                f"{min(len(task.slots), task.k)} of its {task.k} inputs have come")))
        else:  # answered when the result is complete: a failover may still change the set
            task.waiters.append((ev.node, ev.request))
            self._requests.wait(ev.node, ev.request, "reduce", ev.target)

    def confirm(self, ev: ReduceConfirm, out: list[Command]) -> None:
        task = self.reduces.get(ev.target)
        if task is None:  # deleted (or never a tree reduce): nothing can replace the copy
            out.append(Reply(ev.node, ev.request, m.Current(current=True)))
        elif task.failed:
            out.append(Reply(ev.node, ev.request, error_body("ReduceFailed", task.failed)))
        elif task.tag != ev.tag:
            out.append(Reply(ev.node, ev.request, m.Current(current=False)))
        elif task.done:
            out.append(Reply(ev.node, ev.request, m.Current(current=True)))
        else:  # the root's completion may still lose the race with a failover
            task.confirms.append((ev.node, ev.request))
            self._requests.wait(ev.node, ev.request, "reduce", ev.target)

    def step_lost(self, ev: StepLost, out: list[Command]) -> None:
        task = self.reduces.get(ev.target)
        if task is not None and not task.done and not task.failed and not self._stale(task, ev.tag):
            self.restart(task, f"a step lost a child stream: {ev.message}", out)

    def unqueue(self, request: tuple[NodeId, int], target: Key) -> None:
        """`request` (a `reduced_inputs` or a confirm of `target`) waits no more."""
        task = self.reduces.get(target)
        for waiters in (task and task.confirms, task and task.waiters,
                        self.reduce_pending.get(target)):
            if waiters and request in waiters:
                waiters.remove(request)
        if target in self.reduce_pending and not self.reduce_pending[target]:
            del self.reduce_pending[target]

    # ------------------------------------------- what the objects part asks ---
    def making(self, oid: Key) -> bool:
        """Whether an unfinished reduce makes `oid`."""
        task = self.reduces.get(oid)
        return task is not None and not (task.done or task.failed)

    def steps_on(self, oid: Key, node: NodeId) -> bool:
        """Whether the reduce making `oid` has a tree position on `node`."""
        task = self.reduces.get(oid)
        return task is not None and any(n == node for _, n in task.slots)

    def knows(self, oid: Key) -> bool:
        """Whether a reduce (of any state) was asked to make `oid`."""
        return oid in self.reduces

    def failure(self, oid: Key) -> str | None:
        """Why the reduce making `oid` failed (None: it did not)."""
        return self.failed.get(oid)

    def stale_result(self, oid: Key, tag: bytes | None) -> bool:
        """Whether a complete copy of `oid` from tree `tag`, of a node this
        directory lists as a holder (the current tree's root, or a reader of
        it), is not the current tree's result: a rebuilt tree's root (on
        this node too), or a tree of the directory before this one (a
        restart, a standby) whose root step ran where this tree's root step
        now runs, and which that step replaces (`Steps.start`). As
        `confirm` answers, any other tree's copy is not this one's."""
        task = self.reduces.get(oid)
        return (task is not None and not task.done and tag is not None and tag != task.tag
                and len(tag) == len(task.tag))

    def result_complete(self, oid: Key, out: list[Command]) -> None:
        """The node that made `oid` (its putter, or its tree's root) completed it."""
        task = self.reduces.get(oid)
        if task is not None and not task.done:
            self._finish(task, out)
            self._drop_steps(task, out)

    def remake(self, oid: Key, out: list[Command]) -> bool:
        """`oid`, a finished tree reduce's result, was lost: its root's node
        died before any other node held a whole copy. Made again from the
        inputs that still have a live holder (its readers, told to retry,
        wait for the new tree), if at least `k` do and nobody has heard which
        inputs it held (a new tree may take others). Whether it is."""
        task = self.reduces.get(oid)
        if task is None or not task.done or task.failed or task.inline or task.told:
            return False
        alive = sum(self._objects.ready_holder(i) is not None for i in task.inputs)
        if alive < task.k:
            return False
        task.done = False
        self.unfinished[oid] = None
        for i in task.inputs:
            self.watching.setdefault(i, set()).add(oid)
        self.restart(task, "its result was lost before any other node held a whole copy", out)
        return True

    def needs_input(self, oid: Key) -> bool:
        """Whether an unfinished reduce waits for input `oid`."""
        return any(task is not None and not (task.done or task.failed)
                   for task in map(self.reduces.get, self.watching.get(oid, ())))

    def supersede(self, oid: Key, out: list[Command]) -> None:
        """A node announced a complete copy of an unfinished reduce's target
        (to a restarted directory: a result made before the restart, while
        the reduce was asked again), or put the id, before the tree made it:
        that object is the result. The reduce is forgotten, as if it had been
        asked after the object existed: its partial results go, and whoever
        waits for its inputs hears they are unknown here."""
        task = self.reduces.get(oid)
        if task is None or task.done or task.failed:
            return
        del self.reduces[task.target]
        self.unfinished.pop(task.target, None)
        self._forget_watch(task)
        message = (f"the inputs of the reduce into {task.target.hex()} are unknown to this "
                   "directory: the object was announced (or put) before the reduce finished "
                   "here, e.g. after a directory restart")
        for node, request in task.waiters:
            out.append(Reply(node, request, error_body("ObjectNotFound", message)))
        self._answer_confirms(task, True, out)  # the announced copy is final
        self._end_all_steps(task, message, out)

    def deleted(self, oid: Key, out: list[Command]) -> None:
        """`oid` was deleted (its entry removed already): the reduce making
        it ends with it, and who waits to learn its inputs hears."""
        # (a long job deletes one result per step: nothing left behind)
        task = self.reduces.pop(oid, None)
        self.unfinished.pop(oid, None)
        if task is not None:
            self._forget_watch(task)
            if not (task.done or task.failed):
                # The reduce making it ends with it: its waiters hear, its
                # partial results go (the root's copy goes with the entry's).
                self._fail(task, f"object {oid.hex()} was deleted while a reduce "
                           "was making it", out, kind="ObjectNotFound")
            self.failed.pop(oid, None)
        for node, request in self.reduce_pending.pop(oid, ()):
            out.append(Reply(node, request, error_body(
                "ObjectNotFound", f"object {oid.hex()} was deleted before a reduce made it")))

    def slot_lost(self, oid: Key, node: NodeId, why: str, out: list[Command]) -> None:
        """`node` no longer holds `oid`: an unfinished tree that took it from
        there is rebuilt (its step would wait for the input to come back, a
        leaf's parent up to `timeout_s`), with a backup input if there is one."""
        # (unfinished reduces are exactly those watching their inputs)
        for task in [self.reduces.get(t) for t in sorted(self.watching.get(oid, ()))]:
            if (task is not None and not (task.done or task.failed or task.inline)
                    and (oid, node) in task.slots):
                self.restart(task, why, out)

    def input_ready(self, oid: Key, node: NodeId, out: list[Command]) -> None:
        """`node` holds a complete copy of `oid`: reduces waiting for it take it."""
        for target in sorted(self.watching.get(oid, ())):
            task = self.reduces.get(target)
            if task is not None:
                self._add_input(task, oid, node, out)

    # ----------------------------------------------------------- liveness ---
    def hit_by(self, node: NodeId) -> list[ReduceTask]:
        """Unfinished tree reduces with a slot, or the result's root, on `node`."""
        hit = []
        for target in list(self.unfinished):
            task = self.reduces.get(target)
            if task is None or task.done or task.failed or task.inline:
                del self.unfinished[target]
                continue
            if any(host == node for _, host in task.slots):
                hit.append(task)
        return hit

    def restart(self, task: ReduceTask, why: str, out: list[Command]) -> None:
        """Rebuild the tree from the inputs that still have a live holder.

        Every partial result may include the lost branch, so all of them go: the
        steps' outputs, the result's root and the readers' partial copies (told
        to retry, so their gets start over when the new root exists).
        """
        task.restarts += 1
        if task.restarts > 2 * len(task.inputs) + 5:
            self._fail(task, f"gave up after {task.restarts - 1} restarts; last: {why}", out)
            return
        reason = f"the reduce into {task.target.hex()} restarts: {why}"
        self._answer_confirms(task, False, out)  # copies of this tree are superseded
        self._end_all_steps(task, reason, out)
        self._objects.withdraw(task.target, reason, out)
        order = [*task.chosen, *task.backups]
        task.slots, task.at, task.backups, task.started = [], {}, [], set()
        task.folded, task.phases, task.whole = {}, {}, set()
        task.placed = set()
        task.tag = self._next_tag()
        for oid in order:
            holder = self._objects.ready_holder(oid)
            if holder is not None:
                self._add_input(task, oid, holder, out)

    # --------------------------------------------------------------- tree ---
    def _add_input(self, task: ReduceTask, oid: Key, node: NodeId, out: list[Command]) -> None:
        if task.failed or oid in task.placed:
            return
        if len(task.slots) >= task.k:
            task.backups.append(oid)
            task.placed.add(oid)
            return
        entry = self._objects.entry(oid)
        problem = check_input(task, oid, entry, self.settings)
        if problem:
            self._fail(task, problem, out)
            return
        pos = task.place(oid)
        task.at[pos] = len(task.slots)
        task.slots.append((oid, node))
        task.placed.add(oid)
        if task.inline:
            task.inline_data.append(entry.inline or b"")
            if len(task.slots) == task.k:
                out.append(InlineReduce(task.target, task.op, task.layout or {},
                                        tuple(task.inline_data)))
            return
        # The new position, and the parent of each subtree it completed,
        # can have become startable.
        # Walk up only through the subtrees this arrival completes (each
        # completes once: O(k·d) for a whole tree, not O(depth) per input,
        # which is O(k) on a chain).
        parent, children = inorder_tree(task.k, task.degree)
        candidates, at = [pos], pos
        while (at is not None and at in task.at
               and all(c in task.whole for c in children[at])):
            task.whole.add(at)
            at = parent[at]
            if at is not None:
                candidates.append(at)
        self._start_ready_steps(task, out, tuple(candidates))

    def _start_ready_steps(self, task: ReduceTask, out: list[Command],
                           candidates: tuple[int, ...]) -> None:
        """Start each of `candidates` (tree positions) whose input and children's
        subtrees have arrived. A position whose input is in while only some
        of its children's subtrees are gets an early step for those: it
        folds them ahead into a partial result of its own, and the next step
        there takes that as its input. Otherwise a wide node would pull every
        child's stream only once its last child came: `d·S/B` after a late
        input at each level, where a chain needs `S/B`; folded ahead, the last
        child's stream is the one left. A child is folded only once its
        whole subtree is in, so a step never waits on inputs that have not
        arrived (which may take longer than any deadline), only on bytes."""
        parent, children = inorder_tree(task.k, task.degree)
        for pos in sorted(set(candidates)):
            if pos not in task.at or pos in task.started:
                continue
            folded = task.folded.get(pos, ())
            fresh = [c for c in children[pos] if c in task.whole and c not in folded]
            is_root = parent[pos] is None
            if len(fresh) + len(folded) < len(children[pos]):
                if fresh:  # some arrived, others not: fold these ahead
                    out.append(StartReduceStep(task.slot(pos)[1],
                                               step_command(task, pos, fresh, self._nodes,
                                                            rails=self._rails)))
                    task.folded.setdefault(pos, []).extend(fresh)
                    task.phases[pos] = task.phases.get(pos, 0) + 1
                continue
            if children[pos] or is_root:
                task.started.add(pos)
                out.append(StartReduceStep(task.slot(pos)[1], step_command(
                    task, pos, fresh, self._nodes, final=True, rails=self._rails)))
            if is_root:
                self._register_result(task, task.slot(pos)[1], out)

    def _register_result(self, task: ReduceTask, node: NodeId, out: list[Command]) -> None:
        """The root's output is the target object: readable (pipelined) while it is reduced."""
        relay = None
        if task.relay:
            hosts = dict(task.slots)
            order = [node] + [hosts[i] for i in task.inputs if i in hosts]
            relay = tuple(dict.fromkeys(order))  # each node once, the root first
        self._objects.register_result(task.target, task.size, task.layout or {}, node, relay, out)

    # ------------------------------------------------------------ endings ---
    def _stale(self, task: ReduceTask, tag: bytes | None) -> bool:
        """Whether a message about `task` came from a tree this directory has
        since rebuilt (its steps were dropped, but the message crossed the
        drop). Tags of another directory (before a restart) are not stale
        here: what they report is all there is to go on."""
        return (tag is not None and tag != task.tag
                and tag[:len(self.instance)] == self.instance and len(tag) == len(task.tag))

    def _next_tag(self) -> bytes:
        self._trees += 1
        return self.instance + self._trees.to_bytes(8, "big")

    def _finish(self, task: ReduceTask, out: list[Command]) -> None:
        task.done = True
        self.unfinished.pop(task.target, None)
        self._forget_watch(task)  # (a re-put input must not join a finished reduce)
        task.told = task.told or bool(task.waiters)
        for waiter, request in task.waiters:
            out.append(Reply(waiter, request, m.Inputs(inputs=task.chosen)))
        task.waiters.clear()
        self._answer_confirms(task, True, out)

    @staticmethod
    def _answer_confirms(task: ReduceTask, current: bool, out: list[Command]) -> None:
        for node, request in task.confirms:
            out.append(Reply(node, request, m.Current(current=current)))
        task.confirms.clear()

    def _fail(self, task: ReduceTask, message: str, out: list[Command],
              kind: str = "ReduceFailed") -> None:
        if task.failed:
            return
        task.failed = self.failed[task.target] = message
        self.unfinished.pop(task.target, None)
        self._forget_watch(task)
        for node, request in [*task.waiters, *task.confirms]:
            out.append(Reply(node, request, error_body(kind, message)))
        task.waiters.clear()
        task.confirms.clear()
        self._objects.fail_result(task.target, message, kind, out)
        self._end_all_steps(task, message, out)

    def _drop_steps(self, task: ReduceTask, out: list[Command]) -> None:
        """The result is complete: intermediate partial results can go."""
        for pos, oid in step_outputs(task):
            if pos in task.at:
                self._drop_partial(task.slot(pos)[1], oid,
                                   "the reduce finished; its partial results are freed", out)
        self._forget_watch(task)

    def _end_all_steps(self, task: ReduceTask, message: str, out: list[Command]) -> None:
        """Every started step of `task` ends, its partial result dropped."""
        for pos, oid in step_outputs(task):
            self._drop_partial(task.slot(pos)[1], oid, message, out)

    def _drop_partial(self, node: NodeId, oid: Key, reason: str, out: list[Command]) -> None:
        """A reduce step's output on `node` goes. A node declared dead may be
        alive and come back: it would announce that output as an object of
        its own, kept for good; remembered as gone, the announcement is
        answered with a drop instead."""
        if node in self._nodes:
            out.append(Drop(node, oid, reason))
        else:
            self._objects.remove_entry(oid)

    def _forget_watch(self, task: ReduceTask) -> None:
        for oid in task.inputs:
            targets = self.watching.get(oid)
            if targets is not None:
                targets.discard(task.target)
                if not targets:
                    del self.watching[oid]
