"""One rank of the Gloo baseline of the weight channel benchmark
(benchmarks/channel.py): torch.distributed on the CPU, rank 0 the learner,
broadcasting the state dict tensor by tensor (one `dist.broadcast` per
tensor, in order), as a learner without a weight channel would. Run inside an
emulated host's network namespace; rank 0 prints one JSON line with every
rank's start, end and CRC32 of every round (round 0 a warm-up)."""

from __future__ import annotations

import argparse
import json
import os
import time

from .payload import eth0_address
from .weights import crc, empty_like, mixed_sizes, state_dict


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--port", type=int, default=29556)
    p.add_argument("--size", type=int, required=True, help="the state dict's bytes")
    p.add_argument("--rounds", type=int, default=2, help="versions moved, the first a warm-up")
    args = p.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")  # the shaped link, never loopback
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}",
                            rank=args.rank, world_size=args.world)
    sizes = mixed_sizes(args.size)
    held = empty_like(sizes)  # (an actor's tensors, received into round after round)
    rounds = []
    for version in range(args.rounds):
        if args.rank == 0:
            held = state_dict(sizes, version)  # the learner's new weights (untimed)
        tensors = [torch.from_numpy(a) for a in held.values()]
        dist.barrier()
        start = time.time()
        for t in tensors:
            dist.broadcast(t, src=0)
        end = time.time()
        rounds.append({"start": start, "end": end, "crc": crc(held.values())})
    reports = [None] * args.world
    dist.gather_object({"rank": args.rank, "host": eth0_address(), "rounds": rounds,
                        "tensors": len(sizes)}, reports if args.rank == 0 else None, dst=0)
    if args.rank == 0:
        print(json.dumps({"ranks": reports}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
