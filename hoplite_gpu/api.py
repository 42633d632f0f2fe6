"""The user-facing verbs. Each blocking call has an ``*_async`` twin."""

from __future__ import annotations

import atexit
import logging
import numbers
import os
import threading
import time
from typing import Any

from .config import Config, check_timeout
from .device import AS_CHOICES
from .errors import InvalidArgument, NotInitialized
from .ids import ObjectID, as_object_id
from .runtime import Runtime, time_left

_lock = threading.Lock()
_runtime: Runtime | None = None
# A child forked while another thread held the lock (inside init) would wait on
# it for ever: the child starts with it free.


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    if _runtime is not None:
        _runtime.let_go_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def init(address: str | None = None, *, token: str | None = None, **settings: Any) -> Runtime:
    """Join the cluster whose directory is at `address` ("host:port"), proving
    `token`. With no address, start an embedded directory on loopback (local
    mode). Other keywords override `Config` fields (and ``HOPLITE_*`` variables).
    """
    global _runtime
    with _lock:
        if _runtime is not None and not _runtime.closed:
            raise InvalidArgument("hoplite_gpu.init() was already called; call shutdown() first")
        config = Config.from_env(token=token, **settings)
        _set_log_level(config.log_level.upper())
        _runtime = Runtime(config, address)
        return _runtime


def _set_log_level(level: str) -> None:
    """Set the "hoplite_gpu" logger's level. A level below WARNING in a program
    that set up no logging would show nothing (Python's last-resort handler
    prints warnings only): the logger then gets a handler of its own, to
    standard error."""
    logger = logging.getLogger("hoplite_gpu")
    logger.setLevel(level)
    if logger.level < logging.WARNING and not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(handler)


def shutdown() -> None:
    """Leave the cluster and free every object this process holds. Idempotent."""
    global _runtime
    with _lock:
        rt, _runtime = _runtime, None
    if rt is not None:
        rt.close()


atexit.register(shutdown)


def runtime() -> Runtime:
    rt = _runtime
    if rt is not None and rt.forked:
        raise NotInitialized("this process was forked from one that called hoplite_gpu.init(): "
                             "the runtime stays with the parent; call hoplite_gpu.init() here")
    if rt is None or rt.closed:
        raise NotInitialized("hoplite_gpu is not initialised in this process: call hoplite_gpu.init() first")
    return rt


def _timeout(rt: Runtime, timeout: float | None) -> float:
    return rt.config.timeout_s if timeout is None else check_timeout(timeout)


def _new_id(object_id: ObjectID | None) -> ObjectID:
    return ObjectID.random() if object_id is None else as_object_id(object_id)


# ---------------------------------------------------------------- verbs ---
def put(value: Any, object_id: ObjectID | None = None) -> ObjectID:
    """Store `value` (copied) and publish it; returns its ObjectID."""
    rt = runtime()
    oid = _new_id(object_id)
    # A small host value goes straight from this thread (hoplite_gpu.direct).
    deadline = time.monotonic() + rt.config.timeout_s
    if rt.put_here(value, oid, rt.config.timeout_s):
        return oid
    left = time_left(deadline)  # (what the direct try left)
    return rt.call(rt.node.put(value, oid, timeout=left, same_bytes=True), left)


def get(object_id: ObjectID, *, timeout: float | None = None, array_type: str = "cupy") -> Any:
    """Return the object's value, pulling it if needed; waits for a later put.

    NumPy values come back as read-only arrays that share the node's copy (a
    small one fetched on this thread, `hoplite_gpu.direct`: the bytes it
    received). Device objects (put from CuPy / torch CUDA arrays) come back
    as a fresh array on this process's GPU, of `array_type` "cupy" (default)
    or "torch", or as a host copy with "numpy" (always NumPy where this
    process has no GPU).
    """
    rt = runtime()
    # (checks written out: a small get's every call counts, see DirectLink.requests)
    oid = object_id if type(object_id) is ObjectID else as_object_id(object_id)
    limit = rt.config.timeout_s if timeout is None else _timeout(rt, timeout)
    if array_type not in AS_CHOICES:
        _check_array_type(array_type)
    # An inline object comes straight to this thread (hoplite_gpu.direct);
    # anything else is the loop's, with the time left.
    return rt.get(oid, limit, array_type)


def _check_array_type(array_type: str) -> None:
    if array_type not in AS_CHOICES:
        raise InvalidArgument(f"array_type must be one of {AS_CHOICES}; got {array_type!r}")


def delete(object_id: ObjectID) -> None:
    """Free every copy of the object in the cluster. This node's copy is gone
    when the call returns; other nodes drop theirs as the directory's notice
    reaches them, a moment later (a get racing the delete there may still
    return its copy). Arrays already returned stay valid."""
    rt = runtime()
    rt.call(rt.node.delete(as_object_id(object_id)), rt.config.timeout_s)


def reduce(object_ids: list[ObjectID], op: str = "sum", *, num_objects: int | None = None,
           object_id: ObjectID | None = None, root_input: ObjectID | None = None) -> ObjectID:
    """Start reducing the first `num_objects` (default: all) inputs to become
    ready; returns the result's id at once. The tree is built as inputs arrive.

    `root_input`, one of the inputs, puts the tree's root (where the result is
    produced) on the node that holds it, if it arrives among the first
    `num_objects`: pass your own input when you will get the result, and it is
    reduced where you are instead of being pulled from the last arrival."""
    rt = runtime()
    args = _reduce_args(object_ids, op, num_objects, object_id, root_input)
    return rt.call(rt.node.reduce(*args), rt.config.timeout_s)


def reduced_inputs(object_id: ObjectID, *, timeout: float | None = None) -> list[ObjectID]:
    """Exactly which inputs went into a reduce's result (waits until the reduce is done)."""
    rt = runtime()
    limit = _timeout(rt, timeout)
    return rt.call(rt.node.reduced_inputs(as_object_id(object_id), limit), limit)


def _reduce_args(object_ids, op, num_objects, object_id, root_input=None):
    from .kernels import check_op

    check_op(op)
    if isinstance(object_ids, (str, bytes, ObjectID)) or not hasattr(object_ids, "__iter__"):
        raise InvalidArgument(f"reduce takes a list of ObjectIDs; got {type(object_ids).__name__}")
    inputs = [as_object_id(o) for o in object_ids]
    if not inputs:
        raise InvalidArgument("reduce needs at least one input ObjectID")
    if len(set(inputs)) != len(inputs):
        raise InvalidArgument("reduce inputs must be distinct ObjectIDs")
    k = len(inputs) if num_objects is None else num_objects
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= len(inputs):
        raise InvalidArgument(f"num_objects must be an int from 1 to {len(inputs)}; got {num_objects!r}")
    k = int(k)  # (a NumPy integer does not go on the wire)
    if root_input is not None:
        root_input = as_object_id(root_input)
        if root_input not in inputs:
            raise InvalidArgument(f"root_input {root_input} is not one of the reduce's inputs")
    return inputs, op, k, _new_id(object_id), root_input


def object_info(object_id: ObjectID) -> dict[str, Any]:
    """What the directory knows of an object: size, layout, holders and the pull edges."""
    rt = runtime()
    return rt.call(rt.node.query(as_object_id(object_id)), rt.config.timeout_s)


def node_stats() -> dict[str, Any]:
    """This process's node counters: `objects` held; `shared_memory` (on
    here?); `kept_mappings` (objects kept as read-only mappings of a
    same-host sender's copy), `copied_from_mappings` and
    `bytes_copied_from_mappings` (pulls copied out of a same-host sender's
    mapping); `pool_hits` and `pooled_bytes` (buffer reuse; `pool_reclaimed`:
    of the hits, result arrays handed to the caller and taken back once it
    dropped them, as a sliced allreduce's); `failovers`
    (recent pulls that resumed at another sender, the last 1000 at most);
    `bytes_sent_by_address` (bytes this node's data server sent over the
    transport, per address of its own it listens on: which rail carried
    them); `direct_puts` and `direct_gets` (blocking calls of small objects made on
    the caller's thread, `hoplite_gpu.direct`)."""
    rt = runtime()
    stats = rt.call(rt.node.stats(), rt.config.timeout_s)
    if rt.direct is not None:
        stats.update(direct_puts=rt.direct.puts, direct_gets=rt.direct.gets)
    return stats


def node_id() -> str:
    """This process's node id, as it appears in `object_info`."""
    return runtime().node.node_id


async def put_async(value: Any, object_id: ObjectID | None = None) -> ObjectID:
    rt = runtime()
    return await rt.call_async(rt.node.put(value, _new_id(object_id), same_bytes=True))


async def get_async(object_id: ObjectID, *, timeout: float | None = None,
                    array_type: str = "cupy") -> Any:
    rt = runtime()
    _check_array_type(array_type)
    return await rt.call_async(rt.node.get(as_object_id(object_id), _timeout(rt, timeout),
                                           array_type))


async def delete_async(object_id: ObjectID) -> None:
    rt = runtime()
    await rt.call_async(rt.node.delete(as_object_id(object_id)))


async def reduce_async(object_ids: list[ObjectID], op: str = "sum", *,
                       num_objects: int | None = None,
                       object_id: ObjectID | None = None,
                       root_input: ObjectID | None = None) -> ObjectID:
    rt = runtime()
    return await rt.call_async(rt.node.reduce(*_reduce_args(object_ids, op, num_objects, object_id,
                                                            root_input)))


async def reduced_inputs_async(object_id: ObjectID, *, timeout: float | None = None) -> list[ObjectID]:
    rt = runtime()
    return await rt.call_async(rt.node.reduced_inputs(as_object_id(object_id), _timeout(rt, timeout)))


async def object_info_async(object_id: ObjectID) -> dict[str, Any]:
    rt = runtime()
    return await rt.call_async(rt.node.query(as_object_id(object_id)))
