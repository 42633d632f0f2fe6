"""`hoplite_gpu.Group`: every collective against NumPy, agreement between the
ranks (a call they disagree on is refused on every rank), memory that stays
flat with no delete, and what each misuse is told. Ranks are threads of this
process (local mode) unless a test needs a node per rank."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import cluster_tasks as t
import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu.cluster import LocalCluster

OPS = ["sum", "prod", "min", "max", "avg"]
NUMPY = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max, "avg": np.mean}




def on_threads(ranks: list[Callable[[], Any]], timeout: float = 30.0) -> list[Any]:
    """Run each function on a thread of its own, all released at once: each
    one's result, the exception it raised, or "hung"."""
    got: dict[int, Any] = {}
    start = threading.Barrier(len(ranks))

    def run(i: int) -> None:
        start.wait(10)
        try:
            got[i] = ranks[i]()
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            got[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ranks))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    return [got.get(i, "hung") for i in range(len(ranks))]


def each_rank(name: str, size: int, body: Callable[[hg.Group, int], Any], *,
              timeout: float = 10.0, sizes: list[int] | None = None,
              close: bool = True) -> list[Any]:
    """`body(group, rank)` on every rank of a Group `name` (rank r's Group of
    `sizes[r]`, default `size`), closed afterwards (with `close`) if the body
    succeeded."""
    def rank(r: int) -> Any:
        group = hg.Group(name, rank=r, size=(sizes or [size] * size)[r], timeout=timeout)
        out = body(group, r)
        if close:
            group.close()
        return out
    return on_threads([lambda r=r: rank(r) for r in range(len(sizes or [size] * size))])


def inputs(size: int, shape: tuple, dtype: str = "float64") -> list[np.ndarray]:
    rng = np.random.default_rng(len(shape))
    return [(rng.random(shape) * 3 + 0.5).astype(dtype) for _ in range(size)]


@pytest.mark.parametrize("op", OPS)
def test_reductions_match_numpy_for_every_op(local, op):
    size = 3
    x = inputs(size, (1000,))
    expected = NUMPY[op](np.stack(x), axis=0)

    def body(g: hg.Group, r: int) -> tuple:
        return g.allreduce(x[r], op=op), g.reduce(x[r], root=1, op=op), g.reduce_scatter(x[r], op)

    for r, (whole, rooted, block) in enumerate(each_rank(f"ops-{op}", size, body)):
        np.testing.assert_allclose(whole, expected, rtol=1e-12)
        assert (rooted is None) == (r != 1)
        if r == 1:
            np.testing.assert_allclose(rooted, expected, rtol=1e-12)
        np.testing.assert_allclose(block, np.array_split(expected, size, axis=0)[r], rtol=1e-12)


@pytest.mark.parametrize("shape", [(10,), (7, 3), (3, 2), (1,)],
                         ids=["10-rows", "7x3", "3-rows", "1-row"])
def test_reduce_scatter_splits_as_array_split_when_the_rows_do_not_divide(local, shape):
    """4 ranks: 10 and 7 rows do not divide by 4, and 3 rows or 1 leave ranks
    an empty block of the right shape and dtype."""
    size = 4
    x = inputs(size, shape, "int32")
    expected = np.stack(x).sum(axis=0, dtype=np.int32)
    blocks = each_rank(f"scatter-{shape}", size, lambda g, r: g.reduce_scatter(x[r]))
    for r, block in enumerate(blocks):
        want = np.array_split(expected, size, axis=0)[r]
        assert block.dtype == want.dtype and block.shape == want.shape
        assert np.array_equal(block, want)


def test_broadcast_gather_allgather_and_barrier(local):
    size = 4

    def body(g: hg.Group, r: int) -> tuple:
        sent = g.broadcast(np.arange(6) * 7 if r == 2 else None, root=2)
        gathered = g.gather(np.full(r + 1, r), root=1)
        everyone = g.allgather(f"rank {r}".encode())
        g.barrier()
        return sent, gathered, everyone, g.calls

    for r, (sent, gathered, everyone, calls) in enumerate(each_rank("misc", size, body)):
        assert np.array_equal(sent, np.arange(6) * 7)
        if r == 1:
            assert [list(a) for a in gathered] == [[q] * (q + 1) for q in range(size)]
        else:
            assert gathered is None
        assert everyone == [f"rank {q}".encode() for q in range(size)]
        assert calls == 4


def test_asyncio_twins_and_async_with(local):
    size = 3
    x = inputs(size, (50,))

    async def rank(r: int) -> tuple:
        async with hg.Group("async", rank=r, size=size, timeout=10) as g:
            total = await g.allreduce_async(x[r])
            block = await g.reduce_scatter_async(x[r], "max")
            rooted = await g.reduce_async(x[r], root=0, op="min")
            sent = await g.broadcast_async(b"w" if r == 0 else None)
            gathered = await g.allgather_async(np.array([r]))
            await g.barrier_async()
            return total, block, rooted, sent, gathered

    async def main() -> list:
        return await asyncio.wait_for(asyncio.gather(*[rank(r) for r in range(size)]), 30)

    for r, (total, block, rooted, sent, gathered) in enumerate(asyncio.run(main())):
        np.testing.assert_allclose(total, np.sum(x, axis=0))
        np.testing.assert_allclose(block, np.array_split(np.max(x, axis=0), size)[r])
        if r == 0:
            np.testing.assert_allclose(rooted, np.min(x, axis=0))
        assert sent == b"w" and [int(a[0]) for a in gathered] == [0, 1, 2]


def test_each_calls_objects_are_freed_by_a_later_call_and_close_frees_the_rest(local):
    """No delete in user code: the directory holds the objects of the last
    call or two, however many calls there were, and none after `close`."""
    size, calls = 3, 20
    counts: list[int] = []
    step = threading.Barrier(size)

    def body(g: hg.Group, r: int) -> bool:
        right = True
        for i in range(calls):
            right &= float(g.allreduce(np.full(20_000, i + r, dtype=np.float64))[0]) \
                == size * i + 3
            if r == 0:
                counts.append(len(local.directory.state.objects))
            step.wait(10)  # (counted between calls)
        return right

    assert each_rank("flat", size, body) == [True] * size
    assert max(counts[5:]) <= max(counts[:5]) and max(counts) < 4 * size + 8, counts
    assert len(local.directory.state.objects) == 0
    assert hg.node_stats()["held_bytes"] == 0


# (4 processes, 50 x 16 MiB on two cores: about 10 s; in the default set: the
# flat memory of a training loop is what the Group promises)
def test_a_loop_of_allreduces_keeps_every_nodes_memory_flat_without_deletes():
    size, calls, nbytes = 4, 50, 16 << 20
    with LocalCluster(size) as c:
        out = c.map(t.group_allreduce_loop, [("loop", r, size, calls, nbytes)
                                             for r in range(size)], timeout=300)
    for node in out:
        assert node["right"]
        assert node["held"] < 4 * nbytes, f"{node['held']} bytes held after {calls} calls"
        assert node["after_close"] == 0


# ------------------------------------------------------------------ misuse ---
def _all_raise(results: list, kind: type, *texts: str) -> None:
    for r, got in enumerate(results):
        assert isinstance(got, kind), f"rank {r}: {got!r}"
        for text in texts:
            assert text in str(got), f"rank {r}: {got}"


def test_ranks_passing_different_ops_are_refused_on_every_rank(local):
    """Two ranks passing op="sum" and op="max" each returned OK, with
    different results."""
    got = each_rank("ops", 2, lambda g, r: g.allreduce(np.ones(4), op=["sum", "max"][r]))
    _all_raise(got, hg.GroupMismatch, "call 0", "op: 'sum' on rank 0; 'max' on rank 1")


def test_ranks_passing_different_sizes_are_refused_on_every_rank(local):
    """A rank passing size=3 against another's size=2 let one return at once
    and the other wait out its whole timeout with no hint."""
    got = each_rank("sizes", 2, lambda g, r: g.allreduce(np.ones(4)), sizes=[2, 3], timeout=20)
    _all_raise(got, hg.GroupMismatch, "the group's size: 2 on rank 0; 3 on rank 1")


def test_ranks_passing_arrays_of_other_shapes_or_dtypes_are_refused(local):
    def body(g: hg.Group, r: int) -> Any:
        g.allreduce(np.ones(3))  # call 0 agrees
        return g.reduce_scatter(np.ones(4 + r, dtype=["float32", "float64"][r]))

    _all_raise(each_rank("shapes", 2, body), hg.GroupMismatch, "call 1",
               "dtype: 'float32' on rank 0; 'float64' on rank 1",
               "shape: (4,) on rank 0; (5,) on rank 1")


def test_a_rank_calling_out_of_order_is_refused_naming_the_calls(local):
    def body(g: hg.Group, r: int) -> Any:
        if r == 0:
            return g.allreduce(np.ones(2)), g.broadcast(b"x")
        return g.broadcast(b"x"), g.allreduce(np.ones(2))

    _all_raise(each_rank("order", 2, body), hg.GroupMismatch,
               "call 0", "the call: allreduce on rank 0; broadcast on rank 1")


def test_a_missing_rank_makes_every_other_ranks_timeout_name_it(local):
    """A rank that never arrives made everyone time out naming only hex object
    ids: the timeout names the group, the call and the missing ranks."""
    def body(g: hg.Group, r: int) -> Any:
        g.allreduce(np.ones(2))
        if r == 2:
            return "left"
        return g.allreduce(np.ones(2))

    got = each_rank("missing", 3, body, timeout=1, close=False)
    assert got[2] == "left"
    _all_raise(got[:2], hg.Timeout, "Group 'missing' call 1 (allreduce)",
               "rank 2 of 3 did not come within 1s", "ranks 0, 1 came")


def test_two_groups_under_one_name_at_once_are_refused_never_mixed(local):
    """Two groups of 2 ranks calling allreduce under one name at once returned
    a sum mixing both groups (13.0 where 3 and 23 were right) on two ranks.
    Now no rank returns a sum: each is refused, naming the clash."""
    values = [1.0, 2.0, 10.0, 13.0]  # group A: ranks 0, 1; group B: ranks 0, 1

    def rank(i: int) -> Any:
        return float(hg.Group("shared", rank=i % 2, size=2, timeout=3)
                     .allreduce(np.full(4, values[i]))[0])

    got = on_threads([lambda i=i: rank(i) for i in range(4)])
    for i, outcome in enumerate(got):
        assert isinstance(outcome, (hg.GroupConflict, hg.Timeout)), f"thread {i}: {outcome!r}"
    assert sum(isinstance(o, hg.GroupConflict) for o in got) >= 2, got


def test_a_name_serves_one_live_group_at_a_time(local):
    """A group's claims hold its name until it is closed: a second group under
    the name is refused while the first lives (the first goes on unharmed),
    and forms once the first has closed."""
    first = [hg.Group("reused", rank=r, size=2, timeout=10) for r in range(2)]
    assert on_threads([lambda r=r: float(first[r].allreduce(np.full(2, 1.0 + r))[0])
                       for r in range(2)]) == [3.0, 3.0]
    second = each_rank("reused", 2, lambda g, r: g.allreduce(np.full(2, 10.0 + r)))
    _all_raise(second, hg.GroupConflict, "is claimed by another Group")
    assert on_threads([lambda r=r: float(first[r].allreduce(np.full(2, 5.0 + r))[0])
                       for r in range(2)]) == [11.0, 11.0]
    on_threads([g.close for g in first])
    third = each_rank("reused", 2, lambda g, r: float(g.allreduce(np.full(2, 10.0 + r))[0]))
    assert third == [21.0, 21.0]


def test_a_broken_group_says_why_and_closes_at_once(local):
    group = hg.Group("broken", rank=0, size=2, timeout=0.3)
    with pytest.raises(hg.Timeout, match="rank 1 of 2 did not come"):
        group.barrier()
    with pytest.raises(hg.GroupBroken, match="call 0 failed"):
        group.allreduce(np.ones(2))
    group.close()  # (on this rank alone: nothing waits for rank 1)
    with pytest.raises(hg.GroupBroken, match="closed"):
        group.barrier()
    # the claim was taken back: the name can form a group again
    assert each_rank("broken", 2, lambda g, r: float(g.allreduce(np.ones(1))[0])) == [2.0, 2.0]


def test_bad_arguments_are_refused_before_the_call_and_leave_the_group_usable(local):
    for bad in (dict(name="", rank=0, size=1), dict(name="g", rank=1, size=1),
                dict(name="g", rank=0, size=0), dict(name="g", rank=True, size=2),
                dict(name="g", rank=0, size=1, timeout=-1)):
        with pytest.raises(hg.InvalidArgument):
            hg.Group(bad.pop("name"), **bad)
    with hg.Group("args", rank=0, size=1, timeout=5) as group:
        with pytest.raises(hg.InvalidArgument, match="root must be an int in"):
            group.broadcast(1, root=1)
        with pytest.raises(hg.InvalidArgument, match="unknown reduce op"):
            group.allreduce(np.ones(2), op="mean")
        with pytest.raises(hg.InvalidArgument, match="at least one dimension"):
            group.reduce_scatter(np.float64(3))
        assert group.calls == 0
        assert float(group.allreduce(np.ones(2))[0]) == 1.0


def test_one_group_makes_one_call_at_a_time(local):
    group = hg.Group("busy", rank=0, size=2, timeout=1)
    outcome: list = []
    waiting = threading.Thread(target=lambda: outcome.append(on_threads([group.barrier])[0]))
    waiting.start()
    try:
        deadline = time.monotonic() + 5
        while not group._busy.locked() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(hg.InvalidArgument, match="one call at a time"):
            group.allreduce(np.ones(2))
    finally:
        waiting.join(15)
    assert isinstance(outcome[0], hg.Timeout)  # (the barrier itself: rank 1 never came)


def test_group_is_exported_lazily():
    code = ("import sys, hoplite_gpu as hg; assert 'hoplite_gpu.group' not in sys.modules; "
            "print(hg.Group.__module__, 'Group' in dir(hg), 'Group' in hg.__all__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["hoplite_gpu.group", "True", "True"], r.stderr
