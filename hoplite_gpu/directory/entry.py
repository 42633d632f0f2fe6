"""One object's record in the directory (`Entry`) and the small structures it
is made of: its holders, the queue of requests waiting for it, and the heap
of its open complete copies. Owned by the objects part (`objects.Objects`)."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .events import NodeId

if TYPE_CHECKING:
    from .stripes import Trees

#: pull assignments an object's entry keeps for `describe` (object_info)
EDGES_KEPT = 1024


class Waiters(OrderedDict):
    """Requests (node, request) waiting on one id, oldest first: a queue that
    is also a set, so a cancel, an answer or a departed node takes its own
    out in O(1) however many others wait (a deque took O(waiters) each, and
    a burst of W timed-out gets of one id O(W^2)); `of_node` finds a node's.
    (An OrderedDict underneath, so len, truth, `in` and iteration cost what
    a dict's do; change it only through the methods below.)"""

    def __init__(self, items: Any = ()) -> None:
        super().__init__()
        self._by_node: dict[NodeId, dict[int, None]] = {}
        if items:
            self.extend(items)

    def append(self, item: tuple[NodeId, int]) -> None:
        self[item] = None
        mine = self._by_node.get(item[0])
        if mine is None:
            mine = self._by_node[item[0]] = {}
        mine[item[1]] = None

    def extend(self, items: Any) -> None:
        for item in items:
            self.append(item)

    def popleft(self) -> tuple[NodeId, int]:
        item = self.popitem(last=False)[0]
        self._forget(item)
        return item

    def discard(self, item: tuple[NodeId, int]) -> None:
        if item in self:
            del self[item]
            self._forget(item)

    def of_node(self, node: NodeId) -> list[int]:
        """`node`'s waiting requests, oldest first."""
        return list(self._by_node.get(node, ()))

    def _forget(self, item: tuple[NodeId, int]) -> None:
        mine = self._by_node[item[0]]
        del mine[item[1]]
        if not mine:
            del self._by_node[item[0]]

    def __repr__(self) -> str:
        return f"Waiters({list(self)!r})"


@dataclass
class Holder:
    nbytes: int = 0
    complete: bool = False
    origin: bool = False                 # got its bytes from a put, not a pull
    upstream: NodeId | None = None       # whom it pulls from now
    #: complete copies it pulls from too (a pull from several senders)
    also: tuple[NodeId, ...] = ()
    #: its pull has several senders: one failing, the pull goes on without it
    several: bool = False
    serving: set[NodeId] = field(default_factory=set)
    failed_from: set[NodeId] = field(default_factory=set)
    #: order of becoming a holder (ties between senders go to the earliest)
    seq: int = 0
    #: the entry's `epoch` when its pull chain was last seen to reach a
    #: complete copy or an origin (then it still does: see `Entry.epoch`)
    anchored: int = -1


@dataclass
class EarliestFirst:
    """Nodes keyed by a number, the lowest first: a binary heap of (key, node)
    that also knows each node's place in it, so that any node is taken out in
    O(log n) the moment it leaves and the heap holds its members only.
    (Dropped lazily, only once they reached the top, entries would pile up
    for every reader that left while the first copy of a hot object kept
    serving: the heap would grow with every pull for the object's life.)"""

    items: list[tuple[int, NodeId]] = field(default_factory=list)
    #: node -> its index in `items`
    at: dict[NodeId, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.items)

    def first(self) -> NodeId:
        return self.items[0][1]

    def add(self, key: int, node: NodeId) -> None:
        i = self.at.get(node)
        if i is not None and self.items[i][0] == key:
            return
        if i is not None:
            self.discard(node)
        self.items.append((key, node))
        self._up(len(self.items) - 1)

    def discard(self, node: NodeId) -> None:
        i = self.at.pop(node, None)
        if i is None:
            return
        last = self.items.pop()
        if i < len(self.items):  # the last item fills the hole, then finds its place
            self._put(i, last)
            self._down(self._up(i))

    def rebuild(self, pairs: Any) -> None:
        self.items = sorted(pairs)  # (a sorted list is a heap)
        self.at = {node: i for i, (_, node) in enumerate(self.items)}

    def _put(self, i: int, item: tuple[int, NodeId]) -> None:
        self.items[i] = item
        self.at[item[1]] = i

    def _up(self, i: int) -> int:
        """Move item `i` up to its place; where it ends."""
        items, item = self.items, self.items[i]
        while i > 0:
            parent = (i - 1) // 2
            if items[parent][0] <= item[0]:
                break
            self._put(i, items[parent])
            i = parent
        self._put(i, item)
        return i

    def _down(self, i: int) -> None:
        items, item, n = self.items, self.items[i], len(self.items)
        while 2 * i + 1 < n:
            child = 2 * i + 1
            if child + 1 < n and items[child + 1][0] < items[child][0]:
                child += 1
            if items[child][0] >= item[0]:
                break
            self._put(i, items[child])
            i = child
        self._put(i, item)


@dataclass
class Entry:
    size: int
    layout: dict[str, Any]
    inline: bytes | None
    holders: dict[NodeId, Holder] = field(default_factory=dict)
    #: the first put's `values.fingerprint` (None: not told)
    fingerprint: bytes | None = None
    waiting: Waiters = field(default_factory=Waiters)
    #: Every (receiver, sender) pair ever assigned, for tests, demos and tools.
    #: the latest (receiver, sender) assignments (a hot object's nodes come and go)
    edges: deque[tuple[NodeId, NodeId]] = field(
        default_factory=lambda: deque(maxlen=EDGES_KEPT))
    #: the latest connections of pulls spread over rails or paths, each
    #: (receiver, sender, address, local, path) (`PathTaken`); None until one
    paths: deque[tuple[NodeId, NodeId, str, str, int]] | None = None
    #: nodes in relay order (see ReduceRequested.relay): each pulls from the one before
    relay: tuple[NodeId, ...] = ()
    #: node -> its place in `relay` (both set by `set_relay`)
    relay_at: dict[NodeId, int] = field(default_factory=dict)
    #: learnt from a node's announcement, not from a put here (a restarted
    #: directory): other nodes may hold copies it has not heard of yet
    recovered: bool = False
    #: holders that may have a free serving slot, the ones a sender is picked
    #: from (a superset: a full or departed one is dropped when met), so a
    #: broadcast to N receivers costs O(N), not O(N^2) scans of every holder
    open: dict[NodeId, None] = field(default_factory=dict)
    #: the fanout `open` was last checked against (a larger one reopens all)
    open_fanout: int = 0
    #: holders so far (numbers `Holder.seq`)
    joined: int = 0
    #: moves on whenever a pull link breaks (a holder detached or gone).
    #: Between breaks chains only grow from anchored senders, and copies only
    #: complete, so a chain seen anchored stays so: `_can_complete` need not
    #: walk a long chain again for every receiver of a broadcast.
    epoch: int = 0
    #: the complete copies in `open`, the earliest holder first. Complete
    #: copies (all of `size` bytes) rank alike but for `Holder.seq`, and
    #: above every partial one, so the first of these is the sender whenever
    #: it may serve the receiver: a get need not scan every finished copy of
    #: a hot object fetched over time (each of them stays open). Exactly
    #: those copies, kept in step with `open` and `Holder.complete` through
    #: the methods below, so it never outgrows `open`.
    senders: EarliestFirst = field(default_factory=EarliestFirst)
    #: a striped object's stripes and their trees (stripes.py); its receivers
    #: then have no `Holder.upstream`, and each holder's `serving` is who it
    #: sends any stripe to
    stripes: Trees | None = None
    #: not striped while it has fewer holders than this (`Striping.wanted`)
    unstriped_until: int = 0
    #: receivers moved to another sender so far (racks.py): the number of
    #: the latest move's push, which replies after it carry (`seq`), so a
    #: node takes the newer of the two
    moves: int = 0

    def detach(self, node: NodeId) -> None:
        """`node` stops pulling: free the slots it used at its senders."""
        holder = self.holders[node]
        for sender in holder.also:
            self._free_slot(sender, node)
        holder.also, holder.several = (), False
        if holder.upstream is not None:
            self._free_slot(holder.upstream, node)
            self.epoch += 1  # (a link breaks: chains through it are anchored no more)
        holder.upstream = None

    def lose_source(self, node: NodeId, sender: NodeId) -> None:
        """`node` pulls from `sender` no more (it failed, or left), but goes
        on with its other senders, if it pulls from several: one of those
        (complete copies) becomes its upstream if `sender` was."""
        holder = self.holders[node]
        if sender in holder.also:
            self._free_slot(sender, node)
            holder.also = tuple(s for s in holder.also if s != sender)
        elif holder.upstream == sender:
            self._free_slot(sender, node)
            self.epoch += 1
            holder.upstream, holder.also = (holder.also[0], holder.also[1:]) if holder.also \
                else (None, ())
        holder.several = holder.upstream is not None

    def _free_slot(self, sender: NodeId, node: NodeId) -> None:
        if sender in self.holders:
            self.holders[sender].serving.discard(node)
            self.reopen(sender)  # (a slot of it is free again)

    def set_relay(self, nodes: Any) -> None:
        self.relay = tuple(nodes)
        self.relay_at = {node: i for i, node in enumerate(self.relay)}

    def reopen(self, node: NodeId) -> None:
        """`node` (a holder) may have a free serving slot."""
        self.open[node] = None
        holder = self.holders[node]
        if holder.complete:
            self.senders.add(holder.seq, node)
        elif node in self.senders.at:  # (a holder replaced by a partial one)
            self.senders.discard(node)

    def close(self, node: NodeId) -> None:
        """`node` is full or no holder any more (it is reopened when it frees a slot)."""
        self.open.pop(node, None)
        if node in self.senders.at:
            self.senders.discard(node)

    def reopen_all(self) -> None:
        self.open = dict.fromkeys(self.holders)
        self.senders.rebuild((h.seq, n) for n, h in self.holders.items() if h.complete)

    def ranked(self, node: NodeId) -> None:
        """`node`'s holder, its completeness or its place in `open` changed."""
        holder = self.holders.get(node)
        if holder is not None and holder.complete and node in self.open:
            self.senders.add(holder.seq, node)
        elif node in self.senders.at:
            self.senders.discard(node)


