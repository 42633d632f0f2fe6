"""Functions benchmarks run inside LocalCluster workers."""

from __future__ import annotations

import time

import numpy as np

import hoplite_gpu as hg


def put_at(name: str, nbytes: int, seed: int, at: float) -> float:
    """Put a float32 array at wall-clock time `at`; return when the put finished."""
    value = np.random.default_rng(seed).standard_normal(nbytes // 4).astype(np.float32)
    delay = at - time.time()
    if delay > 0:
        time.sleep(delay)
    hg.put(value, hg.ObjectID.from_name(name))
    return time.time()


def reduce_get(names: list[str], target: str, at: float = 0.0) -> tuple[float, float]:
    """At wall time `at`, start reduce(names) and get the result; return (start, end)."""
    delay = at - time.time()
    if delay > 0:
        time.sleep(delay)
    t0 = time.time()
    rid = hg.reduce([hg.ObjectID.from_name(n) for n in names], "sum",
                    object_id=hg.ObjectID.from_name(target))
    hg.get(rid, timeout=600)
    return t0, time.time()


def get_at(name: str, at: float = 0.0) -> tuple[float, float]:
    delay = at - time.time()
    if delay > 0:
        time.sleep(delay)
    t0 = time.time()
    hg.get(hg.ObjectID.from_name(name), timeout=600)
    return t0, time.time()


def put_then_reduce(own: str, names: list[str], target: str, nbytes: int, put_at: float,
                    reduce_at: float) -> tuple[float, float]:
    """Issue reduce(names) at `reduce_at` (before or after our own put at `put_at`),
    put our input, then get the result. Returns (our put's end, result's end)."""
    oids = [hg.ObjectID.from_name(n) for n in names]
    out = hg.ObjectID.from_name(target)
    value = np.random.default_rng(len(own)).standard_normal(nbytes // 4).astype(np.float32)
    events = sorted([(reduce_at, "reduce"), (put_at, "put")])
    put_end = 0.0
    for at, what in events:
        delay = at - time.time()
        if delay > 0:
            time.sleep(delay)
        if what == "reduce":
            hg.reduce(oids, "sum", object_id=out)
        else:
            hg.put(value, hg.ObjectID.from_name(own))
            put_end = time.time()
    hg.get(out, timeout=600)
    return put_end, time.time()


def delete_all(names: list[str]) -> None:
    for name in names:
        hg.delete(hg.ObjectID.from_name(name))


def failovers() -> list[tuple[float, float]]:
    """(pull failed, bytes flowed again) wall times of this node's failovers."""
    return [(a, b) for _, a, b in list(hg.runtime().node.failovers)]
