"""What a node tells the directory of a copy it holds."""

from __future__ import annotations

from hoplite_gpu import device
from hoplite_gpu import messages as m
from hoplite_gpu.values import fingerprint

from .store import StoredObject


def complete_msg(obj: StoredObject) -> m.Complete:
    """`obj` is whole here. Size and layout let a restarted directory learn of
    the object from this alone; `own`: put or made here, so a restarted
    directory counts it as an origin; `tag`: a reduce result's tree."""
    host = not device.is_device_buffer(obj.buffer)
    return m.Complete(oid=obj.oid.binary, size=obj.size, layout=obj.layout.to_wire(),
                      own=obj.own, tag=obj.reduce_tag,
                      print_=fingerprint(obj.buffer) if obj.own and host else None)
