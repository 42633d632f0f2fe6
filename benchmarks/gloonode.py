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
    args = p.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")  # the shaped link, never loopback
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:29555", rank=args.rank,
                            world_size=args.world)
    if args.rank == 0:
        data = np.frombuffer(np.random.default_rng(args.size).bytes(args.size), dtype=np.uint8).copy()
    else:
        data = np.empty(args.size, dtype=np.uint8)
    tensor = torch.from_numpy(data)
    dist.barrier()
    t0 = time.time()
    dist.broadcast(tensor, src=0)
    t1 = time.time()
    dist.barrier()
    print(json.dumps({"start": t0, "end": t1, "crc": zlib.crc32(data)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
