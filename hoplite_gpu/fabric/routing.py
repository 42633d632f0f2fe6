"""How flows between hosts are laid on the fabric's equal-cost paths.

* `Ecmp`: the whole flow on one middle drawn at random (a seeded stand-in
  for a switch's hash of the flow's headers), independently per flow.
* `Spray`: ideal packet spraying: the flow split evenly over every middle
  of its pair of leaves, as one fluid flow whose rate every middle shares
  equally (round-robin packets give each path the same share of the flow).
* `Ethereal`: the flow split on arrival into equal sub-flows, each a
  single-path flow of its own on the middle that is least loaded now.

Ethereal's load is bytes, as in the paper: per link, the bytes of the
sub-flows assigned to it that have not ended yet. A sub-flow goes to the
middle whose most loaded link is least loaded; ties go to the middle whose
most loaded link has carried the fewest bytes in all (every sub-flow ever
assigned), then to the first middle. Flows are assigned in the order they
start (the order their driver sent them at one instant), so the choice is
deterministic. A source that starts f flows at one instant splits each into
ceil(u / f) sub-flows, u being its leaf's working uplinks (at most
`subflows`, at most the pair's number of middles), so that it starts at
least u sub-flows; with f >= u nothing is split.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from .routes import NO_ROUTE, RouteTable, csr_rows
from .topology import Fabric

ROUTINGS = ("ecmp", "spray", "ethereal")
#: How flows were laid out: per part, (index of its flow, route id, bytes).
Parts = tuple[np.ndarray, np.ndarray, np.ndarray]


class Router:
    """Lays flows on routes of `routes` (a table shared with the engine)."""

    name = ""

    def __init__(self, fabric: Fabric, routes: RouteTable) -> None:
        self.fabric = fabric
        self.routes = routes
        self._pairs: dict[int, tuple[int, int]] = {}   # leaf pair -> (first route, paths)

    def assign(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> Parts:
        """The parts of flows that start at the same instant (arrays, one entry
        per flow)."""
        raise NotImplementedError

    def ended(self, route: np.ndarray, nbytes: np.ndarray) -> None:
        """Parts on `route` of `nbytes` ended."""

    def _pair_keys(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        leaf = self.fabric.host_leaf
        a, b = leaf[src], leaf[dst]
        return a * self.fabric.leaves + b, a != b

    def _first_routes(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per flow, the id of its pair's first middle's route and how many
        middles the pair has (its routes are consecutive)."""
        uniq, inv = np.unique(keys, return_inverse=True)
        first = np.empty(len(uniq), np.int64)
        count = np.empty(len(uniq), np.int64)
        leaves = self.fabric.leaves
        for i, key in enumerate(uniq.tolist()):
            got = self._pairs.get(key)
            if got is None:
                a, b = divmod(key, leaves)
                middles = self.fabric.middles(a, b)
                got = self._pairs[key] = (int(self.routes.paths((a, b), middles)[0]),
                                          len(middles))
            first[i], count[i] = got
        inv = inv.reshape(-1)
        return first[inv], count[inv]


class Ecmp(Router):
    name = "ecmp"

    def __init__(self, fabric: Fabric, routes: RouteTable, seed: int = 0) -> None:
        super().__init__(fabric, routes)
        self._rng = np.random.default_rng(seed)

    def assign(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> Parts:
        keys, cross = self._pair_keys(src, dst)
        route = np.full(len(src), NO_ROUTE, np.int64)
        if cross.any():
            first, count = self._first_routes(keys[cross])
            draw = self._rng.random(len(first))
            route[cross] = first + np.minimum((draw * count).astype(np.int64), count - 1)
        return np.arange(len(src)), route, nbytes


class Spray(Router):
    name = "spray"

    def assign(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> Parts:
        keys, cross = self._pair_keys(src, dst)
        route = np.full(len(src), NO_ROUTE, np.int64)
        uniq, inv = np.unique(keys[cross], return_inverse=True)
        ids = np.array([self._spray(*divmod(key, self.fabric.leaves)) for key in uniq.tolist()],
                       dtype=np.int64)
        route[cross] = ids[inv.reshape(-1)] if len(uniq) else route[cross]
        return np.arange(len(src)), route, nbytes

    def _spray(self, a: int, b: int) -> int:
        def even() -> tuple[np.ndarray, np.ndarray]:
            middles = self.fabric.middles(a, b)
            links, times = np.unique(middles, return_counts=True)
            return links, times / len(middles)
        return self.routes.get(("spray", a, b), even)


class Ethereal(Router):
    name = "ethereal"

    def __init__(self, fabric: Fabric, routes: RouteTable, subflows: int | None = None) -> None:
        super().__init__(fabric, routes)
        if subflows is not None and (isinstance(subflows, bool) or not isinstance(subflows, int)
                                     or subflows < 1):
            raise InvalidArgument(f"Ethereal: subflows must be a whole number of at least 1; "
                                  f"got {subflows!r}")
        self.subflows = subflows
        self.active = np.zeros(fabric.links)   # bytes of sub-flows not ended, per link
        self.total = np.zeros(fabric.links)    # bytes of every sub-flow assigned, per link

    def assign(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> Parts:
        keys, cross = self._pair_keys(src, dst)
        starting = np.bincount(src, minlength=self.fabric.hosts)[src]
        first = np.zeros(len(src), np.int64)
        count = np.zeros(len(src), np.int64)
        if cross.any():
            first[cross], count[cross] = self._first_routes(keys[cross])
        leaf = self.fabric.host_leaf
        flow, route, size = [], [], []
        for i, (c, f) in enumerate(zip(cross.tolist(), first.tolist(), strict=True)):
            if not c:
                flow.append(i), route.append(NO_ROUTE), size.append(float(nbytes[i]))
                continue
            a, b = int(leaf[src[i]]), int(leaf[dst[i]])
            middles = self.fabric.middles(a, b)
            u = self.fabric.uplinks(a)
            parts = max(1, min(-(-u // int(starting[i])), len(middles), self.subflows or u))
            piece = float(nbytes[i]) / parts
            for _ in range(parts):
                j = self._least_loaded(middles)
                links = middles[j]
                self.active[links] += piece
                self.total[links] += piece
                flow.append(i), route.append(f + j), size.append(piece)
        return np.array(flow, np.int64), np.array(route, np.int64), np.array(size)

    def _least_loaded(self, middles: np.ndarray) -> int:
        now = self.active[middles].max(axis=1)
        best = now.min()
        tied = np.flatnonzero(now <= best + 1e-9 * max(best, 1.0))
        if len(tied) == 1:
            return int(tied[0])
        ever = self.total[middles[tied]].max(axis=1)
        return int(tied[np.argmin(ever)])

    def ended(self, route: np.ndarray, nbytes: np.ndarray) -> None:
        has = route >= 0
        if has.any():
            ptr, link, _ = self.routes.flat()
            pos, owner = csr_rows(ptr, route[has])
            np.subtract.at(self.active, link[pos], nbytes[has][owner])


def make_router(name: str, fabric: Fabric, routes: RouteTable, *, seed: int = 0,
                subflows: int | None = None) -> Router:
    if name == "ecmp":
        return Ecmp(fabric, routes, seed)
    if name == "spray":
        return Spray(fabric, routes)
    if name == "ethereal":
        return Ethereal(fabric, routes, subflows)
    raise InvalidArgument(f"make_router: routing must be one of {', '.join(ROUTINGS)}; "
                          f"got {name!r}")
