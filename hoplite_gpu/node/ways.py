"""Ways: how this node's large pulls reach their senders, over the rails
it shares with them (`rails`) and over ECMP paths (`paths`).

`Ways.routes` turns a pull's senders into routes for its plan
(`engine.plan_for`); `bind` says where each sub-flow's connection starts
(`transports.Bind`); `tell` makes the notice that reports a connection to
the directory (once per connection and pull); `failed` keeps the rail pairs
a pull's sub-flows failed on, which its next plan leaves out. What a pull
left here goes with it (`forget`). docs/fabric.md, "Rails and paths".
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from hoplite_gpu import messages as m
from hoplite_gpu.config import Config
from hoplite_gpu.errors import ConfigError
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.transports import Bind, Stream

from . import rails as rails_
from .paths import MapFile, PathTable
from .plan import Route, SubFlow, as_route

log = logging.getLogger("hoplite_gpu.node")

#: A path's load a plan holds until it ends: (rail, path, bytes).
Held = tuple[str, int, float]


class Ways:
    """This node's rails, its path table, and per pull what failed and
    which connections the directory heard of."""

    def __init__(self, config: Config) -> None:
        self.config = config
        #: this node's rails (`rails.rails_of`), set by the node once it listens
        self.rails: tuple[rails_.Rail, ...] = ()
        #: the ECMP paths of its sub-flows (`paths` > 1), and their port map
        self.paths = (PathTable(config.paths, config.path_port_range())
                      if config.paths > 1 else None)
        self.path_map = (MapFile(config.path_map, self.paths)
                         if self.paths is not None and config.path_map else None)
        #: per pull, the rail pairs and paths (sender, address, local, path)
        #: a sub-flow failed on (path -1: the rail pair alone): the next plan
        #: leaves them out (a sender's NIC that is down, a cut path)
        self.failed_ways: dict[ObjectID, set[tuple[str, str, str, int]]] = {}
        #: per pull, the connections told to the directory (sender, local)
        self._told: dict[ObjectID, set[tuple[str, str]]] = {}

    def check(self) -> None:
        """Read the path map now: a ConfigError naming the file, before the
        node starts anything."""
        if self.path_map is not None:
            self.path_map.refresh()

    def listening(self, addresses: Sequence[str]) -> None:
        """The node's data server listens on `addresses` (a rail each)."""
        self.rails = rails_.rails_of(addresses, [bits for _, bits in self.config.node_hosts()])

    def routes(self, oid: ObjectID, missing: int, senders: Sequence[tuple[str, str]],
               rails: Mapping[str, Sequence[str]]) -> tuple[list[Route], list[Held]]:
        """The routes of a pull of `missing` bytes of `oid` from `senders`,
        and the paths' loads it holds (`release` them when its plan ends).
        A pull of at least `multi_source_bytes` goes over every pair of (our
        rail, their address) that share a subnet (`rails.pairs`, their
        addresses from `rails`), but those a sub-flow of this pull failed on
        (none left, or none shared: the sender's own address, as today);
        with `paths` > 1, over that many ECMP paths of each pair, but those
        a sub-flow of this pull failed on, assigned least loaded first
        (`PathTable.assign`; a pair whose every path failed is left out).
        Anything else: one route per sender, as today."""
        if missing < self.config.multi_source_bytes or (
                self.paths is None and len(self.rails) < 2 and not rails):
            return [as_route(s) for s in senders], []
        failed = self.failed_ways.get(oid, ())
        bound = self.config.transport == "tcp"  # (others pick their own source address)
        n = 1 if self.paths is None else self.paths.paths
        ways: list[tuple[str, str, str, set[int]]] = []
        for sender, address in senders:
            theirs = rails.get(sender)
            shared = (rails_.pairs(self.rails, theirs or [address])
                      if theirs or len(self.rails) > 1 else [])
            left = []
            for here, there in shared or [("", address)]:
                bad = {p for s, a, h, p in failed if (s, a, h) == (sender, there, here)}
                if -1 not in bad and len(bad) < n:
                    left.append((sender, there, here if bound else "", bad))
            ways += left or [(sender, address, "", {-1})]
        if self.paths is None:
            return [(s, a, here, -1) for s, a, here, _ in ways], []
        self._fresh_map()
        share = missing / sum(n - len(bad) if -1 not in bad else 1 for *_, bad in ways)
        routes: list[Route] = []
        held: list[Held] = []
        for sender, address, here, bad in ways:
            if -1 in bad:  # (every rail pair and path of it failed: the kernel's choice)
                routes.append((sender, address, "", -1))
                continue
            for path in self.paths.assign(here, n - len(bad), share, avoid=bad):
                routes.append((sender, address, here, path))
                held.append((here, path, share))
        return routes, held

    def release(self, held: Sequence[Held]) -> None:
        """A plan ended: the paths' loads it held are freed."""
        for rail, path, nbytes in held:
            self.paths.ended(rail, path, nbytes)

    def _fresh_map(self) -> None:
        """The port map as its file says now; one that cannot be read is
        logged and the last one kept (checked at start: `Node.start`)."""
        if self.path_map is not None:
            try:
                self.path_map.refresh()
            except ConfigError as exc:
                log.warning("keeping the last port map: %s", exc)

    def bind(self, flow: SubFlow) -> Bind | None:
        """Where `flow`'s connection starts: from its rail's address and a
        source port of its path; None for a sub-flow on neither (today's)."""
        if not flow.local and flow.path < 0:
            return None
        return Bind(flow.local, () if flow.path < 0 else self.paths.ports(flow.path, flow.address))

    def tell(self, oid: ObjectID, flow: SubFlow, stream: Stream,
             about: ObjectID | None = None) -> m.PathTaken | None:
        """The notice that tells the directory where a sub-flow of the pull
        of `oid` runs, named as a pull of `about` (default `oid`: a reduce
        step's pull of a child is told as one of the reduce's target): once
        per connection and pull; None for one told already, or a same-host
        stream (no rail, no path)."""
        if stream.caps.local or not stream.local:
            return None
        told = self._told.setdefault(oid, set())
        if (flow.sender, stream.local) in told:
            return None
        told.add((flow.sender, stream.local))
        return m.PathTaken(oid=(about or oid).binary, sender=flow.sender, address=flow.address,
                           local=stream.local, path=flow.path)

    def failed(self, oid: ObjectID, flow: SubFlow) -> None:
        """A sub-flow of the pull of `oid` failed: on a rail pair or path,
        its next plan goes round it."""
        if flow.local or flow.path >= 0:
            self.failed_ways.setdefault(oid, set()).add(
                (flow.sender, flow.address, flow.local, flow.path))

    def forget(self, oid: ObjectID) -> None:
        """The pull of `oid` ended: what it left here goes."""
        self._told.pop(oid, None)
        self.failed_ways.pop(oid, None)
