"""A broadcast that loses a relay mid-transfer, against the same broadcast without failure.

Worker 0 puts S bytes; every other worker gets it at once, so the directory
builds a chain. Bytes cross over TCP, as between hosts (with shared memory a
receiver maps or copies the object whole: no relay is ever partway). In the
failure round the driver watches the directory and kills (SIGKILL) the first
receiver it sees serving others with part of the object (nodes report their
progress every 0.1 s); the fraction it held is reported. The
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
    rows: dict[str, list[float]] = {"no_failure_s": [], "with_failure_s": [], "detect_to_resume_s": [],
                                    "killed_at_fraction": []}
    settings = {"shared_memory": False, **settings}
    with LocalCluster(workers, **settings) as c:
        hg.init(c.address, token=c.token)
        try:
            for r in range(-1, repeats):  # round -1 warms the buffer pools, untimed
                _, t_ok, ok, _ = demo._broadcast_round(c, size, f"ok{r}", None, "")
                assert ok, "failure-free broadcast corrupted"
                t_fail, resume, victim, at = _failure_round(c, size, f"fail{r}")
                console.print(f"round {r}: no failure {t_ok * 1e3:.0f} ms, killed worker {victim} "
                              f"at {at:.0%} of the object: {t_fail * 1e3:.0f} ms, detect->resume "
                              + ", ".join(f"{x * 1e3:.0f} ms" for x in resume))
                if r >= 0:
                    rows["no_failure_s"].append(t_ok)
                    rows["with_failure_s"].append(t_fail)
                    rows["detect_to_resume_s"].extend(resume)
                    rows["killed_at_fraction"].append(at)
                c.restart(victim)
        finally:
            hg.shutdown()
    med = {k: statistics.median(v) if v else None for k, v in rows.items()}
    return {"workers": workers, "size_bytes": size, "repeats": repeats, "settings": settings,
            "samples": rows, "median_s": med,
            "ratio_failure_to_no_failure": med["with_failure_s"] / med["no_failure_s"]}


def _failure_round(c: LocalCluster, size: int, name: str) -> tuple[float, list[float], int, float]:
    n = c.num_workers
    crc, _ = c.run(0, demo.make_and_put, size, name)
    before = {w: len(c.run(w, tasks.failovers)) for w in range(1, n)}
    start_at = time.time() + 0.2
    for w in range(1, n):
        c.submit(w, demo.timed_get, name, start_at)
    victim, at = _kill_a_relay_mid_transfer(c, name, size)
    survivors = [w for w in range(1, n) if w != victim]
    results = [c.result(w, 120) for w in survivors]
    sums = [c.run(w, demo.checksum, name) for w in survivors]
    if any(s != crc for s in sums):
        raise AssertionError("a survivor's copy differs from the original")
    resume = []
    for w in survivors:
        resume += [b - a for a, b in c.run(w, tasks.failovers)[before[w]:]]
    c.run(0, demo.delete, name)
    return max(r[1] for r in results) - min(r[0] for r in results), resume, victim, at


def _kill_a_relay_mid_transfer(c: LocalCluster, name: str, size: int) -> tuple[int, float]:
    """Kill the first receiver seen serving others while it holds part of the
    object (progress comes every 0.1 s: the first sighting may be early or
    late in its transfer). Returns it and the fraction it held."""
    oid = hg.ObjectID.from_name(name)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for h in hg.object_info(oid)["holders"]:
            if h["serving"] and not h["origin"] and not h["complete"] and h["nbytes"] > 0:
                victim = c.node_ids.index(h["node"])
                c.kill(victim)
                return victim, h["nbytes"] / size
        time.sleep(0.002)
    raise TimeoutError("no relay was seen partway through the object: make it larger "
                       "(--size), so that its transfer lasts several progress reports (0.1 s)")
