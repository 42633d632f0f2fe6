"""Asynchronous SGD with a parameter server: every step, N workers compute a
gradient (after a random delay, as real tasks finish unevenly); the server
reduces the first K that are ready and publishes new weights. hoplite-gpu's
subset reduce + weight channel beside Ray's `ray.wait(num_returns=K)` + sum in
the server + `ray.put` of the weights. With --kill, a worker is killed halfway
and the job goes on with the others.

    python examples/async_sgd.py --workers 6 --k 4 --size-mib 16 --steps 8
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
from common import local_ray, ray, report

import hoplite_gpu as hg
import hoplite_gpu.ray as hray
from hoplite_gpu.channel import WeightChannel


def gradient(rank: int, step: int, n: int) -> np.ndarray:
    return np.full(n, (rank + 1) * 1e-3, dtype=np.float32) * (step + 1)


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self, rank: int, n: int, max_delay: float) -> None:
        hray.join()
        self.rank, self.n, self.max_delay = rank, n, max_delay
        self.rng = random.Random(rank)
        self.channel = WeightChannel("sgd")

    def step_hoplite(self, step: int) -> None:
        self.channel.fetch(newer_than=step - 1, timeout=120)  # the weights of this step
        time.sleep(self.rng.uniform(0, self.max_delay))  # "compute"
        hg.put(gradient(self.rank, step, self.n), hg.ObjectID.from_name(f"grad/{step}/{self.rank}"))

    def step_ray(self, step: int, weights: list) -> np.ndarray:
        ray.get(weights[0])
        time.sleep(self.rng.uniform(0, self.max_delay))
        return gradient(self.rank, step, self.n)


def run_hoplite(workers, n: int, k: int, steps: int, kill_at: int | None) -> list[float]:
    channel, w = WeightChannel("sgd"), np.zeros(n, dtype=np.float32)
    channel.publish({"w": w}, version=0)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        calls = [wk.step_hoplite.remote(step) for wk in workers]
        if kill_at == step:
            time.sleep(0.01)
            ray.kill(workers.pop())
            calls.pop()
            print(f"hoplite-gpu step {step}: killed a worker; {len(workers)} go on")
        ids = [hg.ObjectID.from_name(f"grad/{step}/{r}") for r in range(len(workers) + (kill_at == step))]
        rid = hg.reduce(ids, "sum", num_objects=min(k, len(workers)),
                        object_id=hg.ObjectID.from_name(f"grad/{step}/sum"))
        w = w - 0.1 * hg.get(rid, timeout=120)
        channel.publish({"w": w}, version=step + 1)
        times.append(time.perf_counter() - t0)
        ray.get(calls, timeout=120)  # let stragglers finish before the next step
    return times


def run_ray(workers, n: int, k: int, steps: int, kill_at: int | None) -> list[float]:
    w = np.zeros(n, dtype=np.float32)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        ref = [ray.put(w)]
        calls = [wk.step_ray.remote(step, ref) for wk in workers]
        if kill_at == step:
            time.sleep(0.01)
            ray.kill(workers.pop())
            calls.pop()
            print(f"Ray step {step}: killed a worker; {len(workers)} go on")
        ready, _ = ray.wait(calls, num_returns=min(k, len(calls)), timeout=120)
        w = w - 0.1 * sum(ray.get(ready))
        times.append(time.perf_counter() - t0)
        ray.get(calls, timeout=120)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--size-mib", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--max-delay", type=float, default=0.2)
    p.add_argument("--kill", action="store_true", help="kill one worker halfway")
    args = p.parse_args()
    n = (args.size_mib << 20) // 4
    kill_at = args.steps // 2 if args.kill else None
    with local_ray():
        hop_workers = [Worker.remote(r, n, args.max_delay) for r in range(args.workers)]
        ray_workers = [Worker.remote(r, n, args.max_delay) for r in range(args.workers)]
        hop = run_hoplite(hop_workers, n, args.k, args.steps, kill_at)
        base = run_ray(ray_workers, n, args.k, args.steps, kill_at)
    report(f"async SGD step (reduce first {args.k} of {args.workers} gradients of "
           f"{args.size_mib} MiB, then new weights)", hop[1:], base[1:])
    print(f"  throughput: hoplite-gpu {1 / np.median(hop[1:]):.2f} steps/s, "
          f"Ray {1 / np.median(base[1:]):.2f} steps/s")


if __name__ == "__main__":
    main()
