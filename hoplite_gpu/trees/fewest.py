"""The fewest trees that keep a packing's rate: a MILP (SciPy's HiGHS) over
the trees the packing found.

Each tree has a rate (continuous, at most its bottleneck) and a binary "kept";
the links' capacities hold; the kept trees carry at least (1 - max_loss) of
the packing's rate. The objective counts kept trees, less a small reward for
rate (too small to trade a tree for), so among the fewest the fastest wins.
The solver stops at `node_limit` branch-and-bound nodes or `time_limit`
seconds; then the best set found is kept, and without one the packing's own.
"""

from __future__ import annotations

from ..topology.deps import scipy_optimize
from .packing import solve_lp

#: Branch-and-bound nodes, and seconds, the MILP may take.
NODE_LIMIT = 200
TIME_LIMIT_S = 2.0


def least_count(columns: list[dict[int, int]], caps: list[float], needed: float) -> int:
    """A lower bound on how many of the trees carry `needed`: each carries at
    most its bottleneck."""
    necks = sorted((min(caps[e] / k for e, k in u.items()) for u in columns), reverse=True)
    total = 0.0
    for count, neck in enumerate(necks, 1):
        total += neck
        if total >= needed * (1 - 1e-12):
            return count
    return len(necks)


def fewest_trees(columns: list[dict[int, int]], caps: list[float], packed: float, *,
                 max_loss: float, node_limit: int = NODE_LIMIT,
                 time_limit: float = TIME_LIMIT_S) -> list[float] | None:
    """Rates per column (0 for trees dropped), or None when the solver found
    no set within its limits."""
    opt = scipy_optimize()
    c, a, lower, upper, high = _model(columns, caps, packed, max_loss)
    n = len(columns)
    # (presolve off: HiGHS 1.x printf()s a debugging line to stdout when it
    # maps a presolved model's solution back; off, it does so far more
    # rarely, and these models are small. `hoplite-gpu topology` mutes it.)
    res = opt.milp(c, constraints=opt.LinearConstraint(a, lower, upper),
                   integrality=[0] * n + [1] * n, bounds=opt.Bounds(0, high),
                   options={"node_limit": node_limit, "time_limit": time_limit,
                            "presolve": False})
    if res.x is None:
        return None
    keep = [j for j in range(n) if res.x[n + j] > 0.5]
    # The kept trees at their best rates (the MILP's are within its tolerances).
    rates, _ = solve_lp([columns[j] for j in keep], caps)
    out = [0.0] * n
    for j, r in zip(keep, rates, strict=True):
        out[j] = r
    return out


def _model(columns: list[dict[int, int]], caps: list[float], packed: float, max_loss: float):
    """Variables: a rate per tree, then a binary per tree; rates in units of
    the packed rate (the solver's tolerances are absolute). Returns the
    objective, the constraint matrix, its bounds and the variables' bounds."""
    import numpy as np  # noqa: PLC0415 - SciPy's own dependency
    from scipy.sparse import csr_array, diags_array, hstack, vstack  # noqa: PLC0415

    n = len(columns)
    scaled = np.asarray(caps, dtype=float) / packed
    rows, cols, vals = [], [], []
    for j, uses in enumerate(columns):
        for e, k in uses.items():
            rows.append(e)
            cols.append(j)
            vals.append(float(k))
    uses = csr_array((vals, (rows, cols)), shape=(len(caps), n))
    neck = np.array([min(scaled[e] / k for e, k in u.items()) for u in columns])
    a = vstack([
        hstack([uses, csr_array((len(caps), n))]),      # each link's capacity
        hstack([diags_array(np.ones(n)), diags_array(-neck)]),  # rate <= bottleneck * kept
        hstack([csr_array(np.ones((1, n))), csr_array((1, n))]),  # the rate kept
    ]).tocsr()
    lower = np.concatenate([np.full(len(caps) + n, -np.inf), [1 - max_loss]])
    upper = np.concatenate([scaled, np.zeros(n), [np.inf]])
    # (the rate kept is about 1 at most, so the reward never outweighs a tree)
    reward = 0.5 / (1 + max_loss)
    c = np.concatenate([np.full(n, -reward), np.ones(n)])
    return c, a, lower, upper, np.concatenate([neck, np.ones(n)])
