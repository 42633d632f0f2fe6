"""Message framing shared by control and data connections.

A message is a 4-byte big-endian length followed by a msgpack map. On data
connections, bulk bytes follow as frames of a 9-byte header (kind, length)
and a raw payload, so a receiver can read them straight into place.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from .errors import ProtocolError, TransportClosed
from .transports import Stream

_LEN = struct.Struct(">I")
FRAME = struct.Struct(">BQ")
FRAME_DATA = 0
FRAME_ERROR = 1
#: Control messages stay small; inline objects are at most a few hundred KiB.
MAX_MESSAGE = 64 * 1024 * 1024


def pack(msg: dict[str, Any]) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return _LEN.pack(len(body)) + body


async def send_msg(stream: Stream, msg: dict[str, Any]) -> None:
    await stream.send(pack(msg))


async def recv_msg(stream: Stream) -> dict[str, Any]:
    head = await stream.recv_exactly(_LEN.size)
    (n,) = _LEN.unpack(head)
    if n > MAX_MESSAGE:
        raise ProtocolError(f"message of {n} bytes from {stream.peer} exceeds {MAX_MESSAGE}")
    body = await stream.recv_exactly(n)
    try:
        msg = msgpack.unpackb(body, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable message from {stream.peer}: {exc}") from exc
    if not isinstance(msg, dict):
        raise ProtocolError(f"expected a map from {stream.peer}; got {type(msg).__name__}")
    return msg


async def send_error_frame(stream: Stream, kind: str, message: str) -> None:
    body = msgpack.packb({"error": kind, "message": message}, use_bin_type=True)
    await stream.send(FRAME.pack(FRAME_ERROR, len(body)), body)


async def recv_frame_header(stream: Stream) -> tuple[int, int]:
    kind, n = FRAME.unpack(await stream.recv_exactly(FRAME.size))
    if kind not in (FRAME_DATA, FRAME_ERROR):
        raise ProtocolError(f"unknown frame kind {kind} from {stream.peer}")
    return kind, n


async def recv_error_body(stream: Stream, n: int) -> dict[str, Any]:
    if n > MAX_MESSAGE:
        raise ProtocolError(f"error frame of {n} bytes from {stream.peer}")
    return msgpack.unpackb(await stream.recv_exactly(n), raw=False)


def field(msg: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """Read a required field of a given type, or raise ProtocolError."""
    try:
        value = msg[name]
    except KeyError:
        raise ProtocolError(f"message {msg.get('op', '?')!r} lacks field {name!r}") from None
    if not isinstance(value, kind):
        raise ProtocolError(
            f"field {name!r} of {msg.get('op', '?')!r} should be {kind}, got {type(value).__name__}"
        )
    return value


__all__ = [
    "FRAME", "FRAME_DATA", "FRAME_ERROR", "TransportClosed", "field", "pack", "recv_error_body",
    "recv_frame_header", "recv_msg", "send_error_frame", "send_msg",
]
