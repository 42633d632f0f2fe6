"""What happens to the directory: the events its state machine is fed.

Typed and frozen; the server builds them from messages, the simulators and
the tests directly. `Event` is their union.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NodeId = str
Key = bytes  # an ObjectID's 20 raw bytes


@dataclass(frozen=True)
class NodeJoined:
    """`node` joined, its data server at `address`; `rails`: every address
    it listens on, where it has several (`address` among them); `rack`:
    where it sits in the fabric (None: not said)."""

    node: NodeId
    address: str
    now: float = 0.0
    rails: tuple[str, ...] = ()
    rack: str | None = None


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
    is answered ``Location(pushed=True)``. A node already holding or pulling a
    pulled object gets ``Location(held=True)`` and nothing changes: its own pull
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
class PathTaken:
    """A connection of `node`'s pull of `oid` from `sender` goes to
    `address` from `local` ("host:port"), on ECMP path `path` (-1: none
    chosen): kept for `Query` (the object's `paths`)."""

    node: NodeId
    oid: Key
    sender: NodeId
    address: str
    local: str
    path: int = -1


@dataclass(frozen=True)
class Dropped:
    """`node` no longer holds `oid` (its get gave up, or it freed memory)."""

    node: NodeId
    oid: Key


@dataclass(frozen=True)
class Evict:
    """`node` would free its copies of `oids` to make room for new objects.
    Answered ``Evicted(evicted=[oid, ...])``: the ones it may free, which the
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
    """Which inputs went into `target`? Answered once they are all chosen
    (without `wait`: at once, with what stands in the way if they are not)."""

    node: NodeId
    request: int
    target: Key
    wait: bool = True


@dataclass(frozen=True)
class ReduceConfirm:
    """`node` holds a complete copy of reduce result `target` from tree `tag`:
    is that still the result? Answered ``Current(current=bool)`` once the reduce is
    done (True) or the tree is rebuilt (False: the copy may hold a lost input's
    bytes, or miss a backup's, and `reduced_inputs` would not match it)."""

    node: NodeId
    request: int
    target: Key
    tag: bytes


Event = (NodeJoined | Heartbeat | Tick | NodeLost | Put | Progress | Completed | Locate | CancelLocate
         | TransferFailed | PathTaken | Dropped | Evict | Delete | DeleteMany | Query | ChannelPublish
         | ChannelHead | ReduceRequested | ReduceFailed | StepLost | InlineReduced | ReducedInputs
         | ReduceConfirm)

