"""The Ray baseline of the weight channel benchmark (benchmarks/channel.py): a
Ray driver on emulated host 0 (started by `RayOnEmulated`, benchmarks/
rayemu.py), a learner actor on host 0 that `ray.put`s the state dict, and one
actor per other host that `ray.get`s it through the ref passed to it: Ray's
object store moving new weights. Prints one JSON line: every round's start
(the learner's, before its put), every actor's end and CRC32 (round 0 a
warm-up).

    python -m benchmarks.channelray '<spec as JSON>'   (RayOnEmulated.driver-like)
"""

from __future__ import annotations

import json
import sys
import time

import ray

from .rayemu import connect_driver
from .weights import crc, mixed_sizes, state_dict


@ray.remote(num_cpus=0)
class Learner:
    def __init__(self, size: int) -> None:
        self.sizes = mixed_sizes(size)
        self.state: dict = {}

    def prepare(self, version: int) -> int:
        self.state = state_dict(self.sizes, version)  # (untimed: the new weights)
        return crc(self.state.values())

    def put(self) -> tuple[float, list]:
        start = time.time()
        return start, [ray.put(self.state)]  # (a nested ref: owned here, as a learner's)


@ray.remote(num_cpus=0)
class Actor:
    def get(self, refs: list) -> tuple[float, int, int]:
        weights = ray.get(refs[0])
        end = time.time()
        return end, crc(weights.values()), len(weights)


def drive(spec: dict) -> dict:
    connect_driver(spec)
    try:
        hosts = spec["hosts"]
        learner = Learner.options(resources={"host_0": 0.001}).remote(spec["size"])
        actors = [Actor.options(resources={f"host_{i}": 0.001}).remote()
                  for i in range(1, hosts)]
        ray.get([a.__ray_ready__.remote() for a in [learner, *actors]], timeout=300)
        rounds = []
        for version in range(spec["rounds"]):
            expected = ray.get(learner.prepare.remote(version), timeout=600)
            start, refs = ray.get(learner.put.remote(), timeout=600)
            got = ray.get([a.get.remote(refs) for a in actors], timeout=spec["timeout"])
            rounds.append({"start": start, "ends": [g[0] for g in got],
                           "crcs": [g[1] for g in got], "expected": expected,
                           "tensors": got[0][2]})
            del refs
        return {"rounds": rounds}
    finally:
        ray.shutdown()


if __name__ == "__main__":
    print(json.dumps(drive(json.loads(sys.argv[1]))), flush=True)
