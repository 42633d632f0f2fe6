"""The directory's decisions as a pure state machine: events in, commands out.

No sockets, clocks or asyncio here (the h11 style): the asyncio server, the unit
tests and the network simulator all drive this same code by calling
`Directory.handle(event)` and carrying out the commands it returns.

Broadcast is receiver-driven, as in the Hoplite paper: a receiver asks where to
pull an object from; the directory prefers a complete copy, else a partial one,
registers the receiver as a partial holder at once (so the next receiver can
pipeline from it), and lets each holder serve a bounded number of receivers.
A receiver is never sent to a holder that pulls from it, directly or
transitively, so failover can never create a cycle.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

NodeId = str
Key = bytes  # an ObjectID's 20 raw bytes


# ----------------------------------------------------------------- events ---
@dataclass(frozen=True)
class NodeJoined:
    node: NodeId
    address: str


@dataclass(frozen=True)
class NodeLost:
    node: NodeId


@dataclass(frozen=True)
class Put:
    """`node` starts holding a new object (complete at once if `inline` is given)."""

    node: NodeId
    request: int
    oid: Key
    size: int
    layout: dict[str, Any]
    inline: bytes | None = None


@dataclass(frozen=True)
class Progress:
    node: NodeId
    oid: Key
    nbytes: int


@dataclass(frozen=True)
class Completed:
    """`node` now holds every byte of `oid` (a put finished copying, or a pull ended)."""

    node: NodeId
    oid: Key


@dataclass(frozen=True)
class Locate:
    """`node` wants `oid`: reply with where to pull it from, when there is a sender."""

    node: NodeId
    request: int
    oid: Key


@dataclass(frozen=True)
class CancelLocate:
    node: NodeId
    request: int


@dataclass(frozen=True)
class TransferFailed:
    """`node` stopped receiving `oid` from `sender` holding `have` bytes of it."""

    node: NodeId
    oid: Key
    sender: NodeId
    have: int


@dataclass(frozen=True)
class Dropped:
    """`node` no longer holds `oid` (its get gave up, or it freed memory)."""

    node: NodeId
    oid: Key


@dataclass(frozen=True)
class Delete:
    node: NodeId
    request: int
    oid: Key


@dataclass(frozen=True)
class Query:
    node: NodeId
    request: int
    oid: Key


Event = (NodeJoined | NodeLost | Put | Progress | Completed | Locate | CancelLocate
         | TransferFailed | Dropped | Delete | Query)


# --------------------------------------------------------------- commands ---
@dataclass(frozen=True)
class Reply:
    """Answer request `request` of `node` with `body` (an ``error`` key means failure)."""

    node: NodeId
    request: int
    body: dict[str, Any]


@dataclass(frozen=True)
class Drop:
    """Tell `node` to forget `oid`; `reason` goes into the error its waiters see."""

    node: NodeId
    oid: Key
    reason: str


Command = Reply | Drop


def error_body(kind: str, message: str) -> dict[str, Any]:
    return {"error": kind, "message": message}


# ------------------------------------------------------------------ state ---
@dataclass
class Holder:
    nbytes: int = 0
    complete: bool = False
    origin: bool = False                 # got its bytes from a put, not a pull
    upstream: NodeId | None = None       # whom it pulls from now
    serving: set[NodeId] = field(default_factory=set)
    failed_from: set[NodeId] = field(default_factory=set)


@dataclass
class Entry:
    size: int
    layout: dict[str, Any]
    inline: bytes | None
    holders: dict[NodeId, Holder] = field(default_factory=dict)
    waiting: deque[tuple[NodeId, int]] = field(default_factory=deque)
    #: Every (receiver, sender) pair ever assigned, for tests, demos and tools.
    edges: list[tuple[NodeId, NodeId]] = field(default_factory=list)


class Directory:
    """Pure scheduling state of the directory. Feed events to `handle`."""

    def __init__(self, *, max_receivers_per_sender: int = 1) -> None:
        self.max_receivers_per_sender = max_receivers_per_sender
        self.nodes: dict[NodeId, str] = {}
        self.objects: dict[Key, Entry] = {}
        #: Locates for objects nobody has put yet, in arrival order.
        self.pending: dict[Key, deque[tuple[NodeId, int]]] = {}

    def handle(self, event: Event) -> list[Command]:
        method = getattr(self, "_on_" + type(event).__name__, None)
        if method is None:
            raise TypeError(f"not a directory event: {event!r}")
        out: list[Command] = []
        method(event, out)
        return out

    # -------------------------------------------------------------- nodes ---
    def _on_NodeJoined(self, ev: NodeJoined, out: list[Command]) -> None:
        self.nodes[ev.node] = ev.address

    def _on_NodeLost(self, ev: NodeLost, out: list[Command]) -> None:
        self.nodes.pop(ev.node, None)
        for queue in self.pending.values():
            _remove_node(queue, ev.node)
        for key in list(self.objects):
            entry = self.objects[key]
            _remove_node(entry.waiting, ev.node)
            if ev.node in entry.holders:
                self._forget_holder(key, entry, ev.node)
                self._after_loss(key, entry, out)
        self._clean_pending()

    # ------------------------------------------------------------ objects ---
    def _on_Put(self, ev: Put, out: list[Command]) -> None:
        entry = self.objects.get(ev.oid)
        if entry is not None and (entry.size != ev.size or entry.layout != ev.layout):
            out.append(Reply(ev.node, ev.request, error_body(
                "ObjectExists",
                f"object {ev.oid.hex()} already exists with {entry.size} bytes and layout "
                f"{entry.layout}; this put has {ev.size} bytes and layout {ev.layout}. "
                "Objects are immutable: use a new ObjectID.")))
            return
        if entry is None:
            entry = self.objects[ev.oid] = Entry(ev.size, ev.layout, ev.inline)
        complete = ev.inline is not None or ev.size == 0
        entry.holders[ev.node] = Holder(nbytes=ev.size if complete else 0,
                                        complete=complete, origin=True)
        out.append(Reply(ev.node, ev.request, {"ok": True}))
        waiters = self.pending.pop(ev.oid, deque())
        entry.waiting.extend(waiters)
        self._serve_waiting(ev.oid, entry, out)

    def _on_Progress(self, ev: Progress, out: list[Command]) -> None:
        holder = self._holder(ev.oid, ev.node)
        if holder is not None and not holder.complete:
            holder.nbytes = max(holder.nbytes, min(ev.nbytes, self.objects[ev.oid].size))

    def _on_Completed(self, ev: Completed, out: list[Command]) -> None:
        entry = self.objects.get(ev.oid)
        holder = self._holder(ev.oid, ev.node)
        if entry is None or holder is None:
            return
        holder.complete, holder.nbytes = True, entry.size
        self._detach(entry, ev.node)
        self._serve_waiting(ev.oid, entry, out)

    def _on_Locate(self, ev: Locate, out: list[Command]) -> None:
        entry = self.objects.get(ev.oid)
        if entry is None:
            self.pending.setdefault(ev.oid, deque()).append((ev.node, ev.request))
            return
        entry.waiting.append((ev.node, ev.request))
        self._serve_waiting(ev.oid, entry, out)

    def _on_CancelLocate(self, ev: CancelLocate, out: list[Command]) -> None:
        for queue in [*self.pending.values(), *(e.waiting for e in self.objects.values())]:
            try:
                queue.remove((ev.node, ev.request))
            except ValueError:
                continue
        self._clean_pending()

    def _on_TransferFailed(self, ev: TransferFailed, out: list[Command]) -> None:
        entry = self.objects.get(ev.oid)
        holder = self._holder(ev.oid, ev.node)
        if entry is None or holder is None:
            return
        holder.nbytes = max(holder.nbytes, min(ev.have, entry.size))
        holder.failed_from.add(ev.sender)
        self._detach(entry, ev.node)
        self._serve_waiting(ev.oid, entry, out)

    def _on_Dropped(self, ev: Dropped, out: list[Command]) -> None:
        entry = self.objects.get(ev.oid)
        if entry is not None and ev.node in entry.holders:
            self._forget_holder(ev.oid, entry, ev.node)
            self._after_loss(ev.oid, entry, out)
            self._clean_pending()

    def _on_Delete(self, ev: Delete, out: list[Command]) -> None:
        entry = self.objects.pop(ev.oid, None)
        out.append(Reply(ev.node, ev.request, {"ok": True, "existed": entry is not None}))
        if entry is None:
            return
        reason = f"object {ev.oid.hex()} was deleted"
        for node in entry.holders:
            out.append(Drop(node, ev.oid, reason))
        for node, request in entry.waiting:
            out.append(Reply(node, request, error_body("ObjectNotFound", reason)))

    def _on_Query(self, ev: Query, out: list[Command]) -> None:
        out.append(Reply(ev.node, ev.request, self.describe(ev.oid)))

    def describe(self, oid: Key) -> dict[str, Any]:
        entry = self.objects.get(oid)
        if entry is None:
            return error_body("ObjectNotFound", f"object {oid.hex()} is not known to the directory")
        holders = [
            {"node": n, "address": self.nodes.get(n, ""), "nbytes": h.nbytes, "complete": h.complete,
             "origin": h.origin, "upstream": h.upstream, "serving": sorted(h.serving)}
            for n, h in entry.holders.items()
        ]
        return {"size": entry.size, "layout": entry.layout, "inline": entry.inline is not None,
                "holders": holders, "edges": [list(e) for e in entry.edges],
                "waiting": len(entry.waiting)}

    # ------------------------------------------------------------ helpers ---
    def _holder(self, oid: Key, node: NodeId) -> Holder | None:
        entry = self.objects.get(oid)
        return None if entry is None else entry.holders.get(node)

    def _detach(self, entry: Entry, node: NodeId) -> None:
        """`node` stops pulling: free the slot it used at its sender."""
        holder = entry.holders[node]
        if holder.upstream is not None and holder.upstream in entry.holders:
            entry.holders[holder.upstream].serving.discard(node)
        holder.upstream = None

    def _forget_holder(self, oid: Key, entry: Entry, node: NodeId) -> None:
        self._detach(entry, node)
        gone = entry.holders.pop(node)
        for receiver in gone.serving:
            if receiver in entry.holders:
                entry.holders[receiver].upstream = None

    def _depends_on(self, entry: Entry, candidate: NodeId, receiver: NodeId) -> bool:
        """True if `candidate` pulls from `receiver`, directly or through others."""
        seen: set[NodeId] = set()
        node: NodeId | None = candidate
        while node is not None and node not in seen:
            if node == receiver:
                return True
            seen.add(node)
            holder = entry.holders.get(node)
            node = holder.upstream if holder else None
        return False

    def _can_complete(self, entry: Entry, node: NodeId) -> bool:
        """A holder can finish if it is complete, an origin, or pulls (transitively) from one."""
        seen: set[NodeId] = set()
        cur: NodeId | None = node
        while cur is not None and cur not in seen and cur in entry.holders:
            holder = entry.holders[cur]
            if holder.complete or holder.origin:
                return True
            seen.add(cur)
            cur = holder.upstream
        return False

    def _after_loss(self, oid: Key, entry: Entry, out: list[Command]) -> None:
        """If no holder can ever complete any more, the object is lost: say so to everyone."""
        if entry.inline is not None:
            return
        if any(h.complete or h.origin for h in entry.holders.values()):
            self._serve_waiting(oid, entry, out)
            return
        del self.objects[oid]
        reason = (f"object {oid.hex()} was lost: every node holding a complete copy "
                  "(or still putting it) died or dropped it; put it again")
        for node in entry.holders:
            out.append(Drop(node, oid, reason))
        for node, request in entry.waiting:
            out.append(Reply(node, request, error_body("ObjectNotFound", reason)))

    def _clean_pending(self) -> None:
        for key in [k for k, q in self.pending.items() if not q]:
            del self.pending[key]

    def _pick_sender(self, entry: Entry, receiver: NodeId) -> NodeId | None:
        mine = entry.holders.get(receiver)
        have = mine.nbytes if mine else 0
        best: tuple[bool, int] | None = None
        choice: NodeId | None = None
        for node, holder in entry.holders.items():
            if (node == receiver or node not in self.nodes
                    or len(holder.serving) >= self.max_receivers_per_sender
                    or (mine is not None and node in mine.failed_from)
                    or not (holder.complete or self._can_complete(entry, node))
                    or self._depends_on(entry, node, receiver)):
                continue
            if not holder.complete and holder.nbytes < have and not holder.origin:
                # A partial copy behind ours helps only once it overtakes us; a
                # complete or further-ahead one is better, so wait for it.
                continue
            rank = (holder.complete, holder.nbytes)
            if best is None or rank > best:
                best, choice = rank, node
        return choice

    def _serve_waiting(self, oid: Key, entry: Entry, out: list[Command]) -> None:
        """Hand senders to waiting receivers, oldest first, while any sender is free."""
        still: deque[tuple[NodeId, int]] = deque()
        while entry.waiting:
            node, request = entry.waiting.popleft()
            body = self._assign(oid, entry, node)
            if body is None:
                still.append((node, request))
            else:
                out.append(Reply(node, request, body))
        entry.waiting = still

    def _assign(self, oid: Key, entry: Entry, receiver: NodeId) -> dict[str, Any] | None:
        base = {"size": entry.size, "layout": entry.layout}
        mine = entry.holders.get(receiver)
        if entry.inline is not None:
            entry.holders.setdefault(receiver, Holder(nbytes=entry.size, complete=True))
            return {**base, "inline": entry.inline}
        if mine is not None and mine.complete:
            return {**base, "local": True}
        if entry.size == 0:
            entry.holders[receiver] = Holder(complete=True)
            return {**base, "local": True}
        sender = self._pick_sender(entry, receiver)
        if sender is None:
            return None
        if mine is None:
            mine = entry.holders[receiver] = Holder()
        mine.upstream = sender
        entry.holders[sender].serving.add(receiver)
        entry.edges.append((receiver, sender))
        return {**base, "sender": sender, "address": self.nodes[sender]}


def _remove_node(queue: deque[tuple[NodeId, int]], node: NodeId) -> None:
    kept = [item for item in queue if item[0] != node]
    if len(kept) != len(queue):
        queue.clear()
        queue.extend(kept)
