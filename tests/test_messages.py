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
