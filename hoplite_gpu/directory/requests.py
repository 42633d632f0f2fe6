"""The bookkeeping of unanswered requests: what each one waits on, and which
locates were asked on a direct connection (`Locate.direct`).

The queues themselves belong to the parts that answer them (an object's
waiters, a reduce's, a channel's); this part only remembers, per node, which
queue each request is in, so that a cancel or a node's loss looks in one
place instead of every queue.
"""

from __future__ import annotations

from typing import Any

from .events import NodeId


class Requests:
    """Per node, each unanswered request's queue; and the direct locates."""

    def __init__(self) -> None:
        #: per node, what each of its unanswered requests waits on: ("oid", id),
        #: ("reduce", target) or ("channel", name), so a cancel looks in one
        #: place instead of every queue (a burst of timed-out gets stalled the
        #: directory in proportion to every object it knew)
        self.waits: dict[NodeId, dict[int, tuple[str, Any]]] = {}
        #: waiting locates asked on direct connections (`Locate.direct`)
        self.direct: set[tuple[NodeId, int]] = set()

    def wait(self, node: NodeId, request: int, kind: str, key: Any) -> None:
        self.waits.setdefault(node, {})[request] = (kind, key)

    def answered(self, node: NodeId, request: int) -> tuple[str, Any] | None:
        """What the request waited on (None: nothing); it waits no more."""
        mine = self.waits.get(node)
        if not mine:
            return None
        where = mine.pop(request, None)
        if not mine:
            del self.waits[node]
        return where

    def replied(self, node: NodeId, request: int) -> None:
        """The request was answered: whatever the answer, it waits no more."""
        self.direct.discard((node, request))
        mine = self.waits.get(node)  # (`answered`, inline: once per reply)
        if mine:
            mine.pop(request, None)
            if not mine:
                del self.waits[node]

    def cancelled(self, node: NodeId, request: int) -> tuple[str, Any] | None:
        """A request was cancelled: what it waited on (None: answered already)."""
        self.direct.discard((node, request))
        return self.answered(node, request)

    def lost(self, node: NodeId) -> list[tuple[int, str, Any]]:
        """`node` is gone: its unanswered requests, each with what it waited on
        (its next connection numbers requests anew)."""
        waits = self.waits.pop(node, None)
        if not waits:
            return []
        for request in waits:
            self.direct.discard((node, request))
        return [(request, kind, key) for request, (kind, key) in waits.items()]
