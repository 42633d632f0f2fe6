"""Multi-process reduce, subset reduce, allreduce and the collectives."""

from __future__ import annotations

import zlib

import cluster_tasks as t
import numpy as np
import pytest

from hoplite_gpu.cluster import LocalCluster

N = 7  # worker 0 asks for reduces; workers 1-6 put inputs
RANKS = 6


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(N, chunk_size=1 << 20) as c:
        yield c


def oracle(names_seeds, n, op="sum"):
    arrays = [np.random.default_rng(seed).standard_normal(n).astype(np.float32).astype(np.float64)
              for seed in names_seeds]
    stack = np.stack(arrays)
    return {"sum": stack.sum(0), "prod": stack.prod(0), "min": stack.min(0),
            "max": stack.max(0), "avg": stack.mean(0)}[op]


@pytest.mark.parametrize("n", [1000, 300_000, 3_000_000], ids=["inline", "one-chunk", "pipelined"])
@pytest.mark.parametrize("op", ["sum", "min", "max", "avg", "prod"])
def test_reduce_staggered_subset(cluster, n, op):
    """Six workers put at staggered times in a shuffled order: the first four
    ready inputs are reduced, whatever their order."""
    names = [f"r-{op}-{n}-{w}" for w in range(N)]
    target = f"r-{op}-{n}-out"
    cluster.submit(0, t.reduce_and_get, names[1:], op, 4, target)
    delays = {3: 0.0, 5: 0.05, 1: 0.1, 6: 0.15, 4: 0.2, 2: 0.25}
    for w, delay in delays.items():
        cluster.submit(w, t.put_float32, names[w], n, w, delay)
    for w in delays:
        cluster.result(w)
    value, used = cluster.result(0)
    assert len(used) == 4 and len(set(used)) == 4
    expected = oracle([u + 1 for u in used], n, op)  # input i was put by worker i + 1
    tol = 1e-4 if op != "prod" else 1e-3
    np.testing.assert_allclose(value.astype(np.float64), expected, rtol=tol, atol=tol)


@pytest.mark.slow_over_ucx
def test_allreduce_six_64mib_arrays(cluster):
    n = (64 << 20) // 4
    got = cluster.map(t.allreduce_worker, [("ar64", r, RANKS, n, 0.1 * r) for r in range(RANKS)],
                      timeout=240)
    crcs = {g[0] for g in got}
    assert len(crcs) == 1, "ranks disagree on the allreduce result"
    expected = oracle(range(RANKS), 1000).sum()
    assert got[0][1] == pytest.approx(expected, rel=1e-4, abs=1e-3)


@pytest.fixture(scope="module")
def sliced_cluster():
    with LocalCluster(RANKS, chunk_size=1 << 20, allreduce_slicing="auto") as c:
        yield c


@pytest.mark.slow_over_ucx
def test_a_large_allreduce_is_sliced_and_each_slice_relayed_round_the_ranks(sliced_cluster):
    """Slice j is reduced on a chain rooted at rank j, and its result relayed
    from rank j to j+1, j+2, ... as in a ring, whichever rank asks first."""
    n = (12 << 20) // 4 + 5  # 2 MiB slices of 1 MiB chunks, not evenly divided
    got = sliced_cluster.map(t.sliced_allreduce_worker,
                             [("sliced", r, RANKS, n) for r in range(RANKS)], timeout=120)
    assert len({g[0] for g in got}) == 1, "ranks disagree on the allreduce result"
    assert all(g[3] == (n,) for g in got)
    assert [(g[5], g[6]) for g in got] == [(True, False)] * RANKS  # zero-copy, read-only
    nodes = [g[1] for g in got]
    assert len(set(nodes)) == RANKS
    for j, (origins, edges) in enumerate(got[0][2]):
        relay = {(nodes[(j + i) % RANKS], nodes[(j + i - 1) % RANKS]) for i in range(1, RANKS)}
        assert origins == [nodes[j]] and set(edges) == relay, (j, nodes, got[0][2])
    want = oracle(range(RANKS), n)
    # every element, through the slices' edges too: a sample in each slice
    np.testing.assert_allclose(got[0][4], want[::4099], rtol=1e-4, atol=1e-4)
    before, after = sliced_cluster.run(0, t.delete_sliced, "sliced", RANKS)
    assert all(before) and not any(after)


@pytest.mark.slow_over_ucx
def test_sliced_results_reuse_dropped_buffers_never_held_ones(sliced_cluster):
    n, steps = (12 << 20) // 4, 5
    got = sliced_cluster.map(t.allreduce_steps, [("sliced-loop", r, RANKS, n, steps, True)
                                                 for r in range(RANKS)], timeout=120)
    want = [float(sum(range(RANKS)) + RANKS * k) for k in range(steps)]
    assert all(g["sums"] == want for g in got)
    assert all(g["first"] == [want[0]] for g in got), "a kept result changed under its holder"
    # each step's result array comes back to the pool once dropped and deleted;
    # how soon depends on when each node hears of the delete, so not every step
    assert all(g["reclaimed"] >= 1 for g in got), [g["reclaimed"] for g in got]


def test_mismatched_inputs_fail_every_waiter(cluster):
    cluster.run(1, t.put_float32, "bad-a", 5000, 1)
    cluster.run(2, t.put_float32, "bad-b", 6000, 2)
    msg = cluster.run(0, t.get_reduce_error, ["bad-a", "bad-b"], "sum", "bad-out")
    assert msg.startswith("ReduceFailed") and "same dtype and shape" in msg


@pytest.mark.parametrize("root_delay", [0.0, 0.3], ids=["root-first", "root-middle"])
def test_reduce_result_is_produced_on_the_root(cluster, root_delay):
    """The root's own input takes the tree's root, whenever it arrives, so the
    result is reduced where it is wanted instead of pulled from the last arrival."""
    root, n = 2, 300_000
    delays = [0.1 * r for r in range(RANKS)]
    delays[root] = root_delay
    got = cluster.map(t.reduce_worker, [("red-root-" + str(root_delay), r, RANKS, root, n,
                                         delays[r]) for r in range(RANKS)], timeout=120)
    assert [g is None for g in got] == [r != root for r in range(RANKS)]
    total, origins, me = got[root]
    assert origins == [me]
    assert total == pytest.approx(oracle(range(RANKS), 1000).sum(), rel=1e-4, abs=1e-3)


def test_training_loop_deletes_each_step_and_reuses_buffers(cluster):
    n, steps = (4 << 20) // 4, 4
    got = cluster.map(t.allreduce_steps, [("loop", r, RANKS, n, steps) for r in range(RANKS)],
                      timeout=120)
    want = [float(sum(range(RANKS)) + RANKS * k) for k in range(steps)]
    assert all(g["sums"] == want for g in got)
    assert got[0]["gone"] is True
    # every node put an input and held the result each step: later steps reuse those buffers
    assert all(g["pool_hits"] >= steps - 1 for g in got), [g["pool_hits"] for g in got]


@pytest.mark.parametrize("kind", ["broadcast", "gather", "allgather"])
def test_collectives(cluster, kind):
    got = cluster.map(t.collective_worker, [(kind, f"coll-{kind}", r, RANKS) for r in range(RANKS)])
    if kind == "broadcast":
        assert all(g == (0, (100_000,)) for g in got)
    elif kind == "gather":
        assert got[0] == [(r, (100_000 + r,)) for r in range(RANKS)]
        assert got[1:] == [None] * (RANKS - 1)
    else:
        assert all(g == [(r, (100_000 + r,)) for r in range(RANKS)] for g in got)


def test_crc_is_stable():
    assert zlib.crc32(b"x") == zlib.crc32(bytearray(b"x"))


def test_slicing_is_off_unless_asked_for(cluster):
    """The default reduces whole objects: no slice results exist afterwards."""
    n = (12 << 20) // 4
    got = cluster.map(t.allreduce_worker, [("unsliced", r, RANKS, n, 0.0) for r in range(RANKS)],
                      timeout=120)
    assert len({g[0] for g in got}) == 1
    assert cluster.run(0, t.object_exists, "unsliced/reduce/sum/6")
    assert not cluster.run(0, t.object_exists, "unsliced/slice/0/reduce/sum")
