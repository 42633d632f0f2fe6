"""Pulls from several senders: when a large object has complete copies that
serve nobody, the directory names them besides the receiver's sender
(`Location.also`), and the receiver pulls pieces from each (`Plan.pieces`,
run as a queue by the pull engine). Directory rules (pure), then real pulls
between in-process nodes, one of whose senders dies midway."""

from __future__ import annotations

import numpy as np
import pytest
from in_process import count_writes, cut_halfway, eventually, run_nodes

import hoplite_gpu as hg
from hoplite_gpu import messages as m
from hoplite_gpu.directory.commands import PushLocated, Reply
from hoplite_gpu.directory.state import (
    Completed,
    Directory,
    Locate,
    NodeJoined,
    NodeLost,
    Put,
    TransferFailed,
)
from hoplite_gpu.values import Layout

MiB = 1 << 20
OID = b"s" * 20
BIG = {"kind": "bytes", "nbytes": 64 * MiB}


# -- the directory --------------------------------------------------------------


def _directory(holders: int, *, sources: int = 4, size: int = 64 * MiB,
               fan: int = 1) -> Directory:
    """A directory where n0 put OID and n1 .. n<holders-1> pulled it whole."""
    d = Directory(max_receivers_per_sender=fan, max_sources=sources,
                  multi_source_bytes=16 * MiB)
    for i in range(8):
        d.handle(NodeJoined(f"n{i}", f"tcp://h{i}:1"))
    d.handle(Put("n0", 1, OID, size, BIG))
    d.handle(Completed("n0", OID))
    for i in range(1, holders):
        _get(d, f"n{i}")
        d.handle(Completed(f"n{i}", OID))
    return d


def _get(d: Directory, node: str, request: int = 7) -> m.Location:
    [reply] = [c for c in d.handle(Locate(node, request, OID)) if isinstance(c, Reply)]
    return reply.body


def test_a_large_get_is_given_the_idle_complete_copies_as_well():
    d = _directory(3)
    body = _get(d, "n5")
    senders = [body.sender, *(s.sender for s in body.also)]
    assert sorted(senders) == ["n0", "n1", "n2"]
    assert [s.address for s in body.also] == [f"tcp://h{s.sender[1]}:1" for s in body.also]
    mine = d.objects[OID].holders["n5"]
    assert (mine.upstream, *mine.also) == tuple(senders) and mine.several
    assert all(d.objects[OID].holders[s].serving == {"n5"} for s in senders)
    assert {("n5", s) for s in senders} <= set(d.objects[OID].edges)


def test_no_more_senders_than_max_sources_and_none_busy():
    d = _directory(5, sources=3)
    first = _get(d, "n5")
    assert len(first.also) == 2  # three senders in all
    second = _get(d, "n6")  # the two copies left idle
    assert len(second.also) == 1
    taken = {first.sender, *(s.sender for s in first.also)}
    assert not taken & {second.sender, *(s.sender for s in second.also)}


@pytest.mark.parametrize("size, sources", [(8 * MiB, 4), (64 * MiB, 1)])
def test_a_small_object_or_max_sources_1_keeps_one_sender(size, sources):
    d = _directory(3, sources=sources, size=size)
    assert _get(d, "n5").also == []
    assert not d.objects[OID].holders["n5"].several


def test_a_complete_pull_frees_every_senders_slot():
    d = _directory(3)
    body = _get(d, "n5")
    d.handle(Completed("n5", OID))
    entry = d.objects[OID]
    assert all(not entry.holders[s].serving for s in [body.sender, *(x.sender for x in body.also)])
    assert entry.holders["n5"].also == () and entry.holders["n5"].upstream is None


def test_one_sender_failing_leaves_the_pull_with_the_others():
    d = _directory(3)
    body = _get(d, "n5")
    entry = d.objects[OID]
    gone = body.sender
    d.handle(TransferFailed("n5", OID, gone, 10 * MiB))
    mine = entry.holders["n5"]
    rest = [x.sender for x in body.also]
    assert (mine.upstream, *mine.also) == tuple(rest) and mine.several
    assert "n5" not in entry.holders[gone].serving and gone in mine.failed_from
    for sender in rest:  # the last one failing ends the pull, as one sender's failure does
        d.handle(TransferFailed("n5", OID, sender, 20 * MiB))
    assert mine.upstream is None and mine.also == () and not mine.several
    assert all(not entry.holders[s].serving for s in ["n0", "n1", "n2"])


def test_a_sender_that_dies_is_replaced_by_another_of_the_pull():
    d = _directory(3)
    body = _get(d, "n5")
    d.handle(NodeLost(body.sender))
    mine = d.objects[OID].holders["n5"]
    assert mine.upstream == body.also[0].sender and len(mine.also) == len(body.also) - 1


def test_a_direct_locate_pushes_the_other_senders_too():
    d = _directory(3)
    out = d.handle(Locate("n5", -3, OID, direct=True))
    [pushed] = [c for c in out if isinstance(c, PushLocated)]
    assert len(pushed.body.also) == 2


# -- real pulls -----------------------------------------------------------------


def _raw(size: int) -> Layout:
    return Layout("bytes", "uint8", (size,), size)


def test_a_get_pulls_pieces_from_three_holders_and_every_byte_once():
    """(Over TCP: with shared memory, a same-host complete copy is mapped,
    not pulled.)"""
    size = 24 * MiB
    value = (np.arange(size) % 253).astype(np.uint8)
    config = hg.Config(shared_memory=False, chunk_size=MiB, timeout_s=20, stall_timeout_s=2.0)

    async def body(directory, a, b, c, reader):
        oid = hg.ObjectID.from_name("three-holders")
        await a.put(value, oid)
        await b.fetch(oid, 10)  # (each pulls from a alone: a is busy or the only copy)
        await c.fetch(oid, 10)
        served = {n.node_id: [] for n in (a, b, c)}
        for n in (a, b, c):
            real = n.server._stream_range

            async def counted(stream, obj, pos, end, stall, size, real=real,
                              mine=served[n.node_id]):
                mine.append((pos, end))
                return await real(stream, obj, pos, end, stall, size)

            n.server._stream_range = counted
        got = await reader.fetch(oid, 10)
        np.testing.assert_array_equal(np.asarray(got.buffer), value)
        ranges = sorted(r for mine in served.values() for r in mine)
        assert all(served.values()), f"a holder served nothing: {served}"
        covered = 0
        for start, end in ranges:  # disjoint, and all of it: no byte twice
            assert start == covered, ranges
            covered = end
        assert covered == size
        info = await reader.query(oid)
        assert {s for r, s in info["edges"] if r == reader.node_id} == {
            a.node_id, b.node_id, c.node_id}

    run_nodes([config] * 4, body, bound=60, max_sources=3, multi_source_bytes=16 * MiB)


def test_a_holder_dying_midway_leaves_its_bytes_to_the_others():
    """One of three holders sends half of its first piece and cuts the
    connection: its rest goes to the other two, the copy is whole, no byte
    came twice, and the directory heard of that sender alone."""
    size = 32 * MiB
    value = (np.arange(size) % 251).astype(np.uint8)
    config = hg.Config(shared_memory=False, chunk_size=MiB, timeout_s=20, stall_timeout_s=2.0)

    async def body(directory, a, b, c, reader):
        oid = hg.ObjectID.from_name("holder-dies")
        await a.put(value, oid)
        await b.fetch(oid, 10)
        await c.fetch(oid, 10)
        cut_halfway(b.server)
        counts = np.zeros(size, np.int64)
        count_writes(reader, counts)
        failed = []
        real_failed = reader.pulls._flow_failed
        reader.pulls._flow_failed = lambda o, f, e: (failed.append(f.sender), real_failed(o, f, e))
        got = await reader.fetch(oid, 20)
        np.testing.assert_array_equal(np.asarray(got.buffer), value)
        assert (counts == 1).all(), "a byte was written twice, or never"
        assert failed == [b.node_id]
        holder = directory.state.objects[oid.binary].holders[reader.node_id]
        assert await eventually(lambda: holder.complete)  # (its `complete` is on its way)
        assert b.node_id in holder.failed_from

    run_nodes([config] * 4, body, bound=60, max_sources=3, multi_source_bytes=16 * MiB)


@pytest.mark.parametrize("nbytes, senders", [(256 * MiB, 3), (256 * MiB, 4), (24 * MiB, 3),
                                             (1 << 30, 3), (17 * MiB + 5, 2)])
def test_pieces_are_a_whole_number_per_sender_within_bounds(nbytes, senders):
    """Regression: 256 MiB over 3 senders went in 16 pieces of 16 MiB, so one
    sender took 6 and the last piece ran alone: 6/16 of one sender's time
    at best, where a third was the point."""
    from hoplite_gpu.node.engine import PIECE_MAX, PIECE_MIN, piece_size

    piece = piece_size(nbytes, senders)
    pieces = -(-nbytes // piece)
    assert PIECE_MIN <= piece <= PIECE_MAX
    assert pieces % senders == 0 or piece == PIECE_MIN
    assert pieces >= 4 * senders or piece == PIECE_MIN
