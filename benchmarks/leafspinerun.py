"""`python -m benchmarks leafspine`: collectives on the emulated leaf-spine
(benchmarks/leafspine.py) against the fabric's bound, once per ECMP hash
seed, every system in the same run.

For each seed (the routers' `fib_multipath_hash_seed`: the same flows land
on other spines, as other source ports would) it probes how `--probe-flows`
flows from host 0 to a host under another leaf spread over the spines, then
runs each op once per system: hoplite-gpu (single flow per pull; the
allreduce always sliced, a ring in rank order), OpenMPI with the tuned
algorithms, Gloo, and with `--paths N` hoplite-gpu with the runtime's path
setting (the hook below); with `--racks` every hoplite-gpu system once more
as "<system>-racks", each node told its leaf as its rack (`HOPLITE_RACK`,
docs/fabric.md, "Racks"). Rank r runs on host r (`--placement interleaved`:
consecutive ranks under different leaves).

The result file's keys: `benchmark` (`leafspine`), `settings` (the fabric,
its hosts' TCP congestion control, rates, seeds, systems), `link` (one TCP stream measured within a leaf and
across leaves), `ecmp_probe` (per seed: the spine of each probe flow),
`rows` (one per launch, netbench's row plus `seed`, `host_bound_s` (S/B
bounds of the host links), `lower_bound_s` / `ratio_to_bound` (the fabric's
bound, `hoplite_gpu.fabric.run.op_bound`), `link_bytes_fabric` (bytes on
every directed link, "a>b"), `spine_link_bytes` (the leaf-spine ones),
hoplite-gpu's `bytes_sent` (object bytes its data servers sent, TCP's own
resends not counted) and `failovers` (pulls resumed at another sender or
on a new connection), and `cpu` (the machine's cores over the timed call)), `summary` (per op and
system over the seeds: median, spread, bound, ratios to the other systems,
CPU), `simulated` (the flow-level simulator on the same fabric: ECMP median
over the seeds, spraying, Ethereal), `skipped` (systems not run, why) and
`failed` (launches that failed every attempt).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

from rich.console import Console
from rich.table import Table

from hoplite_gpu.config import Config, parse_port_range

from .args import at_least, seconds
from .emurun import _stop_on_signals, fmt_s, human, launch_with_retries, parse_size, summarize

OPS = ("broadcast", "allreduce")
SYSTEMS = ("hoplite-gpu", "openmpi-tuned", "gloo", "openmpi")
#: The runtime's setting that splits a pull over n ECMP paths with chosen
#: source ports (`Config.paths`). `--paths N` runs hoplite-gpu once more per
#: seed with HOPLITE_<NAME>=N on every node, as the system
#: "hoplite-gpu-paths<N>", each node given a path map learned once its data
#: port is known (`benchmarks.leafspinepaths`).
PATHS_SETTING = "paths"
#: `--racks` runs each hoplite-gpu system again as "<system><RACKS>", every
#: node given its leaf as its rack (`Config.rack`)
RACKS = "-racks"
#: the allreduce is a ring in rank order: sliced always, however the ranks arrive
ALLREDUCE_ENV = {"HOPLITE_ALLREDUCE_SLICING": "auto"}


def paths_env(n: int, size: int | None = None, hosts: int | None = None) -> dict[str, str]:
    """The nodes' settings for `--paths n` (`Config.paths`: docs/fabric.md,
    "Rails and paths"), and, given the bytes per rank `size` on `hosts`
    ranks, `HOPLITE_MULTI_SOURCE_BYTES` lowered to a ring's piece (size /
    hosts) where that is below the default: only pulls of at least it are
    split, and a sliced allreduce pulls pieces."""
    env = {f"HOPLITE_{PATHS_SETTING.upper()}": str(n)}
    if size is not None and hosts:
        piece = max(1, size // hosts)
        if piece < Config.multi_source_bytes:
            env["HOPLITE_MULTI_SOURCE_BYTES"] = str(piece)
    return env


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.set_defaults(plot=True)  # (drawn beside the saved result)
    p.add_argument("--hosts", type=at_least(2), default=8)
    p.add_argument("--leaves", type=at_least(2), default=2)
    p.add_argument("--spines", type=at_least(1), default=2)
    p.add_argument("--oversubscription", type=seconds(0.0, above=True), default=2.0,
                   help="hosts per leaf x host rate / (spines x leaf-spine rate); default 2")
    p.add_argument("--mbit", type=seconds(0.0, above=True), default=100.0,
                   help="host link rate, Mbit/s (default 100: low enough that 2 cores keep up; "
                        "the run reports their use)")
    p.add_argument("--placement", choices=("block", "interleaved"), default="block",
                   help="block: hosts 0..h-1 under leaf 0, ...; interleaved: host i under "
                        "leaf i %% leaves")
    p.add_argument("--size", type=parse_size, default=parse_size("64M"),
                   help="bytes per rank, binary units (default 64M)")
    p.add_argument("--op", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--congestion", default=None, metavar="NAME",
                   help="the hosts' TCP congestion control (cubic, bbr, reno...; default: "
                        "this machine's, which the result records)")
    p.add_argument("--seeds", type=at_least(1), default=5,
                   help="ECMP hash seeds 1..N, every system on each (default 5)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS,
                   default=["hoplite-gpu", "openmpi-tuned", "gloo"])
    p.add_argument("--paths", type=at_least(1), default=1,
                   help="hoplite-gpu also with HOPLITE_PATHS=N (pulls split over N ECMP "
                        "paths, path k on spine k mod S, from a path map learned per launch); "
                        "1: off")
    p.add_argument("--racks", action="store_true",
                   help="each hoplite-gpu system also as <system>-racks: every node told its "
                        "leaf as its rack (HOPLITE_RACK), so a broadcast's chain crosses "
                        "between leaves once per leaf")
    p.add_argument("--probe-flows", type=at_least(1), default=16,
                   help="probe flows (source ports) from host 0 across leaves per seed")
    p.add_argument("--retries", type=at_least(0), default=1,
                   help="relaunches of a launch that failed (its error is kept)")
    p.add_argument("--tag", default="leafspine", help="result file stem")


def run(args: argparse.Namespace, console: Console) -> dict:
    from .leafspine import LeafSpine

    extra = paths_env(args.paths, args.size, args.hosts) if args.paths > 1 else None
    if args.hosts % args.leaves:
        raise SystemExit(f"leafspine: --hosts {args.hosts} must split evenly over --leaves "
                         f"{args.leaves}")
    _stop_on_signals()
    systems, skipped = _usable_systems(args.systems, console)
    if extra:
        systems.append(f"hoplite-gpu-paths{args.paths}")
    if args.racks:
        systems += [s + RACKS for s in systems if s.startswith("hoplite-gpu")]
    rows, failed, probes = [], [], []
    with LeafSpine(args.hosts, args.leaves, args.spines, host_bps=args.mbit * 1e6,
                   oversubscription=args.oversubscription, placement=args.placement,
                   hash_seed=1, congestion=args.congestion) as fab:
        if fab.swept:
            console.print(f"removed {len(fab.swept)} namespaces of a run that was killed")
        console.print(fab.describe())
        far = fab.hosts_on(1)[0]  # (host 0 is under leaf 0)
        link = _measure_links(fab, far)
        within = ("-" if link["within_leaf_bps"] is None  # (one host a leaf)
                  else f"{link['within_leaf_bps'] / 1e6:.1f}")
        console.print(f"one TCP stream: {within} Mbit/s within a leaf, "
                      f"{link['across_leaves_bps'] / 1e6:.1f} Mbit/s across leaves")
        for seed in range(1, args.seeds + 1):
            fab.set_hash_seed(seed)
            probe = fab.ecmp_spread(0, far, args.probe_flows)
            probes.append(probe)
            console.print(f"seed {seed}: {args.probe_flows} probe flows 0 -> {far} per spine: "
                          f"{probe['flows_per_spine']}")
            for op in args.op:
                for system in systems:  # interleaved, so drift hits every system alike
                    row, errors = launch_with_retries(
                        args.retries, f"{op}-{seed}-{system}",
                        functools.partial(launch, fab, system, op, args.size, seed=seed,
                                          paths_env=extra))
                    if row is None:
                        failed.append({"system": system, "op": op, "seed": seed,
                                       "errors": errors})
                        console.print(f"[red]{system} {op} seed {seed} failed: "
                                      f"{errors[-1][:300]}[/]")
                        continue
                    rows.append(row)
                    _say(console, row)
        settings = _settings(fab, args, systems, link)
    summary = summarize(rows)
    _cpu_summary(summary, rows)
    console.print(table(summary, settings), width=max(console.width, 150))
    _say_cpu(console, summary)
    return {"benchmark": "leafspine", "file_stem": args.tag, "settings": settings,
            "link": link, "ecmp_probe": probes, "rows": rows, "summary": summary,
            "simulated": simulated(settings, args.op, args.size, args.seeds),
            "skipped": skipped, "failed": failed,
            "byte_identical": not failed and not any(
                "wrong result" in e for r in rows for e in r["failed_attempts"])}


#: the cores' busy share over a timed call at which they may have been what
#: limited it (softirq forwarding and shaping included)
CPU_BUSY = 0.85


def _usable_systems(asked: list[str], console: Console) -> tuple[list[str], list[dict]]:
    """The systems to run, OpenMPI dropped (with the reason) where it cannot be
    installed here."""
    systems, skipped = list(dict.fromkeys(asked)), []
    if any(s.startswith("openmpi") for s in systems):
        from .mpi import MPIUnavailable, ensure_mpi

        try:
            ensure_mpi(log=console.print)
        except MPIUnavailable as exc:
            for s in [s for s in systems if s.startswith("openmpi")]:
                systems.remove(s)
                skipped.append({"system": s, "reason": str(exc)})
                console.print(f"[yellow]skipped {s}: {exc}[/]")
    return systems, skipped


def _measure_links(fab, far: int) -> dict:
    """One TCP stream within leaf 0 (a host link's rate) and from host 0 to
    host `far` (one flow: at most one leaf-spine link's rate), half a second each."""
    nbytes = max(1 << 20, int(fab.host_bps / 8 * 0.5))
    near = [i for i in fab.hosts_on(fab.leaf_of(0)) if i != 0]
    return {"within_leaf_bps": fab.measure_link(nbytes, src=0, dst=near[0]) if near else None,
            "across_leaves_bps": fab.measure_link(nbytes, src=0, dst=far), "far_host": far}


def launch(fab, system: str, op: str, size: int, *, seed: int, tag: str,
           paths_env: dict | None = None) -> dict:
    """One launch of `system` on the fabric: netbench's row, plus the bytes on
    every link and the fabric's bound."""
    from .leafspinepaths import PathMapper
    from .netbench import run_launch

    env = dict(ALLREDUCE_ENV) if op == "allreduce" else {}
    base, on = system.removesuffix(RACKS), fab
    if system.endswith(RACKS):
        on = LeafRacks(fab)
    if base.startswith("hoplite-gpu-paths"):
        base, env = "hoplite-gpu", {**env, **(paths_env or {})}
        ports = parse_port_range(os.environ.get("HOPLITE_PATH_PORTS", Config.path_ports))
        on = PathMapper(on, int(env[f"HOPLITE_{PATHS_SETTING.upper()}"]), ports)
    t = time.monotonic()
    before = fab.link_bytes()
    try:
        row = run_launch(on, base, op, size, tag=tag, env=env or None)
    finally:
        if on is not fab:
            on.close()
    after = fab.link_bytes()
    if isinstance(on, PathMapper):
        row["path_map"] = on.report
    moved = {f"{a}>{b}": n - before[a, b] for (a, b), n in after.items()}
    bound = fabric_bound(fab, op, size)
    row.update(system=system, label=system, seed=seed, host_bound_s=row["lower_bound_s"],
               lower_bound_s=bound, ratio_to_bound=row["seconds"] / bound,
               link_bytes_fabric=moved, launch_wall_s=time.monotonic() - t,
               spine_link_bytes={k: v for k, v in moved.items() if "spine" in k})
    for key in ("start_max", "end_max", "start_min"):
        row.pop(key, None)
    return row


class LeafRacks:
    """The fabric for one launch of a "-racks" system: every node is
    started with its leaf as its rack (`HOPLITE_RACK=leaf<k>`); everything
    else is the fabric's."""

    def __init__(self, fab) -> None:
        self.fab = fab

    def __getattr__(self, name: str):
        return getattr(self.fab, name)

    def popen(self, i: int, argv, **kw):
        if "benchmarks.netnode" in argv:
            kw["env"] = {**(kw.get("env") or os.environ),
                         "HOPLITE_RACK": f"leaf{self.fab.leaf_of(i)}"}
        return self.fab.popen(i, argv, **kw)

    def close(self) -> None:
        """Nothing of its own to remove."""


def _ops(fab, op: str, size: int):
    """The op as the fabric simulator has it, rank r on host r; the broadcast
    relayed in the steps a node relays over TCP (`RELAY_STEP`)."""
    from hoplite_gpu.config import RELAY_STEP
    from hoplite_gpu.fabric.hoplite_ops import HopliteBroadcast
    from hoplite_gpu.fabric.ops import RingAllreduce

    hosts = [fab.fabric_host(r) for r in range(fab.hosts)]
    if op == "allreduce":
        return RingAllreduce(hosts, size)
    return HopliteBroadcast(hosts, size, chunk=min(RELAY_STEP, size), bandwidth=fab.host_bps / 8)


def fabric_bound(fab, op: str, size: int) -> float:
    """What no schedule beats on this fabric (`hoplite_gpu.fabric.run.op_bound`):
    the broadcast from rank 0 to every other, the allreduce as a ring in rank order."""
    from hoplite_gpu.fabric.run import op_bound

    return op_bound(fab.fabric(), _ops(fab, op, size))


def simulated(settings: dict, ops: list[str], size: int, seeds: int) -> dict:
    """The flow-level simulator's completion time for each op on the same
    fabric: ECMP (median over `seeds` draws), ideal spraying and Ethereal."""
    from hoplite_gpu.fabric.run import simulate

    from .leafspine import LeafSpine

    f = settings["fabric"]
    fab = LeafSpine(f["hosts"], f["leaves"], f["spines"], host_bps=f["host_bps"],
                    oversubscription=f["oversubscription"], placement=f["placement"])
    out = {}
    for op in ops:
        times = {r: simulate(fab.fabric(), _ops(fab, op, size), r).completion_s
                 for r in ("spray", "ethereal")}
        times["ecmp"] = statistics.median(
            simulate(fab.fabric(), _ops(fab, op, size), "ecmp", seed=s).completion_s
            for s in range(1, seeds + 1))
        out[op] = {"completion_s": times, "bound_s": fabric_bound(fab, op, size)}
    return out


def _settings(fab, args: argparse.Namespace, systems: list[str], link: dict) -> dict:
    from .mpi import TRANSPORT_MCA, TUNED_MCA

    return {"fabric": {"hosts": fab.hosts, "leaves": fab.leaves, "spines": fab.spines,
                       "hosts_per_leaf": fab.hosts_per_leaf, "host_bps": fab.host_bps,
                       "uplink_bps": fab.uplink_bps, "oversubscription": fab.oversubscription,
                       "placement": fab.placement,
                       "ecmp_hash": "fib_multipath_hash_policy=3, fields 0x37 (5-tuple)",
                       # the hosts' TCP congestion control (every system's flows)
                       "tcp_congestion": fab.congestion or fab.machine_congestion()},
            "size_bytes": args.size, "ops": args.op, "seeds": list(range(1, args.seeds + 1)),
            "systems": systems, "paths": args.paths, "racks": args.racks,
            "probe_flows": args.probe_flows,
            "paths_env": paths_env(args.paths, args.size, args.hosts) if args.paths > 1 else None,
            "measured_link_bps": link["within_leaf_bps"], "allreduce_env": ALLREDUCE_ENV,
            "openmpi": {"mca_both": TRANSPORT_MCA, "mca_tuned": TUNED_MCA},
            "gloo": "torch.distributed defaults, GLOO_SOCKET_IFNAME=eth0",
            "cpu_busy_limit": CPU_BUSY}


def _say(console: Console, row: dict) -> None:
    spines = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(row["spine_link_bytes"].items())
                       if k.startswith("leaf"))
    cpu = row.get("cpu") or {}
    console.print(f"seed {row['seed']} {row['system']}: {row['op']} {human(row['size_bytes'])} "
                  f"{fmt_s(row['seconds'])} = {row['ratio_to_bound']:.2f} x the fabric's bound; "
                  f"CPU {cpu.get('busy', float('nan')):.0%}; MiB up to the spines: {spines}"
                  + (f"; MiB the ranks sent {row['bytes_sent'] / 2**20:.1f} "
                     f"(failovers {row['failovers']})" if row.get("bytes_sent") is not None
                     else ""))


def _cpu_summary(summary: list[dict], rows: list[dict]) -> None:
    """Per summary entry, medians over its launches: the kernels' share of all
    cores in softirq (forwarding and shaping: the fabric's own cost), the
    ranks' own CPU time as a share of all cores over the call, and whether
    the machine was busy enough (`CPU_BUSY`) that the cores may have limited it.
    `cpu_busy` is the whole machine's: other work on it counts too."""
    for e in summary:
        mine = [r for r in rows if (r["op"], r["system"]) == (e["op"], e["system"])]
        soft = [r["cpu"]["softirq"] for r in mine if r.get("cpu")]
        own = [r["cpu_s_per_call"] / (r["seconds"] * r["cpu"]["cores"]) for r in mine
               if r.get("cpu") and r.get("cpu_s_per_call") is not None]
        e["cpu_softirq"] = statistics.median(soft) if soft else None
        e["ranks_cpu_share"] = statistics.median(own) if own else None
        e["cpu_bound"] = e["cpu_busy"] is not None and e["cpu_busy"] >= CPU_BUSY


def _say_cpu(console: Console, summary: list[dict]) -> None:
    for e in summary:
        if e["cpu_busy"] is None:
            continue
        own = "" if e["ranks_cpu_share"] is None else f", the ranks' own {e['ranks_cpu_share']:.0%}"
        verdict = ("may have limited it: lower --mbit, or quiet the machine" if e["cpu_bound"]
                   else "did not limit it")
        console.print(f"CPU, {e['system']} {e['op']}: the machine's cores {e['cpu_busy']:.0%} "
                      f"busy (softirq {e['cpu_softirq']:.0%}{own}): the cores {verdict}")


def table(summary: list[dict], settings: dict) -> Table:
    f = settings["fabric"]
    t = Table(title=f"{f['hosts']} hosts, {f['leaves']} leaves, {f['spines']} spines, "
                    f"{f['host_bps'] / 1e6:g} Mbit/s host links, oversubscription "
                    f"{f['oversubscription']:g}: medians over {len(settings['seeds'])} ECMP seeds")
    for col in ("op", "size", "system", "n", "median", "min .. max", "fabric bound", "x bound",
                "x hoplite-gpu", "x openmpi-tuned", "x gloo", "CPU busy"):
        t.add_column(col, justify="right", no_wrap=True)
    for e in sorted(summary, key=lambda e: (e["op"], e["system"])):
        t.add_row(e["op"], human(e["size_bytes"]), e["system"], str(e["n"]),
                  fmt_s(e["median_s"]), f"{fmt_s(e['min_s'])} .. {fmt_s(e['max_s'])}",
                  fmt_s(e["lower_bound_s"]), f"{e['ratio_to_bound']:.2f}",
                  *(f"{e['ratio_to'][s]:.2f}" if s in e["ratio_to"] else "-"
                    for s in ("hoplite-gpu", "openmpi-tuned", "gloo")),
                  "-" if e["cpu_busy"] is None else f"{e['cpu_busy']:.0%}")
    return t
