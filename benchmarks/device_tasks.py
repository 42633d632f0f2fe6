"""Functions the device benchmark runs inside LocalCluster workers (one GPU, shared)."""

from __future__ import annotations

import time


def device_collective(op: str, tag: str, rank: int, world: int, size: int, start: float,
                      drop: str | None = None) -> dict:
    """Broadcast (rank 0 puts, everyone gets), allreduce (everyone puts, reduce,
    everyone gets) or get (rank 0 puts, rank 1 gets; the rest stand by) of
    `size` bytes of float32 CuPy data; returns when this rank has the result,
    with the seconds its put and its get took. With `drop` (the tag of the round
    before), rank 0 first deletes that round's objects, so their device memory
    goes back to each process's CuPy pool and this round reuses it, as a loop
    that replaces its objects every iteration does."""
    import cupy as cp

    import hoplite_gpu as hg

    n = size // 4
    if drop is not None and rank == 0:
        for name in [f"{drop}-in-{r}" for r in range(world)] + [f"{drop}-out"]:
            hg.delete(hg.ObjectID.from_name(name))
    value = cp.full(n, rank + 1, cp.float32)
    cp.cuda.get_current_stream().synchronize()
    ids = [hg.ObjectID.from_name(f"{tag}-in-{r}") for r in range(world)]
    out = hg.ObjectID.from_name(f"{tag}-out")
    delay = start - time.time()
    if delay > 0:
        time.sleep(delay)
    t0 = time.time()
    if op == "get" and rank > 1:
        return {"end": t0, "put_s": 0.0, "get_s": 0.0, "check": 1024.0}
    if op in ("broadcast", "get"):
        if rank == 0:
            hg.put(value, ids[0])
        t1 = time.time()
        got = value if op == "get" and rank == 0 else hg.get(ids[0], timeout=600)
    else:
        hg.put(value, ids[rank])
        t1 = time.time()
        if rank == 0:
            hg.reduce(ids, "sum", object_id=out)
        got = hg.get(out, timeout=600)
    cp.cuda.get_current_stream().synchronize()
    end = time.time()
    return {"end": end, "put_s": t1 - t0, "get_s": end - t1, "check": float(got[:1024].sum())}


class _Trace:
    """The runtime's debug log lines from now until `stop()`, as (time.time(), text)."""

    def __init__(self) -> None:
        import logging

        self.lines: list[tuple[float, str]] = []
        self.logger = logging.getLogger("hoplite_gpu")
        self.level = self.logger.level
        self.handler = logging.Handler(logging.DEBUG)
        self.handler.emit = lambda rec: self.lines.append((rec.created, rec.getMessage()))
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.DEBUG)

    def stop(self) -> list[tuple[float, str]]:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
        return self.lines


def _in_loop(rt, fn) -> None:
    """Run `fn()` on the runtime's loop thread and wait for it."""
    import threading

    done = threading.Event()

    def run() -> None:
        try:
            fn()
        finally:
            done.set()

    rt._loop.call_soon_threadsafe(run)
    done.wait(10)


def profile_put_get(rank: int, size: int, tag: str, start: float, rounds: int = 3,
                    reuse: bool = False, get_after: float = 0.0) -> dict:
    """Where a device put (rank 0) and get (rank 1) spend their time: each
    round's wall time, plus cProfile of the runtime's loop thread over the last
    round (top functions by own time; on Python 3.12 one profiler sees every
    thread), and the runtime's debug log lines of that round, timed. With
    `reuse`, rank 0 deletes each round's object before the next put, so both
    processes' CuPy pools hand the same device memory out again. Rank 1 asks
    `get_after` seconds after rank 0's put began (0: at the same time)."""
    import cProfile
    import io
    import pstats

    import cupy as cp

    import hoplite_gpu as hg

    rt = hg.runtime()
    out: dict = {"rank": rank, "rounds": []}
    cp.zeros(1).sum()  # the CUDA context and CuPy's pool exist before anything is timed
    cp.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter()
    probe = cp.empty(size, cp.uint8)  # a fresh allocation's cost
    cp.cuda.get_current_stream().synchronize()
    out["alloc_s"] = time.perf_counter() - t0
    del probe
    small = []
    for i in range(5):  # a control round trip: an inline put
        t0 = time.perf_counter()
        hg.put(bytearray(1024), hg.ObjectID.from_name(f"{tag}-small-{rank}-{i}"))
        small.append(time.perf_counter() - t0)
    out["small_put_s"] = sorted(small)[2]
    loop_prof = cProfile.Profile()
    value = cp.full(size // 4, 1, cp.float32)
    cp.cuda.get_current_stream().synchronize()
    for r in range(rounds):
        oid = hg.ObjectID.from_name(f"{tag}-{r}")
        got = None  # (rank 1: the last round's array goes back to the pool)
        if reuse and r and rank == 0:  # half-way between rounds: rank 1 has its copy
            time.sleep(max(0.0, start + r - 0.5 - time.time()))
            hg.delete(hg.ObjectID.from_name(f"{tag}-{r - 1}"))
        delay = start + r * 1.0 + (get_after if rank == 1 else 0.0) - time.time()
        if delay > 0:
            time.sleep(delay)
        if r == rounds - 1:
            _in_loop(rt, loop_prof.enable)
            trace = _Trace()
        t0 = time.perf_counter()
        if rank == 0:
            hg.put(value, oid)
        else:
            got = hg.get(oid, timeout=60)
            cp.cuda.get_current_stream().synchronize()
            assert float(got[:4].sum()) == 4.0
        out["rounds"].append(time.perf_counter() - t0)
    _in_loop(rt, loop_prof.disable)
    out["trace"] = trace.stop()
    text = io.StringIO()
    pstats.Stats(loop_prof, stream=text).sort_stats("tottime").print_stats(30)
    out["loop_profile"] = text.getvalue()[-7000:]
    return out
