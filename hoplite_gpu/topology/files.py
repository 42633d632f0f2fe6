"""Topologies in files: JSON (the format below), or the saved output of
`nvidia-smi topo -m`.

    {"name": "two hosts",                       (optional)
     "nodes": [0, 1, "host-b"],                 GPUs or hosts: ints or strings
     "relays": ["switch"],                      (optional) nodes that only forward
     "unit_bytes_per_s": 1e9,                   (optional) what one capacity unit is
     "links": [{"a": 0, "b": 1, "capacity": 50, "kind": "nvlink"}, ...]}

A link is undirected with `capacity` per direction (any unit); "kind" is
optional (default "link"), and "directed": true makes it one way, a -> b.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from .graph import Link, Topology, TopologyError
from .nvidia import from_smi_text

_TOP_KEYS = {"name", "nodes", "relays", "unit_bytes_per_s", "links"}
_LINK_KEYS = {"a", "b", "capacity", "kind", "directed"}


def from_file(path: str | os.PathLike) -> Topology:
    """A JSON topology, or the saved text of `nvidia-smi topo -m`."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise TopologyError(f"topology file {os.fspath(path)}: cannot be read ({exc})") from None
    if text.lstrip()[:1] in ("{", "["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TopologyError(f"topology file {os.fspath(path)}: not valid JSON ({exc})") from None
        return from_json(data, source=f"topology file {os.fspath(path)}")
    return from_smi_text(text, source=f"topology file {os.fspath(path)}")


def _node_name(value: Any, where: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | str) or value == "":
        raise TopologyError(f"{where}: a node is named by an int or a non-empty string; "
                            f"got {value!r}")
    return value


def _names(data: dict, key: str, source: str, required: bool) -> list:
    if key not in data:
        if required:
            raise TopologyError(f"{source}: no {key!r} list")
        return []
    value = data[key]
    if not isinstance(value, list) or (required and not value):
        raise TopologyError(f"{source}: {key!r} must be a{' non-empty' if required else ''} "
                            f"list of node names; got {value!r}")
    return [_node_name(v, f"{source}: {key}[{i}]") for i, v in enumerate(value)]


def from_json(data: Any, *, source: str = "topology") -> Topology:
    """A topology from the decoded JSON format above; each error names the
    source, the entry and the problem."""
    if not isinstance(data, dict):
        raise TopologyError(f"{source}: expected a JSON object with 'nodes' and 'links'; got "
                            f"{type(data).__name__}")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise TopologyError(f"{source}: unknown key(s) {', '.join(map(repr, unknown))} "
                            f"(known: {', '.join(sorted(_TOP_KEYS))})")
    nodes = _names(data, "nodes", source, required=True)
    relays = _names(data, "relays", source, required=False)
    known: dict[str, Any] = {}
    for n in nodes + relays:
        if str(n) in known:
            raise TopologyError(f"{source}: node {n!r} is listed twice")
        known[str(n)] = n
    unit = data.get("unit_bytes_per_s")
    if unit is not None and (isinstance(unit, bool) or not isinstance(unit, int | float)
                             or not 0 < unit < math.inf):
        raise TopologyError(f"{source}: unit_bytes_per_s must be a positive number; got {unit!r}")
    raw = data.get("links")
    if not isinstance(raw, list):
        raise TopologyError(f"{source}: 'links' must be a list of links; got {raw!r}")
    links: list[Link] = []
    seen: dict[tuple, int] = {}
    for i, entry in enumerate(raw):
        links += _link(entry, f"{source}: links[{i}]", known, seen, i)
    name = data.get("name", source)
    if not isinstance(name, str):
        raise TopologyError(f"{source}: 'name' must be a string; got {name!r}")
    return Topology(nodes, links, relays=relays, unit_bytes_per_s=unit, name=name)


def _link(entry: Any, where: str, known: dict, seen: dict, index: int) -> list[Link]:
    if not isinstance(entry, dict):
        raise TopologyError(f"{where}: expected an object {{'a', 'b', 'capacity'}}; got {entry!r}")
    unknown = sorted(set(entry) - _LINK_KEYS)
    missing = sorted({"a", "b", "capacity"} - set(entry))
    if unknown or missing:
        what = (f"unknown key(s) {', '.join(map(repr, unknown))}" if unknown
                else f"no {', '.join(map(repr, missing))}")
        raise TopologyError(f"{where}: {what} (a link has a, b, capacity and optionally kind, "
                            f"directed)")
    a, b, cap = entry["a"], entry["b"], entry["capacity"]
    where = f"{where} ({a!r} - {b!r})"
    for end in (a, b):
        if isinstance(end, bool) or not isinstance(end, int | str) or known.get(str(end)) != end:
            raise TopologyError(f"{where}: {end!r} is not in 'nodes' or 'relays'")
    if a == b:
        raise TopologyError(f"{where}: a link joins two different nodes")
    if isinstance(cap, bool) or not isinstance(cap, int | float) or not 0 < cap < math.inf:
        raise TopologyError(f"{where}: capacity must be a positive finite number; got {cap!r}")
    kind = entry.get("kind", "link")
    directed = entry.get("directed", False)
    if not isinstance(kind, str) or not kind:
        raise TopologyError(f"{where}: kind must be a non-empty string; got {kind!r}")
    if not isinstance(directed, bool):
        raise TopologyError(f"{where}: directed must be true or false; got {directed!r}")
    pairs = [(a, b)] if directed else [(a, b), (b, a)]
    for pair in pairs:
        key = (str(pair[0]), str(pair[1]))
        if key in seen:
            raise TopologyError(f"{where}: repeats links[{seen[key]}] (give one link with the "
                                f"total capacity)")
        seen[key] = index
    return [Link(x, y, cap, kind) for x, y in pairs]


def to_json(topology: Topology) -> dict:
    """The JSON format of a topology (links both ways at one capacity are
    written once)."""
    out: dict[str, Any] = {"name": topology.name, "nodes": list(topology.nodes)}
    if topology.relays:
        out["relays"] = list(topology.relays)
    if topology.unit_bytes_per_s is not None:
        out["unit_bytes_per_s"] = topology.unit_bytes_per_s
    links = []
    done = set()
    for x in topology.links:
        if (x.src, x.dst) in done:
            continue
        back = topology.link(x.dst, x.src)
        entry: dict[str, Any] = {"a": x.src, "b": x.dst, "capacity": x.capacity, "kind": x.kind}
        if back is not None and back.capacity == x.capacity and back.kind == x.kind:
            done.add((x.dst, x.src))
        else:
            entry["directed"] = True
        links.append(entry)
        done.add((x.src, x.dst))
    out["links"] = links
    return out
