"""`python -m benchmarks dgxmesh`: Blink's packed trees on the emulated
DGX-1V mesh (benchmarks/dgxmesh.py) against S/R*, beside the baselines,
every system in the same run.

For each member set (an allocation; its first member is the root and rank
0, rank r on its r-th member) it builds the mesh of those members alone,
measures one link's real rate, then runs each op once per system, each
launch `--repeats` calls with a common start time each:
- `hoplite-multitree`: a `hoplite_gpu.Group` given the topology among the
  members (`Group(topology=..., members=...)`): a broadcast split across the
  trees `trees.pack` finds, an allreduce over trees used both ways;
- `hoplite-single`: the same Group without a topology, the dynamic path:
  the pipelined chain the directory builds as receivers arrive (one receiver
  per sender, the default), never striped (`HOPLITE_STRIPES=1`; the cost
  model also picks one tree at these receiver counts), the allreduce a
  sliced ring (`HOPLITE_ALLREDUCE_SLICING=auto`); pulls over shared links'
  addresses where a sender has one (`node_hosts`), several senders per pull
  as by default;
- `openmpi-tuned`: OpenMPI's pipelined broadcast (a chain in rank order) and
  segmented ring allreduce (`benchmarks.mpi.TUNED_MCA`), over the host
  addresses, so a step between GPUs with no link goes along the route.

The bound is S / R*: R* the packed bound (`TreePlan.bound`) in units times
the unit's rate as measured (one TCP stream over a link; the nominal rate is
reported beside it). The allreduce runs on the full mesh only and is set
against its own plan's rate (`flow="allreduce"`, trees used both ways).
Every result is checked exactly on every rank; a tree broadcast's bytes
must cross only its trees' links (`direct_links`).

The result file's keys: `benchmark` (`dgxmesh`), `settings`, `meshes` (per
set: its links, routes and measured link), `rows` (one per launch: netbench's
row plus `set`, `members`, `bound_s`, `nominal_bound_s`, `ratio_to_bound`,
`cpu` per call, `link_bytes` per directed link, `forwarded` datagrams per
namespace), `sets` (per set, op and system: median, bound, ratio, speed-ups
over the others, CPU busy), `skipped`, `failed`.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import queue
import statistics
import subprocess
import threading
import time

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .args import at_least
from .emurun import _stop_on_signals, fmt_s, human, launch_with_retries, parse_size

OPS = ("broadcast", "allreduce")
SYSTEMS = ("hoplite-multitree", "hoplite-single", "openmpi-tuned")
#: The sets run unless told: the full mesh; fragmented allocations whose
#: GPUs form no NVLink ring ({0, 1, 4}, {0, 1, 2, 4, 7}) or only a 1-unit one
#: ({0, 3, 4, 7}; {0, 1, 2, 4, 5, 6}, whose trees carry 4 units).
DEFAULT_SETS = ("full", "0,1,4", "0,3,4,7", "0,1,2,4,7", "0,1,2,4,5,6")
#: hoplite-single's settings (besides the mesh's node_hosts)
SINGLE_ENV = {"HOPLITE_STRIPES": "1", "HOPLITE_ALLREDUCE_SLICING": "auto"}
#: a call waits at most this long (the slowest baseline at the default unit
#: takes about 15 s for 64 MiB)
CALL_TIMEOUT_S = 600.0
#: bytes a link outside every tree may carry per call (control traffic to
#: the directory, routed) before a tree broadcast counts as forwarded
OFF_TREE_SLACK = 256 << 10
#: the cores' busy share at which they may have limited a call
CPU_BUSY = 0.85


def unit(text: str) -> float:
    """Bits per second: 40e6, 40M, 1.5G (decimal units)."""
    scale = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9}
    body, suffix = (text[:-1], text[-1].upper()) if text[-1:].isalpha() else (text, "")
    try:
        value = float(body) * scale[suffix]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a rate: {text!r} (bit/s, e.g. 40M)") from None
    if not math.isfinite(value) or value < 1000:
        raise argparse.ArgumentTypeError(f"must be at least 1000 bit/s; got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .dgxmesh import DEFAULT_UNIT_BPS

    p.set_defaults(plot=True)  # (drawn beside the saved result)
    p.add_argument("--size", type=parse_size, default=parse_size("64M"),
                   help="bytes per rank, binary units (default 64M)")
    p.add_argument("--unit", type=unit, default=DEFAULT_UNIT_BPS,
                   help=f"one link unit (an NV1 link), bit/s (default {DEFAULT_UNIT_BPS / 1e6:g}M:"
                        " low enough that 2 cores keep up; the run reports their use)")
    p.add_argument("--sets", nargs="+", default=list(DEFAULT_SETS),
                   help="member sets, each 'full' or GPUs 'a,b,c' (the first is the root)")
    p.add_argument("--op", nargs="+", choices=OPS, default=list(OPS),
                   help="allreduce runs on the full mesh only")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--repeats", type=at_least(1), default=3, help="timed calls per launch")
    p.add_argument("--probe", action="store_true",
                   help="measure every built link and pack the trees over the measured rates "
                        "(a topology probed, not the nominal one); the bound stays S / R* of "
                        "the nominal topology at the measured unit")
    p.add_argument("--topology", default="dgx1v",
                   help="a built-in topology's name or a topology JSON file (default dgx1v)")
    p.add_argument("--retries", type=at_least(0), default=1,
                   help="relaunches of a launch that failed (its error is kept)")
    p.add_argument("--tag", default="dgxmesh", help="result file stem")


def member_sets(topology, texts: list[str]) -> list[tuple[str, tuple]]:
    """(label, members) per `--sets` entry, checked: every member a node, no
    repeats, at least two, every pair joined by links among the members, and
    the root reaching all of them (`pack` plans it)."""
    from hoplite_gpu.topology import TopologyError
    from hoplite_gpu.trees import pack

    from .dgxmesh import DgxMesh

    out = []
    for text in texts:
        if texts.count(text) > 1:
            raise SystemExit(f"dgxmesh: --sets {text}: given twice")
        try:
            if text == "full":
                members = tuple(topology.nodes)
            else:
                members = tuple(topology.lookup(t.strip(), what="GPU") for t in text.split(","))
            DgxMesh(topology, members=members)  # (refuses repeats, strangers, no path)
            pack(topology, members[0], members)
        except (TopologyError, ValueError) as exc:
            raise SystemExit(f"dgxmesh: --sets {text}: {exc}") from None
        out.append((text, members))
    return out


def load_topology(text: str):
    from hoplite_gpu.topology import FIXTURES, TopologyError, fixture, from_file

    try:
        topology = fixture(text) if text in FIXTURES else from_file(text)
    except TopologyError as exc:
        raise SystemExit(f"dgxmesh: --topology {text}: {exc}") from None
    if topology.relays:
        raise SystemExit(f"dgxmesh: --topology {text}: {topology.name} has relays "
                         f"({', '.join(map(str, topology.relays))}); the mesh joins GPUs by "
                         "direct links only")
    return topology


def run(args: argparse.Namespace, console: Console) -> dict:
    from .dgxmesh import DgxMesh
    from .leafspinerun import _usable_systems

    topology = load_topology(args.topology)
    sets = member_sets(topology, args.sets)
    systems, skipped = _usable_systems(args.systems, console)  # (OpenMPI installed if missing)
    _stop_on_signals()
    rows, failed, meshes = [], [], []
    for label, members in sets:
        with DgxMesh(topology, unit_bps=args.unit, members=members) as mesh:
            if mesh.swept:
                console.print(f"removed {len(mesh.swept)} namespaces of a run that was killed")
            console.print(f"[bold]{label}[/]: {mesh.describe()}")
            info = {"set": label, **mesh.report(), "link": measure_unit(mesh)}
            if args.probe:
                from hoplite_gpu.topology import to_json

                mesh.planned = probe_topology(mesh)
                info["probed"] = to_json(mesh.planned)
                console.print(f"  probed: {_probed(mesh)}")
            meshes.append(info)
            link = info["link"]
            console.print(f"  TCP over a {link['units']:g}-unit link: {link['bps'] / 1e6:.1f} "
                          f"Mbit/s sustained ({link['unit_bps'] / 1e6:.1f} a unit; one stream of "
                          f"{human(link['bytes'][0])}: {link['stream_bps'][0] / 1e6:.1f})")
            for op in args.op:
                if op == "allreduce" and len(members) != len(topology.nodes):
                    continue  # (the allreduce runs on the full mesh only)
                for system in systems:
                    row, errors = launch_with_retries(
                        args.retries, f"{label}-{op}-{system}",
                        functools.partial(launch, mesh, system, op, args.size, args.repeats,
                                          unit_bps=info["link"]["unit_bps"]))
                    if row is None:
                        failed.append({"set": label, "system": system, "op": op,
                                       "errors": errors})
                        console.print(f"[red]  {system} {op} failed: "
                                      f"{escape(errors[-1][:300])}[/]")
                        continue
                    row["set"] = label
                    rows.append(row)
                    _say(console, row)
    summary = summarize(rows)
    Console(width=max(console.width, 170), file=console.file,
            quiet=console.quiet).print(table(summary, args))
    result = {"benchmark": "dgxmesh", "file_stem": args.tag,
              "settings": _settings(args, topology, systems), "meshes": meshes,
              "rows": rows, "sets": summary, "skipped": skipped, "failed": failed,
              "ok": not failed and all(r.get("direct_links", True) for r in rows),
              "byte_identical": not any("wrong result" in e or "disagree" in e
                                        for x in [*failed, *rows]
                                        for e in x.get("errors", x.get("failed_attempts", [])))}
    return result


def measure_unit(mesh, seconds: float = 0.5) -> dict:
    """What one unit really carries: the rate of the mesh's slowest link
    (`link_rate`) over its units."""
    i, j = min(mesh.pairs, key=lambda p: (mesh.multiplicity(*p), p))
    units = mesh.multiplicity(i, j)
    rate = link_rate(mesh, i, j, seconds)
    return {"src": mesh.members[i], "dst": mesh.members[j], "units": units, **rate,
            "unit_bps": rate["bps"] / units, "nominal_unit_bps": mesh.unit_bps}


def link_rate(mesh, i: int, j: int, seconds: float) -> dict:
    """What the link from rank i to rank j carries: TCP streams over it, one
    of about `seconds` at its nominal rate and one of three times the bytes;
    their difference in bytes over their difference in time leaves out what
    both share (the token bucket's burst at the start, the set-up)."""
    short = max(1 << 20, int(mesh.rate_bps(i, j) / 8 * seconds))
    fast = mesh.measure_link(short, src=i, dst=j)
    slow = mesh.measure_link(3 * short, src=i, dst=j)
    spent = 3 * short * 8 / slow - short * 8 / fast
    bps = 2 * short * 8 / spent if spent > 0 else slow
    return {"bytes": [short, 3 * short], "stream_bps": [fast, slow], "bps": bps}


def probe_topology(mesh, seconds: float = 0.3):
    """A topology of the mesh as measured, not as built: every link's rate
    (`link_rate`, from its lower rank to its higher, in bytes/s) as its
    capacity. Trees packed over it split the bytes by what the links really
    carry; `--probe` runs the trees over it."""
    from hoplite_gpu.topology import from_json

    links = [{"a": mesh.members[i], "b": mesh.members[j],
              "capacity": round(link_rate(mesh, i, j, seconds)["bps"] / 8)}
             for i, j in mesh.pairs]
    return from_json({"nodes": list(mesh.members), "links": links, "unit_bytes_per_s": 1},
                     source=f"{mesh.topology.name}, probed")


def plan_of(mesh, op: str):
    """The trees of `op` among the mesh's members from its first."""
    from hoplite_gpu.multitree_reduce import plan_for
    from hoplite_gpu.trees import pack

    root, members = mesh.members[0], mesh.members
    return pack(mesh.planned, root, members) if op == "broadcast" else \
        plan_for(op, mesh.planned, root, members)


def _probed(mesh) -> str:
    """The probed links, in units of the nominal unit (as built: NV1 1, NV2 2)."""
    unit = mesh.unit_bps / 8
    return ", ".join(f"{a}-{b} {c / unit:.2f}" for (a, b), c in
                     sorted({(link.src, link.dst): link.capacity for link in mesh.planned.links
                             if mesh.members.index(link.src) < mesh.members.index(link.dst)
                             }.items()))


def launch(mesh, system: str, op: str, size: int, repeats: int, *, tag: str,
           unit_bps: float) -> dict:
    """One launch of `system`: `repeats` calls, checked; netbench's row plus
    the bound, the CPU per call and the bytes on every link."""
    from .netbench import CpuSampler, _row

    plan = plan_of(mesh, op)
    before, fwd = mesh.link_bytes(), mesh.forwarded()
    with CpuSampler() as cpu:
        if system == "openmpi-tuned":
            from .mpi import mpi_run

            report = mpi_run(mesh, op, size, tuned=True, iters=repeats, sync=True,
                             namespaces=[mesh.ns(i) for i in range(mesh.hosts)],
                             interfaces="eth0", timeout=CALL_TIMEOUT_S * repeats)
            ranks, extra = report["ranks"], {"mca": report["mca"], "library": report["library"]}
        else:
            ranks, extra = hoplite_run(mesh, system, op, size, repeats, tag), {}
    after = mesh.link_bytes()
    row = _row(mesh, system, op, size, ranks, iters=repeats, warmup=0, period=0.0)
    rate = (plan.bound if op == "broadcast" else plan.rate) / mesh.base  # units
    bound = size * 8 / (rate * unit_bps)
    calls = list(zip(row.pop("start_min"), row.pop("end_max"), strict=True))
    row.pop("start_max", None)
    row.update(extra, members=list(mesh.members), plan_units=rate, plan_trees=len(plan.trees),
               bound_s=bound, lower_bound_s=bound,
               nominal_bound_s=size * 8 / (rate * mesh.unit_bps), ratio_to_bound=row["seconds"]
               / bound, cpu=[cpu.window(a, b) for a, b in calls],
               link_bytes={f"{a}>{b}": after[a, b] - before[a, b] for a, b in after},
               forwarded=[b - a for a, b in zip(fwd, mesh.forwarded(), strict=True)])
    if system == "hoplite-multitree" and op == "broadcast":
        row.update(tree_links(mesh, plan, size, repeats, row["link_bytes"]))
    return row


def tree_links(mesh, plan, size: int, calls: int, moved: dict[str, int]) -> dict:
    """Whether a tree broadcast's bytes crossed its trees' links alone: each
    tree link at least its ranges' bytes, every other link no more than
    control traffic (`OFF_TREE_SLACK` a call)."""
    want: dict[str, int] = {}
    for tree, (a, b) in zip(plan.trees, plan.split(size), strict=True):
        for parent, child in tree.edges:
            key = f"{parent}>{child}"
            want[key] = want.get(key, 0) + (b - a) * calls
    short = {k: (moved.get(k, 0), n) for k, n in want.items() if moved.get(k, 0) < n}
    extra = {k: n for k, n in moved.items() if k not in want and n > OFF_TREE_SLACK * calls}
    return {"tree_link_bytes_wanted": want, "direct_links": not short and not extra,
            "tree_links_short": short, "off_tree_bytes": extra}


def hoplite_run(mesh, system: str, op: str, size: int, repeats: int, name: str) -> list[dict]:
    """A directory in rank 0's namespace and a node per rank
    (benchmarks/dgxmeshnode.py), `repeats` calls each started at a time the
    harness sends; every rank's report."""
    from hoplite_gpu.auth import new_token
    from hoplite_gpu.topology import to_json

    from .emulated import PY
    from .netbench import ROOT

    token = new_token()
    env = {**os.environ, "PYTHONPATH": ROOT, "HOPLITE_TOKEN": token,
           **(SINGLE_ENV if system == "hoplite-single" else {})}
    trees = ([f"--topology={json.dumps(to_json(mesh.planned))}",
              f"--members={json.dumps(list(mesh.members))}"]
             if system == "hoplite-multitree" else [])
    started: list[_Reader] = []
    try:
        directory = _Reader(mesh.popen(0, [
            PY, "-m", "hoplite_gpu", "directory", "--host", mesh.address(0), "--port", "7777"],
            stdout=subprocess.PIPE, text=True, env=env))
        started.append(directory)
        directory.line(60, "the directory")
        nodes = []
        for i in range(mesh.hosts):
            nodes.append(_Reader(mesh.popen(i, [
                PY, "-m", "benchmarks.dgxmeshnode", "--address", f"{mesh.address(0)}:7777",
                f"--token={token}", f"--name={name}", "--size", str(size), "--op", op,
                "--rank", str(i), "--world", str(mesh.hosts), "--node-host", mesh.node_hosts(i),
                "--iters", str(repeats), *trees],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)))
            started.append(nodes[-1])
        return _drive(nodes, repeats)
    finally:
        _stop_all(started)


class _Reader:
    """A process and its output lines, read by a thread, so that each wait
    has a deadline; `close` reaps both."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self._q = proc, queue.Queue()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._q.put(line.strip())
        self._q.put(None)

    def line(self, timeout: float, what: str) -> str:
        """The next line; an error naming `what` if none comes in time or
        the process ended."""
        try:
            line = self._q.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{what}: said nothing within {timeout:g} s") from None
        if line is None:
            raise RuntimeError(f"{what}: exited (code {self.proc.wait(10)})")
        return line

    def want(self, key: str, timeout: float, what: str) -> dict:
        """The next line, a JSON object holding `key`."""
        line = self.line(timeout, what)
        got = json.loads(line) if line.startswith("{") else {}
        if key not in got:
            raise RuntimeError(f"{what}: said {line[:200]!r}, not {key!r}")
        return got

    def close(self, deadline: float) -> None:
        from hoplite_gpu.lifecycle import stop_process

        try:
            self.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop_process(self.proc, grace=5)
        self._thread.join(5)  # (it read to the end: the pipe can close)
        self.proc.stdout.close()


def _drive(nodes: list[_Reader], repeats: int) -> list[dict]:
    """Ready from every node; then per call a start time to each and its
    `done` back; then every node's report."""
    for i, node in enumerate(nodes):
        node.want("ready", 120, f"hoplite-gpu node {i}")
    for k in range(repeats):
        t0 = json.dumps({"t0": time.time() + 0.3}) + "\n"
        for i, node in enumerate(nodes):
            try:
                node.proc.stdin.write(t0)
                node.proc.stdin.flush()
            except BrokenPipeError:
                raise RuntimeError(f"hoplite-gpu node {i} exited before call {k}") from None
        for i, node in enumerate(nodes):
            node.want("done", CALL_TIMEOUT_S, f"hoplite-gpu node {i}, call {k}")
    return [node.want("rank", 60, f"hoplite-gpu node {i}'s report")
            for i, node in enumerate(nodes)]


def _stop_all(started: list[_Reader]) -> None:
    """Close every node's input at once (they leave together), stop the
    directory (the first) once they are gone, and reap each; one still
    running after 30 s is killed."""
    from hoplite_gpu.lifecycle import stop_process

    for r in started:
        if r.proc.stdin is not None and not r.proc.stdin.closed:
            try:
                r.proc.stdin.close()
            except BrokenPipeError:
                pass
    deadline = time.monotonic() + 30
    for r in started[1:]:
        r.close(deadline)
    if started:
        stop_process(started[0].proc, grace=10)
        started[0].close(deadline)


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (set, op, system): its calls pooled; the bound, the
    ratio to it, each other system's time over this one's (`speedup_over`:
    above 1, this one is faster), the CPU busy share (median over calls)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["set"], r["op"], r["system"]), []).append(r)
    out = []
    for (label, op, system), rs in groups.items():
        samples = [s for r in rs for s in r["samples_s"]]
        q = (statistics.quantiles(samples, n=4, method="inclusive") if len(samples) > 1
             else [samples[0]] * 3)
        med = statistics.median(samples)
        busy = [c["busy"] for r in rs for c in r["cpu"] if c]
        soft = [c["softirq"] for r in rs for c in r["cpu"] if c]
        own = [r["cpu_s_per_call"] / (r["seconds"] * r["cpu"][0]["cores"]) for r in rs
               if r["cpu"] and r["cpu"][0] and r.get("cpu_s_per_call") is not None]
        out.append({"set": label, "op": op, "system": system, "members": rs[0]["members"],
                    "size_bytes": rs[0]["size_bytes"], "n": len(samples), "median_s": med,
                    "min_s": min(samples), "max_s": max(samples), "p25_s": q[0], "p75_s": q[2],
                    "bound_s": rs[0]["bound_s"], "nominal_bound_s": rs[0]["nominal_bound_s"],
                    "plan_units": rs[0]["plan_units"], "ratio_to_bound": med / rs[0]["bound_s"],
                    "cpu_busy": statistics.median(busy) if busy else None,
                    "cpu_softirq": statistics.median(soft) if soft else None,
                    "ranks_cpu_share": statistics.median(own) if own else None,
                    "cpu_bound": bool(busy) and statistics.median(busy) >= CPU_BUSY,
                    "direct_links": all(r.get("direct_links", True) for r in rs)})
    for e in out:
        e["speedup_over"] = {o["system"]: o["median_s"] / e["median_s"] for o in out
                             if (o["set"], o["op"]) == (e["set"], e["op"])
                             and o["system"] != e["system"]}
        if e["system"] == "hoplite-multitree":
            e["within_1_15"] = e["ratio_to_bound"] <= 1.15
            e["faster_than_every_baseline"] = all(x > 1 for x in e["speedup_over"].values())
    return out


def table(summary: list[dict], args: argparse.Namespace) -> Table:
    t = Table(title=f"{args.topology} mesh, 1 unit = {args.unit / 1e6:g} Mbit/s, "
                    f"{human(args.size)}: medians of {args.repeats} calls (bound: S / R*, R* "
                    "in units x the measured unit; allreduce: S over the plan's rate; x single, "
                    "x openmpi: hoplite-single's and openmpi-tuned's time / this one's)")
    for col in ("set", "op", "system", "n", "median", "min .. max", "R* units", "bound",
                "x bound", "x single", "x openmpi", "CPU (softirq, ranks)"):
        t.add_column(col, justify="right", no_wrap=True)
    for e in summary:
        t.add_row(e["set"], e["op"], e["system"], str(e["n"]), fmt_s(e["median_s"]),
                  f"{fmt_s(e['min_s'])} .. {fmt_s(e['max_s'])}", f"{e['plan_units']:.3g}",
                  fmt_s(e["bound_s"]), f"{e['ratio_to_bound']:.2f}",
                  *(f"{e['speedup_over'][s]:.2f}" if s in e["speedup_over"] else "-"
                    for s in ("hoplite-single", "openmpi-tuned")),
                  _cpu(e))
    return t


def _cpu(e: dict) -> str:
    """The machine's cores busy over the calls (other work on it counts too),
    softirq (forwarding, shaping) and the ranks' own share of the cores."""
    if e["cpu_busy"] is None:
        return "-"
    own = "-" if e["ranks_cpu_share"] is None else f"{e['ranks_cpu_share']:.0%}"
    return f"{e['cpu_busy']:.0%} ({e['cpu_softirq']:.0%}, {own})"


def _say(console: Console, row: dict) -> None:
    busy = [c["busy"] for c in row["cpu"] if c]
    cpu = f", CPU {statistics.median(busy):.0%} busy" if busy else ""
    links = ""
    if "direct_links" in row:
        links = (", over its trees' links only" if row["direct_links"] else
                 f", [red]NOT over its trees' links only: short {row['tree_links_short']}, "
                 f"elsewhere {row['off_tree_bytes']}[/]")
    console.print(f"  {row['system']} {row['op']} {human(row['size_bytes'])}: "
                  f"{fmt_s(row['seconds'])} ({row['ratio_to_bound']:.2f} x S/R*, "
                  f"{', '.join(fmt_s(s) for s in row['samples_s'])}){cpu}{links}")


def _settings(args: argparse.Namespace, topology, systems: list[str]) -> dict:
    from .mpi import TRANSPORT_MCA, TUNED_MCA

    return {"topology": topology.name, "unit_bps": args.unit, "size_bytes": args.size,
            "sets": args.sets, "ops": args.op, "systems": systems, "repeats": args.repeats,
            "single_env": SINGLE_ENV, "off_tree_slack_bytes": OFF_TREE_SLACK,
            "openmpi": {"mca_both": TRANSPORT_MCA, "mca_tuned": TUNED_MCA,
                        "interfaces": "eth0 (the host addresses)"},
            "cpu_busy_limit": CPU_BUSY}
