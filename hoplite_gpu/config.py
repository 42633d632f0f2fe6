"""One typed, frozen configuration object, read once from ``HOPLITE_*`` variables."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import numbers
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from fractions import Fraction

from .errors import ConfigError, InvalidArgument

_PREFIX = "HOPLITE_"
#: The settings of TLS (`hoplite_gpu.tls`): all three or none.
TLS_SETTINGS = ("tls_cert", "tls_key", "tls_ca")
#: Transports whose streams take device buffers as they are (`StreamCaps.device`).
DEVICE_TRANSPORTS = ("ucx",)
KiB = 1024
MiB = 1024 * KiB
#: A relay over a byte stream (TCP) passes received bytes on every this many
#: (node/pull_modes.py, STEP); over a message transport (UCX), a message at a
#: time. The directory's broadcast model counts a hop's fill in these.
RELAY_STEP = 256 * KiB
#: The longest deadline a call or setting may have (a year): "forever" is
#: not a deadline, and longer ones overflow the waits they bound.
MAX_TIMEOUT_S = 365 * 24 * 3600.0
#: The longest rack label (`Config.rack`), and what it may be made of.
RACK_MAX = 64
_RACK = re.compile(r"[A-Za-z0-9._:/-]{1,64}")
#: `Config.rack` naming no label but the bits of the node's address that
#: make its rack (`rack_label`)
_SUBNET_RACK = re.compile(r"subnet/(\d{1,3})")


def rack_label(rack: str | None, host: str) -> str | None:
    """The rack a node registers: the label `rack` (HOPLITE_RACK), or with
    ``subnet/N`` the network of its data address `host`, N bits long
    (``10.88.1.0/24``): nodes whose addresses share those bits share a rack,
    as hosts on a leaf's own subnet do. ConfigError if `host` is no IP
    address or N is longer than its address."""
    got = None if rack is None else _SUBNET_RACK.fullmatch(rack)
    if got is None:
        return rack
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise ConfigError(f"rack (HOPLITE_RACK={rack!r}) takes this node's rack from its "
                          f"address, but {host!r} is not an IP address: set HOPLITE_NODE_HOST "
                          "to one, or name the rack") from None
    bits = int(got.group(1))
    if not 1 <= bits <= ip.max_prefixlen:
        raise ConfigError(f"rack (HOPLITE_RACK={rack!r}): an IPv{ip.version} address has "
                          f"1 to {ip.max_prefixlen} bits to take, not {bits}")
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))


def check_timeout(timeout: object, *, zero: bool = False) -> float:
    """`timeout` as seconds: a number above 0 (or 0, with `zero`: poll once)
    and at most MAX_TIMEOUT_S; anything else is InvalidArgument."""
    low = "a number of seconds >= 0" if zero else "a positive number of seconds"
    if (not _real(timeout) or not (0 <= timeout if zero else 0 < timeout)
            or not timeout <= MAX_TIMEOUT_S):
        raise InvalidArgument(f"timeout must be {low}, at most {MAX_TIMEOUT_S:g} (a year); "
                              f"got {timeout!r}")
    return float(timeout)


def _real(value: object) -> bool:
    """A real number, NumPy's included (np.int64, np.float32), but no bool."""
    return isinstance(value, numbers.Real) and not (
        isinstance(value, bool) or type(value).__name__ == "bool_")


@dataclass(frozen=True)
class Config:
    """Runtime settings. Every field can be set by ``HOPLITE_<NAME>`` (upper case).

    Defaults suit one machine or a small cluster; see README "Configuration".
    """

    #: Shared cluster secret; every control and data connection proves it knows it.
    token: str | None = field(default=None, repr=False)
    #: Transport scheme for data connections (see `hoplite-gpu info` for the usable ones).
    transport: str = "tcp"
    #: Transport scheme of control connections: each node's to the directory.
    #: TCP also when data goes over UCX, where a small message waits on
    #: ucxx's polled requests (see docs/architecture.md, "Control connections").
    control_transport: str = "tcp"
    #: Interface a node's data server binds to. Loopback unless you run across hosts.
    #: Several, comma-separated (`10.0.0.5/24,10.1.0.5/24`): one per rail (a
    #: NIC and its subnet, the prefix /24 (IPv4) or /64 (IPv6) if not
    #: given); the data server listens on each, the node registers them all,
    #: and a large pull is spread over the rails it shares with its sender
    #: (docs/fabric.md, "Rails and paths").
    node_host: str = "127.0.0.1"
    #: Bytes per pipelined chunk.
    chunk_size: int = 4 * MiB
    #: Bytes per pipelined chunk of a device object where the transport moves
    #: device memory itself (UCX): its frames, its put's device copy and its
    #: reduce folds. Each chunk is one UCX message, and a message costs a fixed
    #: 0.2-0.35 ms on an H100 besides the copy, so device chunks are larger (see
    #: benchmarks/README, "GPU"). Over TCP device chunks are staged through host
    #: memory and keep `chunk_size`.
    device_chunk_size: int = 64 * MiB
    #: Objects this size or smaller travel inline through the directory.
    inline_threshold: int = 64 * KiB
    #: A blocking put or get of an inline host object is made by the calling
    #: thread itself, over its own connection to the directory, instead of
    #: through the runtime's loop thread (docs/architecture.md, "Direct calls").
    #: TCP control connections only.
    direct_calls: bool = True
    #: How many receivers one node serves one object to at a time: the paper uses 1
    #: (a pipelined chain); 0 lets the cost model choose from the number of receivers.
    max_receivers_per_sender: int = 1
    #: Senders one pull of a large object may have at once: a receiver is
    #: given, besides its sender, complete copies that serve nobody, and pulls
    #: pieces from each (docs/design.md, "Pulls from several senders"). 1:
    #: one sender per pull.
    max_sources: int = 4
    #: Objects at least this large may be pulled from several senders, or
    #: from one over several rails or paths.
    multi_source_bytes: int = 16 * MiB
    #: ECMP paths a pull of at least `multi_source_bytes` from one sender is
    #: split over (per rail): one sub-flow per path, each on a TCP connection
    #: whose source port this node chose for that path, paths assigned least
    #: loaded first (docs/fabric.md, "Rails and paths"). 1: off, the kernel
    #: picks source ports.
    paths: int = 1
    #: Source ports the sub-flows of `paths` are bound to ("low-high"): with
    #: n paths, port p is taken to lie on path (p - low) mod n, unless
    #: `path_map` says otherwise; one in use is skipped.
    path_ports: str = "61000-61999"
    #: A JSON file mapping source ports to paths, which a fabric harness
    #: learned (e.g. with `ip route get ... sport P dport Q`): {destination:
    #: {port: path}}, a destination being a data address's "host:port", its
    #: "host", or "*"; re-read when it changes. None: ports by their class.
    path_map: str | None = None
    #: Where this node sits in the fabric: a label shared by the nodes under
    #: one switch (a rack, a leaf), registered with the directory, which then
    #: prefers a sender in the receiver's rack, so a broadcast's chain
    #: crosses the switches' uplinks once per rack (docs/fabric.md, "Racks").
    #: None: no rack (every sender alike, as before).
    rack: str | None = None
    #: Stripes of a broadcast object of at least `multi_source_bytes`: its
    #: bytes in contiguous ranges, each sent down a tree of its own in which
    #: a receiver relays at most one (docs/design.md, "Striped broadcast").
    #: 0: where the cost model says two stripes beat the chain, or its own
    #: fan-out with `max_receivers_per_sender` 0 (many receivers: a chain or
    #: tree of them fills too slowly; a fan-out set above 1 is kept); 1:
    #: never; 2: always.
    stripes: int = 0
    #: Default deadline, in seconds, of every blocking call that is given none.
    timeout_s: float = 300.0
    #: Deadline for connecting (and authenticating) to the directory or a peer.
    connect_timeout_s: float = 10.0
    #: A transfer that moves no byte for this long counts as failed.
    stall_timeout_s: float = 10.0
    #: How long, in seconds, `shutdown()` waits for peers still pulling an
    #: object of which this node holds the only complete copy (a broadcast's
    #: root that leaves right after its put): they finish instead of losing
    #: the object. Ctrl-C cuts the wait short; 0: no wait. Nobody pulling: no wait.
    shutdown_grace_s: float = 5.0
    #: How often a node renews its lease with the directory.
    heartbeat_interval_s: float = 1.0
    #: A node whose lease is not renewed for this long is declared dead.
    node_lease_s: float = 5.0
    #: Bytes of freed object buffers a node keeps for reuse (0 turns reuse off).
    pool_bytes: int = 1 << 30
    #: Most bytes of host objects a node holds (its puts, copies it pulled,
    #: reduce results); 0: no limit. A put or get that would go over first
    #: evicts pulled copies that another node also holds, least recently used
    #: first, and fails with `StoreFull` if that is not enough (README,
    #: "Memory"). Freed buffers the pool keeps (`pool_bytes`) come on top.
    store_bytes: int = 0
    #: Cost model: one-way latency of a transfer between two nodes (reduce tree shape).
    link_latency_s: float = 1e-4
    #: Cost model: bandwidth of one node's link, bytes per second (reduce tree shape).
    link_bytes_per_s: float = 1.25e9
    #: Log level name for the "hoplite_gpu" logger (DEBUG, INFO, WARNING, ...).
    log_level: str = "WARNING"
    #: "adaptive" (the default) slices a large allreduce of NumPy arrays into
    #: one piece per rank (a ring's traffic, 2(N-1)/N of the object per link
    #: instead of 2x) when every rank's input is ready within
    #: `allreduce_slicing_window_s` of its own and the ranks are on more than
    #: one host, and otherwise reduces whole objects in the order the inputs
    #: arrive, the better schedule for late inputs and on one host; "auto"
    #: always slices, after waiting for every rank's input; "off" never does
    #: (docs/cost-model.md, "Sliced allreduce"). Every rank needs the same value.
    allreduce_slicing: str = "adaptive"
    #: With ``allreduce_slicing="adaptive"``: how long, in seconds, a rank waits
    #: for the other ranks' inputs before it gives up on slicing.
    allreduce_slicing_window_s: float = 0.05
    #: Pull from nodes on the same host (the same network namespace) through
    #: shared memory: the sender's buffer is mapped and copied, not sent
    #: through sockets (see `hoplite_gpu.node.shm`). Host objects only.
    shared_memory: bool = True
    #: TLS on every TCP connection between processes (control, data, direct
    #: calls), mutual: this process's certificate (PEM, its chain after it),
    #: its private key (PEM, unencrypted), and the cluster's CA, which must
    #: have signed every peer's certificate. All three or none (none: no
    #: TLS). UCX data carries no TLS (docs/security.md).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None

    def __post_init__(self) -> None:
        for name in ("path_map", "rack"):
            if getattr(self, name) == "":  # (HOPLITE_PATH_MAP= : not set)
                object.__setattr__(self, name, None)
        for name in TLS_SETTINGS:
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, name, os.fspath(value))
            elif value == "":  # (HOPLITE_TLS_CERT= : not set)
                object.__setattr__(self, name, None)
        for f in fields(self):
            _check_type(f, getattr(self, f.name))
        self._check_tls()
        self._check_values()
        self._check_paths()

    def _check_tls(self) -> None:
        given = [name for name in TLS_SETTINGS if getattr(self, name) is not None]
        if given and len(given) < len(TLS_SETTINGS):
            missing = [n for n in TLS_SETTINGS if n not in given]
            raise ConfigError(
                "TLS needs all three of HOPLITE_TLS_CERT, HOPLITE_TLS_KEY and HOPLITE_TLS_CA "
                f"(tls_cert, tls_key, tls_ca), or none; {', '.join(given)} given, "
                f"{', '.join(missing)} not")

    def _check_paths(self) -> None:
        """Rails and ECMP paths (docs/fabric.md, "Rails and paths")."""
        self.node_hosts()  # (ConfigError naming the bad entry)
        if not 1 <= self.paths <= 64:
            raise ConfigError(f"paths (HOPLITE_PATHS) must be between 1 and 64; got {self.paths}")
        ports = self.path_port_range()
        if self.paths > 1 and self.transport != "tcp":
            raise ConfigError(f"paths (HOPLITE_PATHS={self.paths}) pins each sub-flow's source "
                              f"port, which only the tcp transport can; transport is "
                              f"{self.transport!r}")
        if self.path_map is not None and self.paths < 2:
            raise ConfigError(f"path_map (HOPLITE_PATH_MAP={self.path_map!r}) maps ports to "
                              "paths, but paths (HOPLITE_PATHS) is 1: set it to their number")
        if len(ports) < self.paths:
            raise ConfigError(f"path_ports (HOPLITE_PATH_PORTS={self.path_ports!r}) holds "
                              f"{len(ports)} ports, fewer than paths ({self.paths})")
        if self.rack is not None and not _RACK.fullmatch(self.rack):
            raise ConfigError(f"rack (HOPLITE_RACK={self.rack!r}) must be 1 to {RACK_MAX} "
                              "letters, digits or . _ : / -, or subnet/N")
        subnet = None if self.rack is None else _SUBNET_RACK.fullmatch(self.rack)
        if subnet is not None and not 1 <= int(subnet.group(1)) <= 128:
            raise ConfigError(f"rack (HOPLITE_RACK={self.rack!r}): subnet/N takes N bits of "
                              "this node's address, 1 to 32 (IPv4) or 128 (IPv6)")

    def _check_values(self) -> None:
        if not isinstance(logging.getLevelName(self.log_level.upper()), int):
            raise ConfigError(f"log_level must be one of {', '.join(_LEVELS)}; "
                              f"got {self.log_level!r}")
        if self.allreduce_slicing not in ("off", "auto", "adaptive"):
            raise ConfigError("allreduce_slicing must be 'off', 'auto' or 'adaptive'; "
                              f"got {self.allreduce_slicing!r}")
        for name in ("chunk_size", "device_chunk_size"):
            if getattr(self, name) < 4 * KiB:
                raise ConfigError(f"{name} must be at least 4096 bytes; got {getattr(self, name)}")
        for name in ("pool_bytes", "store_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0; got {getattr(self, name)}")
        if not 0 <= self.inline_threshold <= 16 * MiB:
            raise ConfigError(
                f"inline_threshold must be between 0 and 16 MiB (inline objects travel in "
                f"control messages); got {self.inline_threshold}")
        if self.max_receivers_per_sender < 0:
            raise ConfigError(
                f"max_receivers_per_sender must be >= 1, or 0 for automatic; "
                f"got {self.max_receivers_per_sender}"
            )
        if self.stripes not in (0, 1, 2):
            raise ConfigError(f"stripes must be 0 (the cost model's choice), 1 (off) or 2; "
                              f"got {self.stripes} (more than two stripes would over-fill "
                              "uplinks as receivers arrive: docs/design.md, \"Striped broadcast\")")
        if not 1 <= self.max_sources <= 64:
            raise ConfigError(f"max_sources must be between 1 and 64; got {self.max_sources}")
        if not 0 <= self.shutdown_grace_s <= MAX_TIMEOUT_S:
            raise ConfigError(f"shutdown_grace_s must be >= 0 and at most {MAX_TIMEOUT_S:g}; "
                              f"got {self.shutdown_grace_s}")
        if self.multi_source_bytes < 0:
            raise ConfigError(f"multi_source_bytes must be >= 0; got {self.multi_source_bytes}")
        for name in ("timeout_s", "connect_timeout_s", "stall_timeout_s",
                     "allreduce_slicing_window_s", "heartbeat_interval_s", "node_lease_s",
                     "link_latency_s", "link_bytes_per_s"):
            bound = 1e30 if name == "link_bytes_per_s" else MAX_TIMEOUT_S  # (seconds: a year)
            if not 0 < getattr(self, name) <= bound:
                raise ConfigError(f"{name} must be > 0 and at most {bound:g}; "
                                  f"got {getattr(self, name)}")
        if self.node_lease_s <= self.heartbeat_interval_s:
            raise ConfigError(
                f"node_lease_s ({self.node_lease_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), or every node would expire between beats"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Config:
        """Build a Config from ``HOPLITE_*`` variables, then apply keyword overrides.

        Unknown ``HOPLITE_*`` names and unknown keywords are refused, so a typo
        never silently falls back to a default.
        """
        environ = os.environ if environ is None else environ
        known = {f.name: f for f in fields(cls)}
        values: dict[str, object] = {}
        for key, raw in environ.items():
            if not key.startswith(_PREFIX):
                continue
            name = key[len(_PREFIX):].lower()
            if name not in known:
                raise ConfigError(
                    f"unknown setting {key}; known: "
                    + ", ".join(_PREFIX + n.upper() for n in sorted(known))
                )
            values[name] = _parse(known[name], raw, key)
        for name, value in overrides.items():
            if name not in known:
                raise ConfigError(f"unknown setting {name!r}; known: {', '.join(sorted(known))}")
            kind = _kind(known[name]).split(" ")[0]
            if isinstance(value, str) and kind != "str":
                value = _parse(known[name], value, name)  # "8GiB", "30", "on"
            elif kind == "float" and _real(value):
                value = float(value)  # (np.float32(5), np.int64(30))
            elif kind == "int" and isinstance(value, numbers.Integral) and _real(value):
                value = int(value)
            if value is not None:
                values[name] = value
        return cls(**values)

    def chunk_bytes(self, device: bool) -> int:
        """Pipelining unit for an object's bytes: `device_chunk_size` for device
        memory that the transport moves itself, else `chunk_size`."""
        return self.device_chunk_size if device and self.transport in DEVICE_TRANSPORTS \
            else self.chunk_size

    def relay_bytes(self) -> int:
        """Bytes a relay passes on at a time (host objects): `RELAY_STEP` over
        TCP, a whole message (`chunk_size`) over a message transport."""
        return min(self.chunk_size, RELAY_STEP) if self.transport == "tcp" else self.chunk_size

    def node_hosts(self) -> list[tuple[str, int | None]]:
        """`node_host`'s entries: (host, the rail's prefix length or None)."""
        return parse_node_hosts(self.node_host)

    def path_port_range(self) -> range:
        """`path_ports` as a range of port numbers."""
        return parse_port_range(self.path_ports)

    def replace(self, **changes: object) -> Config:
        return dataclasses.replace(self, **changes)

    def directory_settings(self) -> dict[str, object]:
        """The settings a directory schedules with."""
        return {"transport": self.control_transport, "handshake_timeout": self.connect_timeout_s,
                "max_receivers_per_sender": self.max_receivers_per_sender,
                "max_sources": self.max_sources, "multi_source_bytes": self.multi_source_bytes,
                "stripes": self.stripes, "relay_bytes": self.relay_bytes(),
                "latency_s": self.link_latency_s, "bytes_per_s": self.link_bytes_per_s,
                "chunk_size": self.chunk_size, "lease_s": self.node_lease_s,
                "heartbeat_interval_s": self.heartbeat_interval_s}


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _kind(f: dataclasses.Field) -> str:
    """A field's type name: "int", "float", "bool", "str", "str | None"."""
    return f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))


def _check_type(f: dataclasses.Field, value: object) -> None:
    kind = _kind(f)
    if value is None and kind.endswith("None"):
        return
    ok = {"int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool),
          "bool": isinstance(value, bool)}.get(kind.split(" ")[0], isinstance(value, str))
    if not ok:
        raise ConfigError(f"{f.name} must be {kind.split(' ')[0]}; got {value!r} "
                          f"({type(value).__name__})")


#: Entries `node_host` may list (rails of one node).
MAX_NODE_HOSTS = 16
_WILDCARDS = ("0.0.0.0", "::", "")


def parse_node_hosts(text: str) -> list[tuple[str, int | None]]:
    """HOPLITE_NODE_HOST's entries, comma-separated, each a host name or an
    IP address, an IP with the prefix length of its rail's subnet after a
    slash (`10.0.0.5/24`): (host, prefix or None). ConfigError naming the
    setting and the bad entry."""
    what = f"node_host (HOPLITE_NODE_HOST={text!r})"
    if not isinstance(text, str):
        raise ConfigError(f"{what} must be a str")
    entries = [part.strip() for part in text.split(",")]
    if len(entries) > MAX_NODE_HOSTS:
        raise ConfigError(f"{what} lists {len(entries)} hosts; at most {MAX_NODE_HOSTS}")
    hosts: list[tuple[str, int | None]] = []
    for entry in entries:
        host, slash, prefix = entry.partition("/")
        host = host.strip().removeprefix("[").removesuffix("]")
        if len(entries) > 1 and (not host or host in _WILDCARDS):
            raise ConfigError(f"{what}: {entry!r} is no address of one interface; list each "
                              "rail's address, or give a wildcard alone")
        bits = None
        if slash:
            try:
                family = ipaddress.ip_address(host).version
                bits = int(prefix)
            except ValueError:
                raise ConfigError(f"{what}: {entry!r} is not an IP address with a prefix "
                                  "length (like 10.0.0.5/24)") from None
            if host in _WILDCARDS or not 0 <= bits <= (32 if family == 4 else 128):
                raise ConfigError(f"{what}: {entry!r} has no usable prefix length")
        if any(host == seen for seen, _ in hosts):
            raise ConfigError(f"{what} lists {host!r} twice")
        hosts.append((host, bits))
    return hosts


def parse_port_range(text: str) -> range:
    """HOPLITE_PATH_PORTS: "low-high", ports from 1024 to 65535 (ConfigError
    naming the setting otherwise)."""
    low, dash, high = str(text).partition("-")
    try:
        lo, hi = int(low), int(high)
    except ValueError:
        lo = hi = -1
    if not dash or not 1024 <= lo <= hi <= 65535:
        raise ConfigError(f"path_ports (HOPLITE_PATH_PORTS={text!r}) must be \"low-high\", "
                          "ports between 1024 and 65535, low <= high")
    return range(lo, hi + 1)


_UNITS = {"k": KiB, "m": MiB, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from '4096', '0x1000', '64KiB', '256M', '1.5GiB' (binary units)."""
    t, unit = text.strip().lower(), 1
    if not t.startswith("0x"):
        t = t.removesuffix("ib").removesuffix("b").strip()
        if t[-1:] in _UNITS:
            unit, t = _UNITS[t[-1]], t[:-1].strip()
    try:
        # (exact: a float would round sizes above 2**53 to a neighbour)
        size = (int(t, 16) if t.startswith("0x") else Fraction(t)) * unit
    except (ValueError, ZeroDivisionError):
        size = Fraction(-1)
    if "/" in t or not (0 <= size < 1 << 63) or size != int(size):
        raise ConfigError(f"not a size in whole bytes: {text!r} (examples: 4096, 64KiB, "
                          "256MiB, 1.5GiB)")
    return int(size)


def available_memory() -> int:
    """Bytes the kernel could give this process now (page cache included), as
    /proc/meminfo's MemAvailable says; elsewhere, the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def format_size(size: int) -> str:
    """'64 KiB', '1.5 MiB', '4096 B': a size as `parse_size` reads it back."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            value = size / (1 << shift)
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.4g} {unit}"
    return f"{size} B"


def _parse(f: dataclasses.Field, raw: str, key: str) -> object:
    kind = _kind(f)
    try:
        if kind.startswith("int") and (f.name.endswith("_size") or f.name.endswith("_bytes")
                                       or f.name == "inline_threshold"):
            return parse_size(raw)
        if kind.startswith("int"):
            return int(raw, 0)
        if kind.startswith("float"):
            return float(raw)
        if kind.startswith("bool"):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
    except ConfigError as exc:
        raise ConfigError(f"{key}={raw!r}: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"{key}={raw!r} is not a valid {kind}") from exc
    return raw
