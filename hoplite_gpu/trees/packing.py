"""Fractional packing of spanning trees: the most rate a set of trees rooted
at the root can carry over the links' capacities.

Multiplicative weights in the style of Garg and Koenemann: each link has a
length, 1/capacity at first; each round the oracle's cheapest tree takes its
bottleneck rate, and the lengths of the links it uses grow by a factor of
(1 + eps * share of their capacity). Every few rounds the linear program over
the trees found so far is solved exactly (HiGHS), and its dual prices pick
one more tree (column generation). Two upper bounds are kept: R*, the least
max-flow from the root to a member, and the best dual bound, sum(c * l) /
(cheapest tree's length) for any lengths l. The loop stops as soon as the
rate found is within `target` of the smaller bound: a proof, not a guess.
With every node a member, Edmonds' branching theorem makes the packing's
optimum equal R*.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..topology.deps import networkx, scipy_optimize
from .plan import PlanError
from .routing import Network, Oracle, TreeKey
from .widest import seeds

#: Growth of a fully used link's length per round.
EPS = 0.2
#: Rounds of multiplicative weights between two exact solves.
LP_EVERY = 4
#: Seconds an exact solve may take (milliseconds at these sizes).
LP_TIME_LIMIT_S = 10.0


@dataclass
class Packing:
    """The trees found, the rates of the best packing among them, and the
    bounds proven."""

    columns: dict[TreeKey, dict[int, int]] = field(default_factory=dict)
    rates: dict[TreeKey, float] = field(default_factory=dict)
    bound: float = 0.0
    upper: float = 0.0
    rounds: int = 0

    @property
    def rate(self) -> float:
        return sum(self.rates.values())


def cut_bound(net: Network) -> tuple[float, list[int]]:
    """R*, the least max-flow from the root to a member, over the members'
    and relays' links; and the members the root cannot reach."""
    nx = networkx()
    g = net.nx_graph()
    flows = {v: nx.maximum_flow_value(g, 0, v, capacity="capacity") for v in range(1, net.k)}
    return min(flows.values()), [v for v, f in flows.items() if f <= 0]


def pack(net: Network, bound: float, *, target: float = 0.005, max_rounds: int = 2000,
         seed: bool = True) -> Packing:
    """Trees and rates within `target` (relative) of the best tree packing,
    when `max_rounds` allows; `upper` is what is proven. With `seed`, wide
    trees (widest.py) are the first candidates."""
    oracle = Oracle(net)
    out = Packing(bound=bound, upper=bound)
    for key, uses in seeds(net, bound) if seed else ():
        out.columns.setdefault(key, uses)
    if out.columns:
        out.rounds = 1
        _solve_and_price(out, oracle, net.caps)
    weights = _Weights(net.caps)
    while not out.rate >= (1 - target) * out.upper and out.rounds < max_rounds:
        out.rounds += 1
        key, uses, length = oracle(weights.lengths)
        out.columns.setdefault(key, uses)
        out.upper = min(out.upper, weights.dual_bound(length))
        scaled = weights.route(key, uses)
        if sum(scaled.values()) > out.rate:
            out.rates = scaled
        if out.rounds % LP_EVERY == 0 and not out.rate >= (1 - target) * out.upper:
            _solve_and_price(out, oracle, net.caps)
    out.upper = max(out.upper, out.rate)  # (the solver's tolerances)
    return out


class _Weights:
    """Multiplicative weights: a length per link, and the flow routed so far."""

    def __init__(self, caps: list[float]) -> None:
        self.caps = caps
        self.lengths = [1.0 / c for c in caps]
        self.load = [0.0] * len(caps)
        self.flow: dict[TreeKey, float] = {}

    def dual_bound(self, cheapest: float) -> float:
        """sum(c * l) / (the cheapest tree's length): no packing carries more."""
        if cheapest <= 0:
            return float("inf")
        return sum(c * x for c, x in zip(self.caps, self.lengths, strict=True)) / cheapest

    def route(self, key: TreeKey, uses: dict[int, int]) -> dict[TreeKey, float]:
        """Route the tree at its bottleneck, lengthen the links it uses, and
        return the flow so far scaled down to fit the capacities."""
        rate = min(self.caps[e] / n for e, n in uses.items())
        self.flow[key] = self.flow.get(key, 0.0) + rate
        for e, n in uses.items():
            self.load[e] += rate * n
            self.lengths[e] *= 1 + EPS * rate * n / self.caps[e]
        congestion = max(x / c for x, c in zip(self.load, self.caps, strict=True))
        return {k: v / congestion for k, v in self.flow.items()}


def _solve_and_price(out: Packing, oracle: Oracle, caps: list[float]) -> None:
    """The best rates over the trees found (exact LP), then the tree its dual
    prices favour, and the bound those prices prove."""
    keys = list(out.columns)
    rates, duals = solve_lp([out.columns[k] for k in keys], caps)
    if sum(rates) > out.rate:
        out.rates = {k: r for k, r in zip(keys, rates, strict=True) if r > 0}
    key, uses, length = oracle(duals)
    out.columns.setdefault(key, uses)
    total = sum(c * y for c, y in zip(caps, duals, strict=True))
    if length > 0:
        out.upper = min(out.upper, total / length)


def solve_lp(columns: list[dict[int, int]], caps: list[float]) -> tuple[list[float], list[float]]:
    """Max total rate over the trees `columns` (uses of each link id) within
    `caps`: the rates, and the links' dual prices."""
    opt = scipy_optimize()
    from scipy.sparse import csr_array  # noqa: PLC0415

    rows, cols, vals = [], [], []
    for j, uses in enumerate(columns):
        for e, n in uses.items():
            rows.append(e)
            cols.append(j)
            vals.append(float(n))
    a = csr_array((vals, (rows, cols)), shape=(len(caps), len(columns)))
    res = opt.linprog([-1.0] * len(columns), A_ub=a, b_ub=caps, bounds=(0, None),
                      method="highs", options={"time_limit": LP_TIME_LIMIT_S})
    if res.status != 0:  # (x = 0 is feasible and the rates are bounded: not expected)
        raise PlanError(f"pack: HiGHS did not solve the packing LP of {len(columns)} trees "
                        f"within {LP_TIME_LIMIT_S} s: {res.message}")
    duals = [max(0.0, -y) for y in res.ineqlin.marginals]
    return [max(0.0, x) for x in res.x], duals
