"""One rank of the Gloo baseline (torch.distributed on the CPU), run inside an
emulated host's namespace: a broadcast of S bytes from rank 0, timed between
two barriers; prints one JSON line."""

from __future__ import annotations

import argparse
import json
import os
import time
import zlib

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--op", choices=["broadcast", "reduce", "allreduce"], default="broadcast")
    p.add_argument("--ready-after", type=float, default=0.0,
                   help="seconds after the first barrier that this rank's input becomes ready")
    args = p.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")  # the shaped link, never loopback
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:29555", rank=args.rank,
                            world_size=args.world)
    if args.op == "broadcast":
        if args.rank == 0:
            data = np.frombuffer(np.random.default_rng(args.size).bytes(args.size), dtype=np.uint8).copy()
        else:
            data = np.empty(args.size, dtype=np.uint8)
    else:
        data = np.random.default_rng(args.rank).standard_normal(args.size // 4).astype(np.float32)
    tensor = torch.from_numpy(data)
    dist.barrier()
    time.sleep(args.ready_after)
    t0 = time.time()
    if args.op == "broadcast":
        dist.broadcast(tensor, src=0)
    elif args.op == "reduce":
        dist.reduce(tensor, dst=0)
    else:
        dist.all_reduce(tensor)
    t1 = time.time()
    dist.barrier()
    check = zlib.crc32(data) if args.op == "broadcast" else (
        float(data[:4096].astype(np.float64).sum()) if args.op == "allreduce" or args.rank == 0 else None)
    print(json.dumps({"start": t0, "end": t1, "crc": check}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
