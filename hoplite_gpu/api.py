"""The user-facing verbs. Each blocking call has an ``*_async`` twin."""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any

from .config import Config
from .errors import InvalidArgument, NotInitialized
from .ids import ObjectID, as_object_id
from .runtime import Runtime

_lock = threading.Lock()
_runtime: Runtime | None = None


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
        logging.getLogger("hoplite_gpu").setLevel(config.log_level.upper())
        _runtime = Runtime(config, address)
        return _runtime


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
    if rt is None or rt.closed:
        raise NotInitialized("hoplite_gpu is not initialised in this process: call hoplite_gpu.init() first")
    return rt


def _timeout(rt: Runtime, timeout: float | None) -> float:
    if timeout is None:
        return rt.config.timeout_s
    if not timeout > 0:
        raise InvalidArgument(f"timeout must be a positive number of seconds; got {timeout!r}")
    return float(timeout)


def _new_id(object_id: ObjectID | None) -> ObjectID:
    return ObjectID.random() if object_id is None else as_object_id(object_id)


# ---------------------------------------------------------------- verbs ---
def put(value: Any, object_id: ObjectID | None = None) -> ObjectID:
    """Store `value` (copied) and publish it; returns its ObjectID."""
    rt = runtime()
    oid = _new_id(object_id)
    return rt.call(rt.node.put(value, oid), rt.config.timeout_s)


def get(object_id: ObjectID, *, timeout: float | None = None) -> Any:
    """Return the object's value, pulling it if needed; waits for a later put.

    NumPy values come back as read-only arrays that share the node's copy.
    """
    rt = runtime()
    oid, limit = as_object_id(object_id), _timeout(rt, timeout)
    return rt.call(rt.node.get(oid, limit), limit)


def delete(object_id: ObjectID) -> None:
    """Free every copy of the object in the cluster."""
    rt = runtime()
    rt.call(rt.node.delete(as_object_id(object_id)), rt.config.timeout_s)


def object_info(object_id: ObjectID) -> dict[str, Any]:
    """What the directory knows of an object: size, layout, holders and the pull edges."""
    rt = runtime()
    return rt.call(rt.node.query(as_object_id(object_id)), rt.config.timeout_s)


def node_id() -> str:
    """This process's node id, as it appears in `object_info`."""
    return runtime().node.node_id


async def put_async(value: Any, object_id: ObjectID | None = None) -> ObjectID:
    rt = runtime()
    return await rt.call_async(rt.node.put(value, _new_id(object_id)))


async def get_async(object_id: ObjectID, *, timeout: float | None = None) -> Any:
    rt = runtime()
    return await rt.call_async(rt.node.get(as_object_id(object_id), _timeout(rt, timeout)))


async def delete_async(object_id: ObjectID) -> None:
    rt = runtime()
    await rt.call_async(rt.node.delete(as_object_id(object_id)))


async def object_info_async(object_id: ObjectID) -> dict[str, Any]:
    rt = runtime()
    return await rt.call_async(rt.node.query(as_object_id(object_id)))
