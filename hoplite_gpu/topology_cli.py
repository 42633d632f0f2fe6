"""`hoplite-gpu topology show | pack`: a topology, and the trees packed over it.

    hoplite-gpu topology show                        this machine (NVML)
    hoplite-gpu topology show --fixture dgx1v [--json]
    hoplite-gpu topology pack --fixture dgx1v --root 0 [--members 0,1,4] [--json] [--png F]

Bad input (an unknown fixture, a malformed file, a root or member not in the
topology) is one line on stderr naming the flag, and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator

from .topology import FIXTURES, Topology, TopologyError, TopologyUnavailable


class _BadFlag(Exception):
    """Bad input, by the flag that gave it."""

    def __init__(self, flag: str, cause: str) -> None:
        super().__init__(f"{flag}: {cause}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The `topology` command and its two subcommands."""
    top = sub.add_parser("topology", help="show a GPU topology, or pack broadcast trees "
                                          "over its links (Blink)")
    cmds = top.add_subparsers(dest="topology_command", required=True)
    show = cmds.add_parser("show", help="nodes, relays and links (default: this machine's GPUs)")
    _source(show, required=False)
    show.add_argument("--json", action="store_true", help="print it in the JSON file format")
    show.set_defaults(func=run_show)
    pack = cmds.add_parser("pack", help="spanning trees of a root and members, with their rates")
    _source(pack, required=True)
    pack.add_argument("--root", required=True, help="the node the bytes start from")
    pack.add_argument("--members", default=None,
                      help="comma-separated nodes, the root among them (default: every node)")
    pack.add_argument("--flow", choices=["broadcast", "reduce", "allreduce"],
                      default="broadcast", help="which way bytes flow (default broadcast)")
    pack.add_argument("--max-loss", type=float, default=0.01,
                      help="rate the fewest trees may give up, a fraction (default 0.01)")
    pack.add_argument("--json", action="store_true", help="print the plan as JSON")
    pack.add_argument("--png", metavar="FILE", default=None,
                      help="draw the trees into FILE (needs matplotlib)")
    pack.set_defaults(func=run_pack)


def _source(p: argparse.ArgumentParser, *, required: bool) -> None:
    g = p.add_mutually_exclusive_group(required=required)
    g.add_argument("--fixture", metavar="NAME",
                   help=f"a built-in topology: {', '.join(FIXTURES)}")
    g.add_argument("--file", metavar="F",
                   help="a JSON topology, or saved `nvidia-smi topo -m` output")


def _load(args: argparse.Namespace) -> Topology:
    from .topology import fixture, from_file

    if args.fixture is not None:
        try:
            return fixture(args.fixture)
        except TopologyError as exc:
            raise _BadFlag("--fixture", str(exc)) from None
    try:
        return from_file(args.file)
    except TopologyError as exc:
        raise _BadFlag("--file", str(exc)) from None


def _fail(command: str, exc: _BadFlag) -> int:
    print(f"hoplite-gpu topology {command}: error: {exc}", file=sys.stderr)
    return 2


def run_show(args: argparse.Namespace) -> int:
    from .topology import from_nvml, to_json

    if args.fixture is None and args.file is None:
        try:
            topology = from_nvml()
        except TopologyUnavailable as exc:
            print(f"{exc}; the CPU path (NumPy + TCP) works. Try --fixture NAME "
                  f"({', '.join(FIXTURES)}) or --file F")
            return 0
    else:
        try:
            topology = _load(args)
        except _BadFlag as exc:
            return _fail("show", exc)
    if args.json:
        print(json.dumps(to_json(topology), indent=1))
    else:
        print("\n".join(describe(topology)))
    return 0


def _unit(topology: Topology) -> str:
    return "GB/s" if topology.unit_bytes_per_s == 1e9 else "units"


def describe(topology: Topology) -> list[str]:
    """A topology as lines of text: nodes, relays, links (each pair once)."""
    unit = _unit(topology)
    out = [f"{topology.name}: {len(topology.nodes)} nodes, {len(topology.relays)} relays, "
           f"capacities in {unit} per direction",
           f"nodes: {' '.join(map(str, topology.nodes))}"]
    if topology.relays:
        out.append(f"relays (forward, copy nothing): {' '.join(map(str, topology.relays))}")
    done = set()
    for link in topology.links:
        if (link.src, link.dst) in done:
            continue
        back = topology.link(link.dst, link.src)
        both = back is not None and back.capacity == link.capacity
        if both:
            done.add((link.dst, link.src))
        arrow = "<->" if both else "->"
        out.append(f"  {link.src!s:>14} {arrow} {link.dst!s:<14} {link.capacity:8.4g}  {link.kind}")
    if not topology.links:
        out.append("  (no links)")
    out += [f"note: {n}" for n in topology.notes]
    return out


def _members(topology: Topology, text: str | None) -> list | None:
    if text is None:
        return None
    names = [t.strip() for t in text.split(",")]
    if not all(names):
        raise _BadFlag("--members", f"expected comma-separated nodes, e.g. 0,1,4; got {text!r}")
    try:
        return [topology.lookup(n, what="member") for n in names]
    except TopologyError as exc:
        raise _BadFlag("--members", str(exc)) from None


def run_pack(args: argparse.Namespace) -> int:
    from .trees import pack

    try:
        topology = _load(args)
        try:
            root = topology.lookup(args.root, what="root")
        except TopologyError as exc:
            raise _BadFlag("--root", str(exc)) from None
        members = _members(topology, args.members)
        if members is not None and root not in members:
            raise _BadFlag("--root", f"{root} is not among --members {args.members}")
        if not 0 <= args.max_loss < 1:
            raise _BadFlag("--max-loss", f"must be a fraction in [0, 1); got {args.max_loss}")
        _warm()
        start = time.perf_counter()
        try:
            with _native_stdout_muted():
                plan = pack(topology, root, members, flow=args.flow, max_loss=args.max_loss)
        except TopologyError as exc:
            raise _BadFlag("--members" if args.members else "--root", str(exc)) from None
        seconds = time.perf_counter() - start
    except _BadFlag as exc:
        return _fail("pack", exc)
    if args.png:
        code = _draw(plan, topology, args.png)
        if code:
            return code
    if args.json:
        print(json.dumps({"topology": topology.name, **plan.to_json()}, indent=1))
    else:
        print("\n".join(_summary(plan, topology, seconds)))
    return 0


def _warm() -> None:
    """Import the solvers before the clock starts: "planned in" is planning."""
    from .topology.deps import networkx, scipy_optimize

    networkx()
    scipy_optimize()


def _summary(plan, topology: Topology, seconds: float) -> list[str]:
    unit = _unit(topology)
    pct = 100 * plan.rate / plan.bound
    out = [f"{topology.name}: {plan.flow} from {plan.root} to "
           f"{' '.join(map(str, plan.members))}",
           f"bound R* {plan.bound:.4g} {unit}; packed {plan.packed:.4g} {unit} (tree packings "
           f"reach at most {plan.upper:.4g}); kept {len(plan.trees)} "
           f"tree{'s' if len(plan.trees) != 1 else ''} carrying "
           f"{plan.rate:.4g} {unit} = {pct:.1f} % of R*",
           f"planned in {seconds * 1e3:.0f} ms ({plan.rounds} round"
           f"{'s' if plan.rounds != 1 else ''}, {plan.candidates} candidate trees)"]
    for n, tree in enumerate(plan.trees):
        hops = " ".join(f"{p[0]}" + "".join(f"->[{h}]" for h in p[1:-1]) + f"->{p[-1]}"
                        for p in tree.paths)
        out.append(f"tree {n}: {tree.rate:8.4g} {unit}  {','.join(tree.kinds):<16} {hops}")
    return out


@contextlib.contextmanager
def _native_stdout_muted() -> Iterator[None]:
    """HiGHS (inside SciPy) may printf a debugging line while it solves a
    MILP; keep it out of what we print (a --json reader would choke)."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None).fflush(None)
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _draw(plan, topology: Topology, path: str) -> int:
    try:
        import matplotlib  # noqa: PLC0415 - only for --png

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as exc:
        print(f"hoplite-gpu topology pack: error: --png needs matplotlib "
              f"(pip install matplotlib): {exc}", file=sys.stderr)
        return 1
    from .topology_draw import draw_trees

    try:
        draw_trees(plt, plan, topology, path)
    except (OSError, ValueError) as exc:
        print(f"hoplite-gpu topology pack: error: --png: cannot write {path}: {exc}",
              file=sys.stderr)
        return 2
    return 0
