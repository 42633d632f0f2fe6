"""RL weight broadcast: a learner publishes new weights every iteration and K
rollout actors fetch them; hoplite-gpu's weight channel beside `ray.put` + ref
fan-out. With --kill, one rollout actor is killed halfway and the others go on.

    python examples/rl_weights.py --actors 4 --size-mib 64 --iterations 6

`run` also places the learner on emulated host 0 and the rollouts on the other
hosts (benchmarks/rayemu.py, `python -m benchmarks.rayemu rl`).
"""

from __future__ import annotations

import argparse
import contextlib
import time
import uuid

import numpy as np
from common import crc, local_ray, on_host, ray, report, summary

import hoplite_gpu.ray as hray
from hoplite_gpu.channel import WeightChannel


def make_weights(version: int, size: int) -> dict[str, np.ndarray]:
    layers = 4
    return {f"layer{i}": np.full(size // layers // 4, version + i, dtype=np.float32)
            for i in range(layers)}


@ray.remote(num_cpus=0)
class Learner:
    def __init__(self, size: int, channel: str) -> None:
        hray.join()
        self.size = size
        self.channel = WeightChannel(channel)

    def publish_hoplite(self, version: int) -> int:
        return self.channel.publish(make_weights(version, self.size), version=version)

    def publish_ray(self, version: int) -> list:
        return [ray.put(make_weights(version, self.size))]  # a nested ref: owned here


@ray.remote(num_cpus=0)
class Rollout:
    """Each fetch returns when this actor held the weights (wall clock, taken before
    the checksum, so the time measured is the broadcast's), and their checksum."""

    def __init__(self, channel: str) -> None:
        hray.join()
        self.channel = WeightChannel(channel)

    def fetch_hoplite(self, version: int) -> tuple[int, float, int]:
        got, weights = self.channel.fetch(newer_than=version - 1, timeout=300)
        done = time.time()
        return got, done, crc(weights.values())

    def fetch_ray(self, refs: list) -> tuple[float, int]:
        weights = ray.get(refs[0])
        done = time.time()
        return done, crc(weights.values())


def run(actors: int, size: int, iterations: int, kill: bool = False,
        hosts: int | None = None, meter=None) -> dict:
    """Time `iterations` broadcasts (after one untimed warm-up) with each system:
    from the learner's publish until every rollout actor holds the new weights.
    With `hosts`, the learner sits on emulated host 0 and rollout j on host
    1 + j mod (hosts - 1). `meter(variant)`, a context manager, wraps each
    variant's broadcasts (benchmarks/rayemu.py counts the bytes on every link)."""
    span = meter or (lambda variant: contextlib.nullcontext())
    channel = f"policy-{uuid.uuid4().hex[:8]}"  # (its versions start at 0 every run)
    learner = Learner.options(**on_host(0 if hosts else None)).remote(size, channel)
    rollouts = [Rollout.options(**on_host(1 + j % (hosts - 1) if hosts else None)).remote(channel)
                for j in range(actors)]
    ray.get([a.__ray_ready__.remote() for a in [learner, *rollouts]])
    hop, base = [], []
    for it in range(iterations + 1):  # iteration 0 warms up both paths, untimed
        expected = crc(make_weights(it, size).values())
        with span("hoplite-gpu"):
            t0 = time.time()
            ray.get(learner.publish_hoplite.remote(it))
            futures = [r.fetch_hoplite.remote(it) for r in rollouts]
            if kill and it == iterations // 2:
                time.sleep(0.02)
                victim = rollouts.pop()
                ray.kill(victim)
                futures.pop()
                print(f"iteration {it}: killed one rollout actor mid-fetch; {len(rollouts)} go on")
            got = ray.get(futures, timeout=600)
        t_hop = max(done for _, done, _ in got) - t0
        assert all((v, c) == (it, expected) for v, _, c in got), "a rollout got wrong weights"
        with span("ray"):
            t0 = time.time()
            refs = ray.get(learner.publish_ray.remote(it))
            got = ray.get([r.fetch_ray.remote(refs) for r in rollouts], timeout=600)
        t_ray = max(done for done, _ in got) - t0
        assert all(c == expected for _, c in got), "a rollout got wrong weights from Ray"
        del refs
        if it > 0:
            hop.append(t_hop)
            base.append(t_ray)
            print(f"iteration {it}: hoplite-gpu {t_hop * 1e3:.0f} ms, Ray {t_ray * 1e3:.0f} ms",
                  flush=True)
    for a in [learner, *rollouts]:
        ray.kill(a)
    return {"actors": len(rollouts), "size_bytes": size, "iterations": iterations,
            **summary(hop, base)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--actors", type=int, default=4)
    p.add_argument("--size-mib", type=int, default=64)
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--kill", action="store_true", help="kill one rollout actor halfway")
    args = p.parse_args()
    if min(args.actors, args.size_mib, args.iterations) < 1:
        p.error("--actors, --size-mib and --iterations must be at least 1")
    if args.kill and args.actors < 2:
        p.error("--kill needs at least 2 actors (one is killed, the others go on)")
    with local_ray():
        res = run(args.actors, args.size_mib << 20, args.iterations, args.kill)
    to = (f"{args.actors} rollout actors ({res['actors']} after one was killed)"
          if res["actors"] != args.actors else f"{args.actors} rollout actors")
    report(f"broadcast of {args.size_mib} MiB of weights to {to} "
           "(publish -> every actor holds the new version)", res["hoplite_s"], res["ray_s"])


if __name__ == "__main__":
    main()
