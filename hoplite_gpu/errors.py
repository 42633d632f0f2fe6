"""The error tree: each error is named after what happened, not who raised it."""

from __future__ import annotations


class HopliteError(Exception):
    """Base class of every error hoplite-gpu raises on purpose."""


class ConfigError(HopliteError, ValueError):
    """A configuration value or environment variable is invalid or unknown."""


class NotInitialized(HopliteError, RuntimeError):
    """An API call was made before `init()` or after `shutdown()`."""


class RuntimeClosed(HopliteError, RuntimeError):
    """The runtime was shut down while the call was waiting."""


class UnsupportedValue(HopliteError, TypeError):
    """`put` was given a value that is neither an array nor a byte buffer."""


class InvalidArgument(HopliteError, ValueError):
    """A call's argument is malformed (bad id, bad op, empty list, ...)."""


class ObjectNotFound(HopliteError, KeyError):
    """No copy of the object exists (not yet put, deleted, or every holder was lost)."""

    def __str__(self) -> str:  # KeyError quotes its message; we don't want that
        return str(self.args[0]) if self.args else "object not found"


class VersionLost(ObjectNotFound):
    """A weight channel's version has no copy left anywhere: every process
    that held it whole (its publisher, readers that had fetched it) left."""

    def __init__(self, message: str, channel: str = "", version: int = -1) -> None:
        super().__init__(message)
        self.channel, self.version = channel, version

    def __reduce__(self) -> tuple:  # (pickled whole: Ray and worker processes send errors)
        return type(self), (str(self), self.channel, self.version)


class ObjectExists(HopliteError):
    """An object with this id already exists with a different size or layout."""


class Timeout(HopliteError, TimeoutError):
    """A wait passed its deadline."""


class AuthenticationFailed(HopliteError):
    """The peer could not prove knowledge of the cluster token (or we could not)."""


class ProtocolError(HopliteError):
    """A peer sent a message that does not follow the wire protocol."""


class TransportError(HopliteError):
    """A connection-level failure; subclasses say which."""


class TransportClosed(TransportError):
    """The connection was closed (by us or by the peer) while in use."""


class ConnectionRefused(TransportError):
    """Nobody accepted the connection at the given address."""


class PeerLost(HopliteError):
    """A node we depended on died or stopped answering."""


class DirectoryUnavailable(HopliteError):
    """The directory could not be reached before the deadline."""


class ReduceFailed(HopliteError):
    """A reduce cannot complete (mismatched inputs, too few live inputs, ...)."""


class StoreFull(HopliteError, MemoryError):
    """No room for a new object on this node: its objects would exceed its
    `store_bytes` limit and evicting copies held elsewhere did not make room,
    or the machine (or GPU) could not allocate the memory."""


class GroupMismatch(InvalidArgument):
    """The ranks of a `Group` made different calls, or one call with arguments
    that must agree and do not (size, op, root, an array's dtype or shape);
    every rank that reads the others' descriptors refuses the call."""


class GroupConflict(HopliteError):
    """Two `Group` objects claimed one rank of a group name at once (two groups
    forming under one name): the group is refused, never mixed."""


class GroupBroken(HopliteError):
    """A `Group` call after an earlier call of the group failed, or after
    `close`: its ranks may be at different calls, so it cannot go on."""
