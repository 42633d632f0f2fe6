"""Review of how values become bytes (hoplite_gpu/values.py) and of the values
the collectives' reduces accept: what must be refused is refused with the
project's own error, before anything is sent, and never reduced wrongly."""

from __future__ import annotations

import mmap
import time

import numpy as np
import pytest
from in_process import allreduce_on_threads

import hoplite_gpu as hg
from hoplite_gpu import collectives
from hoplite_gpu.values import to_buffer


@pytest.fixture
def local():
    hg.init(timeout_s=10)
    yield hg.api.runtime()
    hg.shutdown()


def test_a_large_masked_array_allreduce_is_refused_not_reduced_without_its_mask():
    """put() refuses a masked array ("its mask would be lost"), and so does an
    allreduce of a small one or with slicing off. A large one under the
    default slicing ("adaptive") goes through `np.ascontiguousarray`, which
    drops the mask: every rank gets a plain sum that counts the masked
    elements."""
    hg.init(timeout_s=10, chunk_size=4096)
    try:
        mask = np.arange(30_000) % 2 == 0
        value = np.ma.masked_array(np.ones(30_000), mask=mask)
        got = allreduce_on_threads("review-masked", [value, value])
        assert all(isinstance(g, hg.UnsupportedValue) for g in got), \
            [type(g).__name__ for g in got]
    finally:
        hg.shutdown()


def test_a_large_unsupported_allreduce_input_sends_no_reduce_request(local):
    """A small object array is refused before anything is sent; one over the
    inline threshold takes the loop's path, where the reduce request is sent
    before the put converts the value: the call fails with UnsupportedValue,
    but the directory keeps a reduce task for the call and the node keeps
    re-asking for it."""
    rt = local
    with pytest.raises(hg.UnsupportedValue):
        collectives.allreduce(np.empty(20_000, dtype=object), name="review-obj", rank=0,
                              size=2, timeout=5)
    hg.node_stats()  # a round trip through the node's loop
    time.sleep(0.2)
    target = collectives._reduce_ids("review-obj", 2, "sum", None)[1]
    assert target.binary not in rt.directory.state.reduces
    assert target not in rt.node._my_reduces


def test_put_of_a_strided_array_with_no_memory_for_its_copy_raises_store_full(local):
    """docs/guide-memory.md: memory the machine cannot give raises StoreFull, not
    an error from deep inside NumPy. A non-contiguous array is copied by
    `to_buffer` first, and NumPy's own _ArrayMemoryError escapes from put()."""
    value = np.broadcast_to(np.float64(1.0), (2**50,))  # 8 PiB once contiguous
    with pytest.raises(hg.StoreFull):
        hg.put(value)


def _released_memoryview():
    view = memoryview(b"abc")
    view.release()
    return view


def _closed_mmap():
    m = mmap.mmap(-1, 16)
    m.close()
    return m


@pytest.mark.parametrize("make", [_released_memoryview, _closed_mmap],
                         ids=["released-memoryview", "closed-mmap"])
def test_a_buffer_that_cannot_be_read_is_an_unsupported_value(local, make):
    """`memoryview(value)` of a released memoryview or a closed mmap raises
    ValueError, which to_buffer (and put's direct path, reading `.nbytes`)
    lets escape raw instead of UnsupportedValue."""
    with pytest.raises(hg.UnsupportedValue):
        to_buffer(make())
    with pytest.raises(hg.UnsupportedValue):
        hg.put(make())
