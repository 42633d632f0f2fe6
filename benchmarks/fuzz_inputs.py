"""Hostile inputs for the network-facing decoders, free of I/O: a corpus of
valid messages for each phase of a connection, and the ways to spoil them
(random maps, byte edits, fields of the wrong type, deep nesting, framing
that lies). The fuzz harness (`benchmarks.fuzz`) draws from these with
`random.Random`; the property tests (tests/test_fuzz_servers.py) pick the
same choices through hypothesis. Everything here is deterministic given its
arguments, so a saved input replays."""

from __future__ import annotations

import random
import struct
import types
import typing
from dataclasses import dataclass
from typing import Any

import msgspec

from hoplite_gpu import messages as m

LENGTH = struct.Struct(">I")
OID = bytes(range(20))
LAYOUT = {"kind": "bytes", "dtype": "|u1", "shape": [8], "nbytes": 8}


def frame(body: bytes) -> bytes:
    """`body` with its 4-byte length in front, as every message travels."""
    return LENGTH.pack(len(body)) + body


def directory_corpus() -> list[m.Message]:
    """One valid message of each kind a registered node may send the directory."""
    tag = b"t" * 8
    return [
        m.Ping(rid=1), m.Ping(), m.Nodes(rid=2),
        m.Put(rid=3, oid=OID, size=8, layout=LAYOUT, inline=b"abcdefgh", print_=b"p" * 16),
        m.Put(rid=4, oid=OID, size=1 << 20, layout=LAYOUT),
        m.Locate(rid=5, oid=OID), m.Cancel(request=5), m.Progress(oid=OID, nbytes=4),
        m.Complete(oid=OID, size=8, layout=LAYOUT, own=True, tag=tag),
        m.Failed(oid=OID, sender="n1", have=3), m.Dropped(oid=OID),
        m.Evict(rid=6, oids=[OID], need=8), m.Delete(rid=7, oid=OID),
        m.DeleteMany(rid=8, oids=[OID, OID[::-1]]), m.Query(rid=9, oid=OID),
        m.ChannelPublish(rid=10, name="w", version=1),
        m.ChannelHead(rid=11, name="w", newer_than=0, wait=False),
        m.Reduce(rid=12, target=OID[::-1], inputs=[OID, bytes(20)], op_name="sum",
                 num_objects=2, root_input=OID, relay=True),
        m.ReduceFailed(target=OID, message="x", tag=tag), m.StepLost(target=OID, message="y"),
        m.ReducedInputs(rid=13, target=OID), m.ReduceConfirm(rid=14, target=OID, tag=tag),
    ]


def hello_corpus() -> list[m.Message]:
    """Valid first messages after the handshake."""
    return [m.Register(node="fuzz-node", address="tcp://127.0.0.1:9"),
            m.Attach(node="fuzz-node")]


def handshake_corpus() -> list[Any]:
    """A proof of the right shape (its MAC cannot be right without the token)."""
    return [m.Proof(nonce=b"n" * 32, mac=b"m" * 32)]


def pull_corpus(oid: bytes = OID, size: int = 1 << 16) -> list[m.Message]:
    """Valid pull requests for `oid` of `size` bytes (a data server's own
    object, so that the valid ones are served), in each mode a peer may ask."""
    return [m.Pull(oid=oid, offset=0, end=size, stall=1.0),
            m.Pull(oid=oid, offset=size // 2, end=size),
            m.Pull(oid=oid, offset=0, end=0),
            m.Pull(oid=oid, offset=0, end=size, bare=4096),
            m.Pull(oid=oid, offset=0, end=size, shm=True, map=True)]


def encoded(msgs: list[Any]) -> list[bytes]:
    return [m.encode(msg) for msg in msgs]


# ------------------------------------------------------------ random values ---
#: Values of every msgpack type, and the edges of each: what a field may be
#: given instead of what it should hold.
EDGE_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2**31, -(2**31), 2**63 - 1, -(2**63), 2**64 - 1, 0.0, -0.0,
    float("nan"), float("inf"), 1e308, "", "x" * 300, "\u2603", b"", b"\0" * 20, b"\xff" * 21,
    [], [None], {}, {"": None}, {"op": "ping"}, "ping", "sum", -(2**40),
]


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """A msgpack value of any type, nested at most a few levels."""
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.choice(EDGE_VALUES)
    if kind == 1:
        return rng.randint(-(2**63), 2**64 - 1) if rng.random() < 0.3 else rng.randint(-5, 300)
    if kind == 2:
        return rng.random() * 10 ** rng.randint(-3, 300)
    if kind == 3:
        return "".join(rng.choice("abcz_:/.0129\u00e9\x00") for _ in range(rng.randrange(24)))
    if kind == 4:
        return rng.randbytes(rng.choice((0, 1, 19, 20, 21, 32, rng.randrange(64))))
    if kind == 5:
        return rng.choice((True, False, None))
    if kind == 6:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 7:
        return {random_key(rng): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}
    return deep(rng.randrange(1, 40), rng.choice(("list", "map")))


FIELD_NAMES = sorted({f for kind in (*m.ToDirectory.__args__, *m.Hello.__args__, m.Pull,
                                     m.Proof, m.Copied, m.Kept)
                      for f in (*kind.__struct_encode_fields__, "op")})
OPS = sorted({m.op(kind) for kind in (*m.ToDirectory.__args__, *m.Hello.__args__, m.Pull,
                                      m.Copied, m.Kept)})


def random_key(rng: random.Random) -> Any:
    """Mostly a field name that some message has; now and then a key of
    another type (msgpack maps may have any keys)."""
    r = rng.random()
    if r < 0.7:
        return rng.choice(FIELD_NAMES)
    if r < 0.9:
        return "".join(rng.choice("abcdefgho_") for _ in range(rng.randrange(8)))
    return rng.choice((0, -1, b"op", 1.5, None, True))


def random_map(rng: random.Random) -> dict:
    """A map with an `op` (usually one that exists) and random fields."""
    body = {random_key(rng): random_value(rng) for _ in range(rng.randrange(6))}
    if rng.random() < 0.85:
        body["op"] = rng.choice(OPS) if rng.random() < 0.9 else random_value(rng)
    return body


def deep(levels: int, kind: str = "list") -> Any:
    """A value nested `levels` deep (msgspec recurses once per level)."""
    value: Any = 0
    for _ in range(levels):
        value = [value] if kind == "list" else {"k": value}
    return value


def deep_bytes(levels: int, under: str | None = "layout") -> bytes:
    """A msgpack body nested `levels` deep, built byte by byte (no encoder
    recurses that far): arrays of one, under map key `under`, or bare."""
    head = b""
    if under is not None:
        head = b"\x82\xa2op\xa3put" + _str(under)
    return head + b"\x91" * levels + b"\xc0"


def _str(text: str) -> bytes:
    raw = text.encode()
    assert len(raw) < 32
    return bytes([0xA0 | len(raw)]) + raw


# ------------------------------------------------- valid types, odd values ---
#: A few ids, so that the messages of one session meet the same objects.
IDS = [bytes([i]) * 20 for i in range(4)]
INTS = [0, 1, -1, 2, 8, 7, 1 << 20, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63), 2**64 - 1]


def typed_value(rng: random.Random, kind: Any, depth: int = 0,
                ids: list[bytes] = IDS) -> Any:
    """A value that fits the field type `kind` (so the message decodes and
    reaches the server's logic), picked from the edges of that type; ids
    mostly from `ids`."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Annotated:
        base, meta = args[0], args[1]
        if base is bytes:
            return rng.choice(ids) if rng.random() < 0.8 else rng.randbytes(20)
        value = typed_value(rng, base, depth, ids)
        return abs(value) if getattr(meta, "ge", None) == 0 else value
    if origin in (types.UnionType, typing.Union):
        options = [a for a in args if a is not type(None)]
        return None if rng.random() < 0.3 else typed_value(rng, rng.choice(options), depth, ids)
    if origin is list:
        return [typed_value(rng, args[0], depth + 1, ids)
                for _ in range(rng.choice((0, 1, 2, 3, 9)))]
    if origin is dict:
        if rng.random() < 0.5:
            return dict(LAYOUT, nbytes=rng.choice(INTS), shape=[rng.choice(INTS)])
        return {rng.choice(("kind", "dtype", "shape", "nbytes", "x")): random_value(rng, depth + 1)
                for _ in range(rng.randrange(5))}
    if kind is bool:
        return rng.random() < 0.5
    if kind is int:
        return rng.choice(INTS) if rng.random() < 0.7 else rng.randint(-3, 40)
    if kind is str:
        return rng.choice(("", "sum", "avg", "max", "n1", "fuzz-node", "w", "\u00e9", "x" * 200))
    if kind is bytes:
        return rng.choice((b"", b"t" * 8, *IDS, rng.randbytes(rng.randrange(40))))
    if kind is float:
        return rng.choice((0.0, 1.0, -1.0, 1e300))
    if isinstance(kind, type) and hasattr(kind, "__struct_fields__"):
        return {f.encode_name: typed_value(rng, f.type, depth + 1, ids)
                for f in msgspec.structs.fields(kind)}
    return random_value(rng, depth + 1)  # Any


def typed_message(rng: random.Random, kinds: list[type], ids: list[bytes] = IDS) -> dict:
    """The map of a message of one of `kinds`: every field of the right type,
    optional ones now and then left out."""
    kind = rng.choice(kinds)
    body: dict = {"op": m.op(kind)}
    for f in msgspec.structs.fields(kind):
        if f.required or rng.random() < 0.5:
            body[f.encode_name] = typed_value(rng, f.type, ids=ids)
    return body


def typed_body(rng: random.Random, corpus: list[Any]) -> bytes:
    """A message of a kind in `corpus`, of the right types, meeting the ids
    the corpus names (a data server's own object) or a few others."""
    kinds = sorted({type(msg) for msg in corpus}, key=lambda k: k.__name__)
    named = sorted({msg.oid for msg in corpus if isinstance(getattr(msg, "oid", None), bytes)})
    return encode_any(typed_message(rng, kinds, named + IDS))


# ------------------------------------------------------------ spoiling bytes ---
#: Byte edits: (kind, position as a fraction of the length, byte).
Edit = tuple[str, float, int]
EDITS = ("flip", "set", "insert", "delete", "truncate", "duplicate")


def mutate(data: bytes, edits: list[Edit]) -> bytes:
    """`data` with each edit applied in turn (positions scale to the current
    length, so any edit list applies to any input)."""
    buf = bytearray(data)
    for kind, where, byte in edits:
        at = min(int(where * len(buf)), max(len(buf) - 1, 0))
        if kind == "insert":
            buf[at:at] = bytes([byte])
        elif not buf:
            continue
        elif kind == "flip":
            buf[at] ^= 1 << (byte % 8)
        elif kind == "set":
            buf[at] = byte
        elif kind == "delete":
            del buf[at]
        elif kind == "truncate":
            del buf[at:]
        elif kind == "duplicate":
            buf[at:at] = buf[at:at + 1 + byte % 16]
    return bytes(buf)


def random_edits(rng: random.Random) -> list[Edit]:
    return [(rng.choice(EDITS), rng.random(), rng.randrange(256))
            for _ in range(rng.randint(1, 4))]


def wrong_type(msg: Any, name: str, value: Any) -> dict:
    """The map of `msg` with field `name` set to `value` (a field it has, or
    a new one)."""
    raw = m.as_map(msg) if isinstance(msg, m.Message) else dict(m.msgspec.to_builtins(msg))
    raw[name] = value
    return raw


def random_wrong_type(rng: random.Random, msg: Any) -> dict:
    fields = [*msg.__struct_encode_fields__, rng.choice(FIELD_NAMES)]
    return wrong_type(msg, rng.choice(fields), random_value(rng))


def encode_any(value: Any) -> bytes:
    """msgpack of any value built here (maps with keys of any type too)."""
    return m.encode(value)


# ----------------------------------------------------------------- framing ---
def oversized(n: int) -> bytes:
    """A length that promises `n` bytes, then a few."""
    return LENGTH.pack(n) + b"\x80" * 16


def split(data: bytes, sizes: list[int]) -> list[bytes]:
    """`data` in pieces of the given sizes in turn (the last piece the rest)."""
    pieces, at = [], 0
    for n in sizes:
        if at >= len(data):
            break
        pieces.append(data[at:at + max(1, n)])
        at += max(1, n)
    if at < len(data):
        pieces.append(data[at:])
    return pieces


# ------------------------------------------------------------------- cases ---
#: Each connection phase a fuzz run feeds, by target: before the handshake
#: (raw bytes for the proof), the first message after it (directory), a
#: registered node's messages (directory), a puller's request (data).
PHASES = {"directory": ("handshake", "hello", "node"), "data": ("handshake", "request")}
#: How a case ends: stop writing; stay silent (the server's deadline must
#: end it); or send a request the connection must answer if it is still
#: open (a ping on a directory connection, a one-byte pull on a data
#: connection), then stop writing.
FINISHES = ("close", "hold", "ping")


@dataclass
class Case:
    """One hostile input: the bytes of each write, and how the peer ends."""

    target: str
    phase: str
    pieces: list[bytes]
    finish: str
    how: str = ""

    def to_json(self) -> dict:
        return {"target": self.target, "phase": self.phase, "finish": self.finish,
                "how": self.how, "pieces": [p.hex() for p in self.pieces]}

    @classmethod
    def from_json(cls, d: dict) -> Case:
        return cls(d["target"], d["phase"], [bytes.fromhex(p) for p in d["pieces"]],
                   d["finish"], d.get("how", ""))


def corpus_for(target: str, phase: str, oid: bytes = OID, size: int = 1 << 16) -> list[Any]:
    if phase == "handshake":
        return handshake_corpus()
    if phase == "hello":
        return hello_corpus()
    if target == "data":
        return pull_corpus(oid, size)
    return directory_corpus()


#: How a body is made, and how it is framed: the names a case records in `how`.
BODIES = ("map", "mutated", "wrong-type", "raw", "deep", "valid", "typed")
FRAMINGS = ("frame", "frames", "truncated", "oversized", "short-length", "trickle", "session")


def random_body(rng: random.Random, kind: str, corpus: list[Any]) -> bytes:
    if kind == "map":
        return encode_any(random_map(rng))
    if kind == "mutated":
        return mutate(m.encode(rng.choice(corpus)), random_edits(rng))
    if kind == "wrong-type":
        return encode_any(random_wrong_type(rng, rng.choice(corpus)))
    if kind == "raw":
        return rng.randbytes(rng.randrange(1, 64))
    if kind == "deep":
        return deep_bytes(rng.choice((200, 1200, 4000, 20000)), rng.choice((None, "layout")))
    if kind == "typed":
        return typed_body(rng, corpus)
    return m.encode(rng.choice(corpus))


def random_case(rng: random.Random, target: str, phase: str, limit: int,
                corpus: list[Any]) -> Case:
    """A hostile input for `phase` of a `target` connection whose messages
    may be `limit` bytes long."""
    body_kind, framing = rng.choice(BODIES), rng.choice(FRAMINGS)
    body = random_body(rng, body_kind, corpus)
    finish = "ping" if phase != "handshake" else "close"
    if framing == "frame":
        pieces = [frame(body)]
    elif framing == "session":  # valid messages that meet the same few objects
        pieces = [b"".join(frame(random_body(rng, "typed", corpus))
                           for _ in range(rng.randint(2, 12)))]
        body_kind = "typed"
    elif framing == "frames":
        pieces = [b"".join(frame(random_body(rng, rng.choice(BODIES), corpus))
                           for _ in range(rng.randint(2, 5)))]
    elif framing == "truncated":
        whole = frame(body)
        pieces = [whole[:rng.randrange(len(whole))]]
        # (a data server waits for the rest of a request without a deadline:
        # see docs/fault-tolerance.md, "Fuzzing")
        finish = "close" if rng.random() < 0.9 or phase == "request" else "hold"
    elif framing == "oversized":
        pieces = [oversized(rng.choice((limit + 1, 2 * limit, MAX_LENGTH)))]
    elif framing == "short-length":  # the length says less than the body holds
        pieces = [LENGTH.pack(rng.randrange(max(len(body), 1))) + body]
    else:
        whole = frame(m.encode(rng.choice(corpus)) if rng.random() < 0.5 else body)
        pieces = split(whole, [rng.randint(1, 3) for _ in range(len(whole))])
    if phase == "handshake" and rng.random() < 0.2:
        pieces = [rng.randbytes(rng.randrange(1, 48))]  # not even a frame
        body_kind, framing = "raw", "unframed"
    return Case(target, phase, pieces, finish, f"{body_kind}/{framing}")


MAX_LENGTH = 2**32 - 1
