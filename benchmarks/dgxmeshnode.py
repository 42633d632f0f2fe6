"""One rank of a hoplite-gpu system on the emulated GPU mesh
(benchmarks/dgxmesh.py, run by benchmarks/dgxmeshrun.py), inside its
namespace: join the directory, make the input, form the `Group` (with the
mesh's topology and members: packed trees; without: the dynamic path), then
make one timed call per start time the harness sends, each result checked.

Protocol with the harness, one JSON line each way:
node -> {"ready": true}; then per call, harness -> {"t0": wall time to
start}, node -> {"done": k}; after the last, node -> its report (start and
end of every call, whether every result was exact, the last one's CRC32).
The node keeps serving its objects until standard input closes."""

from __future__ import annotations

import argparse
import json
import sys
import time

import hoplite_gpu as hg

from .payload import check, cpu_seconds, eth0_address, join, make_input, rank_arguments

OPS = ("broadcast", "allreduce")


def main() -> int:
    p = argparse.ArgumentParser()
    rank_arguments(p, OPS)
    p.add_argument("--topology", default=None,
                   help="the mesh's topology (JSON text): calls over its packed trees")
    p.add_argument("--members", default=None, help="each rank's node of it (a JSON list)")
    args = p.parse_args()
    join(args.address, args.token, args.node_host)
    try:
        group = _group(args)
        value = make_input(args.rank, args.size) \
            if args.op != "broadcast" or args.rank == 0 else None
        call = getattr(group, args.op)
        group.barrier()  # (forms the group: its claims are not in the first timed call)
        print(json.dumps({"ready": True}), flush=True)
        starts, ends, oks, crc, cpu_s = [], [], [], None, 0.0
        for k in range(args.iters):
            t0 = json.loads(sys.stdin.readline())["t0"]
            delay = t0 - time.time()
            if delay > 0:
                time.sleep(delay)
            cpu0, start = cpu_seconds(), time.time()
            out = call(value)
            ends.append(time.time())
            cpu_s += cpu_seconds() - cpu0  # (the calls' own, not the checks')
            starts.append(start)
            ok, crc = check(args.op, args.world, out, args.size, args.rank)
            oks.append(ok)
            out = None
            print(json.dumps({"done": k}), flush=True)
        print(json.dumps({"rank": args.rank, "starts": starts, "ends": ends,
                          "ok": all(oks) and len(oks) == args.iters, "oks": oks, "crc": crc,
                          "host": eth0_address(), "cpu_s": cpu_s}), flush=True)
        sys.stdin.read()  # keep serving our objects until the harness closes stdin
        return 0
    finally:
        hg.shutdown()


def _group(args: argparse.Namespace) -> hg.Group:
    """The group, its trees packed now (a plan is cached: the calls find it)."""
    if args.topology is None:
        return hg.Group(args.name, rank=args.rank, size=args.world, timeout=600)
    from hoplite_gpu.multitree_reduce import plan_for
    from hoplite_gpu.topology import from_json
    from hoplite_gpu.trees import pack

    topology = from_json(json.loads(args.topology), source="--topology")
    members = json.loads(args.members)
    if args.op == "broadcast":
        pack(topology, members[0], members)
    else:
        plan_for(args.op, topology, members[0], members)
    return hg.Group(args.name, rank=args.rank, size=args.world, timeout=600,
                    topology=topology, members=members)


if __name__ == "__main__":
    sys.exit(main())
