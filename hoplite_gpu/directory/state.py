"""The directory's decisions as a pure state machine: events in, commands out.

No sockets, clocks or asyncio here (the h11 style): the asyncio server, the unit
tests and the network simulator all drive this same code by calling
`Directory.handle(event)` and carrying out the commands it returns.

`Directory` is a small dispatcher over parts that each own their state:

- `leases.Leases`: the live nodes, their addresses and leases;
- `requests.Requests`: which queue each unanswered request waits in, and
  which locates came on a direct connection;
- `objects.Objects`: the objects' entries and holders, the gets waiting for
  an object not put yet, the ids removed lately, and the node -> objects
  index (`holdings.Holdings`);
- `senders.Senders`: the sender choice and the serving of waiting gets;
- `reduces.Reduces`: the reduce tasks, their trees, steps and restarts;
- `channels.Channels`: each channel's head and who waits for a newer one.

Each event type goes to one handler (`Directory._handlers`); the parts call
each other's methods, and write only their own tables. Three tables are read
elsewhere, handed over at construction as read-only views because every get
reads them (a method call each would show in the per-get cost): the live
nodes (`Leases.nodes`), the direct locates (`Requests.direct`) and the reduce
tasks (`Reduces.reduces`, for a tree's tag). Tunables that several parts read
are one `Settings` record, which the directory's own attributes (``latency_s``
and the like) read and set. The events, commands and structures are defined
in their own modules and named here too, so that
``state.Put``, ``state.Directory`` and the like stay where users find them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hoplite_gpu import messages as m

from .channels import Channels
from .commands import (
    Command,
    Disconnect,
    Drop,
    InlineReduce,
    PushLocated,
    PushRestripe,
    Reply,
    StartReduceStep,
    error_body,
)
from .entry import EDGES_KEPT, EarliestFirst, Entry, Holder, Waiters
from .events import (
    CancelLocate,
    ChannelHead,
    ChannelPublish,
    Completed,
    Delete,
    DeleteMany,
    Dropped,
    Event,
    Evict,
    Heartbeat,
    InlineReduced,
    Key,
    Locate,
    NodeId,
    NodeJoined,
    NodeLost,
    PathTaken,
    Progress,
    Put,
    Query,
    ReduceConfirm,
    ReducedInputs,
    ReduceFailed,
    ReduceRequested,
    StepLost,
    Tick,
    TransferFailed,
)
from .leases import Leases
from .objects import _GONE_KEPT, Objects, _held, _held_body, _lost_reason
from .reduce_plan import (
    FOLD_STEP,
    broadcast_fanout,
    choose_degree,
    fold_unit,
    inorder_tree,
    tree_root,
)
from .reduce_task import (
    REDUCIBLE_KINDS,
    ReduceTask,
    step_id,
)
from .reduce_task import check_reduce_args as _check_reduce_args
from .reduce_task import unreducible_dtype as _unreducible_dtype
from .reduces import Reduces
from .requests import Requests
from .senders import Senders
from .settings import Settings

__all__ = [
    "EDGES_KEPT", "FOLD_STEP", "REDUCIBLE_KINDS", "CancelLocate", "ChannelHead",
    "ChannelPublish", "Command", "Completed", "Delete", "DeleteMany", "Directory",
    "Disconnect", "Drop", "Dropped", "EarliestFirst", "Entry", "Event", "Evict", "Heartbeat",
    "Holder", "InlineReduce", "InlineReduced", "Key", "Locate", "NodeId", "NodeJoined",
    "NodeLost", "PathTaken", "Progress", "PushLocated", "PushRestripe", "Put", "Query", "ReduceConfirm",
    "ReduceFailed", "ReduceRequested", "ReduceTask", "ReducedInputs", "Reply", "StartReduceStep", "StepLost",
    "Tick", "TransferFailed", "Waiters", "broadcast_fanout", "choose_degree", "error_body",
    "fold_unit", "inorder_tree", "step_id", "tree_root",
    "_GONE_KEPT", "_check_reduce_args", "_held", "_held_body", "_lost_reason",
    "_unreducible_dtype",
]

Handler = Callable[[Any, list[Command]], None]


def _setting(name: str) -> property:
    """A tunable of the shared `Settings`, read and set through the directory."""
    return property(lambda self: getattr(self._settings, name),
                    lambda self, value: setattr(self._settings, name, value))


def _table(part: str, name: str) -> property:
    """A part's table, read through the directory (tests, tools, the server)."""
    return property(lambda self: getattr(getattr(self, part), name),
                    doc=f"`{part[1:]}.{name}` (read-only: the part keeps it)")


class Directory:
    """Pure scheduling state of the directory. Feed events to `handle`."""

    #: Pick every sender by the scan of `Entry.open` alone, never by the
    #: earliest open complete copy (`Entry.senders`): the reference that
    #: tests/test_sender_choice.py holds the fast choice to.
    _scan_only = False

    def __init__(self, *, max_receivers_per_sender: int = 1, latency_s: float = 1e-4,
                 bytes_per_s: float = 1.25e9, chunk_size: int = 4 << 20,
                 lease_s: float = 5.0, instance: bytes = b"",
                 tick_s: float | None = None, fold_step: int = FOLD_STEP,
                 max_sources: int = 1, multi_source_bytes: int = 16 << 20,
                 stripes: int = 1, relay_bytes: int = 0) -> None:
        if stripes not in (0, 1, 2):
            raise ValueError(f"Directory: stripes must be 0 (the cost model's choice), 1 (off) "
                             f"or 2; got {stripes!r}")
        self._settings = Settings(max_receivers_per_sender, latency_s, bytes_per_s, chunk_size,
                                  fold_step, max_sources, multi_source_bytes, stripes,
                                  relay_bytes)
        self._leases = Leases(lease_s, tick_s)
        self._requests = Requests()
        self._channels = Channels(self._requests)
        self._objects = Objects(self._leases, self._requests)
        self._senders = Senders(self._settings, self._leases, self._requests, self._objects,
                                scan_only=self._scan_only)
        self._reduces = Reduces(self._settings, self._leases, self._requests, self._objects,
                                instance)
        self._objects.bind(self._senders, self._reduces)
        self._senders.bind(self._reduces)
        self._nodes = self._leases.nodes
        objects, reduces, channels = self._objects, self._reduces, self._channels
        self._handlers: dict[type, Handler] = {
            NodeJoined: self._on_NodeJoined, Heartbeat: self._on_Heartbeat,
            Tick: self._on_Tick, NodeLost: self._on_NodeLost,
            Put: objects.put, Progress: objects.progress, Completed: objects.completed,
            Locate: objects.locate, CancelLocate: self._on_CancelLocate,
            TransferFailed: objects.transfer_failed, PathTaken: objects.path_taken,
            Dropped: objects.dropped,
            Evict: objects.evict, Delete: self._on_Delete, DeleteMany: objects.delete_many,
            Query: self._on_Query,
            ChannelPublish: channels.publish, ChannelHead: channels.head,
            ReduceRequested: reduces.requested, ReduceFailed: reduces.step_failed,
            StepLost: reduces.step_lost, InlineReduced: reduces.inline_reduced,
            ReducedInputs: reduces.reduced_inputs, ReduceConfirm: reduces.confirm,
        }

    def handle(self, event: Event) -> list[Command]:
        handler = self._handlers.get(type(event))
        if handler is None:
            raise TypeError(f"not a directory event: {event!r}")
        out: list[Command] = []
        node = getattr(event, "node", None)
        if node and node not in self._nodes and not isinstance(event, NodeJoined | NodeLost):
            # A node declared dead (its lease ran out) whose messages were
            # still being read: it holds, pulls and asks nothing any more.
            return out
        handler(event, out)
        requests = self._requests
        if requests.direct or requests.waits:  # an answered request, whatever the answer, waits no more
            for cmd in out:
                if isinstance(cmd, Reply):
                    requests.replied(cmd.node, cmd.request)
        return out

    def describe(self, oid: Key) -> m.Description | m.Failure:
        return self._objects.describe(oid)

    # -------------------------------------------------------------- nodes ---
    def _on_NodeJoined(self, ev: NodeJoined, out: list[Command]) -> None:
        self._leases.joined(ev)

    def _on_Heartbeat(self, ev: Heartbeat, out: list[Command]) -> None:
        self._leases.heartbeat(ev)

    def _on_Tick(self, ev: Tick, out: list[Command]) -> None:
        for node, why in self._leases.expired(ev):
            out.append(Disconnect(node, why))
            self._on_NodeLost(NodeLost(node), out)

    def _on_NodeLost(self, ev: NodeLost, out: list[Command]) -> None:
        hit = self._reduces.hit_by(ev.node)
        self._leases.lost(ev.node)
        # Its unanswered requests go: its next connection numbers requests
        # anew. Only its own are visited.
        for request, kind, key in self._requests.lost(ev.node):
            self._unqueue((ev.node, request), kind, key)
        self._objects.node_lost(ev.node, out)
        for task in hit:
            self._reduces.restart(task, f"node {ev.node} was lost", out)

    # ----------------------------------------------------------- requests ---
    def _on_CancelLocate(self, ev: CancelLocate, out: list[Command]) -> None:
        where = self._requests.cancelled(ev.node, ev.request)
        if where is None:
            return  # answered already (the cancel crossed the reply), or never asked
        kind, key = where
        self._unqueue((ev.node, ev.request), kind, key)

    def _unqueue(self, request: tuple[NodeId, int], kind: str, key: Any) -> None:
        """Take `request` out of the queue it waits in (`Requests.waits` said which)."""
        if kind == "channel":
            self._channels.unqueue(request, key)
            return
        self._objects.unqueue(request, key)
        if kind == "reduce":
            self._reduces.unqueue(request, key)

    def _on_Delete(self, ev: Delete, out: list[Command]) -> None:
        self._objects.delete_many(DeleteMany(ev.node, ev.request, (ev.oid,)), out, one=True)

    def _on_Query(self, ev: Query, out: list[Command]) -> None:
        out.append(Reply(ev.node, ev.request, self.describe(ev.oid)))

    # ------------------------------------ the parts' tables, for reading ---
    nodes = _table("_leases", "nodes")
    rails = _table("_leases", "rails")
    racks = _table("_leases", "racks")
    last_seen = _table("_leases", "last_seen")
    last_tick = _table("_leases", "last_tick")
    lease_s = _table("_leases", "lease_s")
    tick_s = _table("_leases", "tick_s")
    waits = _table("_requests", "waits")
    direct = _table("_requests", "direct")
    objects = _table("_objects", "objects")
    pending = _table("_objects", "pending")
    holding = property(lambda self: self._objects.holdings.holding,
                       doc="`holdings.Holdings.holding`, the objects part's index (read-only)")
    gone = _table("_objects", "gone")
    reduces = _table("_reduces", "reduces")
    reduce_pending = _table("_reduces", "reduce_pending")
    unfinished = _table("_reduces", "unfinished")
    watching = _table("_reduces", "watching")
    failed = _table("_reduces", "failed")
    instance = _table("_reduces", "instance")
    channels = _table("_channels", "channels")
    channel_waiters = _table("_channels", "channel_waiters")

    max_receivers_per_sender = _setting("max_receivers_per_sender")
    latency_s = _setting("latency_s")
    bytes_per_s = _setting("bytes_per_s")
    chunk_size = _setting("chunk_size")
    fold_step = _setting("fold_step")
    max_sources = _setting("max_sources")
    multi_source_bytes = _setting("multi_source_bytes")
    stripes = _setting("stripes")
    relay_bytes = _setting("relay_bytes")

    # --------------------------- the sender choice, for tests that probe it ---
    def _pick_sender(self, entry: Entry, receiver: NodeId) -> NodeId | None:
        return self._senders.pick_sender(entry, receiver)

    def _can_complete(self, entry: Entry, node: NodeId) -> bool:
        return self._senders.can_complete(entry, node)

    def _assign(self, oid: Key, entry: Entry, receiver: NodeId,
                record: bool = True) -> dict[str, Any] | None:
        return self._senders.assign(oid, entry, receiver, record)
