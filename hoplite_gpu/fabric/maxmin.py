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
from scipy.sparse import csr_matrix

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
        # route -> link as sparse matrices (weights, and ones to count flows):
        # a pass over many routes is one sparse product
        self._weights = csr_matrix((self.r_weight, self.r_link, self.r_ptr),
                                   shape=(self.nr, links)).T
        self._ones = csr_matrix((np.ones(len(pos)), self.r_link, self.r_ptr),
                                shape=(self.nr, links)).T
        # link -> flows through its host links; link -> routes; route -> flows
        ends = np.concatenate((up, down))
        order, self.hd_ptr = _grouped(ends, links)
        self.hd_flow = np.concatenate((np.arange(n), np.arange(n)))[order]
        order, self.lr_ptr = _grouped(self.r_link, links)
        self.lr_route = self.r_owner[order]
        self.rf_flow, self.rf_ptr = _grouped(self.rl, self.nr + 1)

    def _load(self, flows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(flows, weighted load) per link that `flows` put there, at rate 1."""
        links = len(self.cap)
        host = (np.bincount(self.up[flows], minlength=links)
                + np.bincount(self.down[flows], minlength=links)).astype(np.float64)
        if 4 * len(flows) >= self.nr:
            per_route = np.bincount(self.rl[flows], minlength=self.nr + 1)[:self.nr]
            per_route = per_route.astype(np.float64)
            return host + self._ones @ per_route, host + self._weights @ per_route
        # (few flows of many routes: only the routes they take)
        touched, per_route = np.unique(self.rl[flows], return_counts=True)
        keep = touched < self.nr
        touched, per_route = touched[keep], per_route[keep]
        pos, owner = csr_rows(self.r_ptr, touched)
        times = per_route[owner].astype(np.float64)
        count = host + np.bincount(self.r_link[pos], weights=times, minlength=links)
        weight = host + np.bincount(self.r_link[pos], weights=times * self.r_weight[pos],
                                    minlength=links)
        return count, weight

    def _crossing(self, links: np.ndarray) -> np.ndarray:
        """Every flow crossing one of `links` (repeats included)."""
        pos, _ = csr_rows(self.hd_ptr, links)
        via_host = self.hd_flow[pos]
        pos, _ = csr_rows(self.lr_ptr, links)
        routes = np.unique(self.lr_route[pos])
        pos, _ = csr_rows(self.rf_ptr, routes)
        return np.concatenate((via_host, self.rf_flow[pos]))

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
            flows = self._crossing(full)
            flows = np.unique(flows[~frozen[flows]])
            rate[flows] = max(level, 0.0)
            frozen[flows] = True
            c, w = self._load(flows)
            count -= c
            weight -= w
            filled += level * w


def max_min_rates(capacity: np.ndarray, up: np.ndarray, down: np.ndarray, route: np.ndarray,
                  routes_flat: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """The max-min fair rate of each flow (bytes/s). Flow i crosses links
    `up[i]` and `down[i]` with weight 1 and the links of route `route[i]`
    (NO_ROUTE: none) with their weights; `routes_flat` is `RouteTable.flat()`."""
    if len(up) == 0:
        return np.zeros(0)
    return _Problem(capacity, up, down, route, routes_flat).solve()
