"""Chunk reduction kernels: fold each arriving chunk into an accumulator, in place.

NumPy arrays are reduced on the CPU (`numpy_ops`), CuPy arrays by CUDA kernels on
their own GPU (`cupy_ops`); the choice is made by array type, without importing CuPy.
"""

from __future__ import annotations

from typing import Any

from hoplite_gpu.errors import InvalidArgument
from hoplite_gpu.kernels import cupy_ops, numpy_ops
from hoplite_gpu.kernels.numpy_ops import DTYPES, OPS, check_op

__all__ = ["DTYPES", "OPS", "check_op", "finalize", "reduce_into"]


def _on_gpu(arr: Any) -> bool:
    return type(arr).__module__.startswith("cupy")


def reduce_into(
    acc: Any, chunk: Any, op: str, *, stream: Any = None, dtype: str | None = None
) -> None:
    """Fold `chunk` into `acc` in place: acc = acc OP chunk, for op in OPS.

    Both must have the same shape and dtype (else InvalidArgument). "avg" adds here and
    divides in `finalize`. Integers wrap on overflow. `stream` orders a CuPy reduction on
    that CUDA stream (ignored for NumPy); `dtype="bfloat16"` reads uint16 arrays as
    bfloat16 bits, for CuPy versions without a bfloat16 dtype.
    """
    gpu = _on_gpu(acc)
    if _on_gpu(chunk) != gpu:
        raise InvalidArgument(
            f"the accumulator is a {type(acc).__module__}.{type(acc).__name__} but the chunk "
            f"a {type(chunk).__module__}.{type(chunk).__name__}; move both to the same device"
        )
    if gpu:
        cupy_ops.reduce_into(acc, chunk, op, stream=stream, dtype=dtype)
    else:
        numpy_ops.reduce_into(acc, chunk, op, dtype=dtype)


def finalize(
    acc: Any, op: str, count: int, *, stream: Any = None, dtype: str | None = None
) -> None:
    """Finish a reduce of `count` inputs in place: "avg" divides by `count`; other ops
    leave `acc` as it is.

    Floats divide in float64 and round once to the dtype; integers floor-divide
    (toward -inf, like numpy's //) the sum as accumulated, wrapped, in the dtype.
    """
    if _on_gpu(acc):
        cupy_ops.finalize(acc, op, count, stream=stream, dtype=dtype)
    else:
        numpy_ops.finalize(acc, op, count, dtype=dtype)
