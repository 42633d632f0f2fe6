"""One rank of the OpenMPI baseline (mpi4py), started by `mpirun` through a
wrapper that put it in its host's network namespace (benchmarks/mpi.py).
After a barrier rank 0 fixes the common start time; the collective (Bcast,
Reduce, Allreduce, Gather, Allgather) then runs `warmup + iters` times, one
call per time slot. Rank 0 prints one JSON line with every rank's report."""

from __future__ import annotations

import argparse
import json
import time

from .payload import OPS, check, cpu_seconds, eth0_address, make_input, page_faults, plain_empty


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--op", choices=OPS, required=True)
    p.add_argument("--run-id", default="", help="marks this run's ranks (for clean-up)")
    p.add_argument("--size", type=int, required=True, help="bytes per rank")
    p.add_argument("--iters", type=int, default=1)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--period", type=float, default=0.0)
    p.add_argument("--sync", action="store_true",
                   help="steady state: an untimed barrier and a new common start before every call")
    p.add_argument("--ready-after", default="",
                   help="comma-separated seconds after each slot that each rank's input is ready")
    args = p.parse_args()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world, n = comm.Get_rank(), comm.Get_size(), args.size // 4
    ready = [float(v) for v in args.ready_after.split(",")] if args.ready_after else [0.0] * world
    op = args.op
    x = make_input(rank, args.size) if op != "broadcast" or rank == 0 else plain_empty(n)
    out = None
    if op == "allreduce" or (op == "reduce" and rank == 0):
        out = plain_empty(n)
    elif op == "allgather" or (op == "gather" and rank == 0):
        out = plain_empty((world, n))
    comm.Barrier()
    t0 = comm.bcast(time.time() + 0.3 if rank == 0 else None, root=0)
    starts, ends, faults = [], [], []
    cpu0 = cpu_seconds()
    for k in range(args.warmup + args.iters):
        if args.sync:
            comm.Barrier()
            t0 = comm.bcast(time.time() + 0.05 if rank == 0 else None, root=0) - k * args.period
        delay = t0 + k * args.period + ready[rank] - time.time()
        if delay > 0:
            time.sleep(delay)
        faults0 = page_faults()
        start = time.time()
        if op == "broadcast":
            comm.Bcast(x, root=0)
        elif op == "reduce":
            comm.Reduce(x, out, op=MPI.SUM, root=0)
        elif op == "allreduce":
            comm.Allreduce(x, out, op=MPI.SUM)
        elif op == "gather":
            comm.Gather(x, out, root=0)
        else:
            comm.Allgather(x, out)
        end = time.time()
        if k >= args.warmup:
            starts.append(start)
            ends.append(end)
            faults.append(page_faults() - faults0)
    cpu_s = cpu_seconds() - cpu0  # every call, warm-up included
    ok, crc = check(op, world, x if op == "broadcast" else out, args.size, rank)
    report = {"rank": rank, "t0": t0, "starts": starts, "ends": ends, "faults": faults,
              "ok": ok, "crc": crc, "host": eth0_address(), "cpu_s": cpu_s}
    reports = comm.gather(report, root=0)
    if rank == 0:
        print(json.dumps({"ranks": reports, "library": MPI.Get_library_version().strip()}), flush=True)


if __name__ == "__main__":
    main()
