"""The fluid engine: flows share links max-min fairly, and rates change only
when a flow starts or ends.

Between two events every flow moves at a constant rate, so the engine jumps
from event to event: the next start (a timer its driver set) or the next end.
At an event the rates are recomputed:

* flows started: progressive filling over every active flow;
* flows only ended: flows slower than the slowest one that ended keep their
  rates (progressive filling below that level sees the same links fill in
  the same order, since every link of an ended flow filled at its rate or
  later), so only the rest are filled again, in what the slower flows leave
  of each link. When the flows that end are the fastest, as when equal
  flows start together, nothing is recomputed at all.

A flow's remaining bytes are kept as of its last rate change, and its end
time sits in a calendar (sorted once per full recomputation, plus a heap of
the flows whose rate changed since), so an event costs what it changes, not
a pass over every flow.

Flows that would end within `merge` (a fraction) of the time since the last
event end together at the first of them, credited with their last bytes:
the same as running every flow exactly with each such flow's size reduced
by at most `merge` of the bytes it moved in that interval. The default
(1e-9) only merges ends that floating point tells apart.
"""

from __future__ import annotations

import heapq

import numpy as np

from .maxmin import SAME_LEVEL, max_min_rates
from .routes import RouteTable, csr_rows

MERGE = 1e-9
_FIELDS = (("up", np.int64), ("down", np.int64), ("route", np.int64), ("tag", np.int64),
           ("size", np.float64), ("rem", np.float64), ("since", np.float64),
           ("rate", np.float64), ("alive", bool), ("stamp", np.int64))


class FluidEngine:
    """Flows in slots of growing arrays; `add` queues flows that start at the
    current time, `advance` runs to the next event."""

    def __init__(self, capacity: np.ndarray, routes: RouteTable, *, merge: float = MERGE) -> None:
        self.cap = capacity
        self.routes = routes
        self.merge = merge
        self.t = 0.0
        self.n = 0          # slots used
        self.live = 0       # flows not ended
        for name, kind in _FIELDS:
            setattr(self, name, np.zeros(1024, dtype=kind))
        self._new: list[tuple[np.ndarray, ...]] = []
        self._ended_level: float | None = None
        self._gone: list[np.ndarray] = []    # slots ended since rates were last set
        self.load = np.zeros(len(capacity))
        self._order = np.zeros(0, np.int64)   # calendar: slots by end time ...
        self._ends = np.zeros(0)              # ... and those end times
        self._pos = 0
        self._moved: list[tuple[float, int, int]] = []   # (end, stamp, slot) heap
        self._stamps = 0    # a slot's stamp: 0 on the calendar, else its heap entry's
        #: counters for reports: events, full and partial recomputations
        self.events = self.full = self.partial = 0

    @property
    def active(self) -> int:
        return self.live + sum(len(batch[0]) for batch in self._new)

    def add(self, up: np.ndarray, down: np.ndarray, route: np.ndarray, nbytes: np.ndarray,
            tag: np.ndarray) -> None:
        """Queue flows (arrays, one entry per flow) that start now."""
        if len(up):
            self._new.append((up, down, route, nbytes, tag))

    # ------------------------------------------------------------- events ---
    def advance(self, until: float = np.inf) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Run to the next end, or to `until` if nothing ends before; return
        (tags, routes, bytes) of the flows that ended, in slot order."""
        self._settle()
        end = self._next_end()
        if end == np.inf or end > until:
            if until < np.inf:
                self.t = max(self.t, until)
            return self._end(np.zeros(0, np.int64))
        self.events += 1
        cutoff = end + self.merge * (end - self.t)
        self.t = end
        return self._end(self._due(cutoff))

    def _next_end(self) -> float:
        alive, moved = self.alive, self._moved
        while self._pos < len(self._order):
            slot = self._order[self._pos]
            if alive[slot] and self.stamp[slot] == 0:
                break
            self._pos += 1
        while moved and not (alive[moved[0][2]] and self.stamp[moved[0][2]] == moved[0][1]):
            heapq.heappop(moved)
        base = self._ends[self._pos] if self._pos < len(self._order) else np.inf
        return min(base, moved[0][0] if moved else np.inf)

    def _due(self, cutoff: float) -> np.ndarray:
        """Slots of the live flows that end by `cutoff`, taken off the calendar."""
        stop = int(np.searchsorted(self._ends, cutoff, side="right"))
        slots = self._order[self._pos:max(stop, self._pos)]
        self._pos = max(stop, self._pos)
        slots = slots[self.alive[slots] & (self.stamp[slots] == 0)]
        late = []
        while self._moved and self._moved[0][0] <= cutoff:
            _, stamp, slot = heapq.heappop(self._moved)
            if self.alive[slot] and self.stamp[slot] == stamp:
                late.append(slot)
        if late:
            slots = np.concatenate((slots, np.array(late, np.int64)))
        return np.sort(slots)

    def _end(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if len(slots):
            self.alive[slots] = False
            self.live -= len(slots)
            self._gone.append(slots)
            level = float(self.rate[slots].min())
            self._ended_level = (level if self._ended_level is None
                                 else min(level, self._ended_level))
        return self.tag[slots], self.route[slots], self.size[slots]

    # -------------------------------------------------------------- rates ---
    def _settle(self) -> None:
        """Recompute rates if flows started or ended since the last call."""
        if self._new:
            self._gone = []     # (the load is recomputed whole)
            self._append()
            self._recompute_all()
        elif self._ended_level is not None:
            gone = np.concatenate(self._gone)
            self._gone = []
            self.load -= self._link_load(gone, self.rate[gone])
            self._refill(self._ended_level)
        self._ended_level = None

    def _append(self) -> None:
        cols = [np.concatenate(c) for c in zip(*self._new, strict=True)]
        self._new = []
        k = len(cols[0])
        if self.n + k > len(self.up) or self.n > 2 * self.live + 1024:
            self._compact(self.n + k)
        a, b = self.n, self.n + k
        for name, col in zip(("up", "down", "route", "size", "tag"), cols, strict=True):
            getattr(self, name)[a:b] = col
        self.rem[a:b] = cols[3]
        self.since[a:b] = self.t
        self.alive[a:b] = True
        self.n, self.live = b, self.live + k

    def _compact(self, need: int) -> None:
        """Drop ended flows' slots, and make room for `need` - n more."""
        keep = np.flatnonzero(self.alive[:self.n])
        room = max(1024, 2 * (len(keep) + need - self.n))
        for name, kind in _FIELDS:
            grown = np.zeros(room, dtype=kind)
            grown[:len(keep)] = getattr(self, name)[keep]
            setattr(self, name, grown)
        self.n = len(keep)

    def _recompute_all(self) -> None:
        self.full += 1
        idx = np.flatnonzero(self.alive[:self.n])
        self._rebase(idx)
        self.rate[idx], self.load = max_min_rates(self.cap, self.up[idx], self.down[idx],
                                                  self.route[idx], self.routes.flat(),
                                                  with_load=True)
        ends = self.t + self.rem[idx] / self.rate[idx]
        order = np.argsort(ends, kind="stable")
        self._order, self._ends, self._pos = idx[order], ends[order], 0
        self.stamp[idx] = 0
        self._moved = []

    def _rebase(self, idx: np.ndarray) -> None:
        """Bring the remaining bytes of `idx` up to now."""
        self.rem[idx] -= self.rate[idx] * (self.t - self.since[idx])
        self.since[idx] = self.t

    def _refill(self, level: float) -> None:
        """After flows ended: refill the flows at `level` or faster in what the
        slower ones leave of each link."""
        live = self.alive[:self.n]
        redo = np.flatnonzero(live & (self.rate[:self.n] >= level * (1 - SAME_LEVEL)))
        if not len(redo):
            return
        self.partial += 1
        self._rebase(redo)
        old = self._link_load(redo, self.rate[redo])
        residual = np.maximum(self.cap - (self.load - old), 0.0)
        rates, new = max_min_rates(residual, self.up[redo], self.down[redo], self.route[redo],
                                   self.routes.flat(), with_load=True)
        self.rate[redo] = rates
        self.load += new - old
        ends = self.t + self.rem[redo] / rates
        self._stamps += 1
        stamps = self.stamp[redo] = self._stamps
        for end, slot in zip(ends.tolist(), redo.tolist(), strict=True):
            heapq.heappush(self._moved, (end, stamps, slot))

    def _link_load(self, slots: np.ndarray, rate: np.ndarray) -> np.ndarray:
        """Bytes/s that the flows in `slots` put on each link at `rate`."""
        links = len(self.cap)
        load = (np.bincount(self.up[slots], weights=rate, minlength=links)
                + np.bincount(self.down[slots], weights=rate, minlength=links))
        route = self.route[slots]
        has = route >= 0
        if has.any():
            used, per = np.unique(route[has], return_inverse=True)
            total = np.bincount(per.reshape(-1), weights=rate[has])
            ptr, link, weight = self.routes.flat()
            pos, owner = csr_rows(ptr, used)
            load += np.bincount(link[pos], weights=total[owner] * weight[pos], minlength=links)
        return load
