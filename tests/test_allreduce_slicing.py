"""Allreduce slicing (`collectives._sliced`): the adaptive choice
(``allreduce_slicing="adaptive"``), with ranks as threads of this process on
one node made hosts of their own (an empty `Node.host_key`), and slices
small enough to travel inline or ranks that disagree on slicing."""

from __future__ import annotations

import gc
import logging
import time

import cluster_tasks as t
import numpy as np
import pytest
from in_process import allreduce_on_threads

import hoplite_gpu as hg
from hoplite_gpu import collectives
from hoplite_gpu.cluster import LocalCluster


@pytest.fixture
def hosts():
    """Adaptive slicing with a short window, the ranks on hosts of their own."""
    hg.init(timeout_s=20, chunk_size=4096, allreduce_slicing="adaptive",
            allreduce_slicing_window_s=0.05)
    hg.api.runtime().node.host_key = ""
    yield hg.api.runtime()
    hg.shutdown()


@pytest.mark.parametrize("late, values", [
    (1, [np.ones((3, 10_000)), np.ones((10_000, 3))]),
    (0, [np.ones(30_000), np.ones(30_000, dtype=np.int64)]),
], ids=["shape-last-late", "dtype-first-late"])
def test_mismatched_arrays_with_a_late_rank_fail_at_once(hosts, late, values):
    """Arrays of one byte size but different shapes (or dtypes), one rank
    after the other's window: the early rank reduces whole objects, the late
    one sees the mismatch in the markers. Both must fail at once, as with
    the ranks ready together; the early rank must not wait out its deadline
    on a whole-object reduce that the late rank never feeds."""
    start = time.monotonic()
    got = allreduce_on_threads(f"mismatch-{late}", values, timeout=4, delays={late: 0.5})
    elapsed = time.monotonic() - start
    assert all(isinstance(g, hg.HopliteError) and not isinstance(g, hg.Timeout)
               for g in got), got
    assert elapsed < 3, elapsed


@pytest.mark.parametrize("remembered", [False, True], ids=["window", "remembered-one-host"])
def test_a_timed_out_adaptive_allreduce_leaves_no_unretrieved_error(hosts, caplog, remembered):
    """A rank alone times out, while it waits its window for the markers
    (window longer than the call), or after it went whole at once (the
    remembered one-host path, which reads the markers only afterwards). The
    markers' gathering future it gives up must not be left holding an
    exception nobody retrieves: asyncio logs each such one as an error
    ("exception was never retrieved") with a traceback."""
    rt = hosts
    if remembered:
        rt.one_host_groups[3] = True
    else:
        rt.config = rt.config.replace(allreduce_slicing_window_s=5.0)  # (read per call)
    caplog.set_level(logging.ERROR, logger="asyncio")
    try:
        collectives.allreduce(np.ones(30_000), name=f"lonely-{remembered}", rank=0, size=3,
                              timeout=0.5)
        raise AssertionError("a lone rank's allreduce returned")
    except hg.Timeout:
        pass
    time.sleep(0.3)  # (the gets given up settle on the loop)
    hg.node_stats()
    gc.collect()
    hg.node_stats()
    never = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]
    assert not never, never


def test_a_kept_error_of_a_given_up_allreduce_pins_no_output_buffer(hosts):
    """A rank that voted to slice took its output array from the store's
    pool; the call then times out waiting for a vote. The caller keeps the
    errors (a retry loop's log, `gather(..., return_exceptions=True)`): the
    output buffer of a call that returned nothing must still go back to the
    pool, so each retry reuses it instead of pinning a fresh array's worth
    of memory per failed call."""
    node = hosts.node
    value = np.ones(300_000)  # 2.4 MB: the output is a pool buffer
    hosts.config = hosts.config.replace(allreduce_slicing_window_s=5.0)  # (read per call)
    errors = []
    for i in range(3):
        ready = collectives._slice_ids(f"kept-{i}", 2, "sum")[2]
        # rank 1 passed its barrier (on another host) but never votes
        hg.put(collectives._marker(value, sliced=True, domain="elsewhere"), ready[1])
        try:
            collectives.allreduce(value, name=f"kept-{i}", rank=0, size=2, timeout=0.5)
        except hg.Timeout as exc:
            errors.append(exc)
        gc.collect()
    assert len(errors) == 3
    # the second and third call each took the buffer the one before let go
    assert node.store.pool.reclaimed == 2, len(node.store.pool._lent)


def test_a_sliced_allreduce_with_inline_sized_slices_returns_the_sum():
    """chunk_size below inline_threshold: 3 ranks x 6000 float32 (24 kB) are
    sliced into 8 kB slices that travel inline. The result array is lent to
    `receive_into`, and `Pulls.store_inline` finds that (incomplete) object
    and marks it complete without copying the inline bytes into it: every
    rank returns the pool's uninitialised memory (NaN/garbage)."""
    n, size = 6000, 3
    with LocalCluster(size, chunk_size=4096, allreduce_slicing="auto", timeout_s=20) as c:
        got = c.map(t.allreduce_worker, [("tiny-sliced", r, size, n, 0.0) for r in range(size)],
                    timeout=120)
    want = sum(np.random.default_rng(r).standard_normal(n).astype(np.float32).astype(np.float64)
               for r in range(size))
    assert len({g[0] for g in got}) == 1, "ranks disagree on the allreduce result"
    assert got[0][1] == pytest.approx(want[:1000].sum(), rel=1e-4, abs=1e-3)


def test_ranks_of_a_sliced_allreduce_whose_arrays_differ_fail_at_once():
    """With slicing on, each rank decides alone whether to slice (from its own
    array's size): a rank with a large array takes the sliced path and waits
    for the other ranks' barrier markers, a rank with a small one asks for the
    whole-object reduce and waits for the first rank's whole input. Neither
    ever comes, so both wait out the whole deadline (300 s by default) with a
    Timeout, where without slicing both get ReduceFailed at once."""
    import threading

    from hoplite_gpu import collectives

    hg.init(timeout_s=20, chunk_size=4096, allreduce_slicing="auto")
    try:
        values = {0: np.ones(30_000), 1: np.ones(30)}  # rank 0 slices, rank 1 does not
        outcome = {}

        def rank(r):
            start = time.monotonic()
            try:
                collectives.allreduce(values[r], name="mismatched", rank=r, size=2, timeout=8)
                outcome[r] = ("no error", time.monotonic() - start)
            except hg.HopliteError as exc:
                outcome[r] = (type(exc).__name__, time.monotonic() - start)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert not any(th.is_alive() for th in threads)
        for r in range(2):
            kind, took = outcome[r]
            assert kind in ("ReduceFailed", "InvalidArgument") and took < 4, (r, outcome)
    finally:
        hg.shutdown()
