"""`Topology`: a directed graph of link capacities among nodes (GPUs or hosts)
and the relays between them (switches, PCIe bridges, CPUs).

A *node* holds data: it receives bytes, keeps them and can send them on to
several others (a GPU, a host). A *relay* only forwards: a path may pass
through it, but it keeps nothing and makes no copies, so two trees' edges
through a switch each use the switch's links (an NVSwitch without multicast,
a PCIe switch, a CPU's root complex). Every link is directed and has a
capacity per direction in the topology's unit (`unit_bytes_per_s` bytes/s
when known) and a kind ("nvlink", "pcie", "smp", "net", ...).

The class imports the standard library alone; `graph()` builds a networkx
view on demand.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import HopliteError, InvalidArgument

#: A node's or relay's name: a GPU index, or a name.
Node = int | str


class TopologyError(InvalidArgument):
    """A topology, or a question about one, is malformed (unknown node, bad
    capacity, a root that is not a member, ...)."""


class TopologyUnavailable(HopliteError):
    """This machine's topology cannot be read (no NVML, no driver, no GPU)."""


@dataclass(frozen=True)
class Link:
    """One direction of a link: `capacity` units per second from `src` to `dst`."""

    src: Node
    dst: Node
    capacity: float
    kind: str = "link"


def _check_name(name: Any, what: str) -> Node:
    if isinstance(name, bool) or not isinstance(name, int | str) or name == "":
        raise TopologyError(f"{what}: a node is named by an int or a non-empty string; "
                            f"got {name!r}")
    return name


class Topology:
    """Nodes, relays and directed links with capacities; immutable and hashable
    (so plans can be cached by it)."""

    __slots__ = ("name", "nodes", "relays", "links", "unit_bytes_per_s", "notes",
                 "_cap", "_by_text", "_key")

    def __init__(self, nodes: Iterable[Node], links: Iterable[Link], *,
                 relays: Iterable[Node] = (), unit_bytes_per_s: float | None = None,
                 name: str = "topology", notes: Iterable[str] = ()) -> None:
        self.name = name
        self.nodes: tuple[Node, ...] = tuple(_check_name(n, f"{name}: nodes") for n in nodes)
        self.relays: tuple[Node, ...] = tuple(_check_name(n, f"{name}: relays") for n in relays)
        self.links: tuple[Link, ...] = tuple(links)
        self.notes: tuple[str, ...] = tuple(notes)
        if unit_bytes_per_s is not None and not 0 < unit_bytes_per_s < math.inf:
            raise TopologyError(f"{name}: unit_bytes_per_s must be positive and finite; "
                                f"got {unit_bytes_per_s!r}")
        self.unit_bytes_per_s = unit_bytes_per_s
        self._by_text: dict[str, Node] = {}
        for n in self.nodes + self.relays:
            if str(n) in self._by_text:
                raise TopologyError(f"{name}: node {n!r} is named twice (as "
                                    f"{self._by_text[str(n)]!r} and {n!r})")
            self._by_text[str(n)] = n
        self._cap: dict[tuple[Node, Node], Link] = {}
        for link in self.links:
            self._add(link)
        self._key = (self.nodes, self.relays,
                     tuple(sorted(((str(k[0]), str(k[1])), v.capacity, v.kind)
                                  for k, v in self._cap.items())),
                     unit_bytes_per_s)

    def _add(self, link: Link) -> None:
        if not isinstance(link, Link):
            raise TopologyError(f"{self.name}: links are Link(src, dst, capacity, kind); "
                                f"got {link!r}")
        where = f"{self.name}: link {link.src!r} -> {link.dst!r}"
        for end in (link.src, link.dst):
            if str(end) not in self._by_text or self._by_text[str(end)] != end:
                raise TopologyError(f"{where}: {end!r} is neither a node nor a relay")
        if link.src == link.dst:
            raise TopologyError(f"{where}: a link joins two different nodes")
        cap = link.capacity
        if isinstance(cap, bool) or not isinstance(cap, int | float) or not 0 < cap < math.inf:
            raise TopologyError(f"{where}: capacity must be a positive finite number; got {cap!r}")
        if (link.src, link.dst) in self._cap:
            raise TopologyError(f"{where}: given twice (give one link with the total capacity)")
        self._cap[(link.src, link.dst)] = link

    @classmethod
    def undirected(cls, nodes: Iterable[Node], pairs: Iterable[tuple[Node, Node, float, str]],
                   **kwargs: Any) -> Topology:
        """Each (a, b, capacity, kind) is a link with `capacity` in each direction."""
        links = []
        for a, b, cap, kind in pairs:
            links += [Link(a, b, cap, kind), Link(b, a, cap, kind)]
        return cls(nodes, links, **kwargs)

    # -- questions --------------------------------------------------------

    def capacity(self, src: Node, dst: Node) -> float:
        """Capacity of the direct link src -> dst; 0 when there is none."""
        link = self._cap.get((src, dst))
        return link.capacity if link else 0.0

    def link(self, src: Node, dst: Node) -> Link | None:
        return self._cap.get((src, dst))

    def is_relay(self, node: Node) -> bool:
        return node in self.relays

    def lookup(self, text: str, *, what: str = "node") -> Node:
        """The node or relay whose name reads `text` (the command line's "3" is GPU 3)."""
        try:
            return self._by_text[str(text)]
        except KeyError:
            raise TopologyError(f"{what} {text!r} is not in {self.name} (its nodes: "
                                f"{', '.join(map(str, self.nodes))})") from None

    def is_symmetric(self) -> bool:
        return all(self.capacity(b, a) == link.capacity for (a, b), link in self._cap.items())

    def kinds(self) -> tuple[str, ...]:
        return tuple(sorted({link.kind for link in self.links}))

    # -- derived topologies ----------------------------------------------

    def _derive(self, links: Iterable[Link], suffix: str) -> Topology:
        return Topology(self.nodes, links, relays=self.relays, name=f"{self.name} {suffix}",
                        unit_bytes_per_s=self.unit_bytes_per_s, notes=self.notes)

    def reversed(self) -> Topology:
        """Every link turned around: where a reduce's bytes flow when a
        broadcast's flow the other way."""
        return self._derive((Link(x.dst, x.src, x.capacity, x.kind) for x in self.links),
                            "(reversed)")

    def symmetrized(self) -> Topology:
        """Each direction at the smaller capacity of the two (a link one way
        only is dropped): where a tree can move bytes up and down at once."""
        links = [Link(x.src, x.dst, min(x.capacity, self.capacity(x.dst, x.src)), x.kind)
                 for x in self.links if self.capacity(x.dst, x.src) > 0]
        return self._derive(links, "(both ways)")

    def graph(self) -> Any:
        """A networkx DiGraph: nodes with attribute relay, edges with capacity and kind."""
        from .deps import networkx

        nx = networkx()
        g = nx.DiGraph(name=self.name)
        g.add_nodes_from(self.nodes, relay=False)
        g.add_nodes_from(self.relays, relay=True)
        for x in self.links:
            g.add_edge(x.src, x.dst, capacity=float(x.capacity), kind=x.kind)
        return g

    # -- identity ---------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return (f"Topology({self.name!r}, {len(self.nodes)} nodes, {len(self.relays)} relays, "
                f"{len(self.links)} directed links)")
