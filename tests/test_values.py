import array
import ctypes

import hypothesis.extra.numpy as hnp
import ml_dtypes
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hoplite_gpu.errors import InvalidArgument, ProtocolError, UnsupportedValue
from hoplite_gpu.values import Layout, empty_buffer, from_buffer, to_buffer


def through_msgpack(layout):
    packed = msgpack.packb(layout.to_wire(), use_bin_type=True)
    return Layout.from_wire(msgpack.unpackb(packed, raw=False))


def send(value):
    """to_buffer -> wire -> a fresh receive buffer -> from_buffer, as a peer would."""
    buf, layout = to_buffer(value)
    assert isinstance(buf, memoryview)
    assert (buf.format, buf.ndim, buf.c_contiguous) == ("B", 1, True)
    assert buf.nbytes == layout.nbytes
    wire = through_msgpack(layout)
    assert wire == layout
    recv = empty_buffer(layout.nbytes)
    recv[:] = np.frombuffer(buf, dtype=np.uint8)
    return from_buffer(recv, wire), recv, layout


def assert_same_array(out, expected):
    assert isinstance(out, np.ndarray)
    assert out.dtype == expected.dtype
    assert out.shape == expected.shape
    # bitwise: covers NaN, NaT, strings and structured records alike
    assert out.tobytes() == expected.tobytes()


def shares(buf, obj):
    return np.shares_memory(np.frombuffer(buf, dtype=np.uint8), np.asarray(obj))


# --- bytes ---


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"hello",
        bytearray(b"\x00\xff" * 100),
        memoryview(b"abc"),
        memoryview(np.array(1.5, dtype=np.float32)),
    ],
    ids=["empty", "bytes", "bytearray", "memoryview", "memoryview-0d"],
)
def test_bytes_round_trip(value):
    out, _, layout = send(value)
    assert type(out) is bytes
    assert out == bytes(value)
    n = len(out)
    assert (layout.kind, layout.dtype, layout.shape, layout.nbytes) == ("bytes", "uint8", (n,), n)


def test_bytearray_is_zero_copy():
    value = bytearray(b"abcd")
    buf, _ = to_buffer(value)
    value[0] = ord("z")
    assert buf.tobytes() == b"zbcd"


def test_memoryview_of_any_format_gives_raw_bytes():
    a = np.arange(6, dtype=">i4").reshape(2, 3)
    out, _, layout = send(memoryview(a))
    assert layout.kind == "bytes"
    assert out == a.tobytes()


def test_non_contiguous_memoryview_is_copied_in_c_order():
    a = np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2]
    buf, layout = to_buffer(memoryview(a))
    assert buf.tobytes() == a.tobytes()
    assert layout.nbytes == a.nbytes


def test_bytes_result_is_a_copy():
    out, recv, _ = send(b"xyz")
    recv[:] = 0
    assert out == b"xyz"


# --- numpy ---

STRUCT_PADDED = np.dtype(
    {"names": ["a", "b"], "formats": ["u1", ">f4"], "offsets": [0, 4], "itemsize": 12}
)
STRUCT_NESTED = np.dtype([(("a title", "x"), "<i4"), ("y", [("z", "<f2", (2, 3))]), ("s", "S2")])

NUMPY_CASES = {
    "float32-2d": np.arange(12, dtype=np.float32).reshape(3, 4),
    "int64": np.arange(-5, 5, dtype=np.int64),
    "uint64": np.array([0, 2**64 - 1], dtype=np.uint64),
    "float16": np.array([1.5, -np.inf, np.nan], dtype=np.float16),
    "bool": np.array([[True, False], [False, True]]),
    "complex128": np.array([1 + 2j, np.nan - 1j]),
    "big-endian-f8": np.arange(4, dtype=">f8"),
    "big-endian-i2": np.arange(4, dtype=">i2").reshape(2, 2),
    "datetime64": np.array(["2024-01-01T00:00", "NaT"], dtype="datetime64[ns]"),
    "timedelta64": np.array([1, -3], dtype="timedelta64[s]"),
    "unicode": np.array(["a", "hello", ""], dtype="U5"),
    "unicode-big-endian": np.array(["ab", "c"], dtype=">U3"),
    "bytes": np.array([b"ab", b"xyz"], dtype="S3"),
    "void": np.array([b"\x01\x02"], dtype="V2"),
    "structured-padded": np.array([(1, 2.5), (3, -1.0)], dtype=STRUCT_PADDED),
    "structured-nested": np.zeros(3, dtype=STRUCT_NESTED),
    "structured-aligned": np.zeros(2, dtype=np.dtype([("a", "u1"), ("b", "f8")], align=True)),
    "0-d": np.array(3.25),
    "empty": np.empty((0, 3), dtype=np.float64),
    "empty-struct": np.zeros(3, dtype=np.dtype([])),
}


@pytest.mark.parametrize("value", NUMPY_CASES.values(), ids=NUMPY_CASES.keys())
def test_numpy_round_trip(value):
    out, _, layout = send(value)
    assert layout.kind == "numpy"
    assert_same_array(out, value)
    if value.dtype.kind in "SUV":
        assert (out == value).all()
    else:
        assert np.array_equal(out, value, equal_nan=value.dtype.kind in "fcmM")


def test_numpy_dtype_layout_keeps_byte_order():
    _, layout = to_buffer(np.zeros(2, dtype=">f8"))
    assert layout.dtype == ">f8"


@pytest.mark.parametrize(
    "dtype", [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.int4], ids=str
)
def test_ml_dtypes_round_trip(dtype):
    value = np.array([[1.0, -2.0], [0.5, 3.0]]).astype(dtype)
    out, _, layout = send(value)
    assert layout.dtype == np.dtype(dtype).name
    assert_same_array(out, value)
    assert np.array_equal(out, value)


@pytest.mark.parametrize(
    "scalar",
    [np.float32(1.5), np.int8(-3), np.bytes_(b"ab"), np.str_("hi"), np.datetime64("2024-05-01")],
    ids=repr,
)
def test_numpy_scalars_become_0d_arrays(scalar):
    out, _, layout = send(scalar)
    assert layout.kind == "numpy"
    assert layout.shape == ()
    assert_same_array(out, np.asarray(scalar))


def test_contiguous_array_is_zero_copy():
    a = np.arange(10, dtype=np.float64)
    buf, _ = to_buffer(a)
    assert shares(buf, a)


@pytest.mark.parametrize(
    "make",
    [
        lambda a: a[:, ::2],
        lambda a: a.T,
        np.asfortranarray,
        lambda a: a[::-1],
    ],
    ids=["strided", "transposed", "fortran", "reversed"],
)
def test_non_contiguous_array_is_copied_in_c_order(make):
    value = make(np.arange(24, dtype=np.int32).reshape(4, 6))
    buf, layout = to_buffer(value)
    assert not shares(buf, value)
    assert layout.shape == value.shape
    out, _, _ = send(value)
    assert_same_array(out, np.ascontiguousarray(value))
    assert np.array_equal(out, value)


def test_numpy_result_is_a_read_only_zero_copy_view():
    out, recv, _ = send(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert np.shares_memory(out, recv)
    assert not out.flags.writeable
    with pytest.raises(ValueError):
        out[0, 0] = 1.0


def test_from_buffer_accepts_a_memoryview():
    value = np.arange(4, dtype=np.int16)
    buf, layout = to_buffer(value)
    out = from_buffer(buf, layout)
    assert_same_array(out, value)
    assert np.shares_memory(out, value)
    with pytest.raises(ValueError):
        out[0] = 7


def test_from_buffer_rejects_a_buffer_of_the_wrong_size():
    _, layout = to_buffer(np.zeros(4, dtype=np.float32))
    with pytest.raises(InvalidArgument, match="16"):
        from_buffer(empty_buffer(15), layout)


def test_empty_buffer():
    buf = empty_buffer(7)
    assert (buf.dtype, buf.shape) == (np.uint8, (7,))


@st.composite
def numpy_values(draw):
    dtype = draw(
        st.one_of(
            hnp.scalar_dtypes(),
            hnp.byte_string_dtypes(endianness="?"),
            hnp.unicode_string_dtypes(endianness="?"),
            hnp.array_dtypes(allow_subarrays=True),
        )
    )
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
    value = draw(hnp.arrays(dtype, shape))
    if value.ndim and draw(st.booleans()):
        value = value[:: draw(st.integers(1, 3))]  # strided, not contiguous
    return value


@settings(deadline=None, max_examples=200)
@given(numpy_values())
def test_numpy_round_trip_property(value):
    out, recv, layout = send(value)
    assert layout.nbytes == value.nbytes
    assert_same_array(out, np.ascontiguousarray(value).reshape(value.shape))
    assert not out.flags.writeable
    if out.nbytes:
        assert np.shares_memory(out, recv)


# --- other array producers ---


class DLPackOnly:
    """Exposes only the DLPack protocol, like arrays from libraries we do not know."""

    def __init__(self, array, device=(1, 0)):
        self._array = array
        self._device = device

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._device


def test_dlpack_object_round_trips_as_numpy():
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    out, _, layout = send(DLPackOnly(value))
    assert layout.kind == "numpy"
    assert_same_array(out, value)


def _no_usable_gpu() -> bool:
    from hoplite_gpu.gpu import cuda_available

    return not cuda_available()


@pytest.mark.skipif(not _no_usable_gpu(), reason="a GPU is present: device arrays are stored")
def test_dlpack_object_on_a_device_without_a_gpu_is_a_clear_error():
    with pytest.raises(UnsupportedValue, match="device array"):
        to_buffer(DLPackOnly(np.zeros(2), device=(2, 0)))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (array.array("d", [1.0, 2.5]), np.array([1.0, 2.5])),
        (array.array("b", [1, -2]), np.array([1, -2], dtype=np.int8)),
        ((ctypes.c_int32 * 3)(1, 2, 3), np.array([1, 2, 3], dtype=np.int32)),
    ],
    ids=["array-d", "array-b", "ctypes-int32"],
)
def test_buffer_protocol_objects_round_trip_as_numpy(value, expected):
    out, _, layout = send(value)
    assert layout.kind == "numpy"
    assert_same_array(out, expected)


def test_buffer_with_a_format_numpy_cannot_read_falls_back_to_bytes():
    value = (ctypes.c_void_p * 2)(3, 5)
    out, _, layout = send(value)
    assert layout.kind == "bytes"
    assert out == bytes(value)


class FakeCupyArray:
    __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0, False), "version": 3}

    def __dlpack__(self, **kwargs):
        raise AssertionError("must not be called")


@pytest.mark.skipif(not _no_usable_gpu(), reason="a GPU is present: device arrays are stored")
def test_cuda_array_interface_objects_without_a_gpu_are_a_clear_error():
    with pytest.raises(UnsupportedValue, match="device array"):
        to_buffer(FakeCupyArray())


# --- unsupported values ---


@pytest.mark.parametrize(
    "value", [1, "text", [1, 2], {"a": 1}, None, object(), 1.5], ids=lambda v: type(v).__name__
)
def test_unsupported_values_say_what_was_given_and_what_is_accepted(value):
    with pytest.raises(UnsupportedValue) as info:
        to_buffer(value)
    message = str(info.value)
    assert f"got {type(value).__name__}." in message
    assert "NumPy array" in message
    assert "Convert it first" in message
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize(
    "value",
    [
        np.array([1, "a", None], dtype=object),
        np.zeros(2, dtype=[("a", "i4"), ("b", "O")]),
        np.array(["a", "bc"], dtype=np.dtypes.StringDType()),
    ],
    ids=["object", "struct-with-object", "StringDType"],
)
def test_arrays_of_pointers_are_unsupported(value):
    with pytest.raises(UnsupportedValue, match="pointers"):
        to_buffer(value)


def test_masked_arrays_are_unsupported():
    with pytest.raises(UnsupportedValue, match="mask"):
        to_buffer(np.ma.masked_array([1, 2], mask=[0, 1]))


# --- Layout on the wire ---


@pytest.mark.parametrize(
    "value",
    [b"ab", np.zeros((2, 3), ">i2"), np.zeros(2, STRUCT_NESTED), np.zeros(1, ml_dtypes.bfloat16)],
    ids=["bytes", "int16", "structured", "bfloat16"],
)
def test_layout_wire_round_trip(value):
    _, layout = to_buffer(value)
    wire = layout.to_wire()
    assert set(wire) == {"kind", "dtype", "shape", "nbytes"}
    assert through_msgpack(layout) == layout


def test_layout_wire_round_trip_for_torch():
    layout = Layout("torch", "torch.bfloat16", (2, 3), 12)
    assert through_msgpack(layout) == layout


GOOD = {"kind": "numpy", "dtype": "<f4", "shape": [2, 3], "nbytes": 24}

MALFORMED = {
    "not-a-dict": [GOOD],
    "missing-key": {k: v for k, v in GOOD.items() if k != "nbytes"},
    "extra-key": {**GOOD, "extra": 1},
    "bad-kind": {**GOOD, "kind": "pickle"},
    "dtype-not-str": {**GOOD, "dtype": 4},
    "dtype-unknown": {**GOOD, "dtype": "nonsense"},
    "dtype-not-canonical": {**GOOD, "dtype": "f4"},
    "dtype-object": {**GOOD, "dtype": "|O", "nbytes": 48},
    "dtype-not-a-literal": {**GOOD, "dtype": "[__import__('os')]"},
    "dtype-broken-literal": {**GOOD, "dtype": "[('a', "},
    "dtype-huge": {**GOOD, "dtype": "[" + " " * 70000 + "]"},
    "ml-dtypes-non-type": {**GOOD, "dtype": "finfo"},
    "shape-not-list": {**GOOD, "shape": "2,3"},
    "shape-negative": {**GOOD, "shape": [-2, -3]},
    "shape-bool": {**GOOD, "shape": [True, 24]},
    "shape-float": {**GOOD, "shape": [2.0, 3]},
    "shape-too-many-dims": {**GOOD, "shape": [1] * 65, "nbytes": 4},
    "nbytes-str": {**GOOD, "nbytes": "24"},
    "nbytes-negative": {**GOOD, "nbytes": -24},
    "nbytes-bool": {**GOOD, "shape": [1], "dtype": "|u1", "nbytes": True},
    "nbytes-mismatch": {**GOOD, "nbytes": 25},
    "bytes-wrong-dtype": {"kind": "bytes", "dtype": "<f4", "shape": [4], "nbytes": 4},
    "bytes-wrong-shape": {"kind": "bytes", "dtype": "uint8", "shape": [2, 2], "nbytes": 4},
    "torch-no-prefix": {"kind": "torch", "dtype": "float32", "shape": [2], "nbytes": 8},
    "torch-odd-size": {"kind": "torch", "dtype": "torch.float32", "shape": [2], "nbytes": 7},
    "torch-empty-with-bytes": {
        "kind": "torch",
        "dtype": "torch.float32",
        "shape": [0],
        "nbytes": 4,
    },
}


@pytest.mark.parametrize("wire", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_wire_layouts_raise_protocol_error(wire):
    with pytest.raises(ProtocolError):
        Layout.from_wire(wire)
    # also once a good layout of equal values is known (parsed layouts are kept)
    Layout.from_wire(GOOD)
    Layout.from_wire({**GOOD, "shape": [1], "dtype": "|u1", "nbytes": 1})  # (nbytes-bool's)
    with pytest.raises(ProtocolError):
        Layout.from_wire(wire)


def test_known_wire_layouts_are_parsed_once():
    first = Layout.from_wire(dict(GOOD))
    assert Layout.from_wire(dict(GOOD)) is first
    assert Layout.from_wire({**GOOD, "shape": [3, 2]}).shape == (3, 2)


def test_good_wire_layout_parses():
    assert Layout.from_wire(GOOD) == Layout("numpy", "<f4", (2, 3), 24)


# --- torch ---


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def torch_bytes(t):
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


TORCH_DTYPES = [
    "float32", "float64", "float16", "bfloat16", "int8", "int64", "uint8", "uint16",
    "bool", "complex64", "float8_e4m3fn",
]  # fmt: skip


@pytest.mark.parametrize("dtype_name", TORCH_DTYPES)
@pytest.mark.parametrize("shape", [(2, 3), (), (0, 4)], ids=["2d", "0d", "empty"])
def test_torch_round_trip(torch, dtype_name, shape):
    dtype = getattr(torch, dtype_name)
    value = (torch.arange(max(1, int(np.prod(shape)))) % 5 - 2)[: int(np.prod(shape))]
    value = value.reshape(shape).to(dtype)
    out, recv, layout = send(value)
    assert layout.kind == "torch"
    assert layout.dtype == f"torch.{dtype_name}"
    assert isinstance(out, torch.Tensor)
    assert (out.dtype, out.shape, out.device.type) == (dtype, value.shape, "cpu")
    assert torch.equal(torch_bytes(out), torch_bytes(value))
    assert not np.shares_memory(recv, out.reshape(-1).view(torch.uint8).numpy())


def test_torch_result_is_writable_and_fresh(torch):
    value = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    out, recv, _ = send(value)
    out[0, 0] = 100.0  # would warn or fail on a read-only or shared buffer
    assert torch.equal(out[1], value[1])
    assert np.frombuffer(recv, dtype=np.float32)[0] == 0.0


def test_torch_contiguous_is_zero_copy(torch):
    value = torch.arange(8, dtype=torch.bfloat16)
    buf, _ = to_buffer(value)
    assert shares(buf, value.view(torch.uint8).numpy())


def test_torch_requires_grad_and_parameters(torch):
    value = torch.ones(2, 2, requires_grad=True) * 3
    out, _, _ = send(value)
    assert not out.requires_grad
    assert torch.equal(out, value.detach())
    out, _, _ = send(torch.nn.Parameter(torch.ones(3)))
    assert type(out) is torch.Tensor
    assert torch.equal(out, torch.ones(3))


@pytest.mark.parametrize(
    "make",
    [lambda t: t.T, lambda t: t[:, ::2], lambda t: t[:1].expand(3, 4)],
    ids=["transposed", "strided", "expanded"],
)
def test_torch_non_contiguous(torch, make):
    value = make(torch.arange(8, dtype=torch.int32).reshape(2, 4))
    out, _, _ = send(value)
    assert out.is_contiguous()
    assert torch.equal(out, value)


def test_torch_lazy_conj_and_neg_are_resolved(torch):
    value = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    out, _, _ = send(value)
    assert torch.equal(out, torch.tensor([1 - 2j, 3 + 4j], dtype=torch.complex64))
    imag = torch.tensor([1 + 2j], dtype=torch.complex64).conj().imag  # a neg-bit view
    out, _, _ = send(imag)
    assert torch.equal(out, torch.tensor([-2.0]))


def test_torch_device_tensor_is_unsupported(torch):
    with pytest.raises(UnsupportedValue, match=r"only CPU tensors.*\.cpu\(\)"):
        to_buffer(torch.ones(2, device="meta"))


@pytest.mark.gpu
def test_torch_cuda_tensor_is_a_device_object(torch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    buf, layout = to_buffer(torch.arange(6, dtype=torch.float32, device="cuda").reshape(2, 3))
    assert layout.kind == "device" and layout.shape == (2, 3) and layout.nbytes == 24
    out = from_buffer(buf, layout, "torch")
    assert out.is_cuda and torch.equal(out.cpu(), torch.arange(6.0).reshape(2, 3))


def test_torch_sparse_tensor_is_unsupported(torch):
    with pytest.raises(UnsupportedValue, match="dense"):
        to_buffer(torch.ones(2).to_sparse())


def test_torch_layout_with_unknown_dtype_raises_protocol_error(torch):
    layout = Layout("torch", "torch.no_such_dtype", (2,), 8)
    with pytest.raises(ProtocolError):
        from_buffer(empty_buffer(8), layout)
