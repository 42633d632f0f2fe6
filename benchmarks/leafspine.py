"""An emulated two-tier leaf-spine fabric on one machine, from network
namespaces: H hosts on L leaves, every leaf linked once to each of S spines.
Leaves and spines are routers (`ip_forward`); each leaf reaches the other
leaves' hosts over every spine with one ECMP route (`nexthop via A nexthop
via B ...`), hashed on the packet's 5-tuple, so a TCP flow keeps one spine
and flows with other ports may take others, as a switch's hash does. The
hash is the kernel's custom multipath hash over the 5-tuple's fields
(`fib_multipath_hash_policy=3`, `fib_multipath_hash_fields=0x37`), seeded
by `fib_multipath_hash_seed`: the plain L4 policy (1) takes the hash a
packet already carries when it has one, and a TCP packet made on this same
kernel carries its socket's random hash, so there the spine is drawn per
connection and the ports do not decide it (a probe of one 4-tuple twice
lands on either spine). Every link is a veth pair shaped with `tc tbf` in
both directions: host links to `host_bps`, leaf-spine links to
hosts_per_leaf * host_bps / (spines * oversubscription), as
`hoplite_gpu.fabric.topology.leaf_spine` builds the same fabric for the
flow-level simulator (`fabric()`).

Inside a leaf its hosts' links are ports of a bridge; the leaf routes between
that bridge (10.88.<leaf>.0/24, the hosts .1 up, the leaf .254) and its
uplinks (10.89.<leaf>.<4 s + 1>/30, the spine at +1). These addresses exist
only in the namespaces made here. Host i's namespace is `<prefix>h<i>` and its
link `eth0`, as on `EmulatedCluster`, so `benchmarks.netbench` and
`benchmarks.mpi` run on it unchanged. Needs root and iproute2; everything is
torn down on exit, on error and on Ctrl-C, and namespaces of a run that was
killed outright are swept by the next one.
"""

from __future__ import annotations

import itertools
import json
import queue
import re
import subprocess
import threading
import time
from collections.abc import Sequence

from . import emulated
from .emulated import PY, EmulatedCluster, EmulationUnavailable, Namespaces, _sh, run_prefix

#: A namespace this harness makes: "ls<tag>x<n>" then "h<i>", "l<i>", "s<i>" or
#: "probe"; the tag is the making process's id modulo 100000, n counts the
#: fabrics that process made, so two fabrics never share a name.
_OURS = re.compile(r"ls(\d+)x\d+(?:h\d+|l\d+|s\d+|probe)")
_RUNS = itertools.count()
PLACEMENTS = ("block", "interleaved")
_HASH_SYSCTLS = ("net.ipv4.fib_multipath_hash_fields", "net.ipv4.fib_multipath_hash_seed")
#: bytes each path probe sends (far above the few packets of a handshake)
PROBE_BYTES = 256 << 10


def _congestion(which: str) -> str:
    """This machine's `which` ("allowed", "available") TCP congestion controls."""
    try:
        with open(f"/proc/sys/net/ipv4/tcp_{which}_congestion_control") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


class LeafSpine(Namespaces):
    """`hosts` hosts on `leaves` leaves under `spines` spines. `placement`:
    "block" puts hosts 0..h-1 on leaf 0, the next h on leaf 1, ...;
    "interleaved" puts host i on leaf i % leaves, so ranks in host order
    (a ring, a chain) cross leaves at every step. `hash_seed` (0: the
    kernel's own random seed) seeds every router's ECMP hash."""

    OURS = _OURS
    WHAT = "the emulated leaf-spine"

    def __init__(self, hosts: int = 8, leaves: int = 2, spines: int = 2, *,
                 host_bps: float = 100e6, oversubscription: float = 1.0,
                 placement: str = "block", hash_seed: int = 0,
                 congestion: str | None = None) -> None:
        where = "LeafSpine"
        for name, value, least, most in (("hosts", hosts, 2, 250 * 250),
                                         ("leaves", leaves, 2, 250), ("spines", spines, 1, 62)):
            if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
                raise ValueError(f"{where}: {name} must be a whole number from {least} to "
                                 f"{most}; got {value!r}")
        if hosts % leaves or hosts // leaves > 250:
            raise ValueError(f"{where}: hosts ({hosts}) must split evenly over the leaves "
                             f"({leaves}), at most 250 a leaf")
        if not (isinstance(oversubscription, int | float) and 0 < oversubscription < 1e6):
            raise ValueError(f"{where}: oversubscription must be a positive ratio; "
                             f"got {oversubscription!r}")
        if placement not in PLACEMENTS:
            raise ValueError(f"{where}: placement must be one of {', '.join(PLACEMENTS)}; "
                             f"got {placement!r}")
        self.hosts, self.leaves, self.spines = hosts, leaves, spines
        self.hosts_per_leaf = hosts // leaves
        self.host_bps = float(host_bps)
        #: what `benchmarks.netbench` reads as every host link's rate
        self.bandwidth_bps = self.host_bps
        self.oversubscription = float(oversubscription)
        #: each leaf-spine link's rate, both directions
        self.uplink_bps = self.hosts_per_leaf * self.host_bps / (spines * self.oversubscription)
        for what, rate in (("host_bps", self.host_bps), ("the leaf-spine rate", self.uplink_bps)):
            if not rate >= 1000:  # (tc reads a negative rate as a huge one: no shaping)
                raise ValueError(f"{where}: {what} must be at least 1000 bit/s; got {rate!r}")
        self.placement = placement
        if congestion is not None and not re.fullmatch(r"[a-z0-9_]+", str(congestion)):
            raise ValueError(f"{where}: congestion must name a TCP congestion control "
                             f"(cubic, bbr, reno...); got {congestion!r}")
        #: the hosts' TCP congestion control; None: what a new namespace gets
        #: (this machine's default, `machine_congestion`)
        self.congestion = congestion
        _seed(where, hash_seed)
        self.hash_seed = hash_seed
        self._names(run_prefix("ls", _RUNS))

    # ------------------------------------------------------------ layout ---
    def ns(self, i: int) -> str:
        """Host `i`'s namespace (`<prefix>h<i>`: the OpenMPI wrapper appends the rank)."""
        return f"{self.prefix}h{i}"

    def leaf_ns(self, leaf: int) -> str:
        return f"{self.prefix}l{leaf}"

    def spine_ns(self, spine: int) -> str:
        return f"{self.prefix}s{spine}"

    def leaf_of(self, i: int) -> int:
        return i % self.leaves if self.placement == "interleaved" else i // self.hosts_per_leaf

    def slot(self, i: int) -> int:
        """Host `i`'s place among its leaf's hosts."""
        return i // self.leaves if self.placement == "interleaved" else i % self.hosts_per_leaf

    def hosts_on(self, leaf: int) -> list[int]:
        return [i for i in range(self.hosts) if self.leaf_of(i) == leaf]

    def address(self, i: int) -> str:
        return f"10.88.{self.leaf_of(i)}.{self.slot(i) + 1}"

    def fabric(self):
        """The same fabric for `hoplite_gpu.fabric` (rates in bytes/s). Its
        host `fabric_host(i)` is our host i."""
        from hoplite_gpu.fabric.topology import leaf_spine

        return leaf_spine(self.hosts_per_leaf, self.leaves, self.spines,
                          oversubscription=self.oversubscription, host_bps=self.host_bps / 8)

    def fabric_host(self, i: int) -> int:
        return self.leaf_of(i) * self.hosts_per_leaf + self.slot(i)

    def describe(self) -> str:
        return (f"{self.hosts} hosts on {self.leaves} leaves ({self.placement}), "
                f"{self.spines} spines; host links {self.host_bps / 1e6:g} Mbit/s, "
                f"leaf-spine links {self.uplink_bps / 1e6:g} Mbit/s "
                f"(oversubscription {self.oversubscription:g}); TCP congestion control "
                f"{self.congestion or self.machine_congestion()}")

    # ------------------------------------------------------------ set-up ---
    def _check(self) -> None:
        """Refuses before anything is made where namespaces or ECMP are not to be
        had; the probe namespace is on `_made`, so close() removes one an
        interrupt left."""
        super()._check()
        probe = self._add_ns(f"{self.prefix}probe")
        got = _sh("ip", "netns", "exec", probe, "sysctl", "-n", *_HASH_SYSCTLS, check=False)
        if got.returncode != 0:
            raise EmulationUnavailable(
                "this kernel cannot hash ECMP routes on the 5-tuple with a seed (needs "
                f"{', '.join(_HASH_SYSCTLS)}: Linux 6.11 or later): {got.stderr.strip()}")
        if self.congestion is not None:
            got = _sh("ip", "netns", "exec", probe, "sysctl", "-q", "-w",
                      f"net.ipv4.tcp_congestion_control={self.congestion}", check=False)
            if got.returncode != 0:
                raise EmulationUnavailable(
                    f"a namespace here cannot use the TCP congestion control "
                    f"{self.congestion!r} (allowed: {_congestion('allowed')}; loaded: "
                    f"{_congestion('available')}): {got.stderr.strip()}")
        _sh("ip", "netns", "del", probe, check=False)
        self._made.remove(probe)

    @staticmethod
    def machine_congestion() -> str:
        """The TCP congestion control a new namespace starts with here."""
        with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
            return f.read().strip()

    def _add_ns(self, name: str, *, router: bool = False) -> str:
        super()._add_ns(name)
        _sh("ip", "-n", name, "link", "set", "lo", "up")
        if router:
            # (source, destination, protocol, source port, destination port: 0x37)
            _sh("ip", "netns", "exec", name, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1",
                "net.ipv4.fib_multipath_hash_policy=3", "net.ipv4.fib_multipath_hash_fields=0x37",
                "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0",
                # (`trace_paths`: every expired probe answered, however many at once)
                "net.ipv4.icmp_ratelimit=0", "net.ipv4.icmp_msgs_per_sec=100000",
                "net.ipv4.icmp_msgs_burst=100000")
        return name

    def _cable(self, a: str, a_if: str, b: str, b_if: str, bps: float) -> None:
        """A veth pair made inside the two namespaces at once (nothing of it is
        ever in ours, so deleting the namespaces removes it, however a run
        ends), up, each end's egress shaped to `bps`."""
        _sh("ip", "link", "add", a_if, "netns", a, "type", "veth", "peer", "name", b_if,
            "netns", b)
        for ns, dev in ((a, a_if), (b, b_if)):
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                f"{int(bps)}bit", "burst", "256kb", "latency", "100ms")

    def _build(self) -> None:
        for leaf in range(self.leaves):
            ns = self.leaf_ns(leaf)
            self._add_ns(ns, router=True)
            _sh("ip", "-n", ns, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", ns, "addr", "add", f"10.88.{leaf}.254/24", "dev", "br0")
            _sh("ip", "-n", ns, "link", "set", "br0", "up")
        for s in range(self.spines):
            self._add_ns(self.spine_ns(s), router=True)
        self.set_hash_seed(self.hash_seed)
        for i in range(self.hosts):
            ns, leaf = self.ns(i), self.leaf_ns(self.leaf_of(i))
            self._add_ns(ns, router=False)
            if self.congestion is not None:
                _sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                    f"net.ipv4.tcp_congestion_control={self.congestion}")
            self._cable(ns, "eth0", leaf, f"h{i}", self.host_bps)
            _sh("ip", "-n", leaf, "link", "set", f"h{i}", "master", "br0")
            _sh("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "route", "add", "default", "via", f"10.88.{self.leaf_of(i)}.254")
        for leaf in range(self.leaves):
            for s in range(self.spines):
                self._cable(self.leaf_ns(leaf), f"s{s}", self.spine_ns(s), f"l{leaf}",
                            self.uplink_bps)
                _sh("ip", "-n", self.leaf_ns(leaf), "addr", "add", f"{_uplink(leaf, s, 1)}/30",
                    "dev", f"s{s}")
                _sh("ip", "-n", self.spine_ns(s), "addr", "add", f"{_uplink(leaf, s, 2)}/30",
                    "dev", f"l{leaf}")
                _sh("ip", "-n", self.spine_ns(s), "route", "add", f"10.88.{leaf}.0/24", "via",
                    _uplink(leaf, s, 1))
        for leaf in range(self.leaves):
            hops = [w for s in range(self.spines)
                    for w in ("nexthop", "via", _uplink(leaf, s, 2), "dev", f"s{s}")]
            for other in range(self.leaves):
                if other != leaf:
                    _sh("ip", "-n", self.leaf_ns(leaf), "route", "add", f"10.88.{other}.0/24",
                        *hops)

    def set_hash_seed(self, seed: int) -> None:
        """Seed every router's ECMP hash (`net.ipv4.fib_multipath_hash_seed`;
        0: a random one of the kernel's): the same flows then land on other
        spines, as other source ports would."""
        _seed("LeafSpine.set_hash_seed", seed)
        for ns in [*map(self.leaf_ns, range(self.leaves)), *map(self.spine_ns, range(self.spines))]:
            _sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                f"net.ipv4.fib_multipath_hash_seed={seed}")
        self.hash_seed = seed

    def measure_link(self, nbytes: int = 8 << 20, *, src: int = 0, dst: int = 1) -> float:
        """Bits per second of one TCP stream from host `src` to host `dst` (the
        same measurement as `EmulatedCluster.measure_link`): across leaves, one
        flow gets at most one spine link."""
        return EmulatedCluster.measure_link(self, nbytes, src=src, dst=dst)

    def _leaf_stats(self, leaf: int) -> dict[str, dict]:
        out = _sh("ip", "-n", self.leaf_ns(leaf), "-j", "-s", "link", "show").stdout
        return {d["ifname"]: d["stats64"] for d in json.loads(out)}

    def link_counters(self) -> list[tuple[int, int, int, int]]:
        """(downlink bytes, uplink bytes, downlink packets, uplink packets) so far
        for every host, counted on the leaf's side of its link (the layout of
        `EmulatedCluster.link_counters`, which `benchmarks.netbench` reads)."""
        stats = [self._leaf_stats(leaf) for leaf in range(self.leaves)]
        out = []
        for i in range(self.hosts):
            s = stats[self.leaf_of(i)][f"h{i}"]
            out.append((s["tx"]["bytes"], s["rx"]["bytes"], s["tx"]["packets"],
                        s["rx"]["packets"]))
        return out

    def link_bytes(self) -> dict[tuple[str, str], int]:
        """Bytes so far on every directed link of the fabric, keyed by its ends
        as `hoplite_gpu.fabric` names them (("h3", "leaf0"), ("leaf0",
        "spine1"), ...; host names are ours: h<i> is host i). Every link has
        one end in a leaf, so the leaves' counters give them all: what a leaf
        sent on a port (tx) or got from it (rx)."""
        out: dict[tuple[str, str], int] = {}
        for leaf in range(self.leaves):
            stats, name = self._leaf_stats(leaf), f"leaf{leaf}"
            for i in self.hosts_on(leaf):
                s = stats[f"h{i}"]
                out[f"h{i}", name], out[name, f"h{i}"] = s["rx"]["bytes"], s["tx"]["bytes"]
            for sp in range(self.spines):
                s = stats[f"s{sp}"]
                out[name, f"spine{sp}"], out[f"spine{sp}", name] = (s["tx"]["bytes"],
                                                                   s["rx"]["bytes"])
        return out

    def _uplink_tx(self, leaf: int) -> list[int]:
        stats = self._leaf_stats(leaf)
        return [stats[f"s{s}"]["tx"]["bytes"] for s in range(self.spines)]

    def probe_paths(self, src: int, dst: int, ports: Sequence[tuple[int, int]], *,
                    nbytes: int = PROBE_BYTES, timeout: float = 30.0) -> list[int]:
        """The spine that TCP packets from host `src`, source port p, to host
        `dst`, port q, take, for each (p, q) of `ports`: a connection on that
        4-tuple sends `nbytes`, and the spine whose link from `src`'s leaf
        counted them is the one. The hash covers the 5-tuple whichever side
        opened the connection, so the map holds for data either way (a
        sender's data server port to a puller's port: src = the sender).
        Needs the fabric quiet meanwhile (other traffic on `src`'s uplinks
        makes the answer ambiguous: an error) and the ports free on both hosts."""
        where = "LeafSpine.probe_paths"
        self._check_pair(where, src, dst)
        pairs = [(int(p), int(q)) for p, q in ports]
        for p, q in pairs:
            if not (0 < p < 65536 and 0 < q < 65536):
                raise ValueError(f"{where}: ports must be 1 to 65535; got ({p}, {q})")
        if not pairs:
            return []
        if nbytes < 16 << 10:
            raise ValueError(f"{where}: nbytes must be at least 16 KiB; got {nbytes}")
        started: list[subprocess.Popen] = []
        try:
            sink = self.popen(dst, [PY, "-c", _PROBE_SINK, self.address(dst), str(nbytes),
                                    *sorted({str(q) for _, q in pairs})],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            started.append(sink)
            _expect(_Lines(sink), "listening", timeout, f"{where}: the sink on host {dst}")
            client = self.popen(src, [PY, "-c", _PROBE_CLIENT, self.address(src),
                                      self.address(dst), str(nbytes), str(timeout)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
            started.append(client)
            lines, leaf = _Lines(client), self.leaf_of(src)
            out = []
            for p, q in pairs:
                before = self._uplink_tx(leaf)
                client.stdin.write(f"{p} {q}\n")
                client.stdin.flush()
                _expect(lines, "ok", timeout + 5, f"{where}: {src}:{p} -> {dst}:{q}")
                moved = [b - a for a, b in zip(before, self._uplink_tx(leaf), strict=True)]
                out.append(spine_that_carried(moved, nbytes, f"{where}: {src}:{p} -> {dst}:{q}"))
            return out
        finally:
            for proc in started:  # (an interrupted probe leaves nothing running)
                if proc.poll() is None:
                    proc.kill()
                proc.communicate()

    def probe_path(self, src: int, dst: int, src_port: int, dst_port: int, *,
                   nbytes: int = PROBE_BYTES) -> int:
        """The spine a TCP flow from host `src`, port `src_port`, to host `dst`,
        port `dst_port`, takes (see `probe_paths`)."""
        return self.probe_paths(src, dst, [(src_port, dst_port)], nbytes=nbytes)[0]

    def trace_paths(self, src: int, probes: Sequence[tuple[int, int, int]], *,
                    timeout: float = 10.0) -> list[int]:
        """The spine that TCP packets from host `src` to host `dst`, source
        port p, destination port q take, for each (dst, p, q) of `probes`,
        all at once, as traceroute does: a TCP segment on that 5-tuple is
        sent with a TTL of 2, so `src`'s leaf hashes and forwards it and the
        spine it reaches drops it and answers "time exceeded" from its own
        address, quoting the tuple. Nothing reaches `dst` and no port need be
        free on either host (a node's listening data port can be probed),
        nor the fabric quiet; unanswered probes are sent again until
        `timeout`, then an error."""
        where = "LeafSpine.trace_paths"
        todo = []
        for dst, p, q in probes:
            self._check_pair(where, src, dst)
            if not (0 < int(p) < 65536 and 0 < int(q) < 65536):
                raise ValueError(f"{where}: ports must be 1 to 65535; got ({p}, {q})")
            todo.append([self.address(dst), int(p), int(q)])
        if not todo:
            return []
        spine_of = {_uplink(leaf, s, 2): s for leaf in range(self.leaves)
                    for s in range(self.spines)}
        tracer = self.popen(src, [PY, "-c", _TRACER, self.address(src), str(timeout)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
        try:
            out, err = tracer.communicate(json.dumps(todo), timeout=timeout + 10)
        finally:
            if tracer.poll() is None:
                tracer.kill()
                tracer.communicate()
        if tracer.returncode != 0:
            raise RuntimeError(f"{where}: the tracer on host {src} failed: {err.strip()[-500:]}")
        hops = json.loads(out)
        lost = [tuple(t) for t, hop in zip(todo, hops, strict=True) if hop not in spine_of]
        if lost:
            raise RuntimeError(f"{where}: {len(lost)} of {len(todo)} probes from host {src} "
                               f"got no answer from a spine within {timeout:g} s (first: "
                               f"{lost[0]}; answers: {sorted(set(map(str, hops)))[:4]})")
        return [spine_of[hop] for hop in hops]

    def listening_ports(self, i: int, pid: int) -> list[int]:
        """The TCP ports process `pid` listens on at host `i`'s address (a
        node's data server: its port is the kernel's choice)."""
        out = _sh("ip", "netns", "exec", self.ns(i), "ss", "-Hltnp").stdout
        ports = set()
        for line in out.splitlines():
            cols = line.split()
            if len(cols) < 6 or f"pid={pid}," not in line:
                continue
            host, _, port = cols[3].rpartition(":")
            if host in (self.address(i), "0.0.0.0", "*"):
                ports.add(int(port))
        return sorted(ports)

    def ecmp_spread(self, src: int, dst: int, flows: int = 16, *, first_port: int = 41000,
                    dst_port: int = 5600) -> dict:
        """`flows` TCP flows from host `src` to host `dst` on source ports
        `first_port`, `first_port` + 1, ...: the spine each took, and how many
        flows each spine carried."""
        ports = [(first_port + k, dst_port) for k in range(flows)]
        spines = self.probe_paths(src, dst, ports)
        return {"src": src, "dst": dst, "dst_port": dst_port, "hash_seed": self.hash_seed,
                "src_ports": [p for p, _ in ports], "spines": spines,
                "flows_per_spine": [spines.count(s) for s in range(self.spines)]}

    def _check_pair(self, where: str, src: int, dst: int) -> None:
        for i in (src, dst):
            if not (isinstance(i, int) and 0 <= i < self.hosts):
                raise ValueError(f"{where}: hosts are 0 to {self.hosts - 1}; got {i!r}")
        if self.leaf_of(src) == self.leaf_of(dst):
            raise ValueError(f"{where}: hosts {src} and {dst} are both on leaf "
                             f"{self.leaf_of(src)}: no spine is on their path")


def spine_that_carried(moved: Sequence[int], nbytes: int, what: str) -> int:
    """The one spine link whose counter grew by at least `nbytes` while the
    others grew by less than a quarter of it (a handshake, a stray packet)."""
    full = [s for s, m in enumerate(moved) if m >= nbytes]
    if len(full) != 1 or any(m >= nbytes / 4 for s, m in enumerate(moved) if s != full[0]):
        raise RuntimeError(f"{what}: no single spine carried the {nbytes} probe bytes (bytes "
                           f"per spine link: {list(moved)}); is other traffic on the fabric?")
    return full[0]


def _uplink(leaf: int, spine: int, end: int) -> str:
    """The address of the leaf's (end 1) or the spine's (end 2) side of their link."""
    return f"10.89.{leaf}.{4 * spine + end}"


def _seed(where: str, seed: object) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 32:
        raise ValueError(f"{where}: the hash seed must be a whole number from 0 to 2**32 - 1; "
                         f"got {seed!r}")


def sweep_stale() -> list[str]:
    """Delete the namespaces of earlier fabrics whose process is gone (killed
    outright, it could not clean up); those whose tag matches a live process
    are kept (they may be another run's)."""
    return emulated.sweep_stale(_OURS)


class _Lines:
    """A process's output lines, read by a thread, so each wait has a deadline."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.q = proc, queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.q.put(line.strip())
        self.q.put(None)

    def get(self, timeout: float) -> str | None:
        """The next line; None once the process closed its output."""
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no answer within {timeout:g} s") from None


def _expect(lines: _Lines, want: str, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    try:
        got = lines.get(max(0.0, deadline - time.monotonic()))
    except TimeoutError as exc:
        raise RuntimeError(f"{what}: {exc}") from None
    if got != want:
        err = ""
        if got is None:  # (it closed its output: it is exiting, and says why on stderr)
            try:
                lines.proc.wait(5)
                err = lines.proc.stderr.read()[-500:]
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
        raise RuntimeError(f"{what}: {got or 'exited'} {err.strip()}".strip())


# One connection at a time, on any of the ports: read the probe's bytes, answer
# one byte, close (the client then resets its end: no TIME_WAIT on the tuple).
_PROBE_SINK = """
import selectors, socket, sys
addr, nbytes, ports = sys.argv[1], int(sys.argv[2]), [int(p) for p in sys.argv[3:]]
sel = selectors.DefaultSelector()
for port in ports:
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port)); s.listen(8); sel.register(s, selectors.EVENT_READ)
print("listening", flush=True)
buf = bytearray(1 << 16)
while True:
    for key, _ in sel.select():
        c, _ = key.fileobj.accept(); c.settimeout(30); got = 0
        try:
            while got < nbytes:
                n = c.recv_into(buf)
                if not n: break
                got += n
            c.sendall(b"k")
        except OSError:
            pass
        c.close()
"""

# Traceroute by the 5-tuple: read [[dst, sport, dport], ...] on stdin, send
# each a TCP SYN with a TTL of 2 from a raw socket, and read the ICMP "time
# exceeded" answers (the spine's address; the quoted header names the tuple);
# send the unanswered again every 0.2 s until the deadline. Prints the answer
# of each (None: none).
_TRACER = """
import json, select, socket, struct, sys, time
src, timeout = sys.argv[1], float(sys.argv[2])
probes = [tuple(p) for p in json.load(sys.stdin)]
def csum(b):
    b += bytes(len(b) % 2); s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    s = (s >> 16) + (s & 0xffff); return ~(s + (s >> 16)) & 0xffff
def syn(dst, sp, dp):
    h = struct.pack("!HHIIBBHHH", sp, dp, 1, 0, 5 << 4, 0x02, 65535, 0, 0)
    pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, 6, len(h))
    return h[:16] + struct.pack("!H", csum(pseudo + h)) + h[18:]
tx = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
tx.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, 2)
rx = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
hop = dict.fromkeys(probes)
deadline = time.monotonic() + timeout
while None in hop.values() and time.monotonic() < deadline:
    for p in [p for p, h in hop.items() if h is None]:
        tx.sendto(syn(*p), (p[0], 0))
    wait = min(time.monotonic() + 0.2, deadline)
    while time.monotonic() < wait and select.select([rx], [], [], wait - time.monotonic())[0]:
        pkt, (sender, _) = rx.recvfrom(2048)
        inner = pkt[(pkt[0] & 15) * 4 + 8:]
        if pkt[(pkt[0] & 15) * 4] != 11 or len(inner) < 24 or inner[9] != 6:
            continue
        sp, dp = struct.unpack("!HH", inner[(inner[0] & 15) * 4:][:4])
        key = (socket.inet_ntoa(inner[16:20]), sp, dp)
        if socket.inet_ntoa(inner[12:16]) == src and key in hop:
            hop[key] = sender
print(json.dumps([hop[p] for p in probes]))
"""

# For each "sport dport" line: connect from that source port, send the bytes,
# wait for the sink's answer, then reset; prints "ok" or the error.
_PROBE_CLIENT = """
import socket, struct, sys
src, dst, nbytes, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
data = bytes(nbytes)
for line in sys.stdin:
    sport, dport = map(int, line.split())
    c = socket.socket(); c.settimeout(timeout)
    try:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        c.bind((src, sport)); c.connect((dst, dport)); c.sendall(data)
        ok = c.recv(1) == b"k"
        print("ok" if ok else "no answer from the sink", flush=True)
    except OSError as exc:
        print(f"error: {exc}", flush=True)
    finally:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)); c.close()
"""
