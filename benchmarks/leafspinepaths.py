"""Path maps for the emulated leaf-spine: which source ports of a puller put
a sender's data on which spine, learned per launch and written as each
node's `HOPLITE_PATH_MAP` (docs/fabric.md, "Emulated leaf-spine").

A pull's connection runs from the puller (the port it binds, from
`HOPLITE_PATH_PORTS`) to the sender's data port, so a sender's data
travels on the 5-tuple (sender, its data port) -> (puller, the bound
port), and the sender's leaf picks the spine. A node's data port is the
kernel's choice, known only once it listens: `PathMapper` is the fabric
a launch of the paths system runs on; once every node has said it is
ready and before the start time goes out, it finds each node's data
ports (`LeafSpine.listening_ports`), traces the spine of each (sender,
data port, puller, source port) in bulk (`LeafSpine.trace_paths`), the
first ports of the range until every spine has `per_path` ports for each
of its paths, and writes each node's map (`path_maps`), the start time
moved on by the time that took.

Path k is spine k mod S: one pull's sub-flows (distinct paths, least
loaded first: `hoplite_gpu.node.paths`) land on distinct spines.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence

#: source ports each path gets per (sender, data port): one per pull from
#: that sender the node runs at once on that path (a sliced ring's chains
#: pull from the same neighbour together), since a port serves one
#: connection to a peer at a time
PER_PATH = 16
#: (sender, sender's data port, puller, puller's source port) -> spine
Probed = Mapping[tuple[int, int, int, int], int]


def path_maps(probed: Probed, paths: int, spines: int,
              address: Callable[[int], str]) -> dict[int, dict[str, dict[str, int]]]:
    """Each puller's path map from the probed spines: {puller: {"<sender's
    address>:<data port>": {"<source port>": path}}}. Path k lies on spine
    k mod `spines`; a spine's ports go, lowest first, each to that spine's
    path holding the fewest so far (ties: the lowest index), so paths that
    share a spine share its ports evenly; ports of a spine no path lies on
    are left out. Deterministic: the same probes give the same maps.
    ValueError naming the pair if a path is left without a port."""
    if paths < 1 or spines < 1:
        raise ValueError(f"path_maps: paths ({paths}) and spines ({spines}) must be at least 1")
    on_spine = {s: [k for k in range(paths) if k % spines == s] for s in range(spines)}
    maps: dict[int, dict[str, dict[str, int]]] = {}
    for (sender, dport, puller, sport), spine in sorted(probed.items()):
        if not 0 <= spine < spines:
            raise ValueError(f"path_maps: {sender}:{dport} -> {puller}:{sport} took spine "
                             f"{spine}; spines are 0 to {spines - 1}")
        table = maps.setdefault(puller, {}).setdefault(f"{address(sender)}:{dport}", {})
        held = [0] * paths
        for path in table.values():
            held[path] += 1
        choices = on_spine[spine]
        if choices:
            table[str(sport)] = min(choices, key=lambda k: (held[k], k))
    for puller, tables in maps.items():
        for dest, table in tables.items():
            missing = sorted(set(range(paths)) - set(table.values()))
            if missing:
                raise ValueError(f"path_maps: no probed port from {dest} to host {puller} "
                                 f"took spine {missing[0] % spines} (path {missing[0]})")
    return maps


def ports_wanted(paths: int, spines: int, per_path: int = PER_PATH) -> list[int]:
    """Per spine, the ports it needs: `per_path` for each path on it."""
    return [per_path * len(range(s, paths, spines)) for s in range(spines)]


def learn(fab, data_ports: Mapping[int, Sequence[int]], paths: int, ports: range, *,
          per_path: int = PER_PATH) -> Probed:
    """The spine of (sender, data port, puller, source port) for every
    sender and puller under different leaves and every data port of the
    sender in `data_ports`, for the first source ports of `ports`, in rounds
    of twice what is wanted, until each spine has `ports_wanted` of them.
    RuntimeError if the range runs out first."""
    want = ports_wanted(paths, fab.spines, per_path)
    step = 2 * sum(want)
    todo = {(s, d, r) for s, ds in data_ports.items() for d in ds for r in range(fab.hosts)
            if fab.leaf_of(r) != fab.leaf_of(s)}
    probed: dict[tuple[int, int, int, int], int] = {}
    start = 0
    while todo:
        batch = ports[start:start + step]
        if not batch:
            s, d, r = min(todo)
            raise RuntimeError(f"path map: the {len(ports)} ports of the range did not give "
                               f"every spine {max(want)} ports from {s}:{d} to {r}")
        for sender in sorted({s for s, _, _ in todo}):
            mine = sorted((d, r) for s, d, r in todo if s == sender)
            probes = [(r, d, p) for d, r in mine for p in batch]
            for (r, d, p), spine in zip(probes, fab.trace_paths(sender, probes), strict=True):
                probed[sender, d, r, p] = spine
        for key in sorted(todo):
            s, d, r = key
            got = [0] * fab.spines
            for p in ports[:start + step]:
                got[probed[s, d, r, p]] += 1
            if all(g >= w for g, w in zip(got, want, strict=True)):
                todo.discard(key)
        start += step
    return probed


class PathMapper:
    """The fabric for one launch of the paths system: every node is started
    with `HOPLITE_PATH_MAP` naming a file of its own (empty at first), and
    the start time a launch sends its nodes waits until the maps are
    written (`learn`, `path_maps`). Everything else is the fabric's.
    `close` removes the files."""

    def __init__(self, fab, paths: int, ports: range, *, per_path: int = PER_PATH) -> None:
        self.fab, self.paths, self.ports, self.per_path = fab, paths, ports, per_path
        self.dir = tempfile.mkdtemp(prefix="hoplite-pathmap-")
        self.files = {i: os.path.join(self.dir, f"h{i}.json") for i in range(fab.hosts)}
        for name in self.files.values():
            _write(name, {})
        self.nodes: dict[int, object] = {}
        #: once written: what was learned, for the launch's row
        self.report: dict | None = None
        self._t0: float | None = None

    def __getattr__(self, name: str):
        return getattr(self.fab, name)

    def popen(self, i: int, argv: Sequence[str], **kw):
        node = "benchmarks.netnode" in argv
        if node:
            kw["env"] = {**(kw.get("env") or os.environ), "HOPLITE_PATH_MAP": self.files[i]}
        proc = self.fab.popen(i, argv, **kw)
        if node and proc.stdin is not None:
            self.nodes[i] = proc
            proc.stdin = _Gate(proc.stdin, self)
        return proc

    def start_time(self, t0: float) -> float:
        """The start time to send the nodes instead of `t0`: on the first
        call (every node listens: the launch heard each say it is ready),
        the maps are learned and written first, and the time moved on by
        what that took."""
        if self._t0 is None:
            began = time.monotonic()
            self.write()
            self._t0 = t0 + (time.monotonic() - began)
        return self._t0

    def write(self) -> None:
        """Learn the spines of every node's data ports and write the maps."""
        began = time.monotonic()
        data_ports = {i: self.fab.listening_ports(i, proc.pid) for i, proc in self.nodes.items()}
        for i, found in data_ports.items():
            if not found:
                raise RuntimeError(f"path map: node {i} (pid {self.nodes[i].pid}) listens on "
                                   f"no port at {self.fab.address(i)}")
        probed = learn(self.fab, data_ports, self.paths, self.ports, per_path=self.per_path)
        maps = path_maps(probed, self.paths, self.fab.spines, self.fab.address)
        for i, name in self.files.items():
            _write(name, maps.get(i, {}))
        self.report = {"learn_s": round(time.monotonic() - began, 3), "probes": len(probed),
                       "data_ports": {str(i): d for i, d in sorted(data_ports.items())},
                       "ports_per_path_min": min(
                           (sum(1 for k in t.values() if k == path) for m in maps.values()
                            for t in m.values() for path in range(self.paths)), default=0)}

    def close(self) -> None:
        for name in self.files.values():
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass
        os.rmdir(self.dir)


class _Gate:
    """A node's stdin: the start time line that goes through it is the
    mapper's (`PathMapper.start_time`)."""

    def __init__(self, stream, mapper: PathMapper) -> None:
        self._stream, self._mapper = stream, mapper

    def write(self, text: str) -> int:
        try:
            msg = json.loads(text)
        except ValueError:
            msg = None
        if isinstance(msg, dict) and set(msg) == {"t0"}:
            text = json.dumps({"t0": self._mapper.start_time(msg["t0"])}) + "\n"
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _write(name: str, data: dict) -> None:
    """Whole or not at all: a node reading it meanwhile sees the old map."""
    tmp = f"{name}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, sort_keys=True)
    os.replace(tmp, name)

