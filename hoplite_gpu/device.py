"""Device (GPU) objects: everything that touches CuPy lives here.

A put of a device array (CuPy, torch CUDA, anything with
``__cuda_array_interface__`` or a CUDA DLPack capsule) is stored **in device
memory** with a layout of kind ``"device"``. Nodes that have a GPU keep such
objects on their GPU, receive their chunks straight into device memory (UCX) or
through pinned host buffers (TCP), and reduce them with the CuPy kernels on
each arriving chunk. A node without a GPU keeps them in host memory and hands
out NumPy arrays, so a CPU-only consumer still works.

Lifetime rule: ``put`` **copies** a device array (a device-to-device copy,
stream-ordered after the work that produced it), so the caller may reuse or
free its array as soon as put returns. ``get`` returns a **fresh** device array
that the caller owns: writing to it never changes what peers receive.

Stream order: every copy and kernel here runs on CuPy's current stream of the
node's loop thread. Bytes are marked ready (the chunk watermark) only after
work is queued on that stream, and everything that hands device memory to
something outside that stream (UCX, a host copy) synchronises it first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import InvalidArgument, StoreFull, UnsupportedValue

_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged
#: What `get` may return for a device object.
AS_CHOICES = ("cupy", "torch", "numpy")

_cupy: Any = None


def cupy() -> Any:
    global _cupy
    if _cupy is None:
        try:
            import cupy as cp  # noqa: PLC0415 - optional
        except ImportError as exc:
            raise UnsupportedValue(
                "got a device array, and device arrays need CuPy: "
                "pip install 'hoplite-gpu[gpu]'") from exc
        _cupy = cp
    return _cupy


def is_device_array(value: Any) -> bool:
    """A GPU array of any library (checked without importing CuPy or torch)."""
    if type(value) is np.ndarray:  # the common case, answered in one check
        return False
    if hasattr(value, "__cuda_array_interface__"):
        return True
    if type(value).__module__.startswith("torch") and getattr(value, "is_cuda", False):
        return True
    dev = getattr(value, "__dlpack_device__", None)
    if dev is not None and not isinstance(value, np.ndarray):
        try:
            return int(dev()[0]) in _DLPACK_CUDA
        except Exception:
            return False
    return False


def is_device_buffer(buf: Any) -> bool:
    return type(buf).__module__.startswith("cupy")


def gpu_present() -> bool:
    """CuPy is installed and sees a CUDA device (cached after the first answer)."""
    global _present
    if _present is None:
        from .gpu import cuda_available

        _present = cuda_available()
    return _present


_present: bool | None = None


def to_device_buffer(value: Any) -> tuple[Any, str, tuple[int, ...]]:
    """(flat uint8 CuPy view of `value`, dtype code, shape); zero copy when contiguous.

    torch bfloat16 (which CuPy cannot import) is carried as its 16-bit pattern
    and described as "bfloat16"."""
    cp = cupy()
    try:
        return _to_device_buffer(cp, value)
    except UnsupportedValue:
        raise
    except Exception as exc:  # CUDA errors, foreign DLPack devices, odd dtypes
        raise UnsupportedValue(
            f"cannot store the device array ({type(value).__name__}) on this node's GPU: "
            f"{exc}") from exc


def _to_device_buffer(cp: Any, value: Any) -> tuple[Any, str, tuple[int, ...]]:
    from .values import _numpy_dtype_code  # noqa: PLC0415 - shared dtype codes

    code = None
    if type(value).__module__.startswith("torch"):
        import torch  # noqa: PLC0415

        if value.dtype == torch.bfloat16:
            value, code = value.contiguous().view(torch.int16), "bfloat16"
        arr = cp.from_dlpack(value.contiguous())
    elif hasattr(value, "__cuda_array_interface__"):
        arr = cp.asarray(value)
    else:
        arr = cp.from_dlpack(value)
    arr = cp.ascontiguousarray(arr)
    if code is None:
        code = _numpy_dtype_code(np.dtype(arr.dtype))
    return arr.reshape(-1).view(cp.uint8), code, tuple(arr.shape)


def empty(nbytes: int) -> Any:
    cp = cupy()
    try:
        return cp.empty(nbytes, dtype=cp.uint8)
    except cp.cuda.memory.OutOfMemoryError as exc:
        raise StoreFull(
            f"the GPU has no room for an object of {nbytes} bytes ({exc}): delete device "
            "objects you no longer need and drop references to device get results; CuPy "
            "keeps freed blocks in its pool (cupy.get_default_memory_pool().free_all_blocks() "
            "returns them)") from None


def copy_into(dst: Any, src: Any) -> None:
    """dst[...] = src, queued on the current stream (device to device)."""
    dst[...] = src


def sync() -> None:
    """Wait for the work queued on the current stream."""
    cupy().cuda.get_current_stream().synchronize()


def staging(nbytes: int) -> np.ndarray:
    """A pinned host buffer (from CuPy's pinned pool) for TCP staging."""
    cp = cupy()
    mem = cp.cuda.alloc_pinned_memory(nbytes)
    return np.frombuffer(mem, dtype=np.uint8, count=nbytes)


def download(src: Any, out: np.ndarray) -> memoryview:
    """Copy device bytes `src` into host `out` (pinned) and wait: ready to send."""
    src.get(out=out[: src.nbytes])
    sync()
    return memoryview(out)[: src.nbytes]


def upload(dst: Any, src: np.ndarray) -> None:
    """Copy host bytes into device `dst` and wait, so `src` may be reused at once."""
    dst.set(src[: dst.nbytes])
    sync()


def from_host(buf: Any) -> Any:
    """A device copy of host bytes."""
    return cupy().asarray(np.asarray(buf, dtype=np.uint8))


def to_host(buf: Any) -> np.ndarray:
    """A host copy of device bytes (for inline messages and host-only consumers)."""
    return cupy().asnumpy(buf)


def element_view(buf: Any, dtype: np.dtype) -> tuple[Any, str | None]:
    """`buf` (flat uint8, host or device) as elements of `dtype`, for the kernels.

    CuPy has no bfloat16: a device buffer is then viewed as uint16 and the
    kernels are told to read it as bfloat16."""
    if is_device_buffer(buf) and dtype.name == "bfloat16":
        return buf.view(cupy().uint16), "bfloat16"
    return buf.view(dtype), None


def materialize(buf: Any, dtype: np.dtype, shape: tuple[int, ...], as_: str) -> Any:
    """The value of a device-kind object held in `buf` (device or host), as asked."""
    if as_ not in AS_CHOICES:
        raise InvalidArgument(f"array_type must be one of {AS_CHOICES}; got {as_!r}")
    if as_ == "numpy" or not (is_device_buffer(buf) or gpu_present()):
        host = to_host(buf) if is_device_buffer(buf) else np.array(buf, copy=True)
        return host.view(dtype).reshape(shape)
    if as_ == "torch":
        try:
            import torch  # noqa: PLC0415
        except ImportError:
            raise UnsupportedValue("array_type='torch' needs torch: pip install torch "
                                   "(or get(..., array_type='cupy'))") from None
    cp = cupy()
    dev = cp.array(buf, copy=True) if is_device_buffer(buf) else cp.asarray(np.asarray(buf))
    if as_ == "torch":

        if dtype.name == "bfloat16":
            return torch.from_dlpack(dev.view(cp.int16)).view(torch.bfloat16).reshape(shape)
        return torch.from_dlpack(dev.view(dtype)).reshape(shape)
    if dtype.name == "bfloat16":
        raise UnsupportedValue("CuPy has no bfloat16: get(..., array_type='torch') or array_type='numpy'")
    return dev.view(dtype).reshape(shape)


# --- a weight channel's packed versions (hoplite_gpu.packing) ---
def pack(nbytes: int, pieces: list[tuple[int, Any]]) -> Any:
    """A device buffer of `nbytes`, zero but for each (offset, flat uint8
    device array) piece copied in at its offset (queued on the current stream)."""
    out = empty(nbytes)
    out.fill(0)
    for offset, piece in pieces:
        out[offset:offset + piece.nbytes] = piece
    return out


def target_bytes(value: Any) -> tuple[Any, str, tuple[int, ...]]:
    """(flat uint8 view, element name, shape) of a device array to write into
    in place (a CuPy array or a torch CUDA tensor): its own memory, never a
    copy; InvalidArgument if it is not contiguous."""
    cp = cupy()
    if type(value).__module__.startswith("torch"):
        if not value.is_contiguous() or value.is_conj() or value.is_neg():
            raise InvalidArgument("is a torch CUDA tensor that is not contiguous (or a lazy "
                                  "conjugate or negation view): pass .contiguous() storage")
        name = str(value.dtype).removeprefix("torch.")
        flat = value.detach().reshape(-1)
        if flat.numel() == 0:
            return cp.empty(0, dtype=cp.uint8), name, tuple(value.shape)
        import torch  # noqa: PLC0415 - present: value is a torch tensor

        return cp.from_dlpack(flat.view(torch.uint8)), name, tuple(value.shape)
    arr = cp.asarray(value)
    if not arr.flags.c_contiguous:
        raise InvalidArgument("is a device array that is not C-contiguous")
    return arr.reshape(-1).view(cp.uint8), np.dtype(arr.dtype).name, tuple(arr.shape)


def copy_bytes(dst: Any, src: Any) -> None:
    """dst[...] = src for two flat uint8 buffers of one size, each in host or
    device memory; device copies are queued on the current stream (`sync`)."""
    to_device, from_device = is_device_buffer(dst), is_device_buffer(src)
    if to_device and from_device:
        dst[...] = src
    elif to_device:
        dst.set(np.ascontiguousarray(src))
    elif from_device:
        src.get(out=dst)
    else:
        np.copyto(dst, src)
