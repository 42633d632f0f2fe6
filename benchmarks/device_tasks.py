"""Functions the device benchmark runs inside LocalCluster workers (one GPU, shared)."""

from __future__ import annotations

import time


def device_collective(op: str, tag: str, rank: int, world: int, size: int, start: float) -> dict:
    """Broadcast (rank 0 puts, everyone gets) or allreduce (everyone puts, reduce, everyone
    gets) of `size` bytes of float32 CuPy data; returns when this rank has the result."""
    import cupy as cp

    import hoplite_gpu as hg

    n = size // 4
    value = cp.full(n, rank + 1, cp.float32)
    cp.cuda.get_current_stream().synchronize()
    ids = [hg.ObjectID.from_name(f"{tag}-in-{r}") for r in range(world)]
    out = hg.ObjectID.from_name(f"{tag}-out")
    delay = start - time.time()
    if delay > 0:
        time.sleep(delay)
    if op == "broadcast":
        if rank == 0:
            hg.put(value, ids[0])
        got = hg.get(ids[0], timeout=600)
    else:
        hg.put(value, ids[rank])
        if rank == 0:
            hg.reduce(ids, "sum", object_id=out)
        got = hg.get(out, timeout=600)
    cp.cuda.get_current_stream().synchronize()
    end = time.time()
    return {"end": end, "check": float(got[:1024].sum())}
