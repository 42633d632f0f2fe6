"""The directory under many nodes, many objects and long churn.

Each test failed on the code it was written against: state left behind by a
finished inline reduce (and a later reduce of the same id taking it for an
input), a node declared dead while alive keeping a copy the directory no
longer knows (read stale after a delete and a re-put), one event's cost
growing with every object or reduce the directory keeps, and a chain of
inline reduces recursing once per link in the server.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
from in_process import miss_the_lease, two_nodes_short_lease

from benchmarks import directory_scale
from hoplite_gpu.directory import state as s
from hoplite_gpu.directory.server import DirectoryServer
from hoplite_gpu.ids import ObjectID

SCALAR = {"kind": "numpy", "dtype": "<f4", "shape": [1], "nbytes": 4}
ONE = b"\x00\x00\x80?"  # float32 1.0
TWO = b"\x00\x00\x00@"  # float32 2.0
SMALL = {"kind": "bytes", "nbytes": 4}


oid, joined = directory_scale.oid, directory_scale.joined  # (as the benchmark builds them)


def handle(d: s.Directory, event: s.Event) -> list[s.Command]:
    """`d.handle`, carrying out inline reduces as the server does."""
    out = d.handle(event)
    for cmd in list(out):
        if isinstance(cmd, s.InlineReduce):
            acc = np.zeros(1, np.float32)
            for data in cmd.inputs:
                acc += np.frombuffer(data, np.float32)
            out += handle(d, s.InlineReduced(cmd.target, acc.tobytes()))
    return out


def inline_reduce(d: s.Directory, a: bytes, b: bytes, target: bytes) -> None:
    handle(d, s.Put("n0", 1, a, 4, SCALAR, ONE))
    handle(d, s.Put("n1", 2, b, 4, SCALAR, ONE))
    handle(d, s.ReduceRequested("n0", 3, target, (a, b), "sum", 2))
    assert d.objects[target].inline == TWO


# ------------------------------------------------------------ churn -------
def test_inline_reduce_churn_leaves_no_watched_inputs():
    """A long job of small collectives: reduce, read, delete everything, again.
    Tree reduces stop watching their inputs when they finish; a finished
    inline reduce never does, not even once its target is deleted, so
    `watching` grows by one entry per input per step, for ever."""
    d = joined(3)
    for step in range(50):
        a, b, target = oid(3 * step + 1), oid(3 * step + 2), oid(3 * step + 3)
        inline_reduce(d, a, b, target)
        handle(d, s.Locate("n2", 4, target))
        for key in (a, b, target):
            handle(d, s.Delete("n0", 5, key))
    assert not d.objects and not d.reduces and not d.pending
    assert not d.watching, f"{len(d.watching)} ids still watched after every object was deleted"


def test_a_reused_reduce_target_takes_no_input_of_an_earlier_reduce():
    """Same leak, wrong result: target T was reduced inline from a and b, and
    all three deleted. A new reduce into T of c and e then took a re-put `a`
    (an unrelated object by now) as an input: T = a + c, and its inputs named
    an object that is not among the ones asked for."""
    d = joined(3)
    a, b, c, e, target = oid(1), oid(2), oid(3), oid(4), oid(9)
    inline_reduce(d, a, b, target)
    for key in (a, b, target):
        handle(d, s.Delete("n0", 5, key))
    handle(d, s.ReduceRequested("n0", 6, target, (c, e), "sum", 2))
    handle(d, s.Put("n2", 7, a, 4, SCALAR, TWO))  # the id a, put again for something else
    handle(d, s.Put("n1", 8, c, 4, SCALAR, ONE))
    handle(d, s.Put("n1", 9, e, 4, SCALAR, ONE))
    assert set(d.reduces[target].chosen) <= {c, e}, "the reduce took an input it was not asked for"
    assert d.objects[target].inline == TWO


# -------------------------------------------------------------- cost -------
def _best(measure, reps: int = 3) -> float:
    return min(measure() for _ in range(reps))


def test_a_cancelled_locate_costs_the_same_with_many_objects():
    """Every get that gives up sends `cancel`. The state machine looked for
    the withdrawn locate in the waiting queue of every object, every pending
    id and every reduce: one cancel cost O(objects) (about 8 ms with 10,000
    objects), so a burst of timed-out gets stalled the whole directory."""
    def per_cancel(objects: int, cancels: int) -> float:
        d = joined(2)
        for i in range(objects):
            d.handle(s.Put("n0", 1, oid(i + 1), 4, SMALL, b"abcd"))
        missing = b"\xee" * 20

        def measure() -> float:
            start = time.perf_counter()
            for rid in range(100, 100 + cancels):
                d.handle(s.Locate("n1", rid, missing))
                d.handle(s.CancelLocate("n1", rid))
            return (time.perf_counter() - start) / cancels
        return _best(measure)

    few = per_cancel(100, 400)
    many = per_cancel(10_000, 40)
    assert many < 10 * few, (f"a cancel costs {many * 1e6:.0f} us with 10,000 objects and "
                             f"{few * 1e6:.0f} us with 100")


def test_deleting_a_widely_read_object_costs_the_same_with_many_finished_reduces():
    """`Delete` (and `Dropped`) asked, for each holder of the object, every
    reduce the directory keeps whether it took the object from that node
    (`_slot_lost`): O(holders x reduces), though only unfinished reduces that
    watch the object can be concerned. An inline object read by 64 nodes
    cost ~10 ms to delete with 4,000 finished reduces kept."""
    def per_delete(reduces: int) -> float:
        d = joined(64)
        for r in range(reduces):
            inline_reduce(d, oid(2 * r + 1), oid(2 * r + 2), oid(10**9 + r))
        rep = iter(range(10**6))

        def measure() -> float:
            key = oid(10**12 + next(rep))
            d.handle(s.Put("n0", 1, key, 4, SMALL, b"abcd"))
            for i in range(64):
                d.handle(s.Locate(f"n{i}", 2, key))
            assert len(d.objects[key].holders) == 64
            start = time.perf_counter()
            d.handle(s.Delete("n0", 3, key))
            return time.perf_counter() - start
        return _best(measure, 5)

    few = per_delete(20)
    many = per_delete(4000)
    assert many < 10 * few, (f"a delete costs {many * 1e6:.0f} us with 4,000 finished reduces "
                             f"and {few * 1e6:.0f} us with 20")


# ------------------------------------------------------- many reduces -----
def test_a_long_chain_of_inline_reduces_finishes_when_its_first_input_arrives():
    """Reduces asked ahead of their data, each taking the previous one's result
    (a running sum): when the first input arrives they all complete in one
    cascade. `DirectoryServer.apply` carried out each inline reduce by
    calling itself, one stack frame per link: past ~980 links the reduce
    failed with "RecursionError: maximum recursion depth exceeded" and every
    later one waited for ever (neither done nor failed)."""
    links = 1500

    async def main() -> None:
        server = DirectoryServer("tok")
        server.apply(s.NodeJoined("n0", "tcp://127.0.0.1:1", 0.0))
        head = prev = oid(1)
        targets = []
        for i in range(links):
            x, target = oid(10**6 + i), oid(2 * 10**6 + i)
            server.apply(s.Put("n0", 1, x, 4, SCALAR, ONE))
            server.apply(s.ReduceRequested("n0", 2, target, (prev, x), "sum", 2))
            targets.append(target)
            prev = target
        server.apply(s.Put("n0", 3, head, 4, SCALAR, ONE))
        assert server.state.failed == {}, next(iter(server.state.failed.values()))
        last = server.state.objects.get(targets[-1])
        assert last is not None, "the end of the chain never completed"
        assert np.frombuffer(last.inline, np.float32)[0] == links + 1

    asyncio.run(main())


# ---------------------------------------------- a node wrongly declared dead ---
def test_a_node_declared_dead_while_alive_keeps_no_stale_copy():
    """A node that misses its lease while alive (stopped for a moment, a long
    GIL hold) is declared dead: its objects are lost and remembered as
    removed (`gone`). It reconnects under the same id and re-announces what
    it holds, but the announcement of each large object is ignored, and
    nobody tells it to drop the copy. So the copy outlives a `delete`: after
    another node deletes the id and puts a new value under it, the node
    that was declared dead still reads its old value."""
    async def main() -> None:
        async with two_nodes_short_lease() as (server, a, b):
            x = ObjectID.from_name("scale-edges/declared-dead")
            old = np.arange(40_000, dtype=np.float64)  # 320 KB: not inline
            await a.put(old, x)
            await miss_the_lease(server, a)  # declared dead, then back
            await b.delete(x)
            await b.put(old + 1, x)
            got = await a.get(x, 3.0, "numpy")
            assert np.array_equal(got, old + 1), "a read the value deleted before the re-put"

    asyncio.run(asyncio.wait_for(main(), 30))
