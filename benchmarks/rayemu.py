"""Ray across emulated hosts: one Ray node per network namespace of an
`EmulatedCluster` (benchmarks/emulated.py), so Ray's object transfers between
nodes cross the tc-shaped links, beside hoplite-gpu running inside the same Ray
actors.

    python -m benchmarks rayemu all            # rl, sgd, collectives; 8 hosts, 1 Gbit/s
    python -m benchmarks rayemu rl --rl-size-mib 256 --iterations 5
    python -m benchmarks rayemu sgd --sgd-size-mib 64 --k 4 --steps 6
    python -m benchmarks rayemu collectives --coll-size-mib 256 --repeats 3
    python -m benchmarks rayemu sweep --coll-size-mib 256 --repeats 2

Every workload runs once per Ray configuration (`--configs`): "ray", Ray as
installed (only the object store sized), and "ray-tuned", with `TUNED` (or
`--set NAME=VALUE ...`) in every node's environment as RAY_NAME; `sweep` runs
`collectives` under each setting in `SWEEP`. Results: benchmarks/results/
rayemu[-<workload>]-<date>.json, and for `collectives` also
collectives-ray-emulated-<date>.json in the format of `python -m benchmarks
emulated` (rows with samples, bound, exact check, link bytes, CPU; a summary).

- `rl`: examples/rl_weights.py: a learner on host 0 trains a torch policy and
  broadcasts its weights to one rollout actor on each other host, which serves
  each version from a double buffer: hoplite-gpu's weight channel vs `ray.put`
  + the ref passed to the actors, which `ray.get` it into a replica.
- `sgd`: examples/async_sgd.py: the server (the driver, host 0) reduces the
  first k of n workers' gradients (one worker per other host) and publishes new
  weights: hoplite-gpu's subset reduce + weight channel vs `ray.wait` + sum +
  `ray.put`.
- `collectives`: Ray's own broadcast (every other host `ray.get`s one object put
  on host 0) and reduce (host 0 gets and sums every other host's object), as
  rows in the format of benchmarks/netbench.py, with Ray's defaults and tuned.

How the Ray cluster is built: `ray start --head --block` in namespace 0 bound to
that host's address (GCS port 6379), `ray start --address=<host 0>:6379 --block`
in every other namespace, each node with a custom resource ``host_<i>: 1`` (the
examples place actors with it), its own short temp dir under /tmp and its own
object store size. The driver runs in namespace 0 (``ip netns exec``) and calls
``ray.init(address=...)``. Worker processes inherit their node's environment, so
``HOPLITE_NODE_HOST`` is that host's address: hoplite-gpu inside a Ray actor
binds to the namespace's eth0 address.

Stopping: not ``ray stop``, which kills every Ray process on the machine by name
(network namespaces do not separate process ids), but exactly the processes this
module started: each ``ray start --block``, its descendants, and any process
whose command line names this run's temp dir; then the temp dirs are removed.
This runs on exit, on errors, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import ray

from hoplite_gpu.lifecycle import Closing

from .emulated import PY, EmulatedCluster

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
RESULTS = ROOT / "benchmarks" / "results"
RAY = str(Path(PY).with_name("ray"))
HEAD_PORT = 6379
MiB = 1 << 20

#: The object-transfer knobs of Ray's object manager tried by `sweep`
#: (RAY_<name> in every node's environment; Ray's defaults: 5 MiB chunks, 2 GiB
#: in flight per node, rpc threads min(max(2, cpus / 4), 8), a pull not done in
#: 10 s is asked again, of a random holder, while the first goes on).
SWEEP: list[dict[str, str]] = [
    {},
    {"object_manager_default_chunk_size": str(1 * MiB)},
    {"object_manager_default_chunk_size": str(64 * MiB)},
    {"object_manager_max_bytes_in_flight": str(5 * MiB)},
    {"object_manager_max_bytes_in_flight": str(64 * MiB)},
    {"object_manager_rpc_threads_num": "8"},
    {"object_manager_pull_timeout_ms": "100000"},
    {"object_manager_pull_timeout_ms": "100000", "object_manager_default_chunk_size": str(1 * MiB)},
]
#: Ray settings for the "ray-tuned" rows, from `sweep` at 256 MiB on 8 hosts
#: (benchmarks/results/rayemu-sweep-2026-11-22.json): with the default 10 s pull
#: timeout, a receiver whose share of a busy sender's uplink needs longer asks
#: again, of a random holder, while the first pull goes on: 1.2-2.2 x the bytes
#: crossed the links and calls took 18-30 s. With 100 s, every byte crossed once
#: and a 256 MiB broadcast took 16.0 s (7.4 x S/B: the star's 7 x). Chunk size,
#: bytes in flight and rpc threads changed little or made it worse.
TUNED: dict[str, str] = {"object_manager_pull_timeout_ms": "100000"}


# ------------------------------------------------------------------ processes ---
def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def _descendants(pids: list[int]) -> set[int]:
    kids, out, todo = _children(), set(), list(pids)
    while todo:
        pid = todo.pop()
        for child in kids.get(pid, []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _naming(marker: str) -> set[int]:
    """Processes whose command line contains `marker` (this run's unique temp dir)."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    out.add(int(entry))
        except OSError:
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _nic(ns: str) -> dict[str, int]:
    """Bytes sent and received so far on a host's shaped interface."""
    out = {}
    for key in ("tx_bytes", "rx_bytes"):
        got = subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/eth0/statistics/{key}"],
                             capture_output=True, text=True, check=True, timeout=30)
        out[key] = int(got.stdout)
    return out


# -------------------------------------------------------------- the cluster ---
class RayOnEmulated(Closing):
    """One Ray node per host of `cluster`; ``with RayOnEmulated(c) as ray_c: ray_c.driver(...)``."""

    def __init__(self, cluster: EmulatedCluster, *, object_store_bytes: int = 1 << 30,
                 head_object_store_bytes: int = 5 << 29, num_cpus: int = 1,
                 ray_config: dict[str, str] | None = None) -> None:
        self.cluster = cluster
        self.object_store_bytes = object_store_bytes
        self.head_object_store_bytes = head_object_store_bytes
        self.num_cpus = num_cpus
        self.ray_config = dict(ray_config or {})
        self.token = secrets.token_hex(32)
        self.root = ""
        self.procs: list[subprocess.Popen] = []
        self._logs: list = []

    @property
    def address(self) -> str:
        return f"{self.cluster.address(0)}:{HEAD_PORT}"

    def env(self, i: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RAY_", "HOPLITE_")) and k != "PYTHONPATH"}
        env.update({
            "PYTHONPATH": f"{ROOT}{os.pathsep}{EXAMPLES}",
            "HOPLITE_NODE_HOST": self.cluster.address(i),  # hoplite-gpu binds to this host's eth0
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",  # a real cluster: nodes use their own address
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,  # Ray's default, own token
            **{f"RAY_{k}": v for k, v in self.ray_config.items()},
        })
        return env

    def _open(self) -> None:
        # Ray puts unix sockets under the temp dir: keep the path short (108 bytes at most)
        self.root = tempfile.mkdtemp(prefix=f"hgr{os.getpid() % 100000}", dir="/tmp")
        self._start(0)
        self._wait_started(0, 120)
        for i in range(1, self.cluster.hosts):
            self._start(i)
        for i in range(1, self.cluster.hosts):
            self._wait_started(i, 180)

    def _start(self, i: int) -> None:
        c = self.cluster
        argv = [RAY, "start", "--block", f"--node-ip-address={c.address(i)}",
                f"--num-cpus={self.num_cpus}", f"--resources={json.dumps({f'host_{i}': 1})}",
                f"--object-store-memory={self.head_object_store_bytes if i == 0 else self.object_store_bytes}",
                f"--temp-dir={self.root}/{i}", "--disable-usage-stats", "--node-manager-port=8076",
                "--object-manager-port=8077"]
        argv += (["--head", f"--port={HEAD_PORT}", "--include-dashboard=false"] if i == 0
                 else [f"--address={self.address}"])
        log = open(f"{self.root}/node{i}.log", "wb")  # noqa: SIM115 (closed in close())
        self._logs.append(log)
        self.procs.append(c.popen(i, argv, stdout=log, stderr=subprocess.STDOUT, env=self.env(i),
                                  start_new_session=True, cwd=self.root))

    def _wait_started(self, i: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        path = f"{self.root}/node{i}.log"
        while time.monotonic() < deadline:
            text = Path(path).read_text(errors="replace")
            if "Ray runtime started" in text:
                return
            if self.procs[i].poll() is not None:
                raise RuntimeError(f"ray start on host {i} exited:\n{text[-3000:]}")
            time.sleep(0.2)
        raise RuntimeError(f"ray start on host {i} did not start in {timeout:.0f} s:\n"
                           f"{Path(path).read_text(errors='replace')[-3000:]}")

    def log_tail(self, chars: int = 2000) -> str:
        out = []
        for i in range(len(self.procs)):
            with contextlib.suppress(OSError):
                out.append(f"--- host {i} ---\n" + Path(f"{self.root}/node{i}.log").read_text(
                    errors="replace")[-chars:])
        return "\n".join(out)

    def close(self) -> None:
        """Stop every process this cluster started (and only those), remove its temp dirs."""
        if self.root:
            tops = [p.pid for p in self.procs]
            mine = set(tops) | _descendants(tops) | _naming(self.root)
            _signal(mine, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                for p in self.procs:
                    p.poll()
                if not any(_alive(pid) for pid in mine):
                    break
                time.sleep(0.2)
            # whatever is left, and anything spawned meanwhile
            left = {pid for pid in mine | _descendants(tops) | _naming(self.root) if _alive(pid)}
            _signal(left, signal.SIGKILL)
            for p in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(_alive(pid) for pid in left):
                time.sleep(0.1)
            for log in self._logs:
                log.close()
            shutil.rmtree(self.root, ignore_errors=True)
        self.procs.clear()
        self._logs.clear()
        self.root = ""

    def driver(self, spec: dict, timeout: float = 3600) -> dict:
        """Run `spec` in a Ray driver on host 0; returns the driver's JSON result."""
        c = self.cluster
        spec = {**spec, "address": self.address, "hosts": c.hosts, "node_ip": c.address(0),
                "addresses": [c.address(i) for i in range(c.hosts)]}
        proc = c.popen(0, [PY, "-m", "benchmarks.rayemu", "_driver", json.dumps(spec)],
                                  stdout=subprocess.PIPE, env=self.env(0), cwd=str(ROOT), text=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except BaseException:
            proc.kill()
            proc.wait(30)
            if proc.stdout is not None:
                proc.stdout.close()  # (left open, a later test's collection warns of it)
            raise
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"the driver failed (exit {proc.returncode}); Ray nodes' logs:\n"
                               f"{self.log_tail()}")
        return json.loads(lines[-1])


# ---------------------------------------------------------- in the driver ---
def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def connect_driver(spec: dict) -> None:
    """In namespace 0: join the Ray cluster of `spec` as its driver, and wait
    (at most 120 s) until each of its `hosts` Ray nodes is alive."""
    ray.init(address=spec["address"], _node_ip_address=spec["node_ip"], log_to_driver=False,
             configure_logging=False)
    hosts = spec["hosts"]
    deadline = time.monotonic() + 120
    while sum(n["Alive"] for n in ray.nodes()) < hosts:
        if time.monotonic() > deadline:
            ray.shutdown()
            raise RuntimeError(f"only {sum(n['Alive'] for n in ray.nodes())} of {hosts} "
                               "Ray nodes joined")
        time.sleep(0.5)


def _driver(spec: dict) -> dict:
    """Runs in namespace 0: connect to the cluster, run one workload, return its result."""
    import hoplite_gpu as hg
    import hoplite_gpu.ray as hray

    connect_driver(spec)
    try:
        hosts = spec["hosts"]
        # the directory on host 0, bound to its address (as in benchmarks/netbench.py)
        directory = hray.start_directory(host=spec["node_ip"],
                                         actor_options={"resources": {"host_0": 0.001}})
        hray.join()  # the driver is a node too (the parameter server in `sgd`)
        probes = [HostProbe.options(resources={f"host_{i}": 0.001}).remote() for i in range(hosts)]
        placement = ray.get([p.where.remote() for p in probes])
        for i, where in enumerate(placement):  # every actor sits where its resource says
            addr = spec["addresses"][i]
            assert where["ray_node_ip"] == where["hoplite_node_host"] == addr, (i, where)
            assert where["hoplite_data_address"].startswith(f"tcp://{addr}:"), (i, where)
        _say("ray nodes: " + ", ".join(f"host {i}: {w['ray_node_ip']}" for i, w in enumerate(placement)))
        meter = Meter(probes)
        try:
            if spec["workload"] == "rl":
                import rl_weights

                res = rl_weights.run(hosts - 1, spec["size"], spec["iterations"], hosts=hosts,
                                     meter=meter.span)
            elif spec["workload"] == "sgd":
                import async_sgd

                res = async_sgd.run(spec["workers"], spec["k"], spec["size"], spec["steps"] + 1,
                                    spec["max_delay"], hosts=hosts, meter=meter.span)
            elif spec["workload"] == "collectives":
                res = {"rows": _ray_collectives(probes, spec)}
            else:
                raise ValueError(spec["workload"])
            res["placement"] = placement
            res["nic_bytes"] = meter.totals
            res["quiet_wait_s"] = meter.quiet_s
            res["directory"] = directory["address"]
            return res
        finally:
            hg.shutdown()
            hray.stop_directory()
    finally:
        ray.shutdown()


@ray.remote(num_cpus=0)
class HostProbe:
    """One per host: where it runs, its NIC counters, and Ray's broadcast and reduce."""

    def where(self) -> dict:
        import hoplite_gpu.ray as hray
        from hoplite_gpu import api

        hray.join()
        return {"ray_node_ip": ray.util.get_node_ip_address(),
                "hoplite_node_host": os.environ.get("HOPLITE_NODE_HOST"),
                "hoplite_data_address": api.runtime().node.server.address}

    def nic(self) -> dict[str, int]:
        return {k: int(Path(f"/sys/class/net/eth0/statistics/{k}").read_text())
                for k in ("tx_bytes", "rx_bytes")}

    # --- Ray's own broadcast and reduce, the inputs and checks of benchmarks/payload.py ---
    def prepare(self, rank: int, world: int, size: int) -> str:
        from . import payload

        self.rank, self.world, self.size = rank, world, size
        self.input = payload.make_input(rank, size)
        self.host = payload.eth0_address()
        return self.host

    def _rank(self, start: float, end: float, ok: bool, crc: int | None) -> dict:
        return {"rank": self.rank, "host": self.host, "starts": [start], "ends": [end],
                "ok": ok, "crc": crc}

    def bcast_put(self, t0: float) -> tuple[dict, list]:
        """The root: at t0, put its input in its node's object store; the ref goes
        (nested, so Ray passes it unresolved) to every receiver."""
        time.sleep(max(0.0, t0 - time.time()))
        start = time.time()
        ref = ray.put(self.input)
        end = time.time()
        return self._rank(start, end, True, zlib.crc32(self.input)), [ref]

    def bcast_get(self, refs: list) -> dict:
        from . import payload

        start = time.time()
        value = ray.get(refs[0])
        end = time.time()
        return self._rank(start, end, *payload.check("broadcast", self.world, value, self.size,
                                                       self.rank))

    @ray.method(num_returns=2)
    def reduce_input(self, t0: float) -> tuple[dict, np.ndarray]:
        """A non-root: at t0, return its input (a task's return: into its node's object store)."""
        time.sleep(max(0.0, t0 - time.time()))
        start = time.time()
        return self._rank(start, start, True, None), self.input

    def reduce_root(self, inputs: list, t0: float) -> dict:
        """The root: from t0, add every other rank's input to its own as each arrives
        (Ray pulls them all at once)."""
        from . import payload

        time.sleep(max(0.0, t0 - time.time()))
        start = time.time()
        acc = self.input.copy()
        pending = list(inputs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=900)
            if not ready:
                raise TimeoutError("an input of the reduce did not arrive in 900 s")
            np.add(acc, ray.get(ready[0]), out=acc)
        end = time.time()
        return self._rank(start, end, *payload.check("reduce", self.world, acc, self.size, 0))


class Meter:
    """Bytes on each host's shaped eth0 during each variant (read by an actor in
    that namespace). Before each span it waits until the links are quiet, so a
    variant never starts while the previous one's bytes are still flowing (Ray's
    re-sent pulls go on after `ray.get` returned); `quiet_s` keeps those waits."""

    def __init__(self, probes: list) -> None:
        self.probes = probes
        self.totals: dict[str, list[dict[str, int]]] = {}
        self.quiet_s: dict[str, list[float]] = {}

    def _read(self) -> list[dict[str, int]]:
        return ray.get([p.nic.remote() for p in self.probes])

    @contextlib.contextmanager
    def span(self, name: str):
        self.quiet_s.setdefault(name, []).append(quiesce(self.probes))
        before = self._read()
        try:
            yield
        finally:
            after = self._read()
            acc = self.totals.setdefault(name, [{"tx_bytes": 0, "rx_bytes": 0} for _ in after])
            for a, b, t in zip(after, before, acc, strict=True):
                for k in t:
                    t[k] += a[k] - b[k]


def quiesce(probes: list, *, quiet: float = 0.5, idle_bytes_per_s: float = 1e6,
            limit: float = 120.0) -> float:
    """Wait until every host's link carries less than `idle_bytes_per_s` for
    `quiet` seconds (heartbeats only); returns how long that took."""
    t0 = time.monotonic()
    last, since = None, t0
    while time.monotonic() - t0 < limit:
        now = time.monotonic()
        cur = sum(c["tx_bytes"] for c in ray.get([p.nic.remote() for p in probes]))
        if last is not None and cur - last[1] > idle_bytes_per_s * (now - last[0]):
            since = now
        if now - since >= quiet:
            return now - t0
        last = (now, cur)
        time.sleep(0.1)
    return time.monotonic() - t0


def _ray_collectives(probes: list, spec: dict) -> list[dict]:
    """Rows in the format of benchmarks/netbench.py (`run_launch`), one per call."""
    from .netbench import CpuSampler, _row, lower_bound
    from .payload import link_volume

    hosts, size, rows = spec["hosts"], spec["size"], []
    system = spec["label"]
    view = _ClusterView(hosts, spec["addresses"], spec["bandwidth_bps"])
    for op in spec["ops"]:
        for launch in range(spec["repeats"]):
            wall = time.monotonic()
            ray.get([p.prepare.remote(i, hosts, size) for i, p in enumerate(probes)])
            quiet = quiesce(probes)  # the previous call's bytes have stopped flowing
            before = ray.get([p.nic.remote() for p in probes])
            t0 = time.time() + 1.0
            with CpuSampler() as cpu:
                if op == "broadcast":
                    root, refs = ray.get(probes[0].bcast_put.remote(t0))
                    ranks = [root, *ray.get([p.bcast_get.remote(refs) for p in probes[1:]],
                                            timeout=1800)]
                    del refs
                else:
                    metas, inputs = zip(*[p.reduce_input.remote(t0) for p in probes[1:]], strict=True)
                    root = probes[0].reduce_root.remote(list(inputs), t0)
                    ranks = [ray.get(root, timeout=1800), *ray.get(list(metas))]
                    del inputs
            after = ray.get([p.nic.remote() for p in probes])
            row = _row(view, system, op, size, ranks, iters=1, warmup=0, period=0.0)
            down = sum(a["rx_bytes"] - b["rx_bytes"] for a, b in zip(after, before, strict=True))
            floor = link_volume(op, hosts, size)
            if down < floor:
                raise AssertionError(f"{system} {op}: only {down} bytes crossed the links, fewer "
                                     f"than the {floor} the op needs")
            row.update(link_bytes_down=down, link_bytes_floor=floor, launch=launch, quiet_wait_s=quiet,
                       cpu=cpu.window(min(row["start_min"]), max(row["end_max"])),
                       launch_wall_s=time.monotonic() - wall, ray_config=spec["ray_config"],
                       nic_bytes=[{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)])
            for key in ("start_max", "end_max", "start_min"):
                row.pop(key)
            assert row["lower_bound_s"] == lower_bound(op, size, hosts, spec["bandwidth_bps"])
            rows.append(row)
            _say(f"{system}: {op} {size >> 20} MiB, {hosts} hosts: {row['seconds']:.3f} s = "
                 f"{row['ratio_to_bound']:.2f} x bound")
    return rows


class _ClusterView:
    """What netbench's `_row` reads of an EmulatedCluster, inside the driver's namespace."""

    def __init__(self, hosts: int, addresses: list[str], bandwidth_bps: float) -> None:
        self.hosts, self._addresses, self.bandwidth_bps = hosts, addresses, bandwidth_bps

    def address(self, i: int) -> str:
        return self._addresses[i]


# ------------------------------------------------------------------ outside ---
def _machine() -> dict:
    import platform

    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "processor": platform.processor()}


def _ray_version() -> str:
    from importlib.metadata import version

    return version("ray")


def run_workloads(args: argparse.Namespace) -> dict:
    """Build the emulated cluster, then a Ray cluster on it per configuration, and run."""
    out: dict = {"hosts": args.hosts, "bandwidth_bps": args.gbit * 1e9, "ray_version": _ray_version(),
                 "object_store_bytes": {"head": args.head_store_mib * MiB, "other": args.store_mib * MiB}}
    names = ["rl", "sgd", "collectives"] if args.workload == "all" else [args.workload]
    with EmulatedCluster(args.hosts, args.gbit * 1e9) as cluster:
        if cluster.swept:
            _say(f"removed {len(cluster.swept)} namespaces left by an earlier run that was "
                  f"killed: {', '.join(cluster.swept)}")
        link = cluster.measure_link()
        out["measured_link_bps"] = link
        _say(f"{args.hosts} hosts, links shaped to {args.gbit:g} Gbit/s "
             f"(measured host 0 -> 1: {link / 1e9:.3f} Gbit/s)")

        def ray_cluster(config: dict[str, str]) -> RayOnEmulated:
            return RayOnEmulated(cluster, object_store_bytes=args.store_mib * MiB,
                                 head_object_store_bytes=args.head_store_mib * MiB, ray_config=config)

        tuned = dict(args.set) if args.set else TUNED
        if "sweep" in names:
            configs = [("ray" if not c else "ray " + " ".join(f"{k}={v}" for k, v in c.items()), c)
                       for c in SWEEP]
        else:
            configs = [(label, config) for name, label, config in
                       (("default", "ray", {}), ("tuned", "ray-tuned", tuned))
                       if name in args.configs]
        out["ray_configs"] = {label: {f"RAY_{k}": v for k, v in c.items()} for label, c in configs}
        rows: list[dict] = []
        for label, config in configs:  # one Ray cluster per configuration, every workload on it
            with ray_cluster(config) as rc:
                if "rl" in names:
                    res = rc.driver({"workload": "rl", "size": args.rl_size_mib * MiB,
                                     "iterations": args.iterations})
                    out.setdefault("rl", {})[label] = res
                    _say(f"RL broadcast of {args.rl_size_mib} MiB to {res['actors']} actors: "
                         f"hoplite-gpu {res['hoplite_median_s']:.3f} s, {label} "
                         f"{res['ray_median_s']:.3f} s, ratio {res['ratio_ray_to_hoplite']:.2f} x")
                if "sgd" in names:
                    res = rc.driver({"workload": "sgd", "size": args.sgd_size_mib * MiB,
                                     "workers": args.hosts - 1, "k": args.k, "steps": args.steps,
                                     "max_delay": args.max_delay})
                    out.setdefault("sgd", {})[label] = res
                    _say(f"async SGD, first {args.k} of {args.hosts - 1} gradients of "
                         f"{args.sgd_size_mib} MiB: {_sgd_rates(res, label)}")
                if "collectives" in names or "sweep" in names:
                    res = rc.driver({"workload": "collectives", "size": args.coll_size_mib * MiB,
                                     "ops": args.ops, "repeats": args.repeats, "label": label,
                                     "ray_config": out["ray_configs"][label],
                                     "bandwidth_bps": args.gbit * 1e9})
                    for row in res["rows"]:
                        row["measured_link_bps"] = link
                    rows += res["rows"]
        if rows:
            out["collectives"] = rows
            out["collectives_settings"] = {
                "hosts": args.hosts, "bandwidth_bps": args.gbit * 1e9, "measured_link_bps": link,
                "sizes_bytes": [args.coll_size_mib * MiB], "ops": args.ops,
                "systems": [label for label, _ in configs], "repeats": args.repeats,
                "ray": {"version": out["ray_version"], "object_store_bytes": out["object_store_bytes"],
                        "configs": out["ray_configs"],
                        "how": "one Ray node per host (ray start in its namespace), one actor per "
                               "host; broadcast: ray.put on host 0, ray.get of the ref on the "
                               "others; reduce: every other host returns its input from an actor "
                               "call, host 0 ray.waits for them and adds each as it arrives"}}
    return out


def _sgd_rates(r: dict, label: str) -> str:
    """Async SGD's rates, named for what they are: 1 / the median step (what
    a server that never waits for a straggler could apply) and, where
    measured, the rate the example's loop ran at (examples/async_sgd.py)."""
    text = (f"1 / median step: hoplite-gpu {r['hoplite_steps_per_s']:.3f} updates/s, {label} "
            f"{r['ray_steps_per_s']:.3f}, ratio {r['ratio_ray_to_hoplite']:.2f} x")
    if "hoplite_loop_steps_per_s" in r and "ray_loop_steps_per_s" in r:
        text += (f"; the loop ran at hoplite-gpu {r['hoplite_loop_steps_per_s']:.3f}, {label} "
                 f"{r['ray_loop_steps_per_s']:.3f} updates/s")
    return text


def _table(out: dict) -> str:
    lines = []
    for label, r in out.get("rl", {}).items():
        lines.append(f"RL weights, {r['size_bytes'] >> 20} MiB to {r['actors']} actors (median s per "
                     f"broadcast): hoplite-gpu {r['hoplite_median_s']:.3f}, {label} "
                     f"{r['ray_median_s']:.3f}, ratio {r['ratio_ray_to_hoplite']:.2f} x")
    for label, r in out.get("sgd", {}).items():
        lines.append(f"async SGD, first {r['k']} of {r['workers']} x {r['size_bytes'] >> 20} MiB: "
                     f"{_sgd_rates(r, label)}")
    groups: dict[tuple, list[dict]] = {}
    for row in out.get("collectives", []):
        groups.setdefault((row["op"], row["label"], row["size_bytes"]), []).append(row)
    for (op, label, size), rows in groups.items():
        med = statistics.median(r["seconds"] for r in rows)
        lines.append(f"{label}: {op} {size >> 20} MiB, {rows[0]['hosts']} hosts: median {med:.3f} s "
                     f"= {med / rows[0]['lower_bound_s']:.2f} x S/B")
    return "\n".join(lines)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _setting(text: str) -> tuple[str, str]:
    """A `--set` argument: NAME=VALUE, NAME a Ray setting without RAY_."""
    name, eq, value = text.partition("=")
    if not eq or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name.strip(), value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_driver"]:
        sys.path.insert(0, str(EXAMPLES))
        # as benchmarks.rayemu, not __main__: Ray workers import the actor classes by name
        from benchmarks import rayemu

        print(json.dumps(rayemu._driver(json.loads(argv[1]))), flush=True)
        # Ray and hoplite-gpu were shut down in `_driver`; the interpreter's own
        # exit (Ray's exit hooks, its threads) once hung past the harness's
        # deadline after the result was out. Nothing is left to clean up.
        sys.stderr.flush()
        os._exit(0)
    p = argparse.ArgumentParser(prog="python -m benchmarks rayemu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", choices=["all", "rl", "sgd", "collectives", "sweep"],
                   help="sweep: Ray's broadcast and reduce under each setting in SWEEP")
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--gbit", type=float, default=1.0)
    p.add_argument("--rl-size-mib", type=int, default=256)
    p.add_argument("--iterations", type=int, default=5, help="rl: timed broadcasts (after a warm-up)")
    p.add_argument("--sgd-size-mib", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="sgd: gradients reduced per step")
    p.add_argument("--steps", type=int, default=6, help="sgd: timed steps (after a warm-up)")
    p.add_argument("--max-delay", type=float, default=0.2, help="sgd: a worker's compute, up to (s)")
    p.add_argument("--coll-size-mib", type=int, default=256)
    p.add_argument("--ops", nargs="+", default=["broadcast", "reduce"], choices=["broadcast", "reduce"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--configs", nargs="+", default=["default", "tuned"], choices=["default", "tuned"],
                   help="collectives: Ray as installed, and/or with the --set settings")
    p.add_argument("--set", nargs="+", metavar="NAME=VALUE", type=_setting,
                   help=f"collectives: the tuned Ray settings (RAY_NAME in every node's "
                        f"environment); default {' '.join(f'{k}={v}' for k, v in TUNED.items())}")
    p.add_argument("--store-mib", type=int, default=1024, help="Ray object store per node")
    p.add_argument("--head-store-mib", type=int, default=2560, help="Ray object store on host 0")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--out", help="write the JSON here instead of benchmarks/results/")
    args = p.parse_args(argv)
    # SIGTERM, and SIGINT where a background shell ignores it, unwind like Ctrl-C,
    # so every context manager above cleans up
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    out = run_workloads(args)
    print(_table(out))
    today = dt.date.today().isoformat()
    meta = {"command": " ".join(["python -m benchmarks rayemu", *argv]),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": _machine()}
    if args.out:
        Path(args.out).write_text(json.dumps({"benchmark": "rayemu", **out, **meta}, indent=2))
    elif not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / (f"rayemu-{today}.json" if args.workload == "all"
                          else f"rayemu-{args.workload}-{today}.json")
        path.write_text(json.dumps({"benchmark": "rayemu", **out, **meta}, indent=2))
        _say(f"saved {path.relative_to(ROOT)}")
        if args.workload in ("all", "collectives"):
            # beside the other systems' results, in the format of `python -m benchmarks emulated`
            from .emurun import summarize

            coll = RESULTS / f"collectives-ray-emulated-{today}.json"
            coll.write_text(json.dumps({"benchmark": "collectives-ray-emulated",
                                        "settings": out["collectives_settings"],
                                        "rows": out["collectives"],
                                        "summary": summarize(out["collectives"]), **meta}, indent=2))
            _say(f"saved {coll.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
