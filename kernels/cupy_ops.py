"""Chunk reduction on the GPU: CuPy elementwise kernels, the twins of `numpy_ops`.

CuPy is imported on first use only, so this module imports where CuPy is absent. The
kernels are named module-level specs; each becomes a `cupy.ElementwiseKernel` the first
time it is used, and CuPy compiles that once per device and dtype.

Precision: float16 folds in float16 (each step rounds, as NumPy does). bfloat16 runs on
the raw bits viewed as uint16, converting to float32 around each step and rounding to
nearest-even back to bfloat16, which is what ml_dtypes does on the CPU; it needs no
bfloat16 support from CuPy or cuda_bf16.h.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hoplite_gpu.errors import InvalidArgument
from hoplite_gpu.kernels.numpy_ops import (
    DTYPES,
    OPS,
    check_count,
    check_op,
    check_pair,
    element_type,
)

if TYPE_CHECKING:
    import cupy

__all__ = ["DTYPES", "OPS", "check_op", "finalize", "reduce_into"]


@dataclass(frozen=True)
class _Kernel:
    name: str
    in_params: str
    out_params: str
    body: str
    preamble: str = ""


# Casting through unsigned long long makes integer overflow wrap by definition rather
# than by luck (signed overflow is undefined in C++); the low bits are the same.
_SUM_INT = _Kernel(
    "hoplite_sum_int",
    "T x",
    "T acc",
    "acc = (T)((unsigned long long)acc + (unsigned long long)x)",
)
_PROD_INT = _Kernel(
    "hoplite_prod_int",
    "T x",
    "T acc",
    "acc = (T)((unsigned long long)acc * (unsigned long long)x)",
)
_MIN_INT = _Kernel("hoplite_min_int", "T x", "T acc", "acc = x < acc ? x : acc")
_MAX_INT = _Kernel("hoplite_max_int", "T x", "T acc", "acc = acc < x ? x : acc")

_SUM_FLOAT = _Kernel("hoplite_sum_float", "T x", "T acc", "acc = acc + x")
_PROD_FLOAT = _Kernel("hoplite_prod_float", "T x", "T acc", "acc = acc * x")
# `x != x` makes a NaN in either input win, as np.minimum/np.maximum do.
_MIN_FLOAT = _Kernel("hoplite_min_float", "T x", "T acc", "acc = (x < acc || x != x) ? x : acc")
_MAX_FLOAT = _Kernel("hoplite_max_float", "T x", "T acc", "acc = (acc < x || x != x) ? x : acc")

_BF16 = r"""
__device__ __forceinline__ float hoplite_bf16_load(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}
__device__ __forceinline__ unsigned short hoplite_bf16_store(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x0040u);  // keep NaN a (quiet) NaN
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return (unsigned short)(u >> 16);
}
"""


def _bf16(name: str, body: str) -> _Kernel:
    prologue = "float a = hoplite_bf16_load(acc); float b = hoplite_bf16_load(x); "
    return _Kernel(name, "uint16 x", "uint16 acc", prologue + body, _BF16)


_SUM_BF16 = _bf16("hoplite_sum_bf16", "acc = hoplite_bf16_store(a + b)")
_PROD_BF16 = _bf16("hoplite_prod_bf16", "acc = hoplite_bf16_store(a * b)")
_MIN_BF16 = _bf16("hoplite_min_bf16", "acc = (b < a || b != b) ? x : acc")
_MAX_BF16 = _bf16("hoplite_max_bf16", "acc = (a < b || b != b) ? x : acc")

_AVG_INT = _Kernel(
    "hoplite_avg_int",
    "int64 c",
    "T acc",
    # C++ division truncates; step down once more for a negative inexact quotient to floor.
    "long long v = (long long)acc; long long q = v / c; "
    "if (v % c != 0 && v < 0) { q -= 1; } acc = (T)q",
)
_AVG_FLOAT = _Kernel("hoplite_avg_float", "float64 c", "T acc", "acc = (T)((double)acc / c)")
# float16's conversions go through float; naming it avoids an ambiguous double overload.
_AVG_HALF = _Kernel(
    "hoplite_avg_half", "float64 c", "T acc", "acc = (T)(float)((double)(float)acc / c)"
)
_AVG_BF16 = _Kernel(
    "hoplite_avg_bf16",
    "float64 c",
    "uint16 acc",
    "acc = hoplite_bf16_store((float)((double)hoplite_bf16_load(acc) / c))",
    _BF16,
)

_FOLD = {
    "int": {"sum": _SUM_INT, "prod": _PROD_INT, "min": _MIN_INT, "max": _MAX_INT},
    "float": {"sum": _SUM_FLOAT, "prod": _PROD_FLOAT, "min": _MIN_FLOAT, "max": _MAX_FLOAT},
    "bf16": {"sum": _SUM_BF16, "prod": _PROD_BF16, "min": _MIN_BF16, "max": _MAX_BF16},
}
_AVG = {"int": _AVG_INT, "float": _AVG_FLOAT, "half": _AVG_HALF, "bf16": _AVG_BF16}


def _family(kind: str) -> str:
    if kind == "bfloat16":
        return "bf16"
    if kind == "float16":
        return "half"
    return "float" if kind.startswith("float") else "int"


@functools.cache
def _compiled(spec: _Kernel) -> Any:
    import cupy

    return cupy.ElementwiseKernel(
        spec.in_params,
        spec.out_params,
        spec.body,
        spec.name,
        preamble=spec.preamble,
        no_return=True,
    )


#: C types for the 16-byte vector path (float16 stays on the elementwise path,
#: whose CuPy float16 type carries the arithmetic).
_CTYPES = {"float32": "float", "float64": "double", "int8": "signed char", "int16": "short",
           "int32": "int", "int64": "long long", "uint8": "unsigned char",
           "bfloat16": "unsigned short"}
_VEC_BYTES = 16
_VEC_THREADS = 256

_VEC_SOURCE = r"""
{preamble}
typedef {ctype} T;
extern "C" __global__ void {name}(const uint4* __restrict__ xs, uint4* __restrict__ accs,
                                  unsigned long long nvec) {{
    unsigned long long v = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (v >= nvec) return;
    uint4 xv = xs[v];
    uint4 av = accs[v];
    const T* xp = reinterpret_cast<const T*>(&xv);
    T* ap = reinterpret_cast<T*>(&av);
    #pragma unroll
    for (int k = 0; k < (int)(16 / sizeof(T)); ++k) {{
        T x = xp[k];
        T acc = ap[k];
        {body};
        ap[k] = acc;
    }}
    accs[v] = av;
}}
"""


@functools.cache
def _vector_kernel(spec: _Kernel, kind: str) -> Any:
    """`spec`'s fold as a kernel that moves 16 bytes per thread per array: the
    elementwise kernel's 2-4 byte accesses left about a fifth of the H100's
    copy bandwidth unused (benchmarks/README, "GPU")."""
    import cupy

    name = f"{spec.name}_{kind}_v16"
    return cupy.RawKernel(_VEC_SOURCE.format(preamble=spec.preamble, ctype=_CTYPES[kind],
                                             name=name, body=spec.body), name)


def _vector_split(acc: Any, chunk: Any) -> int:
    """How many leading bytes of acc and chunk the vector kernel can take: both
    contiguous and 16-byte aligned, whole vectors only; 0 when it cannot."""
    if not (acc.flags.c_contiguous and chunk.flags.c_contiguous):
        return 0
    if acc.data.ptr % _VEC_BYTES or chunk.data.ptr % _VEC_BYTES:
        return 0
    return acc.nbytes - acc.nbytes % _VEC_BYTES


def _device_array(arr: Any, role: str) -> None:
    if not type(arr).__module__.startswith("cupy"):
        raise InvalidArgument(
            f"expected the {role} as a cupy.ndarray, got {type(arr).__name__}; "
            "hoplite_gpu.kernels.reduce_into picks the backend by array type"
        )


def _checked(acc: Any, chunk: Any | None, op: str, dtype: str | None) -> str:
    check_op(op)
    _device_array(acc, "accumulator")
    if chunk is not None:
        _device_array(chunk, "chunk")
        check_pair(acc, chunk)
        if acc.device.id != chunk.device.id:
            raise InvalidArgument(
                f"chunk is on GPU {chunk.device.id} but the accumulator on GPU "
                f"{acc.device.id}; copy the chunk to the accumulator's device first"
            )
    return element_type(acc, dtype)


@contextlib.contextmanager
def _on(device: Any, stream: Any) -> Any:
    """Launch on `device`, queued on `stream` (the current stream if None)."""
    with contextlib.ExitStack() as scope:
        scope.enter_context(device)
        if stream is not None:
            scope.enter_context(stream)
        yield


def _launch(spec: _Kernel, args: tuple[Any, ...], device: Any, stream: Any) -> None:
    with _on(device, stream):
        _compiled(spec)(*args)


def reduce_into(
    acc: cupy.ndarray,
    chunk: cupy.ndarray,
    op: str,
    *,
    stream: Any = None,
    dtype: str | None = None,
) -> None:
    """Fold `chunk` into `acc` in place on acc's GPU, like `numpy_ops.reduce_into`.

    `stream` (a cupy.cuda.Stream) orders the kernel after work already queued on it;
    by default it runs on the current stream. The call returns before the kernel ends.
    """
    kind = _checked(acc, chunk, op, dtype)
    family = _family(kind)
    spec = _FOLD["float" if family == "half" else family]["sum" if op == "avg" else op]
    if family == "bf16":
        acc, chunk = acc.view("uint16"), chunk.view("uint16")
    split = _vector_split(acc, chunk) if kind in _CTYPES else 0
    if split:
        nvec = split // _VEC_BYTES
        blocks = (nvec + _VEC_THREADS - 1) // _VEC_THREADS
        with _on(acc.device, stream):
            _vector_kernel(spec, kind)((blocks,), (_VEC_THREADS,), (chunk, acc, np.uint64(nvec)))
        if split == acc.nbytes:
            return
        done = split // acc.itemsize  # the tail, shorter than one vector
        acc, chunk = acc.reshape(-1)[done:], chunk.reshape(-1)[done:]
    _launch(spec, (chunk, acc), acc.device, stream)


def finalize(
    acc: cupy.ndarray,
    op: str,
    count: int,
    *,
    stream: Any = None,
    dtype: str | None = None,
) -> None:
    """Finish a reduce of `count` inputs in place, like `numpy_ops.finalize`
    (floats: acc / count via float64; integers: floor division)."""
    kind = _checked(acc, None, op, dtype)
    check_count(count)
    if op != "avg":
        return
    family = _family(kind)
    if family == "bf16":
        acc = acc.view("uint16")
    divisor = int(count) if family == "int" else float(count)
    _launch(_AVG[family], (divisor, acc), acc.device, stream)
