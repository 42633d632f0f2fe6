"""`python -m benchmarks rails`: collectives on emulated hosts with k rails
(benchmarks/rails.py) against the bound of a host's k rails, every system in
the same run.

Systems, rank r on host r:

- `hoplite-gpu`: every node advertises its k rails (`HOPLITE_NODE_HOST`
  lists one address per rail), so a pull of at least
  `HOPLITE_MULTI_SOURCE_BYTES` is split into equal sub-flows over the pairs
  of addresses that share a rail (docs/fabric.md, "Rails and paths");
- `hoplite-single-rail`: the same with every node advertising rail 0 only;
- `openmpi-tuned`: OpenMPI with the tuned algorithms (`benchmarks.mpi`),
  its TCP BTL over every rail's interface (`btl_tcp_if_include=eth0,eth1,...`):
  one BTL module per interface, and the ob1 PML spreads each large message
  over every module that reaches the peer (docs/fabric.md, "Emulated hosts
  with k rails");
- `gloo`: torch.distributed's Gloo on rail 0 only (`GLOO_SOCKET_IFNAME=eth0`).

Both hoplite-gpu systems run with the same settings: the allreduce sliced
(a ring in rank order, as on the leaf-spine) and `HOPLITE_MULTI_SOURCE_BYTES`
lowered to a ring's piece (size / hosts) where that is below the default.

The result file's keys: `benchmark` (`rails`), `settings` (the cluster,
size, ops, systems, each system's settings, the bounds), `link` (one TCP
stream on one rail), `rows` (one per launch: netbench's row, whose
`lower_bound_s` is the k rails' bound, plus `repeat`, `one_rail_bound_s`,
`rail_bytes_down` / `rail_bytes_up` (bytes on each rail, all hosts) and
`rail_share_down`), `summary` (per op and system: netbench's summary plus
`speedup` (this system's median over hoplite-gpu's: how many times faster
hoplite-gpu was), `rail_share_down`, `byte_identical` and the CPU
(`cpu_busy`, `cpu_softirq`, `ranks_cpu_share`, `cpu_bound`)), `speedups`
(per op, each system's median over hoplite-gpu's), `skipped` (systems not
run, why), `failed` (launches that failed every attempt) and
`byte_identical`.
"""

from __future__ import annotations

import argparse
import functools

from rich.console import Console
from rich.table import Table

from hoplite_gpu.config import Config

from .args import at_least, seconds
from .emurun import _stop_on_signals, fmt_s, human, launch_with_retries, parse_size, summarize
from .leafspinerun import ALLREDUCE_ENV, CPU_BUSY, _cpu_summary, _say_cpu, _usable_systems

OPS = ("broadcast", "allreduce")
SYSTEMS = ("hoplite-gpu", "hoplite-single-rail", "openmpi-tuned", "gloo")
#: Each rail's rate unless told (Mbit/s): at 8 hosts with 2 or 4 rails the
#: two cores stayed under about 70 % busy (docs/fabric.md, "Emulated hosts
#: with k rails").
DEFAULT_MBIT = 100.0


def hoplite_env(op: str, size: int, hosts: int) -> dict[str, str]:
    """Both hoplite-gpu systems' settings for `op` on `size` bytes per rank:
    the allreduce sliced, and `HOPLITE_MULTI_SOURCE_BYTES` lowered to a
    ring's piece (size / hosts) where that is below the default, since only
    pulls of at least it are split over the rails."""
    env = dict(ALLREDUCE_ENV) if op == "allreduce" else {}
    piece = max(1, size // hosts)
    if piece < Config.multi_source_bytes:
        env["HOPLITE_MULTI_SOURCE_BYTES"] = str(piece)
    return env


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hosts", type=at_least(2), default=8)
    p.add_argument("--rails", type=at_least(1), default=2, help="rails (NICs) per host")
    p.add_argument("--mbit", type=seconds(0.0, above=True), default=DEFAULT_MBIT,
                   help=f"each rail's rate, Mbit/s (default {DEFAULT_MBIT:g}: low enough that "
                        "2 cores keep up; the run reports their use)")
    p.add_argument("--size", type=parse_size, default=parse_size("64M"),
                   help="bytes per rank, binary units (default 64M)")
    p.add_argument("--op", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--repeats", type=at_least(1), default=3,
                   help="launches of each system per op, interleaved (default 3)")
    p.add_argument("--retries", type=at_least(0), default=1,
                   help="relaunches of a launch that failed (its error is kept)")
    p.add_argument("--tag", default="rails", help="result file stem")
    p.set_defaults(plot=True)  # (drawn beside the saved result)


def run(args: argparse.Namespace, console: Console) -> dict:
    from .rails import RailCluster

    try:
        cluster = RailCluster(args.hosts, args.rails, args.mbit * 1e6)
    except ValueError as exc:
        raise SystemExit(f"rails: {exc}") from None
    _stop_on_signals()
    systems, skipped = _usable_systems(args.systems, console)
    rows, failed = [], []
    with cluster:
        if cluster.swept:
            console.print(f"removed {len(cluster.swept)} namespaces of a run that was killed")
        console.print(cluster.describe())
        half_a_second = max(1 << 20, int(cluster.rail_bps / 16))  # (bytes at the rail's rate)
        link = {"one_stream_bps": cluster.measure_link(half_a_second)}
        console.print(f"one TCP stream on one rail: {link['one_stream_bps'] / 1e6:.1f} Mbit/s")
        for repeat in range(1, args.repeats + 1):
            for op in args.op:
                for system in systems:  # interleaved, so drift hits every system alike
                    row, errors = launch_with_retries(
                        args.retries, f"{op}-{repeat}-{system}",
                        functools.partial(launch, cluster, system, op, args.size, repeat=repeat))
                    if row is None:
                        failed.append({"system": system, "op": op, "repeat": repeat,
                                       "errors": errors})
                        console.print(f"[red]{system} {op} (repeat {repeat}) failed: "
                                      f"{errors[-1][:300]}[/]")
                        continue
                    rows.append(row)
                    _say(console, row)
    settings = _settings(cluster, args, systems, link)
    summary = summarize(rows)
    _cpu_summary(summary, rows)
    _rail_summary(summary, rows, failed)
    console.print(table(summary, settings), width=max(console.width, 150))
    _say_cpu(console, summary)
    agree = all(len({r["crc"] for r in rows if r["op"] == op}) <= 1 for op in args.op)
    return {"benchmark": "rails", "file_stem": args.tag, "settings": settings, "link": link,
            "rows": rows, "summary": summary, "speedups": speedups(summary),
            "skipped": skipped, "failed": failed,
            "byte_identical": agree and not failed and not any(
                "wrong result" in e for r in rows for e in r["failed_attempts"])}


def launch(cluster, system: str, op: str, size: int, *, repeat: int, tag: str) -> dict:
    """One launch of `system` on the cluster: netbench's row (its bound the k
    rails'), plus the bytes each rail carried."""
    from .netbench import run_launch

    if system not in SYSTEMS:
        raise ValueError(f"rails: unknown system {system!r}; one of {', '.join(SYSTEMS)}")
    on, base, env = cluster, system, None
    if system.startswith("hoplite"):
        base, env = "hoplite-gpu", hoplite_env(op, size, cluster.hosts)
        if system == "hoplite-single-rail":
            on = cluster.advertising(1)
    before = cluster.rail_counters()
    row = run_launch(on, base, op, size, tag=tag, env=env)
    after = cluster.rail_counters()
    down = [sum(a[0] - b[0] for a, b in zip(x, y, strict=True))
            for x, y in zip(after, before, strict=True)]
    up = [sum(a[1] - b[1] for a, b in zip(x, y, strict=True))
          for x, y in zip(after, before, strict=True)]
    row.update(system=system, label=system, repeat=repeat, rails=cluster.rails,
               rail_bps=cluster.rail_bps, env=env,
               one_rail_bound_s=row["lower_bound_s"] * cluster.rails,
               rail_bytes_down=down, rail_bytes_up=up,
               rail_share_down=[d / max(1, sum(down)) for d in down])
    for key in ("start_max", "end_max", "start_min"):
        row.pop(key, None)
    return row


def _rail_summary(summary: list[dict], rows: list[dict], failed: list[dict]) -> None:
    """Per summary entry: hoplite-gpu's speed-up over it, each rail's share
    of the bytes its launches delivered, and whether every launch gave the
    exact result."""
    best = {e["op"]: e["median_s"] for e in summary if e["system"] == "hoplite-gpu"}
    for e in summary:
        mine = [r for r in rows if (r["op"], r["system"]) == (e["op"], e["system"])]
        per_rail = [sum(col) for col in zip(*(r["rail_bytes_down"] for r in mine), strict=True)]
        e["rail_share_down"] = [b / max(1, sum(per_rail)) for b in per_rail]
        e["speedup"] = e["median_s"] / best[e["op"]] if e["op"] in best else None
        e["byte_identical"] = len({r["crc"] for r in mine}) == 1 and not any(
            (f["op"], f["system"]) == (e["op"], e["system"]) for f in failed)


def speedups(summary: list[dict]) -> dict[str, dict[str, float]]:
    """Per op: each system's median time over hoplite-gpu's."""
    out: dict[str, dict[str, float]] = {}
    for e in summary:
        if e["speedup"] is not None and e["system"] != "hoplite-gpu":
            out.setdefault(e["op"], {})[e["system"]] = e["speedup"]
    return out


def _settings(cluster, args: argparse.Namespace, systems: list[str], link: dict) -> dict:
    from .mpi import TRANSPORT_MCA, TUNED_MCA
    from .netbench import lower_bound

    return {"cluster": {"hosts": cluster.hosts, "rails": cluster.rails,
                        "rail_bps": cluster.rail_bps, "host_bps": cluster.bandwidth_bps,
                        "addresses": "10.66.<rail>.<host + 1>/24, a switch per rail",
                        "shaping": "tbf both ways on every rail's link, 256 KB burst"},
            "size_bytes": args.size, "ops": args.op, "systems": systems,
            "repeats": args.repeats,
            "bounds_s": {op: {"k_rails": lower_bound(op, args.size, cluster.hosts,
                                                     cluster.bandwidth_bps),
                              "one_rail": lower_bound(op, args.size, cluster.hosts,
                                                      cluster.rail_bps)} for op in args.op},
            "hoplite_env": {op: hoplite_env(op, args.size, cluster.hosts) for op in args.op},
            "hoplite_node_host": {"hoplite-gpu": cluster.node_host(0),
                                  "hoplite-single-rail": cluster.advertising(1).node_host(0)},
            "openmpi": {"mca_both": {**TRANSPORT_MCA, "btl_tcp_if_include": cluster.interfaces,
                                     "oob_tcp_if_include": cluster.interfaces},
                        "mca_tuned": TUNED_MCA},
            "gloo": "torch.distributed defaults, GLOO_SOCKET_IFNAME=eth0 (rail 0 only)",
            "measured_link_bps": link["one_stream_bps"], "cpu_busy_limit": CPU_BUSY}


def _say(console: Console, row: dict) -> None:
    cpu = row.get("cpu") or {}
    rails = "/".join(f"{s:.0%}" for s in row["rail_share_down"])
    console.print(f"{row['system']}: {row['op']} {human(row['size_bytes'])} "
                  f"{fmt_s(row['seconds'])} = {row['ratio_to_bound']:.2f} x the k rails' bound; "
                  f"bytes per rail {rails}; CPU {cpu.get('busy', float('nan')):.0%}")


def table(summary: list[dict], settings: dict) -> Table:
    c = settings["cluster"]
    t = Table(title=f"{c['hosts']} hosts, {c['rails']} rails of {c['rail_bps'] / 1e6:g} Mbit/s "
                    f"each: medians of {settings['repeats']} launches")
    for col in ("op", "size", "system", "n", "median", "min .. max", "bound, k rails", "x bound",
                "hoplite-gpu faster by", "bytes per rail", "exact", "CPU busy"):
        t.add_column(col, justify="right", no_wrap=True)
    order = {s: k for k, s in enumerate(SYSTEMS)}
    for e in sorted(summary, key=lambda e: (e["op"], order.get(e["system"], 99))):
        t.add_row(e["op"], human(e["size_bytes"]), e["system"], str(e["n"]),
                  fmt_s(e["median_s"]), f"{fmt_s(e['min_s'])} .. {fmt_s(e['max_s'])}",
                  fmt_s(e["lower_bound_s"]), f"{e['ratio_to_bound']:.2f}",
                  "-" if e["speedup"] is None or e["system"] == "hoplite-gpu"
                  else f"{e['speedup']:.2f} x",
                  "/".join(f"{s:.0%}" for s in e["rail_share_down"]),
                  "yes" if e["byte_identical"] else "NO",
                  "-" if e["cpu_busy"] is None else f"{e['cpu_busy']:.0%}")
    return t
