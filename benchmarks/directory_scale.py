"""`python -m benchmarks directory-scale`: what one event costs the directory's
state machine at a small and a ten times larger scale, side by side.

No network and no nodes: the events are fed to `Directory.handle` directly, as
the server and the simulator feed them. Each row times one kind of event (the
best of a few runs) at two scales and prints the cost per unit of work (per
event, per answered get, per cancel) at each, and their ratio: about 1 where
an event costs what it must touch itself, about 10 where it walks everything
the directory knows. (tests/test_directory_event_cost.py asserts the same
ratios stay under 4 with smaller numbers; this prints them for the record.)
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from rich.table import Table

from hoplite_gpu.directory import state as s

from .args import at_least

BIG = {"kind": "bytes", "nbytes": 1 << 20}  # never inline
ARRAY = {"kind": "numpy", "dtype": "<f4", "shape": [1 << 18], "nbytes": 1 << 20}
SCALAR = {"kind": "numpy", "dtype": "<f4", "shape": [1], "nbytes": 4}


def oid(i: int) -> bytes:
    return i.to_bytes(20, "big")


def joined(nodes: int) -> s.Directory:
    d = s.Directory()
    for i in range(nodes):
        d.handle(s.NodeJoined(f"n{i}", f"tcp://127.0.0.1:{1000 + i}", 0.0))
    return d


def put_complete(d: s.Directory, node: str, key: bytes, layout: dict = BIG) -> None:
    d.handle(s.Put(node, 1, key, layout["nbytes"], layout))
    d.handle(s.Completed(node, key))


def best_departure(d: s.Directory, pulling: bytes | None = None, workers: int = 15) -> float:
    """The least time of `workers` NodeLost events (workers that joined,
    perhaps asked for `pulling`, and left)."""
    best = float("inf")
    for r in range(workers):
        worker = f"worker-{r}"
        d.handle(s.NodeJoined(worker, "tcp://127.0.0.1:9", 0.0))
        if pulling is not None:
            d.handle(s.Locate(worker, 1, pulling))
        start = time.perf_counter()
        d.handle(s.NodeLost(worker))
        best = min(best, time.perf_counter() - start)
    return best


def node_lost_objects(n: int) -> float:
    """One NodeLost (a worker pulling one object) among `n` objects known."""
    d = joined(2)
    for i in range(n):
        put_complete(d, "n0", oid(i + 1))
    return best_departure(d, pulling=oid(1))


def node_lost_reduces(n: int) -> float:
    """One NodeLost among `n` finished reduces kept for reduced_inputs."""
    d = joined(2)
    for r in range(n):
        ins, target = (oid(10**7 + 2 * r), oid(10**7 + 2 * r + 1)), oid(r + 1)
        d.handle(s.ReduceRequested("n0", 1, target, ins, "sum", 2))
        for j, x in enumerate(ins):
            d.handle(s.Put(f"n{j}", 2, x, 4, SCALAR, b"\x00\x00\x80?"))
        d.handle(s.InlineReduced(target, b"\x00\x00\x00@"))
    return best_departure(d)


def put_to_waiters(n: int) -> float:
    """A Put answering `n` gets that waited for it, per get."""
    d, key = joined(n + 1), oid(7)
    for i in range(1, n + 1):
        d.handle(s.Locate(f"n{i}", 1, key))
    start = time.perf_counter()
    d.handle(s.Put("n0", 2, key, BIG["nbytes"], BIG))
    return (time.perf_counter() - start) / n


def gets_after_put(n: int) -> float:
    """`n` gets of one object arriving one by one after its put, per get."""
    d, key = joined(n + 1), oid(7)
    put_complete(d, "n0", key)
    start = time.perf_counter()
    for i in range(1, n + 1):
        d.handle(s.Locate(f"n{i}", 1, key))
    return (time.perf_counter() - start) / n


def gets_over_time(n: int) -> float:
    """`n` gets of one object, each pull finished before the next get comes
    (a model's weights fetched by workers over time: every finished copy is
    a sender with a free slot), per get."""
    d, key = joined(n + 1), oid(7)
    put_complete(d, "n0", key)
    took = 0.0
    for i in range(1, n + 1):
        start = time.perf_counter()
        d.handle(s.Locate(f"n{i}", 1, key))
        took += time.perf_counter() - start
        d.handle(s.Completed(f"n{i}", key))
    return took / n


def relayed_slice(n: int) -> float:
    """The gets of one relayed allreduce slice of `n` ranks, in random order, per get."""
    d = joined(n)
    inputs = [oid(100 + r) for r in range(n)]
    for r in range(n):
        put_complete(d, f"n{r}", inputs[r], ARRAY)
    target = oid(7)
    chain = tuple(inputs[(1 + i) % n] for i in range(n))
    d.handle(s.ReduceRequested("n0", 2, target, chain, "sum", n, inputs[0], relay=True))
    order = list(range(1, n))
    random.Random(n).shuffle(order)
    start = time.perf_counter()
    for r in order:
        d.handle(s.Locate(f"n{r}", 3, target))
    return (time.perf_counter() - start) / (n - 1)


def cancels(n: int) -> float:
    """`n` waits on one missing id cancelled, the latest first, per cancel."""
    d = joined(2)
    for rid in range(n):
        d.handle(s.Locate("n1", rid, b"\xee" * 20))
    start = time.perf_counter()
    for rid in reversed(range(n)):
        d.handle(s.CancelLocate("n1", rid))
    return (time.perf_counter() - start) / n


#: (what is timed, per what, the function, the small scale)
CASES: list[tuple[str, str, Callable[[int], float], int]] = [
    ("a node's loss, objects known", "event", node_lost_objects, 10_000),
    ("a node's loss, finished reduces kept", "event", node_lost_reduces, 300),
    ("a put answering waiting gets", "get", put_to_waiters, 300),
    ("gets arriving after the put", "get", gets_after_put, 300),
    ("gets over time, each pull done first", "get", gets_over_time, 300),
    ("a relayed slice's gets, ranks", "get", relayed_slice, 32),
    ("waits on one id cancelled", "cancel", cancels, 1_000),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--factor", type=at_least(2), default=10,
                   help="the larger scale is this many times the smaller (default %(default)s)")
    p.add_argument("--shrink", type=at_least(1), default=1,
                   help="divide every small scale by this (a quick run); default %(default)s")
    p.add_argument("--repeats", type=at_least(1), default=2, help="best of this many runs")


def run(args: argparse.Namespace, console) -> dict:
    rows = []
    table = Table(title=f"directory state machine: cost per unit of work at n and "
                  f"{args.factor} n (best of {args.repeats})")
    for col in ("event", "n", "per unit at n", f"{args.factor} n", "per unit there", "ratio"):
        table.add_column(col, justify="right" if col != "event" else "left")
    for label, unit, fn, small in CASES:
        n = max(4, small // args.shrink)
        big = n * args.factor
        few = min(fn(n) for _ in range(args.repeats))
        many = min(fn(big) for _ in range(args.repeats))
        rows.append({"event": label, "unit": unit, "n": n, "seconds_per_unit": few,
                     "n_large": big, "seconds_per_unit_large": many, "ratio": many / few})
        table.add_row(label, f"{n:,}", f"{few * 1e6:.1f} us/{unit}", f"{big:,}",
                      f"{many * 1e6:.1f} us/{unit}", f"{many / few:.2f}")
        console.print(f"  {label}: {many / few:.2f} x per {unit} at {big:,} against {n:,}")
    console.print(table)
    return {"benchmark": "directory-scale", "factor": args.factor, "rows": rows}
