"""How control messages map to the state machine's events, and errors to exceptions."""

from __future__ import annotations

from typing import Any

from hoplite_gpu import errors
from hoplite_gpu.errors import ProtocolError
from hoplite_gpu.kernels.numpy_ops import OPS
from hoplite_gpu.protocol import field

from . import state


def _id(msg: dict[str, Any], name: str) -> bytes:
    """An object id field: 20 bytes (a shorter one would reach other nodes in
    pushes and fail there)."""
    value = field(msg, name, bytes)
    if len(value) != 20:
        raise ProtocolError(f"{name} must be a 20-byte object id; got {len(value)} bytes")
    return value


def _optional(msg: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    """An optional field: `default` when absent or nil, else of type `kind`
    (a mistyped one is refused, as a required one is: read as its default,
    a put's `inline: "abc"` registered an object whose bytes nobody had)."""
    value = msg.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"field {name!r} of {msg.get('op', '?')!r} should be "
                            f"{kind.__name__}, got {type(value).__name__}")
    return value


def _tag(msg: dict[str, Any]) -> bytes | None:
    """A reduce tree's tag, where a message carries one."""
    return _optional(msg, "tag", bytes)


def to_event(node: str, msg: dict[str, Any]) -> state.Event | None:
    """Translate one message from `node`; None for ops the server answers itself."""
    op = field(msg, "op", str)
    if op == "put":
        return state.Put(node, field(msg, "rid", int), _id(msg, "oid"),
                         field(msg, "size", int), field(msg, "layout", dict),
                         _optional(msg, "inline", bytes), _optional(msg, "print", bytes))
    if op == "locate":
        return state.Locate(node, field(msg, "rid", int), _id(msg, "oid"),
                            _optional(msg, "direct", bool, False))
    if op == "cancel":
        return state.CancelLocate(node, field(msg, "request", int))
    if op == "progress":
        return state.Progress(node, _id(msg, "oid"), field(msg, "nbytes", int))
    if op == "complete":
        return state.Completed(node, _id(msg, "oid"), _optional(msg, "size", int, -1),
                               _optional(msg, "layout", dict), _optional(msg, "own", bool, False),
                               _tag(msg), _optional(msg, "print", bytes))
    if op == "failed":
        return state.TransferFailed(node, _id(msg, "oid"), field(msg, "sender", str),
                                    field(msg, "have", int))
    if op == "dropped":
        return state.Dropped(node, _id(msg, "oid"))
    if op == "evict":
        oids = field(msg, "oids", list)
        if not all(isinstance(i, bytes) and len(i) == 20 for i in oids):
            raise ProtocolError("evict oids must be 20-byte object ids")
        need = _optional(msg, "need", int, 0)
        if need < 0:
            raise ProtocolError(f"evict need must not be negative; got {need}")
        return state.Evict(node, field(msg, "rid", int), tuple(oids), need)
    if op == "delete":
        return state.Delete(node, field(msg, "rid", int), _id(msg, "oid"))
    if op == "delete_many":
        oids = field(msg, "oids", list)
        if not all(isinstance(i, bytes) and len(i) == 20 for i in oids):
            raise ProtocolError("delete_many oids must be 20-byte object ids")
        return state.DeleteMany(node, field(msg, "rid", int), tuple(oids))
    if op == "query":
        return state.Query(node, field(msg, "rid", int), _id(msg, "oid"))
    if op == "channel_publish":
        return state.ChannelPublish(node, field(msg, "rid", int), field(msg, "name", str),
                                    field(msg, "version", int))
    if op == "channel_head":
        return state.ChannelHead(node, field(msg, "rid", int), field(msg, "name", str),
                                 field(msg, "newer_than", int), _optional(msg, "wait", bool, True))
    if op == "reduce":
        inputs = field(msg, "inputs", list)
        if not all(isinstance(i, bytes) and len(i) == 20 for i in inputs):
            raise ProtocolError("reduce inputs must be 20-byte object ids")
        root_input = msg.get("root_input")
        if root_input is not None and not (isinstance(root_input, bytes) and len(root_input) == 20):
            raise ProtocolError("reduce root_input must be a 20-byte object id")
        relay = _optional(msg, "relay", bool, False)
        op_name = field(msg, "op_name", str)
        if op_name not in OPS:  # (else it would fail only later, inside a step)
            raise ProtocolError(f"unknown reduce op {op_name!r}; expected one of {', '.join(OPS)}")
        return state.ReduceRequested(node, field(msg, "rid", int), _id(msg, "target"),
                                     tuple(inputs), op_name,
                                     field(msg, "num_objects", int), root_input, relay)
    if op == "reduce_failed":
        return state.ReduceFailed(node, _id(msg, "target"), field(msg, "message", str), _tag(msg))
    if op == "step_lost":
        return state.StepLost(node, _id(msg, "target"), field(msg, "message", str), _tag(msg))
    if op == "reduced_inputs":
        return state.ReducedInputs(node, field(msg, "rid", int), _id(msg, "target"))
    if op == "reduce_confirm":
        return state.ReduceConfirm(node, field(msg, "rid", int), _id(msg, "target"),
                                   field(msg, "tag", bytes))
    return None


def raise_for_error(body: dict[str, Any]) -> dict[str, Any]:
    """Turn an ``{"error": Kind, "message": ...}`` body into the matching HopliteError."""
    kind = body.get("error")
    if kind is None:
        return body
    cls = getattr(errors, str(kind), None)
    if not (isinstance(cls, type) and issubclass(cls, errors.HopliteError)):
        cls = errors.HopliteError
    raise cls(body.get("message", str(kind)))
