"""``python -m benchmarks [broadcast] ...``: run benchmarks, print a table, save JSON.

Results go to ``benchmarks/results/<name>-<date>.json`` with the command line,
the machine (CPU count, platform) and every measured time, so a rerun can be
compared side by side.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import platform
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .args import at_least, seconds

RESULTS = Path(__file__).resolve().parent / "results"


def _machine() -> dict:
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "processor": platform.processor()}


def broadcast(args: argparse.Namespace, console: Console) -> dict:
    """Broadcast to N-1 receivers over loopback vs one point-to-point transfer,
    with same-host pulls through shared memory and/or over TCP."""
    import hoplite_gpu as hg
    from hoplite_gpu.cluster import LocalCluster
    from hoplite_gpu.demo import measure_broadcast

    variants = {"both": [True, False], "on": [True], "off": [False]}[args.shared_memory]
    rows = []
    for size_mib in args.sizes:
        for shared in variants:
            with LocalCluster(args.workers, shared_memory=shared) as cluster:
                hg.init(cluster.address, token=cluster.token)
                try:
                    m = measure_broadcast(cluster, size_mib << 20, args.repeats,
                                          tag=f"b{size_mib}")
                finally:
                    hg.shutdown()
            p2p, bc = statistics.median(m["p2p_s"]), statistics.median(m["broadcast_s"])
            rows.append({"size_bytes": size_mib << 20, "workers": args.workers,
                         "receivers": args.workers - 1, "repeats": args.repeats,
                         "shared_memory": shared,
                         "p2p_s": m["p2p_s"], "broadcast_s": m["broadcast_s"],
                         "p2p_median_s": p2p, "broadcast_median_s": bc,
                         "ratio_broadcast_to_p2p": bc / p2p, "byte_identical": m["ok"],
                         "edges": m["info"]["edges"]})
            console.print(f"{size_mib} MiB, shared memory {'on' if shared else 'off'}: "
                          f"p2p {p2p * 1e3:.1f} ms, broadcast {bc * 1e3:.1f} ms, "
                          f"ratio {bc / p2p:.2f}")
    table = Table(title=f"broadcast to {args.workers - 1} receivers vs point-to-point (loopback)")
    for col in ("size", "shared memory", "p2p median (ms)", "broadcast median (ms)", "ratio",
                "star bound", "broadcast, off / on", "ok"):
        table.add_column(col, justify="right")
    for r in rows:
        off = [o for o in rows if o["size_bytes"] == r["size_bytes"] and not o["shared_memory"]]
        speedup = (f"{off[0]['broadcast_median_s'] / r['broadcast_median_s']:.2f}"
                   if r["shared_memory"] and off else "")
        table.add_row(f"{r['size_bytes'] >> 20} MiB", "on" if r["shared_memory"] else "off",
                      f"{r['p2p_median_s'] * 1e3:.1f}",
                      f"{r['broadcast_median_s'] * 1e3:.1f}", f"{r['ratio_broadcast_to_p2p']:.2f}",
                      f"{r['receivers']}", speedup, "yes" if r["byte_identical"] else "NO")
    console.print(table)
    return {"benchmark": "broadcast-loopback", "rows": rows}


def reduce(args: argparse.Namespace, console: Console) -> dict:
    from . import reduce as bench

    res = bench.run(args.workers, args.size << 20, args.repeats, args.gap, console)
    med = res["median_s"]
    table = Table(title=f"reduce of {args.workers} x {args.size} MiB on loopback (medians)")
    for col in ("measure", "ms"):
        table.add_column(col, justify="right")
    for k, v in med.items():
        table.add_row(k, f"{v * 1e3:.1f}")
    table.add_row("reduce / p2p", f"{res['ratio_reduce_to_p2p']:.2f} x")
    table.add_row("dynamic / all-at-once (after last put)", f"{res['ratio_dynamic_to_all_at_once']:.2f} x")
    console.print(table)
    return {"benchmark": "reduce-loopback", "rows": [res]}


def fault(args: argparse.Namespace, console: Console) -> dict:
    from . import fault as bench

    res = bench.run(args.workers, args.size << 20, args.repeats, console,
                    stall_timeout_s=args.stall_timeout, heartbeat_interval_s=0.5, node_lease_s=2.0)
    med = res["median_s"]
    table = Table(title=f"broadcast of {args.size} MiB to {args.workers - 1} over TCP, one relay "
                  "killed mid-transfer")
    for col in ("measure", "value"):
        table.add_column(col, justify="right")
    table.add_row("no failure (median)", f"{med['no_failure_s'] * 1e3:.0f} ms")
    table.add_row("relay killed mid-transfer (median)", f"{med['with_failure_s'] * 1e3:.0f} ms")
    table.add_row("killed at (median share of the object)", f"{med['killed_at_fraction']:.0%}")
    table.add_row("ratio (the killed receiver's own time is not in it)",
                  f"{res['ratio_failure_to_no_failure']:.2f} x")
    table.add_row("receivers timed: no failure / with failure",
                  f"{args.workers - 1} / {args.workers - 2}")
    if med["detect_to_resume_s"] is not None:
        table.add_row("detection -> resume (median)", f"{med['detect_to_resume_s'] * 1e3:.1f} ms")
    console.print(table)
    return {"benchmark": "fault-loopback", "rows": [res]}


def soak(args: argparse.Namespace, console: Console) -> dict:
    """Run the chaos test (tests/test_chaos.py) `runs` times in a row, each with a new seed."""
    import random
    import subprocess
    import time

    root = Path(__file__).resolve().parent.parent
    rows = []
    for i in range(args.runs):
        seed = random.randrange(1, 1 << 30)
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "tests/test_chaos.py"], cwd=root, capture_output=True, text=True,
                              env={**os.environ, "CHAOS_SEED": str(seed)}, timeout=600)
        rows.append({"run": i + 1, "seed": seed, "passed": proc.returncode == 0,
                     "seconds": time.monotonic() - t0})
        console.print(f"run {i + 1}/{args.runs}: seed {seed} "
                      f"{'passed' if proc.returncode == 0 else 'FAILED'} in {rows[-1]['seconds']:.1f} s")
        if proc.returncode != 0:
            console.print(proc.stdout[-3000:])
    passed = sum(r["passed"] for r in rows)
    total = sum(r["seconds"] for r in rows)
    console.print(f"{passed} of {len(rows)} chaos runs passed; {total:.0f} s in all")
    return {"benchmark": "chaos-soak", "rows": rows, "passed": passed, "seconds": total,
            "byte_identical": passed == len(rows)}


def plot(args: argparse.Namespace, console: Console) -> dict:
    from .plots import plot_all

    made = plot_all(RESULTS)
    for path in made:
        console.print(f"wrote {path.relative_to(RESULTS.parent.parent)}")
    return {"benchmark": "plots", "rows": []}


def _module_command(sub, name: str, module: str, help: str) -> None:
    """A benchmark living in its own module, which provides `add_arguments(parser)`
    and `run(args, console) -> result`."""
    mod = importlib.import_module(f"{__package__}.{module}")
    parser = sub.add_parser(name, help=help)
    mod.add_arguments(parser)
    parser.add_argument("--no-save", action="store_true")
    parser.set_defaults(func=mod.run)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["rayemu"]:  # its own options: python -m benchmarks rayemu --help
        from .rayemu import main as rayemu_main

        return rayemu_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = p.add_subparsers(dest="name", required=True)
    b = sub.add_parser("broadcast", help="loopback broadcast vs point-to-point")
    b.add_argument("--workers", type=at_least(2), default=8)
    b.add_argument("--sizes", type=at_least(1), nargs="+", default=[64, 256], help="MiB")
    b.add_argument("--repeats", type=at_least(1), default=5)
    b.add_argument("--shared-memory", choices=["both", "on", "off"], default="both",
                   help="same-host pulls through shared memory, over TCP, or each in turn")
    b.add_argument("--no-save", action="store_true")
    b.set_defaults(func=broadcast)
    r = sub.add_parser("reduce", help="loopback reduce vs point-to-point; dynamic vs all-at-once")
    r.add_argument("--workers", type=at_least(2), default=8)
    r.add_argument("--size", type=at_least(1), default=64, help="MiB per input")
    r.add_argument("--repeats", type=at_least(1), default=3)
    r.add_argument("--gap", type=seconds(0.0), default=0.3, help="seconds between input arrivals")
    r.add_argument("--no-save", action="store_true")
    r.set_defaults(func=reduce)
    f = sub.add_parser("fault", help="broadcast with a relay killed mid-transfer vs without failure")
    f.add_argument("--workers", type=at_least(3), default=7,
                   help="the putter and at least two receivers (one relays to the other)")
    f.add_argument("--size", type=at_least(1), default=256, help="MiB")
    f.add_argument("--repeats", type=at_least(1), default=3)
    f.add_argument("--stall-timeout", type=seconds(0.0, above=True), default=2.0)
    f.add_argument("--no-save", action="store_true")
    f.set_defaults(func=fault)
    k = sub.add_parser("soak", help="run the chaos test many times in a row")
    k.add_argument("--runs", type=at_least(1), default=20)
    k.add_argument("--no-save", action="store_true")
    k.set_defaults(func=soak)
    _module_command(sub, "emulated", "emurun", "collectives on emulated hosts (network "
                    "namespaces + tc; root): hoplite-gpu, a star, Gloo, OpenMPI")
    _module_command(sub, "latency", "latency", "small-object collectives on loopback: per-call "
                    "time and CPU per process, every call after a sleep")
    _module_command(sub, "coldget", "coldget", "one small blocking get: the caller's CPU back "
                    "to back and after a sleep, beside a bare socket exchange")
    _module_command(sub, "progress", "progress", "idle CPU per process and round-trip time, "
                    "over TCP and over UCX in each ucxx progress setting")
    _module_command(sub, "memory", "memory", "a reader getting many large objects in turn, "
                    "with and without a store limit: its peak memory and get time")
    _module_command(sub, "allreduce", "allreduce", "a large allreduce on one host, training-loop "
                    "style, for each allreduce_slicing setting side by side")
    _module_command(sub, "machine", "machine", "first-touch cost of fresh memory (NumPy vs plain "
                    "pages) and of Python run after a sleep, on this machine")
    _module_command(sub, "degree-sweep", "degree_sweep", "the reduce cost model's tree degree "
                    "against the simulator's best, per size, inputs and link")
    _module_command(sub, "directory-scale", "directory_scale", "what one event costs the "
                    "directory's state machine at n and 10 n objects, gets, ranks or waits")
    _module_command(sub, "multisource", "multisource", "one receiver pulling a large object "
                    "from several holders at once vs from one, and with a holder killed midway, "
                    "on emulated hosts (network namespaces + tc; root)")
    _module_command(sub, "fuzz", "fuzz", "hostile bytes against the directory, the data "
                    "server and their decoders: crashes, hangs, memory per unproven peer")
    _module_command(sub, "channel", "channel", "new weights from a learner to an actor on "
                    "every other emulated host (network namespaces + tc; root): the weight "
                    "channel beside Ray's object store and Gloo, tensor by tensor")
    _module_command(sub, "leafspine", "leafspinerun", "broadcast and ring allreduce on an "
                    "emulated leaf-spine with ECMP (network namespaces + tc; root) against the "
                    "fabric's bound, per ECMP hash seed: hoplite-gpu, OpenMPI, Gloo")
    _module_command(sub, "rails", "railsrun", "broadcast and ring allreduce on emulated hosts "
                    "with k rails, a switch per rail (network namespaces + tc; root), against "
                    "the k rails' bound: hoplite-gpu on k rails and on one, OpenMPI, Gloo")
    _module_command(sub, "dgxmesh", "dgxmeshrun", "Blink's packed trees on an emulated DGX-1V "
                    "NVLink mesh (network namespaces + tc; root) against S/R*: broadcast to "
                    "member sets, allreduce; hoplite-gpu single-tree and OpenMPI beside it")
    _module_command(sub, "fabric-sim", "fabric_sim", "ECMP, spraying and Ethereal on a "
                    "simulated 1,024-host fat-tree: ring allreduce, all-to-all, broadcast")
    _module_command(sub, "dirfailover", "dirfailover", "the directory in use SIGKILLed during "
                    "a broadcast and during a reduce on loopback: nodes move to a standby "
                    "directory; each time with and without the kill, and the time to move over")
    _module_command(sub, "tls", "tls", "what TLS costs: loopback TCP point-to-point and "
                    "broadcast with TLS off and on, side by side")
    _module_command(sub, "compare", "compare", "one benchmark on two commits side by side, "
                    "interleaved: python -m benchmarks compare --base REV -- directory-scale")
    sub.add_parser("rayemu", help="Ray applications (RL weights, async SGD) and Ray's object store "
                   "on emulated hosts: python -m benchmarks rayemu {all,rl,sgd,collectives,sweep}")
    g = sub.add_parser("plot", help="draw PNGs of the saved results (needs matplotlib)")
    g.set_defaults(func=plot, no_save=True)
    args = p.parse_args(argv)
    console = Console()
    result = args.func(args, console)
    result.update(command=" ".join(["python -m benchmarks",
                                    *(sys.argv[1:] if argv is None else argv)]),
                  date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                  machine=_machine())
    if getattr(args, "json", False):  # (one line, for a program to read)
        print(json.dumps(result), flush=True)
    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        stem = result.pop("file_stem", None) or result["benchmark"]
        out = RESULTS / f"{stem}-{dt.date.today().isoformat()}.json"
        n = 1
        while out.exists():  # a rerun the same day keeps the earlier result beside it
            n += 1
            out = RESULTS / f"{stem}-{dt.date.today().isoformat()}-{n}.json"
        out.write_text(json.dumps(result, indent=2))
        console.print(f"saved {out.relative_to(RESULTS.parent.parent)}")
        if getattr(args, "plot", False):  # its plots beside it (`plot` redraws them all)
            from .plots import plot_file

            for made in plot_file(out, console):
                console.print(f"wrote {made.relative_to(RESULTS.parent.parent)}")
    return 0 if result.get("byte_identical", True) and result.get("ok", True) and all(
        r.get("byte_identical", True) for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
