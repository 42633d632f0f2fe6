"""An emulated cluster on one machine: N network namespaces ("hosts") joined by
a bridge in a namespace of its own, each host's link shaped with `tc tbf` to a
bandwidth in both directions (host side = uplink, bridge side = downlink): the
same for every host, or one rate per host (`rates_bps`).

All traffic stays inside the namespaces this creates (addresses 10.77.x.0/24 that
exist only there). Needs root and iproute2 (`ip`, `tc`); refuses clearly
without them. Everything is torn down on exit, on error and on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence

from hoplite_gpu.lifecycle import Closing, stop_process

PY = sys.executable
#: A namespace this harness makes: "hg<tag>" then "sw", "probe" or "n<i>", where
#: the tag is the making process's id modulo 100000.
_OURS = re.compile(r"hg(\d+)(?:sw|probe|n\d+)")


class EmulationUnavailable(RuntimeError):
    """This machine cannot create the emulated cluster (not root, no iproute2, ...)."""


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=30)


class Namespaces(Closing):
    """What every emulated network here shares: namespaces named after
    `prefix`, made by `_build` and listed on `_made` (before each exists),
    deleted in reverse by `close`, so on exit, on error and on Ctrl-C
    (`Closing`); `_open` first refuses where namespaces cannot be made
    (`_check`) and sweeps those of runs killed outright (`OURS`: the
    harness's names, the making process's tag the first group)."""

    OURS: re.Pattern = _OURS
    WHAT = "the emulated cluster"

    def _names(self, prefix: str) -> None:
        self.prefix = prefix
        self._made: list[str] = []
        #: namespaces left by earlier runs that died without cleaning up, removed by `_open`
        self.swept: list[str] = []

    def _open(self) -> None:
        self._check()  # refuses before anything is made (close() removes a probe it left)
        self.swept = sweep_stale(self.OURS)
        self._build()

    def _check(self) -> None:
        require_namespaces(f"{self.prefix}probe", self._made, self.WHAT)

    def _build(self) -> None:
        raise NotImplementedError

    def _add_ns(self, name: str) -> str:
        """Make namespace `name` (on `_made` first: an interrupted add is swept too)."""
        self._made.append(name)
        _sh("ip", "netns", "add", name)
        return name

    def close(self) -> None:
        for ns in reversed(self._made):
            _sh("ip", "netns", "del", ns, check=False)
        self._made.clear()

    def popen(self, i: int, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start a process in host (or rank) `i`'s namespace, `ns(i)`."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns(i), *argv], **kw)

    def ns(self, i: int) -> str:
        raise NotImplementedError


def run_prefix(kind: str, runs) -> str:
    """A harness's name prefix: `kind`, this process's id modulo 100000 (the
    tag `sweep_stale` reads), "x", and the next of `runs` (a count of the
    networks this process made of that kind, so two never share a name)."""
    return f"{kind}{os.getpid() % 100000}x{next(runs)}"


class EmulatedCluster(Namespaces):
    def __init__(self, hosts: int, bandwidth_bps: float = 1e9, *, subnet: int = 77,
                 rates_bps: Sequence[float] | None = None) -> None:
        """`hosts` hosts, each link shaped to `bandwidth_bps` both ways, or host
        i's to `rates_bps[i]` (one rate per host) where given."""
        if hosts < 2:
            raise ValueError("an emulated cluster needs at least 2 hosts")
        rates = [bandwidth_bps] * hosts if rates_bps is None else list(rates_bps)
        if len(rates) != hosts:
            raise ValueError(f"EmulatedCluster: rates_bps needs one rate per host ({hosts}); "
                             f"got {len(rates)}")
        for rate in (bandwidth_bps, *rates):
            if not rate >= 1000:  # (tc reads a negative rate as a huge one: no shaping)
                raise ValueError(f"link bandwidth must be at least 1000 bit/s; got {rate!r}")
        self.hosts, self.bandwidth_bps = hosts, bandwidth_bps
        #: host i's link rate in bit/s, both directions
        self.rates_bps = rates
        tag = os.getpid() % 100000
        self._names(f"hg{tag}")
        self.switch = f"{self.prefix}sw"
        self.subnet = f"10.{subnet}.{tag % 250}"
        self.netem = False

    # ------------------------------------------------------------ set-up ---
    def _build(self) -> None:
        self._add_ns(self.switch)
        sw = ("ip", "netns", "exec", self.switch)
        _sh(*sw, "ip", "link", "add", "br0", "type", "bridge")
        _sh(*sw, "ip", "link", "set", "br0", "up")
        for i in range(self.hosts):
            ns, sw_if = self._add_ns(self.ns(i)), f"{self.prefix}s{i}"
            # Made inside the namespaces at once: nothing of it is ever in
            # ours, so deleting the namespaces removes all of it, however a
            # run ends.
            _sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth",
                "peer", "name", sw_if, "netns", self.switch)
            hx = ("ip", "netns", "exec", ns)
            _sh(*hx, "ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _sh(*hx, "ip", "link", "set", "eth0", "up")
            _sh(*hx, "ip", "link", "set", "lo", "up")
            _sh(*sw, "ip", "link", "set", sw_if, "master", "br0")
            _sh(*sw, "ip", "link", "set", sw_if, "up")
            rate = f"{int(self.rates_bps[i])}bit"
            for where, dev in ((hx, "eth0"), (sw, sw_if)):  # uplink and downlink
                _sh(*where, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                    "burst", "256kb", "latency", "100ms")

    # ------------------------------------------------------------- use ---
    def ns(self, i: int) -> str:
        return f"{self.prefix}n{i}"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def link_bytes(self) -> list[tuple[int, int]]:
        """(downlink, uplink) bytes so far for every host, counted on the bridge's
        side of each host's link (what the switch sent to / got from the host)."""
        return [c[:2] for c in self.link_counters()]

    def link_counters(self) -> list[tuple[int, int, int, int]]:
        """(downlink bytes, uplink bytes, downlink packets, uplink packets) so far
        for every host, as `link_bytes`. A packet here is one buffer the host's
        stack handed to its link, up to 64 KiB with segmentation offload: fewer,
        larger packets for the same bytes cost the kernels less."""
        out = _sh("ip", "netns", "exec", self.switch, "ip", "-j", "-s", "link", "show").stdout
        stats = {d["ifname"]: d["stats64"] for d in json.loads(out)}
        return [(s["tx"]["bytes"], s["rx"]["bytes"], s["tx"]["packets"], s["rx"]["packets"])
                for s in (stats[f"{self.prefix}s{i}"] for i in range(self.hosts))]

    def link_sampler(self, every: float = 0.02) -> LinkSampler:
        """Every host's link byte counters every `every` seconds, read in the
        bridge's namespace while the context runs (`LinkSampler`)."""
        return LinkSampler(self, every)

    def measure_link(self, nbytes: int = 32 << 20, *, src: int = 0, dst: int = 1) -> float:
        """Bits per second from host `src` to host `dst`, measured with a plain
        TCP stream (the slower of the two links bounds it)."""
        started: list[subprocess.Popen] = []
        try:
            sink = self.popen(dst, [PY, "-c", _SINK, self.address(dst)], stdout=subprocess.PIPE,
                              text=True)
            started.append(sink)
            if sink.stdout.readline().strip() != "listening":  # (however slowly it starts)
                raise RuntimeError("the link measurement's receiver did not start")
            source = self.popen(src, [PY, "-c", _SOURCE, self.address(dst), str(nbytes)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            started.append(source)
            _, err = source.communicate(timeout=120)
            if source.returncode != 0:
                raise RuntimeError(f"the link measurement's sender failed: {err.strip()[-500:]}")
            seconds = float(sink.communicate(timeout=120)[0].strip())
            return nbytes * 8 / seconds
        finally:
            for proc in started:  # (an interrupted measurement leaves nothing running)
                if proc.poll() is None:
                    proc.kill()
                proc.communicate()


def require_namespaces(probe: str, made: list[str], what: str = "the emulated cluster") -> None:
    """Refuse (EmulationUnavailable) where `what` cannot be built: not root, no
    iproute2, or network namespaces not allowed. Tries by making the
    namespace `probe`, on `made` while it exists, so the harness's close()
    removes one an interrupt left."""
    if os.geteuid() != 0:
        raise EmulationUnavailable(f"{what} needs root (network namespaces, tc)")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise EmulationUnavailable(
            f"missing {', '.join(missing)}: install iproute2 (apt-get install iproute2)")
    _sh("ip", "netns", "del", probe, check=False)  # (one an interrupted check left)
    made.append(probe)
    done = _sh("ip", "netns", "add", probe, check=False)
    if done.returncode != 0:
        raise EmulationUnavailable("this machine does not allow creating network "
                                   f"namespaces: {done.stderr.strip()}")
    _sh("ip", "netns", "del", probe, check=False)
    made.remove(probe)


def sweep_stale(ours: re.Pattern = _OURS) -> list[str]:
    """Delete the namespaces of earlier runs whose process is gone: a run
    killed outright (SIGKILL, an out-of-memory kill) cannot clean up after
    itself, and its hosts would otherwise stay until reboot. A namespace whose
    tag matches a live process id is kept (it may be another run's). `ours`:
    a harness's names, the tag (a process id modulo 100000) its first group."""
    out = _sh("ip", "netns", "list", check=False).stdout
    stale = []
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = ours.fullmatch(name)
        if m and int(m.group(1)) != os.getpid() % 100000 and not _alive(int(m.group(1))):
            _sh("ip", "netns", "del", name, check=False)
            stale.append(name)
    return stale


def _alive(tag: int) -> bool:
    """Whether some live process may have made namespaces tagged `tag` (a
    process id, or one that is `tag` modulo 100000)."""
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            pid_max = int(f.read())
    except (OSError, ValueError):
        pid_max = 1 << 22
    return any(os.path.exists(f"/proc/{pid}") for pid in range(tag, pid_max + 1, 100000))


class LinkSampler:
    """A process in the bridge's namespace printing, every `every` seconds, the
    time and every host's (downlink, uplink) byte counters; a thread here
    collects them in `samples` as (time, [(down, up), ...]). Reading sysfs
    costs the machine about a percent of a core."""

    def __init__(self, cluster: EmulatedCluster, every: float) -> None:
        names = [f"{cluster.prefix}s{i}" for i in range(cluster.hosts)]
        self._argv = ["ip", "netns", "exec", cluster.switch, PY, "-c", _LINK_SAMPLER,
                      str(every), *names]
        self.samples: list[tuple[float, list[tuple[int, int]]]] = []
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> LinkSampler:
        self._proc = subprocess.Popen(self._argv, stdout=subprocess.PIPE, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            t, *counters = json.loads(line)
            self.samples.append((t, [tuple(c) for c in counters]))

    def __exit__(self, *exc: object) -> None:
        stop_process(self._proc, grace=5)
        self._thread.join(5)
        self._proc.stdout.close()


_LINK_SAMPLER = """
import json, sys, time
every, names = float(sys.argv[1]), sys.argv[2:]
paths = [(f"/sys/class/net/{n}/statistics/tx_bytes", f"/sys/class/net/{n}/statistics/rx_bytes")
         for n in names]
def read(path):
    with open(path) as f:
        return int(f.read())
while True:
    try:
        row = [time.time(), *([read(tx), read(rx)] for tx, rx in paths)]
    except OSError:  # the cluster is being torn down
        break
    print(json.dumps(row), flush=True)
    time.sleep(every)
"""

_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5599)); s.listen(1); print("listening", flush=True); c, _ = s.accept()
buf = bytearray(1 << 20); got = 0; t0 = None
while True:
    n = c.recv_into(buf)
    if not n: break
    if t0 is None: t0 = time.perf_counter()
    got += n
print(time.perf_counter() - t0)
"""

_SOURCE = """
import socket, sys
c = socket.create_connection((sys.argv[1], 5599)); c.sendall(bytes(int(sys.argv[2]))); c.close()
"""
