"""The PCIe tree of a machine, rebuilt from the distance between each pair of
GPUs (what NVML's common ancestor and `nvidia-smi topo -m` report).

The distances form a hierarchy: GPUs one switch apart (PIX) share a switch,
several switches apart (PXB) an upper switch, then a host bridge (PHB), a CPU
(NODE), and CPUs are joined by the SMP interconnect (SYS). Each group of two
or more GPUs that first appears at some level becomes a relay, linked to the
smallest group above it; each CPU group is a relay of its own, and CPUs are
joined pairwise by an "smp" link. A pair whose distance is unknown
(`nvidia-smi` hides it behind NV#) is placed under the same CPU, unless
their NUMA nodes differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .graph import Node

#: PCIe distances, nearest first, as `nvidia-smi topo -m` names them (SOC is
#: the old name of SYS).
LEVELS = ("PIX", "PXB", "PHB", "NODE", "SYS")
_RANK = {name: i + 1 for i, name in enumerate(LEVELS)} | {"SOC": 5}
_NODE = _RANK["NODE"]

#: Relay names by the level at which their group first appears.
_RELAY = {1: "pcie-switch", 2: "pcie-switch", 3: "host-bridge", 4: "cpu"}


@dataclass(frozen=True)
class PcieTree:
    relays: tuple[Node, ...]
    #: (a, b, capacity, kind), each a link both ways
    links: tuple[tuple[Node, Node, float, str], ...]


def _groups(gpus: Sequence[Node], joined) -> list[frozenset]:
    parent = {g: g for g in gpus}

    def find(g: Node) -> Node:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    for i, a in enumerate(gpus):
        for b in gpus[i + 1:]:
            if joined(a, b):
                parent[find(a)] = find(b)
    out: dict[Node, set] = {}
    for g in gpus:
        out.setdefault(find(g), set()).add(g)
    return [frozenset(s) for s in out.values()]


def pcie_tree(gpus: Sequence[Node], levels: Mapping[frozenset, str | None], *,
              gpu_capacity: Mapping[Node, float], switch_capacity: float,
              smp_capacity: float, numa: Mapping[Node, Any] | None = None) -> PcieTree:
    """The relays and links of the PCIe tree over `gpus`.

    `levels[frozenset((a, b))]` is the distance of a pair (a name in LEVELS, or
    None when unknown); `numa[g]` GPU g's NUMA node, when known;
    `gpu_capacity[g]` the capacity of GPU g's own link; `switch_capacity` that
    of each link between relays; `smp_capacity` that of each link between two
    CPUs."""
    entries, cpus = _hierarchy(list(gpus), levels, numa or {})
    names = _names(entries, gpus)
    links: list[tuple[Node, Node, float, str]] = []
    for g in gpus:
        up = next((i for i, (grp, _) in enumerate(entries) if g in grp), None)
        if up is not None:
            links.append((g, names[up], gpu_capacity[g], "pcie"))
    for i, (group, level) in enumerate(entries):
        up = next((j for j in range(i + 1, len(entries)) if group <= entries[j][0]
                   and (group != entries[j][0] or entries[j][1] > level)), None)
        if up is not None:
            links.append((names[i], names[up], switch_capacity, "pcie"))
    cpu_names = sorted(names[i] for i, (g, lv) in enumerate(entries) if g in cpus and lv == _NODE)
    for i, a in enumerate(cpu_names if len(cpu_names) > 1 else []):
        for b in cpu_names[i + 1:]:
            links.append((a, b, smp_capacity, "smp"))
    return PcieTree(tuple(sorted(names)), tuple(links))


def _hierarchy(gpus: list[Node], levels: Mapping[frozenset, str | None],
               numa: Mapping[Node, Any]) -> tuple[list[tuple[frozenset, int]], list[frozenset]]:
    """The relays as (group of GPUs, level), smallest first, and the CPU groups."""
    def joined_at(level: int):
        def joined(a: Node, b: Node) -> bool:
            known = levels.get(frozenset((a, b)))
            if known is not None:
                return _RANK[known] <= level
            na, nb = numa.get(a), numa.get(b)
            return level == _NODE and (na is None or nb is None or na == nb)
        return joined

    first_seen: dict[frozenset, int] = {}
    for level in range(1, _NODE + 1):
        for group in _groups(gpus, joined_at(level)):
            first_seen.setdefault(group, level)
    cpus = [g for g in first_seen if not any(g < other for other in first_seen)]
    # a relay for each group of two or more GPUs where it first appears, and,
    # with several CPUs, one for each CPU above whatever it holds
    entries = {(g, lv) for g, lv in first_seen.items() if len(g) > 1}
    if len(cpus) > 1:
        entries |= {(g, _NODE) for g in cpus}
    return sorted(entries, key=lambda e: (len(e[0]), e[1], sorted(map(str, e[0])))), cpus


def _names(entries: list[tuple[frozenset, int]], gpus: Sequence[Node]) -> list[str]:
    """Relay names by level ("pcie-switch0", "cpu1", ...), numbered in the
    order of their first GPU."""
    position = {g: i for i, g in enumerate(gpus)}
    names = [""] * len(entries)
    counters: dict[str, int] = {}
    for i in sorted(range(len(entries)), key=lambda i: (
            _RELAY[entries[i][1]], min(position[g] for g in entries[i][0]))):
        base = _RELAY[entries[i][1]]
        counters[base] = counters.get(base, -1) + 1
        names[i] = f"{base}{counters[base]}"
    return names
