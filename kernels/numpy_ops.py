"""Chunk reduction on the CPU with NumPy ufuncs; also the oracle the CuPy twins are tested against.

The argument checks live here too, so that `cupy_ops` (which imports this module) rejects
exactly what this one rejects.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hoplite_gpu.errors import InvalidArgument

OPS = ("sum", "prod", "min", "max", "avg")
DTYPES = (
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
)

# "avg" folds as a sum; `finalize` divides once all inputs are in.
_UFUNCS = {
    "sum": np.add,
    "prod": np.multiply,
    "min": np.minimum,
    "max": np.maximum,
    "avg": np.add,
}


def check_op(op: Any) -> None:
    """Raise InvalidArgument unless `op` is one of OPS."""
    if not isinstance(op, str) or op not in OPS:
        raise InvalidArgument(f"unknown reduce op {op!r}; expected one of {', '.join(OPS)}")


def check_count(count: Any) -> None:
    """Raise InvalidArgument unless `count` (the number of reduced inputs) is an int >= 1."""
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        raise InvalidArgument(
            f"finalize expected the number of reduced inputs as an int >= 1, got {count!r}"
        )


def check_pair(acc: Any, chunk: Any) -> None:
    """Raise InvalidArgument unless `chunk` has the accumulator's shape and dtype."""
    if acc.shape != chunk.shape or acc.dtype != chunk.dtype:
        raise InvalidArgument(
            f"chunk does not match the accumulator: expected shape {tuple(acc.shape)} "
            f"dtype {acc.dtype}, got shape {tuple(chunk.shape)} dtype {chunk.dtype}; "
            "every input of a reduce must have the same shape and dtype"
        )


def element_type(arr: Any, dtype: str | None) -> str:
    """Name of the element type `arr` holds: its own dtype, or `dtype` when that is
    "bfloat16" over a 2-byte integer array (CuPy < 14 has no bfloat16 dtype)."""
    own = arr.dtype
    if dtype is None or dtype == own.name:
        if own.name not in DTYPES:
            raise InvalidArgument(
                f"cannot reduce dtype {own}; supported dtypes are {', '.join(DTYPES)}"
            )
        return own.name
    if dtype == "bfloat16" and own.kind in "iu" and own.itemsize == 2:
        return "bfloat16"
    raise InvalidArgument(
        f"dtype={dtype!r} does not describe an array of dtype {own}; pass None, the array's "
        "own dtype name, or 'bfloat16' for bfloat16 bits held in a uint16/int16 array"
    )


def _ndarray(arr: Any, role: str) -> np.ndarray:
    if not isinstance(arr, np.ndarray):
        raise InvalidArgument(f"expected the {role} as a numpy.ndarray, got {type(arr).__name__}")
    return arr


def _writable(acc: np.ndarray) -> None:
    if not acc.flags.writeable:
        raise InvalidArgument("the accumulator is read-only; reduce into a writable copy")


def _as_bfloat16(arr: np.ndarray) -> np.ndarray:
    try:
        import ml_dtypes
    except ImportError as exc:
        raise InvalidArgument(
            "bfloat16 on the CPU needs the ml_dtypes package; pip install ml_dtypes"
        ) from exc
    return arr.view(ml_dtypes.bfloat16)


def _typed(arr: np.ndarray, kind: str) -> np.ndarray:
    if kind == "bfloat16" and arr.dtype.name != "bfloat16":
        return _as_bfloat16(arr)
    return arr


def reduce_into(acc: np.ndarray, chunk: np.ndarray, op: str, *, dtype: str | None = None) -> None:
    """Fold `chunk` into `acc` in place: acc = acc OP chunk ("avg" adds; see `finalize`).

    Integers wrap on overflow; floats overflow to inf silently, as on the GPU.
    """
    check_op(op)
    _ndarray(acc, "accumulator")
    _ndarray(chunk, "chunk")
    check_pair(acc, chunk)
    kind = element_type(acc, dtype)
    _writable(acc)
    acc, chunk = _typed(acc, kind), _typed(chunk, kind)
    # A background reduce has nobody to warn; inf/nan in the result say it all.
    with np.errstate(all="ignore"):
        _UFUNCS[op](acc, chunk, out=acc)


def finalize(acc: np.ndarray, op: str, count: int, *, dtype: str | None = None) -> None:
    """Finish a reduce of `count` inputs in place: for "avg" divide by `count`, else nothing.

    Floats: acc / count, computed in float64 and rounded once to the dtype.
    Integers: floor division, acc // count (rounds toward -inf, like numpy's //),
    applied to the sum as accumulated in the dtype (so an overflowed sum has wrapped).
    """
    check_op(op)
    check_count(count)
    _ndarray(acc, "accumulator")
    kind = element_type(acc, dtype)
    if op != "avg":
        return
    _writable(acc)
    acc = _typed(acc, kind)
    # int64/float64 divisors: `count` may not fit the dtype (300 inputs of int8), and a
    # float16 count would round above 2048.
    if acc.dtype.kind in "iu":
        np.floor_divide(acc, np.int64(count), out=acc, casting="unsafe")
    else:
        np.true_divide(acc, np.float64(count), out=acc, casting="same_kind")
