"""Reuse of large object buffers within a node.

Touching fresh memory costs the kernel a page fault per 4 KiB page, and on a
virtual machine the host may fault too; for a large object that can cost more
than moving it over the network. Buffers of freed objects are kept (up to a
byte budget) and handed to the next object of the same size.

A buffer is only reused when nothing outside the store still refers to it:
`get` returns zero-copy views of store buffers, and a user's view must never
see its bytes change.

Large buffers are anonymous memory maps, not `np.empty`: NumPy asks the kernel
for transparent huge pages on large arrays (madvise), and where THP is in
`madvise` mode a first touch then faults in zeroed 2 MiB pages, which on the
VMs measured was 3-4.5 x slower than 4 KiB pages: 8 processes each writing a
fresh 256 MiB took 1.9-2.5 s with NumPy's arrays and 0.55-0.58 s with plain maps
(`python -m benchmarks machine`). A map takes
the kernel's default (huge pages only where THP is `always`).
"""

from __future__ import annotations

import mmap
import sys

import numpy as np

from . import shm

#: Smaller buffers are cheap to allocate; pooling them would only add bookkeeping.
MIN_POOLED = 1 << 20


def host_buffer(nbytes: int, shared: bool = False) -> np.ndarray:
    """A writable uint8 array of `nbytes` (contents undefined), mapped in plain
    pages when large; its memory is returned when the array is collected.
    `shared`: a large one is a memfd mapping that pullers on this host can map
    (`shm`), where this process can make one."""
    if nbytes < MIN_POOLED:
        return np.empty(nbytes, dtype=np.uint8)
    if shared:
        buffer = shm.shared_buffer(nbytes)
        if buffer is not None:
            return buffer
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


#: A first touch faults in one page of this many bytes (or more: huge pages)
PAGE = 4096


def touched_buffer(nbytes: int, shared: bool = False) -> np.ndarray:
    """`host_buffer(nbytes, shared)` with every page written once (faulted
    in): what a transfer into it then costs is the copy alone. Runs in any
    thread (NumPy's fill lets go of the GIL)."""
    buffer = host_buffer(nbytes, shared)
    buffer[::PAGE] = 0
    return buffer


def _owns_its_memory(buffer: np.ndarray) -> bool:
    """A whole array of its own: not a view of another array or of part of a map."""
    base = buffer.base
    if isinstance(base, memoryview):  # np.frombuffer keeps a view of the map
        base = base.obj
    return base is None or (isinstance(base, mmap.mmap) and len(base) == buffer.nbytes)


class BufferPool:
    def __init__(self, budget: int, shared: bool = False) -> None:
        self.budget = budget
        #: new buffers are memfd mappings (see `host_buffer`)
        self.shared = shared
        self.pooled = 0
        self._free: dict[int, list[np.ndarray]] = {}
        #: buffers handed out for good (`lend`), taken back once let go, oldest
        #: first, and their bytes (`pooled` counts free ones; both share the budget)
        self._lent: list[np.ndarray] = []
        self.lent = 0
        self.hits = 0
        #: of `hits`, lent buffers taken back
        self.reclaimed = 0

    def acquire(self, nbytes: int) -> np.ndarray:
        free = self._free.get(nbytes)
        if free:
            # Newest first; one that another process still reads is passed over
            # (kept for later: its readers let go when they drop their copies),
            # and one handed to a puller that never confirmed is let go.
            for i in range(len(free) - 1, -1, -1):
                if shm.abandoned(free[i]):
                    free.pop(i)
                    self.pooled -= nbytes
                elif not shm.read_elsewhere(free[i]):
                    self.hits += 1
                    self.pooled -= nbytes
                    buffer = free.pop(i)
                    if not free:  # (one key per size ever reused would pile up)
                        del self._free[nbytes]
                    return buffer
            if not free:
                del self._free[nbytes]
        held = self._lent
        for i in range(len(held) - 1, -1, -1):
            if held[i].nbytes != nbytes:
                continue
            if shm.abandoned(held[i]):
                self.lent -= held.pop(i).nbytes
            # (2: the list's reference and getrefcount's argument, so no view,
            # memoryview or store object of anyone's is left)
            elif sys.getrefcount(held[i]) == 2 and not shm.read_elsewhere(held[i]):
                self.hits += 1
                self.reclaimed += 1
                self.lent -= nbytes
                return held.pop(i)
        return host_buffer(nbytes, self.shared)

    def reusable(self, nbytes: int) -> bool:
        """Whether `acquire(nbytes)` would reuse a buffer now: a free one of
        that size, or a lent one that nothing but the pool refers to."""
        if any(not shm.read_elsewhere(b) for b in self._free.get(nbytes, ())):
            return True
        # (3: the list's reference, the loop's and getrefcount's argument)
        return any(b.nbytes == nbytes and sys.getrefcount(b) == 3
                   and not shm.read_elsewhere(b) for b in self._lent)

    def lend(self, buffer: np.ndarray) -> None:
        """Track `buffer`, one of ours handed out for good (an array returned to
        the caller, whose views we cannot see go): `acquire` takes it back once
        nothing but the pool refers to it. Lent buffers count against the
        budget as kept ones do; the oldest is forgotten to make room."""
        n = buffer.nbytes
        if n < MIN_POOLED or n > self.budget or not _owns_its_memory(buffer) \
                or not buffer.flags.writeable or any(b is buffer for b in self._lent):
            return
        self._make_room(n)
        if self.pooled + self.lent + n > self.budget:
            return  # (the free buffers fill the budget: they are the surer reuse)
        self._lent.append(buffer)
        self.lent += n

    def _forget_lent(self, buffer: np.ndarray) -> bool:
        """Stop tracking `buffer` as lent; whether it was."""
        for i, held in enumerate(self._lent):
            if held is buffer:
                self.lent -= self._lent.pop(i).nbytes
                return True
        return False

    def _make_room(self, nbytes: int) -> None:
        """Forget lent buffers, oldest first, until `nbytes` more fit the budget
        (they may be in use for good; their holders keep their memory alive)."""
        while self._lent and self.pooled + self.lent + nbytes > self.budget:
            self.lent -= self._lent.pop(0).nbytes

    def wants(self, nbytes: int) -> bool:
        """Whether a buffer of `nbytes` made now would be kept: none of that
        size is free, and the budget has room (`prepare`)."""
        return (MIN_POOLED <= nbytes and not self._free.get(nbytes)
                and self.pooled + nbytes <= self.budget)

    def release(self, buffer: np.ndarray) -> bool:
        """Keep `buffer` for reuse if no one else holds it and the budget allows."""
        n = buffer.nbytes
        lent = self._forget_lent(buffer)  # (its list's reference is not a holder's)
        # getrefcount counts its own argument and our parameter: 2 means nobody
        # else (no user view, no memoryview being sent) refers to the buffer.
        if n < MIN_POOLED or n > self.budget or sys.getrefcount(buffer) > 3:
            if lent:
                self.lend(buffer)
            return False
        if not _owns_its_memory(buffer) or not buffer.flags.writeable or shm.abandoned(buffer):
            return False
        self._make_room(n)
        if self.pooled + self.lent + n > self.budget:
            return False
        # One that another process on this host still reads (`shm`) is kept
        # too, but handed out only once it no longer is (`acquire` checks).
        self._free.setdefault(n, []).append(buffer)
        self.pooled += n
        return True

    def clear(self) -> None:
        self._free.clear()
        self._lent.clear()
        self.pooled = self.lent = 0
