"""`python -m benchmarks latency`: small-object collectives on loopback, as a
training loop calls them: every rank calls at the same moment, once per
period, and sleeps in between. Reports the per-call time (first start to last
end) and the CPU each process spends per call, directory included.

A process woken from a sleep runs the same Python far slower than in a tight
loop on some VMs, so back-to-back calls would flatter the result; the period
(50 ms by default) keeps every call cold, as in the emulated benchmark.

Each rank is a process (`python -m benchmarks.latency --rank ...`) printing one
JSON line; the directory is `python -m hoplite_gpu directory` on loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from .args import at_least, seconds

OPS = ("broadcast", "reduce", "allreduce", "gather", "allgather")


def _proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process, from /proc (Linux); None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def run(args: argparse.Namespace, console) -> dict:
    token = os.urandom(8).hex()
    env = {**os.environ, "HOPLITE_TOKEN": token}
    directory = subprocess.Popen(
        [sys.executable, "-m", "hoplite_gpu", "directory", "--port", "0", "--token", token],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    rows = []
    try:
        line = directory.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"the directory did not start: {line!r}")
        address = line.rsplit(" ", 1)[1].strip()
        for op in args.ops:
            t0 = time.time() + 3.0 + 0.2 * args.ranks  # every rank has started by then
            cpu0 = _proc_cpu_s(directory.pid)
            procs = [subprocess.Popen(
                [sys.executable, "-m", "benchmarks.latency", "--rank", str(r), "--address", address,
                 "--ranks", str(args.ranks), "--op", op, "--size", str(args.size),
                 "--calls", str(args.calls), "--warmup", str(args.warmup),
                 "--period", str(args.period), "--t0", str(t0)],
                stdout=subprocess.PIPE, text=True, env=env) for r in range(args.ranks)]
            reports = []
            try:
                for p in procs:
                    out, _ = p.communicate(timeout=60 + (args.calls + args.warmup) * args.period)
                    if p.returncode:
                        raise RuntimeError(f"a {op} rank failed (exit {p.returncode})")
                    reports.append(json.loads(out.strip().splitlines()[-1]))
            finally:  # (a rank that failed or timed out: the others go too)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait(10)
            cpu1 = _proc_cpu_s(directory.pid)
            calls = args.calls + args.warmup
            times = [max(r["ends"][k] for r in reports) - min(r["starts"][k] for r in reports)
                     for k in range(args.calls)]
            row = {"op": op, "system": "hoplite-gpu", "ranks": args.ranks, "size_bytes": args.size, "calls": args.calls,
                   "period_s": args.period, "samples_s": times,
                   "median_s": statistics.median(times), "min_s": min(times),
                   "cpu_s_per_call_rank": [r["cpu_s"] / args.calls for r in reports],
                   # the directory's whole window: rank start-up and warm-up calls included
                   "directory_cpu_s_per_call": None if cpu0 is None or cpu1 is None
                   else (cpu1 - cpu0) / calls}
            rows.append(row)
            per_rank = statistics.median(row["cpu_s_per_call_rank"])
            directory_cpu = row["directory_cpu_s_per_call"]
            console.print(f"{op} {args.size} B, {args.ranks} ranks: median {row['median_s'] * 1e3:.2f} ms "
                          f"(min {row['min_s'] * 1e3:.2f} ms); CPU per call: {per_rank * 1e3:.2f} ms "
                          "per rank" + ("" if directory_cpu is None else
                                        f", directory {directory_cpu * 1e3:.2f} ms (incl. start-up)"))
    finally:
        directory.terminate()
        directory.wait(10)
    if args.floor:
        rows += _floor(args, console, rows)
    return {"benchmark": "latency-loopback", "rows": rows}


def _floor(args: argparse.Namespace, console, rows: list[dict]) -> list[dict]:
    """The broadcast's message pattern in minimal Python, side by side (see
    benchmarks/latency_floor.py)."""
    from . import latency_floor

    ours = next((r for r in rows if r["op"] == "broadcast"), None)
    out = []
    for shape in latency_floor.SHAPES:
        row = latency_floor.run(shape, args.ranks, args.size, args.calls, args.warmup,
                                args.period)
        out.append(row)
        vs = "" if ours is None else f"; hoplite-gpu / this {ours['median_s'] / row['median_s']:.2f}"
        console.print(f"{row['system']}: broadcast {args.size} B, {args.ranks} ranks: median "
                      f"{row['median_s'] * 1e3:.2f} ms (min {row['min_s'] * 1e3:.2f} ms); CPU per "
                      f"call: {statistics.median(row['cpu_s_per_call_rank']) * 1e3:.2f} ms per "
                      f"rank{vs}")
    return out


def _rank(argv: list[str]) -> int:
    import resource

    import numpy as np

    import hoplite_gpu as hg
    from hoplite_gpu import collectives

    p = argparse.ArgumentParser()
    for name in ("--rank", "--ranks", "--size", "--calls", "--warmup"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--op", choices=OPS, required=True)
    p.add_argument("--period", type=float, required=True)
    p.add_argument("--t0", type=float, required=True)
    a = p.parse_args(argv)

    def cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    hg.init(a.address)
    value = np.full(max(1, a.size // 4), a.rank, dtype=np.float32)
    fn = getattr(collectives, a.op)
    starts, ends, cpu0 = [], [], 0.0
    try:
        for k in range(a.warmup + a.calls):
            if k == a.warmup:
                cpu0 = cpu()
            delay = a.t0 + k * a.period - time.time()
            if delay > 0:
                time.sleep(delay)
            start = time.time()
            fn(value, name=f"lat/{a.op}/{k}", rank=a.rank, size=a.ranks, timeout=30)
            starts.append(start)
            ends.append(time.time())
        used = cpu() - cpu0
        print(json.dumps({"rank": a.rank, "starts": starts[a.warmup:], "ends": ends[a.warmup:],
                          "cpu_s": used}), flush=True)
        time.sleep(0.5)  # keep serving our objects while the others finish
    finally:
        hg.shutdown()
    return 0




def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=at_least(1), default=8)
    p.add_argument("--size", type=at_least(1), default=1024, help="bytes per rank")
    p.add_argument("--ops", nargs="+", default=["broadcast"], choices=OPS)
    p.add_argument("--calls", type=at_least(1), default=60)
    p.add_argument("--warmup", type=at_least(0), default=5)
    p.add_argument("--period", type=seconds(0.0, above=True), default=0.05,
                   help="seconds between call slots")
    p.add_argument("--floor", action="store_true",
                   help="also time the broadcast's message pattern in minimal Python "
                        "(benchmarks/latency_floor.py), with hoplite-gpu's two threads per "
                        "rank and with one")


if __name__ == "__main__":
    sys.exit(_rank(sys.argv[1:]))
