"""How flows between hosts are laid on the fabric's equal-cost paths.

* `Ecmp`: the whole flow on one middle drawn at random (a seeded stand-in
  for a switch's hash of the flow's headers), independently per flow.
* `Spray`: ideal packet spraying: the flow split evenly over every middle
  of its pair of leaves, as one fluid flow whose rate every middle shares
  equally (round-robin packets give each path the same share of the flow).
* `Ethereal`: the flow split on arrival into equal sub-flows, each a
  single-path flow of its own on the middle that is least loaded now.

Ethereal's load is bytes, as in the paper: per link, the bytes of the
sub-flows assigned to it that have not ended yet. A sub-flow's middle is
chosen tier by tier (the paper's divide and conquer): first the pair of
links it takes out of its source leaf and into its destination leaf (a
spine, or a fat-tree's aggregation switches), the pair whose more loaded
link is least loaded (or whose least loaded way on through the core, if
that is more loaded: a pair behind a failed core link has fewer ways);
then, among the middles through that pair, the one whose most loaded core
link is least loaded. A flow's sub-flows take
distinct outer pairs while there are some it has not used, so a flow split
into u sub-flows puts one on each uplink. Ties go to the choice whose most
used link has carried the fewest bytes in all (every sub-flow ever
assigned), then to the first. Flows are assigned in the order they start
(the order their driver sent them at one instant), so the choice is
deterministic. A source that starts f flows at one instant splits each into
ceil(u / f) sub-flows, u being its leaf's working uplinks (at most
`subflows`, at most the pair's number of middles), so that it starts
at least u sub-flows; with f >= u nothing is split.
"""

from __future__ import annotations

import numpy as np

from ..balance import least_loaded
from ..errors import InvalidArgument
from .routes import NO_ROUTE, RouteTable
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
        # (plain lists: a sub-flow's choice reads a few dozen of them, which
        # Python does faster than NumPy's per-call cost)
        self.active = [0.0] * fabric.links   # bytes of sub-flows not ended, per link
        self.total = [0.0] * fabric.links    # bytes of every sub-flow assigned, per link
        self._tiers_of: dict[tuple[int, int], tuple] = {}
        self._links_of: dict[int, tuple[int, ...]] = {}

    def assign(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> Parts:
        keys, cross = self._pair_keys(src, dst)
        starting = np.bincount(src, minlength=self.fabric.hosts)[src].tolist()
        first = np.zeros(len(src), np.int64)
        if cross.any():
            first[cross] = self._first_routes(keys[cross])[0]
        leaf = self.fabric.host_leaf
        a_of, b_of = leaf[src].tolist(), leaf[dst].tolist()
        flow, route, size = [], [], []
        for i, (f, a, b, n) in enumerate(zip(first.tolist(), a_of, b_of, nbytes.tolist(),
                                             strict=True)):
            if a == b:
                flow.append(i), route.append(NO_ROUTE), size.append(n)
                continue
            tiers = self._tiers(a, b)
            u = self.fabric.uplinks(a)
            parts = max(1, min(-(-u // starting[i]), tiers[0], self.subflows or u))
            piece = n / parts
            used: set[int] = set()
            for _ in range(parts):
                j, links = self._least_loaded(tiers, 1e-6 * piece, used)
                for link in links:
                    self.active[link] += piece
                    self.total[link] += piece
                flow.append(i), route.append(f + j), size.append(piece)
        return np.array(flow, np.int64), np.array(route, np.int64), np.array(size)

    def _tiers(self, a: int, b: int) -> tuple:
        """(number of middles, outer link pairs, per pair its middles as (index,
        inner links, all links)) of a pair of leaves: a middle's outer pair is
        its first and last link, its inner links the rest."""
        got = self._tiers_of.get((a, b))
        if got is None:
            middles = self.fabric.middles(a, b).tolist()
            groups: dict[tuple[int, int], list] = {}
            for j, links in enumerate(middles):
                groups.setdefault((links[0], links[-1]), []).append(
                    (j, tuple(links[1:-1]), tuple(links)))
            got = self._tiers_of[a, b] = (len(middles), list(groups), list(groups.values()))
        return got

    def _least_loaded(self, tiers: tuple, tol: float,
                      used: set[int]) -> tuple[int, tuple[int, ...]]:
        """A middle for the next sub-flow of a flow whose earlier sub-flows took
        the outer pairs in `used` (which it avoids while others are left)."""
        _, pairs, members = tiers
        if len(used) == len(pairs):
            used.clear()
        free = [i for i in range(len(pairs)) if i not in used]
        pick = self._pick_pair(free, pairs, members, tol)
        used.add(pick)
        g = members[pick]
        if len(g) == 1 or not g[0][1]:
            return g[0][0], g[0][2]
        best = g[self._pick([inner for _, inner, _ in g], tol)]
        return best[0], best[2]

    def _pick_pair(self, free: list[int], pairs: list, members: list, tol: float) -> int:
        """The outer pair (of `free`) for a sub-flow: a pair is as loaded as its
        more loaded link, or as its least loaded way on through the core if
        that is busier (a pair behind a failed core link has fewer ways, which
        fill sooner). Pairs are looked at from the least loaded outer links
        up, and only while they could still tie the best."""
        act = self.active
        outer = {i: max(act[pairs[i][0]], act[pairs[i][1]]) for i in free}
        best, seen = np.inf, {}
        for i in sorted(free, key=outer.__getitem__):
            if outer[i] > best + tol:
                break
            way = min(max([act[x] for x in inner], default=0.0) for _, inner, _ in members[i])
            seen[i] = max(outer[i], way)
            best = min(best, seen[i])
        keys, tot = sorted(seen), self.total
        return keys[least_loaded([seen[i] for i in keys],
                                 lambda j: max(tot[pairs[keys[j]][0]], tot[pairs[keys[j]][1]]),
                                 tol)]

    def _pick(self, options: list[tuple[int, ...]], tol: float) -> int:
        """The option (a tuple of links) whose most loaded link is least loaded;
        among ties, the one whose most used link carried least in all; then
        the first."""
        act, tot = self.active, self.total
        return least_loaded([max([act[link] for link in links]) for links in options],
                            lambda i: max([tot[link] for link in options[i]]), tol)

    def ended(self, route: np.ndarray, nbytes: np.ndarray) -> None:
        act, links_of = self.active, self._links_of
        for r, n in zip(route.tolist(), nbytes.tolist(), strict=True):
            if r < 0:
                continue
            links = links_of.get(r)
            if links is None:
                links = links_of[r] = tuple(self.routes.row(r)[0].tolist())
            for link in links:
                act[link] -= n


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
