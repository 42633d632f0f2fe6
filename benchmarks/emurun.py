"""`python -m benchmarks emulated`: every (op, size, system) on the emulated
hosts, a summary with medians, spreads, bounds and ratios between systems, and
a table.

The result file's keys:

- `benchmark`: `collectives-emulated`, or `allreduce-dynamic-emulated` when
  that is the only op; `command`, `date`, `machine`: how, when and where.
- `settings`: `hosts`, `bandwidth_bps` (B), `measured_link_bps`,
  `sizes_bytes`, `ops`, `systems`, `repeats`, `iters`, `warmup`,
  `steady_calls` (0: first calls), `latency_max_bytes`, `gap_s`, `openmpi`
  (`version`, `mca_both`, `mca_tuned`), `gloo`.
- `rows`: one per launch: `system`, `op`, `hosts`, `size_bytes`,
  `samples_s` (every timed call), `seconds` (their median),
  `lower_bound_s`, `ratio_to_bound`, `crc`, link bytes and packets
  (`link_bytes_hosts`: each host's [downlink, uplink]), `cpu` (busy shares
  of all cores during the timed calls), `cpu_s_per_call`, `page_faults` per
  call; with `--timeline`, every host's link use every 20 ms
  (`link_timeline`); per system and op a few more (`init_retries`, `mca`,
  `gap_s`, `seconds_total`).
- `summary`: one per (op, size, system), every call of every launch
  pooled: `n`, `launches`, `median_s`, `min_s`, `max_s`, `p25_s`, `p75_s`
  (inclusive quartiles), `stdev_s`, `lower_bound_s`, `ratio_to_bound`,
  `cpu_busy`, `cpu_s_per_call`, `ratio_to` (`{other system: median /
  other's median}`).
- `skipped`: (op, size) pairs not run, with the reason (memory).
- `failed`: launches that failed every attempt (`--retries`), with each
  attempt's error; the command then exits 1.
- `byte_identical`: every launch ran and every result was right.
"""

from __future__ import annotations

import argparse
import functools
import re
import signal
import statistics
import subprocess
import time
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from hoplite_gpu.config import available_memory, format_size

from .netbench import DEFAULT_SYSTEMS, SYSTEMS, lower_bound

QUICK_SIZES = ["1K", "64M", "256M"]
FULL_SIZES = ["1K", "32K", "1M", "16M", "64M", "256M", "1G"]
OPS = ["broadcast", "reduce", "allreduce", "gather", "allgather"]
# star: hoplite-gpu with fan-out N-1, a naive broadcast. For gather hoplite-gpu's
# schedule is already a star (one receiver per object) and reduces have no fan-out.
STAR_OPS = {"broadcast"}
_UNITS = {"": 1 << 20, "K": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GIB": 1 << 30, "B": 1}


def parse_size(text: str) -> int:
    """'1K', '64M', '256MiB', '1G' (binary units); a bare number is MiB."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 1K, 64M, 1G)")
    size = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if size < 4 or size % 4:
        raise argparse.ArgumentTypeError(f"size must be a positive multiple of 4 bytes: {text!r}")
    return size


def human(size: int) -> str:
    return format_size(size)


def fmt_s(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.3f} s"


def footprint(op: str, size: int, hosts: int) -> int:
    """Bytes all ranks hold at once (inputs, results, hoplite's store copies)."""
    per = {"broadcast": 2, "reduce": 3, "allreduce": 3, "allreduce-dynamic": 3,
           "gather": 2, "allgather": hosts + 1}[op] * size * hosts
    if op == "gather":
        per += (hosts - 1) * size
    return int(per * 1.1) + hosts * (200 << 20)


#: what a failed launch raises: it is said, kept in the row, and retried
LAUNCH_ERRORS = (RuntimeError, AssertionError, subprocess.SubprocessError, ValueError,
                 OSError, TimeoutError)


def launch_with_retries(retries: int, tag: str, launch: Callable[..., dict],
                        say: Callable[[str], object] | None = None,
                        ) -> tuple[dict | None, list[str]]:
    """`launch(tag=...)`'s row, tried `1 + retries` times (tag `{tag}-{attempt}`);
    each failed attempt's error kept in order (as the row's `failed_attempts`,
    or returned with None once every attempt failed) and told to `say`."""
    errors: list[str] = []
    for attempt in range(1 + retries):
        try:
            row = launch(tag=f"{tag}-{attempt}")
        except LAUNCH_ERRORS as exc:
            errors.append(f"{type(exc).__name__}: {str(exc)[-600:]}")
            if say is not None:
                say(f"[red]{tag}: attempt {attempt + 1} failed: {errors[-1][:300]}[/]")
            continue
        row["failed_attempts"] = errors
        return row, errors
    return None, errors


def _stop_on_signals() -> None:
    """SIGTERM, and SIGINT even where a background shell ignores it, raise
    KeyboardInterrupt, so the namespaces and every started process are cleaned up."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)


def run(args: argparse.Namespace, console: Console) -> dict:
    from .emulated import EmulatedCluster

    _stop_on_signals()
    sizes = [parse_size(s) for s in FULL_SIZES] if args.full else list(args.sizes)
    systems = list(dict.fromkeys(args.systems))
    mpi_version = None
    if any(s.startswith("openmpi") for s in systems):
        from .mpi import ensure_mpi

        mpi_version = ensure_mpi(log=console.print)
    rows: list[dict] = []
    skipped: list[dict] = []
    failed: list[dict] = []
    with EmulatedCluster(args.hosts, args.gbit * 1e9) as cluster:
        if cluster.swept:
            console.print(f"removed {len(cluster.swept)} namespaces left by an earlier run that was "
                  f"killed: {', '.join(cluster.swept)}")
        link = cluster.measure_link()
        console.print(f"{args.hosts} hosts, links shaped to {args.gbit:g} Gbit/s "
                      f"(measured host 0 -> 1: {link / 1e9:.3f} Gbit/s)")
        for op in args.ops:
            for size in sizes:
                small = size <= args.latency_max and op != "allreduce-dynamic"
                need = footprint(op, size, args.hosts)
                if need > 0.85 * available_memory():
                    why = (f"needs about {need / 2**30:.1f} GiB, {available_memory() / 2**30:.1f} GiB "
                           f"available")
                    console.print(f"[yellow]skipped {op} {human(size)}: {why}[/]")
                    skipped.append({"op": op, "size_bytes": size, "reason": why})
                    continue
                names = [s for s in systems if s != "star" or op in STAR_OPS]
                launches = 1 if small or args.steady else args.repeats
                for r in range(launches):
                    for system in names:  # systems interleaved, so drift hits all alike
                        t = time.monotonic()
                        row, errors = launch_with_retries(
                            args.retries, f"{op}-{size}-{r}-{system}",
                            functools.partial(_measure, cluster, system, op, size, args=args),
                            console.print)
                        if row is None:
                            failed.append({"system": system, "op": op, "size_bytes": size,
                                           "launch": r, "errors": errors})
                            continue
                        row.update(measured_link_bps=link, launch=r,
                                   launch_wall_s=time.monotonic() - t)
                        row.pop("start_max", None)
                        row.pop("end_max", None)
                        row.pop("start_min", None)
                        rows.append(row)
                        _say(console, row, args)
    summary = summarize(rows)
    console.print(table(summary, args.hosts, args.gbit), width=max(console.width, 150))
    from .mpi import TRANSPORT_MCA, TUNED_MCA

    settings = {"hosts": args.hosts, "bandwidth_bps": args.gbit * 1e9, "measured_link_bps": link,
                "sizes_bytes": sizes, "ops": args.ops, "systems": systems,
                "repeats": args.repeats, "iters": args.iters, "warmup": args.warmup,
                "steady_calls": args.steady,
                "latency_max_bytes": args.latency_max, "gap_s": args.gap,
                "openmpi": {"version": mpi_version, "mca_both": TRANSPORT_MCA,
                            "mca_tuned": TUNED_MCA} if mpi_version else None,
                "gloo": "torch.distributed defaults, GLOO_SOCKET_IFNAME=eth0"}
    dynamic_only = args.ops == ["allreduce-dynamic"]
    return {"benchmark": "allreduce-dynamic-emulated" if dynamic_only else "collectives-emulated",
            "file_stem": args.tag, "settings": settings, "rows": rows, "summary": summary,
            "skipped": skipped, "failed": failed,
            # (a wrong result is not retried away: one attempt's is enough)
            "byte_identical": not failed and not any(
                "wrong result" in e for r in rows for e in r["failed_attempts"])}


def _measure(cluster, system: str, op: str, size: int, tag: str, args: argparse.Namespace) -> dict:
    from .netbench import dynamic_allreduce, run_launch

    if op == "allreduce-dynamic":
        return dynamic_allreduce(cluster, size, args.gap, system, tag, steady=args.steady,
                                 timeline=args.timeline)
    if size <= args.latency_max:
        bound = lower_bound(op, size, args.hosts, args.gbit * 1e9)
        period = max(args.period, 12 * bound)
        iters = min(args.iters, max(5, int(args.latency_budget / period)))
        return run_launch(cluster, system, op, size, tag=tag, iters=iters, warmup=args.warmup,
                          period=period)
    if args.steady:  # one launch: a warm-up call, then the timed calls, each after a barrier
        return run_launch(cluster, system, op, size, tag=tag, iters=args.steady, warmup=1,
                          sync=True, timeline=args.timeline)
    return run_launch(cluster, system, op, size, tag=tag, timeline=args.timeline)


def _say(console: Console, row: dict, args: argparse.Namespace) -> None:
    what = f"{row['system']}: {row['op']} {human(row['size_bytes'])}, {row['hosts']} hosts"
    if row["op"] == "allreduce-dynamic":
        console.print(f"{what}: inputs {args.gap:g} s apart: {fmt_s(row['seconds'])} after the last input "
                      f"({row['ratio_to_bound']:.2f} x S/B)")
    elif row["iters"] > 1:
        console.print(f"{what}: median of {row['iters']} calls {fmt_s(row['seconds'])} "
                      f"(min {fmt_s(min(row['samples_s']))}, max {fmt_s(max(row['samples_s']))}"
                      f"{', ' + str(row['late_calls']) + ' started late' if row['late_calls'] else ''})")
    else:
        console.print(f"{what}: {fmt_s(row['seconds'])} = {row['ratio_to_bound']:.2f} x bound")
    if row.get("link_use_up_mean"):
        console.print("  uplink use per timed call, mean over hosts (least host): " + ", ".join(
            f"{m:.0%} ({n:.0%})" for m, n in zip(row["link_use_up_mean"], row["link_use_up_min"],
                                                   strict=True)))


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (op, size, system): every measured call pooled over launches."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["size_bytes"], r["system"]), []).append(r)
    out = []
    for (op, size, system), rs in groups.items():
        samples = [s for r in rs for s in r["samples_s"]]
        # ("inclusive": quartiles within the calls, also for 2 or 3 of them)
        q = (statistics.quantiles(samples, n=4, method="inclusive") if len(samples) > 1
             else [samples[0]] * 3)
        med = statistics.median(samples)
        out.append({"system": system, "op": op, "hosts": rs[0]["hosts"], "size_bytes": size,
                    "bandwidth_bps": rs[0]["bandwidth_bps"], "launches": len(rs), "n": len(samples),
                    "median_s": med, "min_s": min(samples), "max_s": max(samples),
                    "p25_s": q[0], "p75_s": q[2],
                    "stdev_s": statistics.stdev(samples) if len(samples) > 1 else 0.0,
                    "lower_bound_s": rs[0]["lower_bound_s"],
                    "ratio_to_bound": med / rs[0]["lower_bound_s"],
                    "cpu_busy": statistics.median(busy) if (busy := [
                        r["cpu"]["busy"] for r in rs if r.get("cpu")]) else None,
                    "cpu_s_per_call": statistics.median(cs) if (cs := [
                        r["cpu_s_per_call"] for r in rs if r.get("cpu_s_per_call") is not None])
                    else None})
    for e in out:
        e["ratio_to"] = {o["system"]: e["median_s"] / o["median_s"] for o in out
                         if (o["op"], o["size_bytes"]) == (e["op"], e["size_bytes"])
                         and o["system"] != e["system"]}
    return out


def table(summary: list[dict], hosts: int, gbit: float) -> Table:
    t = Table(title=f"{hosts} emulated hosts, {gbit:g} Gbit/s links: medians over every call "
                    f"(x sys = this time / that system's time; > 1: that system is faster)")
    for col in ("op", "size", "system", "n", "median", "min .. max", "bound", "x bound",
                "x hoplite-gpu", "x openmpi-tuned", "x gloo", "CPU busy", "CPU s/call"):
        t.add_column(col, justify="right", no_wrap=True)
    order = {s: i for i, s in enumerate(SYSTEMS)}
    for e in sorted(summary, key=lambda e: (OPS.index(e["op"]) if e["op"] in OPS else 99,
                                            e["size_bytes"], order.get(e["system"], 99))):
        t.add_row(e["op"], human(e["size_bytes"]), e["system"], str(e["n"]), fmt_s(e["median_s"]),
                  f"{fmt_s(e['min_s'])} .. {fmt_s(e['max_s'])}", fmt_s(e["lower_bound_s"]),
                  f"{e['ratio_to_bound']:.2f}",
                  *(f"{e['ratio_to'][s]:.2f}" if s in e["ratio_to"] else "-"
                    for s in ("hoplite-gpu", "openmpi-tuned", "gloo")),
                  "-" if e.get("cpu_busy") is None else f"{e['cpu_busy']:.0%}",
                  "-" if e.get("cpu_s_per_call") is None else f"{e['cpu_s_per_call']:.3g}")
    return t


def add_arguments(e: argparse.ArgumentParser) -> None:
    e.add_argument("--hosts", type=int, default=8)
    e.add_argument("--gbit", type=float, default=1.0)
    e.add_argument("--sizes", nargs="+", type=parse_size,
                   default=[parse_size(s) for s in QUICK_SIZES],
                   help="per-rank sizes with binary units: 1K 64M 256M 1G (a bare number is MiB); "
                        f"default {' '.join(QUICK_SIZES)}")
    e.add_argument("--full", action="store_true", help=f"sizes {' '.join(FULL_SIZES)}")
    e.add_argument("--steady", type=int, default=0, metavar="CALLS",
                   help="large sizes: one launch per system with a warm-up call and CALLS timed "
                        "calls, each after an untimed barrier, buffers reused between calls (a "
                        "training loop's steady state; hoplite-gpu deletes the previous call's "
                        "objects); default: --repeats fresh launches of one call each")
    e.add_argument("--repeats", type=int, default=3,
                   help="launches per (op, size, system) above --latency-max")
    e.add_argument("--iters", type=int, default=50,
                   help="timed calls in one launch for sizes up to --latency-max")
    e.add_argument("--warmup", type=int, default=5, help="untimed calls first (small sizes)")
    e.add_argument("--latency-max", type=parse_size, default=parse_size("1M"),
                   help="sizes up to this are timed as many calls in one launch (latency)")
    e.add_argument("--period", type=float, default=0.05,
                   help="least seconds between the start slots of two calls (small sizes)")
    e.add_argument("--latency-budget", type=float, default=5.0,
                   help="seconds of call slots per launch at most (small sizes)")
    e.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), choices=SYSTEMS,
                   help="default: every system but the hoplite-gpu variants: hoplite-gpu-ucx "
                        "(over UCX's tcp), hoplite-gpu-sliced (allreduce always sliced), "
                        "hoplite-gpu-whole (allreduce never sliced) and hoplite-gpu-loop "
                        "(direct calls off)")
    e.add_argument("--ops", nargs="+", default=OPS, choices=[*OPS, "allreduce-dynamic"])
    e.add_argument("--gap", type=float, default=0.5,
                   help="seconds between inputs becoming ready (allreduce-dynamic)")
    e.add_argument("--retries", type=int, default=1,
                   help="relaunches of a launch that failed (its error is kept in the row)")
    e.add_argument("--timeline", action="store_true",
                   help="large sizes and allreduce-dynamic: sample every link's byte counters "
                        "every 20 ms during the launch and save each host's uplink and "
                        "downlink use over the timed calls (row fields link_timeline, "
                        "link_use_up_mean, link_use_up_min; plotted by 'plot')")
    e.add_argument("--tag", default=None,
                   help="results file name stem (default: the benchmark name)")
