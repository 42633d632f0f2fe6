"""A pull as a plan of sub-flows: the plan and its ledger (pure), the engine
that runs a plan (with a scripted fetch), and real plans of several
sub-flows over TCP between in-process nodes, one of whose senders dies."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from in_process import count_writes, cut_halfway, run_nodes

import hoplite_gpu as hg
from hoplite_gpu.errors import PeerLost, Timeout
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.node import engine, shm
from hoplite_gpu.node.plan import Ledger, Plan, SubFlow
from hoplite_gpu.node.store import StoredObject
from hoplite_gpu.transports import usable
from hoplite_gpu.values import Layout

MiB = 1 << 20


# -- the ledger ----------------------------------------------------------------


def test_the_ledger_merges_runs_and_gives_the_prefix():
    ledger = Ledger(100)
    ledger.write(10, 20)
    assert ledger.prefix == 0 and ledger.missing() == [(0, 10), (20, 100)]
    ledger.write(0, 10)
    assert ledger.prefix == 20 and ledger.runs == [(0, 20)]
    ledger.write(50, 60)
    ledger.write(30, 40)
    ledger.write(40, 50)
    assert ledger.runs == [(0, 20), (30, 60)]
    assert ledger.missing(15, 70) == [(20, 30), (60, 70)]
    ledger.write(20, 30)
    ledger.write(60, 100)
    assert ledger.complete and ledger.prefix == 100 and ledger.missing() == []


@pytest.mark.parametrize("start,end", [(5, 15), (0, 11), (19, 30), (10, 20), (12, 13), (0, 100)])
def test_the_ledger_refuses_a_byte_written_twice(start, end):
    ledger = Ledger(100)
    ledger.write(10, 20)
    with pytest.raises(ValueError, match="written already"):
        ledger.write(start, end)
    assert ledger.runs == [(10, 20)]


def test_the_ledger_refuses_bytes_outside_the_object():
    with pytest.raises(ValueError, match="outside"):
        Ledger(10).write(5, 11)


def test_the_ledger_hands_out_what_a_failed_sub_flow_left():
    ledger = Ledger(100, prefix=10)
    flow = SubFlow(10, 60, "a", "tcp://a:1")
    ledger.write(10, 35)
    assert ledger.rest(flow) == [SubFlow(35, 60, "a", "tcp://a:1")]
    assert [r.moved("b", "tcp://b:1") for r in ledger.rest(flow)] == [SubFlow(35, 60, "b", "tcp://b:1")]


# -- plans ---------------------------------------------------------------------


def test_a_single_plan_is_todays_pull():
    plan = Plan.single("oid", 100, "a", "tcp://a:1", start=40)
    assert plan.flows == (SubFlow(40, 100, "a", "tcp://a:1"),)
    assert plan.senders == [("a", "tcp://a:1")]


def test_a_plan_refuses_overlapping_or_outside_sub_flows():
    with pytest.raises(ValueError):
        Plan("oid", 100, (SubFlow(0, 60, "a", "x"), SubFlow(50, 100, "b", "y")))
    with pytest.raises(ValueError):
        Plan("oid", 100, (SubFlow(0, 101, "a", "x"),))
    with pytest.raises(ValueError):
        SubFlow(10, 5, "a", "x")


def test_split_cuts_equal_ranges_and_takes_senders_in_turn():
    plan = Plan.split("oid", 90, [("a", "x"), ("b", "y")], parts=3)
    assert [(f.start, f.end, f.sender) for f in plan.flows] == [(0, 30, "a"), (30, 60, "b"),
                                                                 (60, 90, "a")]


def test_split_covers_only_what_is_missing():
    plan = Plan.split("oid", 100, [("a", "x")], missing=[(10, 20), (50, 100)], parts=2)
    # (60 missing bytes in two parts of 30: the first spans both ranges)
    assert [(f.start, f.end) for f in plan.flows] == [(10, 20), (50, 70), (70, 100)]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_split_plans_cover_the_missing_bytes_exactly(data):
    size = data.draw(st.integers(0, 5000))
    cuts = sorted(data.draw(st.lists(st.integers(0, size), max_size=6)))
    edges = [0, *cuts, size]
    missing = [(a, b) for a, b in zip(edges[::2], edges[1::2], strict=False) if a < b]
    senders = [(f"s{i}", f"tcp://s{i}:1") for i in range(data.draw(st.integers(1, 4)))]
    plan = Plan.split("oid", size, senders, missing=missing, parts=data.draw(st.integers(1, 9)))
    covered = sorted((f.start, f.end) for f in plan.flows)
    ledger = Ledger(size)
    for a, b in covered:
        ledger.write(a, b)  # (disjoint: no byte twice)
    assert ledger.runs == _merged(missing)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


# -- a plan run with failures: the ledger's invariants ---------------------------


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_random_plans_and_failures_write_every_byte_once(data):
    """Random plans (equal parts or pieces) over random senders, run by the
    engine, each sub-flow landing in random steps and failing at a random
    offset, except that one sender never fails: every byte is written
    exactly once, the watermark is always the longest written prefix, and
    the object ends complete."""
    size = data.draw(st.integers(1, 4000))
    senders = [(f"s{i}", f"a{i}") for i in range(data.draw(st.integers(1, 4)))]
    if data.draw(st.booleans()):
        plan = Plan.split("oid", size, senders, parts=data.draw(st.integers(1, 8)))
    else:
        plan = Plan.pieces("oid", size, senders,
                           piece=data.draw(st.integers(max(1, size // 40), size)))
    if data.draw(st.booleans()):  # each sub-flow from its own sender, at once
        plan = dataclasses.replace(plan, pinned=True)
    survivor = data.draw(st.sampled_from(senders))[0]
    obj = _object(size)
    counts = np.zeros(size, np.int64)
    failures = []

    original = set(plan.flows) if plan.pinned else set()
    given_after_failing = []

    async def fetch(flow, sink):
        if flow.sender in failures and flow not in original:  # (a pinned one started at once)
            given_after_failing.append(flow)
        fails = flow.sender != survivor and data.draw(st.booleans())
        stop = data.draw(st.integers(flow.start, flow.end)) if fails else flow.end
        pos = flow.start
        while pos < stop:  # in random steps, the senders interleaving
            upto = min(stop, pos + data.draw(st.integers(1, max(1, stop - pos))))
            sink.advance(upto)
            counts[pos:upto] += 1
            pos = upto
            assert obj.ready == _longest_prefix(counts)
            await asyncio.sleep(0)
        if fails:
            raise PeerLost(f"{flow.sender} failed (test)")

    asyncio.run(engine.run_plan(plan, obj, fetch, lambda f, e: failures.append(f.sender),
                                (PeerLost,)))
    assert (counts == 1).all()
    assert obj.complete and obj.ledger is None and survivor not in failures
    assert not given_after_failing, f"given bytes after they failed: {given_after_failing}"


def test_pieces_cut_the_missing_bytes_in_order_and_name_the_senders_in_turn():
    plan = Plan.pieces("oid", 100, [("a", "x"), ("b", "y")], missing=[(10, 35), (50, 100)],
                       piece=20)
    assert [(f.start, f.end, f.sender) for f in plan.flows] == [
        (10, 30, "a"), (30, 35, "b"), (50, 70, "a"), (70, 90, "b"), (90, 100, "a")]
    with pytest.raises(ValueError, match="at least one byte"):
        Plan.pieces("oid", 100, [("a", "x")], piece=0)


def test_a_faster_sender_takes_more_pieces():
    """The queue: each sender takes the next piece when done with one."""
    obj = _object(1000)
    plan = Plan.pieces(obj.oid, 1000, [("slow", "x"), ("fast", "y")], piece=100)
    took = []

    async def fetch(flow, sink):
        await asyncio.sleep(0.05 if flow.sender == "slow" else 0.005)
        took.append(flow.sender)
        sink.advance(flow.end)

    asyncio.run(engine.run_plan(plan, obj, fetch, lambda f, e: None, (PeerLost,)))
    assert obj.complete and took.count("slow") <= 2 and took.count("fast") >= 8


def _longest_prefix(counts: np.ndarray) -> int:
    unwritten = np.flatnonzero(counts == 0)
    return int(unwritten[0]) if len(unwritten) else len(counts)


# -- the engine, with a scripted fetch -----------------------------------------


def _raw(size: int) -> Layout:
    return Layout("bytes", "uint8", (size,), size)


def _object(size: int) -> StoredObject:
    return StoredObject(ObjectID.random(), _raw(size), np.zeros(size, np.uint8))


def test_a_single_sub_flow_advances_the_watermark_itself():
    """Today's pull: no ledger, the object is the sink."""
    obj = _object(100)
    obj.advance(30)
    sinks = []

    async def fetch(flow, sink):
        sinks.append(sink)
        sink.advance(flow.end)

    asyncio.run(engine.run_plan(Plan.single(obj.oid, 100, "a", "x", start=30), obj, fetch,
                                lambda f, e: None, (PeerLost,)))
    assert sinks == [obj] and obj.complete and obj.ledger is None


def test_sub_flows_run_concurrently_and_the_watermark_is_the_prefix():
    obj = _object(300)
    plan = Plan.split(obj.oid, 300, [("a", "x"), ("b", "y")], parts=3)
    order = []
    gate = asyncio.Event

    async def main():
        second_done = gate()

        async def fetch(flow, sink):
            if flow.start == 0:
                await second_done.wait()  # the first range lands last
            sink.advance(flow.end)
            order.append((flow.start, obj.ready))
            if flow.start == 100:
                second_done.set()

        await engine.run_plan(plan, obj, fetch, lambda f, e: None, (PeerLost,))

    asyncio.run(main())
    # the later ranges land first but the watermark stays at 0 until the first is in
    assert sorted(order) == [(0, 300), (100, 0), (200, 0)]
    assert obj.complete and obj.ledger is None


def test_a_failed_sub_flow_moves_its_rest_to_another_sender():
    obj = _object(300)
    plan = Plan.split(obj.oid, 300, [("a", "x"), ("b", "y")], parts=2)
    calls, failures = [], []

    async def fetch(flow, sink):
        calls.append((flow.sender, flow.start, flow.end))
        if flow.sender == "a":
            sink.advance(flow.start + 40)
            raise PeerLost("a died (test)")
        sink.advance(flow.end)

    asyncio.run(engine.run_plan(plan, obj, fetch, lambda f, e: failures.append(f.sender),
                                (PeerLost,)))
    assert failures == ["a"]
    assert sorted(calls) == [("a", 0, 150), ("b", 40, 150), ("b", 150, 300)]
    assert obj.complete


def test_a_failure_with_no_sender_left_is_the_pulls_and_keeps_the_ledger():
    obj = _object(300)
    plan = Plan.split(obj.oid, 300, [("a", "x")], parts=2)

    async def fetch(flow, sink):
        sink.advance(flow.start + 10)
        if flow.start:
            raise PeerLost("a died (test)")
        await asyncio.sleep(1)  # cancelled by the other's failure

    with pytest.raises(PeerLost):
        asyncio.run(engine.run_plan(plan, obj, fetch, lambda f, e: None, (PeerLost,)))
    assert obj.ready == 10 and obj.ledger.runs == [(0, 10), (150, 160)]


def test_a_relay_waiting_on_a_plan_filled_copy_wakes_only_once_the_prefix_covers_it():
    """Bytes past a gap are recorded but not servable: a data server's wait
    for them (`wait_ready`) ends only when the bytes before them are in."""
    obj = _object(300)
    ledger = Ledger(300)

    async def main():
        waiting = asyncio.ensure_future(obj.wait_ready(150, 5))
        engine.FlowSink(obj, ledger, 100).advance(300)
        await asyncio.sleep(0.01)
        assert not waiting.done() and obj.ready == 0
        engine.FlowSink(obj, ledger, 0).advance(100)
        await asyncio.wait_for(waiting, 1)
        assert obj.ready == 300

    asyncio.run(main())


def test_a_sink_refuses_a_byte_twice():
    obj = _object(100)
    ledger = Ledger(100)
    engine.FlowSink(obj, ledger, 0).advance(50)
    with pytest.raises(ValueError):
        engine.FlowSink(obj, ledger, 40).advance(60)


# -- real plans over TCP ---------------------------------------------------------




#: (transport, shared memory): messages over TCP (in parts) and UCX (whole),
#: and copies out of a same-host sender's mapping (sub-flows that start
#: mid-object in each mode).
TRANSPORTS = [
    pytest.param(("tcp", False), id="tcp"),
    pytest.param(("tcp", True), id="shared-memory",
                 marks=pytest.mark.skipif(not shm.usable(), reason="no shared memory here")),
    pytest.param(("ucx", False), id="ucx",
                 marks=pytest.mark.skipif(not usable("ucx"), reason="ucxx is not installed")),
]


def _config(how: tuple[str, bool]) -> hg.Config:
    transport, shared = how
    return hg.Config(shared_memory=shared, chunk_size=MiB, timeout_s=10, stall_timeout_s=1.0,
                     transport=transport)


@pytest.mark.parametrize("how", TRANSPORTS)
def test_a_plan_of_three_sub_flows_from_two_senders_fills_the_object(how):
    size = 12 * MiB
    value = np.arange(size, dtype=np.uint8)

    async def body(directory, a, b, reader):
        oid = hg.ObjectID.from_name("plan-three-flows")
        await a.put(value, oid)
        await b.fetch(oid, 10)  # a second complete copy
        obj = reader.store.create(oid, _raw(size))
        counts = np.zeros(size, np.int64)
        count_writes(reader, counts)
        plan = Plan.split(oid, size, [(a.node_id, a.server.address), (b.node_id, b.server.address)],
                          parts=3)
        assert len({f.sender for f in plan.flows}) == 2
        await reader.pull_plan(obj, plan)
        assert obj.complete and obj.ledger is None
        np.testing.assert_array_equal(obj.buffer, value)
        assert (counts == 1).all()
        if how[1]:  # each sub-flow copied out of its sender's mapping
            assert reader.pool.local_pulls == len(plan.flows)

    run_nodes([_config(how)] * 3, body, bound=30)


@pytest.mark.parametrize("how", TRANSPORTS)
def test_a_sub_flow_whose_sender_dies_midway_is_finished_by_the_other(how, monkeypatch):
    """Sender A serves half of its sub-flow and dies (its data server cuts
    the connection): the rest of that range comes from B, and no byte is
    written twice."""
    size = 16 * MiB
    value = (np.arange(size) % 251).astype(np.uint8)

    async def body(directory, a, b, reader):
        oid = hg.ObjectID.from_name("plan-sender-dies")
        await a.put(value, oid)
        await b.fetch(oid, 10)
        served = cut_halfway(a.server)
        obj = reader.store.create(oid, _raw(size))
        counts = np.zeros(size, np.int64)
        count_writes(reader, counts)
        failed = []
        real_failed = reader.pulls._flow_failed
        reader.pulls._flow_failed = lambda o, flow, exc: (failed.append(flow), real_failed(o, flow, exc))
        plan = Plan.split(oid, size, [(a.node_id, a.server.address), (b.node_id, b.server.address)])
        await reader.pull_plan(obj, plan)
        np.testing.assert_array_equal(obj.buffer, value)
        assert (counts == 1).all(), "a byte was written twice, or never"
        assert served == [(0, size // 2)]
        assert [f.sender for f in failed] == [a.node_id]
        assert obj.complete and obj.ledger is None

    run_nodes([_config(how)] * 3, body, bound=30)


def test_a_range_past_the_watermark_is_served_as_soon_as_it_is_written():
    """A copy filled by a plan of several sub-flows (one per tree of a
    multi-tree broadcast) relays each range as it lands, not only once the
    bytes before it are in: `ready_from` and `wait_range`."""
    obj = _object(300)
    ledger = Ledger(300)
    obj.ledger = ledger

    async def main():
        waiting = asyncio.ensure_future(obj.wait_range(200, 260, 5))
        early = asyncio.ensure_future(obj.wait_range(0, 50, 5))
        engine.FlowSink(obj, ledger, 200).advance(240)
        await asyncio.sleep(0.01)
        assert not waiting.done() and obj.ready_from(200) == 240 and obj.ready_from(250) == 250
        engine.FlowSink(obj, ledger, 240).advance(300)
        await asyncio.wait_for(waiting, 1)
        assert obj.ready == 0 and not early.done()  # (the watermark waits for byte 0)
        engine.FlowSink(obj, ledger, 0).advance(200)
        await asyncio.wait_for(early, 1)
        assert obj.ready == 300 and obj.ready_from(0) == 300
        with pytest.raises(Timeout):
            await _object(10).wait_range(5, 10, 0.01)

    asyncio.run(main())


def test_a_failed_object_fails_its_range_waits_too():
    obj = _object(300)
    obj.ledger = Ledger(300)

    async def main():
        waiting = asyncio.ensure_future(obj.wait_range(100, 200, 5))
        await asyncio.sleep(0)
        obj.fail(PeerLost("gone (test)"))
        with pytest.raises(PeerLost):
            await waiting

    asyncio.run(main())


def test_a_pinned_plan_pulls_each_range_from_its_own_sender_at_once():
    """A multi-tree broadcast's plan: each tree's range from that tree's
    parent, concurrently, even two ranges from one sender; a failed one's
    rest goes to another sender (here the spare that names no range)."""
    obj = _object(300)
    plan = Plan(obj.oid, 300, (SubFlow(0, 100, "a", "x"), SubFlow(100, 200, "a", "x"),
                               SubFlow(200, 300, "b", "y")),
                sources=(("a", "x"), ("b", "y"), ("spare", "z")), pinned=True)
    started, calls = [], []

    async def main():
        both = asyncio.Event()

        async def fetch(flow, sink):
            started.append(flow.start)
            if len(started) == 3:
                both.set()
            await asyncio.wait_for(both.wait(), 1)  # all three run at once
            calls.append((flow.sender, flow.start, flow.end))
            if flow.sender == "b":
                sink.advance(250)
                raise PeerLost("b died (test)")
            sink.advance(flow.end)

        await engine.run_plan(plan, obj, fetch, lambda f, e: None, (PeerLost,))

    asyncio.run(main())
    assert sorted(calls) == [("a", 0, 100), ("a", 100, 200), ("b", 200, 300),
                             ("spare", 250, 300)] or ("a", 250, 300) in calls
    assert obj.complete


def test_without_spares_a_failed_ranges_rest_goes_only_to_a_backup_and_at_once():
    """A multitree broadcast's plan (no spares, the root a backup): b's
    range fails at 250 while a still pulls its own; the rest of b's range
    is pulled from the root at once, never from a (a parent that may wait
    on those very bytes), and a's pull ends only after the root's."""
    obj = _object(300)
    plan = Plan(obj.oid, 300, (SubFlow(0, 200, "a", "x"), SubFlow(200, 300, "b", "y")),
                pinned=True, spares=False, backups=(("root", "r"),))
    calls = []

    async def main():
        root_done = asyncio.Event()

        async def fetch(flow, sink):
            calls.append((flow.sender, flow.start, flow.end))
            if flow.sender == "b":
                sink.advance(250)
                raise PeerLost("b died (test)")
            if flow.sender == "a":  # (waits for the root's: not after a is done)
                await asyncio.wait_for(root_done.wait(), 1)
            sink.advance(flow.end)
            if flow.sender == "root":
                root_done.set()

        await engine.run_plan(plan, obj, fetch, lambda f, e: None, (PeerLost,))

    asyncio.run(main())
    assert sorted(calls) == [("a", 0, 200), ("b", 200, 300), ("root", 250, 300)]
    assert obj.complete
