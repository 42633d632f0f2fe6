"""hoplite-gpu: dynamic, pipelined, fault-tolerant collectives for task-based systems."""

from .api import (
    delete,
    delete_async,
    get,
    get_async,
    init,
    node_id,
    node_stats,
    object_info,
    object_info_async,
    put,
    put_async,
    reduce,
    reduce_async,
    reduced_inputs,
    reduced_inputs_async,
    runtime,
    shutdown,
)
from .config import Config
from .errors import (
    AuthenticationFailed,
    ConfigError,
    ConnectionRefused,
    DirectoryUnavailable,
    HopliteError,
    InvalidArgument,
    NotInitialized,
    ObjectExists,
    ObjectNotFound,
    PeerLost,
    ProtocolError,
    ReduceFailed,
    RuntimeClosed,
    StoreFull,
    Timeout,
    TransportClosed,
    TransportError,
    UnsupportedValue,
)
from .ids import ObjectID

__version__ = "0.1.0"

__all__ = [
    "AuthenticationFailed", "Config", "ConfigError", "ConnectionRefused", "DirectoryUnavailable",
    "HopliteError", "InvalidArgument", "NotInitialized", "ObjectExists", "ObjectID",
    "ObjectNotFound", "PeerLost", "ProtocolError", "ReduceFailed", "RuntimeClosed", "StoreFull",
    "Timeout", "TransportClosed", "TransportError", "UnsupportedValue", "delete",
    "delete_async", "get", "get_async", "init", "node_id", "node_stats", "object_info", "object_info_async", "put",
    "put_async", "reduce", "reduce_async", "reduced_inputs", "reduced_inputs_async", "runtime",
    "shutdown",
]
