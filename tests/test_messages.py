"""The typed messages (hoplite_gpu/messages.py): their wire form, their
validation, and docs/protocol.md kept in step with them."""

from __future__ import annotations

import pathlib
import re
import typing

import msgpack
import msgspec
import pytest

from hoplite_gpu import messages as m
from hoplite_gpu.errors import ProtocolError

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
OID = b"o" * 20


def _types(union) -> list[type]:
    return list(typing.get_args(union))


def _wire_fields(kind: type) -> list[str]:
    return [f.encode_name for f in msgspec.structs.fields(kind)]


@pytest.mark.parametrize("kind", _types(m.ToDirectory), ids=lambda k: m.op(k))
def test_every_message_to_the_directory_is_in_the_protocol_docs_with_its_fields(kind):
    rows = {row.split("|")[1].strip().strip("`"): row
            for row in DOCS.read_text().splitlines() if row.startswith("| `")}
    row = rows.get(m.op(kind))
    assert row is not None, f"docs/protocol.md has no row for {m.op(kind)!r}"
    named = set(re.findall(r"`([a-z_]+)", row)) | set(re.findall(r"\b([a-z_]+)\b", row))
    missing = [f for f in _wire_fields(kind) if f != "rid" and f not in named]
    assert not missing, f"docs/protocol.md's {m.op(kind)!r} row does not name {missing}"


def test_a_message_travels_as_the_map_a_peer_has_always_sent():
    sent = m.encode(m.Put(rid=3, oid=OID, size=3, layout={"kind": "bytes"}, inline=b"abc",
                          print_=b"p" * 8))
    assert msgpack.unpackb(sent, raw=False) == {
        "op": "put", "rid": 3, "oid": OID, "size": 3, "layout": {"kind": "bytes"},
        "inline": b"abc", "print": b"p" * 8}
    # defaults are left out
    assert msgpack.unpackb(m.encode(m.Locate(rid=1, oid=OID)), raw=False) == {
        "op": "locate", "rid": 1, "oid": OID}


def test_a_map_decodes_to_its_type():
    body = msgpack.packb({"op": "complete", "oid": OID, "own": True}, use_bin_type=True)
    msg = m.decode_to_directory("peer", body)
    assert msg == m.Complete(oid=OID, own=True) and msg.size == -1 and msg.tag is None


@pytest.mark.parametrize(("raw", "named"), [
    ({"op": "locate", "rid": 4, "oid": b"short"}, "oid"),
    ({"op": "put", "rid": 4, "oid": OID, "size": 3, "layout": {}, "inline": "abc"}, "inline"),
    ({"op": "evict", "rid": 4, "oids": [OID], "need": -1}, "need"),
    ({"op": "reduce", "rid": 4, "target": OID, "inputs": [OID], "op_name": "median",
      "num_objects": 1}, "median"),
    ({"op": "channel_head", "rid": 4, "name": "c", "newer_than": 0, "wait": "false"}, "wait"),
    ({"op": "teleport", "rid": 4}, "unknown op 'teleport'"),
    ({"op": "query", "rid": 4}, "oid"),
])
def test_a_bad_message_is_named_and_answered_under_its_rid(raw, named):
    got = m.decode_to_directory("peer", msgpack.packb(raw, use_bin_type=True))
    assert isinstance(got, m.Invalid) and got.rid == 4 and named in got.message, got


@pytest.mark.parametrize("body", [b"\xc1", msgpack.packb([1, 2]), msgpack.packb("x")])
def test_bytes_that_are_no_map_are_a_protocol_error(body):
    with pytest.raises(ProtocolError, match="peer"):
        m.decode_to_directory("peer", body)


def test_the_reduce_ops_the_protocol_accepts_are_the_kernels_ops():
    from hoplite_gpu.kernels.numpy_ops import OPS

    assert m.REDUCE_OPS == OPS


def test_from_map_names_the_bad_field():
    with pytest.raises(ProtocolError, match="relay"):
        m.from_map({"op": "reduce", "rid": 1, "target": OID, "inputs": [OID],
                    "op_name": "sum", "num_objects": 1, "relay": 1})


# ------------------------------------------------ the directory to a node ---
PUSHES = [m.Drop, m.ReduceStep, m.Located, m.Restripe]


def _doc_section(title: str) -> str:
    text = DOCS.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


@pytest.mark.parametrize("kind", PUSHES, ids=lambda k: m.op(k))
def test_every_push_is_in_the_protocol_docs_with_its_fields(kind):
    paragraphs = _doc_section("Pushes, directory -> node").split("\n\n")
    [text] = [p for p in paragraphs if p.startswith(f'`{{"op": "{m.op(kind)}"')]
    named = set(re.findall(r'"([a-z_]+)"', text)) | set(re.findall(r"`([a-z_]+)", text))
    missing = [f for f in _wire_fields(kind) if f not in named]
    assert not missing, f"docs/protocol.md's {m.op(kind)!r} push does not name {missing}"


@pytest.mark.parametrize("kind", [m.Body, *m.Body.__subclasses__()], ids=lambda k: k.__name__)
def test_every_reply_kind_is_in_the_protocol_docs_with_its_fields(kind):
    rows = {row.split("|")[1].strip().strip("`"): row
            for row in _doc_section("Replies, directory -> node").splitlines()
            if row.startswith("| `")}
    row = rows.get(kind.__name__)
    assert row is not None, f"docs/protocol.md has no reply row for {kind.__name__!r}"
    named = set(re.findall(r"`([a-z_]+)", row))
    missing = [f for f in _wire_fields(kind) if f != "rid" and f not in named]
    assert not missing, f"docs/protocol.md's {kind.__name__!r} row does not name {missing}"


def _all_subclasses(kind: type) -> list[type]:
    return [sub for direct in kind.__subclasses__() for sub in [direct, *_all_subclasses(direct)]]


def test_the_reply_each_request_is_read_as_is_the_one_the_docs_name():
    """A node reads a reply as the kind `messages.REPLIES` names for its
    request: the table's "answers" column must say the same."""
    rows = [row.split("|") for row in _doc_section("Replies, directory -> node").splitlines()
            if row.startswith("| `")]
    requests = {m.op(kind) for kind in _all_subclasses(m.Message) if kind.__struct_config__.tag}
    documented = {cells[1].strip().strip("`"): set(re.findall(r"`([a-z_]+)`", cells[3])) & requests
                  for cells in rows}
    for request, kind in m.REPLIES.items():
        assert m.op(request) in documented[kind.__name__], \
            f"docs/protocol.md does not say {kind.__name__!r} answers {m.op(request)!r}"
    read = {m.op(request) for request in m.REPLIES}
    for name, ops in documented.items():
        if name not in ("Failure", "Body"):
            assert ops <= read, f"{name!r} documented to answer {ops - read}, read otherwise"


def test_a_reply_or_push_that_fits_no_kind_is_a_protocol_error_naming_the_field():
    with pytest.raises(ProtocolError, match="reply to 'locate'.*layout"):
        m.read_reply(m.Locate, {"rid": 3, "size": 1})
    assert m.read_reply(m.Locate, {"rid": 3, "error": "Timeout", "message": "late"}) == \
        m.Failure(rid=3, error="Timeout", message="late")
    with pytest.raises(ProtocolError, match="push 'drop'.*retry"):
        m.read_push({"op": "drop", "oid": b"o" * 20, "reason": "gone"})
    with pytest.raises(ProtocolError, match="push 'nope'"):
        m.read_push({"op": "nope"})
    assert m.read_push(m.as_map(m.Drop(oid=b"o" * 20, reason="r", retry=True))) == \
        m.Drop(oid=b"o" * 20, reason="r", retry=True)


def _sent(msg) -> bytes:
    """The bytes `msg` travels as (checked to decode to a map, first)."""
    assert isinstance(msgpack.unpackb(m.encode(msg), raw=False), dict)
    return m.encode(msg)


def _was(literal: dict) -> bytes:
    """The bytes the dict literal the directory used to send travelled as
    (the same encoder: byte for byte, so key order counts too)."""
    return msgspec.msgpack.encode(literal)


def test_the_directorys_replies_travel_as_the_maps_they_always_were():
    from hoplite_gpu.directory import state as s

    layout = {"kind": "bytes", "dtype": "|u1", "shape": [1 << 20], "nbytes": 1 << 20}
    d = s.Directory()
    for node in ("n0", "n1"):
        d.handle(s.NodeJoined(node, f"tcp://{node}:1"))
    [ok] = d.handle(s.Put("n0", 1, OID, 1 << 20, layout))
    assert _sent(m.answering(ok.body, 1)) == _was({"rid": 1, "ok": True})
    d.handle(s.Completed("n0", OID))
    [located] = d.handle(s.Locate("n1", 7, OID))
    assert _sent(m.answering(located.body, 7)) == _was(
        {"rid": 7, "size": 1 << 20, "layout": layout, "sender": "n0", "address": "tcp://n0:1"})
    [query] = d.handle(s.Query("n1", 8, OID))
    assert _sent(m.answering(query.body, 8)) == _was(
        {"rid": 8, "size": 1 << 20, "layout": layout, "inline": False, "holders": [
            {"node": "n0", "address": "tcp://n0:1", "nbytes": 1 << 20, "complete": True,
             "origin": True, "upstream": None, "serving": ["n1"]},
            {"node": "n1", "address": "tcp://n1:1", "nbytes": 0, "complete": False,
             "origin": False, "upstream": "n0", "serving": []}],
         "edges": [["n1", "n0"]], "waiting": 0})
    out = d.handle(s.DeleteMany("n1", 10, (OID, b"x" * 20)))
    assert _sent(m.answering(out[0].body, 10)) == _was(
        {"rid": 10, "ok": True, "existed": [True, False]})
    # a refusal, and the first replies of a connection (no rid)
    assert _sent(m.Failure(rid=0, error="ProtocolError", message="no")) == _was(
        {"rid": 0, "error": "ProtocolError", "message": "no"})
    assert _sent(m.Failure(error="ProtocolError", message="no")) == _was(
        {"error": "ProtocolError", "message": "no"})
    assert _sent(m.Registered(ok=True, node="n2", lease_s=5.0)) == _was(
        {"ok": True, "node": "n2", "lease_s": 5.0})
    assert _sent(m.Attached(ok=True, node="n2")) == _was({"ok": True, "node": "n2"})


def test_the_directorys_pushes_travel_as_the_maps_they_always_were():
    from hoplite_gpu.directory import state as s

    layout = {"kind": "numpy", "dtype": "<f4", "shape": [4], "nbytes": 16}
    target = b"t" * 20
    d = s.Directory()
    for i in range(3):
        d.handle(s.NodeJoined(f"n{i}", f"tcp://n{i}:1"))
    d.handle(s.ReduceRequested("n0", 1, target, (b"a" * 20, b"b" * 20), "sum", 2))
    out = []
    for i, key in enumerate((b"a" * 20, b"b" * 20)):
        out += d.handle(s.Put(f"n{i + 1}", 1, key, 16, layout))
        out += d.handle(s.Completed(f"n{i + 1}", key))
    [step] = [c.step for c in out if isinstance(c, s.StartReduceStep)]
    [child] = step.children
    assert _sent(step) == _was(
        {"op": "reduce_step", "target": target, "output": step.output, "input": step.input,
         "children": [{"oid": child.oid, "address": child.address, "node": child.node}],
         "reduce_op": "sum",
         "count": 2, "size": 16, "layout": layout, "tag": step.tag})
    early = m.ReduceStep(target=target, output=b"o" * 20, input=b"i" * 20, children=[],
                         reduce_op="sum", count=0, size=16, layout=layout, tag=b"g", early=True)
    assert _sent(early) == _was(
        {"op": "reduce_step", "target": target, "output": b"o" * 20, "input": b"i" * 20,
         "children": [], "reduce_op": "sum", "count": 0, "size": 16, "layout": layout,
         "tag": b"g", "early": True})
    assert _sent(m.Located(oid=OID, size=16, layout=layout, sender="n1", address="tcp://n1:1")) \
        == _was({"op": "located", "oid": OID, "size": 16, "layout": layout, "sender": "n1",
                 "address": "tcp://n1:1"})
    assert _sent(m.Located(oid=OID, size=16, layout=layout, reduce_tag=b"g", local=True)) == _was(
        {"op": "located", "oid": OID, "size": 16, "layout": layout, "reduce_tag": b"g",
         "local": True})
    assert _sent(m.Drop(oid=OID, reason="gone", retry=False)) == _was(
        {"op": "drop", "oid": OID, "reason": "gone", "retry": False})


def test_the_handshake_and_error_frames_travel_as_the_maps_they_always_were():
    from hoplite_gpu import protocol

    nonce, mac = b"n" * 32, b"m" * 32
    assert _sent(m.Challenge(hello="hoplite-gpu", version=11, nonce=nonce)) == _was(
        {"hello": "hoplite-gpu", "version": 11, "nonce": nonce})
    assert _sent(m.Proof(nonce=nonce, mac=mac)) == _was({"nonce": nonce, "mac": mac})
    assert _sent(m.Verdict(ok=True, mac=mac)) == _was({"ok": True, "mac": mac})
    assert _sent(m.Verdict(ok=False, error="wrong cluster token")) == _was(
        {"ok": False, "error": "wrong cluster token"})

    class Window:
        async def send(self, head, body):
            self.body = bytes(body)

    import asyncio

    window = Window()
    asyncio.run(protocol.send_error_frame(window, "ObjectNotFound", "x" * 300))
    assert window.body == msgpack.packb({"error": "ObjectNotFound", "message": "x" * 300},
                                        use_bin_type=True)


@pytest.mark.parametrize("decode", [m.decode_map, m.decode_hello, m.decode_to_directory,
                                    m.decode_pull, m.decode_ack], ids=lambda f: f.__name__)
@pytest.mark.parametrize("under", [None, "layout"])
def test_a_deeply_nested_message_is_refused_as_a_protocol_error(decode, under):
    """Bug: msgspec recurses once per level of nesting and raises
    RecursionError past Python's limit, which the decoders let through: a
    4 KiB body of arrays of one (``0x91`` bytes), sent as a handshake's
    proof by a peer without the token, ended the server's connection task
    with an exception that is no HopliteError (logged as never retrieved)."""
    body = (b"\x82\xa2op\xa3put\xa6layout" if under else b"") + b"\x91" * 4000 + b"\xc0"
    with pytest.raises(ProtocolError, match="nested too deeply"):
        decode("peer", body)



def test_a_deeply_nested_field_of_a_channel_manifest_is_refused_by_name():
    """Bug: as above for a manifest object's bytes: msgspec skips a field a
    Manifest does not have level by level, so a deeply nested one raised
    RecursionError instead of the ProtocolError that names the manifest."""
    body = b"\x82\xa7version\x01\xa5extra" + b"\x91" * 4000 + b"\xc0"
    with pytest.raises(ProtocolError, match="channel 'w' is not a channel manifest: nested"):
        m.decode_manifest("channel 'w'", body)


def test_a_channel_publish_of_a_negative_version_is_invalid():
    """Bug: a version below 0 was taken, and the directory's state machine
    raised KeyError on it for a channel with no head yet (-1 means "none
    yet" there); it is now refused where it is decoded."""
    msg = m.decode_to_directory("peer", m.encode(m.ChannelPublish(rid=3, name="c", version=-1)))
    assert isinstance(msg, m.Invalid) and msg.rid == 3 and "version" in msg.message, msg
