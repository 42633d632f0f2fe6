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
    """A node joins: its data server's `address`, and with several rails
    (`node_host` lists several hosts) every address it listens on, the
    first being `address`; `rack`: where it sits in the fabric (`rack`),
    none from a node that has none."""

    node: str
    address: str
    addresses: list[str] = []
    rack: Annotated[str, Meta(max_length=64)] = ""


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
    ask again; `kind` names the error when it is not ObjectNotFound; `lost`:
    the object was declared lost (a complete copy is kept: its `complete`
    crossed this drop and brings the object back)."""

    oid: bytes
    reason: str
    retry: bool
    kind: str | None = None
    lost: bool = False


class StepChild(Struct, omit_defaults=True, kw_only=True):
    """One child of a reduce step: its stream `oid`, read locally if the node
    holds it, else pulled from `address`, the data address of the child's
    node `node`; `rails`: every data address of that node, where it listens
    on several (a large pull of it is spread over them, as a get's is)."""

    oid: bytes
    address: str
    node: str = ""
    rails: list[str] = []


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


class Source(Struct, kw_only=True):
    """One more sender of a pull from several (`Location.also`): a node
    with a complete copy, and its data address."""

    sender: str
    address: str


class Stripe(Struct, kw_only=True):
    """One stripe of a striped pull (`Location.stripes`): bytes [start, end)
    of the object, from `sender` at its data `address`."""

    start: NonNegative
    end: NonNegative
    sender: str
    address: str


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
    also: list[Source] = []
    stripes: list[Stripe] = []
    seq: int = 0
    piece: int = 0
    rails: dict[str, list[str]] = {}


class Restripe(Message, tag="restripe"):
    """A push: the senders of the node's striped pull of `oid` changed (a
    stripe moved to another sender: a new receiver took its place in the
    tree, or the sender failed or left). `stripes` is the whole assignment,
    `seq` its number: the node keeps the newest it has heard, reply or push,
    and pulls what it still lacks from these senders, in messages of
    `piece` bytes (0: its own chunk size); `rails`: every data address of
    each sender named that listens on several, as in `Location`."""

    oid: bytes
    stripes: list[Stripe]
    seq: int
    piece: int = 0
    rails: dict[str, list[str]] = {}


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


class PathTaken(Message, tag="path"):
    """A sub-flow of the node's pull of `oid` from `sender` runs on a
    connection to `address` (a rail of the sender) from `local` ("host:port"
    here), its source port chosen for ECMP path `path` (-1: not pinned, a
    rail only). Sent once per connection a pull uses, for `query`'s `paths`."""

    oid: Id
    sender: str
    address: str
    local: str
    path: int = -1


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
    version: NonNegative  # (-1 is a head's "none yet", never a version)


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
    wait: bool = True


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
    `local` / `sender` with its `address`, and with a sender, `also` the
    other senders of a pull from several, or `stripes` (the sender of each
    stripe of a striped object; `sender` is then the first stripe's) with
    their number `seq` and the size of the messages to pull them in,
    `piece` (see `Restripe`); `reduce_tag` while the object is
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
    also: list[Source] = []
    stripes: list[Stripe] = []
    seq: int = 0
    piece: int = 0
    pushed: bool = False
    held: bool = False
    #: the data addresses of each sender named that listens on several
    #: (rails; its `address` among them), for the pull to spread over
    rails: dict[str, list[str]] = {}


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


class HolderInfo(Struct, omit_defaults=True, kw_only=True):
    """One holder of an object, as `query` describes it (every field sent,
    but `stripes` only when it has any)."""

    node: str
    address: str
    nbytes: int
    complete: bool
    origin: bool
    upstream: str | None
    serving: list[str]
    #: a striped object's: the holder's sender of each stripe (a sender
    #: lost and not replaced yet is left out)
    stripes: list[Stripe] = []


class PathInfo(Struct, kw_only=True):
    """The way one connection of a pull went (`Description.paths`): from
    `receiver` at `local` ("host:port") to `sender`'s `address`, on ECMP
    path `path` (-1: its source port was not chosen for a path)."""

    receiver: str
    sender: str
    address: str
    local: str
    path: int


class Description(Body, kw_only=True):
    """The answer to a `query`: what the directory knows of an object."""

    size: int
    layout: dict[str, Any]
    inline: bool
    holders: list[HolderInfo]
    edges: list[list[str]]
    waiting: int
    #: the connections of pulls spread over rails or paths, latest 1,024
    paths: list[PathInfo] = []


class NodeList(Body, kw_only=True):
    """The answer to `nodes`: node id -> data address."""

    nodes: dict[str, str]


class Registered(Body, kw_only=True):
    """The answer to `register` (no `rid`)."""

    ok: bool
    node: str
    lease_s: float
    #: the other nodes registered there when this one was (a node joining
    #: one of several directories prefers one that has some)
    nodes: int = 0


class Attached(Body, kw_only=True):
    """The answer to `attach` (no `rid`)."""

    ok: bool
    node: str


# ----------------------------------------------------- stored, not sent ---
class PackedTensor(Struct, array_like=True):
    """One tensor of a weight channel's version (`hoplite_gpu.packing`): its
    key, its value's layout (`values.Layout`'s fields) and where its bytes
    lie: in which part, from which offset."""

    key: str
    kind: str
    dtype: str
    shape: list[NonNegative]
    nbytes: NonNegative
    part: NonNegative
    offset: NonNegative


class PackPart(Struct, array_like=True):
    """One object of a weight channel's version: its size, and whether it
    holds device tensors (a device object) or host ones."""

    nbytes: NonNegative
    device: bool


class Manifest(Struct, kw_only=True):
    """A weight channel's version, as its manifest object holds it
    (`hoplite_gpu.channel`): its parts (one object per kind of memory, every
    tensor's bytes back to back), where each tensor lies in them, and the
    versions its publisher had not freed (`held`), which a restarted
    publisher takes over."""

    version: int
    parts: list[PackPart]
    tensors: list[PackedTensor]
    held: list[int] = []


class TreeMember(Struct, kw_only=True):
    """A rank's card in a multi-tree broadcast (`hoplite_gpu.multitree`): its
    node and data address; the root's also the object's size and layout."""

    node: str
    address: str
    size: int = 0
    layout: dict[str, Any] | None = None


def answering(body: Body, rid: int) -> Body:
    """`body` sent as the reply to request `rid`."""
    return replace(body, rid=rid)


#: What a node may send the directory on its connection, after `register`.
ToDirectory = (Ping | Nodes | Put | Locate | Cancel | Progress | Complete | Failed | PathTaken
               | Dropped
               | Evict | Delete | DeleteMany | Query | ChannelPublish | ChannelHead | Reduce
               | ReduceFailed | StepLost | ReducedInputs | ReduceConfirm)
#: A connection's first message after the handshake.
Hello = Register | Attach
#: What the directory pushes to a node unasked (a node tells them from
#: replies by their `op`; replies have none).
Push = Drop | ReduceStep | Located | Restripe
#: The body of the reply to each request that succeeds (one that fails is
#: answered with a `Failure`).
REPLIES: dict[type, type[Body]] = {
    Register: Registered, Attach: Attached, Ping: Done, Nodes: NodeList, Put: Done,
    Locate: Location, Evict: Evicted, Delete: Done, DeleteMany: Done, Query: Description,
    ChannelPublish: Done, ChannelHead: Head, Reduce: Done, ReducedInputs: Inputs,
    ReduceConfirm: Current,
}


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


def op(msg: Message | type[Message]) -> str:
    """The name a message (or a message type) travels under."""
    return msg.__struct_config__.tag


def encode(msg: Message | dict[str, Any]) -> bytes:
    return _codec(None).encode(msg)


def as_map(msg: Struct) -> dict[str, Any]:
    """A message as the map a peer decodes it to (for code that reads maps)."""
    return msgspec.to_builtins(msg, builtin_types=(bytes,))


def with_rid(msg: Request, rid: int) -> Request:
    """`msg` sent as request `rid`."""
    return replace(msg, rid=rid)


def _too_deep(peer: str) -> ProtocolError:
    """msgspec recurses once per level of nesting and raises RecursionError
    past Python's limit: a few kilobytes of ``0x91`` bytes (arrays of one)
    reach it, so a peer that has proved nothing could end the task reading
    it with an exception that is no HopliteError."""
    return ProtocolError(f"undecodable message from {peer}: nested too deeply")


def _decode(kind: Any, peer: str, body: bytes | bytearray | memoryview) -> Message | Invalid:
    try:
        return _codec(kind).decode(body)
    except RecursionError:
        raise _too_deep(peer) from None
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
    except RecursionError:
        raise _too_deep(peer) from None
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


def decode_manifest(what: str, body: bytes | bytearray | memoryview) -> Manifest:
    """A channel manifest; ProtocolError naming `what` for bytes that are not one."""
    try:
        return _codec(Manifest).decode(body)
    except RecursionError:  # (`_too_deep`: an unknown field is skipped level by level)
        raise ProtocolError(f"{what} is not a channel manifest: nested too deeply") from None
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"{what} is not a channel manifest: {exc}") from None


def decode_tree_member(what: str, body: bytes | bytearray | memoryview) -> TreeMember:
    """A multi-tree broadcast's card; ProtocolError naming `what` otherwise."""
    try:
        return _codec(TreeMember).decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"{what} is not a multi-tree broadcast's card: {exc}") from None


def read_reply(request: type, raw: dict[str, Any]) -> Body:
    """The reply to a request of kind `request`, from the map it was decoded
    to: a `Failure` or the body `REPLIES` names; ProtocolError naming the
    field when it is neither."""
    kind = Failure if "error" in raw else REPLIES[request]
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"bad reply to {op(request)!r}: {exc}") from None


def read_push(raw: dict[str, Any]) -> Message:
    """A push from the map it was decoded to; ProtocolError naming the field
    (or the unknown op) when it is not a valid one."""
    try:
        return msgspec.convert(raw, Push)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"bad push {raw.get('op', '?')!r}: {exc}") from None


def from_map(msg: dict[str, Any], kind: Any = ToDirectory) -> Message:
    """A message from its map form (tests and tools that build maps by hand);
    ProtocolError naming the field when it is not a valid one."""
    try:
        return msgspec.convert(msg, kind)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"bad {msg.get('op', '?')!r} message: {exc}") from None
