"""Reduce and allreduce over packed spanning trees
(`hoplite_gpu.multitree_reduce`): results against NumPy's between in-process
nodes over TCP (several dtypes and ops, sizes the trees do not split evenly,
the 4-member mesh and the DGX-1V fixture's 8 GPUs), a rank lost mid-way,
and a `Group` on a topology in a LocalCluster."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from in_process import eventually, run_nodes

import hoplite_gpu as hg
from hoplite_gpu import multitree_reduce as mr
from hoplite_gpu.errors import InvalidArgument, ReduceFailed
from hoplite_gpu.kernels import numpy_ops
from hoplite_gpu.topology import fixture, from_json

#: Four members, every pair linked, links of two speeds (tests/test_multitree.py).
MESH = from_json({"nodes": [0, 1, 2, 3], "links": [
    {"a": 0, "b": 1, "capacity": 1}, {"a": 0, "b": 2, "capacity": 1},
    {"a": 0, "b": 3, "capacity": 1}, {"a": 1, "b": 2, "capacity": 2},
    {"a": 2, "b": 3, "capacity": 2}, {"a": 1, "b": 3, "capacity": 2}]}, source="mesh")
CONFIG = hg.Config(shared_memory=False, chunk_size=1 << 20, timeout_s=20, stall_timeout_s=2.0)


def _inputs(size: int, n: int, dtype: str, seed: int = 0) -> list[np.ndarray]:
    """Small whole numbers, so that float sums are exact in any order."""
    rng = np.random.default_rng(seed)
    low, high = (0, 3) if dtype in ("uint8", "int8") else (-8, 9)
    return [rng.integers(low, high, n).astype(dtype) for _ in range(size)]


def _oracle(inputs: list[np.ndarray], op: str) -> np.ndarray:
    """The reduction as the dynamic reduce's kernels define it (NumPy twins)."""
    acc = inputs[0].copy()
    for x in inputs[1:]:
        numpy_ops.reduce_into(acc, x, op)
    numpy_ops.finalize(acc, op, len(inputs))
    return acc


def _calls(nodes, topology, inputs, name, *, everyone, root=0, op="sum", timeout=20.0):
    chosen = tuple(topology.nodes[:len(nodes)])
    plan = mr.plan_for("allreduce" if everyone else "reduce", topology, chosen[root], chosen)
    return [mr.tree_reduce(node, inputs[r], name, r, root, chosen, plan, op, timeout,
                           everyone=everyone, array_type="numpy")
            for r, node in enumerate(nodes)]


def _parts_left(nodes, name: str) -> list:
    """Partial results of call `name` still in some store (each rank frees its own)."""
    ids = mr._Ids(name)
    parts = {ids.part(t, r) for t in range(16) for r in range(len(nodes))}
    return [obj.oid for n in nodes for obj in n.store.objects() if obj.oid in parts]


@pytest.mark.parametrize("everyone", [False, True], ids=["reduce", "allreduce"])
def test_dtypes_and_ops_on_the_mesh_match_numpy(everyone):
    """Sizes that no tree split divides evenly, every root, five dtypes and ops."""
    cases = [("float32", "sum", 1_000_003, 0), ("int32", "max", 262_147, 1),
             ("float64", "avg", 131_075, 2), ("int8", "sum", 333_335, 3),
             ("float16", "min", 7, 0), ("uint8", "prod", 3, 1)]

    async def body(directory, *nodes):
        for i, (dtype, op, n, root) in enumerate(cases):
            inputs = _inputs(4, n, dtype, seed=i)
            got = await asyncio.gather(*_calls(nodes, MESH, inputs, f"mesh-{everyone}-{i}",
                                               everyone=everyone, root=root, op=op))
            want = _oracle(inputs, op)
            for r, out in enumerate(got):
                if everyone or r == root:
                    assert out.dtype == want.dtype and out.shape == want.shape
                    np.testing.assert_array_equal(out, want, err_msg=f"{dtype} {op} rank {r}")
                else:
                    assert out is None
        # each rank freed its partial results; only the call's cards, the
        # outcome and (an allreduce's) result copies stay for `call_ids`
        assert not any(_parts_left(nodes, f"mesh-{everyone}-{i}") for i in range(len(cases)))
        kept = {oid for n in nodes for oid in (obj.oid for obj in n.store.objects())}
        named = {oid for i in range(len(cases))
                 for oid in mr.call_ids(f"mesh-{everyone}-{i}", 4)}
        assert kept <= named

    run_nodes([CONFIG] * 4, body, bound=60)


def test_the_dgx1v_fixtures_eight_gpus_reduce_and_allreduce():
    topology = fixture("dgx1v")
    inputs = _inputs(8, 1_500_001, "float32", seed=7)
    want = _oracle(inputs, "sum")

    async def body(directory, *nodes):
        served = {n.node_id: 0 for n in nodes}
        for n in nodes:
            real = n.server._stream_range

            async def counted(stream, obj, pos, end, stall, size, real=real, who=n.node_id):
                served[who] += end - pos
                return await real(stream, obj, pos, end, stall, size)

            n.server._stream_range = counted
        got = await asyncio.gather(*_calls(nodes, topology, inputs, "dgx-all", everyone=True))
        for r, out in enumerate(got):
            np.testing.assert_array_equal(out, want, err_msg=f"rank {r}")
        # every rank sent bytes: partial results up and ranges of the result down
        assert all(served.values()), served
        got = await asyncio.gather(*_calls(nodes, topology, inputs, "dgx-red", everyone=False,
                                           root=5))
        np.testing.assert_array_equal(got[5], want)
        assert not _parts_left(nodes, "dgx-all") and not _parts_left(nodes, "dgx-red")

    run_nodes([CONFIG] * 8, body, bound=90)


def _cut_streams(node, keep: float) -> None:
    """`node`'s data server sends `keep` of each range it is asked for, then
    cuts the stream (its process dying mid-send)."""
    real = node.server._stream_range

    async def dies(stream, obj, pos, end, stall, size):
        await real(stream, obj, pos, pos + int((end - pos) * keep), stall, size)
        await stream.close()
        return False

    node.server._stream_range = dies


@pytest.mark.parametrize("everyone", [False, True], ids=["reduce", "allreduce"])
def test_a_rank_lost_midway_fails_every_rank_naming_it(everyone):
    """Rank 2's streams break half-way (its partial results, and in an
    allreduce its ranges of the result): every rank's call fails soon (well
    before its deadline) with a ReduceFailed that names rank 2, and no
    partial result is left behind."""
    inputs = _inputs(4, 1_000_000, "float32")
    victim = 2

    async def body(directory, *nodes):
        _cut_streams(nodes[victim], 0.5)
        began = time.monotonic()
        got = await asyncio.gather(*_calls(nodes, MESH, inputs, f"lost-{everyone}",
                                           everyone=everyone, timeout=15.0),
                                   return_exceptions=True)
        took = time.monotonic() - began
        for r, out in enumerate(got):
            assert isinstance(out, ReduceFailed), (r, out)
            assert f"rank {victim} was lost" in str(out), (r, out)
        assert took < 8.0, took
        # failed parts stay a stall timeout (a late parent reads why), then go
        assert await eventually(lambda: not _parts_left(nodes, f"lost-{everyone}"),
                                CONFIG.stall_timeout_s + 3)

    run_nodes([CONFIG] * 4, body, bound=60)


def test_a_root_lost_before_it_says_how_the_reduce_ended_is_named_soon(monkeypatch):
    """Regression: the root of a reduce died after its folds, before putting
    its word on how the reduce ended, and every other rank, its parts pulled
    in full, waited for that word until its deadline (15 s here) and then
    raised a Timeout. Now they find the root gone (it stops serving) within
    about a stall timeout (2 s) and raise ReduceFailed naming rank 0."""
    inputs = _inputs(4, 400_000, "float32")
    real = mr._TreeReduce._say

    async def dies(self, outcome):
        if self.rank != self.root:
            return await real(self, outcome)
        _cut_streams(self.node, 0.0)  # its process gone: nothing it served comes any more
        raise RuntimeError("the root's process died")

    monkeypatch.setattr(mr._TreeReduce, "_say", dies)

    async def body(directory, *nodes):
        began = time.monotonic()
        got = await asyncio.gather(*_calls(nodes, MESH, inputs, "root-lost", everyone=False,
                                           timeout=15.0), return_exceptions=True)
        took = time.monotonic() - began
        assert isinstance(got[0], RuntimeError), got[0]
        for r, out in enumerate(got[1:], 1):
            assert isinstance(out, ReduceFailed) and "rank 0 was lost" in str(out), (r, out)
        assert took < 8.0, took

    run_nodes([CONFIG] * 4, body, bound=60)


@pytest.mark.gpu
@pytest.mark.parametrize("everyone", [False, True], ids=["reduce", "allreduce"])
def test_device_arrays_fold_on_the_device(everyone):
    """CuPy inputs over TCP (pinned staging): partial results live in device
    memory and fold with the CuPy kernels; the result is a CuPy array."""
    cp = pytest.importorskip("cupy")
    host = _inputs(4, 1_000_003, "float32", seed=3)
    want = _oracle(host, "sum")

    async def body(directory, *nodes):
        inputs = [cp.asarray(x) for x in host]
        chosen = tuple(MESH.nodes)
        plan = mr.plan_for("allreduce" if everyone else "reduce", MESH, 1, chosen)
        got = await asyncio.gather(*[
            mr.tree_reduce(node, inputs[r], f"gpu-{everyone}", r, 1, chosen, plan, "sum", 20.0,
                           everyone=everyone, array_type="cupy")
            for r, node in enumerate(nodes)])
        for r, out in enumerate(got):
            if everyone or r == 1:
                assert isinstance(out, cp.ndarray), type(out)
                np.testing.assert_array_equal(cp.asnumpy(out), want, err_msg=f"rank {r}")

    run_nodes([CONFIG] * 4, body, bound=60)


def test_a_stalled_rank_is_named_after_the_stall_timeout():
    """A rank whose node stops sending (alive, no keepalive) on the DGX-1V
    allreduce: its parents' stall timeouts name it, every rank fails with
    it, within a few stall timeouts."""
    async def silent(stream, obj, pos, end, stall, size):
        await asyncio.sleep(30)

    _every_rank_fails_naming(6, silent, "stall", size=8,
                             config=CONFIG.replace(stall_timeout_s=1.0))


def test_arrays_that_differ_are_refused_naming_the_rank():
    inputs = _inputs(4, 100_000, "float32")
    inputs[3] = inputs[3].astype("float64")

    async def body(directory, *nodes):
        got = await asyncio.gather(*_calls(nodes, MESH, inputs, "differ", everyone=True,
                                           timeout=10.0), return_exceptions=True)
        assert isinstance(got[3], InvalidArgument) and "rank 3 failed" in str(got[3])
        for r in (0, 1, 2):
            assert isinstance(got[r], ReduceFailed) and "rank 3 failed" in str(got[r]), got[r]

    run_nodes([CONFIG] * 4, body, bound=30)


def test_a_rank_that_never_comes_is_named_in_the_timeouts():
    """Rank 3 never calls: the ranks waiting on its partial result name it
    (no card came from it), the others the root that never said it was done,
    all at their deadline."""
    inputs = _inputs(4, 100_000, "float32")

    async def body(directory, *nodes):
        calls = _calls(nodes, MESH, inputs, "absent", everyone=False, timeout=1.5)
        calls.pop().close()  # (never awaited: rank 3 does not come)
        began = time.monotonic()
        got = await asyncio.gather(*calls, return_exceptions=True)
        assert time.monotonic() - began < 3.5
        assert all(isinstance(out, hg.Timeout) for out in got), got
        assert "no card came from rank 3" in str(got[0]), got[0]
        for out in got[1:]:
            assert "no card came from rank 3" in str(out) \
                or "the root, rank 0, never said the reduce was done" in str(out), out

    run_nodes([CONFIG] * 4, body, bound=30)


def test_an_error_relayed_up_the_trees_names_the_rank_it_started_at():
    """A parent's pull fails with the text of its child's error frame: the
    rank named there, not the child, is the one lost."""
    call = mr._TreeReduce.__new__(mr._TreeReduce)
    call.what = "multitree reduce 'x'"
    relayed = hg.PeerLost("tcp://h:1 could not serve: ReduceFailed: multitree reduce 'x': "
                          "rank 3 was lost: its partial result of tree 0 stopped coming (...)")
    assert str(call._lost(1, 2, relayed)).startswith("multitree reduce 'x': rank 3 was lost")
    own = hg.PeerLost("tcp://h:1 closed the connection")
    assert "rank 1 was lost: its partial result of tree 2" in str(call._lost(1, 2, own))


def test_calls_are_checked_before_anything_is_sent():
    with pytest.raises(InvalidArgument, match="size must be an int >= 2"):
        mr.multitree_reduce(np.zeros(4), name="x", rank=0, size=1, topology=MESH)
    with pytest.raises(InvalidArgument, match="multitree_allreduce: members must be distinct"):
        mr.multitree_allreduce(np.zeros(4), name="x", rank=0, size=2, topology=MESH,
                               members=[1, 1])
    with pytest.raises(InvalidArgument, match="unknown reduce op"):
        mr.multitree_allreduce(np.zeros(4), name="x", rank=0, size=2, topology=MESH, op="xor")


@pytest.mark.slow
def test_a_group_on_a_topology_reduces_over_its_trees_and_frees_each_call():
    """Four processes (their start is most of the test's 6 s on 2 cores): a
    standalone allreduce, then a Group's large allreduces and reduces over
    the trees, a small one on the dynamic path, and memory freed call by call."""
    import cluster_tasks as t

    from hoplite_gpu.cluster import LocalCluster

    size, calls, n = 4, 3, 1 << 20
    with LocalCluster(size, shared_memory=False) as c:
        out = c.map(t.group_tree_reduces, [("mt-reduce", r, size, calls, n)
                                           for r in range(size)], timeout=120)
    for rank, node in enumerate(out):
        assert node["right"], (rank, node)
        assert node["ways"] == ["trees"] * (2 * calls) + ["whole"], node["ways"]
        # the last call's result (4 bytes an element), its inputs never copied
        assert node["held"] <= 2 * 4 * n, f"{node['held']} bytes held after {2 * calls} calls"
        assert node["after_close"] == 0


def test_a_group_of_one_rank_on_a_topology_takes_the_dynamic_path():
    """A Group of one rank on a topology packed trees for its broadcast, and
    `pack` refuses a single member: the call failed with TopologyError. One
    rank has nothing to send over trees."""
    from in_process import local_mode

    with local_mode(), hg.Group("one-rank", rank=0, size=1, topology=MESH, timeout=10) as g:
        value = np.arange(100_000, dtype=np.float32)
        np.testing.assert_array_equal(g.broadcast(value), value)
        np.testing.assert_array_equal(g.allreduce(value), value)
        np.testing.assert_array_equal(g.reduce(value), value)


def test_a_child_pulled_in_full_does_not_hide_its_siblings_failure():
    """A parent whose first child's partial result had come in full (a leaf's,
    at once) stopped watching its other child's pull: when that pull failed,
    the parent waited for bytes that never came until its deadline. On the
    DGX-1V allreduce of 7 ranks the root (children 3 and leaf 4 in tree 0,
    1 and 2 in tree 1) never said the call failed, and rank 4, which is no
    ancestor of rank 6 in either tree, waited to its deadline on its copy of
    the result (the chaos test's allreduce with a rank killed, seed
    485091414). Here rank 6's server answers nothing for half a second, long
    after every leaf's part is in, then cuts each stream: every rank fails
    soon, naming it."""
    async def dies_late(stream, obj, pos, end, stall, nbytes):
        await asyncio.sleep(0.5)
        await stream.close()
        return False

    _every_rank_fails_naming(6, dies_late, "late", size=7, config=CONFIG)


def _every_rank_fails_naming(victim: int, serve, name: str, size: int, config) -> None:
    """A DGX-1V allreduce of `size` ranks whose rank `victim` serves its
    ranges with `serve`: every rank raises ReduceFailed naming the victim,
    within 6 s."""
    topology = fixture("dgx1v")
    inputs = _inputs(size, 600_000, "int32")

    async def body(directory, *nodes):
        nodes[victim].server._stream_range = serve
        began = time.monotonic()
        got = await asyncio.gather(*_calls(nodes, topology, inputs, name, everyone=True,
                                           timeout=15.0), return_exceptions=True)
        took = time.monotonic() - began
        for r, out in enumerate(got):
            assert isinstance(out, ReduceFailed) and f"rank {victim} was lost" in str(out), \
                (r, out)
        assert took < 6.0, took

    run_nodes([config] * size, body, bound=60)



def test_a_deep_tree_folds_in_smaller_pieces():
    """Every level of a tree adds one piece's time to a reduce (and to an
    allreduce's way down), so a rank folds a tree's range in at least
    FOLD_PIECES_PER_LEVEL pieces per level of that tree's height."""
    from hoplite_gpu.directory.reduce_plan import MIN_FOLD_STEP, fold_unit

    chain = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6)]
    star = [(0, r) for r in range(1, 7)]
    assert mr._height(chain, 0) == 6 and mr._height(star, 0) == 1 and mr._height([], 0) == 0
    assert mr._height([(2, 0), (0, 1), (2, 3)], 2) == 2  # rooted elsewhere than node 0
    size = 16 << 20
    assert fold_unit(size, 1 << 20) == 1 << 20  # 8 pieces would be 2 MiB: the step caps it
    assert fold_unit(size, 1 << 20, 6 * mr.FOLD_PIECES_PER_LEVEL) == -(-size // 24)
    assert fold_unit(1 << 20, 1 << 20, 100) == MIN_FOLD_STEP  # never below the floor
