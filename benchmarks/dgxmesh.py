"""An emulated GPU mesh on one machine, from network namespaces: one
namespace per GPU of a `Topology` (the DGX-1V fixture unless told), one veth
pair per linked pair of GPUs, each end's egress shaped with `tc tbf` to the
link's multiplicity x `unit_bps` (multiplicity: the link's capacity over the
topology's smallest link capacity, so on the DGX-1V an NV1 link is 1 unit
and an NV2 link 2). The pairs and capacities are the topology's own, so a
topology file with other links builds its own mesh.

A member set (an allocation such as GPUs 0, 1 and 4) makes only the
members' namespaces and the links among them: links to GPUs outside the
allocation are absent, as Blink's trees use only links among the allocation.
Rank i runs in the namespace of the i-th member.

Addresses, all inside the namespaces made here:
- each namespace's host address, 10.66.0.<i + 1>/32, on an interface of
  its own named `eth0`, a bridge with no ports (a dummy interface, where
  the kernel may lack the dummy module): the directory, control traffic
  and OpenMPI use it, and `benchmarks.payload.eth0_address` reads which
  namespace a rank ran in;
- link k (in the order of `pairs`) is the /30 10.67.<k // 64>.<4 (k % 64)>:
  .1 on its lower-indexed end, .2 on the other; its interface in namespace i
  is `to<j>`, j the index of the GPU at its other end.

Every namespace forwards (`ip_forward`), with reverse-path filtering off,
and has a static route to every other's host address: over the direct link
where one exists, otherwise along a fixed path through other members (the
fewest hops; among those the widest, its slowest link the fastest; then the
lowest GPU indices). On the full DGX-1V every non-adjacent pair is two hops
apart through a common neighbour. A pair's path is the same both ways, so
replies come back the way requests went, and routes carry the host address
as their source. A hoplite-gpu node lists its host address first and then
one address per link (`node_hosts`): peers on a shared link meet on its /30
(`hoplite_gpu.node.rails`), others at the host address, along the route.

Needs root and iproute2; everything is torn down on exit, on error and on
Ctrl-C, and the namespaces of a run killed outright are swept by the next.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
from collections.abc import Sequence
from typing import Any

from . import emulated
from .emulated import EmulatedCluster, Namespaces, _sh, run_prefix

#: A namespace this harness makes: "dm<tag>x<n>" then "g<i>" or "probe"; the
#: tag is the making process's id modulo 100000, n counts the meshes that
#: process made, so two meshes never share a name.
_OURS = re.compile(r"dm(\d+)x\d+(?:g\d+|probe)")
_RUNS = itertools.count()
#: One unit (an NV1 link on the DGX-1V), bit/s: a full-mesh broadcast then
#: moves 7 x 6 units at once, which 2 cores forward and shape with room left.
DEFAULT_UNIT_BPS = 40e6
#: The most nodes a mesh may have (host addresses are 10.66.0.1 to .254).
MAX_NODES = 254


class DgxMesh(Namespaces):
    """The mesh of `topology` (default: the DGX-1V fixture) among `members`
    (default: all its nodes, in its order), one unit `unit_bps` bit/s."""

    OURS = _OURS
    WHAT = "the emulated mesh"

    def __init__(self, topology: Any = None, *, unit_bps: float = DEFAULT_UNIT_BPS,
                 members: Sequence[Any] | None = None) -> None:
        from hoplite_gpu.topology import Topology, fixture

        where = "DgxMesh"
        full = fixture("dgx1v") if topology is None else topology
        if not isinstance(full, Topology):
            raise ValueError(f"{where}: topology must be a hoplite_gpu.topology.Topology; "
                             f"got {type(full).__name__}")
        if full.relays:
            raise ValueError(f"{where}: topology {full.name!r} has relays ({list(full.relays)}): "
                             "the mesh joins GPUs by direct links only")
        if not full.links:
            raise ValueError(f"{where}: topology {full.name!r} has no links")
        if isinstance(unit_bps, bool) or not isinstance(unit_bps, int | float) \
                or not math.isfinite(unit_bps) or unit_bps < 1000:
            raise ValueError(f"{where}: unit_bps must be a finite number of at least 1000 bit/s "
                             f"(tc reads a negative rate as no shaping); got {unit_bps!r}")
        self.members = _members(where, full, members)
        self.unit_bps = float(unit_bps)
        #: what `benchmarks.netbench` reads as a link's rate: one unit
        self.bandwidth_bps = self.unit_bps
        #: the capacity that is one unit: the full topology's smallest link
        self.base = min(link.capacity for link in full.links)
        self.full = full
        self.topology = restricted(full, self.members)
        #: the topology its trees are packed over: `topology` itself, or what
        #: probing the built links measured (`dgxmeshrun.probe_topology`)
        self.planned = self.topology
        self.hosts = len(self.members)
        self._index = {node: i for i, node in enumerate(self.members)}
        #: linked pairs (i, j), i < j, in order: pair k is link k
        self.pairs: list[tuple[int, int]] = []
        for i, a in enumerate(self.members):
            for j in range(i + 1, self.hosts):
                b = self.members[j]
                there, back = self.topology.capacity(a, b), self.topology.capacity(b, a)
                if (there > 0) != (back > 0):
                    one_way = f"{a} -> {b}" if there else f"{b} -> {a}"
                    raise ValueError(f"{where}: the link {one_way} goes one way only; a veth "
                                     "pair carries both ways, so give both directions")
                if there:
                    self.pairs.append((i, j))
        for i, j in self.pairs:
            for a, b in ((i, j), (j, i)):
                if self.rate_bps(a, b) < 1000:
                    raise ValueError(f"{where}: link {self.members[a]} -> {self.members[b]} "
                                     f"would be shaped to {self.rate_bps(a, b):g} bit/s, below "
                                     "1000; raise unit_bps")
        self._paths = _fixed_paths(where, self.topology, self.members)
        self._names(run_prefix("dm", _RUNS))

    # ------------------------------------------------------------ layout ---
    def ns(self, i: int) -> str:
        """Rank `i`'s namespace (`<prefix>g<i>`)."""
        return f"{self.prefix}g{i}"

    def address(self, i: int) -> str:
        """Rank `i`'s host address (on its own `eth0`, a bridge with no ports)."""
        return f"10.66.0.{i + 1}"

    def link_address(self, i: int, j: int) -> str:
        """Rank `i`'s address on its link to rank `j`."""
        k = self.pairs.index((min(i, j), max(i, j)))
        return f"10.67.{k // 64}.{4 * (k % 64) + (1 if i < j else 2)}"

    def multiplicity(self, i: int, j: int) -> float:
        """The link from rank `i` to rank `j` in units (0: no link)."""
        return self.topology.capacity(self.members[i], self.members[j]) / self.base

    def rate_bps(self, i: int, j: int) -> float:
        """What the link from rank `i` to rank `j` is shaped to, bit/s."""
        return self.multiplicity(i, j) * self.unit_bps

    def neighbours(self, i: int) -> list[int]:
        return [j for pair in self.pairs if i in pair for j in pair if j != i]

    def path(self, i: int, j: int) -> list[int]:
        """The ranks a packet from rank `i` to rank `j` visits, both ends included."""
        return list(self._paths[i, j])

    def node_hosts(self, i: int) -> str:
        """Rank `i`'s `HOPLITE_NODE_HOST`: its host address, then one per link."""
        return ",".join([f"{self.address(i)}/32",
                         *(f"{self.link_address(i, j)}/30" for j in self.neighbours(i))])

    def describe(self) -> str:
        kinds = sorted({self.multiplicity(i, j) for i, j in self.pairs})
        routed = sum(1 for (i, j), p in self._paths.items() if i < j and len(p) > 2)
        return (f"{self.hosts} GPUs of {self.full.name} ({', '.join(map(str, self.members))}), "
                f"{len(self.pairs)} links of {', '.join(f'{k:g}' for k in kinds)} units, "
                f"1 unit = {self.unit_bps / 1e6:g} Mbit/s; {routed} pairs routed through others")

    def report(self) -> dict:
        """The mesh as the results file keeps it."""
        return {"topology": self.full.name, "members": list(self.members),
                "unit_bps": self.unit_bps, "base_capacity": self.base,
                "links": [{"a": self.members[i], "b": self.members[j],
                           "units": self.multiplicity(i, j)} for i, j in self.pairs],
                "routed": {f"{self.members[i]}-{self.members[j]}":
                           [self.members[k] for k in p]
                           for (i, j), p in sorted(self._paths.items()) if i < j and len(p) > 2}}

    # ------------------------------------------------------------ set-up ---
    def _build(self) -> None:
        for i in range(self.hosts):
            ns = self.ns(i)
            self._add_ns(ns)
            _sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1",
                "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0",
                # (no IPv6: its neighbour discovery would count on the links)
                "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
            # (a bridge with no ports stands for a dummy interface, which
            # kernels without the dummy module lack)
            _batch(ns, ["link set lo up", "link add eth0 type bridge",
                        f"addr add {self.address(i)}/32 dev eth0", "link set eth0 up"])
        for i, j in self.pairs:
            # Made inside the two namespaces at once: nothing of it is ever in
            # ours, so deleting the namespaces removes all of it.
            _sh("ip", "link", "add", f"to{j}", "netns", self.ns(i), "type", "veth",
                "peer", "name", f"to{i}", "netns", self.ns(j))
        for i in range(self.hosts):
            ns, lines = self.ns(i), []
            for j in self.neighbours(i):
                lines += [f"addr add {self.link_address(i, j)}/30 dev to{j}",
                          f"link set to{j} up"]
            for j in range(self.hosts):
                if j != i:
                    hop = self._paths[i, j][1]
                    lines.append(f"route add {self.address(j)}/32 via "
                                 f"{self.link_address(hop, i)} dev to{hop} "
                                 f"src {self.address(i)}")
            _batch(ns, lines)
            _batch(ns, [f"qdisc add dev to{j} root tbf rate {int(self.rate_bps(i, j))}bit "
                        "burst 256kb latency 100ms"
                        for j in self.neighbours(i)], tool="tc")

    # ------------------------------------------------------------- use ---
    def measure_link(self, nbytes: int = 8 << 20, *, src: int = 0, dst: int = 1) -> float:
        """Bits per second of one TCP stream from rank `src` to rank `dst`'s host
        address (`EmulatedCluster.measure_link`): over their link where they
        have one, else along their route."""
        return EmulatedCluster.measure_link(self, nbytes, src=src, dst=dst)

    def _stats(self, i: int) -> dict[str, dict]:
        out = _sh("ip", "-n", self.ns(i), "-j", "-s", "link", "show").stdout
        return {d["ifname"]: d["stats64"] for d in json.loads(out)}

    def link_bytes(self) -> dict[tuple[Any, Any], int]:
        """Bytes so far on every directed link, keyed by its ends' GPU names
        ((0, 3): what GPU 0 sent to GPU 3), counted where they were sent."""
        out = {}
        for i in range(self.hosts):
            stats = self._stats(i)
            for j in self.neighbours(i):
                out[self.members[i], self.members[j]] = stats[f"to{j}"]["tx"]["bytes"]
        return out

    def link_counters(self) -> list[tuple[int, int, int, int]]:
        """(bytes in, bytes out, packets in, packets out) so far for every
        rank, summed over its links (the layout of
        `EmulatedCluster.link_counters`: "down" is what reached the rank)."""
        out = []
        for i in range(self.hosts):
            stats = self._stats(i)
            rows = [stats[f"to{j}"] for j in self.neighbours(i)]
            out.append(tuple(sum(s[d][k] for s in rows)
                             for d, k in (("rx", "bytes"), ("tx", "bytes"),
                                          ("rx", "packets"), ("tx", "packets"))))
        return out

    def forwarded(self) -> list[int]:
        """IP datagrams each rank's namespace has forwarded so far (bytes it
        passed on between two others)."""
        out = []
        for i in range(self.hosts):
            text = _sh("ip", "netns", "exec", self.ns(i), "cat", "/proc/net/snmp").stdout
            head, values = [ln.split() for ln in text.splitlines() if ln.startswith("Ip:")][:2]
            out.append(int(values[head.index("ForwDatagrams")]))
        return out


def restricted(topology: Any, members: Sequence[Any]) -> Any:
    """`topology` among `members` alone: those nodes, in that order, and the
    links between two of them."""
    from hoplite_gpu.topology import Topology

    keep = set(members)
    links = [x for x in topology.links if x.src in keep and x.dst in keep]
    name = topology.name if len(keep) == len(topology.nodes) else \
        f"{topology.name}[{','.join(map(str, members))}]"
    return Topology(members, links, unit_bytes_per_s=topology.unit_bytes_per_s, name=name,
                    notes=topology.notes)


def _members(where: str, topology: Any, members: Sequence[Any] | None) -> tuple[Any, ...]:
    chosen = tuple(topology.nodes) if members is None else tuple(members)
    if len(chosen) < 2:
        raise ValueError(f"{where}: a mesh needs at least 2 members; got {list(chosen)}")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"{where}: members must be distinct; got {list(chosen)}")
    unknown = [n for n in chosen if n not in topology.nodes]
    if unknown:
        raise ValueError(f"{where}: {unknown} are not nodes of {topology.name!r} "
                         f"({list(topology.nodes)})")
    if len(chosen) > MAX_NODES:
        raise ValueError(f"{where}: at most {MAX_NODES} members; got {len(chosen)}")
    return chosen


def _fixed_paths(where: str, topology: Any, members: Sequence[Any]) -> dict:
    """For every ordered pair of ranks, the ranks along its route: the fewest
    hops, then the widest (its slowest link the fastest), then the lowest
    indices; a pair's path the same both ways."""
    import networkx as nx

    index = {node: i for i, node in enumerate(members)}
    g = nx.Graph()
    g.add_nodes_from(range(len(members)))
    for x in topology.links:
        g.add_edge(index[x.src], index[x.dst])
    paths = {}
    for i, j in itertools.combinations(range(len(members)), 2):
        if not nx.has_path(g, i, j):
            raise ValueError(f"{where}: {members[i]} and {members[j]} are joined by no path "
                             f"over links among the members {list(members)}")

        def width(p: list[int]) -> float:
            return min(topology.capacity(members[a], members[b]) for a, b in itertools.pairwise(p))

        best = min(nx.all_shortest_paths(g, i, j), key=lambda p: (-width(p), p))
        paths[i, j], paths[j, i] = tuple(best), tuple(reversed(best))
    return paths


def _batch(ns: str, lines: Sequence[str], tool: str = "ip") -> None:
    """Run `tool` commands in namespace `ns`, one process for all of them."""
    if not lines:
        return
    done = subprocess.run([tool, "-n", ns, "-batch", "-"], input="\n".join(lines) + "\n",
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, [tool, "-n", ns, "-batch", "-"],
                                            done.stdout, done.stderr)


def sweep_stale() -> list[str]:
    """Delete the namespaces of earlier meshes whose process is gone (killed
    outright, it could not clean up); those whose tag matches a live process
    are kept (they may be another run's)."""
    return emulated.sweep_stale(_OURS)
