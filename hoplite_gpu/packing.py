"""The layout of a weight channel's version (`hoplite_gpu.channel`): every
tensor's bytes back to back, each at an offset aligned to `ALIGN`, in one
object per kind of memory (a host part, and a device part where device
tensors are published), and the manifest that says where each tensor lies.

One object per version instead of one per tensor: a fetch is one get, one
receiver-driven pipelined chain at a broadcast's speed, whatever the number
of tensors, and none of the per-object costs (a locate, a registration, a
pull's start, a chain filling again) is paid per tensor.

Here: planning the offsets (pure), the manifest both ways (checked: a
manifest is bytes from another process), the values a plain fetch returns
(views of the received part, or copies where the kind asks for them), and
the caller's arrays a `fetch(out=...)` writes into: their checks against the
version (names, shapes, element types) and the copies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import device
from . import messages as m
from .errors import InvalidArgument, ProtocolError
from .values import Layout, _is_torch_tensor, _numpy_dtype_code, _wire_numpy_dtype, from_buffer
from .values import is_masked as _is_masked

#: Every tensor starts at a multiple of this many bytes in its part: views of
#: it are aligned for any element type, and copies run on whole cache lines.
ALIGN = 64


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies: its key, its value's layout, its part and offset."""

    key: str
    layout: Layout
    part: int
    offset: int

    @property
    def end(self) -> int:
        return self.offset + self.layout.nbytes


@dataclass(frozen=True)
class Part:
    """One object of a version: its size, and whether it is a device object."""

    nbytes: int
    device: bool


def plan(entries: Sequence[tuple[str, Layout]]) -> tuple[list[Slot], list[Part]]:
    """Slots for `(key, layout)` entries in their order: host tensors back to
    back in one part, device tensors (layout kind "device") in another; the
    host part first. Empty parts are left out."""
    kinds = [kind for kind in (False, True) if any((lay.kind == "device") == kind
                                                    for _, lay in entries)]
    ends = dict.fromkeys(kinds, 0)
    slots = []
    for key, layout in entries:
        on_device = layout.kind == "device"
        offset = -(-ends[on_device] // ALIGN) * ALIGN
        slots.append(Slot(key, layout, kinds.index(on_device), offset))
        ends[on_device] = offset + layout.nbytes
    return slots, [Part(ends[kind], kind) for kind in kinds]


def to_manifest(version: int, slots: Sequence[Slot], parts: Sequence[Part],
                held: list[int]) -> m.Manifest:
    return m.Manifest(
        version=version, held=held,
        parts=[m.PackPart(p.nbytes, p.device) for p in parts],
        tensors=[m.PackedTensor(s.key, s.layout.kind, s.layout.dtype, list(s.layout.shape),
                                s.layout.nbytes, s.part, s.offset) for s in slots])


def read_manifest(what: str, manifest: m.Manifest) -> tuple[list[Slot], list[Part]]:
    """The slots and parts of a decoded manifest; ProtocolError naming `what`
    when it does not hold together (a layout that is no layout, a tensor past
    its part's end or in a part of the other memory, a key twice)."""
    parts = [Part(p.nbytes, p.device) for p in manifest.parts]
    slots, seen = [], set()
    for t in manifest.tensors:
        layout = Layout.from_wire({"kind": t.kind, "dtype": t.dtype, "shape": t.shape,
                                   "nbytes": t.nbytes})
        slot = Slot(t.key, layout, t.part, t.offset)
        if t.key in seen:
            raise ProtocolError(f"{what} names tensor {t.key!r} twice")
        seen.add(t.key)
        if (t.part >= len(parts) or slot.end > parts[t.part].nbytes
                or parts[t.part].device != (layout.kind == "device")):
            raise ProtocolError(f"{what}: tensor {t.key!r} does not lie within a part of its "
                                "kind of memory")
        slots.append(slot)
    return slots, parts


# --------------------------------------------------------------- reading ---
def on_loop(slot: Slot, parts: Sequence[Any], targets: Mapping[str, Target] | None) -> bool:
    """Whether this slot's value is made (or its copy into the caller's
    array is made) on the node's loop thread: anything that touches device
    memory, whose copies are ordered on that thread's stream."""
    if slot.layout.kind == "device" or device.is_device_buffer(parts[slot.part]):
        return True
    return targets is not None and targets[slot.key].device


def values(slots: Sequence[Slot], parts: Sequence[Any], array_type: str,
           loop: bool) -> dict[str, Any]:
    """The values of the slots that `on_loop` puts on this side (`loop`):
    NumPy values as read-only views of their part (no copy), torch and bytes
    values as fresh copies, device values as fresh arrays of `array_type`."""
    out = {}
    for slot in slots:
        if on_loop(slot, parts, None) == loop:
            out[slot.key] = from_buffer(parts[slot.part][slot.offset:slot.end], slot.layout,
                                        array_type)
    return out


def copy_into(slots: Sequence[Slot], parts: Sequence[Any], targets: Mapping[str, Target],
              loop: bool) -> None:
    """Copy each slot's bytes into its target (the slots `on_loop` puts on
    this side); device copies are waited for before this returns."""
    queued = False
    for slot in slots:
        if on_loop(slot, parts, targets) == loop:
            src = parts[slot.part][slot.offset:slot.end]
            dst = targets[slot.key].view
            device.copy_bytes(dst, src)
            queued = queued or device.is_device_buffer(dst) or device.is_device_buffer(src)
    if queued:
        device.sync()


# -------------------------------------------------- the caller's arrays ---
@dataclass(frozen=True)
class Target:
    """A caller's array to write one tensor into: its bytes (a flat uint8
    view of its own memory), its element type's name and its shape."""

    view: Any
    element: str
    shape: tuple[int, ...]
    device: bool


def targets(out: Any) -> dict[str, Target]:
    """`out` (name -> array) as targets; InvalidArgument naming the key and
    the cause for anything that cannot be written in place."""
    if not isinstance(out, Mapping) or not all(isinstance(k, str) for k in out):
        raise InvalidArgument(f"fetch(out=...) takes a mapping of name -> array to write into; "
                              f"got {type(out).__name__}")
    found = {}
    for key, value in out.items():
        try:
            found[key] = _target(value)
        except InvalidArgument as exc:
            raise InvalidArgument(f"fetch(out=...): out[{key!r}] {exc}") from None
    return found


def _target(value: Any) -> Target:
    if isinstance(value, np.ndarray):
        if _is_masked(value):
            raise InvalidArgument("is a masked array; pass its data (arr.data)")
        if not value.flags.writeable:
            raise InvalidArgument("is read-only")
        if not value.flags.c_contiguous:
            raise InvalidArgument("is not C-contiguous: the version's bytes are written "
                                  "into the array's own memory")
        flat = value.reshape(-1).view(np.uint8) if value.nbytes else np.empty(0, np.uint8)
        return Target(flat, _numpy_element(value.dtype), tuple(value.shape), False)
    if _is_torch_tensor(value) and value.device.type == "cpu":
        if not value.is_contiguous() or value.is_conj() or value.is_neg():
            raise InvalidArgument("is a torch tensor that is not contiguous (or a lazy "
                                  "conjugate or negation view)")
        name = str(value.dtype).removeprefix("torch.")
        if value.numel() == 0:
            return Target(np.empty(0, np.uint8), name, tuple(value.shape), False)
        import torch  # noqa: PLC0415 - present: value is a torch tensor

        flat = value.detach().reshape(-1).as_strided((value.numel(),), (1,))
        return Target(flat.view(torch.uint8).numpy(), name, tuple(value.shape), False)
    if device.is_device_array(value):
        view, name, shape = device.target_bytes(value)
        return Target(view, name, shape, True)
    raise InvalidArgument(f"is a {type(value).__module__}.{type(value).__qualname__}; out= "
                          "takes NumPy arrays, torch tensors (CPU or CUDA) and CuPy arrays")


def check(what: str, slots: Sequence[Slot], found: Mapping[str, Target]) -> None:
    """InvalidArgument naming `what` (the call and the version) and every
    difference between the version's tensors and the caller's arrays: names
    missing or extra, shapes, element types."""
    names = [s.key for s in slots]
    problems = []
    missing = [k for k in names if k not in found]
    extra = [k for k in found if k not in set(names)]
    if missing:
        problems.append(f"out lacks {_few(missing)}")
    if extra:
        problems.append(f"out has {_few(extra)}, which the version does not")
    for slot in slots:
        t = found.get(slot.key)
        if t is None:
            continue
        want, shape = element(slot.layout), tuple(slot.layout.shape)
        if t.element != want or t.shape != shape or t.view.nbytes != slot.layout.nbytes:
            problems.append(f"{slot.key!r} is {want} {list(shape)} in the version, "
                            f"{t.element} {list(t.shape)} in out")
    if problems:
        shown = "; ".join(problems[:8]) + ("; ..." if len(problems) > 8 else "")
        raise InvalidArgument(f"{what}: out does not match the version: {shown}")


def element(layout: Layout) -> str:
    """A layout's element type by name, comparable across NumPy, torch and
    CuPy ("float32", "bfloat16", ...); a byte buffer's is "uint8"."""
    if layout.kind == "bytes":
        return "uint8"
    if layout.kind == "torch":
        return layout.dtype.removeprefix("torch.")
    return _numpy_element(_wire_numpy_dtype(layout.dtype))


def _numpy_element(dtype: np.dtype) -> str:
    # (plain native types by name, as torch names them; anything else by its
    # exact code: byte order, fields and sizes all count)
    if dtype.isnative and dtype.names is None and dtype.subdtype is None:
        return dtype.name
    return _numpy_dtype_code(dtype)


def _few(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:5])
    return shown + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
