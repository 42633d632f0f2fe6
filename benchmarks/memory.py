"""`python -m benchmarks memory`: a reader that gets many large objects in
turn, with and without a store limit (`HOPLITE_STORE_BYTES`), side by side.

Objects stay where they are until deleted, and each copy a get pulls stays
on the reader to serve later receivers. A reader of a stream of large
objects (weights of many versions, the shards of a dataset) then grows by one
object per get. With a limit, the reader evicts its least recently used
copies that another node also holds before each new one.

This process puts `--objects` objects of `--size` MiB (the origin copies:
no limit here); one LocalCluster worker gets them one after the other, drops
each result, and reports after every get its resident memory (VmRSS) and the
get's time. Both variants run in one invocation, alternating launches, over
TCP (shared memory off, as between hosts). Printed: the reader's peak
resident memory and median get time in each variant, and their ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
import zlib

from .args import at_least

MiB = 1 << 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise LookupError(field)


def read_all(names: list[str]) -> dict:
    """Worker side: get each object in turn, keep no result; per get, its time
    and this process's resident memory afterwards."""
    import hoplite_gpu as hg

    seconds, rss, crcs = [], [], []
    for name in names:
        start = time.perf_counter()
        value = hg.get(hg.ObjectID.from_name(name), timeout=120)
        seconds.append(time.perf_counter() - start)
        crcs.append(zlib.crc32(value))
        del value
        rss.append(_status_kib("VmRSS") * 1024)
    stats = hg.node_stats()
    return {"seconds": seconds, "rss": rss, "peak": _status_kib("VmHWM") * 1024, "crcs": crcs,
            "held_bytes": stats["held_bytes"], "evicted": stats["evicted"]}


def _launch(size: int, count: int, limit: int, seed: int) -> dict:
    import numpy as np

    import hoplite_gpu as hg
    from hoplite_gpu.cluster import LocalCluster

    with LocalCluster(1, shared_memory=False, store_bytes=limit) as cluster:
        hg.init(cluster.address, token=cluster.token, shared_memory=False)
        try:
            names, crcs = [f"memory/{seed}/{i}" for i in range(count)], []
            rng = np.random.default_rng(seed)
            for name in names:
                value = rng.integers(0, 255, size, dtype=np.uint8)
                hg.put(value, hg.ObjectID.from_name(name))
                crcs.append(zlib.crc32(value))
            got = cluster.run(0, read_all, names, timeout=600)
        finally:
            hg.shutdown()
    got["byte_identical"] = got.pop("crcs") == crcs
    return got


def run(args: argparse.Namespace, console) -> dict:
    from rich.table import Table

    size, limit = args.size * MiB, args.limit * MiB
    variants = {"no limit": 0, f"limit {args.limit} MiB": limit}
    launches: dict[str, list[dict]] = {name: [] for name in variants}
    for rep in range(args.repeats):
        for name, store in variants.items():
            console.print(f"[{rep + 1}/{args.repeats}] {name}: {args.objects} gets of {args.size} MiB")
            launches[name].append(_launch(size, args.objects, store, seed=rep))
    rows = []
    for name, store in variants.items():
        runs = launches[name]
        rows.append({
            "variant": name, "store_bytes": store, "objects": args.objects, "size_bytes": size,
            "peak_rss_bytes": statistics.median(r["peak"] for r in runs),
            "final_rss_bytes": statistics.median(r["rss"][-1] for r in runs),
            "get_s_median": statistics.median(s for r in runs for s in r["seconds"]),
            "held_bytes": runs[-1]["held_bytes"], "evicted": runs[-1]["evicted"],
            "byte_identical": all(r["byte_identical"] for r in runs), "launches": runs})
    free, bounded = rows
    ratios = {"peak_rss": bounded["peak_rss_bytes"] / free["peak_rss_bytes"],
              "get_s": bounded["get_s_median"] / free["get_s_median"]}
    table = Table(title=f"a reader of {args.objects} x {args.size} MiB over loopback TCP, "
                        f"medians of {args.repeats} launches")
    for col in ("variant", "peak RSS", "RSS at the end", "get (median)", "held", "evicted",
                "identical"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in rows:
        table.add_row(r["variant"], f"{r['peak_rss_bytes'] / MiB:.0f} MiB",
                      f"{r['final_rss_bytes'] / MiB:.0f} MiB", f"{r['get_s_median'] * 1e3:.1f} ms",
                      f"{r['held_bytes'] / MiB:.0f} MiB", str(r["evicted"]), str(r["byte_identical"]))
    console.print(table)
    console.print(f"limited / unlimited: peak RSS {ratios['peak_rss']:.2f} x, "
                  f"get time {ratios['get_s']:.2f} x")
    return {"benchmark": "memory", "rows": rows, "ratios": ratios}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--objects", type=at_least(1), default=16, help="objects the reader gets in turn")
    p.add_argument("--size", type=at_least(1), default=64, help="MiB per object")
    p.add_argument("--limit", type=at_least(1), default=256,
                   help="the reader's store limit, MiB (0 would mean none)")
    p.add_argument("--repeats", type=at_least(1), default=3, help="launches of each variant")
