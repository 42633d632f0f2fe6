"""Wide trees, peeled off one after another: candidates that let a few trees
carry the whole rate.

A packing's lengths favour stars (the cheapest tree under equal lengths
hangs everything off the cheapest sender), but the fewest trees are usually
wide chains: on a DGX-1V, the two directions of the NV2 ring and of the NV1
ring carry all 150 GB/s in four trees; through an NVSwitch one chain of all
GPUs carries a GPU's full port rate. So before the packing, trees are grown
greedily over what capacity is left: depth first, each step to the member
reached by the widest route (relays in between), never below the width the
widest tree (grown Prim-style) reaches; each takes its bottleneck rate and
the next is grown on the rest. Greedy: they seed the packing and the choice
of the fewest; the packing's bounds, not these, prove the rate.
"""

from __future__ import annotations

import heapq
import math

from .routing import Network, TreeKey

#: A tree is peeled only while it carries at least this share of R*.
MIN_SHARE = 1e-3


def _widest_routes(net: Network, src: int, free: list[float], uses: dict[int, int],
                   seen: set[int]) -> dict[int, tuple[float, tuple[int, ...]]]:
    """Per member not in `seen`: the widest route from src, as arcs (the
    width of an arc: what is free on its link over the link's uses so far
    plus one; the fewest arcs among equally wide routes), inner nodes relays."""
    best = {src: (math.inf, 0)}
    via: dict[int, int] = {}
    heap = [(-math.inf, 0, src)]
    while heap:
        w, hops, u = heapq.heappop(heap)
        if (-w, -hops) < (best[u][0], -best[u][1]) or (u != src and u < net.k):
            continue
        for v, e in net.out[u]:
            if v < net.k and (v in seen or v == 0):
                continue
            link = net.link_of[e]
            nw = min(-w, free[link] / (uses.get(link, 0) + 1))
            old = best.get(v, (0.0, 0))
            if nw > 0 and (nw > old[0] or (nw == old[0] and hops + 1 < old[1])):
                best[v] = (nw, hops + 1)
                via[v] = e
                heapq.heappush(heap, (-nw, hops + 1, v))
    out = {}
    for c in range(1, net.k):
        if c not in seen and c in via:
            path, at = [], c
            while at != src:
                path.append(via[at])
                at = net.arcs[via[at]][0]
            out[c] = (best[c][0], tuple(reversed(path)))
    return out


def _grow(net: Network, free: list[float], floor: float, depth_first: bool
          ) -> tuple[list[tuple[int, int, tuple[int, ...]]], dict[int, int]] | None:
    """A spanning tree whose every step is at least `floor` wide (None if the
    greedy growth gets stuck): depth first, or Prim-style (the widest step
    from any member reached)."""
    seen, uses, edges = {0}, {}, []
    stack = [0]
    while len(seen) < net.k:
        best = None
        for x in (stack[-1:] if depth_first else sorted(seen)):
            for c, (w, path) in _widest_routes(net, x, free, uses, seen).items():
                rank = (w, -len(path), -c)
                if w >= floor and (best is None or rank > best[0]):
                    best = (rank, x, c, path)
        if best is None:
            if depth_first and len(stack) > 1:
                stack.pop()
                continue
            return None
        _, x, c, path = best
        edges.append((x, c, path))
        for arc in path:
            link = net.link_of[arc]
            uses[link] = uses.get(link, 0) + 1
        seen.add(c)
        stack.append(c)
    return edges, uses


def seeds(net: Network, bound: float) -> list[tuple[TreeKey, dict[int, int]]]:
    """Wide trees over the fastest kind of link alone (NVLink), then over the
    other kinds alone (PCIe and what joins the CPUs): trees a runtime drives
    one way each; then over every link, on what they left."""
    fastest: dict[str, float] = {}
    for cap, kind in zip(net.caps, net.kinds, strict=True):
        fastest[kind] = max(cap, fastest.get(kind, 0.0))
    free = list(net.caps)
    out = []
    if len(fastest) > 1:
        first = min(fastest, key=lambda k: (-fastest[k], k))
        for fast in (True, False):
            mine = [e for e, k in enumerate(net.kinds) if (k == first) == fast]
            only = [0.0] * len(free)
            for e in mine:
                only[e] = free[e]
            out += peel(net, bound, 2 * net.k, only)
            for e in mine:
                free[e] = only[e]
    return out + peel(net, bound, 2 * net.k, free)


def peel(net: Network, bound: float, limit: int, caps: list[float] | None = None
         ) -> list[tuple[TreeKey, dict[int, int]]]:
    """Up to `limit` wide trees, each grown on the capacity (`caps`, default
    the links'; the list is used up in place) the ones before it left, with
    its uses of each link."""
    free = list(net.caps) if caps is None else caps
    out = []
    for _ in range(limit):
        prim = _grow(net, free, bound * MIN_SHARE, depth_first=False)
        if prim is None:
            break
        floor = min(free[e] / n for e, n in prim[1].items())
        grown = _grow(net, free, floor * (1 - 1e-9), depth_first=True) or prim
        edges, uses = grown
        rate = min(free[e] / n for e, n in uses.items())
        if rate < bound * MIN_SHARE:
            break
        for e, n in uses.items():
            free[e] -= rate * n
        out.append((tuple(sorted(edges)), uses))
    return out
