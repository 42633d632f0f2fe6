"""One rank of the Gloo baseline (torch.distributed on the CPU), run inside an
emulated host's network namespace: after a barrier rank 0 fixes the common
start time, then the collective runs `warmup + iters` times (one call per time
slot); prints one JSON line with every rank's starts and ends (rank 0) ."""

from __future__ import annotations

import argparse
import json
import os
import time

from .payload import OPS, check, cpu_seconds, eth0_address, make_input, page_faults, plain_empty


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--port", type=int, default=29555)
    p.add_argument("--size", type=int, required=True, help="bytes per rank")
    p.add_argument("--op", choices=OPS, default="broadcast")
    p.add_argument("--iters", type=int, default=1)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--period", type=float, default=0.0)
    p.add_argument("--sync", action="store_true",
                   help="steady state: an untimed barrier and a new common start before every call")
    p.add_argument("--ready-after", type=float, default=0.0,
                   help="seconds after each slot that this rank's input becomes ready")
    args = p.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")  # the shaped link, never loopback
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank,
                            world_size=args.world)
    rank, world, n = args.rank, args.world, args.size // 4
    x = torch.from_numpy(make_input(rank, args.size)) if args.op != "broadcast" or rank == 0 else None
    work = torch.from_numpy(plain_empty(n))
    pieces = [torch.from_numpy(plain_empty(n)) for _ in range(world)] \
        if args.op == "allgather" or (args.op == "gather" and rank == 0) else None
    dist.barrier()
    t = torch.tensor([time.time() + 0.3], dtype=torch.float64)
    dist.broadcast(t, src=0)
    t0 = float(t[0])
    starts, ends, faults = [], [], []
    cpu0 = cpu_seconds()
    for k in range(args.warmup + args.iters):
        if args.op in ("reduce", "allreduce") or (args.op == "broadcast" and rank == 0):
            work.copy_(x)  # these work in place: start every call from the input
        if args.sync:
            dist.barrier()
            t = torch.tensor([time.time() + 0.05], dtype=torch.float64)
            dist.broadcast(t, src=0)
            t0 = float(t[0]) - k * args.period
        delay = t0 + k * args.period + args.ready_after - time.time()
        if delay > 0:
            time.sleep(delay)
        faults0 = page_faults()
        start = time.time()
        if args.op == "broadcast":
            dist.broadcast(work, src=0)
        elif args.op == "reduce":
            dist.reduce(work, dst=0)
        elif args.op == "allreduce":
            dist.all_reduce(work)
        elif args.op == "gather":
            dist.gather(x, gather_list=pieces, dst=0)
        else:
            dist.all_gather(pieces, x)
        end = time.time()
        if k >= args.warmup:
            starts.append(start)
            ends.append(end)
            faults.append(page_faults() - faults0)
    cpu_s = cpu_seconds() - cpu0  # every call, warm-up included
    out = [q.numpy() for q in pieces] if pieces is not None else work.numpy()
    ok, crc = check(args.op, world, out, args.size, rank)
    reports = [None] * world
    dist.gather_object({"rank": rank, "t0": t0, "starts": starts, "ends": ends, "faults": faults,
                        "ok": ok, "crc": crc, "host": eth0_address(), "cpu_s": cpu_s},
                       reports if rank == 0 else None, dst=0)
    if rank == 0:
        print(json.dumps({"ranks": reports}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
