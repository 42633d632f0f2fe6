"""Collectives in one process (local mode): the other ranks' inputs are put
under the ids those ranks would use."""

from __future__ import annotations

import time

import numpy as np
import pytest
from in_process import allreduce_on_threads

import hoplite_gpu as hg
from hoplite_gpu import collectives


def _put_rank(name: str, rank: int, value) -> None:
    hg.put(value, collectives.input_id(name, rank))


@pytest.mark.parametrize("op", ["gather", "allgather"])
def test_gathers_return_every_rank_in_rank_order(local, op):
    size = 5
    for r in (3, 1, 4, 2):  # put out of order
        _put_rank(f"g-{op}", r, np.full(1000 * r + 7, r, dtype=np.int32))
    out = getattr(collectives, op)(np.zeros(7, dtype=np.int32), name=f"g-{op}", rank=0,
                                   size=size, timeout=10)
    assert [int(x[0]) for x in out] == [0, 1, 2, 3, 4]
    assert [x.size for x in out] == [7, 1007, 2007, 3007, 4007]
    assert collectives.gather(np.zeros(1), name="not-root", rank=1, size=2, timeout=1) is None


def test_a_gather_pulls_every_input_at_once(local):
    """The root asks for every missing input at the same time (one round trip
    for small objects, not one per rank), and gets them as they are put."""
    import threading

    rt = hg.api.runtime()
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("out", collectives.gather(
        np.zeros(3), name="late", rank=0, size=5, timeout=10)))
    t.start()
    pending = rt.directory.state.pending  # (asked by the caller's thread or the node's loop)
    deadline = time.monotonic() + 5
    while sum(map(len, pending.values())) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(map(len, pending.values())) == 4  # ranks 1-4, all waiting at once
    for r in (4, 2, 1, 3):
        _put_rank("late", r, np.full(3, r, dtype=np.float64))
    t.join(10)
    assert [float(x[0]) for x in result["out"]] == [0, 1, 2, 3, 4]


def test_a_failed_gather_leaves_nothing_waiting(local):
    with pytest.raises(hg.Timeout):
        collectives.gather(np.zeros(3), name="missing", rank=0, size=5, timeout=0.5)
    rt = hg.api.runtime()
    deadline = time.monotonic() + 5
    state = rt.directory.state
    while (rt.node._pulls or state.pending) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not rt.node._pulls and not rt.node._pull_waiters
    assert not state.pending and not state.direct  # the directory forgot the waits too


@pytest.mark.parametrize("op", ["reduce", "allreduce"])
def test_reduces_sum_every_rank(local, op):
    size = 4
    for r in (2, 1, 3):
        _put_rank(f"r-{op}", r, np.full(50_000, r, dtype=np.float64))
    out = getattr(collectives, op)(np.full(50_000, 10.0), name=f"r-{op}", rank=0, size=size,
                                   timeout=10)
    assert out.shape == (50_000,) and float(out[0]) == float(out[-1]) == 16.0


def test_a_bad_value_fails_the_call_at_once_and_leaves_nothing_waiting(local):
    start = time.monotonic()
    with pytest.raises(hg.UnsupportedValue):
        collectives.allreduce(["not", "an", "array"], name="bad", rank=0, size=3, timeout=10)
    assert time.monotonic() - start < 5  # not the 10 s the result's get would wait
    rt = hg.api.runtime()
    deadline = time.monotonic() + 5
    while rt.node._pulls and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not rt.node._pulls
    with pytest.raises(hg.InvalidArgument):  # checked before anything is sent
        collectives.allreduce(np.zeros(3), name="bad-op", rank=0, size=3, op="median")


def _gone(oid, seconds: float = 5.0) -> bool:
    """The directory forgets `oid` (a node's "dropped" notice is one-way)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            hg.object_info(oid)
        except hg.ObjectNotFound:
            return True
        time.sleep(0.02)
    return False


def test_a_lent_put_shares_the_callers_memory_until_reclaimed(local):
    rt = hg.api.runtime()
    value = np.arange(100_000, dtype=np.float32)
    oid = hg.ObjectID.from_name("lent")
    rt.call(rt.node.put(value, oid, lend=True), 10)
    obj = rt.node.store.get(oid)
    assert obj.complete and np.shares_memory(obj.buffer, value)
    assert hg.object_info(oid)["holders"][0]["complete"]
    rt.call(_reclaim(rt.node, oid), 10)
    assert rt.node.store.get(oid) is None and _gone(oid)
    assert float(value[-1]) == 99_999.0  # the caller's array is untouched
    copied = hg.ObjectID.from_name("copied")
    rt.call(rt.node.put(value, copied), 10)  # without lend: a copy, kept by reclaim
    assert not np.shares_memory(rt.node.store.get(copied).buffer, value)
    rt.call(_reclaim(rt.node, copied), 10)
    assert rt.node.store.get(copied) is not None


async def _reclaim(node, oid):
    await node.reclaim(oid)


@pytest.mark.parametrize("op", ["reduce", "allreduce"])
def test_a_reduce_reads_the_roots_input_in_place_and_lets_it_go_on_return(local, op):
    """No copy of the input: the reduce reads the caller's array, and the input
    leaves the cluster before the call returns (the rank returns only once the
    reduce is done), so the caller may change the array at once."""
    name = f"lend-{op}"
    for r in (1, 2):
        _put_rank(name, r, np.full(50_000, r, dtype=np.float64))
    mine = np.full(50_000, 10.0)
    out = getattr(collectives, op)(mine, name=name, rank=0, size=3, timeout=10)
    assert float(out[0]) == float(out[-1]) == 13.0
    mine[:] = -1.0
    assert float(out[0]) == 13.0
    rt = hg.api.runtime()
    assert rt.node.store.get(collectives.input_id(name, 0)) is None
    assert _gone(collectives.input_id(name, 0))
    collectives.delete(name, size=3)  # what is left; the lent input is already gone


def test_a_reduce_copies_a_non_roots_input(local):
    """A non-root rank returns once its input is put, before the reduce reads
    it: its input must be a copy that outlives the call."""
    mine = np.full(50_000, 2.0)
    assert collectives.reduce(mine, name="copy", rank=1, size=3, timeout=10) is None
    obj = hg.api.runtime().node.store.get(collectives.input_id("copy", 1))
    assert obj is not None and obj.complete and not np.shares_memory(obj.buffer, mine)
    collectives.delete("copy", size=3)


def test_a_waiting_non_root_returns_after_the_reduce_and_lends_its_input(local):
    """With wait=True a non-root returns only once the reduce is done (as
    MPI_Reduce), and its input was read in place: nothing is left of it."""
    import threading

    _put_rank("waits", 0, np.full(50_000, 1.0))
    mine = np.full(50_000, 2.0)
    done = threading.Event()
    out: list = []

    def non_root() -> None:
        out.append(collectives.reduce(mine, name="waits", rank=1, size=3, timeout=10, wait=True))
        done.set()

    t = threading.Thread(target=non_root)
    t.start()
    assert not done.wait(0.5), "returned before rank 2's input existed"
    _put_rank("waits", 2, np.full(50_000, 4.0))
    assert done.wait(10)
    t.join()
    assert out == [None]
    assert hg.api.runtime().node.store.get(collectives.input_id("waits", 1)) is None
    assert _gone(collectives.input_id("waits", 1))
    mine[:] = -100.0  # the caller owns its array again: the result does not change
    result = collectives.reduce(np.full(50_000, 1.0), name="waits-root", rank=0, size=1,
                                timeout=10)  # unrelated call: the node still works
    assert float(result[0]) == 1.0
    got = hg.get(collectives._reduce_ids("waits", 3, "sum", None)[1], timeout=10)
    assert float(got[0]) == float(got[-1]) == 7.0
    collectives.delete("waits", size=3)


def test_a_waiting_non_root_that_times_out_lets_its_input_go(local):
    with pytest.raises(hg.Timeout):
        collectives.reduce(np.ones(50_000), name="lonely-wait", rank=1, size=3, timeout=0.5,
                           wait=True)
    assert hg.api.runtime().node.store.get(collectives.input_id("lonely-wait", 1)) is None
    assert _gone(collectives.input_id("lonely-wait", 1))


def test_a_failed_allreduce_lets_its_input_go_too(local):
    with pytest.raises(hg.Timeout):
        collectives.allreduce(np.ones(50_000), name="lonely", rank=0, size=3, timeout=0.5)
    assert hg.api.runtime().node.store.get(collectives.input_id("lonely", 0)) is None
    assert _gone(collectives.input_id("lonely", 0))


def test_a_node_forgets_reduces_whose_result_it_has(local, monkeypatch):
    """A node re-asks a restarted directory for the reduces it asked for; one
    whose final result it holds, or that it deleted, is forgotten, and the
    list is bounded (a training loop's allreduce per step must not grow it)."""
    from hoplite_gpu.node import steps as steps_module

    rt = hg.api.runtime()
    for step in range(3):
        name = f"loop-{step}"
        _put_rank(name, 1, np.ones(20_000))
        collectives.allreduce(np.ones(20_000), name=name, rank=0, size=2, timeout=10)
    assert not rt.node._my_reduces
    assert collectives.reduce(np.ones(20_000), name="nonroot", rank=1, size=2, timeout=10) is None
    assert len(rt.node._my_reduces) == 1  # a non-root does not read the result
    collectives.delete("nonroot", size=2)
    assert not rt.node._my_reduces
    monkeypatch.setattr(steps_module, "MAX_REMEMBERED_REDUCES", 2)
    for step in range(4):
        collectives.reduce(np.ones(20_000), name=f"many-{step}", rank=1, size=2, timeout=10)
    assert len(rt.node._my_reduces) == 2


def test_a_sliced_allreduce_missing_a_rank_times_out_and_lets_its_slices_go():
    hg.init(timeout_s=20, chunk_size=4096, allreduce_slicing="auto")
    try:
        value = np.ones(30_000)  # three slices of 80 kB: lent, not put inline
        start = time.monotonic()
        with pytest.raises(hg.Timeout):
            collectives.allreduce(value, name="sliced-lonely", rank=0, size=3, timeout=0.5)
        assert time.monotonic() - start < 5
        inputs, _, _ = collectives._slice_ids("sliced-lonely", 3, "sum")
        for j in range(3):
            with pytest.raises(hg.ObjectNotFound):
                hg.object_info(inputs[j][0])
        store = hg.api.runtime().node.store
        assert not [oid for oid in collectives._slice_ids("sliced-lonely", 3, "sum")[1]
                    if oid in store]  # the results it was to receive are gone too
    finally:
        hg.shutdown()


def _made_by(name, size):
    """Which allreduce ran: "sliced" if slice results exist, "whole" if the
    whole-object reduce's result does."""
    made = set()
    if all(_exists(oid) for oid in collectives._slice_ids(name, size, "sum")[1]):
        made.add("sliced")
    if _exists(collectives._reduce_ids(name, size, "sum", None)[1]):
        made.add("whole")
    return made


def _exists(oid):
    try:
        hg.object_info(oid)
        return True
    except hg.ObjectNotFound:
        return False


def _hosts_unknown():
    """Make the ranks of this process, threads on one node, hosts of their own."""
    hg.api.runtime().node.host_key = ""


@pytest.mark.parametrize("one_host", [False, True], ids=["hosts", "one-host"])
def test_an_adaptive_allreduce_slices_inputs_ready_together_across_hosts(one_host):
    """Inputs ready together are sliced, unless every rank is on one host:
    there no byte crosses a link, and slicing costs CPU."""
    hg.init(timeout_s=20, chunk_size=4096, allreduce_slicing="adaptive",
            allreduce_slicing_window_s=5.0)
    try:
        if not one_host:
            _hosts_unknown()
        values = [np.arange(30_000.0) * (r + 1) for r in range(3)]
        got = allreduce_on_threads("adaptive-together", values)
        assert all(isinstance(g, np.ndarray) for g in got), got
        for g in got:
            np.testing.assert_array_equal(g, np.arange(30_000.0) * 6)
        assert _made_by("adaptive-together", 3) == {"whole" if one_host else "sliced"}
        votes = collectives._vote_ids("adaptive-together", 3, "sum")
        assert {bytes(hg.get(oid, timeout=5)) for oid in votes} == \
            {b"whole" if one_host else b"sliced"}
        assert hg.api.runtime().one_host_groups == {3: one_host}
        collectives.delete("adaptive-together", size=3)
        assert not any(_exists(oid) for oid in votes)
    finally:
        hg.shutdown()


def test_an_adaptive_allreduce_remembers_one_host_and_learns_otherwise():
    """After a call of this many ranks found one host, the next goes whole at
    once, without waiting for the others, and reads their markers afterwards:
    finding several hosts, the call after it is sliced."""
    hg.init(timeout_s=20, chunk_size=4096, allreduce_slicing="adaptive",
            allreduce_slicing_window_s=5.0)
    try:
        _hosts_unknown()
        rt = hg.api.runtime()
        rt.one_host_groups[3] = True  # as if an earlier call had found one host
        values = [np.arange(30_000.0) * (r + 1) for r in range(3)]
        for step, made in enumerate(["whole", "sliced"]):
            got = allreduce_on_threads(f"adaptive-learn-{step}", values)
            for g in got:
                np.testing.assert_array_equal(g, np.arange(30_000.0) * 6)
            assert _made_by(f"adaptive-learn-{step}", 3) == {made}
            assert rt.one_host_groups == {3: False}
    finally:
        hg.shutdown()


def test_an_adaptive_allreduce_of_a_sliced_and_an_unsliced_array_fails_at_once():
    """A rank whose array is too small to slice puts no marker (no extra put
    for small allreduces): the slicing rank gives up on slicing after its
    window, and the whole-object reduce fails for both."""
    hg.init(timeout_s=20, chunk_size=4096, allreduce_slicing="adaptive",
            allreduce_slicing_window_s=0.1)
    try:
        start = time.monotonic()
        got = allreduce_on_threads("adaptive-odd", [np.ones(30_000), np.ones(10)])
        assert time.monotonic() - start < 10
        assert all(isinstance(g, hg.HopliteError) and "same dtype and shape" in str(g)
                   for g in got), got
    finally:
        hg.shutdown()


@pytest.mark.parametrize("late", [0, 2], ids=["first-late", "last-late"])
def test_an_adaptive_allreduce_with_a_late_input_reduces_whole_objects(late):
    """A rank whose input comes after the others' windows: every rank,
    the late one too (it saw every marker, and votes to slice), reduces whole
    objects, and the result is the same."""
    hg.init(timeout_s=20, chunk_size=4096, allreduce_slicing="adaptive",
            allreduce_slicing_window_s=0.05)
    try:
        _hosts_unknown()
        values = [np.arange(30_000.0) * (r + 1) for r in range(3)]
        start = time.monotonic()
        got = allreduce_on_threads("adaptive-late", values, delays={late: 0.5})
        assert time.monotonic() - start < 10
        assert all(isinstance(g, np.ndarray) for g in got), got
        for g in got:
            np.testing.assert_array_equal(g, np.arange(30_000.0) * 6)
        assert _made_by("adaptive-late", 3) == {"whole"}
        votes = [bytes(hg.get(oid, timeout=5))
                 for oid in collectives._vote_ids("adaptive-late", 3, "sum")]
        assert votes[late] == b"sliced" and votes.count(b"whole") == 2, votes
        # a rank's slices were lent only for the call
        inputs = collectives._slice_ids("adaptive-late", 3, "sum")[0]
        assert not any(_exists(oid) for row in inputs for oid in row)
        collectives.delete("adaptive-late", size=3)
        assert _made_by("adaptive-late", 3) == set()
    finally:
        hg.shutdown()


def test_a_sliced_allreduce_of_different_shapes_fails_at_once():
    """Same element count, different shapes: whole objects would not match, and
    slices must not either."""
    hg.init(timeout_s=20, chunk_size=4096, allreduce_slicing="auto")
    try:
        start = time.monotonic()
        got = allreduce_on_threads("sliced-shapes", [np.ones((3, 10_000)), np.ones((10_000, 3))])
        assert time.monotonic() - start < 10
        assert all(isinstance(g, hg.InvalidArgument) and "same dtype and shape" in str(g)
                   for g in got), got
        ok = allreduce_on_threads("sliced-fortran", [np.ones((3, 10_000)),
                                              np.asfortranarray(np.ones((3, 10_000)))])
        assert all(isinstance(g, np.ndarray) and (g == 2).all() for g in ok), ok
    finally:
        hg.shutdown()


def test_a_collectives_delete_of_many_ranks_keeps_the_real_ids_remembered():
    """A delete of a call of 64 ranks names 4,354 ids, mostly slice inputs that
    never existed (or left with their call): the ids that did exist must stay
    in the directory's memory of removed ids, which stops a pull that crossed
    the delete from bringing the object back."""
    hg.init(timeout_s=20)
    try:
        hg.put(np.ones(10), collectives.input_id("many", 3))
        hg.put(np.ones(10), hg.ObjectID.from_name("many/bcast"))
        collectives.delete("many", size=64)
        gone = hg.api.runtime().directory.state.gone
        assert collectives.input_id("many", 3).binary in gone
        assert hg.ObjectID.from_name("many/bcast").binary in gone
        # and a second call's delete does not push the first's out either
        collectives.delete("many-2", size=64)
        assert hg.ObjectID.from_name("many/bcast").binary in gone
    finally:
        hg.shutdown()


def test_a_collectives_delete_is_one_message_per_4096_ids(monkeypatch):
    """A sliced allreduce of N ranks makes about N^2 objects; `delete` frees
    them in batches (here of 7), not one request each."""
    from hoplite_gpu import messages
    from hoplite_gpu.directory import server
    from hoplite_gpu.node import node as node_module

    hg.init(timeout_s=20, chunk_size=4096, allreduce_slicing="auto")
    try:
        values = [np.ones(30_000) * (r + 1) for r in range(3)]
        assert all((g == 6).all() for g in allreduce_on_threads("batched-delete", values))
        inputs, results, ready = collectives._slice_ids("batched-delete", 3, "sum")
        ops = []
        real = server.to_event
        monkeypatch.setattr(server, "to_event", lambda node, msg: (ops.append(messages.op(msg)),
                                                                   real(node, msg))[1])
        monkeypatch.setattr(node_module, "_DELETE_BATCH", 7)
        collectives.delete("batched-delete", size=3)
        # bcast, result, inputs, slices' inputs, results, markers, votes
        doomed = 2 + 3 + 9 + 3 + 3 + 3
        assert ops.count("delete_many") == -(-doomed // 7) and "delete" not in ops
        for oid in [*results, *ready, *(i for row in inputs for i in row)]:
            with pytest.raises(hg.ObjectNotFound):
                hg.object_info(oid)
    finally:
        hg.shutdown()


@pytest.mark.parametrize("op", ["gather", "allgather"])
def test_a_gathers_timeout_names_the_call_and_the_ranks_that_never_came(local, op):
    """A rank that never arrives made everyone's timeout name only hex object
    ids ("4 objects were not all available within 0.5s"): it names the call,
    this rank, the group's size and the ranks whose values never came."""
    _put_rank(f"late-{op}", 2, np.ones(3))
    with pytest.raises(hg.Timeout) as err:
        getattr(collectives, op)(np.ones(3), name=f"late-{op}", rank=0, size=4, timeout=0.5)
    assert str(err.value).startswith(f"{op} 'late-{op}' (rank 0 of 4) did not finish within "
                                     "its timeout of 0.5s (no value came from ranks 1, 3)")


def test_a_broadcasts_timeout_says_the_root_never_put(local):
    with pytest.raises(hg.Timeout, match=r"\(the root, rank 2, never put its value\)"):
        collectives.broadcast(None, name="no-root", rank=0, size=3, root=2, timeout=0.5)
