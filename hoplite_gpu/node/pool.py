"""Reuse of large object buffers within a node.

Touching fresh memory costs the kernel a page fault per 4 KiB page, and on a
virtual machine the host may fault too; for a large object that can cost more
than moving it over the network. Buffers of freed objects are kept (up to a
byte budget) and handed to the next object of the same size.

A buffer is only reused when nothing outside the store still refers to it:
`get` returns zero-copy views of store buffers, and a user's view must never
see its bytes change.
"""

from __future__ import annotations

import sys

import numpy as np

#: Smaller buffers are cheap to allocate; pooling them would only add bookkeeping.
MIN_POOLED = 1 << 20


class BufferPool:
    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.pooled = 0
        self._free: dict[int, list[np.ndarray]] = {}
        self.hits = 0

    def acquire(self, nbytes: int) -> np.ndarray:
        free = self._free.get(nbytes)
        if free:
            self.hits += 1
            self.pooled -= nbytes
            return free.pop()
        return np.empty(nbytes, dtype=np.uint8)

    def release(self, buffer: np.ndarray) -> bool:
        """Keep `buffer` for reuse if no one else holds it and the budget allows."""
        n = buffer.nbytes
        # getrefcount counts its own argument and our parameter: 2 means nobody
        # else (no user view, no memoryview being sent) refers to the buffer.
        if n < MIN_POOLED or self.pooled + n > self.budget or sys.getrefcount(buffer) > 3:
            return False
        if buffer.base is not None or not buffer.flags.writeable:
            return False
        self._free.setdefault(n, []).append(buffer)
        self.pooled += n
        return True

    def clear(self) -> None:
        self._free.clear()
        self.pooled = 0
