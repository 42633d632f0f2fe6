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

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from .reduce_plan import (
    FOLD_STEP,
    broadcast_fanout,
    choose_degree,
    fold_unit,
    inorder_tree,
    tree_root,
)

NodeId = str
Key = bytes  # an ObjectID's 20 raw bytes


# ----------------------------------------------------------------- events ---
@dataclass(frozen=True)
class NodeJoined:
    node: NodeId
    address: str
    now: float = 0.0


@dataclass(frozen=True)
class Heartbeat:
    """`node` renewed its lease at time `now` (the driver's clock, in seconds)."""

    node: NodeId
    now: float


@dataclass(frozen=True)
class Tick:
    """Time passed: nodes whose lease ran out by `now` are declared dead."""

    now: float


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
    #: `values.fingerprint` of a host value put with its bytes elsewhere
    fingerprint: bytes | None = None


@dataclass(frozen=True)
class Progress:
    node: NodeId
    oid: Key
    nbytes: int


@dataclass(frozen=True)
class Completed:
    """`node` now holds every byte of `oid` (a put finished copying, or a pull ended).

    With `size` and `layout`, an object the directory does not know is registered
    (a restarted directory learns what survives from the nodes that hold it);
    `own`: the node put or made it, rather than pulled it.
    """

    node: NodeId
    oid: Key
    size: int = -1
    layout: dict[str, Any] | None = None
    own: bool = False
    #: a reduce result's tree (its root step's `tag`), if it is one
    tag: bytes | None = None
    #: `values.fingerprint` of a copy the node made (a restarted directory
    #: then still refuses a put of other bytes under the id)
    fingerprint: bytes | None = None


@dataclass(frozen=True)
class Locate:
    """`node` wants `oid`: reply with where to pull it from, when there is a sender.

    `direct`: asked by one of the node's threads on its own connection
    (docs/protocol.md, "Direct connections"). Inline bytes are answered
    alike. A sender (or "local") goes to the node itself (`PushLocated`), so
    that its loop starts the pull with no thread in between, and the thread
    is answered ``{"pushed": True}``. A node already holding or pulling a
    pulled object gets ``{"held": True}`` and nothing changes: its own pull
    goes on as it was."""

    node: NodeId
    request: int
    oid: Key
    direct: bool = False


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
class Evict:
    """`node` would free its copies of `oids` to make room for new objects.
    Answered ``{"evicted": [oid, ...]}``: the ones it may free, which the
    directory forgets as its copies at once. A copy may go only if nothing is
    lost and nothing breaks: it is complete and was pulled, not put; no
    receiver is assigned to it; no unfinished reduce takes it as an input; and
    the object is inline here or another live node holds a complete copy.
    With `need`, all or nothing: the first of `oids` (in order) that may go
    and free at least `need` bytes together, else none (a call that cannot
    get room then changes nothing)."""

    node: NodeId
    request: int
    oids: tuple[Key, ...]
    need: int = 0


@dataclass(frozen=True)
class Delete:
    node: NodeId
    request: int
    oid: Key


@dataclass(frozen=True)
class DeleteMany:
    """`Delete` of every id in `oids`, answered once (``existed``: a list)."""

    node: NodeId
    request: int
    oids: tuple[Key, ...]


@dataclass(frozen=True)
class Query:
    node: NodeId
    request: int
    oid: Key


@dataclass(frozen=True)
class ChannelPublish:
    """Version `version` of channel `name` is complete: it becomes the head if newer."""

    node: NodeId
    request: int
    name: str
    version: int


@dataclass(frozen=True)
class ChannelHead:
    """Which is the newest version of channel `name`? Answered once one newer
    than `newer_than` exists (-1: any)."""

    node: NodeId
    request: int
    name: str
    newer_than: int
    wait: bool = True


@dataclass(frozen=True)
class ReduceRequested:
    """Reduce the first `num_objects` ready `inputs` with `op` into `target`."""

    node: NodeId
    request: int
    target: Key
    inputs: tuple[Key, ...]
    op: str
    num_objects: int
    #: An input whose node should hold the result (the tree's root): the node
    #: that will get the result, so it need not pull it from elsewhere.
    root_input: Key | None = None
    #: Relay the result along the inputs' nodes in the listed order: the
    #: result's holder serves the node of the first input, that node the next
    #: one's, and so on (while each is alive). A sliced allreduce lists slice
    #: j's inputs from rank j+1 around to rank j, so every slice's result
    #: travels on the same links as its reduce chain, rank r to rank r+1, as a
    #: ring's allgather does.
    relay: bool = False


@dataclass(frozen=True)
class ReduceFailed:
    """A reduce step (or the directory's inline reduce) could not be done."""

    node: NodeId
    target: Key
    message: str
    #: the failed step's tree, if known
    tag: bytes | None = None


@dataclass(frozen=True)
class StepLost:
    """A reduce step on `node` lost a child's stream (the child died or stalled)."""

    node: NodeId
    target: Key
    message: str
    #: the step's tree, if known
    tag: bytes | None = None


@dataclass(frozen=True)
class InlineReduced:
    """The driver computed an inline reduce that `InlineReduce` asked for."""

    target: Key
    data: bytes


@dataclass(frozen=True)
class ReducedInputs:
    """Which inputs went into `target`? Answered once they are all chosen."""

    node: NodeId
    request: int
    target: Key


@dataclass(frozen=True)
class ReduceConfirm:
    """`node` holds a complete copy of reduce result `target` from tree `tag`:
    is that still the result? Answered ``{"current": bool}`` once the reduce is
    done (True) or the tree is rebuilt (False: the copy may hold a lost input's
    bytes, or miss a backup's, and `reduced_inputs` would not match it)."""

    node: NodeId
    request: int
    target: Key
    tag: bytes


Event = (NodeJoined | Heartbeat | Tick | NodeLost | Put | Progress | Completed | Locate | CancelLocate
         | TransferFailed | Dropped | Evict | Delete | DeleteMany | Query | ChannelPublish
         | ChannelHead | ReduceRequested | ReduceFailed | StepLost | InlineReduced | ReducedInputs
         | ReduceConfirm)


# --------------------------------------------------------------- commands ---
@dataclass(frozen=True)
class Reply:
    """Answer request `request` of `node` with `body` (an ``error`` key means failure)."""

    node: NodeId
    request: int
    body: dict[str, Any]


def _lost_reason(oid: Key) -> str:
    return (f"object {oid.hex()} was lost: every node holding a complete copy (or still "
            "putting it) died, left or dropped it (an object lives only as long as a "
            "process that holds it); put it again")


def _unreducible_dtype(layout: dict) -> str:
    """Why the element type of arrays of `layout` cannot be reduced ("" if it can),
    so a reduce fails when its first input arrives, not inside a step."""
    from hoplite_gpu.errors import HopliteError
    from hoplite_gpu.kernels import DTYPES
    from hoplite_gpu.values import Layout, numpy_dtype

    try:
        name = numpy_dtype(Layout.from_wire(layout)).name
    except HopliteError as exc:
        return str(exc)
    if name not in DTYPES:
        return f"cannot reduce dtype {name}; supported dtypes are {', '.join(DTYPES)}"
    return ""


@dataclass(frozen=True)
class Drop:
    """Tell `node` to forget `oid`; `reason` goes into the error its waiters see.
    With `retry`, the object will come back (a reduce restarts): waiters ask again."""

    node: NodeId
    oid: Key
    reason: str
    retry: bool = False
    #: the error its waiters get (a failed reduce's result: "ReduceFailed")
    kind: str = "ObjectNotFound"


@dataclass(frozen=True)
class StartReduceStep:
    """`node` folds its input and its children's streams into `step["output"]`."""

    node: NodeId
    step: dict[str, Any]


@dataclass(frozen=True)
class InlineReduce:
    """The driver should reduce these small inputs itself and report `InlineReduced`."""

    target: Key
    op: str
    layout: dict[str, Any]
    inputs: tuple[bytes, ...]


@dataclass(frozen=True)
class PushLocated:
    """Send `node`, on its own connection, the answer `body` to a locate of
    `oid` that one of its threads asked directly: the node starts the pull
    at once (`Locate.direct`)."""

    node: NodeId
    oid: Key
    body: dict[str, Any]


@dataclass(frozen=True)
class Disconnect:
    """Close `node`'s control connection: its lease expired and it counts as dead."""

    node: NodeId
    reason: str


Command = Reply | Drop | StartReduceStep | InlineReduce | PushLocated | Disconnect

#: Removed ids a directory remembers (see `Directory.gone`): a collective's
#: delete names up to N^2 + 4N + 2 ids (a sliced allreduce of N ranks), 4,354 at
#: N = 64, and several such deletes must fit.
_GONE_KEPT = 1 << 16

#: Layout kinds a reduce accepts: typed arrays, folded by the NumPy kernels on a
#: host buffer and by the CuPy kernels where a node keeps the object on a GPU.
REDUCIBLE_KINDS = ("numpy", "device")
#: pull assignments an object's entry keeps for `describe` (object_info)
EDGES_KEPT = 1024


def error_body(kind: str, message: str) -> dict[str, Any]:
    return {"error": kind, "message": message}


def _held(entry: Entry, node: NodeId) -> bool:
    """Does `node` hold or pull this pulled object already (see `Locate.direct`)?"""
    return entry.inline is None and node in entry.holders


def _held_body(entry: Entry) -> dict[str, Any]:
    return {"size": entry.size, "layout": entry.layout, "held": True}


# ------------------------------------------------------------------ state ---
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


@dataclass
class ReduceTask:
    target: Key
    inputs: tuple[Key, ...]
    op: str
    k: int
    size: int = -1
    layout: dict[str, Any] | None = None
    inline: bool = False
    degree: int = 1
    #: (input, node hosting it) in arrival order; the first k fill tree positions.
    slots: list[tuple[Key, NodeId]] = field(default_factory=list)
    #: tree position -> index into `slots`
    at: dict[int, int] = field(default_factory=dict)
    #: the input that takes the tree's root when it arrives among the first k
    root_input: Key | None = None
    #: relay the result in the inputs' order (see ReduceRequested.relay)
    relay: bool = False
    inline_data: list[bytes] = field(default_factory=list)
    backups: list[Key] = field(default_factory=list)
    #: every input in `slots` or `backups` (membership in O(1) at thousands of inputs)
    placed: set[Key] = field(default_factory=set)
    started: set[int] = field(default_factory=set)
    #: tree position -> its children already folded by the position's early
    #: steps (`Directory._start_ready_steps`), in the order they were folded
    folded: dict[int, list[int]] = field(default_factory=dict)
    #: tree position -> how many early steps it was sent
    phases: dict[int, int] = field(default_factory=dict)
    #: tree positions whose whole subtree (itself too) is filled
    whole: set[int] = field(default_factory=set)
    failed: str | None = None
    done: bool = False
    restarts: int = 0
    #: names this incarnation of the tree in its partial results' ids
    tag: bytes = b""
    waiters: list[tuple[NodeId, int]] = field(default_factory=list)
    #: ReduceConfirm requests of this tree, answered when it finishes or is rebuilt
    confirms: list[tuple[NodeId, int]] = field(default_factory=list)

    @property
    def chosen(self) -> list[Key]:
        return [oid for oid, _ in self.slots]

    def slot(self, pos: int) -> tuple[Key, NodeId]:
        return self.slots[self.at[pos]]

    def place(self, oid: Key) -> int:
        """The tree position for the next arrival: the lowest free one (the
        in-order rule), except that the root waits for `root_input` while
        another position is still free."""
        root = tree_root(self.k, self.degree)
        if oid == self.root_input and root not in self.at:
            return root
        skip = root if self.root_input is not None and root not in self.at else None
        # Positions fill from 0 up with at most the root out of order, so the
        # lowest free one is next to len(at).
        p = max(0, len(self.at) - 1)
        while p < self.k and (p in self.at or p == skip):
            p += 1
        return p if p < self.k else root


def step_id(target: Key, position: int, tag: bytes = b"", phase: int | None = None) -> Key:
    """Id of the partial result at a tree position. `tag` names one incarnation of
    the tree: a restarted reduce (or a restarted directory) must never match a
    stale partial result that a node still holds under an old id. `phase`
    names the output of the position's early step number `phase` (the
    children that arrived before the rest, folded ahead)."""
    import hashlib

    extra = b"" if phase is None else b"/early" + phase.to_bytes(4, "big")
    return hashlib.blake2b(target + position.to_bytes(4, "big") + tag + extra, digest_size=20,
                           person=b"hoplite-step").digest()


class Directory:
    """Pure scheduling state of the directory. Feed events to `handle`."""

    #: Pick every sender by the scan of `Entry.open` alone, never by the
    #: earliest open complete copy (`Entry.senders`): the reference that
    #: tests/test_sender_choice.py holds the fast choice to.
    _scan_only = False

    def __init__(self, *, max_receivers_per_sender: int = 1, latency_s: float = 1e-4,
                 bytes_per_s: float = 1.25e9, chunk_size: int = 4 << 20,
                 lease_s: float = 5.0, instance: bytes = b"",
                 tick_s: float | None = None, fold_step: int = FOLD_STEP) -> None:
        self.max_receivers_per_sender = max_receivers_per_sender
        self.lease_s = lease_s
        #: how often the driver sends Tick (None: as it likes; no pause is told)
        self.tick_s = tick_s
        #: distinguishes this directory's trees from a previous incarnation's
        self.instance = instance
        self._trees = 0
        #: node -> when its lease was last renewed
        self.last_seen: dict[NodeId, float] = {}
        #: the last Tick's time (None before the first)
        self.last_tick: float | None = None
        self.latency_s, self.bytes_per_s, self.chunk_size = latency_s, bytes_per_s, chunk_size
        #: the pieces a host reduce step folds and hands on in (nodes fold in
        #: `reduce_plan.FOLD_STEP`s; a simulator passes its own chunk)
        self.fold_step = fold_step
        self.nodes: dict[NodeId, str] = {}
        self.objects: dict[Key, Entry] = {}
        #: Locates for objects nobody has put yet, in arrival order.
        self.pending: dict[Key, Waiters] = {}
        #: `reduced_inputs` asked of a target no reduce produces yet: they
        #: wait for its reduce (as a get of it waits), then on it
        self.reduce_pending: dict[Key, list[tuple[NodeId, int]]] = {}
        self.reduces: dict[Key, ReduceTask] = {}
        #: targets of reduces that may be unfinished (a superset, cleaned when
        #: met): a node's loss looks among these, not among every reduce kept
        #: for `reduced_inputs`
        self.unfinished: dict[Key, None] = {}
        #: input -> targets of reduces waiting for it
        self.watching: dict[Key, set[Key]] = {}
        #: targets whose reduce failed -> why (answers later gets at once)
        self.failed: dict[Key, str] = {}
        #: channel name -> newest complete version, and who waits for a newer one
        self.channels: dict[str, int] = {}
        self.channel_waiters: dict[str, dict[tuple[NodeId, int], int]] = {}  # -> newer_than
        #: node -> ids whose entry names it as a holder or in its relay (a
        #: superset: checked on use), so a node's loss visits its own objects,
        #: not every object the directory knows
        self.holding: dict[NodeId, dict[Key, None]] = {}
        #: per node, what each of its unanswered requests waits on: ("oid", id),
        #: ("reduce", target) or ("channel", name), so a cancel looks in one
        #: place instead of every queue (a burst of timed-out gets stalled the
        #: directory in proportion to every object it knew)
        self.waits: dict[NodeId, dict[int, tuple[str, Any]]] = {}
        #: waiting locates asked on direct connections (`Locate.direct`)
        self.direct: set[tuple[NodeId, int]] = set()
        #: ids whose entry this directory removed (deleted, lost, a reduce
        #: restarted or failed), most recent last, at most `_GONE_KEPT`: a
        #: completion announced for one crossed that removal and is stale.
        #: The value says whether it was lost (every holder died or dropped
        #: it): then a putter's own copy, announced again by a node that was
        #: declared dead and came back, brings the object back.
        self.gone: OrderedDict[Key, bool] = OrderedDict()

    def handle(self, event: Event) -> list[Command]:
        method = getattr(self, "_on_" + type(event).__name__, None)
        if method is None:
            raise TypeError(f"not a directory event: {event!r}")
        out: list[Command] = []
        node = getattr(event, "node", None)
        if node and node not in self.nodes and not isinstance(event, NodeJoined | NodeLost):
            # A node declared dead (its lease ran out) whose messages were
            # still being read: it holds, pulls and asks nothing any more.
            return out
        method(event, out)
        if self.direct or self.waits:  # an answered request, whatever the answer, waits no more
            for cmd in out:
                if isinstance(cmd, Reply):
                    self.direct.discard((cmd.node, cmd.request))
                    self._answered(cmd.node, cmd.request)
        return out

    def _wait(self, node: NodeId, request: int, kind: str, key: Any) -> None:
        self.waits.setdefault(node, {})[request] = (kind, key)

    def _answered(self, node: NodeId, request: int) -> tuple[str, Any] | None:
        """What the request waited on (None: nothing); it waits no more."""
        mine = self.waits.get(node)
        if not mine:
            return None
        where = mine.pop(request, None)
        if not mine:
            del self.waits[node]
        return where

    # -------------------------------------------------------------- nodes ---
    def _on_NodeJoined(self, ev: NodeJoined, out: list[Command]) -> None:
        self.nodes[ev.node] = ev.address
        self.last_seen[ev.node] = ev.now

    def _on_Heartbeat(self, ev: Heartbeat, out: list[Command]) -> None:
        if ev.node in self.nodes:
            self.last_seen[ev.node] = max(ev.now, self.last_seen.get(ev.node, ev.now))

    def _on_Tick(self, ev: Tick, out: list[Command]) -> None:
        gap = 0.0 if self.last_tick is None else ev.now - self.last_tick
        self.last_tick = ev.now
        if self.tick_s is not None and gap > max(4 * self.tick_s, self.lease_s / 2):
            # Ticks come every `tick_s`: this long without one, the directory
            # itself was not running (stopped, starved of CPU), and the nodes'
            # heartbeats of that time wait unread in its sockets. Its pause
            # says nothing of the nodes: it is not counted against them.
            for node in self.last_seen:
                self.last_seen[node] += gap
        for node, seen in sorted(self.last_seen.items()):
            if ev.now - seen > self.lease_s:
                out.append(Disconnect(node, f"no heartbeat for {ev.now - seen:.1f}s "
                                            f"(lease {self.lease_s:g}s)"))
                self._on_NodeLost(NodeLost(node), out)

    def _on_NodeLost(self, ev: NodeLost, out: list[Command]) -> None:
        hit = self._reduces_hit_by(ev.node)
        self._forget_node(ev, out)
        for task in hit:
            self._restart_reduce(task, f"node {ev.node} was lost", out)

    def _forget_node(self, ev: NodeLost, out: list[Command]) -> None:
        self.nodes.pop(ev.node, None)
        self.last_seen.pop(ev.node, None)
        # Its unanswered requests (`waits` names each one's queue) go: its next
        # connection numbers requests anew. Only its own are visited.
        for request, (kind, key) in self.waits.pop(ev.node, {}).items():
            self.direct.discard((ev.node, request))
            self._unqueue((ev.node, request), kind, key)
        visited = self.holding.pop(ev.node, {})
        for key in visited:
            entry = self.objects.get(key)
            if entry is None:
                continue  # (removed meanwhile, by what an earlier key set off)
            if ev.node in entry.holders:
                self._forget_holder(key, entry, ev.node)
                self._after_loss(key, entry, out)
            elif ev.node in entry.relay_at and entry.waiting:
                # the next node of a relay waited for this one alone: it may
                # now pull from any holder
                self._serve_waiting(key, entry, out)
        for key in visited:
            # Still in those relays: the node may come back (a lease missed)
            # and leave again, and its successor must hear of that too.
            entry = self.objects.get(key)
            if entry is not None and ev.node in entry.relay_at:
                self._holds(ev.node, key)

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
        if entry is not None and (
                (ev.inline is not None and entry.inline is not None and ev.inline != entry.inline)
                or (ev.fingerprint and entry.fingerprint and ev.fingerprint != entry.fingerprint)):
            # Another put of the id with other bytes (a retried task whose
            # output is not deterministic, two writers of one name). The same
            # bytes again are a further copy; other bytes would let a reader
            # that fails over between the two resume mid-object and return a
            # mix of both.
            first = next((n for n, h in entry.holders.items() if h.origin), None)
            out.append(Reply(ev.node, ev.request, error_body(
                "ObjectExists",
                f"object {ev.oid.hex()} was already put with other bytes"
                + (f" (by node {first})" if first else "")
                + "; objects are immutable: use a new ObjectID (or delete it first)")))
            return
        task = self.reduces.get(ev.oid)
        if task is not None and not (task.done or task.failed):
            if entry is not None:
                out.append(Reply(ev.node, ev.request, error_body(
                    "ObjectExists", f"a reduce is making object {ev.oid.hex()}; objects are "
                    "immutable: use a new ObjectID")))
                return
            self._supersede_reduce(task, out)  # (a restarted directory: see there)
        if entry is None:
            entry = self.objects[ev.oid] = Entry(ev.size, ev.layout, ev.inline)
        if entry.fingerprint is None:
            entry.fingerprint = ev.fingerprint
        complete = ev.inline is not None or ev.size == 0
        holder = entry.holders.get(ev.node)
        if holder is None:
            self._new_holder(ev.oid, entry, ev.node, Holder(nbytes=ev.size if complete else 0,
                                                            complete=complete, origin=True))
        else:  # a re-put by a current holder keeps its links (slots it serves, its upstream)
            holder.origin = True
            if complete:
                holder.complete, holder.nbytes = True, ev.size
                entry.ranked(ev.node)
        out.append(Reply(ev.node, ev.request, {"ok": True}))
        waiters = self.pending.pop(ev.oid, ())
        entry.waiting.extend(waiters)
        self._serve_waiting(ev.oid, entry, out)
        if complete:
            self._input_ready(ev.oid, ev.node, out)

    def _on_Progress(self, ev: Progress, out: list[Command]) -> None:
        holder = self._holder(ev.oid, ev.node)
        if holder is not None and not holder.complete:
            entry = self.objects[ev.oid]
            before = holder.nbytes
            holder.nbytes = max(holder.nbytes, min(ev.nbytes, entry.size))
            if holder.nbytes > before and entry.waiting:
                # it may now be ahead of a waiting receiver that refused it before
                self._serve_waiting(ev.oid, entry, out)

    def _on_Completed(self, ev: Completed, out: list[Command]) -> None:
        entry = self.objects.get(ev.oid)
        if (entry is None and ev.size >= 0 and ev.layout is not None and ev.node in self.nodes
                and (ev.oid not in self.gone or (self.gone[ev.oid] and ev.own))):
            # Unknown: announced to a restarted directory, whose other holders
            # may announce theirs too (`recovered`). Lost: only this, its
            # putter's own copy, comes back; other copies were told to drop.
            recovered = self.gone.pop(ev.oid, None) is None
            entry = self.objects[ev.oid] = Entry(ev.size, ev.layout, None, recovered=recovered)
            self._new_holder(ev.oid, entry, ev.node, Holder(origin=ev.own))
            task = self.reduces.get(ev.oid)
            if task is not None and not (task.done or task.failed):
                self._supersede_reduce(task, out)
            entry.waiting.extend(self.pending.pop(ev.oid, ()))
        if entry is not None and entry.fingerprint is None and ev.own and ev.fingerprint:
            entry.fingerprint = ev.fingerprint
        holder = self._holder(ev.oid, ev.node)
        if (holder is None and entry is not None and entry.recovered and ev.node in self.nodes
                and (ev.size, ev.layout) == (entry.size, entry.layout)
                and ev.oid not in self.reduces):
            # Another node's copy announced to a restarted directory. (Elsewhere
            # a complete from a non-holder is a pull's that crossed a delete:
            # it is ignored, or a stale copy would be served.)
            holder = self._new_holder(ev.oid, entry, ev.node, Holder(origin=ev.own))
        if entry is None or holder is None:
            # (a full announcement of a live object from a non-holder: a node
            # declared dead that came back, whose copy the directory forgot)
            if (ev.oid in self.gone or (entry is not None and ev.size >= 0)) and ev.node in self.nodes:
                # A copy that crossed the removal (a pull completing as the id
                # was deleted, a node declared dead while it held it) must go,
                # or that node would keep serving it to its own gets. `retry`:
                # a get it started since asks again instead of failing.
                out.append(Drop(ev.node, ev.oid, f"object {ev.oid.hex()} was removed "
                                "while this copy was made", retry=True))
            return
        task = self.reduces.get(ev.oid)
        if task is not None and not task.done and self._stale(task, ev.tag):
            return  # the root of a tree since rebuilt, on this node too: not this tree's result
        holder.complete, holder.nbytes = True, entry.size
        entry.ranked(ev.node)
        self._detach(entry, ev.node)
        self._serve_waiting(ev.oid, entry, out)
        self._input_ready(ev.oid, ev.node, out)
        task = self.reduces.get(ev.oid)
        if task is not None and holder.origin and not task.done:
            self._finish_reduce(task, out)
            self._drop_steps(task, out)

    def _on_Locate(self, ev: Locate, out: list[Command]) -> None:
        entry = self.objects.get(ev.oid)
        if entry is None and ev.oid in self.failed:
            out.append(Reply(ev.node, ev.request, error_body("ReduceFailed", self.failed[ev.oid])))
            return
        if entry is None and self.gone.get(ev.oid):
            # Lost, not deleted: a get asked after the loss is told so too,
            # at once, as the gets waiting then were, instead of waiting out
            # its deadline for a put (e.g. the put's process exited: a Ray
            # task's worker). A put of the id again makes it available.
            out.append(Reply(ev.node, ev.request, error_body("ObjectNotFound", _lost_reason(ev.oid))))
            return
        if ev.direct:
            if entry is not None and _held(entry, ev.node):
                out.append(Reply(ev.node, ev.request, _held_body(entry)))
                return
            self.direct.add((ev.node, ev.request))
        self._wait(ev.node, ev.request, "oid", ev.oid)
        if entry is None:
            self.pending.setdefault(ev.oid, Waiters()).append((ev.node, ev.request))
            return
        if (entry.waiting and ev.node in entry.relay_at and entry.inline is None
                and self.max_receivers_per_sender > 0):
            self._serve_relay_arrival(ev.oid, entry, ev.node, ev.request, out)
            return
        if not entry.waiting:  # (the common case: nobody else waits; queued only if it must)
            if not self._serve_one(ev.oid, entry, ev.node, ev.request, out):
                entry.waiting.append((ev.node, ev.request))
            return
        entry.waiting.append((ev.node, ev.request))
        self._serve_waiting(ev.oid, entry, out)

    def _on_CancelLocate(self, ev: CancelLocate, out: list[Command]) -> None:
        self.direct.discard((ev.node, ev.request))
        where = self._answered(ev.node, ev.request)
        if where is None:
            return  # answered already (the cancel crossed the reply), or never asked
        kind, key = where
        request = (ev.node, ev.request)
        self._unqueue(request, kind, key)

    def _unqueue(self, request: tuple[NodeId, int], kind: str, key: Any) -> None:
        """Take `request` out of the queue it waits in (`waits` said which)."""
        if kind == "channel":
            waiters = self.channel_waiters.get(key)
            if waiters is not None:
                waiters.pop(request, None)
                if not waiters:
                    del self.channel_waiters[key]
            return
        queue, entry = self.pending.get(key), self.objects.get(key)
        if queue is not None:
            queue.discard(request)
            if not queue:
                del self.pending[key]
        if entry is not None:
            entry.waiting.discard(request)
        if kind == "reduce":  # (lists: a reduce has few of these)
            task = self.reduces.get(key)
            for waiters in (task and task.confirms, task and task.waiters,
                            self.reduce_pending.get(key)):
                if waiters and request in waiters:
                    waiters.remove(request)
            if key in self.reduce_pending and not self.reduce_pending[key]:
                del self.reduce_pending[key]

    # ----------------------------------------------------------- channels ---
    def _on_ChannelPublish(self, ev: ChannelPublish, out: list[Command]) -> None:
        if ev.version > self.channels.get(ev.name, -1):
            self.channels[ev.name] = ev.version
        out.append(Reply(ev.node, ev.request, {"ok": True, "head": self.channels[ev.name]}))
        head, still = self.channels[ev.name], {}
        for (node, request), newer_than in self.channel_waiters.pop(ev.name, {}).items():
            if head > newer_than:
                out.append(Reply(node, request, {"head": head}))
            else:
                still[node, request] = newer_than
        if still:
            self.channel_waiters[ev.name] = still

    def _on_ChannelHead(self, ev: ChannelHead, out: list[Command]) -> None:
        head = self.channels.get(ev.name, -1)
        if head > ev.newer_than or not ev.wait:
            out.append(Reply(ev.node, ev.request, {"head": head}))
        else:
            self.channel_waiters.setdefault(ev.name, {})[ev.node, ev.request] = ev.newer_than
            self._wait(ev.node, ev.request, "channel", ev.name)

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
            self._slot_lost(ev.oid, ev.node, f"node {ev.node} dropped input {ev.oid.hex()}", out)
        entry = self.objects.get(ev.oid)
        if entry is not None and ev.node in entry.relay_at:
            # It gave its copy up (its call ended, or it gave up on the
            # object): the next node of the relay, which waits for this one
            # alone, waits no more, as if this one had died.
            entry.set_relay(n for n in entry.relay if n != ev.node)
            if entry.waiting:
                self._serve_waiting(ev.oid, entry, out)

    def _slot_lost(self, oid: Key, node: NodeId, why: str, out: list[Command]) -> None:
        """`node` no longer holds `oid`: an unfinished tree that took it from
        there is rebuilt (its step would wait for the input to come back, a
        leaf's parent up to `timeout_s`), with a backup input if there is one."""
        # (unfinished reduces are exactly those watching their inputs)
        for task in [self.reduces.get(t) for t in sorted(self.watching.get(oid, ()))]:
            if (task is not None and not (task.done or task.failed or task.inline)
                    and (oid, node) in task.slots):
                self._restart_reduce(task, why, out)

    def _on_Evict(self, ev: Evict, out: list[Command]) -> None:
        chosen: list[tuple[Key, Entry]] = []
        room = 0
        for oid in dict.fromkeys(ev.oids):
            if ev.need and room >= ev.need:
                break
            entry = self.objects.get(oid)
            # (a copy this node no longer holds, evicted for another call,
            # makes no room)
            if (entry is not None and (ev.node in entry.holders or entry.inline is not None)
                    and self._may_evict(oid, entry, ev.node)):
                chosen.append((oid, entry))
                room += entry.size
        if room < ev.need:
            chosen = []  # not enough: keep them all
        for oid, entry in chosen:
            if ev.node in entry.holders:
                self._forget_holder(oid, entry, ev.node)
        out.append(Reply(ev.node, ev.request, {"evicted": [oid for oid, _ in chosen]}))

    def _may_evict(self, oid: Key, entry: Entry, node: NodeId) -> bool:
        holder = entry.holders.get(node)
        if holder is not None and (holder.origin or not holder.complete or holder.serving):
            return False
        if entry.relay_at.get(node, len(entry.relay)) < len(entry.relay) - 1:
            # the next node of a relay waits for this one alone while it lives
            after = entry.relay[entry.relay_at[node] + 1]
            if after in self.nodes and not (after in entry.holders
                                            and entry.holders[after].complete):
                return False
        if any(task is not None and not (task.done or task.failed)
               for task in map(self.reduces.get, self.watching.get(oid, ()))):
            return False
        return entry.inline is not None or any(
            h.complete and n != node and n in self.nodes for n, h in entry.holders.items())

    def _on_Delete(self, ev: Delete, out: list[Command]) -> None:
        self._on_DeleteMany(DeleteMany(ev.node, ev.request, (ev.oid,)), out, one=True)

    def _on_DeleteMany(self, ev: DeleteMany, out: list[Command], one: bool = False) -> None:
        at = len(out)  # (the answer goes first, before what the deletes tell others)
        existed = [self._delete(ev.node, oid, out) for oid in ev.oids]
        out.insert(at, Reply(ev.node, ev.request, {"ok": True,
                                                   "existed": existed[0] if one else existed}))

    def _delete(self, by: NodeId, oid: Key, out: list[Command]) -> bool:
        """Remove `oid` for node `by`; whether it existed."""
        entry = self._remove_entry(oid)
        # (a long job deletes one result per step: nothing left behind)
        task = self.reduces.pop(oid, None)
        self.unfinished.pop(oid, None)
        if task is not None:
            self._forget_watch(task)
            if not (task.done or task.failed):
                # The reduce making it ends with it: its waiters hear, its
                # partial results go (the root's copy goes with the entry's).
                self._fail_reduce(task, f"object {oid.hex()} was deleted while a reduce "
                                  "was making it", out, kind="ObjectNotFound")
            self.failed.pop(oid, None)
        for node, request in self.reduce_pending.pop(oid, ()):
            out.append(Reply(node, request, error_body(
                "ObjectNotFound", f"object {oid.hex()} was deleted before a reduce made it")))
        if entry is None:
            return False
        reason = f"object {oid.hex()} was deleted"
        for node in list(entry.holders):  # (an input of a reduce under way: rebuilt without it)
            self._slot_lost(oid, node, reason, out)
        # A recovered object may have copies that were never announced (their
        # nodes' announcements are still on the way): every node hears.
        for node in (self.nodes if entry.recovered else entry.holders):
            # The deleting node drops its own copy when the reply comes; a drop
            # arriving after that reply could cancel a get it started since.
            if node != by:
                out.append(Drop(node, oid, reason))
        for node, request in entry.waiting:
            out.append(Reply(node, request, error_body("ObjectNotFound", reason)))
        return True

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

    # ------------------------------------------------------------ reduce ---
    def _on_ReduceRequested(self, ev: ReduceRequested, out: list[Command]) -> None:
        old = self.reduces.get(ev.target)
        if old is not None:
            # The same reduce, its inputs in any order (a relayed one's order
            # is its chain's: that must match).
            same = (old.inputs == ev.inputs or (not old.relay and not ev.relay
                                                 and sorted(old.inputs) == sorted(ev.inputs)))
            if same and (old.op, old.k) == (ev.op, ev.num_objects) and old.failed:
                # Said now, not at the get: a late rank of a collective fails
                # fast, and a user sees how to ask again.
                out.append(Reply(ev.node, ev.request, error_body(
                    "ReduceFailed", f"{old.failed} (this reduce into {ev.target.hex()} failed "
                    "before; delete the target id to ask for it again)")))
            elif same and (old.op, old.k) == (ev.op, ev.num_objects):
                if old.root_input is None and ev.root_input in old.inputs:
                    old.root_input = ev.root_input  # still honoured if the root is free
                out.append(Reply(ev.node, ev.request, {"ok": True}))  # same reduce asked twice
            else:
                out.append(Reply(ev.node, ev.request, error_body(
                    "ObjectExists", f"a different reduce already produces {ev.target.hex()}")))
            return
        problem = _check_reduce_args(ev)
        if problem or ev.target in self.objects:
            out.append(Reply(ev.node, ev.request, error_body(
                "InvalidArgument", problem or f"object {ev.target.hex()} already exists")))
            return
        task = self.reduces[ev.target] = ReduceTask(ev.target, ev.inputs, ev.op, ev.num_objects)
        self.unfinished[ev.target] = None
        task.root_input = ev.root_input if ev.root_input in ev.inputs else None
        task.relay = ev.relay
        task.tag = self._next_tag()
        self.failed.pop(ev.target, None)
        task.waiters.extend(self.reduce_pending.pop(ev.target, ()))
        out.append(Reply(ev.node, ev.request, {"ok": True}))
        for oid in ev.inputs:
            self.watching.setdefault(oid, set()).add(ev.target)
        for oid in ev.inputs:
            holder = self._ready_holder(oid)
            if holder is not None:
                self._add_input(task, oid, holder, out)

    def _on_ReduceFailed(self, ev: ReduceFailed, out: list[Command]) -> None:
        task = self.reduces.get(ev.target)
        if task is not None and not self._stale(task, ev.tag):
            self._fail_reduce(task, ev.message, out)

    def _on_InlineReduced(self, ev: InlineReduced, out: list[Command]) -> None:
        task = self.reduces.get(ev.target)
        if task is None or task.failed or ev.target in self.objects or task.layout is None:
            return
        entry = self.objects[ev.target] = Entry(task.size, task.layout, ev.data)
        self._finish_reduce(task, out)
        entry.waiting.extend(self.pending.pop(ev.target, ()))
        self._serve_waiting(ev.target, entry, out)
        self._input_ready(ev.target, "", out)

    def _on_ReducedInputs(self, ev: ReducedInputs, out: list[Command]) -> None:
        task = self.reduces.get(ev.target)
        if task is None and (ev.target in self.gone or ev.target in self.objects):
            out.append(Reply(ev.node, ev.request, error_body(
                "ObjectNotFound", f"no reduce produces {ev.target.hex()}"
                + (" (it was deleted or lost)" if ev.target in self.gone else
                   " (it is an object that was put)"))))
        elif task is None:  # (its reduce not asked for yet: waits for it, as a get does)
            self.reduce_pending.setdefault(ev.target, []).append((ev.node, ev.request))
            self._wait(ev.node, ev.request, "reduce", ev.target)
        elif task.failed:
            out.append(Reply(ev.node, ev.request, error_body("ReduceFailed", task.failed)))
        elif task.done:
            out.append(Reply(ev.node, ev.request, {"inputs": task.chosen}))
        else:  # answered when the result is complete: a failover may still change the set
            task.waiters.append((ev.node, ev.request))
            self._wait(ev.node, ev.request, "reduce", ev.target)

    def _on_ReduceConfirm(self, ev: ReduceConfirm, out: list[Command]) -> None:
        task = self.reduces.get(ev.target)
        if task is None:  # deleted (or never a tree reduce): nothing can replace the copy
            out.append(Reply(ev.node, ev.request, {"current": True}))
        elif task.failed:
            out.append(Reply(ev.node, ev.request, error_body("ReduceFailed", task.failed)))
        elif task.tag != ev.tag:
            out.append(Reply(ev.node, ev.request, {"current": False}))
        elif task.done:
            out.append(Reply(ev.node, ev.request, {"current": True}))
        else:  # the root's completion may still lose the race with a failover
            task.confirms.append((ev.node, ev.request))
            self._wait(ev.node, ev.request, "reduce", ev.target)

    def _answer_confirms(self, task: ReduceTask, current: bool, out: list[Command]) -> None:
        for node, request in task.confirms:
            out.append(Reply(node, request, {"current": current}))
        task.confirms.clear()

    def _on_StepLost(self, ev: StepLost, out: list[Command]) -> None:
        task = self.reduces.get(ev.target)
        if task is not None and not task.done and not task.failed and not self._stale(task, ev.tag):
            self._restart_reduce(task, f"a step lost a child stream: {ev.message}", out)

    def _stale(self, task: ReduceTask, tag: bytes | None) -> bool:
        """Whether a message about `task` came from a tree this directory has
        since rebuilt (its steps were dropped, but the message crossed the
        drop). Tags of another directory (before a restart) are not stale
        here: what they report is all there is to go on."""
        return (tag is not None and tag != task.tag
                and tag[:len(self.instance)] == self.instance and len(tag) == len(task.tag))

    def _next_tag(self) -> bytes:
        self._trees += 1
        return self.instance + self._trees.to_bytes(8, "big")

    def _finish_reduce(self, task: ReduceTask, out: list[Command]) -> None:
        task.done = True
        self.unfinished.pop(task.target, None)
        self._forget_watch(task)  # (a re-put input must not join a finished reduce)
        for waiter, request in task.waiters:
            out.append(Reply(waiter, request, {"inputs": task.chosen}))
        task.waiters.clear()
        self._answer_confirms(task, True, out)

    def _reduces_hit_by(self, node: NodeId) -> list[ReduceTask]:
        """Unfinished tree reduces with a slot, or the result's root, on `node`."""
        hit = []
        for target in list(self.unfinished):
            task = self.reduces.get(target)
            if task is None or task.done or task.failed or task.inline:
                del self.unfinished[target]
                continue
            if any(host == node for _, host in task.slots):
                hit.append(task)
        return hit

    def _restart_reduce(self, task: ReduceTask, why: str, out: list[Command]) -> None:
        """Rebuild the tree from the inputs that still have a live holder.

        Every partial result may include the lost branch, so all of them go: the
        steps' outputs, the result's root and the readers' partial copies (told
        to retry, so their gets start over when the new root exists).
        """
        task.restarts += 1
        if task.restarts > 2 * len(task.inputs) + 5:
            self._fail_reduce(task, f"gave up after {task.restarts - 1} restarts; last: {why}", out)
            return
        reason = f"the reduce into {task.target.hex()} restarts: {why}"
        self._answer_confirms(task, False, out)  # copies of this tree are superseded
        self._end_all_steps(task, reason, out)
        entry = self._remove_entry(task.target)
        if entry is not None:
            for node in entry.holders:
                out.append(Drop(node, task.target, reason, retry=True))
            if entry.waiting:
                self.pending.setdefault(task.target, Waiters()).extend(entry.waiting)
        order = [*task.chosen, *task.backups]
        task.slots, task.at, task.backups, task.started = [], {}, [], set()
        task.folded, task.phases, task.whole = {}, {}, set()
        task.placed = set()
        task.tag = self._next_tag()
        for oid in order:
            holder = self._ready_holder(oid)
            if holder is not None:
                self._add_input(task, oid, holder, out)

    def _ready_holder(self, oid: Key) -> NodeId | None:
        entry = self.objects.get(oid)
        if entry is None:
            return None
        if entry.inline is not None:
            return ""
        complete = [n for n, h in entry.holders.items() if h.complete and n in self.nodes]
        origins = [n for n in complete if entry.holders[n].origin]
        return (origins or complete or [None])[0]

    def _input_ready(self, oid: Key, node: NodeId, out: list[Command]) -> None:
        for target in sorted(self.watching.get(oid, ())):
            task = self.reduces.get(target)
            if task is not None:
                self._add_input(task, oid, node, out)

    def _add_input(self, task: ReduceTask, oid: Key, node: NodeId, out: list[Command]) -> None:
        if task.failed or oid in task.placed:
            return
        if len(task.slots) >= task.k:
            task.backups.append(oid)
            task.placed.add(oid)
            return
        entry = self.objects[oid]
        problem = self._check_input(task, oid, entry)
        if problem:
            self._fail_reduce(task, problem, out)
            return
        pos = task.place(oid)
        task.at[pos] = len(task.slots)
        task.slots.append((oid, node))
        task.placed.add(oid)
        if task.inline:
            task.inline_data.append(entry.inline or b"")
        if len(task.slots) == task.k:
            if task.inline:
                out.append(InlineReduce(task.target, task.op, task.layout or {},
                                        tuple(task.inline_data)))
        if not task.inline:
            # The new position, and the parent of each subtree it completed,
            # can have become startable.
            # Walk up only through the subtrees this arrival completes (each
            # completes once: O(k·d) for a whole tree, not O(depth) per input,
            # which is O(k) on a chain).
            parent, children = inorder_tree(task.k, task.degree)
            candidates, at = [pos], pos
            while (at is not None and at in task.at
                   and all(c in task.whole for c in children[at])):
                task.whole.add(at)
                at = parent[at]
                if at is not None:
                    candidates.append(at)
            self._start_ready_steps(task, out, tuple(candidates))

    def _check_input(self, task: ReduceTask, oid: Key, entry: Entry) -> str | None:
        if task.layout is None:
            if entry.layout.get("kind") not in REDUCIBLE_KINDS:
                return (f"input {oid.hex()} is a {entry.layout.get('kind')!r} object; reduce "
                        "works on NumPy and device arrays")
            refused = _unreducible_dtype(entry.layout)
            if refused:
                return f"input {oid.hex()}: {refused}"
            task.size, task.layout, task.inline = entry.size, entry.layout, entry.inline is not None
            # A relayed reduce is one slice of an allreduce: a chain, so that
            # every slice moves from rank r to rank r+1 only, as in a ring (a
            # tree that is best for one reduce alone loads its inner nodes'
            # links twice while every other slice runs too).
            # (the pipelining unit: a host step's fold pieces, a device step's chunks)
            unit = self.chunk_size if entry.layout.get("kind") == "device" \
                else fold_unit(entry.size, min(self.chunk_size, self.fold_step))
            task.degree = 1 if task.relay else choose_degree(
                task.size, task.k, self.latency_s, self.bytes_per_s, unit)
            return None
        if entry.size != task.size or entry.layout != task.layout:
            first = task.slots[0][0].hex() if task.slots else "?"
            return (f"input {oid.hex()} has {entry.size} bytes and layout {entry.layout}, but "
                    f"input {first} has {task.size} bytes and layout {task.layout}; every input "
                    "of a reduce must have the same dtype and shape")
        if task.inline != (entry.inline is not None):
            return f"input {oid.hex()} was put with a different inline threshold than the others"
        return None

    def _start_ready_steps(self, task: ReduceTask, out: list[Command],
                           candidates: tuple[int, ...]) -> None:
        """Start each of `candidates` (tree positions) whose input and children's
        subtrees have arrived. A position whose input is in while only some
        of its children's subtrees are gets an early step for those: it
        folds them ahead into a partial result of its own, and the next step
        there takes that as its input. Otherwise a wide node would pull every
        child's stream only once its last child came: `d·S/B` after a late
        input at each level, where a chain needs `S/B`; folded ahead, the last
        child's stream is the one left. A child is folded only once its
        whole subtree is in, so a step never waits on inputs that have not
        arrived (which may take longer than any deadline), only on bytes."""
        parent, children = inorder_tree(task.k, task.degree)
        for pos in sorted(set(candidates)):
            if pos not in task.at or pos in task.started:
                continue
            folded = task.folded.get(pos, ())
            fresh = [c for c in children[pos] if c in task.whole and c not in folded]
            is_root = parent[pos] is None
            if len(fresh) + len(folded) < len(children[pos]):
                if fresh:  # some arrived, others not: fold these ahead
                    out.append(StartReduceStep(task.slot(pos)[1], self._step(task, pos, fresh)))
                    task.folded.setdefault(pos, []).extend(fresh)
                    task.phases[pos] = task.phases.get(pos, 0) + 1
                continue
            if children[pos] or is_root:
                task.started.add(pos)
                out.append(StartReduceStep(task.slot(pos)[1],
                                           self._step(task, pos, fresh, final=True)))
            if is_root:
                self._register_result(task, task.slot(pos)[1], out)

    def _step(self, task: ReduceTask, pos: int, kids: list[int],
              final: bool = False) -> dict[str, Any]:
        """The command of a step at `pos` folding `kids` (children of it) into
        what the position holds so far: its input, or its last early step's
        output. Final: the position's own output (the target at the root);
        else the output of a new early step."""
        parent, children = inorder_tree(task.k, task.degree)
        sources = []
        for c in kids:
            source = step_id(task.target, c, task.tag) if children[c] else task.slot(c)[0]
            sources.append({"oid": source, "address": self.nodes.get(task.slot(c)[1], "")})
        done = task.phases.get(pos, 0)
        is_root = final and parent[pos] is None
        output = (task.target if is_root else step_id(task.target, pos, task.tag) if final
                  else step_id(task.target, pos, task.tag, done))
        step = {"target": task.target, "output": output,
                "input": step_id(task.target, pos, task.tag, done - 1) if done else task.slot(pos)[0],
                "children": sources, "reduce_op": task.op,
                "count": task.k if is_root else 0, "size": task.size, "layout": task.layout,
                "tag": task.tag}
        if done:
            step["early"] = True  # (its input is this node's own early step's output)
        return step

    @staticmethod
    def _step_outputs(task: ReduceTask) -> list[tuple[int, Key]]:
        """(position, output) of every partial result of `task`'s tree: its
        started steps' (but the root's, which is the target) and its early
        steps'."""
        parent, _ = inorder_tree(task.k, task.degree)
        outputs = [(pos, step_id(task.target, pos, task.tag))
                   for pos in task.started if parent[pos] is not None]
        for pos, count in task.phases.items():
            outputs.extend((pos, step_id(task.target, pos, task.tag, n)) for n in range(count))
        return outputs

    def _register_result(self, task: ReduceTask, node: NodeId, out: list[Command]) -> None:
        """The root's output is the target object: readable (pipelined) while it is reduced."""
        old = self.objects.get(task.target)  # (none: a put or announcement supersedes the task)
        entry = self.objects[task.target] = Entry(task.size, task.layout or {}, None)
        if old is not None:
            entry.waiting.extend(old.waiting)
            self._unhold(task.target, old)
        if task.relay:
            hosts = dict(task.slots)
            order = [node] + [hosts[i] for i in task.inputs if i in hosts]
            entry.set_relay(dict.fromkeys(order))  # each node once, the root first
            for member in entry.relay:
                self._holds(member, task.target)
        self._new_holder(task.target, entry, node, Holder(origin=True))
        entry.waiting.extend(self.pending.pop(task.target, ()))
        self._serve_waiting(task.target, entry, out)

    def _drop_steps(self, task: ReduceTask, out: list[Command]) -> None:
        """The result is complete: intermediate partial results can go."""
        for pos, oid in self._step_outputs(task):
            if pos in task.at:
                self._drop_partial(task.slot(pos)[1], oid,
                                   "the reduce finished; its partial results are freed", out)
        self._forget_watch(task)

    def _forget_watch(self, task: ReduceTask) -> None:
        for oid in task.inputs:
            targets = self.watching.get(oid)
            if targets is not None:
                targets.discard(task.target)
                if not targets:
                    del self.watching[oid]

    def _supersede_reduce(self, task: ReduceTask, out: list[Command]) -> None:
        """A node announced a complete copy of an unfinished reduce's target
        (to a restarted directory: a result made before the restart, while
        the reduce was asked again), or put the id, before the tree made it:
        that object is the result. The reduce is forgotten, as if it had been
        asked after the object existed: its partial results go, and whoever
        waits for its inputs hears they are unknown here."""
        del self.reduces[task.target]
        self.unfinished.pop(task.target, None)
        self._forget_watch(task)
        message = (f"the inputs of the reduce into {task.target.hex()} are unknown to this "
                   "directory: the object was announced (or put) before the reduce finished "
                   "here, e.g. after a directory restart")
        for node, request in task.waiters:
            out.append(Reply(node, request, error_body("ObjectNotFound", message)))
        self._answer_confirms(task, True, out)  # the announced copy is final
        self._end_all_steps(task, message, out)

    def _fail_reduce(self, task: ReduceTask, message: str, out: list[Command],
                     kind: str = "ReduceFailed") -> None:
        if task.failed:
            return
        task.failed = self.failed[task.target] = message
        self.unfinished.pop(task.target, None)
        self._forget_watch(task)
        for node, request in [*task.waiters, *task.confirms]:
            out.append(Reply(node, request, error_body(kind, message)))
        task.waiters.clear()
        task.confirms.clear()
        for node, request in self.pending.pop(task.target, ()):
            out.append(Reply(node, request, error_body(kind, message)))
        entry = self._remove_entry(task.target)
        if entry is not None:
            for node in entry.holders:
                out.append(Drop(node, task.target, message, kind=kind))
            for node, request in entry.waiting:
                out.append(Reply(node, request, error_body(kind, message)))
        self._end_all_steps(task, message, out)

    def _end_all_steps(self, task: ReduceTask, message: str, out: list[Command]) -> None:
        """Every started step of `task` ends, its partial result dropped."""
        for pos, oid in self._step_outputs(task):
            self._drop_partial(task.slot(pos)[1], oid, message, out)

    def _drop_partial(self, node: NodeId, oid: Key, reason: str, out: list[Command]) -> None:
        """A reduce step's output on `node` goes. A node declared dead may be
        alive and come back: it would announce that output as an object of
        its own, kept for good; remembered as gone, the announcement is
        answered with a drop instead."""
        if node in self.nodes:
            out.append(Drop(node, oid, reason))
        else:
            self._remove_entry(oid)

    # ------------------------------------------------------------ helpers ---
    def _holder(self, oid: Key, node: NodeId) -> Holder | None:
        entry = self.objects.get(oid)
        return None if entry is None else entry.holders.get(node)

    def _detach(self, entry: Entry, node: NodeId) -> None:
        """`node` stops pulling: free the slot it used at its sender."""
        holder = entry.holders[node]
        if holder.upstream is not None and holder.upstream in entry.holders:
            entry.holders[holder.upstream].serving.discard(node)
            entry.reopen(holder.upstream)  # (a slot of it is free again)
        if holder.upstream is not None:
            entry.epoch += 1  # (a link breaks: chains through it are anchored no more)
        holder.upstream = None

    def _forget_holder(self, oid: Key, entry: Entry, node: NodeId) -> None:
        self._detach(entry, node)
        gone = entry.holders.pop(node)
        entry.close(node)
        entry.epoch += 1
        if node not in entry.relay_at:
            self._let_go(node, oid)
        for receiver in gone.serving:
            if receiver in entry.holders:
                entry.holders[receiver].upstream = None
        if any(receiver == node for receiver, _ in entry.edges):  # (its pulls are history now)
            entry.edges = deque((e for e in entry.edges if e[0] != node), maxlen=EDGES_KEPT)

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
        seen: dict[NodeId, Holder] = {}
        cur: NodeId | None = node
        while cur is not None and cur not in seen and cur in entry.holders:
            holder = entry.holders[cur]
            if holder.complete or holder.origin or holder.anchored == entry.epoch:
                for walked in seen.values():  # (until the next break, without the walk)
                    walked.anchored = entry.epoch
                return True
            seen[cur] = holder
            cur = holder.upstream
        return False

    def _after_loss(self, oid: Key, entry: Entry, out: list[Command]) -> None:
        """If no holder can ever complete any more, the object is lost: say so to everyone."""
        if entry.inline is not None:
            return
        if any(h.complete or h.origin for h in entry.holders.values()):
            self._serve_waiting(oid, entry, out)
            return
        task = self.reduces.get(oid)
        if task is not None and not task.done and not task.failed:
            return  # the result of a reduce in flight: the reduce restarts and rebuilds it
        self._remove_entry(oid, lost=True)
        reason = _lost_reason(oid)
        for node in entry.holders:
            out.append(Drop(node, oid, reason))
        for node, request in entry.waiting:
            out.append(Reply(node, request, error_body("ObjectNotFound", reason)))

    def _remove_entry(self, oid: Key, lost: bool = False) -> Entry | None:
        self.gone[oid] = lost
        self.gone.move_to_end(oid)
        if len(self.gone) > _GONE_KEPT:
            self.gone.popitem(last=False)
        entry = self.objects.pop(oid, None)
        if entry is not None:
            self._unhold(oid, entry)
        return entry

    def _new_holder(self, oid: Key, entry: Entry, node: NodeId, holder: Holder) -> Holder:
        entry.joined += 1
        holder.seq = entry.joined
        entry.holders[node] = holder
        entry.reopen(node)
        mine = self.holding.get(node)  # (`_holds`, inline: once per holder of every object)
        if mine is None:
            mine = self.holding[node] = {}
        mine[oid] = None
        return holder

    def _holds(self, node: NodeId, oid: Key) -> None:
        """`oid`'s entry names `node` (a holder, or in its relay): see `holding`."""
        self.holding.setdefault(node, {})[oid] = None

    def _let_go(self, node: NodeId, oid: Key) -> None:
        mine = self.holding.get(node)
        if mine is not None:  # (an empty one stays while the node lives: it is reused)
            mine.pop(oid, None)

    def _unhold(self, oid: Key, entry: Entry) -> None:
        """`entry` of `oid` is gone or replaced: no node holds it through it."""
        holding = self.holding
        for nodes in (entry.holders, entry.relay):
            for node in nodes:
                mine = holding.get(node)
                if mine is not None:
                    mine.pop(oid, None)

    def _fanout(self, entry: Entry) -> int:
        """Receivers one holder may serve at once: the configured number, or
        with 0 ("auto") the cost model's choice for the receivers seen so far."""
        if self.max_receivers_per_sender > 0:
            return self.max_receivers_per_sender
        receivers = len(entry.holders) + len(entry.waiting)
        return broadcast_fanout(entry.size, receivers, self.latency_s, self.bytes_per_s,
                                self.chunk_size)

    def _pick_sender(self, entry: Entry, receiver: NodeId) -> NodeId | None:
        choice = self._best_sender(entry, receiver, avoid_failed=True)
        mine = entry.holders.get(receiver)
        if choice is None and mine is not None and mine.failed_from:
            # Only senders that failed us before are left. A stall may have been
            # passing, and one that is truly dead is removed when its lease ends:
            # try them again rather than wait for nothing.
            choice = self._best_sender(entry, receiver, avoid_failed=False)
            if choice is not None:
                mine.failed_from.discard(choice)
        return choice

    def _best_sender(self, entry: Entry, receiver: NodeId, avoid_failed: bool) -> NodeId | None:
        mine = entry.holders.get(receiver)
        have = mine.nbytes if mine else 0
        # (nobody can pull from a receiver that serves nobody, even through others)
        served = mine is not None and bool(mine.serving)
        if entry.relay_at.get(receiver, 0) > 0:
            before = entry.relay[entry.relay_at[receiver] - 1]
            if before in self.nodes and not (avoid_failed and mine is not None
                                             and before in mine.failed_from):
                # The node before this one in the relay serves it, and only it:
                # wait until that node holds (or pulls) the result, as it will.
                holder = entry.holders.get(before)
                if (holder is None or not (holder.complete or self._can_complete(entry, before))
                        or (served and self._depends_on(entry, before, receiver))):
                    return None
                if holder.complete or holder.origin or holder.nbytes >= have:
                    return before
            # that node is gone, failed us, or is behind us: any other holder
        best: tuple[bool, int, int] | None = None
        choice: NodeId | None = None
        fanout = self._fanout(entry)
        if fanout > entry.open_fanout:  # (holders found full before may have room now)
            entry.reopen_all()
        entry.open_fanout = fanout
        while entry.senders.items and not self._scan_only:
            # The earliest open complete copy outranks every other candidate:
            # if it may serve this receiver (the checks below, for a complete
            # copy), it is the scan's choice too.
            node = entry.senders.first()
            holder = entry.holders[node]
            if len(holder.serving) >= fanout:
                entry.close(node)  # (as the scan would: full)
                continue
            if not (node == receiver or node not in self.nodes
                    or (avoid_failed and mine is not None and node in mine.failed_from)
                    or (served and self._depends_on(entry, node, receiver))):
                return node
            break  # (not for this receiver: any other may be)
        for node in list(entry.open):
            holder = entry.holders.get(node)
            if holder is None or len(holder.serving) >= fanout:
                entry.close(node)  # (reopened when it frees a slot or the fanout grows)
                continue
            if (node == receiver or node not in self.nodes
                    or (avoid_failed and mine is not None and node in mine.failed_from)
                    or not (holder.complete or self._can_complete(entry, node))
                    or (served and self._depends_on(entry, node, receiver))):
                continue
            if not holder.complete and holder.nbytes < have and not holder.origin:
                # A partial copy behind ours helps only once it overtakes us; a
                # complete or further-ahead one is better, so wait for it.
                continue
            rank = (holder.complete, holder.nbytes, -holder.seq)
            if best is None or rank > best:
                best, choice = rank, node
        return choice

    def _serve_waiting(self, oid: Key, entry: Entry, out: list[Command]) -> None:
        """Hand senders to waiting receivers, oldest first, while any sender is free.

        Each assignment creates a new partial holder that an earlier waiter may
        pull from, so passes repeat until one assigns nobody.
        """
        progress = True
        while progress and entry.waiting:
            progress = False
            for node, request in list(entry.waiting):  # (the ones served leave it)
                if self._serve_one(oid, entry, node, request, out):
                    entry.waiting.discard((node, request))
                    progress = True

    def _serve_one(self, oid: Key, entry: Entry, node: NodeId, request: int,
                   out: list[Command]) -> bool:
        """Answer one waiting request if a sender (or the bytes) can be had
        now; False if it must wait on. The caller keeps the queue."""
        if (node, request) in self.direct and _held(entry, node):
            out.append(Reply(node, request, _held_body(entry)))
            return True
        # (a direct call's thread keeps no copy of inline bytes: it
        # is no holder, or a later drop would be mistaken for newer
        # than the node's next put of the id)
        body = self._assign(oid, entry, node, record=(node, request) not in self.direct)
        if body is None:
            return False
        if (node, request) in self.direct and "inline" not in body:
            out.append(PushLocated(node, oid, body))
            body = {"size": entry.size, "layout": entry.layout, "pushed": True}
        out.append(Reply(node, request, body))
        return True

    def _serve_relay_arrival(self, oid: Key, entry: Entry, node: NodeId, request: int,
                             out: list[Command]) -> None:
        """A get of a relayed result from a node of the relay, while others
        wait. Its arrival changes no holder, so no one else can be served
        now but through it: serve it if its node's predecessor can, then the
        next node of the relay if it waits, and so on. (A pass over every
        waiter per get cost a slice of an allreduce of N ranks O(N^2); the
        others are still checked at every progress and completion.)"""
        entry.waiting.append((node, request))
        while True:
            served = False
            for req in entry.waiting.of_node(node):
                if self._serve_one(oid, entry, node, req, out):
                    entry.waiting.discard((node, req))
                    served = True
            at = entry.relay_at.get(node, len(entry.relay))
            if not served or at + 1 >= len(entry.relay):
                return
            node = entry.relay[at + 1]

    def _assign(self, oid: Key, entry: Entry, receiver: NodeId,
                record: bool = True) -> dict[str, Any] | None:
        base = {"size": entry.size, "layout": entry.layout}
        task = self.reduces.get(oid)
        reducing = task is not None and not (task.done or task.failed or task.inline)
        if reducing:
            base["reduce_tag"] = task.tag  # confirm the copy before handing it out
        mine = entry.holders.get(receiver)
        if entry.inline is not None:
            if record and receiver not in entry.holders:
                self._new_holder(oid, entry, receiver, Holder(nbytes=entry.size, complete=True))
            return {**base, "inline": entry.inline}
        if mine is not None and mine.complete:
            return {**base, "local": True}
        if mine is not None and mine.origin and reducing:
            # The reduce's root step runs on this node and makes the result
            # here: pulling it as well would only move its bytes twice.
            return None
        if entry.size == 0:
            self._new_holder(oid, entry, receiver, Holder(complete=True))
            return {**base, "local": True}
        if mine is not None and mine.upstream is not None:
            self._detach(entry, receiver)  # asked again while pulling: free the old slot
        sender = self._pick_sender(entry, receiver)
        if sender is None:
            return None
        if mine is None:
            mine = self._new_holder(oid, entry, receiver, Holder())
        mine.upstream = sender
        entry.holders[sender].serving.add(receiver)
        entry.edges.append((receiver, sender))
        return {**base, "sender": sender, "address": self.nodes[sender]}


def _check_reduce_args(ev: ReduceRequested) -> str | None:
    if not ev.inputs:
        return "reduce needs at least one input"
    if len(set(ev.inputs)) != len(ev.inputs):
        return "reduce inputs must be distinct objects"
    if ev.target in ev.inputs:
        return "a reduce cannot write into one of its own inputs"
    if not 1 <= ev.num_objects <= len(ev.inputs):
        return f"num_objects must be between 1 and {len(ev.inputs)}; got {ev.num_objects}"
    return None
