"""RL weights: a learner trains a small torch policy (an MLP built here, no
downloads) and publishes its weights every iteration through a weight channel;
K rollout actors each hold two replicas of the policy and serve from one
while the next version arrives into the other (`DoubleBuffer`: in place, no
pause), then evaluate it. Beside it, Ray's object store: `ray.put` of the
weights in the learner, `ray.get` and a copy into a third replica in each
actor. With --kill, one rollout actor is killed mid-fetch and a new one joins:
it gets the current version as a late joiner, the learner doing nothing.

    python examples/rl_weights.py --actors 4 --size-mib 64 --iterations 6 --kill

`run` also places the learner on emulated host 0 and the rollouts on the other
hosts (benchmarks/rayemu.py, `python -m benchmarks.rayemu rl`).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
import uuid

import numpy as np
from common import crc, local_ray, on_host, ray, report, summary

import hoplite_gpu.ray as hray
from hoplite_gpu.channel import WeightChannel

INPUTS, OUTPUTS, BATCH = 32, 8, 64


def make_policy(size: int, seed: int):
    """An MLP of about `size` bytes of float32 parameters: 32 -> H -> H -> 8,
    with a LayerNorm; its initial weights drawn from `seed`."""
    import torch

    # (parameters: H^2 + 44 H + 8, solved for H)
    hidden = max(4, int((-44 + math.sqrt(44 ** 2 + 4 * max(size // 4 - 8, 1))) / 2))
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(INPUTS, hidden), torch.nn.LayerNorm(hidden), torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, OUTPUTS))


def task(seed: int = 7):
    """The task every process agrees on: imitate a fixed teacher on random inputs."""
    import torch

    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(INPUTS, OUTPUTS, generator=g) / math.sqrt(INPUTS)
    probe = torch.randn(256, INPUTS, generator=g)
    return teacher, probe


def loss_of(model, x, teacher) -> float:
    import torch

    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), torch.tanh(x @ teacher)))


def checksum(model) -> int:
    return crc(t.detach().numpy() for t in model.state_dict().values())


@ray.remote(num_cpus=0)
class Learner:
    def __init__(self, size: int, channel: str) -> None:
        import torch

        hray.join()
        self.model = make_policy(size, seed=0)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.teacher, _ = task()
        self.channel = WeightChannel(channel)
        self.steps = 0

    def train(self) -> dict:
        """One SGD step on fresh inputs (untimed: the weights' next version)."""
        import torch

        x = torch.randn(BATCH, INPUTS)
        loss = torch.nn.functional.mse_loss(self.model(x), torch.tanh(x @ self.teacher))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.steps += 1
        return {"crc": checksum(self.model), "bytes": sum(
            t.numel() * t.element_size() for t in self.model.state_dict().values())}

    def publish_hoplite(self) -> int:
        """The new weights as the channel's next version; returns its number."""
        return self.channel.publish(self.model.state_dict())

    def publish_ray(self) -> list:
        state = {k: t.detach().numpy() for k, t in self.model.state_dict().items()}
        return [ray.put(state)]  # a nested ref: owned here


@ray.remote(num_cpus=0)
class Rollout:
    """Two replicas of the policy behind a `DoubleBuffer` (hoplite-gpu) and a
    third one (Ray). Each fetch returns when this actor serves the new
    version (wall clock, taken before the checksum, so the time measured is
    the broadcast's), with the checksum of what it serves."""

    def __init__(self, size: int, channel: str, seed: int) -> None:
        hray.join()
        # (initial weights of its own: what it serves is what arrived)
        self.weights = WeightChannel(channel).double_buffer(make_policy(size, seed),
                                                            make_policy(size, seed + 1000))
        self.ray_model = make_policy(size, seed + 2000)
        self.teacher, self.probe = task()

    def fetch_hoplite(self) -> tuple[int, float, int]:
        """Wait for a version newer than the one served, receive it into the
        replica nobody serves from, then serve it."""
        version = self.weights.update(timeout=300)
        done = time.time()
        with self.weights.serving() as (_, model):
            return version, done, checksum(model)

    def fetch_ray(self, refs: list) -> tuple[float, int]:
        state = ray.get(refs[0])
        for name, t in self.ray_model.state_dict().items():
            t.numpy()[...] = state[name]  # (in place, as load_state_dict would copy)
        done = time.time()
        return done, checksum(self.ray_model)

    def act(self) -> tuple[int, float]:
        """A rollout step on the version served: its loss on the probe inputs."""
        with self.weights.serving() as (version, model):
            return version, loss_of(model, self.probe, self.teacher)


def run(actors: int, size: int, iterations: int, kill: bool = False,
        hosts: int | None = None, meter=None) -> dict:
    """Time `iterations` broadcasts (after one untimed warm-up) with each system:
    from the learner's publish until every rollout actor serves the new
    weights. With `hosts`, the learner sits on emulated host 0 and rollout j
    on host 1 + j mod (hosts - 1). `meter(variant)`, a context manager, wraps
    each variant's broadcasts (benchmarks/rayemu.py counts the bytes on
    every link). With `kill`, a rollout actor is killed mid-fetch halfway and
    a new one joins on its host."""
    span = meter or (lambda variant: contextlib.nullcontext())
    channel = f"policy-{uuid.uuid4().hex[:8]}"  # (its versions start at 0 every run)
    where = [1 + j % (hosts - 1) if hosts else None for j in range(actors)]
    learner = Learner.options(**on_host(0 if hosts else None)).remote(size, channel)
    rollouts = [Rollout.options(**on_host(where[j])).remote(size, channel, seed=j + 1)
                for j in range(actors)]
    ray.get([a.__ray_ready__.remote() for a in [learner, *rollouts]])
    hop, base, losses, killed = [], [], [], None
    for it in range(iterations + 1):  # iteration 0 warms up both paths, untimed
        expected = ray.get(learner.train.remote())
        with span("hoplite-gpu"):
            t0 = time.time()
            version = ray.get(learner.publish_hoplite.remote())
            futures = [r.fetch_hoplite.remote() for r in rollouts]
            if kill and it == iterations // 2:
                killed = _kill_one(rollouts, futures, where, size, channel, it)
            got = ray.get(futures, timeout=600)
        t_hop = max(done for _, done, _ in got) - t0
        assert all((v, c) == (version, expected["crc"]) for v, _, c in got), \
            "a rollout serves wrong weights"
        if killed is not None and killed["iteration"] == it:
            _rejoin(killed, rollouts, version, expected["crc"])
        with span("ray"):
            t0 = time.time()
            refs = ray.get(learner.publish_ray.remote())
            got = ray.get([r.fetch_ray.remote(refs) for r in rollouts], timeout=600)
        t_ray = max(done for done, _ in got) - t0
        assert all(c == expected["crc"] for _, c in got), "a rollout got wrong weights from Ray"
        del refs
        acted = ray.get([r.act.remote() for r in rollouts])
        losses.append(float(np.mean([loss for _, loss in acted])))
        if it > 0:
            hop.append(t_hop)
            base.append(t_ray)
            print(f"iteration {it}: version {version}, hoplite-gpu {t_hop * 1e3:.0f} ms, "
                  f"Ray {t_ray * 1e3:.0f} ms; the actors' loss {losses[-1]:.4f}", flush=True)
    for a in [learner, *rollouts]:
        ray.kill(a)
    return {"actors": len(rollouts), "size_bytes": expected["bytes"], "iterations": iterations,
            "killed": killed, "loss": losses, **summary(hop, base)}


def _kill_one(rollouts: list, futures: list, where: list, size: int, channel: str,
              it: int) -> dict:
    time.sleep(0.02)  # (its fetch has started)
    victim = rollouts.pop()
    futures.pop()
    ray.kill(victim)
    print(f"iteration {it}: killed a rollout actor mid-fetch; {len(rollouts)} go on, and a new "
          "one joins", flush=True)
    host = where[len(rollouts)]
    joiner = Rollout.options(**on_host(host)).remote(size, channel, seed=len(rollouts) + 101)
    return {"iteration": it, "host": host, "joiner": joiner}


def _rejoin(killed: dict, rollouts: list, version: int, expected: int) -> None:
    """The new actor fetches the channel's current version (a late joiner)."""
    joiner = killed.pop("joiner")
    got, _, c = ray.get(joiner.fetch_hoplite.remote(), timeout=600)
    assert (got, c) == (version, expected), "the new rollout actor got wrong weights"
    killed["rejoined_at_version"] = got
    rollouts.append(joiner)
    print(f"iteration {killed['iteration']}: the new rollout actor serves version {got}",
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--actors", type=int, default=4)
    p.add_argument("--size-mib", type=int, default=64, help="the policy's weights, about")
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--kill", action="store_true",
                   help="kill one rollout actor mid-fetch halfway; a new one joins")
    args = p.parse_args()
    if min(args.actors, args.size_mib, args.iterations) < 1:
        p.error("--actors, --size-mib and --iterations must be at least 1")
    if args.kill and args.actors < 2:
        p.error("--kill needs at least 2 actors (one is killed, the others go on)")
    with local_ray():
        res = run(args.actors, args.size_mib << 20, args.iterations, args.kill)
    killed = res["killed"]
    to = (f"{args.actors} rollout actors (one killed mid-fetch at iteration "
          f"{killed['iteration']}; a new one joined at version {killed['rejoined_at_version']})"
          if killed else f"{args.actors} rollout actors")
    report(f"broadcast of {res['size_bytes'] / 2**20:.1f} MiB of policy weights to {to} "
           "(publish -> every actor serves the new version)", res["hoplite_s"], res["ray_s"])
    print(f"  the actors' loss on the probe inputs: {res['loss'][0]:.4f} (version 0) -> "
          f"{res['loss'][-1]:.4f} (version {args.iterations})")


if __name__ == "__main__":
    main()
