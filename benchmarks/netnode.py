"""One host's part in an emulated-cluster benchmark: join the directory, then
put or get, and print one JSON line of timings. Run by benchmarks/emulated runs
inside a host's network namespace."""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib

import numpy as np

import hoplite_gpu as hg


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--node-host", required=True)
    p.add_argument("--role", choices=["put", "get", "reduce", "allreduce"], required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--name", required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--start-at", type=float, default=0.0)
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--ready-at", type=float, default=0.0,
                   help="wall time this rank's input becomes ready (dynamic arrival)")
    args = p.parse_args()
    settings = {"chunk_size": args.chunk_size} if args.chunk_size else {}
    hg.init(args.address, token=args.token, node_host=args.node_host, **settings)
    oid = hg.ObjectID.from_name(args.name)
    try:
        if args.role == "put":
            data = np.frombuffer(np.random.default_rng(args.size).bytes(args.size), dtype=np.uint8)
            hg.put(data, oid)
            print(json.dumps({"crc": zlib.crc32(data)}), flush=True)
            sys.stdin.read()  # serve until the harness closes our stdin
            return 0
        if args.role in ("reduce", "allreduce"):
            return _collective(args)
        delay = args.start_at - time.time()
        if delay > 0:
            time.sleep(delay)
        t0 = time.time()
        value = hg.get(oid, timeout=600)
        t1 = time.time()
        print(json.dumps({"start": t0, "end": t1, "crc": zlib.crc32(value)}), flush=True)
        return 0
    finally:
        hg.shutdown()


def _collective(args: argparse.Namespace) -> int:
    """Every rank contributes a float32 array; reduce (result on rank 0) or allreduce."""
    from hoplite_gpu import collectives

    value = np.random.default_rng(args.rank).standard_normal(args.size // 4).astype(np.float32)
    delay = max(args.start_at, args.ready_at) - time.time()
    if delay > 0:
        time.sleep(delay)
    t0 = time.time()
    fn = collectives.allreduce if args.role == "allreduce" else collectives.reduce
    out = fn(value, name=args.name, rank=args.rank, size=args.world, timeout=600)
    t1 = time.time()
    checksum = float(out[:4096].astype(np.float64).sum()) if out is not None else None
    print(json.dumps({"start": t0, "end": t1, "check": checksum}), flush=True)
    sys.stdin.read()  # keep serving our input and partial results until told to stop
    return 0


if __name__ == "__main__":
    sys.exit(main())
