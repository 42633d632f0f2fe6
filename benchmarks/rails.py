"""An emulated cluster of hosts with k rails, on one machine: every host has
k links (`eth0` .. `eth<k-1>`, its NICs), and rail r of every host is cabled
to switch r, a bridge of its own, as a rail-optimised cluster is wired
(NIC r of every host on leaf switch r). Traffic between NIC r of two hosts
then crosses one switch and never meets another rail's, and each rail is a
broadcast domain and subnet of its own: 10.66.<r>.<host + 1>/24, so rail r
of two hosts shares a subnet and the kernel reaches it over `eth<r>` only
(one bridge for every rail would be one flat network, where a host answers
for all its addresses on any of its NICs and two rails' flows could share
one link). Every link is a veth pair shaped with `tc tbf` to the rail's
rate in both directions (host side: uplink; switch side: downlink).

Host i's namespace is `<prefix>h<i>` and its rail 0 `eth0`, as on
`EmulatedCluster`, so `benchmarks.netbench`, `benchmarks.mpi` and Gloo run
on it unchanged; `node_host(i)` is what a hoplite-gpu node advertises (one
address per rail) and `interfaces` what OpenMPI may use. The addresses
exist only in the namespaces made here. Needs root and iproute2; everything
is torn down on exit, on error and on Ctrl-C, and namespaces of a run that
was killed outright are swept by the next one.
"""

from __future__ import annotations

import itertools
import json
import re

from . import emulated
from .emulated import EmulatedCluster, Namespaces, _sh, run_prefix
from .leafspine import LeafSpine

#: A namespace this harness makes: "rl<tag>x<n>" then "h<i>" (a host), "r<r>"
#: (rail r's switch) or "probe"; the tag is the making process's id modulo
#: 100000, n counts the clusters that process made.
_OURS = re.compile(r"rl(\d+)x\d+(?:h\d+|r\d+|probe)")
_RUNS = itertools.count()
#: the second octet of every address here: 10.66.<rail>.<host + 1>
NET = 66
#: `HOPLITE_NODE_HOST` lists at most this many rails
MAX_RAILS = 16
MAX_HOSTS = 250


class RailCluster(Namespaces):
    """`hosts` hosts with `rails` rails each, every rail's links shaped to
    `rail_bps` both ways. `bandwidth_bps` is a host's k rails together (what
    `benchmarks.netbench` reads as a host's rate: its S/B bounds are then
    S/(kB))."""

    OURS = _OURS
    WHAT = "the emulated rails"

    def __init__(self, hosts: int = 8, rails: int = 2, rail_bps: float = 100e6) -> None:
        where = "RailCluster"
        for name, value, least, most in (("hosts", hosts, 2, MAX_HOSTS),
                                         ("rails", rails, 1, MAX_RAILS)):
            if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
                raise ValueError(f"{where}: {name} must be a whole number from {least} to "
                                 f"{most}; got {value!r}")
        if isinstance(rail_bps, bool) or not isinstance(rail_bps, int | float) or not (
                1000 <= rail_bps < 1e12):  # (tc reads a negative rate as a huge one: no shaping)
            raise ValueError(f"{where}: rail_bps must be a finite rate of at least 1000 bit/s; "
                             f"got {rail_bps!r}")
        self.hosts, self.rails = hosts, rails
        self.rail_bps = float(rail_bps)
        #: a host's rails together
        self.bandwidth_bps = rails * self.rail_bps
        self._names(run_prefix("rl", _RUNS))

    # ------------------------------------------------------------ layout ---
    def ns(self, i: int) -> str:
        """Host `i`'s namespace (`<prefix>h<i>`: the OpenMPI wrapper appends the rank)."""
        return f"{self.prefix}h{i}"

    def switch_ns(self, rail: int) -> str:
        return f"{self.prefix}r{rail}"

    def address(self, i: int, rail: int = 0) -> str:
        """Host `i`'s address on `rail` (rail 0: the one the directory, Gloo
        and OpenMPI's launcher use)."""
        return f"10.{NET}.{rail}.{i + 1}"

    def node_host(self, i: int) -> str:
        """What a hoplite-gpu node on host `i` advertises (`HOPLITE_NODE_HOST`):
        its address on every rail, with the rail's prefix length."""
        return ",".join(f"{self.address(i, r)}/24" for r in range(self.rails))

    @property
    def interfaces(self) -> str:
        """The interfaces OpenMPI may use (its `*_if_include` syntax): every rail's."""
        return ",".join(f"eth{r}" for r in range(self.rails))

    def advertising(self, rails: int) -> Advertising:
        """This cluster as seen by a launch whose hoplite-gpu nodes (and
        OpenMPI) use only the first `rails` rails."""
        return Advertising(self, rails)

    def describe(self) -> str:
        return (f"{self.hosts} hosts, {self.rails} rails each (a switch per rail), every rail "
                f"{self.rail_bps / 1e6:g} Mbit/s both ways: "
                f"{self.bandwidth_bps / 1e6:g} Mbit/s a host")

    # ------------------------------------------------------------ set-up ---
    # (a veth pair made inside the two namespaces at once, each end shaped)
    _cable = LeafSpine._cable

    def _build(self) -> None:
        for r in range(self.rails):
            sw = self.switch_ns(r)
            self._add_ns(sw)
            _sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", sw, "link", "set", "br0", "up")
        for i in range(self.hosts):
            ns = self.ns(i)
            self._add_ns(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            for r in range(self.rails):
                sw = self.switch_ns(r)
                self._cable(ns, f"eth{r}", sw, f"h{i}", self.rail_bps)
                _sh("ip", "-n", sw, "link", "set", f"h{i}", "master", "br0")
                _sh("ip", "-n", ns, "addr", "add", f"{self.address(i, r)}/24", "dev", f"eth{r}")

    # ------------------------------------------------------------- use ---
    def measure_link(self, nbytes: int = 8 << 20, *, src: int = 0, dst: int = 1) -> float:
        """Bits per second of one TCP stream from host `src` to host `dst` on
        rail 0 (`EmulatedCluster.measure_link`): one rail's rate."""
        return EmulatedCluster.measure_link(self, nbytes, src=src, dst=dst)

    def rail_counters(self) -> list[list[tuple[int, int, int, int]]]:
        """Per rail, per host: (downlink bytes, uplink bytes, downlink
        packets, uplink packets) so far, counted on the switch's side of the
        host's link (what the switch sent to / got from the host)."""
        out = []
        for r in range(self.rails):
            text = _sh("ip", "-n", self.switch_ns(r), "-j", "-s", "link", "show").stdout
            stats = {d["ifname"]: d["stats64"] for d in json.loads(text)}
            out.append([(s["tx"]["bytes"], s["rx"]["bytes"], s["tx"]["packets"],
                         s["rx"]["packets"]) for s in (stats[f"h{i}"] for i in range(self.hosts))])
        return out

    def link_counters(self) -> list[tuple[int, int, int, int]]:
        """Every host's counters, its rails summed (the layout of
        `EmulatedCluster.link_counters`, which `benchmarks.netbench` reads)."""
        per_rail = self.rail_counters()
        return [tuple(sum(rail[i][k] for rail in per_rail) for k in range(4))
                for i in range(self.hosts)]

    def link_bytes(self) -> list[tuple[int, int]]:
        """(downlink, uplink) bytes so far for every host, its rails summed."""
        return [c[:2] for c in self.link_counters()]


class Advertising:
    """A `RailCluster` for one launch whose hoplite-gpu nodes advertise, and
    whose OpenMPI ranks use, only its first `rails` rails; everything else
    (hosts, links, counters) is the cluster's."""

    def __init__(self, cluster: RailCluster, rails: int) -> None:
        if isinstance(rails, bool) or not isinstance(rails, int) or not (
                1 <= rails <= cluster.rails):
            raise ValueError(f"RailCluster.advertising: rails must be 1 to {cluster.rails}; "
                             f"got {rails!r}")
        self.cluster, self.used = cluster, rails

    def __getattr__(self, name: str):
        return getattr(self.cluster, name)

    def node_host(self, i: int) -> str:
        return ",".join(f"{self.cluster.address(i, r)}/24" for r in range(self.used))

    @property
    def interfaces(self) -> str:
        return ",".join(f"eth{r}" for r in range(self.used))


def sweep_stale() -> list[str]:
    """Delete the namespaces of earlier rail clusters whose process is gone
    (killed outright, it could not clean up); those whose tag matches a live
    process are kept (they may be another run's)."""
    return emulated.sweep_stale(_OURS)
