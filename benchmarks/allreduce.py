"""`python -m benchmarks allreduce`: a large allreduce on one machine, in a
training loop's steady state, for each `allreduce_slicing` setting side by
side.

Every rank is a LocalCluster worker on this host. Each call follows an
untimed barrier (an allgather of one element), after which rank 0 deletes the
previous call's objects, as `benchmarks/netnode.py --sync` does on the
emulated hosts. A call's time is the slowest rank's; the first call of each
launch is a warm-up and not counted. The settings take turns, launch by
launch (`--rounds`), so a slower minute of the machine hits them alike.
Every result is checked against the exact sum (the inputs are small
integers in float32).

On one host no byte crosses a network link and the CPU is the limit: this
shows what slicing costs there, and that "adaptive" does not pay it
(docs/cost-model.md, "Adaptive slicing").
"""

from __future__ import annotations

import argparse
import statistics
import time

from .args import at_least

MiB = 1 << 20


def steps(name: str, rank: int, size: int, n: int, calls: int) -> dict:
    """Worker side: `calls` allreduces of `n` float32; each one's seconds, and
    whether every result was the exact sum."""
    import numpy as np

    from hoplite_gpu import collectives

    seconds, exact = [], True
    for k in range(calls):
        collectives.allgather(np.zeros(1), name=f"{name}/sync/{k}", rank=rank, size=size,
                              timeout=120)
        if rank == 0 and k:
            collectives.delete(f"{name}/{k - 1}", size=size)
        value = np.full(n, rank + k, dtype=np.float32)
        start = time.perf_counter()
        out = collectives.allreduce(value, name=f"{name}/{k}", rank=rank, size=size, timeout=120)
        seconds.append(time.perf_counter() - start)
        exact = exact and bool((out == sum(range(size)) + size * k).all())
        del out  # a view kept would keep its buffer from the pool
    return {"seconds": seconds, "exact": exact}


def _launch(ranks: int, size: int, calls: int, slicing: str, shared_memory: bool,
            tag: str) -> dict:
    from hoplite_gpu.cluster import LocalCluster

    with LocalCluster(ranks, allreduce_slicing=slicing, shared_memory=shared_memory) as c:
        got = c.map(steps, [(f"allreduce-bench/{tag}", r, ranks, size // 4, calls)
                            for r in range(ranks)], timeout=600)
    per_call = [max(g["seconds"][k] for g in got) for k in range(1, calls)]
    return {"seconds": per_call, "exact": all(g["exact"] for g in got)}


def run(args: argparse.Namespace, console) -> dict:
    from rich.table import Table

    size = args.size * MiB
    launches: dict[str, list[dict]] = {s: [] for s in args.slicing}
    for rnd in range(args.rounds):
        for slicing in args.slicing:
            console.print(f"[{rnd + 1}/{args.rounds}] {slicing}: {args.calls} allreduces of "
                          f"{args.size} MiB among {args.ranks} ranks")
            launches[slicing].append(_launch(args.ranks, size, args.calls, slicing,
                                             args.shared_memory == "on", f"{slicing}/{rnd}"))
    rows = []
    for slicing, runs in launches.items():
        calls = [s for r in runs for s in r["seconds"]]
        rows.append({"slicing": slicing, "ranks": args.ranks, "size_bytes": size,
                     "shared_memory": args.shared_memory == "on",
                     "median_s": statistics.median(calls), "min_s": min(calls),
                     "max_s": max(calls),
                     "launch_medians_s": [statistics.median(r["seconds"]) for r in runs],
                     "byte_identical": all(r["exact"] for r in runs)})
    first = rows[0]
    table = Table(title=f"allreduce of {args.size} MiB among {args.ranks} ranks on one host "
                        f"(shared memory {args.shared_memory}): slowest rank per call")
    for col in ("slicing", "median", "launch medians", "min .. max", f"x {first['slicing']}",
                "exact"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["slicing"], f"{r['median_s'] * 1e3:.1f} ms",
                      ", ".join(f"{m * 1e3:.1f}" for m in r["launch_medians_s"]),
                      f"{r['min_s'] * 1e3:.1f} .. {r['max_s'] * 1e3:.1f} ms",
                      f"{r['median_s'] / first['median_s']:.2f}", str(r["byte_identical"]))
    console.print(table)
    return {"benchmark": "allreduce-loopback", "rows": rows,
            "file_stem": f"allreduce-loopback-{'shm' if args.shared_memory == 'on' else 'tcp'}"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=at_least(2), default=8)
    p.add_argument("--size", type=at_least(1), default=64, help="MiB per rank's array")
    p.add_argument("--calls", type=at_least(2), default=12,
                   help="calls per launch (the first untimed)")
    p.add_argument("--rounds", type=at_least(1), default=2,
                   help="launches of each setting, in turn")
    p.add_argument("--slicing", nargs="+", default=["off", "adaptive", "auto"],
                   choices=["off", "adaptive", "auto"])
    p.add_argument("--shared-memory", choices=["on", "off"], default="on")
