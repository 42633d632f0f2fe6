"""Collectives as messages on a `Network`, each waiting for what it needs.

Every op sets itself up on a network (`start`), is played by `Network.run`,
and then tells when each host was done (`done_at`) and its last (`finished`).
A message's bytes are usable at its receiver `latency` seconds after its last
flow ends (0 by default: the closed forms below are exact then).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np

from ..errors import InvalidArgument
from .network import Network


def _hosts(where: str, hosts: Sequence[int], least: int = 2) -> list[int]:
    out = [int(h) for h in hosts]
    if len(out) < least:
        raise InvalidArgument(f"{where}: needs at least {least} hosts; got {len(out)}")
    if len(set(out)) != len(out):
        raise InvalidArgument(f"{where}: a host appears twice in {out[:16]}...")
    return out


def _positive(where: str, name: str, value: float) -> float:
    if isinstance(value, bool) or not (isinstance(value, numbers.Real) and 0 < value < math.inf):
        raise InvalidArgument(f"{where}: {name} must be a positive number; got {value!r}")
    return float(value)


class Op:
    """What every op keeps: when each of its hosts was done."""

    name = ""

    def __init__(self, latency: float = 0.0) -> None:
        if not 0 <= latency < math.inf:
            raise InvalidArgument(f"{type(self).__name__}: latency must be 0 or more seconds; "
                                  f"got {latency!r}")
        self.latency = latency
        self.done_at: dict[int, float] = {}
        self.net: Network | None = None

    def start(self, net: Network) -> None:
        raise NotImplementedError

    @property
    def finished(self) -> float:
        return max(self.done_at.values()) if self.done_at else 0.0

    def _deliver(self, fn, *args):
        """A `done` callback that calls fn(t, *args) `latency` after the flows end."""
        if self.latency == 0:
            return lambda t: fn(t, *args)
        return lambda t: self.net.at(t + self.latency, lambda u: fn(u, *args))


class PointToPoint(Op):
    name = "p2p"

    def __init__(self, src: int, dst: int, size: float, *, latency: float = 0.0) -> None:
        super().__init__(latency)
        self.src, self.dst = _hosts("PointToPoint", [src, dst])
        self.size = _positive("PointToPoint", "size", size)

    def start(self, net: Network) -> None:
        self.net = net
        net.send(self.src, self.dst, self.size, self._deliver(self._got))

    def _got(self, t: float) -> None:
        self.done_at[self.dst] = t


class RingAllreduce(Op):
    """Ring allreduce of `size` bytes over `ring` (hosts in ring order): 2(p-1)
    steps; in step s each rank sends a piece of size/p to the next rank, once
    it has sent step s-1 and received the previous rank's step s-1."""

    name = "ring-allreduce"

    def __init__(self, ring: Sequence[int], size: float, *, latency: float = 0.0) -> None:
        super().__init__(latency)
        self.ring = _hosts("RingAllreduce", ring)
        self.size = _positive("RingAllreduce", "size", size)
        p = len(self.ring)
        self.steps, self.piece = 2 * (p - 1), self.size / p
        self.sent = [0] * p        # steps whose send ended, per rank
        self.received = [0] * p    # steps received, per rank
        self.sending = [False] * p

    def start(self, net: Network) -> None:
        self.net = net
        for rank in range(len(self.ring)):
            self._next(rank)

    def _next(self, rank: int) -> None:
        s = self.sent[rank]
        if self.sending[rank] or s >= self.steps or self.received[rank] < s:
            return
        self.sending[rank] = True
        to = (rank + 1) % len(self.ring)
        self.net.send(self.ring[rank], self.ring[to], self.piece, self._sent_cb(rank))

    def _sent_cb(self, rank: int):
        deliver = self._deliver(self._got, (rank + 1) % len(self.ring))

        def sent(t: float) -> None:
            self.sending[rank] = False
            self.sent[rank] += 1
            self._next(rank)
            deliver(t)
        return sent

    def _got(self, t: float, rank: int) -> None:
        self.received[rank] += 1
        if self.received[rank] == self.steps:
            self.done_at[self.ring[rank]] = t
        self._next(rank)


class AllToAll(Op):
    """Every host sends size/p bytes to every other host, all at once."""

    name = "alltoall"

    def __init__(self, hosts: Sequence[int], size: float, *, latency: float = 0.0) -> None:
        super().__init__(latency)
        self.hosts = _hosts("AllToAll", hosts)
        self.size = _positive("AllToAll", "size", size)
        self.left = {h: len(self.hosts) - 1 for h in self.hosts}

    def start(self, net: Network) -> None:
        self.net = net
        hosts = np.array(self.hosts)
        p = len(hosts)
        src = np.repeat(hosts, p - 1)
        # (each source's destinations, itself left out, starting with the next host)
        shift = (np.arange(p)[:, None] + np.arange(1, p)[None, :]) % p
        dst = hosts[shift.reshape(-1)]
        self._dst = dst
        net.send_many(src, dst, np.full(len(src), self.size / p),
                      lambda t, which: self._deliver(self._got, which)(t))

    def _got(self, t: float, which: np.ndarray) -> None:
        for dst in self._dst[which].tolist():
            self.left[dst] -= 1
            if self.left[dst] == 0:
                self.done_at[dst] = t


def _tree(where: str, root: int, parent: dict[int, int]) -> dict[int, list[int]]:
    """Children lists of a tree given as child -> parent, checked to reach `root`."""
    children: dict[int, list[int]] = {root: []}
    for child in parent:
        children.setdefault(child, [])
    for child, up in parent.items():
        if up not in children:
            raise InvalidArgument(f"{where}: host {child}'s parent {up} is not in the tree")
        children[up].append(child)
    for node in parent:
        seen, at = set(), node
        while at != root:
            if at in seen:
                raise InvalidArgument(f"{where}: the tree has a cycle through host {at}")
            seen.add(at)
            at = parent[at]
    return children


def chain(hosts: Sequence[int]) -> dict[int, int]:
    """The child -> parent map of a chain hosts[0] -> hosts[1] -> ..."""
    return {hosts[i + 1]: hosts[i] for i in range(len(hosts) - 1)}


class _Stream:
    """One tree edge's chunks, in order, one in flight at a time."""

    __slots__ = ("src", "dst", "next", "busy")

    def __init__(self, src: int, dst: int) -> None:
        self.src, self.dst, self.next, self.busy = src, dst, 0, False


class _Pipelined(Op):
    """Chunks along the edges of a tree (child -> parent), one in flight per
    edge, each sent once its sender has it (`_have`)."""

    def __init__(self, root: int, parent: dict[int, int], size: float, chunks: int,
                 latency: float) -> None:
        super().__init__(latency)
        where = type(self).__name__
        self.size = _positive(where, "size", size)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise InvalidArgument(f"{where}: chunks must be a whole number of at least 1; "
                                  f"got {chunks!r}")
        self.root, self.chunks = int(root), chunks
        self.children = _tree(where, self.root, parent)
        self.parent = dict(parent)

    def _have(self, host: int) -> int:
        raise NotImplementedError

    def _got(self, t: float, s: _Stream) -> None:
        raise NotImplementedError

    def _pump(self, s: _Stream) -> None:
        if s.busy or s.next >= self.chunks or self._have(s.src) <= s.next:
            return
        s.busy = True
        self.net.send(s.src, s.dst, self.size / self.chunks, lambda t: self._left(t, s))

    def _left(self, t: float, s: _Stream) -> None:
        s.busy = False
        s.next += 1
        self._deliver(self._got, s)(t)
        self._pump(s)


class TreeBroadcast(_Pipelined):
    """Broadcast `size` bytes from `root` down a tree (child -> parent) in
    `chunks` pipelined chunks: a host forwards chunk i to each child once it
    has it and that child's chunk i-1 has left."""

    name = "tree-broadcast"

    def __init__(self, root: int, parent: dict[int, int], size: float, chunks: int = 1, *,
                 latency: float = 0.0) -> None:
        super().__init__(root, parent, size, chunks, latency)
        self.held = {h: 0 for h in self.children}
        self.held[self.root] = chunks
        self.streams = {h: [_Stream(h, c) for c in kids] for h, kids in self.children.items()}

    def start(self, net: Network) -> None:
        self.net = net
        for s in self.streams[self.root]:
            self._pump(s)

    def _have(self, host: int) -> int:
        return self.held[host]

    def _got(self, t: float, s: _Stream) -> None:
        host = s.dst
        self.held[host] += 1
        if self.held[host] == self.chunks:
            self.done_at[host] = t
        for out in self.streams[host]:
            self._pump(out)


class TreeReduce(_Pipelined):
    """Reduce `size`-byte inputs up a tree (child -> parent) to `root` in
    `chunks` pipelined chunks: a host's chunk i of its partial result exists
    once chunk i of every child's has arrived (folding is free), and goes to
    its parent once chunk i-1 has left."""

    name = "tree-reduce"

    def __init__(self, root: int, parent: dict[int, int], size: float, chunks: int = 1, *,
                 latency: float = 0.0) -> None:
        super().__init__(root, parent, size, chunks, latency)
        self.arrived = {h: 0 for h in self.children}   # chunks in from each child (as a child)
        self.up = {h: _Stream(h, self.parent[h]) for h in self.parent}

    def _have(self, host: int) -> int:
        kids = self.children[host]
        return min((self.arrived[c] for c in kids), default=self.chunks)

    def start(self, net: Network) -> None:
        self.net = net
        for s in self.up.values():
            self._pump(s)
        if not self.parent:
            self.done_at[self.root] = 0.0

    def _got(self, t: float, s: _Stream) -> None:
        self.arrived[s.src] += 1
        host = s.dst
        if host == self.root:
            if self._have(host) == self.chunks:
                self.done_at[host] = t
        else:
            self._pump(self.up[host])
