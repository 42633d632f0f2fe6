"""Pulls between nodes on one host through shared memory instead of sockets.

A node's large store buffers are memory-mapped *memfd* files. A puller on the
same host reaches the sender's data server over the ``local`` transport (a
Unix socket in the abstract namespace named after the sender's data
address: `hoplite_gpu.transports.local`); the sender passes the buffer's
file descriptor (`send_mode`) and then only says how many more bytes are
ready, and the puller copies them straight from the mapping into its own
buffer: one memory copy per hop instead of a send and a receive through the
kernel's socket buffers.

A receiver that finds the sender's copy complete need not copy at all: it
keeps a read-only mapping of the sender's pages as its own copy
(`map_kept`), under a shared flock that tells the owner's pool the pages are
still someone's (`read_elsewhere`).

"Same host" means the same network namespace (see the transport), and the
socket accepts only processes of the same user; then the usual token
handshake runs on it.

A puller says when it has copied everything it was promised; until then the
buffer counts a reader and the pool does not reuse it (the puller may still
copy from its mapping after the object is freed here, and must see the
bytes it was promised). A puller that never says so (it died, stalled, or
the pull failed) leaves the count up for good: that buffer is never reused,
and its pages go when the last mapping goes.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import resource
import sys
import weakref
from typing import Any

import numpy as np

from hoplite_gpu import transports
from hoplite_gpu.errors import PeerLost, Timeout, TransportError
from hoplite_gpu.transports import Stream


def usable() -> bool:
    """Whether this platform has what sharing needs: memfd, /proc/self/fd and
    the same-host transport (Linux)."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create") \
        and transports.usable("local")


def domain() -> str:
    """Which nodes are on this node's host, as far as moving bytes goes (and
    can share memory with it, if on): the same boot of the same machine, in
    the same network namespace (see above); "" if unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return ""


class SharedMap(mmap.mmap):
    """A mapping of a memfd file; `fd` stays open while the mapping lives."""

    fd: int = -1
    #: pullers that mapped it and have not said they are done: while any
    #: remain, the pool must not reuse it
    readers: int = 0
    #: handed to a puller that keeps it as its own copy (mode ``M``): from
    #: then on only `_exclusive` says whether the pool may reuse it
    kept_elsewhere: bool = False
    #: a mapping of another process's pages that we keep as our copy (`map_kept`)
    kept: bool = False
    #: a puller took it and never said it was done: never reused (`abandon`)
    poisoned: bool = False


#: Kept copies whose pullers never said they took their own lock: held (and
#: our lock with them) until the process ends, so the owner never reuses
#: pages that such a puller may still map.
_abandoned: list[SharedMap] = []


def abandon(mapped: SharedMap) -> None:
    """A puller was handed `mapped` and did not confirm: it may still read
    it, so it is never reused, and if it is a copy we keep of someone else's
    pages, our lock on them stays too."""
    mapped.poisoned = True
    if mapped.kept and mapped not in _abandoned:
        _abandoned.append(mapped)


#: Shared buffers alive in this process. Each holds two descriptors (the
#: memfd and the one `mmap` keeps), so they stop at a quarter of the
#: descriptor limit, which this process's sockets and user code also need;
#: past it, new buffers are plain memory and pulls of them use bytes.
_live = 0


def _fd_budget() -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (1 << 16) if soft == resource.RLIM_INFINITY else soft // 4


def _freed(fd: int) -> None:
    global _live
    _live -= 1
    os.close(fd)


def shared_buffer(nbytes: int) -> np.ndarray | None:
    """A writable uint8 array of `nbytes` backed by a memfd file, or None where
    memfds are not available or this process holds its share of descriptors.
    The file is sealed against shrinking and growing: a puller holding its
    descriptor cannot cut it short under our mapping (SIGBUS)."""
    global _live
    if 2 * (_live + 1) > _fd_budget():
        return None
    try:
        # A memfd's pages are not reserved when it is sized or mapped, so a
        # size the machine cannot give would be found out only when written
        # (the OOM killer). A private map of the size is checked against the
        # kernel's overcommit rules, touches nothing, and is dropped at once;
        # if refused, the caller's plain map is refused alike: StoreFull.
        mmap.mmap(-1, nbytes).close()
    except (OSError, ValueError, OverflowError):
        return None
    try:
        fd = os.memfd_create("hoplite-gpu", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (AttributeError, OSError):
        return None
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        mapped = SharedMap(fd, nbytes)
    except (OSError, AttributeError):
        os.close(fd)
        return None
    mapped.fd = fd
    _live += 1
    weakref.finalize(mapped, _freed, fd)
    return np.frombuffer(mapped, dtype=np.uint8)


def shared_map(buffer: Any) -> SharedMap | None:
    """The SharedMap that `buffer` covers whole (a store buffer from
    `shared_buffer`), else None: a lent array, a slice, device memory."""
    if not isinstance(buffer, np.ndarray):
        return None
    base = buffer.base
    if isinstance(base, memoryview):
        base = base.obj
    if isinstance(base, SharedMap) and len(base) == buffer.nbytes and not base.closed:
        return base
    return None


def read_elsewhere(buffer: Any) -> bool:
    """Whether another process may still read `buffer`'s memory: a puller
    still copying from it, or one that keeps a mapping of it as its copy."""
    mapped = shared_map(buffer)
    if mapped is None:
        return False
    if mapped.kept or mapped.poisoned or mapped.readers > 0:
        # (never an exclusive lock on a kept copy's descriptor: failing, it
        # would drop our shared one)
        return True
    return mapped.kept_elsewhere and not _exclusive(mapped.fd)


def abandoned(buffer: Any) -> bool:
    """Whether `buffer` went to a puller that never confirmed (`abandon`)."""
    mapped = shared_map(buffer)
    return mapped is not None and mapped.poisoned


def _exclusive(fd: int) -> bool:
    """Whether no other process holds a mapping of this file as its copy:
    each holds a shared flock on its own open file description for as long
    as its mapping lives (`map_kept`), so ours can take an exclusive one."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def map_kept(fd: int, nbytes: int) -> SharedMap | None:
    """Keep a passed descriptor's file as this process's read-only copy of an
    object: reopened (our own open file description, so our lock is ours),
    share-locked for as long as the mapping lives (the owner's pool does not
    reuse the memory meanwhile), and mapped read-only. Closes `fd`. None if
    the lock cannot be had at once (the owner is checking right now) or this
    process holds its share of descriptors (two per kept copy)."""
    global _live
    if 2 * (_live + 1) > _fd_budget():
        os.close(fd)
        return None
    try:
        own = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        os.close(fd)
        return None
    os.close(fd)
    try:
        fcntl.flock(own, fcntl.LOCK_SH | fcntl.LOCK_NB)
        if os.fstat(own).st_size < nbytes:
            raise OSError("the passed file is shorter than the object")
        mapped = SharedMap(own, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except OSError:
        os.close(own)
        return None
    mapped.fd = own
    mapped.kept = True
    _live += 1
    weakref.finalize(mapped, _freed, own)  # closing it (and mmap's own) drops the lock
    return mapped


#: Mode bytes: F (a descriptor: copy what is announced), M (a descriptor of a
#: complete object: keep it mapped), B (bytes follow), N (no mapping offered).
MODES = {b"F": True, b"M": True, b"B": False, b"N": False}


async def send_mode(stream: Stream, mode: bytes, fd: int | None, timeout: float) -> None:
    """The byte that says how a pull is served (`MODES`), with `fd` attached
    where given (a same-host stream: `caps.local`)."""
    try:
        await stream.send_descriptor(mode, fd, timeout)
    except Timeout:
        raise
    except TransportError as exc:
        raise PeerLost(str(exc)) from exc


async def recv_mode(stream: Stream, timeout: float) -> tuple[bytes, int | None]:
    """The mode byte `send_mode` sent, and the descriptor if one came with it."""
    try:
        msg, fds = await stream.recv_descriptor(timeout)
    except Timeout:
        raise
    except TransportError as exc:
        raise PeerLost(str(exc)) from exc
    if msg in MODES and len(fds) == int(MODES[msg]):
        return msg, (fds[0] if fds else None)
    for fd in fds:
        os.close(fd)
    raise PeerLost(f"{stream.peer} sent {msg!r} where a pull's mode belongs "
                   "(connection closed?)")


def map_readonly(fd: int, nbytes: int) -> mmap.mmap:
    """Map a passed descriptor read-only (and close it: the mapping keeps the file)."""
    try:
        # (not MAP_POPULATE: the first bytes can be copied before the last
        # pages are mapped)
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
