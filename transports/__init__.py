"""Transports, chosen by URI scheme. ``get_backend("tcp")`` -> the TCP backend."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .base import HEAD, Backend, Bind, Head, Listener, SendWindow, Stream, StreamCaps, split_address

if TYPE_CHECKING:
    from .tls import TLS

# scheme -> "module:attribute", imported on first use so optional ones (ucx)
# cost nothing when unused.
_KNOWN = {
    "tcp": "hoplite_gpu.transports.tcp:TCPBackend",
    "ucx": "hoplite_gpu.transports.ucx:UCXBackend",
    # same-host streams that pass descriptors (Unix sockets; Linux)
    "local": "hoplite_gpu.transports.local:LocalBackend",
}
_loaded: dict[str, Backend] = {}


def register_backend(scheme: str, backend: Backend) -> None:
    _loaded[scheme] = backend


def get_backend(scheme: str, tls: TLS | None = None) -> Backend:
    """The backend of `scheme`; with `tls`, one whose connections run in TLS
    where the transport has it (`Backend.with_tls`)."""
    if tls is not None:
        return get_backend(scheme).with_tls(tls)
    from hoplite_gpu.errors import ConfigError

    if scheme in _loaded:
        return _loaded[scheme]
    if scheme not in _KNOWN:
        known = ", ".join(sorted(set(_KNOWN) | set(_loaded)))
        raise ConfigError(f"unknown transport {scheme!r}; known transports: {known}")
    module, _, attr = _KNOWN[scheme].partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise ConfigError(
            f"transport {scheme!r} is not usable here: {exc}. "
            f"Install its extra (pip install 'hoplite-gpu[{scheme}]')."
        ) from exc
    try:
        backend = cls()
    except Exception as exc:  # e.g. the UCX library is present but cannot start
        raise ConfigError(f"transport {scheme!r} is not usable here: {exc}") from exc
    _loaded[scheme] = backend
    return backend


def usable(scheme: str) -> bool:
    """Whether the transport `scheme` can be used here (its package installed
    and its library started)."""
    from hoplite_gpu.errors import ConfigError

    try:
        get_backend(scheme)
    except ConfigError:
        return False
    return True


__all__ = ["HEAD", "Backend", "Bind", "Head", "Listener", "SendWindow", "Stream", "StreamCaps", "get_backend",
           "register_backend", "split_address", "usable"]
