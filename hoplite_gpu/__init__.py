"""hoplite-gpu: dynamic, pipelined, fault-tolerant collectives for task-based systems.

Importing the package is cheap: the errors, ids and config load at once (the
standard library alone), while the runtime's API (numpy, msgspec, the node and
its transports) loads on first use of one of its names. So the pure parts,
`hoplite_gpu.directory` and `hoplite_gpu.simulator`, work where only the
standard library is installed.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from .config import Config
from .errors import (
    AuthenticationFailed,
    ConfigError,
    ConnectionRefused,
    DirectoryUnavailable,
    GroupBroken,
    GroupConflict,
    GroupMismatch,
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
    VersionLost,
)
from .ids import ObjectID

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ loads them
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
    from .group import Group

__version__ = "0.1.0"

# The names that live in .api, loaded on first access (PEP 562).
_API = frozenset({
    "delete", "delete_async", "get", "get_async", "init", "node_id", "node_stats",
    "object_info", "object_info_async", "put", "put_async", "reduce", "reduce_async",
    "reduced_inputs", "reduced_inputs_async", "runtime", "shutdown",
})
#: Other names loaded on first access, and the module each lives in.
_LAZY = {"Group": ".group"}


def __getattr__(name: str) -> Any:
    module = ".api" if name in _API else _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'hoplite_gpu' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _API | set(_LAZY))


class _Package(types.ModuleType):
    """The package's own module type: a submodule named like an API function
    (`hoplite_gpu.runtime`, the module, beside `hoplite_gpu.runtime()`, the
    function) is not bound over that name when it is imported, so
    `hg.runtime()` is the function whichever was imported first."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _API and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)

    def __reduce__(self) -> tuple:
        # pickled by reference, as a plain module is (Ray's cloudpickle sends
        # the functions that name `hoplite_gpu`)
        return importlib.import_module, (self.__name__,)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "AuthenticationFailed", "Config", "ConfigError", "ConnectionRefused", "DirectoryUnavailable",
    "Group", "GroupBroken", "GroupConflict", "GroupMismatch", "HopliteError", "InvalidArgument",
    "NotInitialized", "ObjectExists", "ObjectID",
    "ObjectNotFound", "PeerLost", "ProtocolError", "ReduceFailed", "RuntimeClosed", "StoreFull",
    "Timeout", "TransportClosed", "TransportError", "UnsupportedValue", "VersionLost", "delete",
    "delete_async", "get", "get_async", "init", "node_id", "node_stats", "object_info", "object_info_async", "put",
    "put_async", "reduce", "reduce_async", "reduced_inputs", "reduced_inputs_async", "runtime",
    "shutdown",
]
