"""Which ids a node forgot (dropped, deleted) and when, counted: a call that
read the count before it asked the directory can tell whether a drop of its
id overtook the answer."""

from __future__ import annotations

from collections import OrderedDict

from hoplite_gpu.ids import ObjectID

#: Ids whose last drop a node remembers (see `Node.keep_inline`).
KEPT = 4096


class Forgotten:
    """The count of forgets so far, and the count at the last one of each
    recent id. Only the node's loop thread records; `count` may be read from
    any thread (one int, replaced whole), which the direct calls of a
    caller's thread do before they ask (`hoplite_gpu.direct`)."""

    def __init__(self) -> None:
        self._count = 0
        self._last: OrderedDict[ObjectID, int] = OrderedDict()

    @property
    def count(self) -> int:
        """Forgets so far (safe to read from any thread)."""
        return self._count

    def record(self, oid: ObjectID) -> None:
        """`oid` is forgotten here now (on the loop thread)."""
        self._count += 1
        self._last[oid] = self._count
        self._last.move_to_end(oid)
        while len(self._last) > KEPT:
            self._last.popitem(last=False)

    def since(self, oid: ObjectID, count: int) -> bool:
        """Whether `oid` was forgotten after `count` was read."""
        return self._last.get(oid, 0) > count
