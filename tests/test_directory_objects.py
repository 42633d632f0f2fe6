"""The objects part (`objects.Objects`, with the sender choice of
`senders.Senders`) through the directory, fed object events only: puts
(some inline), gets (some on a direct connection), progress, completions,
failed pulls, drops, evictions, deletes, cancels and node losses.

A hypothesis state machine checks after every step the part's own
invariants: pull links agree from both ends and never form a cycle; no
holder serves more receivers than the fanout; a complete copy has every
byte; the node -> objects index names every holder; `Entry.senders` is a
heap of exactly the open complete copies; every waiting get is in exactly
one queue (an entry's, or the queue of an id nobody put) and booked under
its node, and a booked get is queued; ids nobody holds wait in `pending`
only while no entry exists.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hoplite_gpu.directory.state import (
    CancelLocate,
    Completed,
    Delete,
    Directory,
    Dropped,
    Evict,
    Locate,
    NodeJoined,
    NodeLost,
    Progress,
    Put,
    TransferFailed,
)

NODES = [f"n{i}" for i in range(6)]
BIG = {"kind": "bytes", "nbytes": 1000}
SMALL = {"kind": "bytes", "nbytes": 4}
OIDS = [bytes([i]) * 20 for i in range(1, 4)]
TINY = bytes([9]) * 20  # put inline


class ObjectsMachine(RuleBasedStateMachine):
    @initialize(fan=st.sampled_from([1, 2, 3]), sources=st.sampled_from([1, 3]))
    def setup(self, fan: int, sources: int) -> None:
        self.fan = fan
        # (BIG objects are 1000 bytes: with `sources`, pulls of them may
        # have several senders)
        self.d = Directory(max_receivers_per_sender=fan, max_sources=sources,
                           multi_source_bytes=1000)
        self.alive: list[str] = []
        self.rid = 0
        for node in NODES[:4]:
            self.join(node)

    def r(self) -> int:
        self.rid += 1
        return self.rid

    def someone(self, i: int) -> str:
        return self.alive[i % len(self.alive)]

    def holders(self, test) -> list[tuple[str, bytes]]:
        return sorted((n, oid) for oid, e in self.d.objects.items()
                      for n, h in e.holders.items() if test(h))

    # ------------------------------------------------------------ nodes ---
    @rule(node=st.sampled_from(NODES))
    def join(self, node: str) -> None:
        if node not in self.alive:
            self.d.handle(NodeJoined(node, "addr-" + node))
            self.alive.append(node)

    @precondition(lambda self: len(self.alive) > 2)
    @rule(i=st.integers(0, 5))
    def lose(self, i: int) -> None:
        node = self.someone(i)
        self.d.handle(NodeLost(node))
        self.alive.remove(node)

    # ---------------------------------------------------------- objects ---
    @rule(i=st.integers(0, 5), oid=st.sampled_from(OIDS), done=st.booleans())
    def put(self, i: int, oid: bytes, done: bool) -> None:
        node = self.someone(i)
        self.d.handle(Put(node, self.r(), oid, BIG["nbytes"], BIG))
        if done:
            self.d.handle(Completed(node, oid))

    @rule(i=st.integers(0, 5))
    def put_inline(self, i: int) -> None:
        self.d.handle(Put(self.someone(i), self.r(), TINY, 4, SMALL, b"\x01\x02\x03\x04"))

    @precondition(lambda self: self.holders(lambda h: h.origin and not h.complete))
    @rule(i=st.integers(0, 30))
    def complete_put(self, i: int) -> None:
        found = self.holders(lambda h: h.origin and not h.complete)
        node, oid = found[i % len(found)]
        self.d.handle(Completed(node, oid))

    @rule(i=st.integers(0, 5), oid=st.sampled_from([*OIDS, TINY]), direct=st.booleans())
    def locate(self, i: int, oid: bytes, direct: bool) -> None:
        self.d.handle(Locate(self.someone(i), self.r(), oid, direct))

    @precondition(lambda self: self.holders(lambda h: h.upstream is not None))
    @rule(i=st.integers(0, 30), nbytes=st.integers(0, 1200))
    def progress(self, i: int, nbytes: int) -> None:
        found = self.holders(lambda h: h.upstream is not None)
        node, oid = found[i % len(found)]
        self.d.handle(Progress(node, oid, nbytes))

    @precondition(lambda self: self.holders(lambda h: h.upstream is not None))
    @rule(i=st.integers(0, 30), ok=st.booleans(), have=st.integers(0, 1000),
          j=st.integers(0, 2))
    def pull_ends(self, i: int, ok: bool, have: int, j: int) -> None:
        found = self.holders(lambda h: h.upstream is not None)
        node, oid = found[i % len(found)]
        if ok:
            self.d.handle(Completed(node, oid))
        else:  # (one of several senders, the pull going on with the others)
            h = self.d.objects[oid].holders[node]
            senders = [h.upstream, *h.also]
            self.d.handle(TransferFailed(node, oid, senders[j % len(senders)], have))

    @precondition(lambda self: self.holders(lambda h: True))
    @rule(i=st.integers(0, 30))
    def drop(self, i: int) -> None:
        found = self.holders(lambda h: True)
        node, oid = found[i % len(found)]
        self.d.handle(Dropped(node, oid))

    @rule(i=st.integers(0, 5), need=st.sampled_from([0, 0, 1500]))
    def evict(self, i: int, need: int) -> None:
        node = self.someone(i)
        out = self.d.handle(Evict(node, self.r(), (*OIDS, TINY), need))
        evicted = out[0].body.evicted
        for oid in evicted:  # (what it may free, it no longer holds)
            entry = self.d.objects.get(oid)
            assert entry is None or node not in entry.holders
        assert not need or not evicted or sum(
            (1000 if oid in OIDS else 4) for oid in evicted) >= need

    @rule(i=st.integers(0, 5), oid=st.sampled_from([*OIDS, TINY]), rarely=st.integers(0, 3))
    def delete(self, i: int, oid: bytes, rarely: int) -> None:
        if rarely == 0:
            self.d.handle(Delete(self.someone(i), self.r(), oid))
            # (gets of an id nobody put wait on, for a put of it to come)
            assert oid not in self.d.objects

    @precondition(lambda self: self.d.waits)
    @rule(i=st.integers(0, 30))
    def cancel(self, i: int) -> None:
        booked = sorted((n, r) for n, mine in self.d.waits.items() for r in mine)
        node, request = booked[i % len(booked)]
        self.d.handle(CancelLocate(node, request))
        assert request not in self.d.waits.get(node, {})

    # ------------------------------------------------------- invariants ---
    @invariant()
    def pull_links_agree_and_never_loop(self) -> None:
        for oid, e in self.d.objects.items():
            for node, h in e.holders.items():
                if h.upstream is not None:
                    assert h.upstream in e.holders, (oid, node)
                    assert node in e.holders[h.upstream].serving, (oid, node)
                for receiver in h.serving:
                    assert node in (e.holders[receiver].upstream, *e.holders[receiver].also), \
                        (oid, node, receiver)
                for sender in h.also:  # complete copies, serving it, each once
                    assert e.holders[sender].complete and node in e.holders[sender].serving
                    assert sender != h.upstream and h.also.count(sender) == 1
                assert not h.also or h.upstream is not None
                assert len(h.serving) <= self.fan, (oid, node, h.serving)
                seen, at = set(), node
                while at is not None:
                    assert at not in seen, ("a pull cycle", oid, node)
                    seen.add(at)
                    at = e.holders[at].upstream

    @invariant()
    def copies_and_indexes_agree(self) -> None:
        for oid, e in self.d.objects.items():
            for node, h in e.holders.items():
                assert oid in self.d.holding.get(node, {}), (oid, node)
                assert h.nbytes <= e.size and (not h.complete or h.nbytes == e.size)
            items = e.senders.items
            want = sorted((h.seq, n) for n, h in e.holders.items() if h.complete and n in e.open)
            assert sorted(items) == want, (oid, items, want)
            assert e.senders.at == {n: i for i, (_, n) in enumerate(items)}
            for i in range(1, len(items)):
                assert items[(i - 1) // 2][0] < items[i][0]

    @invariant()
    def every_waiting_get_is_queued_once_and_booked(self) -> None:
        assert not set(self.d.pending) & set(self.d.objects)
        queued: dict[tuple[str, int], bytes] = {}
        queues = [*self.d.pending.items(),
                  *((oid, e.waiting) for oid, e in self.d.objects.items())]
        assert all(self.d.pending.values())  # (no empty queue of an id nobody put)
        for oid, waiters in queues:
            for w in waiters:
                assert w not in queued, w
                queued[w] = oid
            for node in {n for n, _ in waiters}:
                assert waiters.of_node(node) == [r for n, r in waiters if n == node]
        booked = {(node, request): where for node, mine in self.d.waits.items()
                  for request, where in mine.items()}
        assert booked == {w: ("oid", oid) for w, oid in queued.items()}
        assert self.d.direct <= set(booked)


TestObjectsMachine = ObjectsMachine.TestCase
TestObjectsMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
