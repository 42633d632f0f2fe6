"""Two CLOS fabrics as directed graphs of link capacities: a k-ary fat-tree and a
two-tier leaf-spine, with failed cables removed.

Every host hangs off one switch, its *leaf* (a fat-tree's edge switch); a host
link is a pair of directed links (host -> leaf, leaf -> host). The equal-cost
paths between two hosts are the shortest up/down paths through the switches
that avoid failed links: the host's uplink, a *middle* from its leaf to the
other host's leaf, and the other host's downlink. Middles are enumerated per
pair of leaves when first asked for and cached, so nothing is enumerated for
all pairs up front (a 1,024-host fat-tree has 16,256 pairs of edge switches,
64 middles each between pods).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidArgument

#: A link's layer: which cut of the fabric it belongs to.
HOST_UP, HOST_DOWN, LEAF_UP, LEAF_DOWN, CORE_UP, CORE_DOWN = range(6)
LAYER_NAMES = ("host-up", "host-down", "leaf-up", "leaf-down", "core-up", "core-down")


@dataclass(eq=False)
class Fabric:
    """Nodes, directed links and the hosts of one fabric. Build it with
    `fat_tree` or `leaf_spine`; link ids index `capacity`, `layer`, `ends`."""

    kind: str
    #: bytes/s of each directed link; a failed link keeps its id with capacity 0
    capacity: np.ndarray
    #: LAYER of each link
    layer: np.ndarray
    #: (from node, to node) names of each link
    ends: list[tuple[str, str]]
    #: host -> its leaf's index; leaf -> its pod's index (0 for leaf-spine)
    host_leaf: np.ndarray
    leaf_pod: np.ndarray
    host_up: np.ndarray
    host_down: np.ndarray
    #: ids of the failed links (both directions of each failed cable)
    failed: frozenset[int]
    #: what built it, for reports: k, or hosts per leaf, leaves, spines, ...
    params: dict
    _index: dict[tuple[str, str], int] = field(repr=False, default_factory=dict)
    _middles: dict[tuple[int, int], np.ndarray] = field(repr=False, default_factory=dict)
    _owner: np.ndarray | None = field(repr=False, default=None)
    _uplinks: np.ndarray | None = field(repr=False, default=None)

    @property
    def hosts(self) -> int:
        return len(self.host_leaf)

    @property
    def links(self) -> int:
        return len(self.capacity)

    @property
    def leaves(self) -> int:
        return len(self.leaf_pod)

    def link(self, a: str, b: str) -> int:
        """The id of the directed link from node `a` to node `b`."""
        try:
            return self._index[a, b]
        except KeyError:
            raise InvalidArgument(f"Fabric.link: no link from {a!r} to {b!r}") from None

    def middles(self, leaf_a: int, leaf_b: int) -> np.ndarray:
        """The equal-cost middles from leaf `leaf_a` to leaf `leaf_b`: an int
        array (paths x hops) of link ids, each avoiding every failed link;
        (1 x 0) for the same leaf. Cached per pair of leaves."""
        key = (leaf_a, leaf_b)
        got = self._middles.get(key)
        if got is None:
            got = self._enumerate(leaf_a, leaf_b)
            if len(got) == 0:
                raise InvalidArgument(
                    f"Fabric.middles: the failed links {self.describe_failed()} leave no "
                    f"shortest path from leaf {leaf_a} to leaf {leaf_b}")
            self._middles[key] = got
        return got

    def _enumerate(self, a: int, b: int) -> np.ndarray:
        if a == b:
            return np.zeros((1, 0), dtype=np.int64)
        paths = np.array([[self._index[u, v] for u, v in hops]
                          for hops in self._hops(a, b)], dtype=np.int64)
        if self.failed:
            paths = paths[~np.isin(paths, list(self.failed)).any(axis=1)]
        return paths

    def _hops(self, a: int, b: int) -> list[list[tuple[str, str]]]:
        p = self.params
        if self.kind == "leaf-spine":
            return [[(f"leaf{a}", f"spine{s}"), (f"spine{s}", f"leaf{b}")]
                    for s in range(p["spines"])]
        half = p["k"] // 2
        pa, pb = int(self.leaf_pod[a]), int(self.leaf_pod[b])
        ea, eb = f"edge{a}", f"edge{b}"
        if pa == pb:
            return [[(ea, f"agg{pa * half + g}"), (f"agg{pa * half + g}", eb)]
                    for g in range(half)]
        return [[(ea, f"agg{pa * half + g}"), (f"agg{pa * half + g}", f"core{g * half + c}"),
                 (f"core{g * half + c}", f"agg{pb * half + g}"), (f"agg{pb * half + g}", eb)]
                for g in range(half) for c in range(half)]

    def uplinks(self, leaf: int) -> int:
        """How many of a leaf's links towards the spine or aggregation layer work."""
        if self._uplinks is None:
            working = (self.layer == LEAF_UP) & (self.capacity > 0)
            self._uplinks = np.bincount(self.owner()[working], minlength=self.leaves)
        return int(self._uplinks[leaf])

    def cut(self, layer: int, group: int) -> np.ndarray:
        """The working links of one cut: HOST_UP/HOST_DOWN of host `group`,
        LEAF_UP/LEAF_DOWN of leaf `group`, CORE_UP/CORE_DOWN of pod `group`."""
        if layer == HOST_UP:
            return self.host_up[group:group + 1]
        if layer == HOST_DOWN:
            return self.host_down[group:group + 1]
        return np.flatnonzero((self.layer == layer) & (self.owner() == group)
                              & (self.capacity > 0))

    def owner(self) -> np.ndarray:
        """Per link, the host, leaf or pod whose cut it is in (see `cut`)."""
        if self._owner is None:
            half = self.params.get("k", 2) // 2
            number = {}
            for i in range(self.hosts):
                number[f"h{i}"] = i
            for i in range(self.leaves):
                number[f"edge{i}"] = number[f"leaf{i}"] = i
                number[f"agg{i}"] = i // half       # (a fat-tree has as many aggs as edges)
            below = [u if lay % 2 == 0 else v for (u, v), lay in zip(self.ends, self.layer,
                                                                  strict=True)]
            self._owner = np.array([number[n] for n in below], dtype=np.int64)
        return self._owner

    def describe_failed(self) -> str:
        cables = sorted({tuple(sorted(self.ends[i])) for i in self.failed})
        return ", ".join(f"{u}-{v}" for u, v in cables) or "(none)"

    def describe(self) -> str:
        p = self.params
        if self.kind == "fat-tree":
            shape = f"fat-tree k={p['k']}"
        else:
            shape = (f"leaf-spine {p['leaves']} leaves x {p['hosts_per_leaf']} hosts, "
                     f"{p['spines']} spines, oversubscription {p['oversubscription']:g}")
        failed = f", failed: {self.describe_failed()}" if self.failed else ""
        return f"{shape} ({self.hosts} hosts, {p['host_bps'] / 1e9:g} GB/s host links{failed})"


class _Builder:
    """Collects nodes' links while a fabric is built."""

    def __init__(self) -> None:
        self.ends: list[tuple[str, str]] = []
        self.capacity: list[float] = []
        self.layer: list[int] = []

    def cable(self, a: str, b: str, bps: float, up: int, down: int) -> tuple[int, int]:
        """A cable between `a` (below) and `b` (above): two directed links."""
        ids = []
        for ends, lay in (((a, b), up), ((b, a), down)):
            ids.append(len(self.ends))
            self.ends.append(ends)
            self.capacity.append(bps)
            self.layer.append(lay)
        return ids[0], ids[1]

    def build(self, kind: str, host_leaf: list[int], leaf_pod: list[int],
              host_links: list[tuple[int, int]], params: dict, failed: object,
              seed: int | None) -> Fabric:
        index = {e: i for i, e in enumerate(self.ends)}
        capacity = np.array(self.capacity, dtype=np.float64)
        layer = np.array(self.layer, dtype=np.int8)
        dead = _failed_links(self.ends, layer, index, failed, seed, kind)
        capacity[list(dead)] = 0.0
        ups, downs = zip(*host_links, strict=True)
        return Fabric(kind, capacity, layer, list(self.ends), np.array(host_leaf),
                      np.array(leaf_pod), np.array(ups), np.array(downs), frozenset(dead),
                      dict(params), index)


def _failed_links(ends: list[tuple[str, str]], layer: np.ndarray,
                  index: dict[tuple[str, str], int], failed: object, seed: int | None,
                  kind: str) -> set[int]:
    """Link ids of the failed cables, both directions. `failed` is a count of
    switch-to-switch cables to fail, chosen at random with `seed`, or a list of
    (node, node) cables."""
    where = f"{kind}: failed"
    cables = [i for i, lay in enumerate(layer) if lay in (LEAF_UP, CORE_UP)]
    if failed is None:
        return set()
    if isinstance(failed, numbers.Integral) and not isinstance(failed, bool):
        if not 0 <= failed <= len(cables):
            raise InvalidArgument(f"{where} must be 0 to {len(cables)} switch-to-switch "
                                  f"cables; got {failed}")
        chosen = np.random.default_rng(seed).choice(len(cables), size=int(failed), replace=False)
        picked = [ends[cables[i]] for i in sorted(chosen)]
    else:
        try:
            picked = [(str(a), str(b)) for a, b in failed]
        except (TypeError, ValueError):
            raise InvalidArgument(f"{where} must be a count or a list of (node, node) cables; "
                                  f"got {failed!r}") from None
    dead: set[int] = set()
    for a, b in picked:
        if (a, b) not in index or (b, a) not in index:
            raise InvalidArgument(f"{where}: no cable between {a!r} and {b!r}")
        if layer[index[a, b]] in (HOST_UP, HOST_DOWN):
            raise InvalidArgument(f"{where}: {a!r}-{b!r} is a host's own link; only "
                                  "switch-to-switch cables can fail (a host without its "
                                  "link is not in the fabric)")
        dead.update((index[a, b], index[b, a]))
    return dead


def _check_bps(where: str, host_bps: float) -> None:
    if isinstance(host_bps, bool) or not (isinstance(host_bps, numbers.Real)
                                          and 0 < host_bps < math.inf):
        raise InvalidArgument(f"{where}: host_bps must be a positive number of bytes/s; "
                              f"got {host_bps!r}")


def _count(where: str, name: str, value: object, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise InvalidArgument(f"{where}: {name} must be a whole number of at least {least}; "
                              f"got {value!r}")
    return int(value)


def fat_tree(k: int, *, host_bps: float = 1.25e9, failed: object = None,
             seed: int | None = 0) -> Fabric:
    """A k-ary fat-tree (k even): k pods of k/2 edge and k/2 aggregation
    switches, (k/2)^2 core switches, k^3/4 hosts; every link `host_bps`
    (non-blocking). Edge switch e is leaf e; aggregation switch g of pod p is
    agg{p*k/2+g}, linked to cores core{g*k/2+c}. `failed`: a count of
    switch-to-switch cables failed at random (`seed`), or a list of cables."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 2 or k % 2:
        raise InvalidArgument(f"fat_tree: k must be an even whole number of at least 2; got {k!r}")
    _check_bps("fat_tree", host_bps)
    half, b = k // 2, _Builder()
    host_leaf, host_links = [], []
    for e in range(k * half):
        for j in range(half):
            host_links.append(b.cable(f"h{e * half + j}", f"edge{e}", host_bps, HOST_UP, HOST_DOWN))
            host_leaf.append(e)
    for p in range(k):
        for e in range(p * half, (p + 1) * half):
            for g in range(half):
                b.cable(f"edge{e}", f"agg{p * half + g}", host_bps, LEAF_UP, LEAF_DOWN)
        for g in range(half):
            for c in range(half):
                b.cable(f"agg{p * half + g}", f"core{g * half + c}", host_bps, CORE_UP, CORE_DOWN)
    leaf_pod = [e // half for e in range(k * half)]
    return b.build("fat-tree", host_leaf, leaf_pod, host_links,
                   {"k": k, "host_bps": float(host_bps)}, failed, seed)


def leaf_spine(hosts_per_leaf: int, leaves: int, spines: int, *, oversubscription: float = 1.0,
               host_bps: float = 1.25e9, failed: object = None, seed: int | None = 0) -> Fabric:
    """A two-tier leaf-spine: `leaves` leaves of `hosts_per_leaf` hosts, each
    leaf linked once to each of `spines` spines. Host links carry `host_bps`;
    a leaf-spine link carries hosts_per_leaf * host_bps / (spines *
    oversubscription), so a leaf's uplinks together carry 1/oversubscription
    of what its hosts can send."""
    where = "leaf_spine"
    h = _count(where, "hosts_per_leaf", hosts_per_leaf)
    n_leaves = _count(where, "leaves", leaves)
    u = _count(where, "spines", spines)
    _check_bps(where, host_bps)
    x = oversubscription
    if isinstance(x, bool) or not (isinstance(x, numbers.Real) and 0 < x < math.inf):
        raise InvalidArgument(f"{where}: oversubscription must be a positive ratio; got {x!r}")
    b = _Builder()
    host_leaf, host_links = [], []
    for leaf in range(n_leaves):
        for j in range(h):
            host_links.append(b.cable(f"h{leaf * h + j}", f"leaf{leaf}", host_bps,
                                      HOST_UP, HOST_DOWN))
            host_leaf.append(leaf)
    uplink = h * host_bps / (u * x)
    for leaf in range(n_leaves):
        for s in range(u):
            b.cable(f"leaf{leaf}", f"spine{s}", uplink, LEAF_UP, LEAF_DOWN)
    params = {"hosts_per_leaf": h, "leaves": n_leaves, "spines": u,
              "oversubscription": float(x), "host_bps": float(host_bps)}
    return b.build("leaf-spine", host_leaf, [0] * n_leaves, host_links, params, failed, seed)
