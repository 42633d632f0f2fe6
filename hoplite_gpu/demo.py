"""`hoplite-gpu demo`: a broadcast from one worker of a local cluster to every
other, with live progress, the tree the directory built, each receiver's time,
and a yardstick that fits how the bytes moved: one local copy of the object
where receivers map the sender's pages (shared memory), the bound `S/B` where
every byte crosses the transport (B from one point-to-point get in the same
run)."""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
import zlib

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn
from rich.tree import Tree

from . import api
from .cluster import LocalCluster
from .config import available_memory, format_size
from .errors import InvalidArgument
from .ids import ObjectID


# --------------------------------------------------- run inside workers ---
def make_and_put(size: int, name: str) -> tuple[int, float]:
    """Put a deterministic array of `size` bytes; return (crc32, seconds)."""
    data = np.arange(size, dtype=np.uint64)[: size].astype(np.uint8) if size < 1024 else \
        np.frombuffer(np.random.default_rng(size).bytes(size), dtype=np.uint8)
    t0 = time.perf_counter()
    api.put(data, ObjectID.from_name(name))
    return zlib.crc32(data), time.perf_counter() - t0


def timed_get(name: str, start_at: float) -> tuple[float, float]:
    """Wait until `start_at` (wall clock), get, return (start, end) wall-clock times."""
    delay = start_at - time.time()
    if delay > 0:
        time.sleep(delay)
    t0 = time.time()
    api.get(ObjectID.from_name(name), timeout=600)
    return t0, time.time()


def delete(name: str) -> None:
    api.delete(ObjectID.from_name(name))


def checksum(name: str) -> int:
    """crc32 of a local copy; run after the timing so it does not steal CPU from it."""
    return zlib.crc32(api.get(ObjectID.from_name(name), timeout=600))


def copy_seconds(size: int, repeats: int = 3) -> float:
    """Median time of one local copy of `size` bytes (memcpy into memory
    already touched): what a receiver on this machine would pay to copy the
    object once, the yardstick for a broadcast through shared memory."""
    src = np.full(size, 7, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    dst[::4096] = 1  # (touch every page: time the copy, not the page faults)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def mapped_pulls() -> int:
    """Pulls this node made through a same-host sender's shared memory."""
    stats = api.node_stats()
    return stats["kept_mappings"] + stats["copied_from_mappings"]


# ---------------------------------------------------------- the driver ---
def _watch(name: str, receivers: list[str], size: int, stop: threading.Event, console: Console,
           received: threading.Event) -> None:
    """Poll the directory for each receiver's bytes and draw one bar each (no
    speed column: a broadcast here may end between two polls; the table
    after it has each receiver's rate)."""
    oid = ObjectID.from_name(name)
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                  console=console, transient=False) as progress:
        bars = {n: progress.add_task(f"receiver {i + 1}", total=size) for i, n in enumerate(receivers)}
        rt = api.runtime()
        while not stop.is_set():
            try:  # (briefly: the directory may be gone, e.g. after Ctrl-C; a
                # query waits timeout_s for it to come back, the blocking call
                # a grace more)
                info = rt.call(asyncio.wait_for(rt.node.query(oid), 1.0), 1.0)
            except Exception:
                info = {"holders": []}
            for h in info.get("holders", []):
                if h["node"] in bars:
                    progress.update(bars[h["node"]], completed=h["nbytes"])
            stop.wait(0.1)
        if received.is_set():  # every receiver has it all (the last poll may
            for bar in bars.values():  # have come before the last bytes)
                progress.update(bar, completed=size)


def run_demo(num_workers: int = 8, size: int = 256 << 20, repeats: int = 1,
             chunk_size: int | None = None) -> int:
    console = Console()
    errors = Console(stderr=True)  # (usage errors go where argparse's go)
    if num_workers < 2:
        errors.print("[red]the demo needs at least 2 workers (1 sender, 1 receiver)")
        return 2
    if repeats < 1:
        errors.print("[red]the demo needs at least 1 repeat")
        return 2
    free = available_memory()
    if size * 2 > free:  # (at least the sender's array and its store copy)
        errors.print(f"[red]a {format_size(size)} demo needs at least {format_size(2 * size)} "
                     f"of memory; {format_size(free)} is free. Use a smaller --size")
        return 2
    settings = {"chunk_size": chunk_size} if chunk_size else {}
    console.print(f"starting a local cluster: directory + {num_workers} worker processes ...")
    with LocalCluster(num_workers, **settings) as cluster:
        api.init(cluster.address, token=cluster.token)
        try:
            return _run(cluster, console, num_workers, size, repeats)
        finally:
            api.shutdown()


def measure_broadcast(cluster: LocalCluster, size: int, repeats: int = 1, *,
                      console: Console | None = None, tag: str = "demo",
                      warmup: bool = True) -> dict:
    """Time a point-to-point get (worker 0 -> 1) and a broadcast from worker 0 to
    every other worker, `repeats` times each, checking every copy's checksum.

    Each round deletes its objects, and an untimed warm-up round runs first:
    otherwise every round would also time the kernel handing each process fresh
    pages, which on a virtual machine can cost more than the transfer itself.
    Returns times in seconds, per-receiver (start, end) of the last broadcast,
    the directory's view of it, and whether every copy was byte-identical.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise InvalidArgument(f"repeats must be an int >= 1; got {repeats!r}")
    p2p, bcast, ok = [], [], True
    for r in range(-1 if warmup else 0, repeats):
        label = "warm-up" if r < 0 else f"{r + 1}/{repeats}"
        t_p2p, ok_p2p = _p2p_round(cluster, size, f"{tag}-p2p-{r}")
        name = f"{tag}-bcast-{r}"
        results, t_b, ok_b, info = _broadcast_round(cluster, size, name, console, label)
        ok &= ok_p2p and ok_b
        if r >= 0:
            p2p.append(t_p2p)
            bcast.append(t_b)
    return {"p2p_s": p2p, "broadcast_s": bcast, "receivers": results,
            "begin": min(res[0] for res in results), "info": info, "ok": ok}


def _p2p_round(cluster: LocalCluster, size: int, name: str) -> tuple[float, bool]:
    crc, _ = cluster.run(0, make_and_put, size, name)
    t0, t1 = cluster.run(1, timed_get, name, 0.0)
    ok = cluster.run(1, checksum, name) == crc
    cluster.run(0, delete, name)
    return t1 - t0, ok


def _broadcast_round(cluster: LocalCluster, size: int, name: str, console: Console | None,
                     label: str) -> tuple[list, float, bool, dict]:
    n, names = cluster.num_workers, cluster.node_ids
    crc, _ = cluster.run(0, make_and_put, size, name)
    stop, received, watcher = threading.Event(), threading.Event(), None
    if console is not None:
        console.print(f"broadcast {label}: {format_size(size)} from worker 0 to {n - 1} receivers")
        watcher = threading.Thread(target=_watch, args=(name, names[1:], size, stop, console,
                                                         received), daemon=True)
        watcher.start()
    start_at = time.time() + 0.2
    try:
        results = cluster.map(timed_get, [(name, start_at)] * (n - 1), workers=range(1, n))
        received.set()
    finally:
        stop.set()
        if watcher is not None:
            watcher.join(5)
    sums = cluster.map(checksum, [(name,)] * (n - 1), workers=range(1, n))
    info = api.object_info(ObjectID.from_name(name))
    cluster.run(0, delete, name)
    begin = min(res[0] for res in results)
    return results, max(res[1] for res in results) - begin, all(x == crc for x in sums), info


def _run(cluster: LocalCluster, console: Console, n: int, size: int, repeats: int) -> int:
    names = cluster.node_ids
    label = {node: ("sender" if i == 0 else f"receiver {i}") for i, node in enumerate(names)}
    t_copy = cluster.run(0, copy_seconds, size)
    m = measure_broadcast(cluster, size, repeats, console=console)
    mapped = cluster.map(mapped_pulls, [()] * (n - 1), workers=range(1, n))
    shared = all(k > 0 for k in mapped)
    begin = m["begin"]
    done = {names[i]: (t0 - begin, t1 - begin) for i, (t0, t1) in enumerate(m["receivers"], 1)}
    console.print(tree_of(m["info"].get("edges", []), names[0], done, label))
    t_p2p, t_b = statistics.median(m["p2p_s"]), statistics.median(m["broadcast_s"])
    for line in headline(n - 1, size, t_b, shared=shared, copy_s=t_copy, p2p_s=t_p2p,
                         cores=os.cpu_count() or 1, workers=n, rounds=repeats):
        console.print(line)
    console.print("all copies byte-identical: " + ("[green]yes" if m["ok"] else "[red]NO"))
    return 0 if m["ok"] else 1


def tree_of(edges: list, root: str, done: dict[str, tuple[float, float]],
            label: dict[str, str]) -> Tree:
    """The broadcast's tree from the directory's pull edges ([receiver,
    sender], in the order it named them): each receiver under the first
    sender it was named, any later ones (pieces from several holders, a
    failover) listed beside it, with the time it started and was done (from
    the first receiver's start)."""
    parent: dict[str, str] = {}
    also: dict[str, list[str]] = {}
    for receiver, sender in edges:
        if receiver not in parent:
            parent[receiver] = sender
        elif sender != parent[receiver] and sender not in also.setdefault(receiver, []):
            also[receiver].append(sender)
    children: dict[str, list[str]] = {}
    for receiver in done:  # (in receiver order)
        children.setdefault(parent.get(receiver, "?"), []).append(receiver)

    def name(node: str) -> str:
        return escape(label.get(node, node))

    def text(node: str) -> str:
        t0, t1 = done[node]
        more = f", also from {', '.join(map(name, also[node]))}" if also.get(node) else ""
        return f"{name(node)}: done after {t1 * 1e3:.1f} ms (own {(t1 - t0) * 1e3:.1f} ms{more})"

    tree = Tree(f"[bold]the tree the directory built[/bold]: {name(root)} (put the object)")
    placed: set[str] = set()

    def grow(branch: Tree, node: str) -> None:
        for child in children.get(node, []):
            if child not in placed:
                placed.add(child)
                grow(branch.add(text(child)), child)

    grow(tree, root)
    for node in done:  # (a sender the directory no longer lists, or none at all)
        if node not in placed:
            placed.add(node)
            known = f"from {name(parent[node])}" if node in parent else "its sender not listed"
            grow(tree.add(f"{text(node)} ({known})"), node)
    return tree


def headline(receivers: int, size: int, broadcast_s: float, *, shared: bool, copy_s: float,
             p2p_s: float, cores: int, workers: int, rounds: int = 1) -> list[str]:
    """What the broadcast's time means on this machine: with shared memory
    (receivers map the sender's pages, no byte moves) against one local copy
    of the object; with every byte moving between processes, against the
    bound `S/B`, B being the rate of one point-to-point get of the object.
    Times are medians over `rounds`."""
    median = f" (median of {rounds} rounds)" if rounds > 1 else ""
    took = (f"[bold]broadcast of {format_size(size)} to {receivers} receivers: every one had "
            f"it after {broadcast_s * 1e3:.1f} ms{median}")
    if shared:
        return [f"{took} = {broadcast_s / copy_s:.2f} x one local copy of it[/bold] "
                f"({copy_s * 1e3:.1f} ms, a memcpy on this machine in this run)",
                "receivers keep read-only mappings of the sender's pages (shared memory), so "
                "no byte moves; HOPLITE_SHARED_MEMORY=0 sends every byte over TCP, as between "
                "hosts, and compares with the bound instead"]
    return [f"{took} = {broadcast_s / p2p_s:.2f} x the bound S/B[/bold] ({p2p_s * 1e3:.1f} ms: "
            f"S = {format_size(size)}, B = {size / p2p_s / 1e9:.2f} GB/s, one point-to-point "
            "get in this run)",
            f"here {workers} processes share {cores} cores and every hop costs them copies, "
            "so the cores bound this ratio, not the links; `python -m benchmarks emulated` "
            "gives each host a link of its own (docs/cost-model.md)"]
