"""One host's part in an emulated-cluster benchmark of hoplite-gpu: join the
directory, make this rank's input, say ready, wait for the common start time,
run the collective `warmup + iters` times (one call per time slot), check the
result, print one JSON line, and keep serving objects until stdin closes.

Protocol with the harness (benchmarks/netbench.py), one JSON line each way:
node -> {"ready": true}; harness -> {"t0": wall time of the first slot};
node -> report (start and end of every measured call, check, crc).
Run inside a host's network namespace."""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import hoplite_gpu as hg
from hoplite_gpu import collectives

from .payload import (
    OPS,
    check,
    cpu_seconds,
    eth0_address,
    join,
    make_input,
    page_faults,
    rank_arguments,
)


def main() -> int:
    p = argparse.ArgumentParser()
    rank_arguments(p, OPS)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--period", type=float, default=0.0, help="seconds between call slots")
    p.add_argument("--ready-after", type=float, default=0.0,
                   help="seconds after each slot that this rank's input becomes ready")
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--sync", action="store_true",
                   help="steady state: an untimed barrier before every call, after which rank 0 "
                        "deletes the previous call's objects (as a training loop would)")
    p.add_argument("--group", action="store_true",
                   help="call the collective on a `hoplite_gpu.Group`, which frees each call's "
                        "objects itself (no delete in this script)")
    args = p.parse_args()
    settings = {"chunk_size": args.chunk_size} if args.chunk_size else {}
    init_retries = join(args.address, args.token, args.node_host, **settings)
    try:
        value = make_input(args.rank, args.size) if args.op != "broadcast" or args.rank == 0 else None
        group = hg.Group(args.name, rank=args.rank, size=args.world, timeout=600) if args.group else None
        fn = _group_call(group, args.op) if group else getattr(collectives, args.op)
        if args.op == "reduce":
            # Every rank returns once the reduce is done, as MPI_Reduce and Gloo's
            # reduce do; inputs are then lent, not copied.
            fn = functools.partial(fn, wait=True)
        print(json.dumps({"ready": True}), flush=True)
        t0 = json.loads(sys.stdin.readline())["t0"]
        starts, ends, faults, out = [], [], [], None
        cpu0 = cpu_seconds()
        for k in range(args.warmup + args.iters):
            if args.sync:
                out = None  # our view of the last result: its buffer can then be reused
                t0 = (_group_barrier(group) if group else _barrier(args, k)) - k * args.period
            delay = t0 + k * args.period + args.ready_after - time.time()
            if delay > 0:
                time.sleep(delay)
            faults0 = page_faults()
            start = time.time()
            out = fn(value, name=f"{args.name}/{k}", rank=args.rank, size=args.world, timeout=600)
            end = time.time()
            if k >= args.warmup:
                starts.append(start)
                ends.append(end)
                faults.append(page_faults() - faults0)
        cpu_s = cpu_seconds() - cpu0  # every call, warm-up included
        ok, crc = check(args.op, args.world, out, args.size, args.rank)
        print(json.dumps({"rank": args.rank, "t0": t0, "starts": starts, "ends": ends, "faults": faults,
                          "ok": ok, "crc": crc, "host": eth0_address(), "cpu_s": cpu_s,
                          "init_retries": init_retries,
                          "pool_hits": hg.api.runtime().node.store.pool.hits,
                          **_sent()}), flush=True)
        sys.stdin.read()  # keep serving our objects until the harness closes stdin
        return 0
    finally:
        hg.shutdown()


def _sent() -> dict:
    """What this node's data server sent over the transport (bytes of
    objects, not counting TCP's own resends) and its pulls that resumed at
    another sender: beside a link's byte counters, they tell the runtime's
    re-sent bytes from TCP's."""
    stats = hg.node_stats()
    return {"bytes_sent": sum(stats["bytes_sent_by_address"].values()),
            "failovers": stats["failovers"]}


def _group_call(group, op: str):
    """`op` on the group, called as the name-based collectives are."""
    method = getattr(group, op)

    def call(value, *, name, rank, size, timeout, wait=False):
        return method(value)
    return call


def _group_barrier(group) -> float:
    """Untimed, on the group: wait until every rank has finished the last
    call and agree on when the next starts (the group frees what it may)."""
    import numpy as np

    group.barrier()
    start = np.array([time.time() + 0.05]) if group.rank == 0 else None
    return float(group.broadcast(start)[0])


def _barrier(args: argparse.Namespace, k: int) -> float:
    """Untimed: wait until every rank has finished call k-1, free that call's
    objects (rank 0), and agree on when call k starts."""
    import numpy as np

    sync = f"{args.name}/sync/{k}"
    collectives.allgather(np.zeros(1), name=sync, rank=args.rank, size=args.world, timeout=600)
    start = None
    if args.rank == 0:
        if k:
            collectives.delete(f"{args.name}/{k - 1}", size=args.world)
        start = np.array([time.time() + 0.05])
    start = collectives.broadcast(start, name=f"{sync}/t", rank=args.rank, size=args.world,
                                  timeout=600)
    return float(start[0])


if __name__ == "__main__":
    sys.exit(main())
