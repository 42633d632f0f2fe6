"""Membership: which nodes are alive, at which address, and their leases.

A node is a member from its `NodeJoined` until it is lost (`NodeLost`, or
its lease runs out at a `Tick`). Every other part asks this one whether a
node is alive (`nodes`); nothing else writes it.
"""

from __future__ import annotations

from collections.abc import Iterable

from .events import Heartbeat, NodeId, NodeJoined, Tick


class Leases:
    """The live nodes (node -> address), the addresses of those with several
    (rails), the racks of those that said one, and when each last renewed
    its lease."""

    def __init__(self, lease_s: float, tick_s: float | None) -> None:
        self.lease_s = lease_s
        #: how often the driver sends Tick (None: as it likes; no pause is told)
        self.tick_s = tick_s
        self.nodes: dict[NodeId, str] = {}
        #: node -> every data address it listens on, for nodes with several
        self.rails: dict[NodeId, tuple[str, ...]] = {}
        #: node -> its rack, for nodes that said one
        self.racks: dict[NodeId, str] = {}
        #: node -> when its lease was last renewed
        self.last_seen: dict[NodeId, float] = {}
        #: the last Tick's time (None before the first)
        self.last_tick: float | None = None

    def joined(self, ev: NodeJoined) -> None:
        self.nodes[ev.node] = ev.address
        if len(ev.rails) > 1:
            self.rails[ev.node] = ev.rails
        else:
            self.rails.pop(ev.node, None)
        if ev.rack:
            self.racks[ev.node] = ev.rack
        else:
            self.racks.pop(ev.node, None)
        self.last_seen[ev.node] = ev.now

    def rails_of(self, senders: Iterable[NodeId]) -> dict[str, list[str]]:
        """Every data address of each of `senders` that listens on several
        (rails): a pull from it may spread over them."""
        rails = self.rails
        if not rails:
            return {}
        return {node: list(rails[node]) for node in senders if node in rails}

    def heartbeat(self, ev: Heartbeat) -> None:
        if ev.node in self.nodes:
            self.last_seen[ev.node] = max(ev.now, self.last_seen.get(ev.node, ev.now))

    def expired(self, ev: Tick) -> list[tuple[NodeId, str]]:
        """Time passed: the nodes whose lease ran out by `ev.now`, each with
        why, in the order of their names (the caller declares them lost)."""
        gap = 0.0 if self.last_tick is None else ev.now - self.last_tick
        self.last_tick = ev.now
        if self.tick_s is not None and gap > max(4 * self.tick_s, self.lease_s / 2):
            # Ticks come every `tick_s`: this long without one, the directory
            # itself was not running (stopped, starved of CPU), and the nodes'
            # heartbeats of that time wait unread in its sockets. Its pause
            # says nothing of the nodes: it is not counted against them.
            for node in self.last_seen:
                self.last_seen[node] += gap
        return [(node, f"no heartbeat for {ev.now - seen:.1f}s (lease {self.lease_s:g}s)")
                for node, seen in sorted(self.last_seen.items()) if ev.now - seen > self.lease_s]

    def lost(self, node: NodeId) -> None:
        self.nodes.pop(node, None)
        self.rails.pop(node, None)
        self.racks.pop(node, None)
        self.last_seen.pop(node, None)
