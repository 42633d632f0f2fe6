"""`python -m benchmarks fabric-sim`: ECMP, ideal spraying and Ethereal on a
simulated fat-tree (hoplite_gpu/fabric), per op and number of failed links.

For each op (ring allreduce, all-to-all, hoplite-gpu's broadcast) and each
count of failed switch-to-switch cables, every routing runs on the same
fabric and placement; each row records the completion time, the fabric's
bound, the most loaded switch link, Ethereal's largest sub-flow, and the
ratios to spraying. The simulator is deterministic and CPU-only: its results
do not depend on the machine; `wall_s` (the simulator's own time) does.
Runs matching a `--small` pattern (op:routing:failed, shell-style, e.g.
`ring-allreduce:ecmp:*`: a ring whose ranks fall out of step makes an event
of nearly every message, two million at 1,024 hosts) run on `--small-k`
instead, and the row says so (its `k`).
"""

from __future__ import annotations

import argparse
import fnmatch

import numpy as np
from rich.table import Table

from hoplite_gpu.fabric.hoplite_ops import HopliteBroadcast
from hoplite_gpu.fabric.ops import AllToAll, RingAllreduce
from hoplite_gpu.fabric.run import simulate
from hoplite_gpu.fabric.topology import fat_tree

from .args import at_least, size

OPS = ("ring-allreduce", "alltoall", "broadcast")
ROUTINGS = ("spray", "ethereal", "ecmp")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--k", type=at_least(2), default=16, help="fat-tree radix (16: 1,024 hosts)")
    p.add_argument("--small-k", type=at_least(2), default=8,
                   help="radix for the runs --small names (default 8)")
    p.add_argument("--size", type=size, default=64 << 20, help="bytes (default 64 MiB)")
    p.add_argument("--chunk", type=size, default=4 << 20, help="broadcast chunk (default 4 MiB)")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--failed", type=int, nargs="+", default=[0, 1, 2],
                   help="failed cables per run (default 0 1 2)")
    p.add_argument("--small", nargs="*", default=["ring-allreduce:ecmp:*"],
                   help="op:routing:failed patterns run on --small-k (default "
                        "ring-allreduce:ecmp:*)")
    p.add_argument("--seed", type=int, default=1, help="placement, failures, ECMP draws")


def _op(name: str, hosts: list[int], args: argparse.Namespace):
    if name == "ring-allreduce":
        return RingAllreduce(hosts, args.size)
    if name == "alltoall":
        return AllToAll(hosts, args.size)
    return HopliteBroadcast(hosts, args.size, chunk=args.chunk, latency=1e-4)


def run(args: argparse.Namespace, console) -> dict:
    rows = []
    for op in args.ops:
        for failed in args.failed:
            base = {}
            for routing in ROUTINGS:
                small = any(fnmatch.fnmatchcase(f"{op}:{routing}:{failed}", pattern)
                            for pattern in args.small)
                k = args.small_k if small else args.k
                f = fat_tree(k, failed=failed, seed=args.seed)
                hosts = np.random.default_rng(args.seed).permutation(f.hosts).tolist()
                r = simulate(f, _op(op, hosts, args), routing, seed=args.seed)
                row = {"op": op, "routing": routing, "k": k, "failed_count": failed,
                       "placement": "random",
                       **{key: value for key, value in r.as_dict().items()
                          if key not in ("op", "routing")}}
                if routing == "spray":
                    base[k] = r
                ref = base.get(k)
                if ref is not None:
                    row["completion_over_spray"] = r.completion_s / ref.completion_s
                    row["max_load_over_spray_in_parts"] = (
                        (r.max_link_load_bytes - ref.max_link_load_bytes)
                        / max(r.largest_part_bytes, 1.0))
                row["completion_over_bound"] = r.completion_s / r.bound_s
                rows.append(row)
                console.print(f"{op} k={k} failed={failed} {routing}: "
                              f"{r.completion_s * 1e3:.2f} ms ({r.completion_s / r.bound_s:.3f} "
                              f"x bound), max switch link {r.max_link_load_bytes / 2**20:.1f} "
                              f"MiB, {r.events} events, {r.wall_s:.1f} s")
    table = Table(title="fabric-sim: routing on a fat-tree (completion / spraying's)")
    for col in ("op", "k", "failed", "routing", "completion (ms)", "x bound", "x spray",
                "max switch link (MiB)", "over spray (sub-flows)", "sim s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["op"], str(r["k"]), str(r["failed_count"]), r["routing"],
                      f"{r['completion_s'] * 1e3:.2f}", f"{r['completion_over_bound']:.3f}",
                      f"{r.get('completion_over_spray', float('nan')):.3f}",
                      f"{r['max_link_load_bytes'] / 2**20:.1f}",
                      f"{r.get('max_load_over_spray_in_parts', float('nan')):.2f}",
                      f"{r['wall_s']:.1f}")
    console.print(table)
    return {"benchmark": "fabric-sim", "rows": rows}
