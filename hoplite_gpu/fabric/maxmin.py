"""Max-min fair rates of flows on links of fixed capacity, by progressive filling.

Every flow crosses its source's host uplink, its destination's host downlink
and the links of its route, each route link taking a fixed share (its weight)
of the flow's rate. All rates rise together; when a link is full, the flows
crossing it keep the rate they reached and the others go on rising. The work
per level is vectorised and touches only the links that fill and the flows
and routes crossing them, so a million flows cost a few passes over their
arrays plus a little per level.
"""

from __future__ import annotations

import numpy as np

from .routes import csr_rows

#: Links whose fair share is within this factor of the lowest fill together
#: (shares computed in floating point from the same numbers differ by ulps).
SAME_LEVEL = 1e-9


def _grouped(keys: np.ndarray, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, pointers): positions of `keys` sorted, and where each group starts."""
    # (NumPy sorts 16-bit keys by radix: linear in their number)
    small = keys.astype(np.int16) if groups < 1 << 15 else keys
    order = np.argsort(small, kind="stable")
    return order, np.searchsorted(keys[order], np.arange(groups + 1))


class _Problem:
    """One progressive filling: the flows' incidence, indexed both ways."""

    def __init__(self, capacity: np.ndarray, up: np.ndarray, down: np.ndarray,
                 route: np.ndarray, routes_flat: tuple[np.ndarray, np.ndarray, np.ndarray]):
        self.cap = capacity
        n, links = len(up), len(capacity)
        self.up, self.down = up, down
        # routes used here, renumbered 0..nr-1; flows with no route get nr (no links)
        used, local = np.unique(route, return_inverse=True)
        has = used >= 0
        self.nr = int(has.sum())
        remap = np.full(len(used), self.nr, dtype=np.int64)
        remap[has] = np.arange(self.nr)
        self.rl = remap[local.reshape(-1)]
        ptr, link, weight = routes_flat
        pos, owner = csr_rows(ptr, used[has])
        self.r_link, self.r_weight, self.r_owner = link[pos], weight[pos], owner
        lengths = np.bincount(owner, minlength=self.nr)
        self.r_ptr = np.concatenate(([0], np.cumsum(lengths)))
        # link -> flows through its host links; link -> routes; route -> flows
        ends = np.concatenate((up, down))
        order, self.hd_ptr = _grouped(ends, links)
        self.hd_flow = np.concatenate((np.arange(n), np.arange(n)))[order]
        order, self.lr_ptr = _grouped(self.r_link, links)
        self.lr_route = self.r_owner[order]
        self.rf_flow, self.rf_ptr = _grouped(self.rl, self.nr + 1)

    def _per_route(self, flows: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        return np.bincount(self.rl[flows], weights, minlength=self.nr + 1)[:self.nr]

    def _spread(self, per_route: np.ndarray, weighted: bool,
                touched: np.ndarray | None = None) -> np.ndarray:
        """Per link, the sum over routes of per_route[r] (times the link's
        weight in r, if `weighted`); over `touched` routes only, if given."""
        links = len(self.cap)
        if touched is None:
            times = per_route[self.r_owner]
            w = times * self.r_weight if weighted else times
            return np.bincount(self.r_link, weights=w, minlength=links)
        pos, owner = csr_rows(self.r_ptr, touched)
        times = per_route[touched][owner]
        w = times * self.r_weight[pos] if weighted else times
        return np.bincount(self.r_link[pos], weights=w, minlength=links)

    def _load(self, flows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(flows, weighted load) per link that `flows` put there, at rate 1."""
        links = len(self.cap)
        host = (np.bincount(self.up[flows], minlength=links)
                + np.bincount(self.down[flows], minlength=links)).astype(np.float64)
        per_route = self._per_route(flows).astype(np.float64)
        # (few flows of many routes, a million flows' levels: only their routes)
        touched = np.flatnonzero(per_route) if 16 * len(flows) < self.nr else None
        return (host + self._spread(per_route, False, touched),
                host + self._spread(per_route, True, touched))

    def link_load(self, rate: np.ndarray) -> np.ndarray:
        """Bytes/s on each link when the flows move at `rate`."""
        links = len(self.cap)
        host = (np.bincount(self.up, rate, minlength=links)
                + np.bincount(self.down, rate, minlength=links))
        return host + self._spread(self._per_route(np.arange(len(rate)), rate), True)

    def _crossing(self, links: np.ndarray, frozen: np.ndarray) -> np.ndarray:
        """The flows not frozen yet that cross one of `links`."""
        pos, _ = csr_rows(self.hd_ptr, links)
        hit = np.zeros(len(frozen) + 1, dtype=bool)
        hit[self.hd_flow[pos]] = True
        pos, _ = csr_rows(self.lr_ptr, links)
        routes = np.zeros(self.nr + 1, dtype=bool)
        routes[self.lr_route[pos]] = True
        pos, _ = csr_rows(self.rf_ptr, np.flatnonzero(routes))
        hit[self.rf_flow[pos]] = True
        hit[-1] = False
        hit[:-1] &= ~frozen
        return np.flatnonzero(hit)

    def solve(self) -> np.ndarray:
        n = len(self.up)
        rate = np.zeros(n)
        frozen = np.zeros(n, dtype=bool)
        count, weight = self._load(np.arange(n))
        filled = np.zeros(len(self.cap))
        share = np.full(len(self.cap), np.inf)
        while True:
            busy = count > 0.5
            share.fill(np.inf)
            share[busy] = (self.cap[busy] - filled[busy]) / weight[busy]
            level = share.min()
            if level == np.inf:
                return rate
            full = np.flatnonzero(share <= level * (1 + SAME_LEVEL))
            flows = self._crossing(full, frozen)
            rate[flows] = max(level, 0.0)
            frozen[flows] = True
            c, w = self._load(flows)
            count -= c
            weight -= w
            filled += level * w


def max_min_rates(capacity: np.ndarray, up: np.ndarray, down: np.ndarray, route: np.ndarray,
                  routes_flat: tuple[np.ndarray, np.ndarray, np.ndarray], *,
                  with_load: bool = False):
    """The max-min fair rate of each flow (bytes/s). Flow i crosses links
    `up[i]` and `down[i]` with weight 1 and the links of route `route[i]`
    (NO_ROUTE: none) with their weights; `routes_flat` is `RouteTable.flat()`.
    With `with_load`, also each link's load at those rates."""
    if len(up) == 0:
        rate = np.zeros(0)
        return (rate, np.zeros(len(capacity))) if with_load else rate
    problem = _Problem(capacity, up, down, route, routes_flat)
    rate = problem.solve()
    return (rate, problem.link_load(rate)) if with_load else rate
