"""The node -> objects index: which ids' entries name a node (as a holder, or
in a relay), so that a node's loss visits its own objects, not every object
the directory knows. Kept by the objects part (`objects.Objects`), the only
writer of entries."""

from __future__ import annotations

from .entry import Entry
from .events import Key, NodeId


class Holdings:
    """node -> the ids naming it (a superset: the objects part checks on use)."""

    def __init__(self) -> None:
        self.holding: dict[NodeId, dict[Key, None]] = {}

    def add(self, node: NodeId, oid: Key) -> None:
        """`oid`'s entry names `node` (a holder, or in its relay)."""
        mine = self.holding.get(node)  # (once per holder of every object)
        if mine is None:
            mine = self.holding[node] = {}
        mine[oid] = None

    def let_go(self, node: NodeId, oid: Key) -> None:
        mine = self.holding.get(node)
        if mine is not None:  # (an empty one stays while the node lives: it is reused)
            mine.pop(oid, None)

    def unhold(self, oid: Key, entry: Entry) -> None:
        """`entry` of `oid` is gone or replaced: no node holds it through it."""
        holding = self.holding
        for nodes in (entry.holders, entry.relay):
            for node in nodes:
                mine = holding.get(node)
                if mine is not None:
                    mine.pop(oid, None)

    def take(self, node: NodeId) -> dict[Key, None]:
        """`node` is gone: the ids that named it (the index forgets it)."""
        return self.holding.pop(node, {})
