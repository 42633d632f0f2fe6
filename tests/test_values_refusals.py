"""Values refused, and how: value conversion (hoplite_gpu/values.py) of
what cannot be carried, the collectives' and put's refusals before anything
is sent, and how reduce kernels' refusals reach callers (kernels/,
hoplite_gpu/node/reducer.py)."""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import time
import warnings

import numpy as np
import pytest
from in_process import allreduce_on_threads, run_nodes

import hoplite_gpu as hg
from hoplite_gpu import collectives
from hoplite_gpu.errors import ProtocolError, ReduceFailed, UnsupportedValue
from hoplite_gpu.values import Layout, empty_buffer, from_buffer, to_buffer


def _round_trips_or_is_unsupported(value: np.ndarray) -> None:
    """put() must either carry `value` exactly or refuse it with UnsupportedValue."""
    try:
        buf, layout = to_buffer(value)
    except UnsupportedValue:
        return
    recv = empty_buffer(layout.nbytes)
    recv[:] = np.frombuffer(buf, dtype=np.uint8)
    out = from_buffer(recv, Layout.from_wire(layout.to_wire()))
    assert out.dtype == value.dtype and out.shape == value.shape
    assert out.tobytes() == np.ascontiguousarray(value).tobytes()


# --- values: things put() is handed ---


def test_torch_size_is_an_unsupported_value():
    """torch.Size (a tuple with a numel() method) passes the torch-tensor test
    and then fails on `.device` with a raw AttributeError."""
    torch = pytest.importorskip("torch")
    with pytest.raises(UnsupportedValue):
        to_buffer(torch.Size([2, 3]))


def _nested(torch):
    return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])  # layout torch.strided


def _masked(torch):
    return torch.masked.masked_tensor(torch.tensor([1.0, 2.0]), torch.tensor([True, False]))


@pytest.mark.parametrize("make", [_nested, _masked], ids=["nested", "masked"])
def test_torch_tensors_that_are_not_plain_dense_are_unsupported(make):
    """A nested tensor (RuntimeError from reshape) and a MaskedTensor (TypeError
    from as_strided) escape as raw torch errors instead of UnsupportedValue."""
    torch = pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        value = make(torch)
        with pytest.raises(UnsupportedValue):
            to_buffer(value)


class _Union(ctypes.Union):
    _fields_ = [("i", ctypes.c_int32), ("f", ctypes.c_float)]


def _fields_reordered():
    a = np.zeros(3, [("x", "<i4"), ("y", "<f8")])
    a["x"], a["y"] = [1, 2, 3], [0.5, 1.5, 2.5]
    return a[["y", "x"]]  # a view whose fields are out of offset order


def test_structured_dtype_with_out_of_order_fields_is_carried_or_refused():
    """`dtype.descr` raises ValueError for out-of-order or overlapping fields;
    `_numpy_dtype_code` calls it outside its try, so put() of a multi-field
    view raises a raw ValueError instead of carrying the array or raising
    UnsupportedValue."""
    _round_trips_or_is_unsupported(_fields_reordered())


def test_ctypes_union_buffer_is_carried_or_refused():
    """The same through the buffer-protocol path: NumPy reads a ctypes Union
    as a structured dtype with overlapping fields, whose descr raises."""
    arr = (_Union * 2)()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            buf, layout = to_buffer(arr)
    except UnsupportedValue:
        return
    assert bytes(buf) == bytes(arr)


# --- values: layouts a peer sends ---


@pytest.mark.parametrize(
    "wire",
    [
        {"kind": "numpy", "dtype": "<f4", "shape": [0, 2**63], "nbytes": 0},
        {"kind": "numpy", "dtype": "|V0", "shape": [2**63], "nbytes": 0},
        {"kind": "torch", "dtype": "torch.float32", "shape": [0, 2**63], "nbytes": 0},
    ],
    ids=["numpy-zero-size", "numpy-void0", "torch-zero-size"],
)
def test_layout_with_a_dimension_no_array_can_have_is_a_protocol_error(wire):
    """A dimension past what an array index can hold (here 2**63, which msgpack
    carries) passes `Layout.from_wire` because the item count is 0, and then
    `from_buffer` fails with NumPy's ValueError or torch's TypeError."""
    if wire["kind"] == "torch":
        pytest.importorskip("torch")
    with pytest.raises(ProtocolError):
        layout = Layout.from_wire(wire)
        from_buffer(b"", layout)
    with pytest.raises(ProtocolError):
        layout = Layout.from_wire(wire)
        from_buffer(empty_buffer(0), layout)


# --- reduce: a kernel's refusal, as the callers see it ---


def test_reduce_of_an_unsupported_dtype_fails_waiting_gets_with_reduce_failed():
    """Objects over the inline threshold are reduced by tree steps; a step whose
    kernel refuses the dtype (uint16 here) makes the gets already waiting raise
    ObjectNotFound, while the same reduce of small (inline) objects, and any
    later get, raise ReduceFailed, which docs/fault-tolerance.md promises to
    every waiter ("a step failing for any other reason")."""
    config = hg.Config(shared_memory=False, timeout_s=10)
    seen: dict[str, BaseException | None] = {}

    async def body(directory, a, b):
        ids = [hg.ObjectID.from_name(f"values-edges-u16-{i}") for i in range(2)]
        target = hg.ObjectID.from_name("values-edges-u16-t")
        await a.reduce(ids, "sum", 2, target)
        gets = {"root": asyncio.ensure_future(a.get(target, 5, "numpy")),
                "other": asyncio.ensure_future(b.get(target, 5, "numpy"))}
        await asyncio.sleep(0.1)  # both gets are waiting before any input exists
        for oid in ids:
            await a.put(np.ones(100_000, np.uint16), oid)
        for name, get in gets.items():
            try:
                await asyncio.wait_for(get, 8)
                seen[name] = None
            except Exception as exc:  # noqa: BLE001 - the kind is what is checked
                seen[name] = exc

    run_nodes([config, config], body, bound=20)
    for name, exc in seen.items():
        assert isinstance(exc, ReduceFailed), f"{name} get raised {exc!r}"


def test_plain_arrays_never_import_numpy_ma():
    """Checking for a masked array by `isinstance(value, np.ma.MaskedArray)`
    imports `numpy.ma` (NumPy 2 loads it on first use): 10-18 ms of CPU in
    every process's first allreduce (`collectives._slices`) or first put of
    a non-contiguous array. A masked array cannot exist before `numpy.ma` is
    imported, so plain arrays must not import it; a masked one is still
    refused."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import numpy as np\n"
        "from hoplite_gpu import collectives, values\n"
        "values.to_buffer(np.arange(16.0)[::2])\n"
        "assert not values.is_masked(np.zeros(4))\n"
        "collectives._slicing = lambda size, num_objects: True  # (no runtime here)\n"
        "collectives._slices(np.zeros(4, np.float32), 8, None)\n"
        "print('numpy.ma' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "a plain array imported numpy.ma"
    with pytest.raises(UnsupportedValue, match="masked"):
        to_buffer(np.ma.masked_array(np.arange(4.0)[::2], mask=[0, 1]))


# --- collectives and put: values refused before anything is sent ---


@pytest.fixture
def runtime_settings() -> dict:
    """The `local` runtime's settings here."""
    return {"timeout_s": 10}


def _closed_mmap():
    m = mmap.mmap(-1, 16)
    m.close()
    return m


def _released_memoryview():
    view = memoryview(b"abc")
    view.release()
    return view


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
