"""What the directory asks for: the commands its state machine returns.

The driver (the server, a simulator) carries each one out: a reply to a
request, a drop, a reduce step to start, an inline reduce to compute, a
located sender or a striped pull's new senders pushed to a node, a
connection to close. `Command` is their union.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hoplite_gpu import messages as m

from .events import Key, NodeId


def error_body(kind: str, message: str) -> m.Failure:
    return m.Failure(error=kind, message=message)


@dataclass(frozen=True)
class Reply:
    """Answer request `request` of `node` with `body` (a `messages.Failure`
    means failure); the driver sends it under the request's `rid`."""

    node: NodeId
    request: int
    body: m.Body


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
    #: the object was declared lost: a node whose copy is complete keeps it
    #: (its `complete` crossed this drop and brings the object back)
    lost: bool = False


@dataclass(frozen=True)
class StartReduceStep:
    """`node` folds its input and its children's streams into `step.output`."""

    node: NodeId
    step: m.ReduceStep


@dataclass(frozen=True)
class InlineReduce:
    """The driver should reduce these small inputs itself and report `InlineReduced`."""

    target: Key
    op: str
    layout: dict[str, Any]
    inputs: tuple[bytes, ...]


@dataclass(frozen=True)
class PushLocated:
    """Send `node`, on its own connection, the answer `body` (its `oid` is
    `oid`) to a locate of `oid` that one of its threads asked directly: the
    node starts the pull at once (`Locate.direct`)."""

    node: NodeId
    oid: Key
    body: m.Located


@dataclass(frozen=True)
class PushRestripe:
    """Send `node` the new senders of its striped pull of `oid` (`body`):
    one of its stripes moved to another sender (stripes.py)."""

    node: NodeId
    oid: Key
    body: m.Restripe


@dataclass(frozen=True)
class Disconnect:
    """Close `node`'s control connection: its lease expired and it counts as dead."""

    node: NodeId
    reason: str


Command = (Reply | Drop | StartReduceStep | InlineReduce | PushLocated | PushRestripe
           | Disconnect)
