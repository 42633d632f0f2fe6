"""A sender is picked through `Entry.senders` (the earliest open complete
copy first) where it may serve the receiver, and by a scan of every open
holder otherwise. The choice must be exactly the scan's in every case.

A hypothesis state machine feeds the same random events (puts, gets, direct
gets, completions, progress, failed pulls, drops, evictions, deletes,
cancels, node losses and expired leases, relayed reduces, a directory
restart whose nodes announce their copies, with one receiver per sender,
several, or the cost model's choice) to a `Directory` and to one whose
`_best_sender` is the scan alone (as it was before `Entry.senders`), and
requires the same commands and the same holders, links and queues after
every event, and `Entry.senders` to hold exactly the open complete copies.
Long random walks of the same rules with 40 nodes build heaps of dozens of
copies; one explicit case passes over a complete copy that would close a
cycle. A growth test then checks that a long-lived object whose readers
come and go keeps its heap no larger than its open copies, and a relay's
next node is served once the node before it gave up its copy.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from benchmarks import directory_scale
from hoplite_gpu.directory import state as s
from hoplite_gpu.directory.state import (
    CancelLocate,
    Completed,
    Delete,
    Directory,
    Disconnect,
    Dropped,
    Entry,
    Evict,
    Heartbeat,
    InlineReduce,
    InlineReduced,
    Locate,
    NodeId,
    NodeJoined,
    NodeLost,
    Progress,
    Put,
    Query,
    ReduceRequested,
    Tick,
    TransferFailed,
)

oid, joined, put_complete = directory_scale.oid, directory_scale.joined, directory_scale.put_complete
ARRAY = {"kind": "numpy", "dtype": "<f4", "shape": [1 << 18], "nbytes": 1 << 20}


class ScanDirectory(Directory):
    """The reference: every sender found by the scan of the open holders, as
    before `Entry.senders` (the scan there is unchanged)."""

    _scan_only = True


class CountingDirectory(Directory):
    """The directory under test, counting how its choices were made."""

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        self.choices: Counter[str] = Counter()
        # (the sender choice is its own part: its method is wrapped there)
        self._choose = self._senders.best_sender
        self._senders.best_sender = self._best_sender

    def _best_sender(self, entry: Entry, receiver: NodeId, avoid_failed: bool) -> NodeId | None:
        choice = self._choose(entry, receiver, avoid_failed)
        holder = entry.holders.get(choice) if choice is not None else None
        if holder is None:
            self.choices["no sender"] += 1
        elif not holder.complete:
            self.choices["a partial copy"] += 1
        elif entry.senders and entry.senders.first() == choice:
            self.choices["the earliest open complete copy"] += 1
        else:  # (the earliest could not serve this receiver: the scan chose)
            self.choices["a later complete copy"] += 1
        return choice


def holders_state(d: Directory) -> dict:
    """Everything of `d` that its commands follow from (not `open`, a superset
    by design, nor the caches `anchored` and `senders`)."""
    objects = {}
    for oid, e in d.objects.items():
        objects[oid] = (
            e.size, e.layout, e.inline, e.recovered, e.relay, list(e.waiting), list(e.edges),
            [(n, h.nbytes, h.complete, h.origin, h.upstream, sorted(h.serving),
              sorted(h.failed_from), h.seq) for n, h in e.holders.items()])
    return {"objects": objects, "nodes": dict(d.nodes),
            "pending": {k: list(v) for k, v in d.pending.items()},
            "gone": list(d.gone.items()), "waits": d.waits, "direct": sorted(d.direct),
            "reduces": {t: (r.tag, r.slots, r.done, r.failed) for t, r in d.reduces.items()}}


def check_senders(d: Directory) -> None:
    """`Entry.senders` holds exactly the open complete copies, as a heap."""
    for oid, e in d.objects.items():
        items = e.senders.items
        want = sorted((h.seq, n) for n, h in e.holders.items() if h.complete and n in e.open)
        assert sorted(items) == want, (oid, items, want)
        assert e.senders.at == {n: i for i, (_, n) in enumerate(items)}
        for i in range(1, len(items)):
            assert items[(i - 1) // 2][0] < items[i][0], (oid, items)
        # (the premise: complete copies differ only in seq)
        assert all(h.nbytes == e.size for h in e.holders.values() if h.complete)


NODES = [f"n{i}" for i in range(8)]
HOT, OTHER, SMALL, EMPTY = (bytes([i]) * 20 for i in (1, 2, 3, 4))
ROW = {"kind": "numpy", "dtype": "<f4", "shape": [100], "nbytes": 400}
SPECS = {
    HOT: (1000, {"kind": "bytes", "nbytes": 1000}, None),
    OTHER: (400, ROW, None),
    SMALL: (4, {"kind": "bytes", "nbytes": 4}, b"\x01\x02\x03\x04"),  # inline
    EMPTY: (0, {"kind": "bytes", "nbytes": 0}, None),
}
INPUTS = [bytes([10 + i]) * 20 for i in range(4)]
TARGET = bytes([99]) * 20  # a relayed reduce's result
#: most gets are of the object with many holders
OID_CHOICES = [HOT, HOT, HOT, HOT, HOT, OTHER, SMALL, EMPTY, TARGET, INPUTS[0]]
SOME_OID = st.sampled_from(OID_CHOICES)
LEASE = 5.0


class SameChoiceMachine(RuleBasedStateMachine):
    #: the nodes that may join (a random walk below takes more)
    names = NODES

    @initialize(fan=st.sampled_from([0, 1, 2, 3]), joined=st.integers(3, len(NODES)),
                latency=st.sampled_from([1e-4, 1e-2]), racked=st.booleans())
    def setup(self, fan: int, joined: int, latency: float, racked: bool = False) -> None:
        # (racked: the nodes in two racks, so the choice prefers one's own
        # and receivers are moved: racks.py)
        self.racked = racked
        self.config = {"max_receivers_per_sender": fan, "latency_s": latency, "lease_s": LEASE}
        self.choices: Counter[str] = Counter()  # (of directories replaced by a restart)
        self.fast = CountingDirectory(**self.config)
        self.ref = ScanDirectory(**self.config)
        self.alive: set[str] = set()
        self.now = 0.0
        self.rid = 0
        self.locates: set[tuple[str, int]] = set()
        for node in self.names[:joined]:
            self.apply(self.joined(node))
        size, layout, _ = SPECS[HOT]
        self.apply(Put(self.names[0], self.r(), HOT, size, layout))
        self.apply(Completed(self.names[0], HOT))

    # ------------------------------------------------------------ driver ---
    def joined(self, node: str) -> NodeJoined:
        rack = f"r{int(node.strip('n') or 0) % 2}" if self.racked else None
        return NodeJoined(node, "addr-" + node, self.now, rack=rack)

    def r(self) -> int:
        self.rid += 1
        return self.rid

    def apply(self, ev: Any) -> None:
        if isinstance(ev, NodeJoined):
            self.alive.add(ev.node)
        if isinstance(ev, NodeLost):
            self.alive.discard(ev.node)
        got, want = self.fast.handle(ev), self.ref.handle(ev)
        assert repr(got) == repr(want), (ev, got, want)
        assert holders_state(self.fast) == holders_state(self.ref), ev
        for c in got:
            if isinstance(c, Disconnect):
                self.alive.discard(c.node)
            if isinstance(c, InlineReduce):
                self.apply(InlineReduced(c.target, c.inputs[0]))
        self.locates = {key for key in self.locates if self.waiting(key)}

    def waiting(self, key: tuple[str, int]) -> bool:
        return key in self.fast.waits.get(key[0], {})

    def someone(self, i: int) -> str:
        return sorted(self.alive)[i % len(self.alive)]

    def where(self, test) -> list[tuple[str, bytes]]:
        return sorted((n, oid) for oid, e in self.fast.objects.items()
                      for n, h in e.holders.items() if test(h))

    # ------------------------------------------------------------- nodes ---
    @rule(node=st.sampled_from(NODES))
    def join(self, node: str) -> None:
        if node not in self.alive:
            self.apply(self.joined(node))

    @precondition(lambda self: len(self.alive) > 2)
    @rule(i=st.integers(0, 7))
    def lose(self, i: int) -> None:
        self.apply(NodeLost(self.someone(i)))

    @precondition(lambda self: len(self.alive) > 2)
    @rule(i=st.integers(0, 7))
    def lease_runs_out(self, i: int) -> None:
        """Every node but one renews its lease; the time passes."""
        late = self.someone(i)
        self.now += LEASE + 1
        for node in sorted(self.alive - {late}):
            self.apply(Heartbeat(node, self.now))
        self.apply(Tick(self.now))

    @rule(fan=st.sampled_from([0, 1, 2, 3]), rarely=st.integers(0, 3))
    def restart(self, fan: int, rarely: int) -> None:
        """A new directory (perhaps another fanout): the nodes join it and
        announce their complete copies; their gets are gone with it."""
        if rarely != 2:
            return
        copies = [(n, oid, self.fast.objects[oid]) for n, oid in self.where(lambda h: h.complete)]
        origin = {(n, oid) for n, oid in self.where(lambda h: h.origin)}
        self.config["max_receivers_per_sender"] = fan
        self.choices += self.fast.choices
        self.fast = CountingDirectory(**self.config)
        self.ref = ScanDirectory(**self.config)
        self.locates = set()
        for node in sorted(self.alive):
            self.apply(self.joined(node))
        for node, oid, entry in copies:
            if entry.inline is None:
                self.apply(Completed(node, oid, entry.size, entry.layout,
                                     own=(node, oid) in origin))

    # ----------------------------------------------------------- objects ---
    @rule(i=st.integers(0, 7), oid=SOME_OID, done=st.booleans(), bytes_here=st.integers(0, 4))
    def put(self, i: int, oid: bytes, done: bool, bytes_here: int = 0) -> None:
        if oid == TARGET:
            return  # (a reduce makes it)
        node = self.someone(i)
        size, layout, inline = SPECS.get(oid, (400, ROW, None))
        if bytes_here == 3:
            # (now and then its bytes with it: complete at once, even on a
            # node that was pulling the object and keeps its upstream)
            inline = inline or bytes(size)
        self.apply(Put(node, self.r(), oid, size, layout, inline))
        if done:
            self.apply(Completed(node, oid))

    @precondition(lambda self: self.where(lambda h: h.origin and not h.complete))
    @rule(i=st.integers(0, 50))
    def complete_put(self, i: int) -> None:  # also a reduce's root step finishing
        copying = self.where(lambda h: h.origin and not h.complete)
        self.apply(Completed(*copying[i % len(copying)]))

    @rule(who=st.lists(st.integers(0, 7), min_size=1, max_size=4), oid=SOME_OID,
          direct=st.booleans())
    def locate(self, who: list[int], oid: bytes, direct: bool) -> None:
        for i in who:
            ev = Locate(self.someone(i), self.r(), oid, direct)
            self.locates.add((ev.node, ev.request))
            self.apply(ev)

    @rule(i=st.integers(0, 7), done=st.booleans())
    def pull_hot(self, i: int, done: bool) -> None:
        """A node without the hot object gets it (and perhaps has it at once:
        a get over time)."""
        entry = self.fast.objects.get(HOT)
        lacking = [n for n in sorted(self.alive) if entry is None or n not in entry.holders]
        if lacking:
            node = lacking[i % len(lacking)]
            ev = Locate(node, self.r(), HOT)
            self.locates.add((node, ev.request))
            self.apply(ev)
            entry = self.fast.objects.get(HOT)
            if done and entry is not None and node in entry.holders and entry.holders[node].upstream:
                self.apply(Completed(node, HOT))

    @precondition(lambda self: self.where(lambda h: h.upstream is not None))
    @rule(i=st.integers(0, 50), have=st.integers(0, 1000))
    def fail_and_ask_again(self, i: int, have: int) -> None:
        """A pull fails and its node asks again at once: the sender that
        failed it is passed over while another can serve it."""
        pulls = self.where(lambda h: h.upstream is not None)
        node, oid = pulls[i % len(pulls)]
        sender = self.fast.objects[oid].holders[node].upstream
        self.apply(TransferFailed(node, oid, sender, have))
        ev = Locate(node, self.r(), oid)
        self.locates.add((node, ev.request))
        self.apply(ev)

    @precondition(lambda self: self.where(lambda h: h.upstream is not None))
    @rule(i=st.integers(0, 50))
    def complete_pull(self, i: int) -> None:
        pulls = self.where(lambda h: h.upstream is not None)
        self.apply(Completed(*pulls[i % len(pulls)]))

    @precondition(lambda self: self.where(lambda h: h.upstream is not None))
    @rule(i=st.integers(0, 50), nbytes=st.integers(0, 1000))
    def progress(self, i: int, nbytes: int) -> None:
        pulls = self.where(lambda h: h.upstream is not None)
        self.apply(Progress(*pulls[i % len(pulls)], nbytes))

    @precondition(lambda self: self.where(lambda h: h.upstream is not None))
    @rule(i=st.integers(0, 50), have=st.integers(0, 1000))
    def fail_pull(self, i: int, have: int) -> None:
        pulls = self.where(lambda h: h.upstream is not None)
        node, oid = pulls[i % len(pulls)]
        sender = self.fast.objects[oid].holders[node].upstream
        self.apply(TransferFailed(node, oid, sender, have))

    @precondition(lambda self: self.where(lambda h: True))
    @rule(i=st.integers(0, 50))
    def drop(self, i: int) -> None:
        held = self.where(lambda h: True)
        self.apply(Dropped(*held[i % len(held)]))

    @precondition(lambda self: self.where(lambda h: True))
    @rule(i=st.integers(0, 50), need=st.sampled_from([0, 0, 500]))
    def evict(self, i: int, need: int) -> None:
        held = self.where(lambda h: True)
        node, oid = held[i % len(held)]
        self.apply(Evict(node, self.r(), (oid, HOT), need))

    @rule(i=st.integers(0, 7), oid=SOME_OID, rarely=st.integers(0, 3))
    def delete(self, i: int, oid: bytes, rarely: int) -> None:
        if rarely == 2:  # (or objects die young)
            self.apply(Delete(self.someone(i), self.r(), oid))

    @rule(i=st.integers(0, 7), oid=SOME_OID)
    def query(self, i: int, oid: bytes) -> None:
        self.apply(Query(self.someone(i), self.r(), oid))

    @precondition(lambda self: self.locates)
    @rule(i=st.integers(0, 50))
    def cancel(self, i: int) -> None:
        keys = sorted(self.locates)
        self.apply(CancelLocate(*keys[i % len(keys)]))

    # ------------------------------------------------------------ reduce ---
    @rule(i=st.integers(0, 7), k=st.integers(1, 4), relay=st.booleans(), root=st.booleans())
    def reduce(self, i: int, k: int, relay: bool, root: bool) -> None:
        order = tuple(INPUTS[(i + j) % len(INPUTS)] for j in range(len(INPUTS)))
        self.apply(ReduceRequested(self.someone(i), self.r(), TARGET, order, "sum", k,
                                   order[0] if root else None, relay))

    @rule(i=st.integers(0, 7), j=st.integers(0, 3), done=st.booleans())
    def put_input(self, i: int, j: int, done: bool) -> None:
        node = self.someone(i)
        self.apply(Put(node, self.r(), INPUTS[j], 400, ROW))
        if done:
            self.apply(Completed(node, INPUTS[j]))

    # -------------------------------------------------------- invariants ---
    @invariant()
    def senders_are_the_open_complete_copies(self) -> None:
        check_senders(self.fast)

    def all_choices(self) -> Counter[str]:
        return self.choices + self.fast.choices

    def teardown(self) -> None:
        for kind in self.all_choices():
            event("chosen: " + kind)


SameChoiceMachine.TestCase.settings = settings(max_examples=400, deadline=None,
                                               stateful_step_count=80)
TestSameChoiceMachine = SameChoiceMachine.TestCase


def random_walk(seed: int, nodes: int = 40, steps: int = 3000,
                racked: bool = False) -> SameChoiceMachine:
    """The machine's rules at random for `steps` events, with `nodes` nodes
    (heaps of dozens of copies, which hypothesis's short runs seldom build),
    gets and pulls weighted up; `racked`: the nodes in two racks."""
    rng = random.Random(seed)
    m = SameChoiceMachine()
    m.names = [f"n{i}" for i in range(nodes)]
    m.setup(fan=rng.choice([0, 1, 2, 3]), joined=rng.randint(nodes // 2, nodes),
            latency=rng.choice([1e-4, 1e-2]), racked=racked)
    some = lambda: rng.randrange(nodes)  # noqa: E731
    oid = lambda: rng.choice(OID_CHOICES)  # noqa: E731
    pulling = lambda: m.where(lambda h: h.upstream is not None)  # noqa: E731
    actions: list[tuple[float, Any]] = [
        (8, lambda: m.pull_hot(some(), rng.random() < 0.7)),
        (4, lambda: pulling() and m.complete_pull(rng.randrange(50))),
        (2, lambda: m.locate([some() for _ in range(rng.randint(1, 4))], oid(), rng.random() < 0.3)),
        (2, lambda: pulling() and m.progress(rng.randrange(50), rng.randrange(1001))),
        (1, lambda: pulling() and m.fail_and_ask_again(rng.randrange(50), rng.randrange(1001))),
        (1, lambda: pulling() and m.fail_pull(rng.randrange(50), rng.randrange(1001))),
        (1.5, lambda: m.where(lambda h: True) and m.drop(rng.randrange(50))),
        (0.5, lambda: m.where(lambda h: True) and m.evict(rng.randrange(50), rng.choice([0, 500]))),
        (1, lambda: m.join(rng.choice(m.names))),
        (1, lambda: len(m.alive) > 2 and m.lose(some())),
        (0.2, lambda: len(m.alive) > 2 and m.lease_runs_out(some())),
        (1, lambda: m.put(some(), oid(), rng.random() < 0.5, rng.randrange(5))),
        (1, lambda: m.where(lambda h: h.origin and not h.complete) and m.complete_put(rng.randrange(50))),
        (0.5, lambda: m.locates and m.cancel(rng.randrange(50))),
        (0.3, lambda: m.query(some(), oid())),
        (0.05, lambda: m.delete(some(), oid(), 2)),
        (0.2, lambda: m.reduce(some(), rng.randint(1, 4), rng.random() < 0.5, rng.random() < 0.5)),
        (0.5, lambda: m.put_input(some(), rng.randrange(4), rng.random() < 0.5)),
        (0.05, lambda: m.restart(rng.choice([0, 1, 2, 3]), 2)),
    ]
    weights = [w for w, _ in actions]
    for _ in range(steps):
        rng.choices(actions, weights)[0][1]()
        m.senders_are_the_open_complete_copies()
    return m


@pytest.mark.parametrize("seed", range(16))
def test_long_random_walks_with_many_copies_choose_as_the_scan(seed):
    racked = seed % 4 == 3  # (racks: the earliest copy only where it is the receiver's rack's)
    m = random_walk(seed, racked=racked)
    # (both ways of choosing were taken, and compared)
    assert m.all_choices()["the earliest open complete copy"] > (20 if racked else 50), \
        m.all_choices()
    assert m.all_choices()["a partial copy"] + m.all_choices()["a later complete copy"] > 5


def test_a_complete_copy_still_pulling_from_the_receiver_is_passed_over():
    """A node put the object's bytes while it pulled it (complete, yet still
    linked to its sender) from a chain that leads back to a receiver asking
    again: though the earliest open complete copy, it may not serve that
    receiver (a cycle), and the scan's choice is taken."""
    m = SameChoiceMachine()
    m.setup(fan=1, joined=6, latency=1e-4)  # n0 holds HOT, complete
    size, layout, _ = SPECS[HOT]
    m.apply(Locate("n1", m.r(), HOT))            # n1 <- n0
    m.apply(Locate("n2", m.r(), HOT))            # n2 <- n1
    m.apply(Locate("n3", m.r(), HOT))            # n3 <- n2
    m.apply(Put("n3", m.r(), HOT, size, layout, bytes(size)))  # complete, still <- n2
    m.apply(TransferFailed("n1", HOT, "n0", 0))  # n0 is free again...
    m.apply(Locate("n4", m.r(), HOT))            # ...and serves n4
    entry = m.fast.objects[HOT]
    assert entry.holders["n3"].complete and entry.holders["n3"].upstream == "n2"
    assert entry.holders["n4"].upstream == "n0"
    m.apply(Locate("n1", m.r(), HOT))
    assert entry.senders.first() == "n3"  # the earliest open complete copy...
    assert entry.holders["n1"].upstream == "n4"  # ...is passed over


# ----------------------------------------------------------------- growth ---
def test_a_long_lived_object_keeps_no_more_senders_than_open_copies():
    """Readers of a hot object join, pull it, serve others for a while and
    leave, for thousands of pulls, while its first copy keeps serving: the
    heap holds its open complete copies and nothing of those that left."""
    for fan in (1, 2, 0):
        d = Directory(max_receivers_per_sender=fan)
        d.handle(NodeJoined("n0", "a0"))
        d.handle(Put("n0", 1, HOT, 1000, SPECS[HOT][1]))
        d.handle(Completed("n0", HOT))
        entry = d.objects[HOT]
        live: list[str] = []
        for i in range(3000):
            node = f"w{i}"
            d.handle(NodeJoined(node, node))
            d.handle(Locate(node, 1, HOT))
            if i % 7:
                d.handle(Completed(node, HOT))
            live.append(node)
            if len(live) > 40:  # an early reader leaves; another gives its copy up
                d.handle(NodeLost(live.pop(i % 37)))
                d.handle(Dropped(live.pop(i % 11), HOT))
            assert len(entry.senders) <= len(entry.open) <= len(entry.holders)
            check_senders(d)
        for node in live:
            d.handle(NodeLost(node))
        assert list(entry.holders) == ["n0"]
        assert entry.senders.items == [(entry.holders["n0"].seq, "n0")]
        assert entry.senders.at == {"n0": 0}


def test_the_earliest_complete_copy_serves_a_get_over_time():
    """Gets that come one by one, each pull done first, are all served by the
    first copy (the earliest of the open complete ones), as the scan chose."""
    d = Directory()
    for i in range(50):
        d.handle(NodeJoined(f"n{i}", f"a{i}"))
    d.handle(Put("n0", 1, HOT, 1000, SPECS[HOT][1]))
    d.handle(Completed("n0", HOT))
    for i in range(1, 50):
        (reply,) = d.handle(Locate(f"n{i}", 1, HOT))
        assert reply.body.sender == "n0"
        d.handle(Completed(f"n{i}", HOT))
    assert len(d.objects[HOT].senders) == 50
    # n0 busy, n1 failed this receiver before: the next earliest, n2
    d.handle(NodeJoined("x", "ax"))
    d.handle(NodeJoined("y", "ay"))
    assert d.handle(Locate("x", 1, HOT))[0].body.sender == "n0"
    d.handle(Locate("y", 1, HOT))
    d.handle(TransferFailed("y", HOT, "n1", 10))
    assert d.handle(Locate("y", 2, HOT))[0].body.sender == "n2"


# ------------------------------------------------------------------- relays ---
def senders(out: list[s.Command], node: str) -> list[str]:
    return [c.body.sender for c in out
            if isinstance(c, s.Reply) and c.node == node and getattr(c.body, "sender", None) is not None]


def test_a_relays_next_node_is_served_once_the_node_before_it_gave_up_its_copy():
    """A sliced allreduce relays slice results rank to rank (`relay`); a rank
    waits for the rank before it "to hold or pull the result" and takes any
    other holder only once that rank's node is *gone* or failed it
    (`_best_sender`: `before in self.nodes` and not a holder -> None, "as it
    will"). A rank whose call gave up (its own deadline, a cancelled task)
    stays alive but tells the directory it holds nothing: `unreceived` sends
    `dropped` for its unfinished result, and its lent inputs are reclaimed
    "as if its task had died" (node.py `reclaim`). It never asks again, so
    the next rank's get of that slice waits on it forever: every Progress
    and Completed re-checks it and again finds the rule says wait. The
    user sees `Timeout` at the next rank's deadline (and the rank after it
    waits on that one, and so on round the relay) although the slice's root
    holds a complete copy the whole time, where a node that died instead
    would have let them all finish."""
    d = joined(5)
    for i in range(4):
        put_complete(d, f"n{i + 1}", oid(i), ARRAY)
    target = oid(100)
    # slice 1 of 4 ranks on n1..n4: chain 2, 3, 0 -> 1, relayed n2 -> n3 -> n4 -> n1
    d.handle(s.ReduceRequested("n0", 1, target, (oid(2), oid(3), oid(0), oid(1)), "sum", 4,
                               root_input=oid(1), relay=True))
    assert d.objects[target].relay == ("n2", "n3", "n4", "n1")
    assert senders(d.handle(s.Locate("n3", 10, target)), "n3") == ["n2"]
    d.handle(s.Completed("n2", target))  # the slice is reduced: n2 holds all of it
    # n3's call gives up before its pull ends: it drops its copy and never asks again
    d.handle(s.Dropped("n3", target))
    assert "n3" in d.nodes and "n3" not in d.objects[target].holders

    out = d.handle(s.Locate("n4", 11, target))
    # (anything else about the object happening meanwhile changes nothing today)
    out += d.handle(s.Locate("n1", 12, target))
    assert senders(out, "n4") == ["n2"], (
        "n4's get of the relayed slice still waits for n3, which dropped its copy and "
        f"will never ask again, though n2 holds a complete copy; waiting: "
        f"{list(d.objects[target].waiting)}")
