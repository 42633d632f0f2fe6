"""The reduces part (`reduces.Reduces`) through the directory, fed reduce
events and what a reduce needs around it: reduce requests (trees, relayed
chains, inline ones), inputs put and completed, root steps finishing, steps
failing or losing a child, `reduced_inputs` and confirms, deletes of inputs
and targets, node losses.

A hypothesis state machine checks after every step the part's own
invariants: an unfinished reduce is listed as such and watches each of its
inputs, a finished or failed one watches none; a tree holds at most `k`
inputs, each position once, every input placed at most once and only its
own; a finished reduce chose exactly `k`; only started positions' steps ran
and only filled ones; the failures kept are exactly the failed tasks'; every
request waiting on a reduce is booked under its node; each tree's tag is
this directory's and no two trees share one.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hoplite_gpu.directory.reduce_plan import inorder_tree
from hoplite_gpu.directory.state import (
    Completed,
    Delete,
    Directory,
    InlineReduce,
    InlineReduced,
    NodeJoined,
    NodeLost,
    Put,
    ReduceConfirm,
    ReducedInputs,
    ReduceFailed,
    ReduceRequested,
    StepLost,
)

NODES = [f"n{i}" for i in range(5)]
ARRAY = {"kind": "numpy", "dtype": "<f4", "shape": [1 << 18], "nbytes": 1 << 20}
SCALAR = {"kind": "numpy", "dtype": "<f4", "shape": [1], "nbytes": 4}
INPUTS = [bytes([10 + i]) * 20 for i in range(5)]
SMALL_INPUTS = [bytes([20 + i]) * 20 for i in range(3)]  # put inline
TARGETS = [bytes([90 + i]) * 20 for i in range(2)]
INSTANCE = b"dir-1"


class ReducesMachine(RuleBasedStateMachine):
    @initialize(latency=st.sampled_from([1e-2, 1e-2, 1e-4]))
    def setup(self, latency: float) -> None:
        self.d = Directory(latency_s=latency, instance=INSTANCE)
        self.alive: list[str] = []
        self.rid = 0
        self.tags: set[bytes] = set()
        for node in NODES:
            self.join(node)

    def r(self) -> int:
        self.rid += 1
        return self.rid

    def someone(self, i: int) -> str:
        return self.alive[i % len(self.alive)]

    def apply(self, ev) -> None:
        for cmd in self.d.handle(ev):
            if isinstance(cmd, InlineReduce):  # (the driver computes it)
                self.apply(InlineReduced(cmd.target, cmd.inputs[0]))
        for task in self.d.reduces.values():
            self.tags.add(task.tag)

    # ------------------------------------------------------------ nodes ---
    @rule(node=st.sampled_from(NODES))
    def join(self, node: str) -> None:
        if node not in self.alive:
            self.apply(NodeJoined(node, "addr-" + node))
            self.alive.append(node)

    @precondition(lambda self: len(self.alive) > 2)
    @rule(i=st.integers(0, 5))
    def lose(self, i: int) -> None:
        node = self.someone(i)
        self.apply(NodeLost(node))
        self.alive.remove(node)

    # ----------------------------------------------------------- reduces ---
    @rule(i=st.integers(0, 5), which=st.sampled_from(TARGETS), small=st.sampled_from([False, False, True]),
          n=st.integers(1, 5), k=st.integers(1, 5), relay=st.booleans(), root=st.booleans())
    def request(self, i: int, which: bytes, small: bool, n: int, k: int, relay: bool,
                root: bool) -> None:
        target = which
        inputs = tuple((SMALL_INPUTS if small else INPUTS)[:n])
        self.apply(ReduceRequested(self.someone(i), self.r(), target, inputs, "sum",
                                   min(k, len(inputs)), inputs[-1] if root else None, relay))

    @rule(i=st.integers(0, 5), j=st.integers(0, 4), done=st.sampled_from([True, True, False]))
    def put_input(self, i: int, j: int, done: bool) -> None:
        node = self.someone(i)
        self.apply(Put(node, self.r(), INPUTS[j], ARRAY["nbytes"], ARRAY))
        if done:
            self.apply(Completed(node, INPUTS[j]))

    @rule(i=st.integers(0, 5), j=st.integers(0, 2), rarely=st.integers(0, 2))
    def put_small_input(self, i: int, j: int, rarely: int) -> None:
        if rarely == 0:
            self.apply(Put(self.someone(i), self.r(), SMALL_INPUTS[j], 4, SCALAR,
                           b"\x00\x00\x80?"))

    def roots(self) -> list[tuple[str, bytes]]:
        return sorted((n, t) for t in TARGETS if t in self.d.objects
                      for n, h in self.d.objects[t].holders.items() if h.origin and not h.complete)

    @precondition(lambda self: self.roots())
    @rule(i=st.integers(0, 10), stale=st.booleans())
    def root_step_finishes(self, i: int, stale: bool) -> None:
        node, target = self.roots()[i % len(self.roots())]
        task = self.d.reduces.get(target)
        tag = INSTANCE + (0).to_bytes(8, "big") if stale or task is None else task.tag
        self.apply(Completed(node, target, tag=tag))

    @rule(i=st.integers(0, 5), which=st.sampled_from(TARGETS), lost=st.booleans(),
          stale=st.booleans())
    def step_goes_wrong(self, i: int, which: bytes, lost: bool, stale: bool) -> None:
        target = which
        task = self.d.reduces.get(target)
        tag = INSTANCE + (0).to_bytes(8, "big") if stale or task is None else task.tag
        event = StepLost if lost else ReduceFailed
        self.apply(event(self.someone(i), target, "a step went wrong", tag))

    @rule(i=st.integers(0, 5), which=st.sampled_from(TARGETS), confirm=st.booleans())
    def ask(self, i: int, which: bytes, confirm: bool) -> None:
        target = which
        node = self.someone(i)
        task = self.d.reduces.get(target)
        if confirm:
            self.apply(ReduceConfirm(node, self.r(), target, task.tag if task else b"x"))
        else:
            self.apply(ReducedInputs(node, self.r(), target))

    @rule(i=st.integers(0, 5), which=st.sampled_from([*TARGETS, INPUTS[0], SMALL_INPUTS[0]]),
          rarely=st.integers(0, 3))
    def delete(self, i: int, which: bytes, rarely: int) -> None:
        if rarely == 0:
            self.apply(Delete(self.someone(i), self.r(), which))
            assert which not in self.d.reduces

    # ------------------------------------------------------- invariants ---
    @invariant()
    def unfinished_reduces_watch_their_inputs_and_no_other_does(self) -> None:
        d = self.d
        for target, task in d.reduces.items():
            running = not (task.done or task.failed)
            if running:
                assert target in d.unfinished or task.inline, target
            for oid in task.inputs:
                assert (target in d.watching.get(oid, ())) == running, (target, oid)
        assert all(d.watching.values())  # (no empty set kept)
        assert set(d.unfinished) <= set(d.reduces)

    @invariant()
    def each_tree_holds_its_own_inputs_once(self) -> None:
        for target, task in self.d.reduces.items():
            chosen = task.chosen
            assert len(chosen) <= task.k and len(set(chosen)) == len(chosen)
            assert set(chosen).isdisjoint(task.backups)
            assert task.placed == set(chosen) | set(task.backups)
            assert task.placed <= set(task.inputs)
            assert sorted(task.at.values()) == list(range(len(task.slots)))
            assert all(0 <= pos < task.k for pos in task.at)
            if task.done:
                assert len(chosen) == task.k, target
            if not task.inline and task.slots:
                _, children = inorder_tree(task.k, task.degree)
                assert task.started <= set(task.at) and task.whole <= set(task.at)
                for pos, kids in task.folded.items():
                    assert set(kids) <= set(children[pos]) & task.whole

    @invariant()
    def the_failures_kept_are_the_failed_tasks(self) -> None:
        assert self.d.failed == {t: task.failed for t, task in self.d.reduces.items()
                                 if task.failed}

    @invariant()
    def every_request_waiting_on_a_reduce_is_booked(self) -> None:
        d = self.d
        waiting = {w: t for t, ws in d.reduce_pending.items() for w in ws}
        assert all(d.reduce_pending.values())
        assert not set(d.reduce_pending) & set(d.reduces)
        for target, task in d.reduces.items():
            for w in [*task.waiters, *task.confirms]:
                waiting[w] = target
        for (node, request), target in waiting.items():
            assert d.waits.get(node, {}).get(request) == ("reduce", target), (node, request)
        booked = {(n, r) for n, mine in d.waits.items() for r, (kind, _) in mine.items()
                  if kind == "reduce"}
        assert booked == set(waiting)

    @invariant()
    def each_tree_has_its_own_tag_of_this_directory(self) -> None:
        tags = [task.tag for task in self.d.reduces.values()]
        assert len(set(tags)) == len(tags)
        assert all(tag.startswith(INSTANCE) and len(tag) == len(INSTANCE) + 8 for tag in tags)


TestReducesMachine = ReducesMachine.TestCase
TestReducesMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
