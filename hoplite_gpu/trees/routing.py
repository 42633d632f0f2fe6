"""One planning question by index, and the packing's oracle: the cheapest
spanning tree of the members under a length per link.

Only the members and the relays take part: a node that is not a member is
someone else's GPU and carries nothing. A tree's edge joins two members,
directly or along a path whose inner nodes are relays (which forward but do
not copy), so each edge uses every link of its path. The cheapest tree is
then Edmonds' minimum spanning arborescence over the members, each pair
weighted by its shortest relay path: exact, since each edge's path can be
chosen on its own.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from ..topology.deps import networkx
from ..topology.graph import Node, Topology

#: A tree, by index: ((parent, child, arc ids of its path), ...), sorted.
TreeKey = tuple[tuple[int, int, tuple[int, ...]], ...]


class Network:
    """Members (index 0 is the root) and relays by index. An *arc* is a
    directed hop a path may take (none runs into the root); a *link* is the
    capacity arcs use: one per arc, or with `both_ways` one per pair of
    nodes, shared by both its arcs (an allreduce's trees carry bytes both
    ways, so a tree's edge uses the pair's capacity whichever way it points)."""

    def __init__(self, topology: Topology, root: Node, members: Sequence[Node], *,
                 both_ways: bool = False) -> None:
        self.names: list[Node] = [root] + [m for m in members if m != root] + list(topology.relays)
        self.k = len(members)
        index = {n: i for i, n in enumerate(self.names)}
        self.arcs: list[tuple[int, int]] = []
        self.link_of: list[int] = []
        self.caps: list[float] = []
        self.kinds: list[str] = []
        self.out: list[list[tuple[int, int]]] = [[] for _ in self.names]
        links: dict[object, int] = {}
        for link in topology.links:
            a, b = index.get(link.src), index.get(link.dst)
            if a is None or b is None or (b == 0 and not both_ways):
                continue
            pair = frozenset((a, b)) if both_ways else (a, b)
            if pair not in links:
                links[pair] = len(self.caps)
                self.caps.append(float(link.capacity))
                self.kinds.append(link.kind)
            if b != 0:
                self.out[a].append((b, len(self.arcs)))
                self.arcs.append((a, b))
                self.link_of.append(links[pair])
        self.relayed = len(self.names) > self.k

    def uses(self, edges) -> dict[int, int]:
        """How many times a tree's (parent, child, arcs) edges use each link."""
        out: dict[int, int] = {}
        for _, _, path in edges:
            for arc in path:
                e = self.link_of[arc]
                out[e] = out.get(e, 0) + 1
        return out

    def nx_graph(self):
        """The members and relays as a networkx DiGraph, arcs with capacities."""
        g = networkx().DiGraph()
        g.add_nodes_from(range(len(self.names)))
        for (a, b), e in zip(self.arcs, self.link_of, strict=True):
            g.add_edge(a, b, capacity=self.caps[e])
        return g

    def routes_from(self, p: int, lengths: Sequence[float]) -> dict[int, tuple[float, tuple]]:
        """Shortest paths from member p to each other member (not the root)
        whose inner nodes are relays (`lengths` per link): member -> (length,
        arc ids)."""
        if not self.relayed:
            return {b: (lengths[self.link_of[e]], (e,)) for b, e in self.out[p]}
        dist = {p: 0.0}
        via: dict[int, int] = {}
        heap = [(0.0, p)]
        while heap:
            d, u = heapq.heappop(heap)
            if d > dist[u] or (u != p and u < self.k):
                continue  # stale, or a member: a path ends there
            for v, e in self.out[u]:
                nd = d + lengths[self.link_of[e]]
                if nd < dist.get(v, math.inf):
                    dist[v] = nd
                    via[v] = e
                    heapq.heappush(heap, (nd, v))
        out = {}
        for c in range(1, self.k):
            if c != p and c in via:
                path, at = [], c
                while at != p:
                    e = via[at]
                    path.append(e)
                    at = self.arcs[e][0]
                out[c] = (dist[c], tuple(reversed(path)))
        return out


class Oracle:
    """The cheapest spanning tree of the members rooted at index 0 under a
    length per link (networkx's Edmonds)."""

    def __init__(self, net: Network) -> None:
        self.net = net
        nx = networkx()
        self._arborescence = nx.minimum_spanning_arborescence
        self.overlay = nx.DiGraph()
        self.overlay.add_nodes_from(range(net.k))
        ones = [1.0] * len(net.caps)
        for p in range(net.k):
            for c in net.routes_from(p, ones):
                self.overlay.add_edge(p, c, weight=1.0)

    def __call__(self, lengths: Sequence[float]) -> tuple[TreeKey, dict[int, int], float]:
        """(tree, uses of each link, the tree's length)."""
        routes = {}
        for p in range(self.net.k):
            for c, (d, path) in self.net.routes_from(p, lengths).items():
                routes[(p, c)] = path
                self.overlay[p][c]["weight"] = d
        tree = self._arborescence(self.overlay, attr="weight", preserve_attrs=False)
        key = tuple(sorted((p, c, routes[(p, c)]) for p, c in tree.edges))
        uses = self.net.uses(key)
        return key, uses, sum(lengths[e] * n for e, n in uses.items())
