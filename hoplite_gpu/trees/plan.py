"""`TreePlan`: spanning trees of a group's members, each with a rate, and how
an object's bytes are split across them. Pure; the standard library alone.

A tree's edges are (parent, child) pairs; each edge has a path, the nodes it
passes from parent to child (relays between them, if any). In a broadcast
bytes flow from parent to child; in a reduce from child to parent along the
same path turned around; an allreduce does both at once, so each tree uses
its links in both directions at its rate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..topology.graph import Node, Topology, TopologyError

FLOWS = ("broadcast", "reduce", "allreduce")


class PlanError(TopologyError):
    """A plan does not hold on a topology (a tree that spans the wrong nodes,
    a link over its capacity, ...)."""


@dataclass(frozen=True)
class Tree:
    """One spanning tree of the members, rooted at the plan's root."""

    rate: float
    #: (parent, child), parents before their children
    edges: tuple[tuple[Node, Node], ...]
    #: per edge, the nodes from parent to child (relays in between, if any)
    paths: tuple[tuple[Node, ...], ...]
    #: the kinds of link its paths use ("nvlink", "pcie", ...)
    kinds: tuple[str, ...] = ()

    def hops(self) -> list[tuple[Node, Node]]:
        """The directed links of its paths, parent side first, with repeats."""
        return [(p[i], p[i + 1]) for p in self.paths for i in range(len(p) - 1)]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rate": self.rate, "edges": [list(e) for e in self.edges]}
        if any(len(p) > 2 for p in self.paths):
            out["paths"] = [list(p) for p in self.paths]
        out["kinds"] = list(self.kinds)
        return out


@dataclass(frozen=True)
class TreePlan:
    """Trees packed over a topology's links for one root and member set.

    `bound` is R*, the least max-flow from the root to a member (no schedule
    beats it); `upper` the best upper bound proven for packings of trees (at
    most `bound`; lower when relays, which copy nothing, make R* unreachable);
    `packed` the rate the packing reached; `rate` that of the trees kept (the
    fewest that keep `packed` within the loss allowed). Rates are in the
    topology's unit (`unit_bytes_per_s` bytes/s, when known)."""

    root: Node
    members: tuple[Node, ...]
    flow: str
    bound: float
    upper: float
    packed: float
    rate: float
    trees: tuple[Tree, ...]
    unit_bytes_per_s: float | None = None
    #: packing rounds (oracle calls) and distinct trees found
    rounds: int = 0
    candidates: int = 0

    def loads(self) -> dict[tuple[Node, Node], float]:
        """Rate on each directed link the plan uses, in its flow's direction(s)."""
        out: dict[tuple[Node, Node], float] = {}
        for tree in self.trees:
            for a, b in tree.hops():
                for link in _directions((a, b), self.flow):
                    out[link] = out.get(link, 0.0) + tree.rate
        return out

    def reversed(self) -> TreePlan:
        """The same trees with bytes flowing the other way: a broadcast's trees
        as a reduce's (or back). It holds where each link's reverse has the
        capacity (`check` says; a symmetric topology always does)."""
        if self.flow == "allreduce":
            raise PlanError("an allreduce plan already uses its trees both ways")
        flow = "reduce" if self.flow == "broadcast" else "broadcast"
        return replace(self, flow=flow)

    def split(self, size: int, *, align: int = 1,
              delays: Mapping[str, float] | None = None) -> list[tuple[int, int]]:
        """Byte ranges [start, end), one per tree in order, that cover [0, size)
        exactly, in proportion to the trees' rates; boundaries fall on
        multiples of `align`.

        With `delays` (seconds by link kind, e.g. {"pcie": 20e-6}) a tree starts
        after the largest delay of its kinds, and the split makes every tree
        finish at once: a slow-starting tree gets less, or nothing for a small
        object (needs `unit_bytes_per_s`)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise PlanError(f"TreePlan.split: size must be a whole number of bytes >= 0; "
                            f"got {size!r}")
        if isinstance(align, bool) or not isinstance(align, int) or align < 1:
            raise PlanError(f"TreePlan.split: align must be a whole number >= 1; got {align!r}")
        if not self.trees:
            raise PlanError("TreePlan.split: the plan has no trees")
        weights = [t.rate for t in self.trees]
        if delays:
            weights = self._timed_shares(size, delays)
        units = -(-size // align)
        counts = _apportion(units, weights)
        out, at = [], 0
        for n in counts:
            out.append((min(size, at * align), min(size, (at + n) * align)))
            at += n
        return out

    def _timed_shares(self, size: int, delays: Mapping[str, float]) -> list[float]:
        if self.unit_bytes_per_s is None:
            raise PlanError("TreePlan.split: delays need the topology's unit_bytes_per_s")
        for kind, d in delays.items():
            if not 0 <= d < math.inf:
                raise PlanError(f"TreePlan.split: delay of {kind!r} must be 0 or more seconds; "
                                f"got {d!r}")
        starts = [max((delays.get(k, 0.0) for k in t.kinds), default=0.0) for t in self.trees]
        speed = [t.rate * self.unit_bytes_per_s for t in self.trees]
        # Water-fill: the finish time T with sum over started trees of (T - start) * speed = size.
        order = sorted(range(len(starts)), key=lambda i: starts[i])
        used_speed = used = 0.0
        finish = 0.0
        for n, i in enumerate(order):
            used_speed += speed[i]
            used += speed[i] * starts[i]
            finish = (size + used) / used_speed
            if n + 1 == len(order) or finish <= starts[order[n + 1]]:
                break
        return [max(0.0, finish - starts[i]) * speed[i] for i in range(len(starts))]

    def check(self, topology: Topology, *, tolerance: float = 1e-6) -> None:
        """Raise PlanError unless every tree spans exactly the members from the
        root along links of `topology`, and no link carries more than its
        capacity (times 1 + tolerance)."""
        for n, tree in enumerate(self.trees):
            _check_tree(tree, n, self.root, self.members, topology, self.flow)
        for (a, b), load in self.loads().items():
            cap = topology.capacity(a, b)
            if load > cap * (1 + tolerance):
                raise PlanError(f"link {a!r} -> {b!r} carries {load:.6g}, over its capacity "
                                f"{cap:.6g}")
        total = sum(t.rate for t in self.trees)
        if not math.isclose(total, self.rate, rel_tol=1e-9, abs_tol=1e-12):
            raise PlanError(f"the trees' rates add up to {total:.6g}, not the plan's {self.rate:.6g}")

    def to_json(self) -> dict[str, Any]:
        return {"root": self.root, "members": list(self.members), "flow": self.flow,
                "bound": self.bound, "upper": self.upper, "packed": self.packed,
                "rate": self.rate, "unit_bytes_per_s": self.unit_bytes_per_s,
                "rounds": self.rounds, "candidates": self.candidates,
                "trees": [t.to_json() for t in self.trees]}


def _directions(link: tuple[Node, Node], flow: str) -> tuple[tuple[Node, Node], ...]:
    a, b = link
    if flow == "broadcast":
        return ((a, b),)
    if flow == "reduce":
        return ((b, a),)
    return ((a, b), (b, a))


def _apportion(units: int, weights: list[float]) -> list[int]:
    """`units` whole units in proportion to `weights` (largest remainder; ties
    to the earlier tree)."""
    total = sum(weights)
    if total <= 0:
        raise PlanError("TreePlan.split: the trees' rates add up to nothing")
    exact = [units * w / total for w in weights]
    counts = [math.floor(x) for x in exact]
    left = units - sum(counts)
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:left]:
        counts[i] += 1
    return counts


def _check_tree(tree: Tree, n: int, root: Node, members: tuple[Node, ...],
                topology: Topology, flow: str) -> None:
    where = f"tree {n}"
    if not tree.rate > 0:
        raise PlanError(f"{where}: rate {tree.rate!r} is not positive")
    if len(tree.paths) != len(tree.edges):
        raise PlanError(f"{where}: {len(tree.edges)} edges but {len(tree.paths)} paths")
    parent: dict[Node, Node] = {}
    for (p, c), path in zip(tree.edges, tree.paths, strict=True):
        if c in parent or c == root:
            raise PlanError(f"{where}: {c!r} has more than one parent, or is the root")
        parent[c] = p
        if path[0] != p or path[-1] != c:
            raise PlanError(f"{where}: the path of edge {p!r} -> {c!r} runs {path!r}")
        for hop in path[1:-1]:
            if not topology.is_relay(hop):
                raise PlanError(f"{where}: edge {p!r} -> {c!r} passes {hop!r}, not a relay")
        for i in range(len(path) - 1):
            for a, b in _directions((path[i], path[i + 1]), flow):
                if topology.capacity(a, b) <= 0:
                    raise PlanError(f"{where}: edge {p!r} -> {c!r} uses {a!r} -> {b!r}, "
                                    "which is not a link")
    if set(parent) | {root} != set(members) or set(parent.values()) - set(members):
        raise PlanError(f"{where}: spans {sorted(map(str, set(parent) | {root}))}, not the "
                        f"members {sorted(map(str, members))}")
    for c in parent:
        seen = set()
        while c != root:
            if c in seen:
                raise PlanError(f"{where}: a cycle through {c!r}")
            seen.add(c)
            c = parent[c]
