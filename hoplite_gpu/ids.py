"""Object identifiers: 20 bytes, random or derived from a name."""

from __future__ import annotations

import hashlib
import os

from .errors import InvalidArgument

_ID_LEN = 20


def encode_text(text: str) -> bytes:
    """UTF-8 bytes of any str: bytes that came from the OS as surrogate escapes
    (an environment variable, a file name) are restored, and a lone surrogate
    is encoded as itself, so every name and token has bytes."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


class ObjectID:
    """A 20-byte object name.

    ``ObjectID.random()`` makes a fresh one; ``ObjectID.from_name("w:step-3")``
    derives the same id in every process, so tasks can agree without talking.
    """

    __slots__ = ("_b",)

    def __init__(self, raw: bytes) -> None:
        if not isinstance(raw, (bytes, bytearray)) or len(raw) != _ID_LEN:
            got = f"{type(raw).__name__} of length {len(raw)}" if hasattr(raw, "__len__") else type(raw).__name__
            raise InvalidArgument(f"an ObjectID is {_ID_LEN} bytes; got {got}")
        self._b = bytes(raw)

    @classmethod
    def random(cls) -> ObjectID:
        return cls(os.urandom(_ID_LEN))

    @classmethod
    def from_name(cls, name: str) -> ObjectID:
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"ObjectID.from_name needs a non-empty str; got {name!r}")
        return cls(hashlib.blake2b(encode_text(name), digest_size=_ID_LEN, person=b"hoplite-oid").digest())

    @classmethod
    def from_hex(cls, text: str) -> ObjectID:
        try:
            raw = bytes.fromhex(text)
        except ValueError as exc:
            raise InvalidArgument(f"not a hex ObjectID: {text!r}") from exc
        return cls(raw)

    @property
    def binary(self) -> bytes:
        return self._b

    def hex(self) -> str:
        return self._b.hex()

    def __bytes__(self) -> bytes:
        return self._b

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectID) and other._b == self._b

    def __hash__(self) -> int:
        return hash(self._b)

    def __repr__(self) -> str:
        return f"ObjectID({self._b.hex()[:12]}…)"

    def __reduce__(self):
        return (ObjectID, (self._b,))


def as_object_id(value: object) -> ObjectID:
    """Accept an ObjectID (or its 20 raw bytes); refuse anything else clearly."""
    if isinstance(value, ObjectID):
        return value
    if isinstance(value, (bytes, bytearray)) and len(value) == _ID_LEN:
        return ObjectID(bytes(value))
    raise InvalidArgument(f"expected an ObjectID; got {type(value).__name__}: {value!r:.60}")
