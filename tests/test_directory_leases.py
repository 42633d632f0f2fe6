"""The membership part (`leases.Leases`) alone, and through the directory with
membership events only: joins, heartbeats, ticks and losses.

A hypothesis state machine keeps a model of each node's last renewal and
checks after every step that the part knows exactly the live nodes, that a
lease never moves back in time, that a tick expires exactly the nodes whose
lease ran out (by the model's clock), and that a pause of the directory
itself (a tick long overdue) is not held against the nodes.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hoplite_gpu.directory.events import Heartbeat, NodeJoined, NodeLost, Tick
from hoplite_gpu.directory.leases import Leases
from hoplite_gpu.directory.state import Directory, Disconnect

NODES = [f"n{i}" for i in range(6)]
LEASE = 5.0
TICK = 0.5


class LeasesMachine(RuleBasedStateMachine):
    """The part alone, against a model of renewals and of the tick's clock."""

    @initialize(paused=st.booleans())
    def setup(self, paused: bool) -> None:
        #: with `tick_s`, a long gap between ticks is the directory's pause
        self.tick_s = TICK if paused else None
        self.leases = Leases(LEASE, self.tick_s)
        self.now = 0.0
        self.seen: dict[str, float] = {}
        self.last_tick: float | None = None

    @rule(node=st.sampled_from(NODES))
    def join(self, node: str) -> None:
        self.leases.joined(NodeJoined(node, "addr-" + node, self.now))
        self.seen[node] = self.now

    @rule(node=st.sampled_from(NODES), back=st.sampled_from([0.0, 0.0, 1.0]))
    def heartbeat(self, node: str, back: float) -> None:
        """A renewal, now and then stamped earlier than the last one (a
        heartbeat read late): the lease keeps the later time."""
        self.leases.heartbeat(Heartbeat(node, self.now - back))
        if node in self.seen:
            self.seen[node] = max(self.seen[node], self.now - back)

    @rule(dt=st.sampled_from([0.1, TICK, 2.0, LEASE / 2, LEASE + 0.5, 4 * LEASE]))
    def tick(self, dt: float) -> None:
        self.now += dt
        gap = 0.0 if self.last_tick is None else self.now - self.last_tick
        self.last_tick = self.now
        if self.tick_s is not None and gap > max(4 * self.tick_s, LEASE / 2):
            # the directory did not run: nobody's lease ran meanwhile
            self.seen = {node: seen + gap for node, seen in self.seen.items()}
        want = sorted(n for n, seen in self.seen.items() if self.now - seen > LEASE)
        expired = self.leases.expired(Tick(self.now))
        assert [node for node, _ in expired] == want
        for node, why in expired:
            assert "no heartbeat for" in why and f"lease {LEASE:g}s" in why
            self.leases.lost(node)  # (the directory declares it lost)
            del self.seen[node]

    @precondition(lambda self: self.seen)
    @rule(i=st.integers(0, 5))
    def lose(self, i: int) -> None:
        node = sorted(self.seen)[i % len(self.seen)]
        self.leases.lost(node)
        del self.seen[node]

    @invariant()
    def the_live_nodes_are_those_that_joined_and_were_not_lost(self) -> None:
        assert set(self.leases.nodes) == set(self.seen)
        assert set(self.leases.last_seen) == set(self.seen)
        assert all(self.leases.nodes[n] == "addr-" + n for n in self.seen)

    @invariant()
    def each_lease_is_the_latest_renewal(self) -> None:
        for node, seen in self.seen.items():
            assert abs(self.leases.last_seen[node] - seen) < 1e-9, (node, seen)
        assert self.leases.last_tick == self.last_tick


TestLeasesMachine = LeasesMachine.TestCase
TestLeasesMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class MembershipMachine(RuleBasedStateMachine):
    """The directory fed membership events only: the leases part decides,
    the dispatcher turns each expiry into a `Disconnect` and a loss."""

    def __init__(self) -> None:
        super().__init__()
        self.d = Directory(lease_s=LEASE)
        self.now = 0.0
        self.seen: dict[str, float] = {}

    @rule(node=st.sampled_from(NODES))
    def join(self, node: str) -> None:
        assert self.d.handle(NodeJoined(node, "addr-" + node, self.now)) == []
        self.seen[node] = self.now

    @rule(node=st.sampled_from(NODES))
    def heartbeat(self, node: str) -> None:
        assert self.d.handle(Heartbeat(node, self.now)) == []
        if node in self.seen:
            self.seen[node] = self.now

    @rule(dt=st.sampled_from([0.5, 3.0, LEASE + 1]))
    def tick(self, dt: float) -> None:
        self.now += dt
        out = self.d.handle(Tick(self.now))
        want = sorted(n for n, seen in self.seen.items() if self.now - seen > LEASE)
        assert [c.node for c in out] == want
        assert all(isinstance(c, Disconnect) for c in out)
        for node in want:
            del self.seen[node]

    @rule(node=st.sampled_from(NODES))
    def lose(self, node: str) -> None:
        assert self.d.handle(NodeLost(node)) == []
        self.seen.pop(node, None)

    @invariant()
    def the_directory_reads_the_parts_table(self) -> None:
        assert set(self.d.nodes) == set(self.seen) == set(self.d.last_seen)
        assert self.d.lease_s == LEASE
        assert not self.d.waits and not self.d.objects and not self.d.holding


TestMembershipMachine = MembershipMachine.TestCase
TestMembershipMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def test_a_pause_of_the_directory_is_not_held_against_the_nodes() -> None:
    """Ticks every 0.5 s, then none for 20 s (the directory stopped): the
    nodes' heartbeats of that time wait unread, and nobody expires."""
    leases = Leases(LEASE, TICK)
    leases.joined(NodeJoined("a", "addr-a", 0.0))
    assert leases.expired(Tick(0.5)) == []
    assert leases.expired(Tick(20.5)) == []
    assert leases.last_seen["a"] == 20.0
    # then ticks come again, and its lease runs from where the pause ended
    assert all(leases.expired(Tick(20.5 + i / 2)) == [] for i in range(1, 10))
    assert [node for node, _ in leases.expired(Tick(25.5))] == ["a"]
