"""Edge cases of the collectives as a user calls them (one local runtime, as
in test_collectives.py): each test fails on a confirmed bug."""

from __future__ import annotations

import time

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu import collectives


@pytest.fixture
def local():
    hg.init(timeout_s=5)
    yield hg.api.runtime()
    hg.shutdown()


# --- `timeout` bounds the whole call ---------------------------------------------


CALLS = {
    "allgather": lambda: collectives.allgather(np.ones(10), name="away-ag", rank=0, size=2,
                                               timeout=1),
    "gather-root": lambda: collectives.gather(np.ones(10), name="away-g0", rank=0, size=2,
                                              timeout=1),
    "gather-non-root": lambda: collectives.gather(np.ones(10), name="away-g1", rank=1, size=2,
                                                  timeout=1),
    "reduce-non-root": lambda: collectives.reduce(np.ones(10), name="away-r", rank=1, size=2,
                                                  timeout=1),
    "broadcast-root": lambda: collectives.broadcast(np.ones(10), name="away-b", rank=0, size=2,
                                                    timeout=1),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_collectives_timeout_bounds_the_call_while_the_directory_is_away(local, call):
    """gather/allgather say "`timeout` bounds the whole call" (and
    docs/architecture.md says so of every collective). With the directory
    unreachable, allreduce, a reduce's root and a broadcast's receiver give up
    at their 1 s; but the put in gather/allgather and a broadcast root's put
    wait the runtime's `timeout_s` (5 s here, 300 s by default), and a
    non-root `reduce`'s steps are bounded only by the blocking call's grace
    (timeout + 5 s, "the runtime did not answer")."""
    rt = local
    rt.call(rt.directory.close(), 10)  # (its node keeps trying to reconnect)
    start = time.monotonic()
    with pytest.raises(hg.HopliteError):
        CALLS[call]()
    assert time.monotonic() - start < 3.0


# --- arguments ----------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [dict(op="mean"), dict(num_objects=0),
                                    dict(num_objects=3)],
                         ids=["unknown-op", "no-objects", "more-objects-than-ranks"])
def test_delete_refuses_what_no_call_could_have_used(local, kwargs):
    """`delete(name, size=, op=, num_objects=)` must name the call's op and
    num_objects to free its result. Values no call accepts (every collective
    refuses them with InvalidArgument) are taken silently: the result of the
    call the user meant is never freed, and nothing says so."""
    with pytest.raises(hg.InvalidArgument):
        collectives.delete("some-call", size=2, **kwargs)


@pytest.mark.parametrize("kwargs", [dict(rank=True, size=2), dict(rank=0, size=True)],
                         ids=["bool-rank", "bool-size"])
def test_a_bool_rank_or_size_is_invalid_argument(local, kwargs):
    """`num_objects=True` and `timeout=True` are refused as InvalidArgument,
    but `_check` takes a bool rank or size as the int it subclasses: rank=True
    silently acts as rank 1, size=True as a group of one."""
    with pytest.raises(hg.InvalidArgument):
        collectives.allgather(np.ones(3), name="bools", timeout=0.5, **kwargs)


def test_an_allreduce_with_slicing_on_honours_its_timeout_while_the_directory_is_away():
    """With `allreduce_slicing="auto"`, an allreduce too small to slice first
    puts its barrier marker with `api.put`, bounded by `timeout_s` (5 s here,
    300 s by default), not by the call's `timeout` (a sliced one does stop at
    its 1 s)."""
    hg.init(timeout_s=5, allreduce_slicing="auto")
    try:
        rt = hg.api.runtime()
        rt.call(rt.directory.close(), 10)
        start = time.monotonic()
        with pytest.raises(hg.HopliteError):
            collectives.allreduce(np.ones(10), name="away-marker", rank=0, size=2, timeout=1)
        assert time.monotonic() - start < 3.0
    finally:
        hg.shutdown()
