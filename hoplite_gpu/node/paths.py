"""Paths: which ECMP path each sub-flow of this node takes, and the source
port that puts its connection there.

On an ECMP fabric a switch hashes each TCP connection's 5-tuple to pick one
of the equal-cost paths (Linux routers with `fib_multipath_hash_policy=1`
hash the L4 ports too). A flow's path is then chance, and two large flows
that collide share a link while another idles. With `paths` set to n, a
large pull from one sender is split into n equal sub-flows (Ethereal's
split), each on a connection of its own, and this node chooses each
sub-flow's path, least loaded first as Ethereal does, then a source port
that lands on that path:

* **Which path** (`PathTable.assign`): per rail of this node, the path
  whose sub-flows still running carry the fewest bytes; ties to the one
  that carried the fewest bytes in all, then to the lowest index
  (`hoplite_gpu.balance.least_loaded`, the rule the fabric simulator's
  Ethereal router uses); the sub-flows of one pull take distinct paths
  while it has unused ones. The load is this node's own pulls (a node
  does not see the others').
* **Which port** (`PathTable.ports`): the switch's hash is not computable
  from user space in general (its seed is the kernel's). So the port ->
  path relation is either *given*: a map a fabric harness learned (for
  instance with `ip route get <dst> from <src> ipproto tcp sport P dport Q`
  on the leaf) or built (routes by source port), read from `path_map`, per
  destination; or *assumed*: port p of the range `path_ports` = [low,
  high] lies on path (p - low) mod n. The assumed classes are exact on a
  fabric that routes by them; on a hashing one they still give every
  sub-flow of this node a distinct 5-tuple, spread by the hash.

A port already taken is skipped by the transport for the next of the same
path (`transports.Bind`).

`PathTable` is pure; `read_map` reads the map's file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from hoplite_gpu.balance import least_loaded
from hoplite_gpu.errors import ConfigError
from hoplite_gpu.transports.base import split_address

#: destination ("host:port", "host" or "*") -> {source port: path}
PortMap = Mapping[str, Mapping[int, int]]


def parse_map(raw: object, paths: int, ports: range, what: str) -> dict[str, dict[int, int]]:
    """A port map from its JSON form, {destination: {port: path}}: ports in
    `ports`, paths below `paths`. ConfigError naming `what` and the bad entry."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{what}: expected a JSON object {{destination: {{port: path}}}}")
    parsed: dict[str, dict[int, int]] = {}
    for dest, table in raw.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{what}: {dest!r} maps to {table!r}, not {{port: path}}")
        mine: dict[int, int] = {}
        for port, path in table.items():
            if not (isinstance(port, str) and port.isdigit() and int(port) in ports):
                raise ConfigError(f"{what}: {dest!r}: port {port!r} is not in path_ports "
                                  f"({ports.start}-{ports.stop - 1})")
            if isinstance(path, bool) or not isinstance(path, int) or not 0 <= path < paths:
                raise ConfigError(f"{what}: {dest!r}: port {port} maps to path {path!r}; "
                                  f"paths are 0 to {paths - 1} (HOPLITE_PATHS={paths})")
            mine[int(port)] = path
        parsed[dest] = mine
    return parsed


def read_map(filename: str, paths: int, ports: range) -> dict[str, dict[int, int]]:
    """The port map in `filename` (HOPLITE_PATH_MAP); ConfigError naming it."""
    what = f"path_map (HOPLITE_PATH_MAP={filename!r})"
    try:
        with open(filename, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what}: cannot read it: {exc}") from None
    return parse_map(raw, paths, ports, what)


@dataclass
class PathTable:
    """This node's sub-flows on `paths` ECMP paths per rail, and the ports of each path."""

    paths: int
    ports_range: range
    #: a harness's port map (`read_map`); destinations it does not name
    #: take the port classes
    port_map: PortMap = field(default_factory=dict)
    #: rail ("" for the kernel's choice) -> per path, bytes of sub-flows not ended
    active: dict[str, list[float]] = field(default_factory=dict)
    #: rail -> per path, bytes of every sub-flow assigned
    total: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.paths <= len(self.ports_range):
            raise ValueError(f"{self.paths} paths need at least as many ports; "
                             f"got {len(self.ports_range)}")

    def assign(self, rail: str, parts: int, nbytes: float,
               avoid: Collection[int] = ()) -> list[int]:
        """The paths of a pull's `parts` sub-flows of `nbytes` each from
        `rail`, least loaded first (ties: least carried in all, then the
        lowest), distinct while the pull has unused ones, none of `avoid`
        (paths it failed on); each counted as loaded until `ended`."""
        now = self.active.setdefault(rail, [0.0] * self.paths)
        ever = self.total.setdefault(rail, [0.0] * self.paths)
        usable = [k for k in range(self.paths) if k not in avoid]
        if not usable:
            raise ValueError(f"every one of the {self.paths} paths is to be avoided")
        chosen: list[int] = []
        used: set[int] = set()
        for _ in range(parts):
            if len(used) == len(usable):
                used.clear()
            free = [k for k in usable if k not in used]
            path = free[least_loaded([now[k] for k in free], lambda j, free=free: ever[free[j]])]
            used.add(path)
            now[path] += nbytes
            ever[path] += nbytes
            chosen.append(path)
        return chosen

    def ended(self, rail: str, path: int, nbytes: float) -> None:
        """A sub-flow `assign` counted is over (done, failed or given up)."""
        now = self.active.get(rail)
        if now is not None:
            now[path] = max(0.0, now[path] - nbytes)

    def ports(self, path: int, address: str) -> tuple[int, ...]:
        """The source ports that put a connection to the data address
        `address` on `path`, in the order to try them: the map's for that
        destination ("host:port", else "host", else "*"), lowest first;
        where it names none of `path`, the port class of `path` in
        `ports_range`."""
        if not 0 <= path < self.paths:
            raise ValueError(f"path {path} is not one of 0 to {self.paths - 1}")
        if self.port_map:
            _, host, port = split_address(address)
            for dest in (f"{host}:{port}", f"[{host}]:{port}", host, "*"):
                table = self.port_map.get(dest)
                if table is not None:
                    mapped = tuple(sorted(p for p, k in table.items() if k == path))
                    if mapped:
                        return mapped
                    break
        return tuple(self.ports_range[path::self.paths])


class MapFile:
    """`path_map` kept fresh: read again when the file changes (a harness
    that learns the ports of nodes once they listen writes it then)."""

    def __init__(self, filename: str, table: PathTable) -> None:
        self.filename, self.table = filename, table
        self._stamp: tuple[int, int] | None = None

    def refresh(self) -> None:
        """Read the file if it changed since the last read. ConfigError
        (naming it) if it cannot be read or is not a valid map."""
        try:
            st = os.stat(self.filename)
        except OSError as exc:
            raise ConfigError(f"path_map (HOPLITE_PATH_MAP={self.filename!r}): cannot read "
                              f"it: {exc}") from None
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        self.table.port_map = read_map(self.filename, self.table.paths, self.table.ports_range)
        self._stamp = stamp
