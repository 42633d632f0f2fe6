"""Chunk reduction kernels: one test body per backend, checked against a NumPy oracle."""

from __future__ import annotations

import functools
import operator
import subprocess
import sys

import numpy as np
import pytest

from hoplite_gpu import kernels
from hoplite_gpu.errors import InvalidArgument
from hoplite_gpu.kernels import cupy_ops, numpy_ops

BACKENDS = ["numpy", pytest.param("cupy", marks=pytest.mark.gpu)]
FLOATS = ("float16", "bfloat16", "float32", "float64")
INTS = ("int8", "int16", "int32", "int64", "uint8")
SHAPES = [(0,), (1,), (7,), (4099,), (3, 5)]
NCHUNKS = 5
# Each fold rounds once (unit roundoff u) and "avg" once more, so NCHUNKS * u bounds
# the error relative to sum(|x|) (sum, avg) or to |result| (prod).
RTOL = {"float16": 1e-2, "bfloat16": 2e-2, "float32": 1e-6, "float64": 1e-12}


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        return np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    return np.dtype(name)


class _Backend:
    """Moves host arrays to the backend under test and back."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stream = None
        if name == "cupy":
            import cupy

            self.xp = cupy
            # A stream of our own: the kernels must honour it, not just the default one.
            self.stream = cupy.cuda.Stream()
        else:
            self.xp = np

    def put(self, host: np.ndarray) -> tuple[object, str | None]:
        """The array on the backend, and the `dtype=` to pass with it."""
        if self.name == "numpy":
            return host.copy(), None
        with self.stream:
            if host.dtype.name == "bfloat16":
                try:
                    return self.xp.asarray(host), None
                except (TypeError, ValueError, NotImplementedError):
                    # CuPy without a bfloat16 dtype: carry the bits as uint16.
                    return self.xp.asarray(host.view(np.uint16)), "bfloat16"
            return self.xp.asarray(host), None

    def get(self, arr: object, dtype: np.dtype) -> np.ndarray:
        if self.name == "numpy":
            return arr
        self.stream.synchronize()
        return self.xp.asnumpy(arr).view(dtype)

    def reduce(self, chunks: list[np.ndarray], op: str, *, dtype: np.dtype) -> np.ndarray:
        acc, kind = self.put(chunks[0])
        for chunk in chunks[1:]:
            dev, _ = self.put(chunk)
            kernels.reduce_into(acc, dev, op, stream=self.stream, dtype=kind)
        kernels.finalize(acc, op, len(chunks), stream=self.stream, dtype=kind)
        return self.get(acc, dtype)


def _random(rng: np.random.Generator, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    # Magnitudes in [0.5, 2) keep a product of NCHUNKS far from float16's over/underflow.
    x = rng.uniform(0.5, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
    return x.astype(dtype)


def _int_oracle(chunks: list[np.ndarray], op: str) -> np.ndarray:
    dtype = chunks[0].dtype
    if op in ("min", "max"):
        return getattr(np, op)(np.stack(chunks), axis=0)
    exact = [c.astype(object) for c in chunks]  # Python ints: no overflow, no warnings
    total = functools.reduce(operator.mul if op == "prod" else operator.add, exact)
    info = np.iinfo(dtype)
    wrapped = (total - info.min) % (1 << info.bits) + info.min
    if op == "avg":
        wrapped = wrapped // len(chunks)
    return wrapped.astype(dtype)


def _assert_float_close(got: np.ndarray, chunks: list[np.ndarray], op: str) -> None:
    x = np.stack([c.astype(np.float64) for c in chunks])
    n = len(chunks)
    want = {
        "sum": x.sum(0),
        "avg": x.sum(0) / n,
        "prod": x.prod(0),
        "min": x.min(0),
        "max": x.max(0),
    }[op]
    scale = {"sum": abs(x).sum(0), "avg": abs(x).sum(0) / n, "prod": abs(want)}
    tol = RTOL[chunks[0].dtype.name] * scale.get(op, 0.0)
    err = abs(got.astype(np.float64) - want)
    assert np.all(err <= tol), f"max error {err.max()} over tolerance"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype_name", FLOATS + INTS)
@pytest.mark.parametrize("op", kernels.OPS)
def test_reduce_matches_oracle(backend, op, dtype_name, shape):
    dtype = _dtype(dtype_name)
    seed = [kernels.OPS.index(op), (FLOATS + INTS).index(dtype_name), *shape]
    rng = np.random.default_rng(seed)
    chunks = [_random(rng, dtype, shape) for _ in range(NCHUNKS)]
    originals = [c.copy() for c in chunks]

    got = _Backend(backend).reduce(chunks, op, dtype=dtype)

    assert got.dtype == dtype and got.shape == shape
    for chunk, original in zip(chunks, originals, strict=True):
        np.testing.assert_array_equal(chunk, original)
    if dtype.kind in "iu":
        np.testing.assert_array_equal(got, _int_oracle(chunks, op))
    else:
        _assert_float_close(got, chunks, op)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype_name", FLOATS)
def test_min_max_propagate_nan(backend, dtype_name):
    dtype = _dtype(dtype_name)
    a = np.array([np.nan, 1.0, 2.0, np.nan], dtype=dtype)
    b = np.array([1.0, np.nan, 0.0, np.nan], dtype=dtype)
    for op, last in (("min", 0.0), ("max", 2.0)):
        got = _Backend(backend).reduce([a, b], op, dtype=dtype).astype(np.float64)
        np.testing.assert_array_equal(got, [np.nan, np.nan, last, np.nan])


@pytest.mark.parametrize("backend", BACKENDS)
def test_integer_overflow_wraps(backend):
    cases = [
        ("sum", [100, 100], "int8", -56),
        ("sum", [200, 100], "uint8", 44),
        ("prod", [2**20, 2**20], "int32", 0),
        ("prod", [2**62, 3], "int64", -(2**62)),
        ("sum", [2**63 - 1, 1], "int64", -(2**63)),
    ]
    for op, values, dtype_name, want in cases:
        chunks = [np.array([v], dtype=dtype_name) for v in values]
        got = _Backend(backend).reduce(chunks, op, dtype=np.dtype(dtype_name))
        assert got[0] == want, (op, values, dtype_name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_integer_avg_floors(backend):
    be = _Backend(backend)
    acc, _ = be.put(np.array([-7, 7, -6, 0], dtype=np.int16))
    kernels.finalize(acc, "avg", 2, stream=be.stream)
    np.testing.assert_array_equal(be.get(acc, np.dtype(np.int16)), [-4, 3, -3, 0])
    # The count need not fit the dtype.
    acc, _ = be.put(np.array([-128, 127, 5, -1], dtype=np.int8))
    kernels.finalize(acc, "avg", 300, stream=be.stream)
    np.testing.assert_array_equal(be.get(acc, np.dtype(np.int8)), [-1, 0, 0, -1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
def test_finalize_leaves_other_ops_alone(backend, op):
    be = _Backend(backend)
    acc, _ = be.put(np.array([3.0, -1.5], dtype=np.float32))
    kernels.finalize(acc, op, 4, stream=be.stream)
    np.testing.assert_array_equal(be.get(acc, np.dtype(np.float32)), [3.0, -1.5])


def test_float_overflow_is_silent():
    acc = np.array([60000.0, -60000.0], dtype=np.float16)
    kernels.reduce_into(acc, acc.copy(), "sum")
    np.testing.assert_array_equal(acc, [np.inf, -np.inf])


@pytest.mark.parametrize("op", kernels.OPS)
def test_bfloat16_bits_in_uint16(op):
    bf16 = _dtype("bfloat16")
    rng = np.random.default_rng(7)
    chunks = [_random(rng, bf16, (33,)) for _ in range(3)]
    native = _Backend("numpy").reduce(chunks, op, dtype=bf16)
    acc = chunks[0].view(np.uint16).copy()
    for chunk in chunks[1:]:
        kernels.reduce_into(acc, chunk.view(np.uint16), op, dtype="bfloat16")
    kernels.finalize(acc, op, len(chunks), dtype="bfloat16")
    np.testing.assert_array_equal(acc, native.view(np.uint16))


@pytest.mark.parametrize(
    ("acc", "chunk", "expected", "got"),
    [
        (np.zeros(7, np.float32), np.zeros(8, np.float32), "shape (7,)", "shape (8,)"),
        (np.zeros(7, np.float32), np.zeros(7, np.int32), "dtype float32", "dtype int32"),
        (np.zeros((2, 3), np.int8), np.zeros(6, np.int8), "shape (2, 3)", "shape (6,)"),
    ],
)
def test_mismatched_chunk_is_rejected(acc, chunk, expected, got):
    with pytest.raises(InvalidArgument, match="expected") as info:
        kernels.reduce_into(acc, chunk, "sum")
    assert expected in str(info.value) and got in str(info.value)
    assert not acc.any()


def test_unknown_op_is_rejected():
    acc = np.zeros(3, np.float32)
    calls = [
        lambda: kernels.check_op("mean"),
        lambda: kernels.reduce_into(acc, acc.copy(), "mean"),
        lambda: kernels.finalize(acc, "mean", 2),
        lambda: cupy_ops.check_op(None),
    ]
    for call in calls:
        with pytest.raises(InvalidArgument) as info:
            call()
        assert all(op in str(info.value) for op in kernels.OPS)
    for op in kernels.OPS:
        kernels.check_op(op)


@pytest.mark.parametrize("count", [0, -1, 1.5, True, "2", None])
def test_bad_count_is_rejected(count):
    with pytest.raises(InvalidArgument, match="int >= 1"):
        kernels.finalize(np.zeros(3, np.float32), "avg", count)


@pytest.mark.parametrize("dtype", ["complex64", "bool", "uint16", "uint64", "float64"])
def test_unsupported_dtype_is_rejected(dtype):
    arr = np.zeros(3, dtype)
    describe = "float32" if dtype == "float64" else None
    with pytest.raises(InvalidArgument, match="dtype"):
        kernels.reduce_into(arr, arr.copy(), "sum", dtype=describe)


def test_non_arrays_and_read_only_are_rejected():
    acc = np.zeros(3, np.float32)
    with pytest.raises(InvalidArgument, match="numpy.ndarray"):
        kernels.reduce_into(acc, [0.0, 0.0, 0.0], "sum")
    frozen = acc.copy()
    frozen.flags.writeable = False
    with pytest.raises(InvalidArgument, match="read-only"):
        kernels.reduce_into(frozen, acc, "sum")
    with pytest.raises(InvalidArgument, match="read-only"):
        kernels.finalize(frozen, "avg", 2)


def test_cupy_ops_rejects_host_arrays():
    acc = np.zeros(3, np.float32)
    with pytest.raises(InvalidArgument, match="cupy.ndarray"):
        cupy_ops.reduce_into(acc, acc.copy(), "sum")
    with pytest.raises(InvalidArgument, match="cupy.ndarray"):
        cupy_ops.finalize(acc, "avg", 2)


def test_import_does_not_load_cupy():
    code = "import sys, hoplite_gpu.kernels; sys.exit('cupy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_backends_share_ops_and_dtypes():
    assert kernels.OPS == numpy_ops.OPS == cupy_ops.OPS == ("sum", "prod", "min", "max", "avg")
    assert kernels.DTYPES == cupy_ops.DTYPES


@pytest.mark.gpu
def test_mixed_host_and_device_is_rejected():
    import cupy

    host = np.zeros(3, np.float32)
    with pytest.raises(InvalidArgument, match="same device"):
        kernels.reduce_into(cupy.zeros(3, cupy.float32), host, "sum")
    with pytest.raises(InvalidArgument, match="same device"):
        kernels.reduce_into(host, cupy.zeros(3, cupy.float32), "sum")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "float64"])
@pytest.mark.parametrize("layout", ["aligned", "offset", "strided"])
def test_device_fold_on_any_alignment_and_stride(dtype, layout):
    """The 16-byte vector kernel takes aligned contiguous bytes and the elementwise
    kernel the rest (a tail, a misaligned or strided array): same result."""
    import cupy

    dt = _dtype(dtype)
    rng = np.random.default_rng(5)
    for n in (1, 15, 16, 17, 1000, 100_003):
        a, b = _random(rng, dt, (n + 8,)), _random(rng, dt, (n + 8,))
        if layout == "aligned":
            pick = slice(0, n)
        elif layout == "offset":
            pick = slice(1, n + 1)
        else:
            pick = slice(0, 2 * (n // 2 + 1), 2) if n + 8 >= 2 * (n // 2 + 1) else slice(0, n)
        for op in ("sum", "max"):
            acc = cupy.asarray(a.view(np.uint16) if dtype == "bfloat16" else a)[pick]
            chunk = cupy.asarray(b.view(np.uint16) if dtype == "bfloat16" else b)[pick]
            kernels.reduce_into(acc, chunk, op, dtype=dtype if dtype == "bfloat16" else None)
            want = a[pick].copy()
            numpy_ops.reduce_into(want, b[pick], op)
            got = cupy.asnumpy(acc)
            got = got.view(dt) if dtype == "bfloat16" else got
            np.testing.assert_array_equal(got, want, err_msg=f"{op} n={n}")
