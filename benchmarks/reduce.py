"""Reduce on loopback.

1. Reduce of N inputs of S bytes (one per worker, all present) vs one
   point-to-point transfer of S bytes.
2. Inputs that become ready one every `gap_s` (as tasks finish): time from the
   last input's put to the complete result, for a reduce issued before the
   inputs exist (the tree grows as they arrive) vs an all-at-once reduce issued
   only after every input exists.
"""

from __future__ import annotations

import statistics
import time

from hoplite_gpu.cluster import LocalCluster

from . import tasks


def run(workers: int, size: int, repeats: int, gap_s: float, console) -> dict:
    rows: dict[str, list[float]] = {"p2p_s": [], "reduce_s": [], "dynamic_after_last_s": [],
                                    "all_at_once_after_last_s": []}
    with LocalCluster(workers) as c:
        for r in range(-1, repeats):  # round -1 warms up the nodes' buffer pools, untimed
            sample = {}
            c.run(0, tasks.put_at, f"p2p{r}", size, 0, 0.0)
            t0, t1 = c.run(1, tasks.get_at, f"p2p{r}")
            sample["p2p_s"] = t1 - t0
            names = [f"in{r}-{w}" for w in range(workers)]
            c.map(tasks.put_at, [(names[w], size, w, 0.0) for w in range(workers)])
            t0, t1 = c.run(0, tasks.reduce_get, names, f"out{r}")
            sample["reduce_s"] = t1 - t0
            sample["dynamic_after_last_s"] = staggered(c, size, gap_s, f"dyn{r}", True)
            sample["all_at_once_after_last_s"] = staggered(c, size, gap_s, f"aao{r}", False)
            c.run(0, tasks.delete_all, [f"p2p{r}", *names, f"out{r}"]
                  + [f"{t}{r}-{w}" for t in ("dyn", "aao") for w in range(workers)]
                  + [f"dyn{r}-out", f"aao{r}-out"])
            label = "warm-up" if r < 0 else f"repeat {r + 1}/{repeats}"
            console.print(f"{label}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in sample.items()))
            if r >= 0:
                for k, v in sample.items():
                    rows[k].append(v)
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"workers": workers, "size_bytes": size, "repeats": repeats, "gap_s": gap_s,
            "samples": rows, "median_s": med,
            "ratio_reduce_to_p2p": med["reduce_s"] / med["p2p_s"],
            "ratio_dynamic_to_all_at_once":
                med["dynamic_after_last_s"] / med["all_at_once_after_last_s"]}


def staggered(c: LocalCluster, size: int, gap_s: float, tag: str, dynamic: bool) -> float:
    """Workers 1..N-1 put one every gap_s, worker 0 last; worker 0 gets the result."""
    n = c.num_workers
    names = [f"{tag}-{w}" for w in range(n)]
    start = time.time() + 0.5
    last = start + gap_s * (n - 1)
    for w in range(1, n):
        c.submit(w, tasks.put_at, names[w], size, w, start + gap_s * (w - 1))
    c.submit(0, tasks.put_then_reduce, names[0], names, f"{tag}-out", size, last,
             start if dynamic else last + 0.01)
    put_ends = [c.result(w) for w in range(1, n)]
    own_put_end, result_end = c.result(0)
    return result_end - max([own_put_end, *put_ends])
