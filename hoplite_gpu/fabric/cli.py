"""`hoplite-gpu simulate --fabric ...`: one op on a simulated CLOS fabric with
one routing; prints a summary, or the result as JSON."""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

from ..config import format_size, parse_size
from ..errors import ConfigError, HopliteError
from .hoplite_ops import HopliteBroadcast, HopliteReduce
from .ops import AllToAll, Op, RingAllreduce
from .routing import ROUTINGS
from .run import FabricResult, simulate
from .topology import LAYER_NAMES, Fabric, fat_tree, leaf_spine

PROG = "hoplite-gpu simulate"
OPS = ("ring-allreduce", "alltoall", "broadcast", "reduce")


class _Refused(Exception):
    """A flag's value, or a combination of flags, that cannot run."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{PROG} --fabric", description="One collective on a simulated CLOS fabric "
        "(flow level, max-min fair links): completion time, the fabric's bound and the most "
        "loaded link, for one routing (ECMP, ideal spraying or Ethereal's split flows).")
    p.add_argument("--fabric", choices=["leaf-spine", "fat-tree"], required=True)
    p.add_argument("--hosts", type=int, help="hosts in the fabric (fat-tree: k^3/4; "
                   "leaf-spine: a multiple of --hosts-per-leaf)")
    p.add_argument("--k", type=int, help="fat-tree: switch radix (even; default from --hosts)")
    p.add_argument("--spines", type=int, default=16, help="leaf-spine: spines (default 16)")
    p.add_argument("--hosts-per-leaf", type=int,
                   help="leaf-spine: hosts under each leaf (default: as many as --spines)")
    p.add_argument("--oversubscription", type=float, default=1.0,
                   help="leaf-spine: hosts' bandwidth over a leaf's uplinks' (default 1)")
    p.add_argument("--op", choices=OPS, required=True,
                   help="broadcast and reduce are hoplite-gpu's, decided by its directory")
    p.add_argument("--routing", choices=ROUTINGS, required=True)
    p.add_argument("--subflows", type=int,
                   help="ethereal: most sub-flows per flow (default: the leaf's uplinks)")
    p.add_argument("--failed-links", type=int, default=0,
                   help="switch-to-switch cables failed, chosen with --seed (default 0)")
    p.add_argument("--size", default="64MiB",
                   help="ring-allreduce: the array; alltoall: what each host sends in all; "
                        "broadcast: the object; reduce: each input (default 64MiB)")
    p.add_argument("--chunk", default="4MiB", help="broadcast, reduce: pipeline chunk "
                   "(default 4MiB)")
    p.add_argument("--bandwidth", type=float, default=1.25e9,
                   help="bytes/s of a host link (default 1.25e9)")
    p.add_argument("--latency", type=float, default=1e-4,
                   help="broadcast, reduce: seconds per directory message and chunk hop "
                        "(default 1e-4)")
    p.add_argument("--placement", choices=["linear", "random"], default="linear",
                   help="ranks on hosts 0, 1, ... in order, or shuffled with --seed")
    p.add_argument("--seed", type=int, default=0,
                   help="failed links, ECMP's draws, random placement (default 0)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--png", metavar="FILE", help="draw each layer's link loads (matplotlib)")
    return p


def _size(flag: str, text: str) -> int:
    try:
        value = parse_size(text)
    except ConfigError as exc:
        raise _Refused(f"{flag} {text}: {exc}") from None
    if value < 1:
        raise _Refused(f"{flag} {text}: must be at least 1 byte")
    return value


def build_fabric(a: argparse.Namespace) -> Fabric:
    if not (0 < a.bandwidth < math.inf):
        raise _Refused(f"--bandwidth {a.bandwidth:g}: must be a positive number of bytes/s")
    if a.fabric == "fat-tree":
        k = a.k
        if k is None:
            if a.hosts is None:
                raise _Refused("--fabric fat-tree needs --k or --hosts")
            k = round((4 * a.hosts) ** (1 / 3))
            if k * k * k != 4 * a.hosts or k % 2:
                raise _Refused(f"--hosts {a.hosts}: a fat-tree has k^3/4 hosts for an even k "
                               "(16, 54, 128, 250, 432, 686, 1024, ...)")
        if k < 2 or k % 2:
            raise _Refused(f"--k {k}: a fat-tree needs an even k of at least 2")
        if a.hosts is not None and a.hosts != k ** 3 // 4:
            raise _Refused(f"--hosts {a.hosts}: a fat-tree with --k {k} has {k ** 3 // 4} hosts")
        return fat_tree(k, host_bps=a.bandwidth, failed=_failed(a, 2 * k ** 3 // 4), seed=a.seed)
    if a.k is not None:
        raise _Refused("--k is for --fabric fat-tree; a leaf-spine takes --spines, "
                       "--hosts-per-leaf and --oversubscription")
    if a.spines < 1:
        raise _Refused(f"--spines {a.spines}: needs at least 1 spine")
    per_leaf = a.spines if a.hosts_per_leaf is None else a.hosts_per_leaf
    if per_leaf < 1:
        raise _Refused(f"--hosts-per-leaf {per_leaf}: needs at least 1 host per leaf")
    if a.hosts is None or a.hosts < 2 or a.hosts % per_leaf:
        raise _Refused(f"--hosts {a.hosts}: a leaf-spine needs a multiple of --hosts-per-leaf "
                       f"({per_leaf}), at least 2 hosts")
    if not 0 < a.oversubscription < math.inf:
        raise _Refused(f"--oversubscription {a.oversubscription:g}: must be a positive ratio")
    leaves = a.hosts // per_leaf
    return leaf_spine(per_leaf, leaves, a.spines, oversubscription=a.oversubscription,
                      host_bps=a.bandwidth, failed=_failed(a, leaves * a.spines), seed=a.seed)


def _failed(a: argparse.Namespace, cables: int) -> int:
    if not 0 <= a.failed_links <= cables:
        raise _Refused(f"--failed-links {a.failed_links}: this fabric has {cables} "
                       "switch-to-switch cables")
    return a.failed_links


def build_op(a: argparse.Namespace, fabric: Fabric) -> Op:
    size = _size("--size", a.size)
    hosts = np.arange(fabric.hosts)
    if a.placement == "random":
        hosts = np.random.default_rng(a.seed).permutation(fabric.hosts)
    hosts = hosts.tolist()
    if a.latency < 0 or not a.latency < math.inf:
        raise _Refused(f"--latency {a.latency:g}: must be 0 or more seconds")
    if a.op == "ring-allreduce":
        return RingAllreduce(hosts, size)
    if a.op == "alltoall":
        return AllToAll(hosts, size)
    chunk = _size("--chunk", a.chunk)
    if a.op == "broadcast":
        return HopliteBroadcast(hosts, size, chunk=chunk, latency=a.latency,
                                bandwidth=a.bandwidth)
    if size % 4:
        raise _Refused(f"--size {a.size}: reduce sums float32 arrays; needs a multiple of "
                       "4 bytes")
    return HopliteReduce(hosts, size, chunk=chunk, latency=a.latency, bandwidth=a.bandwidth)


def summary(r: FabricResult) -> str:
    return (f"{r.op} of {format_size(int(r.size_bytes))} on {r.fabric}, {r.routing}: "
            f"{r.completion_s * 1e3:.2f} ms = {r.completion_s / r.bound_s:.3f} x the bound "
            f"({r.bound_s * 1e3:.2f} ms); most loaded switch link "
            f"{format_size(int(r.max_link_load_bytes))}; {r.events} events, "
            f"{r.flows} flows, {r.wall_s:.1f} s")


def draw(path: str, fabric: Fabric, loads: np.ndarray, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise _Refused(f"--png {path}: drawing needs matplotlib "
                       "(pip install 'hoplite-gpu[bench]')") from None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, name in enumerate(LAYER_NAMES):
        on = (fabric.layer == i) & (fabric.capacity > 0)
        if on.any():
            ax.plot(np.sort(loads[on])[::-1] / 2**20, label=name)
    ax.set_xlabel("links of a layer, most loaded first")
    ax.set_ylabel("MiB carried")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        fabric = build_fabric(args)
        op = build_op(args, fabric)
        if args.subflows is not None and (args.routing != "ethereal" or args.subflows < 1):
            raise _Refused(f"--subflows {args.subflows}: a whole number of at least 1, for "
                           "--routing ethereal only")
        result, loads = run_one(fabric, op, args)
        if args.png:
            draw(args.png, fabric, loads, summary(result))
    except _Refused as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except HopliteError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        out = result.as_dict()
        out["command"] = " ".join([PROG, *argv])
        print(json.dumps(out, indent=2))
    else:
        print(summary(result))
    return 0


def run_one(fabric: Fabric, op: Op, args: argparse.Namespace) -> tuple[FabricResult, np.ndarray]:
    result = simulate(fabric, op, args.routing, seed=args.seed, subflows=args.subflows)
    result.extra["placement"] = args.placement
    return result, result.link_bytes
