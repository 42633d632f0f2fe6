"""A pull as a plan of sub-flows, and the ledger of the bytes it has written.

A `Plan` splits one object's missing bytes into `SubFlow`s: each a byte range
with the sender to pull it from and its *route*: the address (a rail of that
sender) to use, the address of this node to connect from (its rail), and
the ECMP path whose source port the connection takes (docs/fabric.md,
"Rails and paths"). A pull from one sender is `Plan.single`: one sub-flow.
A pull from several (`Plan.pieces`) cuts the bytes into pieces that the
pull engine (`hoplite_gpu.node.engine`) hands to its routes as a queue, so
each takes the next piece when done with one (a faster sender takes more);
a pull from one sender over several rails or paths is `Plan.dealt`: pieces
dealt to the routes in turn, each route pulling its own one after another
(an equal share each, and the written prefix moves as they land). When one
fails, the `Ledger` says which of its bytes are still missing, and those go
back to the queue for the others.
The ledger refuses to record a byte twice, and its `prefix` is the
watermark the store exposes for relaying.

Pure: no I/O, no clocks, no asyncio.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Sequence
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
    #: (pinned) a route's sub-flows run one after another, in their order
    #: here, on one connection; else each sub-flow at once on its own
    serial: bool = False

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
        in turn; `pinned`: each from its own, all at once."""
        if not senders:
            raise ValueError("a plan needs at least one sender")
        routes = [as_route(s) for s in senders]
        ranges = _ranges(size, missing)
        parts = max(1, min(parts or len(senders), sum(b - a for a, b in ranges) or 1))
        return cls(oid, size, tuple(_cut(ranges, parts, routes)), tuple(routes), pinned=pinned)

    @classmethod
    def dealt(cls, oid: Any, size: int, routes: Sequence[tuple[str, str] | Route],
              missing: Iterable[tuple[int, int]] | None = None, piece: int = 1) -> Plan:
        """Ethereal's split of one flow over several routes (rails, ECMP
        paths): the `missing` ranges (all of [0, size) by default) cut into
        equal pieces of at most `piece` bytes, as many for every route, and
        dealt to the routes in turn; each route pulls its own in order, all
        routes at once (`serial`). Each route carries an equal share, and
        as the pieces land in order the written prefix moves on, so a copy
        that is still being made (a relay's, a reduce step's output) is
        pulled as it grows, on every route."""
        if not routes:
            raise ValueError("a plan needs at least one route")
        ways = [as_route(r) for r in routes]
        return cls(oid, size, tuple(deal(_ranges(size, missing), ways, piece)), tuple(ways),
                   pinned=True, serial=True)

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
        ranges = _ranges(size, missing)
        routes = [as_route(s) for s in senders]
        flows = [_flow(lo, min(lo + piece, b), routes[i % len(routes)])
                 for i, (lo, b) in enumerate((lo, b) for a, b in ranges
                                             for lo in range(a, b, piece))]
        return cls(oid, size, tuple(flows), tuple(routes))

    @classmethod
    def striped(cls, oid: Any, size: int, stripes: Sequence[tuple[int, int, str, str]],
                missing: Iterable[tuple[int, int]], piece: int = 0,
                routes: Sequence[Route] = (), cut: Callable[[int, int], int] | None = None
                ) -> Plan:
        """A striped pull: of each stripe (start, end, sender, address), what
        `missing` lacks of it, from that stripe's sender, all at once, in
        messages of `piece` bytes. Where `routes` give a stripe's sender
        several (its rails and paths), that stripe's bytes are dealt over
        them as `dealt` does, in pieces of `cut(bytes, routes)`; the stripes'
        pieces alternate on a route two of them share."""
        missing = list(missing)
        dealt: list[list[SubFlow]] = []
        for start, end, sender, address in stripes:
            ranges = [(lo, hi) for a, b in missing if (lo := max(a, start)) < (hi := min(b, end))]
            ways = [r for r in routes if r[0] == sender]
            if len(ways) != 1 and (len(ways) < 2 or cut is None):
                ways = [(sender, address, "", -1)]
            piece_of = cut(sum(b - a for a, b in ranges), len(ways)) if len(ways) > 1 else 0
            dealt.append([replace(f, piece=piece) for f in (
                deal(ranges, ways, piece_of) if piece_of else
                [_flow(lo, hi, ways[0]) for lo, hi in ranges])])
        flows = tuple(f for turn in itertools.zip_longest(*dealt) for f in turn if f is not None)
        split = any(f.route != (f.sender, f.address, "", -1) for f in flows)
        return cls(oid, size, flows, tuple(dict.fromkeys(f.route for f in flows)), pinned=True,
                   spares=False, serial=split)

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


def _ranges(size: int, missing: Iterable[tuple[int, int]] | None) -> list[tuple[int, int]]:
    return [(0, size)] if missing is None else [(a, b) for a, b in missing if a < b]


def deal(ranges: Sequence[tuple[int, int]], routes: Sequence[Route], piece: int) -> list[SubFlow]:
    """`ranges` cut into equal pieces (within a byte) of at most `piece`
    bytes, a whole number of them per route, in order, the routes named in
    turn: route i of n takes pieces i, i + n, ..."""
    if piece < 1:
        raise ValueError(f"a piece has at least one byte; got {piece}")
    n = len(routes)
    return _cut(ranges, n * max(1, -(-sum(b - a for a, b in ranges) // (n * piece))), routes)


def _cut(ranges: Sequence[tuple[int, int]], parts: int, routes: Sequence[Route]) -> list[SubFlow]:
    """`ranges` in `parts` equal parts (within a byte; one may span several
    ranges, then a sub-flow each), part i from route i mod len(routes)."""
    total = sum(b - a for a, b in ranges)
    cuts = [total * i // parts for i in range(parts + 1)]  # in missing bytes
    flows: list[SubFlow] = []
    done = 0  # missing bytes before the current range
    for a, b in ranges:
        for i in range(parts):
            lo = max(a, a + cuts[i] - done)
            hi = min(b, a + cuts[i + 1] - done)
            if lo < hi:
                flows.append(_flow(lo, hi, routes[i % len(routes)]))
        done += b - a
    return flows


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
