"""The planning question end to end: check the root and members, bound the
rate (R*), pack trees, keep the fewest, and name them. Plans are cached by
(topology, root, members, options): pure functions of those."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

from ..topology.graph import Node, Topology, TopologyError
from .fewest import fewest_trees, least_count
from .packing import Packing, cut_bound
from .packing import pack as _pack
from .plan import FLOWS, Tree, TreePlan
from .routing import Network, TreeKey
from .widest import peel


def _question(call: str, topology: Topology, root: Node,
              members: Iterable[Node] | None) -> tuple[Node, ...]:
    """The members in the topology's order, checked."""
    if not isinstance(topology, Topology):
        raise TopologyError(f"{call}: expected a Topology; got {type(topology).__name__}")
    if root not in topology.nodes:
        what = "a relay, which holds no data" if topology.is_relay(root) else "not a node"
        raise TopologyError(f"{call}: root {root!r} is {what} of {topology.name}")
    if members is None:
        chosen = list(topology.nodes)
    else:
        chosen = list(members)
        for m in chosen:
            if m not in topology.nodes:
                what = "a relay, which holds no data" if topology.is_relay(m) else "not a node"
                raise TopologyError(f"{call}: member {m!r} is {what} of {topology.name}")
        if len(set(chosen)) != len(chosen):
            raise TopologyError(f"{call}: members {chosen!r} name a node twice")
        if root not in chosen:
            raise TopologyError(f"{call}: root {root!r} is not among the members {chosen!r}")
    if len(chosen) < 2:
        raise TopologyError(f"{call}: needs the root and at least one other member; "
                            f"got {chosen!r}")
    order = {n: i for i, n in enumerate(topology.nodes)}
    return tuple(sorted(chosen, key=order.__getitem__))


def _network(call: str, topology: Topology, root: Node, members: tuple[Node, ...],
             flow: str, *, reachable: bool = True) -> tuple[Network, float]:
    """The question by index, and R*; unless `reachable` is False, an error
    names the members the root cannot reach."""
    net = Network(_oriented(topology, flow), root, members, both_ways=flow == "allreduce")
    r_star, unreachable = cut_bound(net)
    if unreachable and reachable:
        names = ", ".join(str(net.names[v]) for v in unreachable)
        raise TopologyError(f"{call}: member(s) {names} cannot be reached from root {root!r} "
                            f"in {topology.name} over the links among the members and relays "
                            "(nodes outside the members carry nothing)")
    return net, r_star


def _oriented(topology: Topology, flow: str) -> Topology:
    if flow == "reduce":
        return topology.reversed()
    if flow == "allreduce":
        return topology.symmetrized()
    return topology


def bound(topology: Topology, root: Node, members: Iterable[Node] | None = None, *,
          flow: str = "broadcast") -> float:
    """R*: the least max-flow from the root to a member (to the root from a
    member for a reduce; both ways for an allreduce), over the links among the
    members and relays; 0 when the root cannot reach a member."""
    _check_flow("bound", flow)
    chosen = _question("bound", topology, root, members)
    return _network("bound", topology, root, chosen, flow, reachable=False)[1]


def pack(topology: Topology, root: Node, members: Iterable[Node] | None = None, *,
         flow: str = "broadcast", target: float = 0.005, max_loss: float = 0.01,
         fewest: bool = True) -> TreePlan:
    """Spanning trees of `members` (default: every node) rooted at `root`,
    with rates, over `topology`'s links.

    `flow` "broadcast" moves bytes from parent to child; "reduce" packs the
    trees over the links turned around (bytes from child to parent);
    "allreduce" over each link's smaller direction, so a tree can reduce up and
    broadcast down at once. The packing comes within `target` of the best
    tree packing (proven by a bound in the plan), then, with `fewest`, the
    fewest of its trees that lose at most `max_loss` of its rate are kept."""
    _check_flow("pack", flow)
    for name, value, top in (("target", target, 1.0), ("max_loss", max_loss, 1.0)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                0 < value < top if name == "target" else 0 <= value < top):
            raise TopologyError(f"pack: {name} must be a fraction in "
                                f"{'(0, 1)' if name == 'target' else '[0, 1)'}; got {value!r}")
    chosen = _question("pack", topology, root, members)
    return _cached_pack(topology, root, chosen, flow, float(target), float(max_loss),
                        bool(fewest))


def _check_flow(call: str, flow: str) -> None:
    if flow not in FLOWS:
        raise TopologyError(f"{call}: flow must be one of {', '.join(FLOWS)}; got {flow!r}")


@functools.lru_cache(maxsize=512)
def _cached_pack(topology: Topology, root: Node, members: tuple[Node, ...], flow: str,
                 target: float, max_loss: float, fewest: bool) -> TreePlan:
    net, r_star = _network("pack", topology, root, members, flow)
    packing = _pack(net, r_star, target=target)
    kept = _fewest(net, packing, max_loss) if fewest else list(packing.rates.items())
    kept = _direct(net, [(k, r) for k, r in kept if r > 0])
    trees = [_tree(net, k, r) for k, r in kept]
    trees.sort(key=lambda t: (-t.rate, [tuple(map(str, e)) for e in t.edges]))
    return TreePlan(root=root, members=members, flow=flow, bound=r_star,
                    upper=packing.upper, packed=packing.rate,
                    rate=math.fsum(t.rate for t in trees), trees=tuple(trees),
                    unit_bytes_per_s=topology.unit_bytes_per_s, rounds=packing.rounds,
                    candidates=len(packing.columns))


def _fewest(net: Network, packing: Packing, max_loss: float) -> list[tuple[TreeKey, float]]:
    """The fewest of the packing's trees (and of trees peeled off its load)
    that keep (1 - max_loss) of its rate, with their rates."""
    mine = list(packing.rates.items())
    if len(mine) < 2:
        return mine
    # The packing's load carries its rate, so wide trees grown on it tend to
    # carry it in few.
    load = [0.0] * len(net.caps)
    for k, r in mine:
        for e, n in packing.columns[k].items():
            load[e] += r * n
    for key, uses in peel(net, packing.rate, 2 * net.k, caps=load):
        packing.columns.setdefault(key, uses)
    keys = list(packing.columns)
    columns = [packing.columns[k] for k in keys]
    if len(mine) <= least_count(columns, net.caps, (1 - max_loss) * packing.rate):
        return mine
    rates = fewest_trees(columns, net.caps, packing.rate, max_loss=max_loss)
    if rates is None:  # no set within the solver's limits: the packing's own
        return mine
    return list(zip(keys, rates, strict=True))


def _direct(net: Network, kept: list[tuple[TreeKey, float]]) -> list[tuple[TreeKey, float]]:
    """Each edge routed through relays moves to a direct link between its
    ends where that link has the room: the same rates, over fewer hops (an
    NVLink rather than a PCIe path through the CPUs)."""
    load = [0.0] * len(net.caps)
    for key, rate in kept:
        for e, n in net.uses(key).items():
            load[e] += rate * n
    direct = {arc: i for i, arc in enumerate(net.arcs)}
    out = []
    for key, rate in kept:
        edges = list(key)
        for i, (p, c, path) in enumerate(edges):
            arc = direct.get((p, c))
            if len(path) < 2 or arc is None:
                continue
            link = net.link_of[arc]
            if load[link] + rate <= net.caps[link] * (1 + 1e-12):
                for e in path:
                    load[net.link_of[e]] -= rate
                load[link] += rate
                edges[i] = (p, c, (arc,))
        out.append((tuple(sorted(edges)), rate))
    return out


def _tree(net: Network, key: TreeKey, rate: float) -> Tree:
    """A tree by index as names: edges parents first, each with its path."""
    children: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    for p, c, path in key:
        children.setdefault(p, []).append((c, path))
    edges, paths, kinds = [], [], set()
    todo = [0]
    while todo:
        p = todo.pop(0)
        for c, path in children.get(p, []):
            edges.append((net.names[p], net.names[c]))
            paths.append(tuple([net.names[p]] + [net.names[net.arcs[e][1]] for e in path]))
            kinds.update(net.kinds[net.link_of[e]] for e in path)
            todo.append(c)
    return Tree(rate=rate, edges=tuple(edges), paths=tuple(paths), kinds=tuple(sorted(kinds)))
