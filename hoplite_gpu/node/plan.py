"""A pull as a plan of sub-flows, and the ledger of the bytes it has written.

A `Plan` splits one object's missing bytes into `SubFlow`s: each a byte range
with the sender to pull it from and its *route*: the address (a rail of that
sender) to use, the address of this node to connect from (its rail), and
the ECMP path whose source port the connection takes (docs/fabric.md,
"Rails and paths"). A pull from one sender is `Plan.single`: one sub-flow.
A pull from several (`Plan.pieces`) cuts the bytes into pieces that the
pull engine (`hoplite_gpu.node.engine`) hands to its routes as a queue, so
each takes the next piece when done with one (a faster sender takes more);
a pull from one sender over several rails or paths is `Plan.split`, one
equal sub-flow per route. When one fails, the `Ledger` says which of its
bytes are still missing, and those go back to the queue for the others.
The ledger refuses to record a byte twice, and its `prefix` is the
watermark the store exposes for relaying.

Pure: no I/O, no clocks, no asyncio.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

#: How a sub-flow reaches its sender: (sender, its address, this node's
#: address to connect from ("": the kernel's choice), ECMP path (-1: none)).
Route = tuple[str, str, str, int]


def as_route(source: tuple[str, ...] | tuple[str, str, str, int]) -> Route:
    """A (sender, address) pair, or a whole route, as a route."""
    if len(source) == 2:
        return (source[0], source[1], "", -1)
    sender, address, local, path = source
    return (sender, address, local, path)


@dataclass(frozen=True)
class SubFlow:
    """Bytes [start, end) of an object, from `sender` through `address`, in
    messages of `piece` bytes (0: the puller's chunk size), on a connection
    from this node's `local` address ("": any) whose source port is chosen
    for ECMP path `path` (-1: none)."""

    start: int
    end: int
    sender: str
    address: str
    piece: int = 0
    local: str = ""
    path: int = -1

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"sub-flow range [{self.start}, {self.end}) is not a range")

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def route(self) -> Route:
        return (self.sender, self.address, self.local, self.path)

    def moved(self, sender: str, address: str, start: int | None = None,
              end: int | None = None, local: str = "", path: int = -1) -> SubFlow:
        """The same bytes (or [start, end) of them) from another sender, or
        over another route."""
        return replace(self, sender=sender, address=address, local=local, path=path,
                       start=self.start if start is None else start,
                       end=self.end if end is None else end)


@dataclass(frozen=True)
class Plan:
    """How one pull fills an object of `size` bytes: its sub-flows, disjoint."""

    oid: Any
    size: int
    flows: tuple[SubFlow, ...]
    #: every sender the plan may use, with its address, or its whole route
    #: (by default those its sub-flows name): one named for no sub-flow
    #: takes over failed ones' bytes
    sources: tuple[tuple[str, str] | Route, ...] = ()
    #: each sub-flow comes from the sender it names, all at once (a tree's
    #: range from that tree's parent); only what a failed one left moves to
    #: another. Else the sub-flows are a queue for whichever sender is free.
    pinned: bool = False
    #: what a failed sub-flow left may move to another of the plan's
    #: senders. Not in a striped pull: another stripe's sender may be one
    #: this node sends that stripe to, and each would wait on the other's
    #: bytes; the directory names a new sender instead (`Restripe`).
    spares: bool = True
    #: senders that, without `spares`, still take what failed sub-flows
    #: left, at once (each a complete copy that waits on nobody: a
    #: multitree broadcast's root)
    backups: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        last = 0
        for flow in sorted(self.flows, key=lambda f: f.start):
            if flow.start < last or flow.end > self.size:
                raise ValueError(f"sub-flow [{flow.start}, {flow.end}) overlaps another "
                                 f"or lies outside [0, {self.size})")
            last = flow.end

    @classmethod
    def single(cls, oid: Any, size: int, sender: str, address: str, start: int = 0) -> Plan:
        """Today's pull: bytes [start, size) from one sender."""
        return cls(oid, size, (SubFlow(start, size, sender, address),))

    @classmethod
    def split(cls, oid: Any, size: int, senders: Sequence[tuple[str, str] | Route],
              missing: Iterable[tuple[int, int]] | None = None, parts: int | None = None,
              pinned: bool = False) -> Plan:
        """The `missing` ranges (all of [0, size) by default) in `parts` equal
        sub-flows (one per sender, or route, by default), the senders taken
        in turn; `pinned`: each from its own, all at once (Ethereal's split
        of one flow over paths)."""
        if not senders:
            raise ValueError("a plan needs at least one sender")
        routes = [as_route(s) for s in senders]
        ranges = [(0, size)] if missing is None else [(a, b) for a, b in missing if a < b]
        total = sum(b - a for a, b in ranges)
        parts = max(1, min(parts or len(senders), total or 1))
        flows: list[SubFlow] = []
        cuts = [total * i // parts for i in range(parts + 1)]  # in missing bytes
        done = 0  # missing bytes before the current range
        for a, b in ranges:
            for i in range(parts):
                lo = max(a, a + cuts[i] - done)
                hi = min(b, a + cuts[i + 1] - done)
                if lo < hi:
                    flows.append(_flow(lo, hi, routes[i % len(routes)]))
            done += b - a
        return cls(oid, size, tuple(flows), tuple(routes), pinned=pinned)

    @classmethod
    def pieces(cls, oid: Any, size: int, senders: Sequence[tuple[str, str] | Route],
               missing: Iterable[tuple[int, int]] | None = None, piece: int = 1) -> Plan:
        """The `missing` ranges (all of [0, size) by default) cut into pieces
        of at most `piece` bytes, in order, the senders named in turn: a plan
        the engine runs as a queue, each sender taking the next piece when
        it is done with one, so a faster sender takes more of them."""
        if not senders:
            raise ValueError("a plan needs at least one sender")
        if piece < 1:
            raise ValueError(f"a piece has at least one byte; got {piece}")
        ranges = [(0, size)] if missing is None else [(a, b) for a, b in missing if a < b]
        routes = [as_route(s) for s in senders]
        flows = [_flow(lo, min(lo + piece, b), routes[i % len(routes)])
                 for i, (lo, b) in enumerate((lo, b) for a, b in ranges
                                             for lo in range(a, b, piece))]
        return cls(oid, size, tuple(flows), tuple(routes))

    @classmethod
    def striped(cls, oid: Any, size: int, stripes: Sequence[tuple[int, int, str, str]],
                missing: Iterable[tuple[int, int]], piece: int = 0) -> Plan:
        """A striped pull: of each stripe (start, end, sender, address), what
        `missing` lacks of it, from that stripe's sender, all at once."""
        missing = list(missing)
        flows = tuple(SubFlow(lo, hi, sender, address, piece)
                      for start, end, sender, address in stripes for a, b in missing
                      if (lo := max(a, start)) < (hi := min(b, end)))
        return cls(oid, size, flows, pinned=True, spares=False)

    @property
    def senders(self) -> list[tuple[str, str]]:
        """Its senders with their addresses, each once: its `sources`, or
        those its sub-flows name, in order of first use."""
        return list(dict.fromkeys((r[0], r[1]) for r in self.routes))

    @property
    def routes(self) -> list[Route]:
        """Its routes, each once: its `sources` and `backups`, then those its
        sub-flows name, in order of first use (one worker each)."""
        seen: dict[Route, None] = dict.fromkeys(as_route(s) for s in self.sources)
        seen.update(dict.fromkeys(as_route(s) for s in self.backups))
        for flow in self.flows:
            seen.setdefault(flow.route, None)
        return list(seen)


def _flow(start: int, end: int, route: Route) -> SubFlow:
    sender, address, local, path = route
    return SubFlow(start, end, sender, address, local=local, path=path)


class Ledger:
    """Which bytes of an object of `size` bytes are written: disjoint, sorted,
    non-adjacent [start, end) runs. A byte is recorded at most once."""

    __slots__ = ("size", "_starts", "_ends")

    def __init__(self, size: int, prefix: int = 0) -> None:
        self.size = size
        self._starts: list[int] = []
        self._ends: list[int] = []
        if prefix:
            self.write(0, prefix)

    def __repr__(self) -> str:
        return f"Ledger({self.size}, runs={self.runs})"

    @property
    def runs(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends, strict=True))

    @property
    def prefix(self) -> int:
        """The longest written prefix: the watermark below which bytes are final."""
        return self._ends[0] if self._starts and self._starts[0] == 0 else 0

    @property
    def written(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

    @property
    def complete(self) -> bool:
        return self.prefix >= self.size

    def write(self, start: int, end: int) -> None:
        """Record bytes [start, end) as written. ValueError if any of them was
        already, or lies outside the object: that would be a byte written twice."""
        if start >= end:
            return
        if start < 0 or end > self.size:
            raise ValueError(f"[{start}, {end}) lies outside [0, {self.size})")
        i = bisect.bisect_right(self._starts, start)  # runs before i start at or before `start`
        if i and self._ends[i - 1] > start or i < len(self._starts) and self._starts[i] < end:
            raise ValueError(f"bytes in [{start}, {end}) were written already: {self.runs}")
        joins_left = i > 0 and self._ends[i - 1] == start
        joins_right = i < len(self._starts) and self._starts[i] == end
        if joins_left and joins_right:
            self._ends[i - 1] = self._ends[i]
            del self._starts[i], self._ends[i]
        elif joins_left:
            self._ends[i - 1] = end
        elif joins_right:
            self._starts[i] = start
        else:
            self._starts.insert(i, start)
            self._ends.insert(i, end)

    def run_end(self, pos: int) -> int:
        """Where the written run holding byte `pos` ends (`pos` if none holds it)."""
        i = bisect.bisect_right(self._starts, pos) - 1
        return self._ends[i] if i >= 0 and self._ends[i] > pos else pos

    def missing(self, start: int = 0, end: int | None = None) -> list[tuple[int, int]]:
        """The ranges of [start, end) (all of the object by default) not written yet."""
        end = self.size if end is None else end
        gaps, pos = [], start
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        for s, e in zip(self._starts[i:], self._ends[i:], strict=True):
            if s >= end:
                break
            if s > pos:
                gaps.append((pos, s))
            pos = max(pos, e)
        if pos < end:
            gaps.append((pos, end))
        return gaps

    def rest(self, flow: SubFlow) -> list[SubFlow]:
        """What `flow` has not written yet, as sub-flows of the same sender
        (to be `moved` to another)."""
        return [replace(flow, start=a, end=b) for a, b in self.missing(flow.start, flow.end)]
