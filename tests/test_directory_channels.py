"""The channels part (`channels.Channels`) through the directory, fed channel
events only: publishes, head queries (waiting or not), cancels and the
loss of a waiting node.

A hypothesis state machine keeps a model (each channel's newest version, and
who waits for one newer than what) and checks every reply against it, and
after every step that the head is the newest version published, that every
waiter still waits for a version newer than the head, that no channel keeps
an empty queue, and that the request bookkeeping names exactly the waiters.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hoplite_gpu import messages as m
from hoplite_gpu.directory.state import (
    CancelLocate,
    ChannelHead,
    ChannelPublish,
    Directory,
    NodeJoined,
    NodeLost,
    Reply,
)

NODES = ["a", "b", "c"]
NAMES = ["x", "y"]


class ChannelsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.d = Directory()
        for node in NODES:
            self.d.handle(NodeJoined(node, "addr-" + node))
        self.rid = 0
        self.heads: dict[str, int] = {}
        #: (node, request) -> (channel, newer_than)
        self.waiting: dict[tuple[str, int], tuple[str, int]] = {}

    def r(self) -> int:
        self.rid += 1
        return self.rid

    @rule(node=st.sampled_from(NODES), name=st.sampled_from(NAMES), version=st.integers(0, 6))
    def publish(self, node: str, name: str, version: int) -> None:
        request = self.r()
        out = self.d.handle(ChannelPublish(node, request, name, version))
        self.heads[name] = max(version, self.heads.get(name, -1))
        head = self.heads[name]
        assert out[0] == Reply(node, request, m.Done(ok=True, head=head))
        woken = [(w, newer) for w, (n, newer) in self.waiting.items() if n == name and head > newer]
        assert sorted((c.node, c.request) for c in out[1:]) == sorted(w for w, _ in woken)
        assert all(c.body == m.Head(head=head) for c in out[1:])
        for w, _ in woken:
            del self.waiting[w]

    @rule(node=st.sampled_from(NODES), name=st.sampled_from(NAMES),
          newer_than=st.integers(-1, 6), wait=st.booleans())
    def head(self, node: str, name: str, newer_than: int, wait: bool) -> None:
        request = self.r()
        out = self.d.handle(ChannelHead(node, request, name, newer_than, wait))
        head = self.heads.get(name, -1)
        if head > newer_than or not wait:
            assert out == [Reply(node, request, m.Head(head=head))]
        else:
            assert out == []
            self.waiting[node, request] = (name, newer_than)

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 20))
    def cancel(self, i: int) -> None:
        node, request = sorted(self.waiting)[i % len(self.waiting)]
        assert self.d.handle(CancelLocate(node, request)) == []
        del self.waiting[node, request]

    @rule(node=st.sampled_from(NODES))
    def leave_and_rejoin(self, node: str) -> None:
        """Its waiting heads go with it (its next connection asks anew)."""
        assert self.d.handle(NodeLost(node)) == []
        self.d.handle(NodeJoined(node, "addr-" + node))
        self.waiting = {w: v for w, v in self.waiting.items() if w[0] != node}

    @invariant()
    def the_head_is_the_newest_version_published(self) -> None:
        assert self.d.channels == self.heads

    @invariant()
    def every_waiter_waits_for_a_version_newer_than_the_head(self) -> None:
        got = {(w, (name, newer)) for name, queue in self.d.channel_waiters.items()
               for w, newer in queue.items()}
        assert got == set(self.waiting.items())
        assert all(self.d.channel_waiters.values())  # (no empty queue is kept)
        for name, newer in self.waiting.values():
            assert self.heads.get(name, -1) <= newer

    @invariant()
    def the_bookkeeping_names_exactly_the_waiters(self) -> None:
        booked = {(node, request): where for node, mine in self.d.waits.items()
                  for request, where in mine.items()}
        assert booked == {w: ("channel", name) for w, (name, _) in self.waiting.items()}
        assert all(self.d.waits.values())


TestChannelsMachine = ChannelsMachine.TestCase
TestChannelsMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
