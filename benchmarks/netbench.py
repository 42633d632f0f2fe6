"""Collectives on the emulated cluster, one launch of a system at a time.

Systems: hoplite-gpu (its `collectives` module: put/get/reduce), star
(hoplite-gpu with every receiver of an object served by its owner, fan-out
N-1: a naive broadcast), gloo (torch.distributed defaults), openmpi (mpi4py,
OpenMPI's defaults) and openmpi-tuned (mpi4py, the MCA settings in
`benchmarks.mpi.TUNED_MCA`).

Every launch does the same thing on every system: every rank makes its input,
the ranks agree on a start time t0, then call the collective `warmup + iters`
times, call k at wall time t0 + k * period (+ the rank's ready offset in the
dynamic-arrival runs). One call's time is from the first rank's start to the
last end that matters (every rank's for broadcast, allreduce and allgather;
the root's for reduce and gather). All namespaces share one kernel clock, so
starts and ends from different hosts compare directly. Results are checked
exactly (`benchmarks.payload`), and the bytes that crossed the shaped links are
counted and must reach the floor that the op needs (`payload.link_volume`).

A cluster whose hosts have several links (`benchmarks.rails`) says what a
hoplite-gpu node advertises (`node_host(i)`; else `address(i)`) and which
interfaces OpenMPI may use (`interfaces`; else eth0).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import threading
import time

from hoplite_gpu.auth import new_token

from .emulated import PY, EmulatedCluster
from .payload import holds_result, link_volume

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ("hoplite-gpu", "star", "gloo", "openmpi", "openmpi-tuned", "hoplite-gpu-ucx",
           "hoplite-gpu-sliced", "hoplite-gpu-loop", "hoplite-gpu-whole", "hoplite-gpu-group")
#: What `--systems` runs unless told: the hoplite-gpu variants are asked for by name.
DEFAULT_SYSTEMS = SYSTEMS[:5]
#: hoplite-gpu over UCX: UCX's tcp transport on the shaped eth0 only (no shared
#: memory, no loopback lanes), so every byte crosses the emulated links; with
#: the event-driven progress (8 spinning processes would take the 2 cores).
UCX_ENV = {"HOPLITE_TRANSPORT": "ucx", "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0",
           "UCXPY_PROGRESS_MODE": "event"}
#: hoplite-gpu with settings other than its defaults, run as systems of their own.
VARIANT_ENV = {"hoplite-gpu-ucx": UCX_ENV,
               "hoplite-gpu-sliced": {"HOPLITE_ALLREDUCE_SLICING": "auto"},
               "hoplite-gpu-whole": {"HOPLITE_ALLREDUCE_SLICING": "off"},
               "hoplite-gpu-loop": {"HOPLITE_DIRECT_CALLS": "0"},
               # calls on a `hoplite_gpu.Group` (numbered calls, freed by the group)
               "hoplite-gpu-group": {}}


def lower_bound(op: str, size: int, hosts: int, bandwidth_bps: float) -> float:
    """S/B for broadcast, reduce and the dynamic allreduce after its last input
    (that input's S bytes must leave its host); 2(N-1)/N S/B for allreduce;
    (N-1) S/B for gather (the root's downlink) and allgather (every downlink)."""
    t = size * 8 / bandwidth_bps
    if op == "allreduce":
        return 2 * (hosts - 1) / hosts * t
    if op in ("gather", "allgather"):
        return (hosts - 1) * t
    return t


def _close(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.stdin is not None and not p.stdin.closed:
            try:
                p.stdin.close()  # hoplite nodes stop serving and exit
            except BrokenPipeError:
                pass
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
        if p.stdout is not None:
            p.stdout.close()


def _readline(p: subprocess.Popen, what: str) -> dict:
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"{what} exited (code {p.wait(10)}) without reporting")
    return json.loads(line)


def hoplite_run(c: EmulatedCluster, op: str, size: int, name: str, *, fanout: int = 1,
                iters: int = 1, warmup: int = 0, period: float = 0.0,
                ready: list[float] | None = None, chunk: int | None = None,
                sync: bool = False, variant: str = "",
                env: dict[str, str] | None = None) -> list[dict]:
    """hoplite-gpu: a directory on host 0 and one node per host; every rank
    calls `hoplite_gpu.collectives.<op>` (with the settings of `variant`, a
    key of VARIANT_ENV, if given, and `env` on top). Returns every rank's
    report."""
    token = new_token()
    env = {**os.environ, "PYTHONPATH": ROOT, "HOPLITE_TOKEN": token,
           "HOPLITE_MAX_RECEIVERS_PER_SENDER": str(fanout), **VARIANT_ENV.get(variant, {}),
           **(env or {})}
    node_host = getattr(c, "node_host", c.address)  # (a host with several rails lists them)
    directory = c.popen(0, [PY, "-m", "hoplite_gpu", "directory", "--host", c.address(0),
                            "--port", "7777"], stdout=subprocess.PIPE, text=True, env=env)
    procs: list[subprocess.Popen] = []
    try:
        directory.stdout.readline()
        for i in range(c.hosts):
            procs.append(c.popen(i, [
                PY, "-m", "benchmarks.netnode", "--address", f"{c.address(0)}:7777",
                f"--token={token}", "--name", name, "--size", str(size), "--op", op,
                "--rank", str(i), "--world", str(c.hosts), "--node-host", node_host(i),
                "--iters", str(iters), "--warmup", str(warmup), "--period", str(period),
                "--ready-after", str(ready[i] if ready else 0.0),
                *(["--chunk-size", str(chunk)] if chunk else []), *(["--sync"] if sync else []),
                *(["--group"] if variant == "hoplite-gpu-group" else [])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT))
        for i, p in enumerate(procs):  # a barrier: every node has joined and made its input
            _readline(p, f"hoplite-gpu node {i}")
        t0 = json.dumps({"t0": time.time() + 0.3}) + "\n"
        for i, p in enumerate(procs):
            try:
                p.stdin.write(t0)
                p.stdin.flush()
            except BrokenPipeError:
                raise RuntimeError(f"hoplite-gpu node {i} exited before the start") from None
        return [_readline(p, f"hoplite-gpu node {i}") for i, p in enumerate(procs)]
    finally:
        _close(procs)  # the nodes leave first, then the directory stops
        directory.terminate()
        _close([directory])


_GLOO_PORT = [29555]


def gloo_run(c: EmulatedCluster, op: str, size: int, *, iters: int = 1, warmup: int = 0,
             period: float = 0.0, ready: list[float] | None = None,
             sync: bool = False) -> list[dict]:
    """Gloo (torch.distributed defaults, bound to the shaped eth0) on every host."""
    env = {**os.environ, "PYTHONPATH": ROOT, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    _GLOO_PORT[0] = 29555 + (_GLOO_PORT[0] - 29555 + 1) % 200  # no TIME_WAIT clash between runs
    procs = [c.popen(i, [PY, "-m", "benchmarks.gloonode", "--rank", str(i), "--world", str(c.hosts),
                         "--master", c.address(0), "--port", str(_GLOO_PORT[0]), "--size", str(size),
                         "--op", op, "--iters", str(iters), "--warmup", str(warmup),
                         "--period", str(period), "--ready-after", str(ready[i] if ready else 0.0),
                         *(["--sync"] if sync else [])],
                     stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT) for i in range(c.hosts)]
    try:
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    finally:
        _close(procs)
    if procs[0].returncode != 0 or not outs[0].strip():
        raise RuntimeError(f"gloo rank 0 failed (exit {procs[0].returncode})")
    return json.loads(outs[0].strip().splitlines()[-1])["ranks"]


class CpuSampler:
    """Samples /proc/stat (the whole machine: every emulated host shares its
    cores) every 20 ms, to tell how busy the CPUs were while calls ran."""

    def __init__(self, every: float = 0.02) -> None:
        self.every, self.samples = every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _read() -> list[int]:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:8]]

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self._read()))
            self._stop.wait(self.every)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def window(self, t_a: float, t_b: float) -> dict | None:
        """Fractions of all cores' time between t_a and t_b: busy, and its user,
        system and softirq (packet forwarding, shaping) parts."""
        if len(self.samples) < 2:
            return None
        before = [s for s in self.samples if s[0] <= t_a] or self.samples[:1]
        after = [s for s in self.samples if s[0] >= t_b] or self.samples[-1:]
        a, b = before[-1][1], after[0][1]
        d = [y - x for x, y in zip(a, b, strict=True)]  # user nice system idle iowait irq softirq
        total = sum(d) or 1
        return {"busy": 1 - (d[3] + d[4]) / total, "user": (d[0] + d[1]) / total,
                "system": d[2] / total, "softirq": (d[5] + d[6]) / total,
                "cores": os.cpu_count()}


def run_launch(c: EmulatedCluster, system: str, op: str, size: int, *, tag: str, iters: int = 1,
               warmup: int = 0, period: float = 0.0, ready: list[float] | None = None,
               sync: bool = False, timeline: bool = False,
               env: dict[str, str] | None = None) -> dict:
    """One launch of `system`: returns a row with every measured call's time
    (`samples_s`), checked results and the bytes that crossed the links; with
    `timeline`, also every link's use over the timed calls (`link_timeline`).
    `env`: settings on top of the variant's (hoplite-gpu systems only)."""
    with CpuSampler() as cpu, (c.link_sampler() if timeline
                               else contextlib.nullcontext()) as links:
        ranks, extra, before, after = _launch(c, system, op, size, tag=tag, iters=iters,
                                              warmup=warmup, period=period, ready=ready, sync=sync,
                                              env=env)
    row = _row(c, system, op, size, ranks, iters=iters, warmup=warmup, period=period)
    if links is not None:
        # (with staggered inputs the last rank's start is when the last input was ready)
        row.update(link_timeline(links.samples, c.bandwidth_bps, row["start_min"],
                                 row["end_max"], marks=row["start_max"] if ready else None))
    moved = [[a - b for a, b in zip(x, y, strict=True)] for x, y in zip(after, before, strict=True)]
    down = sum(m[0] for m in moved)
    floor = link_volume(op, c.hosts, size) * (iters + warmup)
    up_packets = sum(m[3] for m in moved)
    row.update(extra, sync=sync, link_bytes_down=down, link_bytes_floor=floor,
               link_bytes_hosts=[m[:2] for m in moved], link_packets_up=up_packets,
               bytes_per_packet_up=sum(m[1] for m in moved) / max(up_packets, 1),
               cpu=cpu.window(min(row["start_min"]), max(row["end_max"])))
    if down < floor:
        raise AssertionError(f"{system} {op}: only {down} bytes crossed the links, fewer than the "
                             f"{floor} the op needs: some traffic went another way")
    return row


def link_timeline(samples: list[tuple[float, list[tuple[int, int]]]], bps: float,
                  starts: list[float], ends: list[float], step: float = 0.05,
                  marks: list[float] | None = None) -> dict:
    """Each host's uplink and downlink use (bytes moved / what `bps` allows)
    from the first timed call's start to the last one's end, in steps of about
    `step` seconds (`link_timeline`), and per timed call the hosts' mean and
    least uplink use (`link_use_up_mean`, `link_use_up_min`): a schedule that
    keeps every uplink busy to the end has both near 1. `marks`: moments to
    show in the timeline (the last input's readiness, with staggered inputs)."""
    per_s = bps / 8
    t_a, t_b = min(starts), max(ends)
    pts = [p for p in samples if t_a - step <= p[0] <= t_b + step]
    out: dict = {"link_timeline": None, "link_use_up_mean": [], "link_use_up_min": []}
    if len(pts) < 2:
        return out
    series = {"t0": t_a, "step_s": step, "t_s": [], "up": [], "down": [],
              "calls": [[round(a - t_a, 4), round(b - t_a, 4)]
                        for a, b in zip(starts, ends, strict=True)],
              "marks": [round(m - t_a, 4) for m in marks or []]}
    prev = pts[0]
    for p in pts[1:]:
        dt = p[0] - prev[0]
        if dt < step and p is not pts[-1]:
            continue
        series["t_s"].append(round((prev[0] + p[0]) / 2 - t_a, 4))
        for key, side in (("down", 0), ("up", 1)):
            series[key].append([round((b[side] - a[side]) / dt / per_s, 3)
                                for a, b in zip(prev[1], p[1], strict=True)])
        prev = p
    out["link_timeline"] = series
    for start, end in zip(starts, ends, strict=True):
        a = max((p for p in samples if p[0] <= start), key=lambda p: p[0], default=None)
        b = min((p for p in samples if p[0] >= end), key=lambda p: p[0], default=None)
        if a is None or b is None or b[0] <= a[0]:
            continue
        use = [(y[1] - x[1]) / (b[0] - a[0]) / per_s for x, y in zip(a[1], b[1], strict=True)]
        out["link_use_up_mean"].append(round(statistics.fmean(use), 3))
        out["link_use_up_min"].append(round(min(use), 3))
    return out


def _launch(c: EmulatedCluster, system: str, op: str, size: int, *, tag: str, iters: int,
            warmup: int, period: float, ready: list[float] | None, sync: bool = False,
            env: dict[str, str] | None = None):
    before = c.link_counters()
    extra: dict = {}
    if system in ("hoplite-gpu", "star", *VARIANT_ENV):
        fanout = c.hosts - 1 if system == "star" else 1
        ranks = hoplite_run(c, op, size, tag, fanout=fanout, iters=iters, warmup=warmup,
                            period=period, ready=ready, sync=sync, variant=system, env=env)
    elif system == "gloo":
        ranks = gloo_run(c, op, size, iters=iters, warmup=warmup, period=period, ready=ready,
                         sync=sync)
    elif system in ("openmpi", "openmpi-tuned"):
        from .mpi import mpi_run

        report = mpi_run(c, op, size, tuned=system == "openmpi-tuned", iters=iters, warmup=warmup,
                         period=period, ready=ready, sync=sync,
                         interfaces=getattr(c, "interfaces", "eth0"))
        ranks = report["ranks"]
        extra = {"mca": report["mca"], "library": report["library"]}
    else:
        raise ValueError(f"unknown system {system!r}")
    return ranks, extra, before, c.link_counters()


def _row(c: EmulatedCluster, system: str, op: str, size: int, ranks: list[dict], *, iters: int,
         warmup: int, period: float) -> dict:
    ranks = sorted(ranks, key=lambda r: r["rank"])
    wrong = [r["rank"] for r in ranks if not r["ok"]]
    if wrong:
        raise AssertionError(f"{system} {op}: wrong result on rank(s) {wrong}")
    crcs = {r["crc"] for r in ranks if holds_result(op, r["rank"])}
    if len(crcs) != 1 or None in crcs:
        raise AssertionError(f"{system} {op}: ranks disagree on the result: {crcs}")
    hosts = [r["host"] for r in ranks]
    if hosts != [c.address(i) for i in range(c.hosts)]:
        raise AssertionError(f"{system}: ranks ran on {hosts}, not one per emulated host")
    ending = ranks if op in ("broadcast", "allreduce", "allgather") else ranks[:1]
    samples = [max(r["ends"][k] for r in ending) - min(r["starts"][k] for r in ranks)
               for k in range(iters)]
    late = sum(1 for k in range(iters) if period and max(
        r["starts"][k] - (r["t0"] + (warmup + k) * period) for r in ranks) > period / 2)
    bound = lower_bound(op, size, c.hosts, c.bandwidth_bps)
    seconds = statistics.median(samples)
    return {"system": system, "label": system, "op": op, "hosts": c.hosts, "size_bytes": size,
            "init_retries": sum(r.get("init_retries", 0) for r in ranks),
            "pool_hits": [r.get("pool_hits") for r in ranks],
            # (hoplite-gpu only) object bytes the ranks' data servers sent, and
            # their pulls that resumed at another sender
            "bytes_sent": _total(r.get("bytes_sent") for r in ranks),
            "failovers": _total(r.get("failovers") for r in ranks),
            "cpu_s_ranks": [r.get("cpu_s") for r in ranks],
            "cpu_s_per_call": (sum(r["cpu_s"] for r in ranks) / (iters + warmup)
                               if all(r.get("cpu_s") is not None for r in ranks) else None),
            # page faults of all ranks together in each timed call (fresh memory touched)
            "page_faults": ([sum(r["faults"][k] for r in ranks) for k in range(iters)]
                            if all(len(r.get("faults", ())) == iters for r in ranks) else None),
            "bandwidth_bps": c.bandwidth_bps, "iters": iters, "warmup": warmup, "period_s": period,
            "late_calls": late, "samples_s": samples, "seconds": seconds, "lower_bound_s": bound,
            "ratio_to_bound": seconds / bound, "check": "exact", "crc": crcs.pop(),
            "start_max": [max(r["starts"][k] for r in ranks) for k in range(iters)],
            "start_min": [min(r["starts"][k] for r in ranks) for k in range(iters)],
            "end_max": [max(r["ends"][k] for r in ending) for k in range(iters)]}


def _total(values) -> int | None:
    """The sum of the ranks' counts, None where a rank (a baseline's) has none."""
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


def dynamic_allreduce(c: EmulatedCluster, size: int, gap: float, system: str, tag: str,
                      steady: int = 0, timeline: bool = False) -> dict:
    """Inputs become ready one every `gap` seconds, as tasks finish; the time that
    matters is from the last input's readiness to the allreduce's end everywhere.
    Each rank's start is when it called the allreduce: measured, not assumed.
    `steady` > 0: a warm-up and that many calls after barriers, buffers reused."""
    ready = [gap * i for i in range(c.hosts)]
    if steady:
        row = run_launch(c, system, "allreduce", size, tag=tag, ready=ready, iters=steady,
                         warmup=1, sync=True, timeline=timeline)
    else:
        row = run_launch(c, system, "allreduce", size, tag=tag, ready=ready, timeline=timeline)
    after = [e - s for e, s in zip(row["end_max"], row["start_max"], strict=True)]
    row["seconds_after_last_ready"] = statistics.median(after)
    bound = lower_bound("allreduce-dynamic", size, c.hosts, c.bandwidth_bps)
    row.update(op="allreduce-dynamic", gap_s=gap, seconds_total=row["seconds"],
               seconds=row["seconds_after_last_ready"], samples_s=after,
               lower_bound_s=bound, ratio_to_bound=row["seconds_after_last_ready"] / bound)
    return row
