"""Estimate the cost model's latency L and bandwidth B from two measured gets.

A get of a small object (one chunk, just above the inline threshold) costs about
L + s/B; a get of a large one about L + S/B. Two medians give both unknowns.
This measures the path between two processes of this machine over the
transport (loopback), with shared memory off: a same-host mapping moves no
bytes and would pass for a link of tens of GB/s. On a cluster, run it between
two hosts by hand or set the values from the network's specifications.
"""

from __future__ import annotations

import statistics

from . import demo
from .cluster import LocalCluster
from .config import Config


def calibrate(large: int = 64 << 20, repeats: int = 5) -> dict[str, float]:
    small = Config.from_env().inline_threshold + 1
    times: dict[int, list[float]] = {small: [], large: []}
    with LocalCluster(2, shared_memory=False) as cluster:
        for r in range(-1, repeats):  # round -1 warms up, untimed
            for size in (small, large):
                name = f"calibrate-{size}-{r}"
                cluster.run(0, demo.make_and_put, size, name)
                t0, t1 = cluster.run(1, demo.timed_get, name, 0.0)
                cluster.run(0, demo.delete, name)
                if r >= 0:
                    times[size].append(t1 - t0)
    t_small, t_large = statistics.median(times[small]), statistics.median(times[large])
    bandwidth = (large - small) / max(t_large - t_small, 1e-9)
    latency = max(t_small - small / bandwidth, 1e-6)
    return {"link_latency_s": latency, "link_bytes_per_s": bandwidth,
            "small_get_s": t_small, "large_get_s": t_large}
