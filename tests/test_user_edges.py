"""Edge cases a demanding user hits: each test fails on a confirmed bug."""

from __future__ import annotations

import os
import signal
import time
import warnings

import cluster_tasks as t
import numpy as np
import pytest
from in_process import wait_child

import hoplite_gpu as hg
from hoplite_gpu.cluster import LocalCluster


@pytest.fixture
def local():
    hg.init(chunk_size=64 * 1024, timeout_s=20)
    yield hg.api.runtime()
    hg.shutdown()


# --- deadlines given by the caller ------------------------------------------


@pytest.mark.parametrize("call", ["get", "reduced_inputs"])
def test_an_infinite_timeout_waits_or_is_refused_clearly(local, call):
    """`timeout=float("inf")` ("wait as long as it takes") passes the
    `timeout > 0` check, then overflows `Future.result(inf + 5)`: a raw
    OverflowError, while the call itself keeps running on the loop."""
    a, b = hg.put(np.ones(100_000)), hg.put(np.ones(100_000))
    try:
        if call == "get":
            value = hg.get(a, timeout=float("inf"))
            assert value.shape == (100_000,)
        else:
            target = hg.reduce([a, b])
            assert hg.get(target, timeout=10)[0] == 2.0
            assert set(hg.reduced_inputs(target, timeout=float("inf"))) == {a, b}
    except hg.HopliteError:
        pass  # refused clearly (InvalidArgument) is fine too


def test_a_timeout_of_the_wrong_type_is_invalid_argument(local):
    oid = hg.put(b"abc")
    with pytest.raises(hg.InvalidArgument):
        hg.get(oid, timeout="5")  # raw TypeError from `not timeout > 0`


# --- init ---------------------------------------------------------------------


@pytest.mark.parametrize("address", [1234, "127.0.0.1:99999"], ids=["not-a-str", "port-out-of-range"])
def test_a_malformed_directory_address_is_invalid_argument(address):
    """An int address dies with a raw AttributeError (`address.partition`); a
    port over 65535 is not checked and wraps modulo 65536 (99999 dials 34463,
    someone else's port)."""
    try:
        with pytest.raises(hg.InvalidArgument):
            hg.init(address, token="x", connect_timeout_s=1)
    finally:
        hg.shutdown()


# --- fork -------------------------------------------------------------------


def test_a_forked_child_gets_a_prompt_clear_answer_and_can_init(local):
    """In a forked child the runtime's loop thread does not exist, but the
    runtime still looks open (`loop.is_running()` is copied state): a call is
    queued to a loop nobody runs and blocks its whole deadline plus 5 s of
    grace before a misleading Timeout; `init()` is refused as "already
    called", and `shutdown()` blocks for 15 s."""
    small = hg.put(b"abc")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (forking a threaded process)
        pid = os.fork()
    if pid == 0:  # the child: exit code says what went wrong
        signal.alarm(30)
        code = 0
        try:
            start = time.monotonic()
            try:
                hg.get(small, timeout=0.5)
            except hg.HopliteError:
                pass
            if time.monotonic() - start > 2.5:
                os._exit(1)  # hung past its 0.5 s deadline
            try:
                hg.init(timeout_s=5)  # the child's own runtime
                if hg.get(hg.put(b"child"), timeout=2) != b"child":
                    code = 3
                hg.shutdown()
            except BaseException:
                code = 2
        finally:
            os._exit(code)
    status = wait_child(pid, 60, "the forked child did not finish within 60 s")
    code = os.waitstatus_to_exitcode(status)
    assert code == 0, {1: "a call in the child hung past its deadline",
                       2: "init() in the child failed",
                       3: "the child's own runtime returned the wrong value"}.get(code, code)


# --- sliced allreduce ---------------------------------------------------------


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
