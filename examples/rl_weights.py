"""RL weight broadcast: a learner publishes new weights every iteration and K
rollout actors fetch them; hoplite-gpu's weight channel beside `ray.put` + ref
fan-out. With --kill, one rollout actor is killed halfway and the others go on.

    python examples/rl_weights.py --actors 4 --size-mib 64 --iterations 6
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import crc, local_ray, ray, report

import hoplite_gpu.ray as hray
from hoplite_gpu.channel import WeightChannel


def make_weights(version: int, size: int) -> dict[str, np.ndarray]:
    layers = 4
    return {f"layer{i}": np.full(size // layers // 4, version + i, dtype=np.float32)
            for i in range(layers)}


@ray.remote(num_cpus=0)
class Learner:
    def __init__(self, size: int) -> None:
        hray.join()
        self.size = size
        self.channel = WeightChannel("policy")

    def publish_hoplite(self, version: int) -> int:
        return self.channel.publish(make_weights(version, self.size), version=version)

    def publish_ray(self, version: int) -> list:
        return [ray.put(make_weights(version, self.size))]  # a nested ref: owned here


@ray.remote(num_cpus=0)
class Rollout:
    def __init__(self) -> None:
        hray.join()
        self.channel = WeightChannel("policy")

    def fetch_hoplite(self, version: int) -> tuple[int, int]:
        got, weights = self.channel.fetch(newer_than=version - 1, timeout=120)
        return got, crc(weights.values())

    def fetch_ray(self, refs: list) -> int:
        return crc(ray.get(refs[0]).values())


def run(actors: int, size: int, iterations: int, kill: bool) -> None:
    learner = Learner.remote(size)
    rollouts = [Rollout.remote() for _ in range(actors)]
    ray.get([r.__ray_ready__.remote() for r in rollouts])
    hop, base = [], []
    for it in range(iterations + 1):  # iteration 0 warms up both paths, untimed
        expected = crc(make_weights(it, size).values())
        t0 = time.perf_counter()
        ray.get(learner.publish_hoplite.remote(it))
        futures = [r.fetch_hoplite.remote(it) for r in rollouts]
        if kill and it == iterations // 2:
            time.sleep(0.02)
            victim = rollouts.pop()
            ray.kill(victim)
            futures.pop()
            print(f"iteration {it}: killed one rollout actor mid-fetch; {len(rollouts)} go on")
        got = ray.get(futures, timeout=300)
        t_hop = time.perf_counter() - t0
        assert all(g == (it, expected) for g in got), "a rollout got wrong weights"
        t0 = time.perf_counter()
        refs = ray.get(learner.publish_ray.remote(it))
        sums = ray.get([r.fetch_ray.remote(refs) for r in rollouts], timeout=300)
        t_ray = time.perf_counter() - t0
        assert all(s == expected for s in sums)
        if it > 0:
            hop.append(t_hop)
            base.append(t_ray)
            print(f"iteration {it}: hoplite-gpu {t_hop * 1e3:.0f} ms, Ray {t_ray * 1e3:.0f} ms")
    report(f"broadcast of {size >> 20} MiB of weights to {len(rollouts)} rollout actors "
           "(publish -> every actor holds the new version)", hop, base)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--actors", type=int, default=4)
    p.add_argument("--size-mib", type=int, default=64)
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--kill", action="store_true", help="kill one rollout actor halfway")
    args = p.parse_args()
    with local_ray():
        run(args.actors, args.size_mib << 20, args.iterations, args.kill)


if __name__ == "__main__":
    main()
