"""A broadcast that loses a relay halfway, against the same broadcast without failure.

Worker 0 puts S bytes; every other worker gets it at once, so the directory
builds a chain. In the failure round the driver watches the directory and, once
a receiver that others pull from holds half the object, kills it (SIGKILL). The
survivors' time is compared with a failure-free round, and each survivor's
detection-to-resume time (its pull failing -> bytes flowing from a new sender)
is reported. The killed worker is restarted between rounds, as a task system
would restart it.
"""

from __future__ import annotations

import statistics
import time

import hoplite_gpu as hg
from hoplite_gpu import demo
from hoplite_gpu.cluster import LocalCluster

from . import tasks


def run(workers: int, size: int, repeats: int, console, **settings) -> dict:
    rows: dict[str, list[float]] = {"no_failure_s": [], "with_failure_s": [], "detect_to_resume_s": []}
    with LocalCluster(workers, **settings) as c:
        hg.init(c.address, token=c.token)
        try:
            for r in range(-1, repeats):  # round -1 warms the buffer pools, untimed
                _, t_ok, ok, _ = demo._broadcast_round(c, size, f"ok{r}", None, "")
                assert ok, "failure-free broadcast corrupted"
                t_fail, resume, victim = _failure_round(c, size, f"fail{r}")
                console.print(f"round {r}: no failure {t_ok * 1e3:.0f} ms, killed worker {victim} "
                              f"halfway: {t_fail * 1e3:.0f} ms, detect->resume "
                              + ", ".join(f"{x * 1e3:.0f} ms" for x in resume))
                if r >= 0:
                    rows["no_failure_s"].append(t_ok)
                    rows["with_failure_s"].append(t_fail)
                    rows["detect_to_resume_s"].extend(resume)
                c.restart(victim)
        finally:
            hg.shutdown()
    med = {k: statistics.median(v) if v else None for k, v in rows.items()}
    return {"workers": workers, "size_bytes": size, "repeats": repeats, "settings": settings,
            "samples": rows, "median_s": med,
            "ratio_failure_to_no_failure": med["with_failure_s"] / med["no_failure_s"]}


def _failure_round(c: LocalCluster, size: int, name: str) -> tuple[float, list[float], int]:
    n = c.num_workers
    crc, _ = c.run(0, demo.make_and_put, size, name)
    before = {w: len(c.run(w, tasks.failovers)) for w in range(1, n)}
    start_at = time.time() + 0.2
    for w in range(1, n):
        c.submit(w, demo.timed_get, name, start_at)
    victim = _kill_a_relay_halfway(c, name, size)
    survivors = [w for w in range(1, n) if w != victim]
    results = [c.result(w, 120) for w in survivors]
    sums = [c.run(w, demo.checksum, name) for w in survivors]
    if any(s != crc for s in sums):
        raise AssertionError("a survivor's copy differs from the original")
    resume = []
    for w in survivors:
        resume += [b - a for a, b in c.run(w, tasks.failovers)[before[w]:]]
    c.run(0, demo.delete, name)
    return max(r[1] for r in results) - min(r[0] for r in results), resume, victim


def _kill_a_relay_halfway(c: LocalCluster, name: str, size: int) -> int:
    oid = hg.ObjectID.from_name(name)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        info = hg.object_info(oid)
        for h in info["holders"]:
            if h["serving"] and not h["origin"] and not h["complete"] and h["nbytes"] >= size // 2:
                victim = c.node_ids.index(h["node"])
                c.kill(victim)
                return victim
        time.sleep(0.002)
    raise TimeoutError("no relay reached half of the object")
