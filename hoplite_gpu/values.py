"""Values to flat byte buffers plus a small Layout that lets a receiver rebuild them, and back."""

from __future__ import annotations

import ast
import functools
import hashlib
import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.format import descr_to_dtype

from .errors import InvalidArgument, ProtocolError, StoreFull, UnsupportedValue

KINDS = ("bytes", "numpy", "torch", "device")
ACCEPTED = (
    "put() takes a NumPy array, a torch tensor, a CuPy (or any CUDA) array, bytes or any "
    "DLPack/buffer-protocol object"
)
_WIRE_KEYS = frozenset({"kind", "dtype", "shape", "nbytes"})
_MAX_NDIM = 64  # numpy's own limit
_MAX_DTYPE_CHARS = 1 << 16  # a peer must not make us literal_eval megabytes
_TORCH_PREFIX = "torch."
_TORCH_ITEMSIZES = (1, 2, 4, 8, 16)
_DLPACK_CPU = 1


@dataclass(frozen=True)
class Layout:
    """What a flat byte buffer holds: the value's kind, encoded dtype, shape and size in bytes."""

    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def to_wire(self) -> dict:
        """This layout as a msgpack-able dict."""
        return {
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_wire(cls, d: dict) -> Layout:
        """Parse a dict made by `to_wire`; raise ProtocolError if it is malformed."""
        key = None
        if type(d) is dict and len(d) == 4:  # the same few layouts come again and again
            shape, nbytes = d.get("shape"), d.get("nbytes")
            if type(shape) is list and type(nbytes) is int and all(type(n) is int for n in shape):
                try:
                    key = (d.get("kind"), d.get("dtype"), nbytes, *shape)
                    known = _KNOWN_LAYOUTS.get(key)
                except TypeError:  # unhashable kind or dtype: refused below
                    key = known = None
                if known is not None:
                    return known
        if not isinstance(d, dict) or set(d) != _WIRE_KEYS:
            raise ProtocolError(
                f"a layout must be a dict with keys {sorted(_WIRE_KEYS)}; got {d!r:.200}"
            )
        layout = cls(d["kind"], d["dtype"], _wire_shape(d["shape"]), _wire_int(d["nbytes"]))
        _check_layout(layout)
        if key is not None:
            if len(_KNOWN_LAYOUTS) >= _MAX_KNOWN_LAYOUTS:
                _KNOWN_LAYOUTS.clear()
            _KNOWN_LAYOUTS[key] = layout
        return layout


#: Checked layouts by their wire fields (`Layout.from_wire`); only a dict of
#: a list of ints and an int is looked up here.
_KNOWN_LAYOUTS: dict[tuple, Layout] = {}
_MAX_KNOWN_LAYOUTS = 1024


@dataclass(frozen=True)
class Encoded:
    """A value already made a buffer and its layout (`encode`): `to_buffer`
    gives them back as they are. A call that sends a request about a value
    before it puts the value encodes it first, so that a value it cannot send
    is refused before anything is sent, and is made bytes only once."""

    buf: memoryview
    layout: Layout


def encode(value: Any) -> Any:
    """`value` as an `Encoded` (see there); raises what `to_buffer` raises. A
    device array is left as it is: its buffer is made on the node's loop
    thread, whose stream orders every device copy (`hoplite_gpu.device`)."""
    from . import device

    if isinstance(value, Encoded) or device.is_device_array(value):
        return value
    return Encoded(*to_buffer(value))


def to_buffer(value: Any) -> tuple[memoryview, Layout]:
    """Return a flat 1-D byte memoryview over `value` (zero copy when contiguous) and its Layout.

    Raises UnsupportedValue for anything that is not an array or a byte buffer,
    and StoreFull where the machine has no memory for a contiguous copy of a
    non-contiguous one.
    """
    # numpy first: np.bytes_ is a bytes subclass but must come back as a 0-d array
    if isinstance(value, np.ndarray | np.generic):
        return _numpy_to_buffer(value)
    if isinstance(value, Encoded):
        return value.buf, value.layout
    if isinstance(value, bytes | bytearray | memoryview):
        flat = _flat_bytes(value)
        return flat, Layout("bytes", "uint8", (flat.nbytes,), flat.nbytes)
    if _is_torch_tensor(value) and not getattr(value, "is_cuda", False):
        return _torch_to_buffer(value)
    # device arrays also have __dlpack__, so this check must come before the DLPack one
    from . import device

    if device.is_device_array(value):
        buf, code, shape = device.to_device_buffer(value)
        return buf, Layout("device", code, shape, int(buf.nbytes))
    if hasattr(value, "__dlpack__"):
        return _numpy_to_buffer(_from_dlpack(value))
    try:
        view = memoryview(value)
    except (TypeError, ValueError, BufferError):  # (ValueError: released, or closed)
        raise UnsupportedValue(_unsupported_message(value)) from None
    return _buffer_protocol_to_buffer(view)


def host_nbytes(value: Any) -> int | None:
    """How many bytes `value` puts in host memory, read from its metadata
    alone (no copy, no conversion): NumPy arrays and scalars, byte buffers
    and CPU torch tensors; None for anything else (a device array, an object
    that only exports a buffer), whose size `to_buffer` learns."""
    if isinstance(value, np.ndarray | np.generic):
        return int(value.nbytes)
    if isinstance(value, bytes | bytearray):
        return len(value)
    if isinstance(value, memoryview):
        try:
            return value.nbytes
        except ValueError:  # (released: `to_buffer` says so)
            return None
    if _is_torch_tensor(value) and getattr(value, "device", None) is not None \
            and value.device.type == "cpu":
        return int(value.numel() * value.element_size())
    return None


def from_buffer(buf: Any, layout: Layout, array_type: str = "cupy") -> object:
    """Rebuild the value described by `layout` from `buf`, a flat buffer of layout.nbytes bytes.

    "numpy" gives a read-only zero-copy view of `buf`; "bytes" and "torch" give fresh copies;
    "device" gives a fresh array of `array_type` ("cupy", "torch" or "numpy"; NumPy where
    this process has no GPU).
    """
    if layout.kind == "device":
        from . import device

        if int(buf.nbytes) != layout.nbytes:
            raise InvalidArgument(
                f"the buffer holds {buf.nbytes} bytes but the layout needs {layout.nbytes}")
        return device.materialize(buf, _wire_numpy_dtype(layout.dtype), layout.shape, array_type)
    if type(buf) is bytes and layout.kind == "numpy" and len(buf) == layout.nbytes:
        # (an inline reply's bytes: immutable, so the array is read-only by itself)
        return np.ndarray(layout.shape, dtype=_wire_numpy_dtype(layout.dtype), buffer=buf)
    view = memoryview(buf)
    if view.nbytes != layout.nbytes:
        raise InvalidArgument(
            f"the buffer holds {view.nbytes} bytes but the layout needs {layout.nbytes}"
        )
    if layout.kind == "bytes":
        return view.tobytes()
    if layout.kind == "numpy":
        arr = np.ndarray(layout.shape, dtype=_wire_numpy_dtype(layout.dtype), buffer=view)
        # the buffer belongs to the object store and may be shared with other readers
        arr.flags.writeable = False
        return arr
    if layout.kind == "torch":
        return _torch_from_buffer(view, layout)
    raise InvalidArgument(f"layout kind must be one of {KINDS}; got {layout.kind!r}")


def numpy_dtype(layout: Layout) -> np.dtype:
    """The element type of a NumPy or device layout (for reductions over its raw bytes)."""
    if layout.kind not in ("numpy", "device"):
        raise UnsupportedValue(
            f"reduce works on NumPy and device arrays; this object is of kind {layout.kind!r}")
    return _wire_numpy_dtype(layout.dtype)


def empty_buffer(nbytes: int) -> np.ndarray:
    """Return an uninitialised uint8 array of `nbytes` bytes to receive into."""
    return np.empty(nbytes, dtype=np.uint8)


# --- bytes and the buffer protocol ---


def _flat_bytes(value: Any) -> memoryview:
    try:
        view = memoryview(value)
    except (ValueError, BufferError):  # a released memoryview
        raise UnsupportedValue(_unsupported_message(value)) from None
    if not view.c_contiguous:
        return memoryview(_copied(view.tobytes, view.nbytes))
    if view.ndim == 1 and view.format == "B":
        return view
    # memoryview.cast only accepts native single-char formats; frombuffer takes any
    return memoryview(np.frombuffer(view, dtype=np.uint8))


def _buffer_protocol_to_buffer(view: memoryview) -> tuple[memoryview, Layout]:
    try:
        arr = np.asarray(view)
    except (TypeError, ValueError):
        arr = None
    if arr is None or arr.dtype.hasobject:
        flat = _flat_bytes(view)
        return flat, Layout("bytes", "uint8", (flat.nbytes,), flat.nbytes)
    return _numpy_to_buffer(arr)


# --- numpy ---


def is_masked(value: Any) -> bool:
    """`value` is a NumPy masked array. `np.ma` is imported on its first
    use (NumPy 2), which cost 10-18 ms of CPU in each process's first
    allreduce; a masked array cannot exist before `numpy.ma` is imported, so
    it is looked up, never imported, here."""
    ma = sys.modules.get("numpy.ma")
    return ma is not None and isinstance(value, ma.MaskedArray)


def _numpy_to_buffer(value: np.ndarray | np.generic) -> tuple[memoryview, Layout]:
    if type(value) is np.ndarray and value.flags.c_contiguous and value.dtype.itemsize:
        # the common case, in few calls (a small put's every call counts)
        layout = _numpy_layout(_numpy_dtype_code(value.dtype), value.shape, value.nbytes)
        return memoryview(value.reshape(-1).view(np.uint8)), layout
    if is_masked(value):
        raise UnsupportedValue(
            "got a NumPy masked array; its mask would be lost. Send arr.filled(...) "
            "or the data and the mask as two objects"
        )
    arr = np.asarray(value)
    code = _numpy_dtype_code(arr.dtype)
    if not arr.flags.c_contiguous:
        arr = _copied(lambda: arr.copy(order="C"), arr.nbytes)
    if arr.dtype.itemsize == 0:
        flat = np.empty(0, dtype=np.uint8)  # view(uint8) cannot divide by a zero itemsize
    else:
        flat = arr.reshape(-1).view(np.uint8)
    return memoryview(flat), _numpy_layout(code, tuple(arr.shape), arr.nbytes)


def _copied(copy: Any, nbytes: int) -> Any:
    """`copy()`, the contiguous copy of a value that has none; StoreFull,
    not NumPy's own error, if the machine has no memory for it."""
    try:
        return copy()
    except MemoryError:
        raise StoreFull(f"no memory for a contiguous copy of {nbytes} bytes; pass a "
                        "contiguous array (its memory is sent as it is)") from None


@functools.lru_cache(maxsize=256)
def _numpy_layout(code: str, shape: tuple[int, ...], nbytes: int) -> Layout:
    return Layout("numpy", code, shape, nbytes)


@functools.lru_cache(maxsize=256)
def _numpy_dtype_code(dtype: np.dtype) -> str:
    if dtype.hasobject:
        raise UnsupportedValue(
            f"got a NumPy array of dtype {dtype}; it holds pointers to Python objects, not "
            "data. Convert it first, e.g. arr.astype(float) or arr.astype('U')"
        )
    code = ""
    try:
        if dtype.names is not None:
            # (fields out of offset order or overlapping have no descr: refused)
            code = repr(dtype.descr)
        elif dtype.type.__module__ == "ml_dtypes":
            code = dtype.name  # their dtype.str is an anonymous void like '<V2'
        else:
            code = dtype.str
        same = _parse_numpy_dtype(code) == dtype
    except (TypeError, ValueError, SyntaxError):
        same = False
    if not same:
        raise UnsupportedValue(
            f"got a NumPy array of dtype {dtype!r}, which cannot be described to a peer. "
            "Convert it to a built-in or ml_dtypes dtype first"
        )
    return code


@functools.lru_cache(maxsize=256)
def _parse_numpy_dtype(code: str) -> np.dtype:
    if code.startswith("["):
        # the .npy format's way to write structured dtypes, padding and titles included
        return descr_to_dtype(ast.literal_eval(code))
    try:
        return np.dtype(code)
    except TypeError:
        pass
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError(f"dtype {code!r} needs ml_dtypes: pip install ml_dtypes") from None
    scalar = getattr(ml_dtypes, code, None)
    if isinstance(scalar, type) and issubclass(scalar, np.generic):
        return np.dtype(scalar)
    raise TypeError(f"unknown dtype {code!r}")


@functools.lru_cache(maxsize=256)
def _wire_numpy_dtype(code: str) -> np.dtype:
    try:
        dtype = _parse_numpy_dtype(code)
        canonical = _numpy_dtype_code(dtype) == code
    except (TypeError, ValueError, SyntaxError, MemoryError, RecursionError) as exc:
        raise ProtocolError(
            f"layout dtype {code!r:.200} is not a dtype we can rebuild: {exc}"
        ) from exc
    if not canonical:
        raise ProtocolError(f"layout dtype {code!r:.200} is not in canonical form")
    return dtype


def _from_dlpack(value: Any) -> np.ndarray:
    try:
        device = getattr(value, "__dlpack_device__", lambda: (_DLPACK_CPU, 0))()
    except Exception as exc:  # (an exporter whose array is gone, ...)
        raise UnsupportedValue(
            f"cannot ask {_type_name(value)} which device its DLPack data is on: {exc}"
        ) from exc
    if int(device[0]) != _DLPACK_CPU:
        # (CUDA and CUDA-managed memory reach here only where no GPU is usable)
        why = ("this node has no usable CUDA device" if int(device[0]) in (2, 13) else
               "only CPU memory, and CUDA memory on a node with a GPU, can be put")
        raise UnsupportedValue(
            f"got a DLPack object ({_type_name(value)}) on device {tuple(device)}; {why}. "
            "Copy it to host memory first"
        )
    try:
        return np.from_dlpack(value)
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        raise UnsupportedValue(
            f"NumPy could not import {_type_name(value)} through DLPack: {exc}"
        ) from exc


# --- torch (imported only once a torch value or layout shows up) ---


def _is_torch_tensor(value: Any) -> bool:
    if not type(value).__module__.startswith("torch"):
        return False  # (so torch is imported only once a torch value shows up)
    import torch

    return isinstance(value, torch.Tensor)


def _torch_to_buffer(tensor: Any) -> tuple[memoryview, Layout]:
    import torch

    if tensor.device.type != "cpu":
        raise UnsupportedValue(
            f"got a torch tensor on device {tensor.device}; only CPU tensors, and CUDA "
            "tensors on a node with a GPU, can be put. Move it first: tensor.cpu()"
        )
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
        kind = ("quantized" if tensor.is_quantized else "nested" if tensor.is_nested
                else tensor.layout)
        raise UnsupportedValue(
            f"got a {kind} torch tensor; only dense tensors are supported. Convert it first: "
            "tensor.to_dense(), .dequantize() or, for a nested one, .to_padded_tensor(0)"
        )
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        # (e.g. a MaskedTensor: its bytes alone would drop the mask)
        raise UnsupportedValue(
            f"got a {_type_name(tensor)}, a torch tensor subclass whose bytes may not be all of "
            "its value; convert it to a plain tensor first"
        )
    try:
        # conj/neg bits are lazy flags; resolve them so the bytes hold the values the user sees
        tensor = tensor.detach().resolve_conj().resolve_neg().contiguous()
        # torch calls a one-element tensor contiguous whatever its stride, but view(uint8) needs 1
        flat = tensor.reshape(-1).as_strided((tensor.numel(),), (1,))
        # reinterpret, since dtypes like bfloat16 have no numpy equivalent
        flat = flat.view(torch.uint8).numpy()
    except (RuntimeError, TypeError) as exc:
        raise UnsupportedValue(f"cannot take the bytes of a {tensor.dtype} tensor: {exc}") from exc
    return memoryview(flat), Layout("torch", str(tensor.dtype), tuple(tensor.shape), flat.nbytes)


def _torch_from_buffer(view: memoryview, layout: Layout) -> Any:
    try:
        import torch
    except ImportError:
        raise UnsupportedValue(
            "received a torch tensor but torch is not installed here: pip install torch"
        ) from None
    dtype = getattr(torch, layout.dtype.removeprefix(_TORCH_PREFIX), None)
    if not layout.dtype.startswith(_TORCH_PREFIX) or not isinstance(dtype, torch.dtype):
        raise ProtocolError(f"layout dtype {layout.dtype!r:.200} is not a torch dtype")
    if layout.nbytes == 0:
        return torch.empty(layout.shape, dtype=dtype)
    # a writable copy: torch.from_numpy warns on read-only arrays, and torch users expect to write
    raw = torch.from_numpy(np.frombuffer(view, dtype=np.uint8).copy())
    try:
        return raw.view(dtype).reshape(layout.shape)
    except RuntimeError as exc:
        raise ProtocolError(f"layout {layout} does not match its {layout.nbytes} bytes") from exc


# --- wire checks ---

_MAX_INDEX = int(np.iinfo(np.intp).max)


def _wire_int(value: Any) -> int:
    # bool is an int subclass, but True is never a valid size
    if type(value) is not int or value < 0:
        raise ProtocolError(f"expected a non-negative int in the layout; got {value!r:.200}")
    return value


def _wire_shape(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or len(value) > _MAX_NDIM:
        raise ProtocolError(
            f"layout shape must be a list of at most {_MAX_NDIM} ints; got {value!r:.200}"
        )
    shape = tuple(_wire_int(dim) for dim in value)
    # No array can have more elements than an index can count, even with a zero
    # dimension beside them (NumPy refuses the shape; it would fail only there).
    if math.prod(d for d in shape if d) > _MAX_INDEX:
        raise ProtocolError(f"layout shape {value!r:.200} has more elements than an array can")
    return shape


def _check_layout(layout: Layout) -> None:
    if layout.kind not in KINDS:
        raise ProtocolError(f"layout kind must be one of {KINDS}; got {layout.kind!r:.200}")
    if not isinstance(layout.dtype, str) or len(layout.dtype) > _MAX_DTYPE_CHARS:
        raise ProtocolError(f"layout dtype must be a short str; got {layout.dtype!r:.200}")
    count = math.prod(layout.shape)
    if layout.kind == "bytes":
        ok = layout.dtype == "uint8" and layout.shape == (layout.nbytes,)
    elif layout.kind in ("numpy", "device"):
        ok = layout.nbytes == count * _wire_numpy_dtype(layout.dtype).itemsize
    else:
        ok = layout.dtype.startswith(_TORCH_PREFIX) and _torch_size_ok(count, layout.nbytes)
    if not ok:
        raise ProtocolError(
            f"layout {layout!r:.300} is inconsistent: nbytes must be the item count of its shape "
            "times its dtype's item size (and a 'bytes' layout has dtype 'uint8', shape (nbytes,))"
        )


def _torch_size_ok(count: int, nbytes: int) -> bool:
    # torch is optional here, so check only what holds for every torch dtype
    if count == 0:
        return nbytes == 0
    return nbytes % count == 0 and nbytes // count in _TORCH_ITEMSIZES


# --- messages ---


def _type_name(value: Any) -> str:
    cls = type(value)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _unsupported_message(value: Any) -> str:
    hint = "value.encode()" if isinstance(value, str) else "numpy.asarray(...)"
    return f"{ACCEPTED}; got {_type_name(value)}. Convert it first, e.g. {hint}"


#: bytes sampled by `fingerprint` at each of the start, the middle and the end
_SAMPLE = 4096


def fingerprint(buf: Any) -> bytes:
    """8 bytes that tell two host values of one size apart in practice: a
    hash of the size and of 4 KiB at the start, the middle and the end (a few
    microseconds at any size). The directory compares a put's with the first
    put's of the id, so a second put of other bytes under an id is refused
    instead of handing readers a mix; equal fingerprints do not prove equal
    bytes."""
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    n = len(view)
    digest = hashlib.blake2b(n.to_bytes(8, "big"), digest_size=8, person=b"hoplite-put")
    for start, stop in fingerprint_windows(n):
        digest.update(view[start:stop])
    return digest.digest()


def fingerprint_windows(nbytes: int) -> list[tuple[int, int]]:
    """The byte ranges of a value of `nbytes` that `fingerprint` reads: a put
    that fills its object after registering it has these bytes in first."""
    starts = sorted({0, max(0, nbytes // 2 - _SAMPLE // 2), max(0, nbytes - _SAMPLE)})
    return [(start, min(nbytes, start + _SAMPLE)) for start in starts]
