"""Asynchronous SGD with a parameter server: every step, N workers compute a
gradient (after a random delay, as real tasks finish unevenly); the server
reduces the first K that are ready and publishes new weights. hoplite-gpu's
subset reduce + weight channel beside Ray's `ray.wait(num_returns=K)` + sum in
the server + `ray.put` of the weights. With --kill, a worker is killed halfway
and the job goes on with the others.

    python examples/async_sgd.py --workers 6 --k 4 --size-mib 16 --steps 8

`run` also places the server (the driver) on emulated host 0 and the workers on
the other hosts (benchmarks/rayemu.py, `python -m benchmarks.rayemu sgd`).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import time
import uuid

import numpy as np
from common import local_ray, on_host, ray, report, summary

import hoplite_gpu as hg
import hoplite_gpu.ray as hray
from hoplite_gpu.channel import WeightChannel

LR = 0.1


def gradient(rank: int, step: int, n: int) -> np.ndarray:
    return np.full(n, (rank + 1) * 1e-3, dtype=np.float32) * (step + 1)


def _expected_update(ranks, step: int) -> float:
    """What the sum of these ranks' gradients holds in every element."""
    return float(sum(gradient(r, step, 1)[0] for r in ranks))


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self, rank: int, n: int, max_delay: float, channel: str) -> None:
        hray.join()
        self.rank, self.n, self.max_delay = rank, n, max_delay
        self.rng = random.Random(rank)
        self.channel = WeightChannel(channel)

    def step_hoplite(self, step: int) -> None:
        self.channel.fetch(newer_than=step - 1, timeout=300)  # the weights of this step
        time.sleep(self.rng.uniform(0, self.max_delay))  # "compute"
        hg.put(gradient(self.rank, step, self.n), hg.ObjectID.from_name(f"grad/{step}/{self.rank}"))

    def step_ray(self, step: int, weights: list) -> np.ndarray:
        ray.get(weights[0])
        time.sleep(self.rng.uniform(0, self.max_delay))
        return gradient(self.rank, step, self.n)


def make_workers(count: int, n: int, max_delay: float, hosts: int | None = None,
                 channel: str = "sgd") -> list:
    """`count` workers; with `hosts`, worker r sits on emulated host 1 + r mod (hosts - 1)."""
    workers = [Worker.options(**on_host(1 + r % (hosts - 1) if hosts else None)).remote(r, n, max_delay, channel)
               for r in range(count)]
    ray.get([w.__ray_ready__.remote() for w in workers])
    return workers


def run_hoplite(workers, n: int, k: int, steps: int, kill_at: int | None,
                channel: str) -> tuple[list[float], float]:
    """Each step's time (until the first K gradients are reduced and the new
    weights are out), and the seconds the loop took from step 1 on, waits
    for stragglers included."""
    channel, w = WeightChannel(channel), np.zeros(n, dtype=np.float32)
    channel.publish({"w": w}, version=0)
    times, loop_start = [], 0.0
    for step in range(steps):
        t0 = time.perf_counter()
        loop_start = t0 if step == 1 else loop_start
        calls = [wk.step_hoplite.remote(step) for wk in workers]
        if kill_at == step:
            time.sleep(0.01)
            ray.kill(workers.pop())
            calls.pop()
            print(f"hoplite-gpu step {step}: killed a worker; {len(workers)} go on")
        ids = [hg.ObjectID.from_name(f"grad/{step}/{r}") for r in range(len(workers) + (kill_at == step))]
        rid = hg.reduce(ids, "sum", num_objects=min(k, len(workers)),
                        object_id=hg.ObjectID.from_name(f"grad/{step}/sum"))
        update = hg.get(rid, timeout=300)
        w = w - LR * update
        channel.publish({"w": w}, version=step + 1)
        times.append(time.perf_counter() - t0)
        chosen = [ids.index(i) for i in hg.reduced_inputs(rid)]
        # (every element: the reduce is pipelined chunk by chunk)
        assert np.allclose(update, _expected_update(chosen, step), rtol=1e-5), "wrong reduce"
        del update  # a view of the result's copy in this node's store, freed next
        ray.get(calls, timeout=300)  # let stragglers finish before the next step
        for oid in [*ids, rid]:  # the gradients of this step are spent: free every copy
            hg.delete(oid)
    return times, time.perf_counter() - loop_start


def run_ray(workers, n: int, k: int, steps: int, kill_at: int | None) -> tuple[list[float], float]:
    """As `run_hoplite`, with Ray's object store."""
    w = np.zeros(n, dtype=np.float32)
    times, loop_start = [], 0.0
    for step in range(steps):
        t0 = time.perf_counter()
        loop_start = t0 if step == 1 else loop_start
        ref = [ray.put(w)]
        calls = [wk.step_ray.remote(step, ref) for wk in workers]
        if kill_at == step:
            time.sleep(0.01)
            ray.kill(workers.pop())
            calls.pop()
            print(f"Ray step {step}: killed a worker; {len(workers)} go on")
        # fetch_local=False: wait for the first K to finish without pulling every
        # result here; then pull just those K (in parallel)
        ready, _ = ray.wait(calls, num_returns=min(k, len(calls)), timeout=300, fetch_local=False)
        update = sum(ray.get(ready))
        w = w - LR * update
        times.append(time.perf_counter() - t0)
        chosen = [calls.index(r) for r in ready]
        assert np.allclose(update, _expected_update(chosen, step), rtol=1e-5), "wrong sum"
        # stragglers finish before the next step, their results are not pulled here
        ray.wait(calls, num_returns=len(calls), timeout=300, fetch_local=False)
        del ref, calls, ready, update
    return times, time.perf_counter() - loop_start


def run(workers: int, k: int, size: int, steps: int, max_delay: float = 0.2,
        kill: bool = False, hosts: int | None = None, meter=None) -> dict:
    """Both variants, `steps` steps each; step 0 warms up and is not counted.
    `meter(variant)`, a context manager, wraps each variant (benchmarks/rayemu.py
    counts the bytes on every link)."""
    span = meter or (lambda variant: contextlib.nullcontext())
    n = size // 4
    kill_at = steps // 2 if kill else None
    channel = f"sgd-{uuid.uuid4().hex[:8]}"  # (its versions start at 0 every run)
    hop_workers = make_workers(workers, n, max_delay, hosts, channel)
    with span("hoplite-gpu"):
        hop, hop_loop = run_hoplite(hop_workers, n, k, steps, kill_at, channel)
    for wk in hop_workers:
        ray.kill(wk)
    ray_workers = make_workers(workers, n, max_delay, hosts)
    with span("ray"):
        base, ray_loop = run_ray(ray_workers, n, k, steps, kill_at)
    for wk in ray_workers:
        ray.kill(wk)
    res = {"workers": workers, "k": k, "size_bytes": size, "steps": steps - 1,
           "max_delay_s": max_delay, **summary(hop[1:], base[1:]),
           # (with --kill: how many workers the later steps had)
           "workers_left": workers - (kill_at is not None)}
    # Updates a server could apply per second, at the median step: an async
    # server need not wait for stragglers. This loop does wait for them between
    # steps (to free each step's gradients), so it runs slower: loop_steps_per_s.
    res["hoplite_steps_per_s"] = 1 / res["hoplite_median_s"]
    res["ray_steps_per_s"] = 1 / res["ray_median_s"]
    res["hoplite_loop_steps_per_s"] = (steps - 1) / hop_loop
    res["ray_loop_steps_per_s"] = (steps - 1) / ray_loop
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--size-mib", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--max-delay", type=float, default=0.2)
    p.add_argument("--kill", action="store_true", help="kill one worker halfway")
    args = p.parse_args()
    if min(args.workers, args.k, args.size_mib) < 1 or args.steps < 2:
        p.error("--workers, --k and --size-mib must be at least 1, --steps at least 2 "
                "(step 0 warms up, untimed)")
    if args.k > args.workers:
        p.error("--k must be at most --workers (the first K of the workers' gradients)")
    if not (math.isfinite(args.max_delay) and args.max_delay >= 0):
        p.error("--max-delay must be a finite number of seconds >= 0")
    if args.kill and args.workers < 2:
        p.error("--kill needs at least 2 workers (one is killed, the others go on)")
    with local_ray():
        res = run(args.workers, args.k, args.size_mib << 20, args.steps, args.max_delay, args.kill)
    killed = (f" ({res['workers_left']} after one was killed; then the first "
              f"{min(args.k, res['workers_left'])})" if args.kill else "")
    report(f"async SGD step (reduce first {args.k} of {args.workers} gradients{killed} of "
           f"{args.size_mib} MiB, then new weights)", res["hoplite_s"], res["ray_s"])
    print(f"  1 / median step: hoplite-gpu {res['hoplite_steps_per_s']:.2f} steps/s, "
          f"Ray {res['ray_steps_per_s']:.2f} steps/s (what a server that does not wait "
          "for stragglers could reach)")
    print(f"  loop, waiting for stragglers between steps: hoplite-gpu "
          f"{res['hoplite_loop_steps_per_s']:.2f} steps/s, Ray "
          f"{res['ray_loop_steps_per_s']:.2f} steps/s")


if __name__ == "__main__":
    main()
