"""How a node's typed messages map to the state machine's events, and errors to exceptions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hoplite_gpu import errors
from hoplite_gpu import messages as m

from . import state


def _put(node: str, msg: m.Put) -> state.Event:
    return state.Put(node, msg.rid, msg.oid, msg.size, msg.layout, msg.inline, msg.print_)


def _complete(node: str, msg: m.Complete) -> state.Event:
    return state.Completed(node, msg.oid, msg.size, msg.layout, msg.own, msg.tag, msg.print_)


def _reduce(node: str, msg: m.Reduce) -> state.Event:
    return state.ReduceRequested(node, msg.rid, msg.target, tuple(msg.inputs), msg.op_name,
                                 msg.num_objects, msg.root_input, msg.relay)


#: message type -> its event (the server answers `ping` and `nodes` itself)
EVENTS: dict[type, Callable[[str, Any], state.Event]] = {
    m.Put: _put,
    m.Locate: lambda node, msg: state.Locate(node, msg.rid, msg.oid, msg.direct),
    m.Cancel: lambda node, msg: state.CancelLocate(node, msg.request),
    m.Progress: lambda node, msg: state.Progress(node, msg.oid, msg.nbytes),
    m.Complete: _complete,
    m.Failed: lambda node, msg: state.TransferFailed(node, msg.oid, msg.sender, msg.have),
    m.PathTaken: lambda node, msg: state.PathTaken(node, msg.oid, msg.sender, msg.address,
                                                   msg.local, msg.path),
    m.Dropped: lambda node, msg: state.Dropped(node, msg.oid),
    m.Evict: lambda node, msg: state.Evict(node, msg.rid, tuple(msg.oids), msg.need),
    m.Delete: lambda node, msg: state.Delete(node, msg.rid, msg.oid),
    m.DeleteMany: lambda node, msg: state.DeleteMany(node, msg.rid, tuple(msg.oids)),
    m.Query: lambda node, msg: state.Query(node, msg.rid, msg.oid),
    m.ChannelPublish: lambda node, msg: state.ChannelPublish(node, msg.rid, msg.name,
                                                             msg.version),
    m.ChannelHead: lambda node, msg: state.ChannelHead(node, msg.rid, msg.name,
                                                       msg.newer_than, msg.wait),
    m.Reduce: _reduce,
    m.ReduceFailed: lambda node, msg: state.ReduceFailed(node, msg.target, msg.message, msg.tag),
    m.StepLost: lambda node, msg: state.StepLost(node, msg.target, msg.message, msg.tag),
    m.ReducedInputs: lambda node, msg: state.ReducedInputs(node, msg.rid, msg.target, msg.wait),
    m.ReduceConfirm: lambda node, msg: state.ReduceConfirm(node, msg.rid, msg.target, msg.tag),
}


def to_event(node: str, msg: m.Message | dict[str, Any]) -> state.Event | None:
    """The event of one message from `node` (a map is validated first:
    ProtocolError names what is wrong); None for what the server answers itself."""
    if isinstance(msg, dict):
        msg = m.from_map(msg)
    make = EVENTS.get(type(msg))
    return None if make is None else make(node, msg)


def raise_for_error(body: Any) -> Any:
    """Turn a `Failure` (or an ``{"error": Kind, "message": ...}`` map: a data
    connection's error frame) into the matching HopliteError; return any
    other body as it is."""
    if isinstance(body, m.Failure):
        kind, message = body.error, body.message
    elif isinstance(body, dict) and body.get("error") is not None:
        kind = body["error"]
        message = body.get("message", str(kind))
    else:
        return body
    cls = getattr(errors, str(kind), None)
    if not (isinstance(cls, type) and issubclass(cls, errors.HopliteError)):
        cls = errors.HopliteError
    raise cls(message)
