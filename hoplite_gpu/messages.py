"""The messages between processes, typed and defined once, with their codec.

Each message is a msgspec Struct whose tag (`op`) and field names are the keys
of the msgpack map that travels (docs/protocol.md), so the bytes on the wire
are the same map a peer has always sent: a message is decoded and validated
in one step (a missing or mistyped field, an object id that is not 20 bytes,
an unknown reduce op), and a bad one is answered by name, never half taken.

Fields that may be left out default to None or their neutral value and are
left out of what is sent (`omit_defaults`).

Where msgspec is not installed (the pure scheduling core used alone, with the
standard library only), the same classes are built on `plain_struct`: they
construct and compare alike, with no codec and no validation.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

from .errors import ProtocolError

try:
    import msgspec
    from msgspec import Meta, Struct, field
    from msgspec.structs import replace
except ImportError:  # the pure core alone: see the module's docstring
    msgspec = None
    from .plain_struct import Meta, Struct, field, replace

#: The reduce ops a `reduce` may name (kernels/numpy_ops.py implements each;
#: tests/test_messages.py checks the two agree).
REDUCE_OPS = ("sum", "prod", "min", "max", "avg")

#: An object id: 20 raw bytes (a shorter one would reach other nodes in
#: pushes and fail there).
Id = Annotated[bytes, Meta(min_length=20, max_length=20)]
NonNegative = Annotated[int, Meta(ge=0)]


class Message(Struct, tag_field="op", omit_defaults=True, kw_only=True):
    """A message; `op` names its kind on the wire."""


class Request(Message):
    """A node's request to the directory, answered under its `rid`."""

    rid: int


# ------------------------------------- the handshake (docs/protocol.md) ---
class Challenge(Struct, kw_only=True):
    """The accepting side's first message: who it is, and its nonce."""

    hello: str
    version: int
    nonce: bytes


class Proof(Struct, kw_only=True):
    """The connecting side's answer: its nonce and its MAC over both."""

    nonce: bytes
    mac: bytes


class Verdict(Struct, omit_defaults=True, kw_only=True):
    """The accepting side's verdict: `ok` with its own MAC, or why not."""

    ok: bool
    mac: bytes | None = None
    error: str | None = None


# ------------------------------------------------ first message of a connection ---
class Register(Message, tag="register"):
    node: str
    address: str


class Attach(Message, tag="attach"):
    node: str


# ---------------------------------------------- a puller to a data server ---
class Pull(Message, tag="pull"):
    """Bytes [offset, end) of `oid`. `stall` (seconds) and `bare` (the size
    of the answer's messages) are taken as sent and checked where they
    are used (docs/protocol.md: a bad `bare` is answered with an error frame,
    a bad `stall` leaves the server's own); `shm`/`map`: same-host modes."""

    oid: Id
    offset: int
    end: int
    stall: Any = None
    shm: bool = False
    map: bool = False
    bare: Any = None


class Copied(Message, tag="copied"):
    """The puller no longer reads the sender's mapping."""


class Kept(Message, tag="kept"):
    """The puller holds its own lock on the mapped pages."""


# ------------------------------------------------ the directory to a node ---
class Drop(Message, tag="drop"):
    """A push: the node's copy or wait for `oid` is void (`reason`); `retry`:
    ask again; `kind` names the error when it is not ObjectNotFound."""

    oid: bytes
    reason: str
    retry: bool
    kind: str | None = None


class StepChild(Struct, kw_only=True):
    """One child of a reduce step: its stream `oid`, read locally if the node
    holds it, else pulled from `address`."""

    oid: bytes
    address: str


class ReduceStep(Message, tag="reduce_step"):
    """A push: run one reduce tree position (docs/protocol.md, "Pushes").
    Every field but `early` is always sent (`count` is 0 below the root)."""

    target: bytes
    output: bytes
    input: bytes
    children: list[StepChild]
    reduce_op: str
    count: int
    size: int
    layout: dict[str, Any]
    tag: bytes
    early: bool = False


class Located(Message, tag="located"):
    """A push: the answer to a locate of `oid` that a direct connection of
    the node asked (a sender, or `local`), for the node to start the pull."""

    oid: bytes
    size: int
    layout: dict[str, Any]
    reduce_tag: bytes | None = None
    local: bool = False
    sender: str | None = None
    address: str | None = None


class DirectoryLost(Message, tag="directory_lost"):
    """Not sent: what a node's client hands its node when the connection ends."""

    reason: str


# -------------------------------------------------- a node to the directory ---
class Ping(Message, tag="ping"):
    """A heartbeat; answered only when it carries a `rid`."""

    rid: int | None = None


class Nodes(Message, tag="nodes"):
    rid: int = 0


class Put(Request, tag="put"):
    oid: Id
    size: int
    layout: dict[str, Any]
    inline: bytes | None = None
    print_: bytes | None = field(default=None, name="print")


class Locate(Request, tag="locate"):
    oid: Id
    direct: bool = False


class Cancel(Message, tag="cancel"):
    request: int


class Progress(Message, tag="progress"):
    oid: Id
    nbytes: int


class Complete(Message, tag="complete"):
    oid: Id
    size: int = -1
    layout: dict[str, Any] | None = None
    own: bool = False
    tag: bytes | None = None
    print_: bytes | None = field(default=None, name="print")


class Failed(Message, tag="failed"):
    oid: Id
    sender: str
    have: int


class Dropped(Message, tag="dropped"):
    oid: Id


class Evict(Request, tag="evict"):
    oids: list[Id]
    need: NonNegative = 0


class Delete(Request, tag="delete"):
    oid: Id


class DeleteMany(Request, tag="delete_many"):
    oids: list[Id]


class Query(Request, tag="query"):
    oid: Id


class ChannelPublish(Request, tag="channel_publish"):
    name: str
    version: int


class ChannelHead(Request, tag="channel_head"):
    name: str
    newer_than: int
    wait: bool = True


class Reduce(Request, tag="reduce"):
    target: Id
    inputs: list[Id]
    op_name: str
    num_objects: int
    root_input: Id | None = None
    relay: bool = False

    def __post_init__(self) -> None:
        if self.op_name not in REDUCE_OPS:  # (else it would fail only later, inside a step)
            raise ValueError(f"unknown reduce op {self.op_name!r}; expected one of "
                             f"{', '.join(REDUCE_OPS)}")


class ReduceFailed(Message, tag="reduce_failed"):
    target: Id
    message: str
    tag: bytes | None = None


class StepLost(Message, tag="step_lost"):
    target: Id
    message: str
    tag: bytes | None = None


class ReducedInputs(Request, tag="reduced_inputs"):
    target: Id


class ReduceConfirm(Request, tag="reduce_confirm"):
    target: Id
    tag: bytes


# --------------------------------------- the directory's replies to a node ---
class Body(Struct, omit_defaults=True):
    """A reply: untagged (a node tells a reply from a push by its `rid`),
    its fields the keys of the map besides `rid`. The state machine leaves
    `rid` unset; whoever sends the reply sets it (`answering`), and a set
    `rid` is always sent, first, as it always was (so each kind is
    `kw_only` itself: its fields follow `rid`). The connection's first
    reply has none."""

    rid: int | None = None


class Done(Body, kw_only=True):
    """`ok: true`, with what a `delete` found (`existed`: a bool, or one per
    id of a `delete_many`) or a channel's `head` after a `channel_publish`."""

    ok: bool
    existed: bool | list[bool] | None = None
    head: int | None = None


class Failure(Body, kw_only=True):
    """A refused or failed request: `error` names a HopliteError subclass.
    Also the body of a data connection's error frame (no `rid`)."""

    error: str
    message: str


class Location(Body, kw_only=True):
    """The answer to a `locate`: `size`, `layout` and one of `inline` /
    `local` / `sender` with its `address`; `reduce_tag` while the object is
    an unfinished tree reduce's result. A direct connection's locate may be
    answered `pushed` (the assignment went to the node as `Located`) or
    `held` (the node holds or pulls it already) instead."""

    size: int
    layout: dict[str, Any]
    reduce_tag: bytes | None = None
    inline: bytes | None = None
    local: bool = False
    sender: str | None = None
    address: str | None = None
    pushed: bool = False
    held: bool = False


class Evicted(Body, kw_only=True):
    evicted: list[bytes]


class Head(Body, kw_only=True):
    """A channel's newest version (-1: none yet)."""

    head: int


class Inputs(Body, kw_only=True):
    """The inputs a finished reduce folded."""

    inputs: list[bytes]


class Current(Body, kw_only=True):
    """Whether a reduce's tree `tag` is the one that finished."""

    current: bool


class HolderInfo(Struct, kw_only=True):
    """One holder of an object, as `query` describes it (every field sent)."""

    node: str
    address: str
    nbytes: int
    complete: bool
    origin: bool
    upstream: str | None
    serving: list[str]


class Description(Body, kw_only=True):
    """The answer to a `query`: what the directory knows of an object."""

    size: int
    layout: dict[str, Any]
    inline: bool
    holders: list[HolderInfo]
    edges: list[list[str]]
    waiting: int


class NodeList(Body, kw_only=True):
    """The answer to `nodes`: node id -> data address."""

    nodes: dict[str, str]


class Registered(Body, kw_only=True):
    """The answer to `register` (no `rid`)."""

    ok: bool
    node: str
    lease_s: float


class Attached(Body, kw_only=True):
    """The answer to `attach` (no `rid`)."""

    ok: bool
    node: str


def answering(body: Body, rid: int) -> Body:
    """`body` sent as the reply to request `rid`."""
    return replace(body, rid=rid)


#: What a node may send the directory on its connection, after `register`.
ToDirectory = (Ping | Nodes | Put | Locate | Cancel | Progress | Complete | Failed | Dropped
               | Evict | Delete | DeleteMany | Query | ChannelPublish | ChannelHead | Reduce
               | ReduceFailed | StepLost | ReducedInputs | ReduceConfirm)
#: A connection's first message after the handshake.
Hello = Register | Attach


# ------------------------------------------------------------------- codec ---
class Invalid(Struct, frozen=True):
    """A message that was a map but not a valid one: what to answer it with."""

    op: str
    rid: int
    message: str


@functools.cache
def _codec(kind: Any) -> Any:
    """The encoder (kind None) or the decoder of `kind`: made on first use, as
    only processes with msgspec talk on the wire."""
    return msgspec.msgpack.Encoder() if kind is None else msgspec.msgpack.Decoder(kind)


def op(msg: Message | type[Message] | dict[str, Any]) -> str:
    """The name a message (or a message type, or a map) travels under."""
    return str(msg.get("op")) if isinstance(msg, dict) else msg.__struct_config__.tag


def encode(msg: Message | dict[str, Any]) -> bytes:
    return _codec(None).encode(msg)


def as_map(msg: Message | dict[str, Any]) -> dict[str, Any]:
    """A message as the map a peer decodes it to (for code that reads maps)."""
    if isinstance(msg, dict):
        return msg
    return msgspec.to_builtins(msg, builtin_types=(bytes,))


def with_rid(msg: Request | dict[str, Any], rid: int) -> Request | dict[str, Any]:
    """`msg` sent as request `rid` (a map: the node's messages not typed yet)."""
    if isinstance(msg, dict):
        return {**msg, "rid": rid}
    return replace(msg, rid=rid)


def _decode(kind: Any, peer: str, body: bytes | bytearray | memoryview) -> Message | Invalid:
    try:
        return _codec(kind).decode(body)
    except msgspec.ValidationError as exc:
        raw = decode_map(peer, body)
        op, rid = raw.get("op"), raw.get("rid")
        rid = rid if isinstance(rid, int) and not isinstance(rid, bool) else 0
        what = f"unknown op {op!r}" if "$.op" in str(exc) and "Invalid value" in str(exc) \
            else f"bad {op!r} message: {exc}"
        return Invalid(op=str(op), rid=rid, message=what)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable message from {peer}: {exc}") from exc


def decode_map(peer: str, body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """A message read as a plain map (what a node reads); ProtocolError naming
    `peer` for bytes that are no map."""
    try:
        raw = _codec(Any).decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable message from {peer}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ProtocolError(f"expected a map from {peer}; got {type(raw).__name__}")
    return raw


def decode_to_directory(peer: str, body: bytes | bytearray | memoryview) -> Message | Invalid:
    """A node's message to the directory, or what is wrong with it; ProtocolError
    for bytes that are no map at all (the connection is then dropped)."""
    return _decode(ToDirectory, peer, body)


def decode_hello(peer: str, body: bytes | bytearray | memoryview) -> Message | Invalid:
    return _decode(Hello, peer, body)


def decode_pull(peer: str, body: bytes | bytearray | memoryview) -> Message | Invalid:
    """A data connection's request."""
    return _decode(Pull, peer, body)


def decode_ack(peer: str, body: bytes | bytearray | memoryview) -> Message | Invalid:
    """A same-host puller's word after a mapping (`copied` or `kept`)."""
    return _decode(Copied | Kept, peer, body)


def from_map(msg: dict[str, Any], kind: Any = ToDirectory) -> Message:
    """A message from its map form (tests and tools that build maps by hand);
    ProtocolError naming the field when it is not a valid one."""
    try:
        return msgspec.convert(msg, kind)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"bad {msg.get('op', '?')!r} message: {exc}") from None
