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
from .config import Config, available_memory, format_size
from .errors import HopliteError, InvalidArgument


def calibrate(large: int = 64 << 20, repeats: int = 5) -> dict[str, float]:
    small = Config.from_env().inline_threshold + 1
    least = max(1 << 20, 16 * (small - 1))  # (1 MiB with the default inline threshold)
    if large < least:
        raise InvalidArgument(f"the large transfer must be at least {least} bytes (16 x the "
                              f"small one, and 1 MiB) to tell bandwidth from latency; got {large}")
    free = available_memory()
    if 3 * large > free:  # (the sender's array, its store copy, the receiver's copy)
        raise InvalidArgument(f"a calibration with a {format_size(large)} transfer needs "
                              f"{format_size(3 * large)} of memory; {format_size(free)} is "
                              "free. Use a smaller --size")
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
    if t_large <= t_small:
        raise HopliteError(f"the {large}-byte get took no longer than the {small}-byte one "
                           f"({t_large:.3g} s against {t_small:.3g} s): the machine was too busy "
                           "to measure; use a larger --size or more --repeats")
    bandwidth = (large - small) / (t_large - t_small)
    latency = max(t_small - small / bandwidth, 1e-6)
    return {"link_latency_s": latency, "link_bytes_per_s": bandwidth,
            "small_get_s": t_small, "large_get_s": t_large}
