"""hoplite-gpu on a local Ray: directory actor, nodes in tasks and actors, ids in
task arguments, the weight channel through actors, and an actor restart."""

from __future__ import annotations

import os

import numpy as np
import pytest

# Single-machine Ray: with this off, Ray binds to loopback instead of the host's
# address (read when ray is imported), so the tests' traffic stays on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

from ray_local import local_ray  # noqa: E402

import hoplite_gpu as hg  # noqa: E402
import hoplite_gpu.ray as hray  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray("hoplite-tests", num_cpus=32):
        info = hray.start_directory()
        yield info
        hray.stop_directory()


@ray.remote
def produce(n: int):
    hray.join()
    return hg.put(np.arange(n, dtype=np.float32))


@ray.remote
def consume(oid) -> float:
    hray.join()
    return float(hg.get(oid, timeout=30).astype(np.float64).sum())


@ray.remote
class Holder:
    def __init__(self) -> None:
        hray.join()

    def put(self, n: int):
        return hg.put(np.full(n, 2.0, dtype=np.float32))

    def get_sum(self, oid) -> float:
        return float(hg.get(oid, timeout=30).astype(np.float64).sum())

    def pid(self) -> int:
        return os.getpid()


@ray.remote
class AsyncReader:
    async def ready(self) -> bool:
        await hray.join_async()
        return True

    async def get_sum(self, oid) -> float:
        value = await hg.get_async(oid, timeout=30)
        return float(value.astype(np.float64).sum())


def test_attach_returns_the_same_directory(ray_cluster):
    assert hray.start_directory() == ray_cluster


def test_ids_travel_in_task_arguments(ray_cluster):
    n = 300_000
    oid = ray.get(produce.remote(n))
    assert isinstance(oid, hg.ObjectID)
    sums = ray.get([consume.remote(oid) for _ in range(3)])
    assert sums == [float(n * (n - 1) / 2)] * 3


def test_sync_and_async_actors_join(ray_cluster):
    holder, reader = Holder.remote(), AsyncReader.remote()
    oid = ray.get(holder.put.remote(1_000_000))
    assert ray.get(reader.ready.remote())
    assert ray.get(reader.get_sum.remote(oid)) == 2_000_000.0
    ray.kill(reader)


def test_restarted_actor_rejoins_and_gets_again(ray_cluster):
    source = Holder.remote()
    oid = ray.get(source.put.remote(500_000))
    actor = Holder.options(max_restarts=1, max_task_retries=1).remote()
    assert ray.get(actor.get_sum.remote(oid)) == 1_000_000.0
    first = ray.get(actor.pid.remote())
    os.kill(first, 9)
    assert ray.get(actor.get_sum.remote(oid), timeout=120) == 1_000_000.0
    assert ray.get(actor.pid.remote()) != first


@ray.remote
class Learner:
    def __init__(self) -> None:
        hray.join()

    def publish(self, versions: int, size: int) -> list[int]:
        from hoplite_gpu.channel import WeightChannel

        ch = WeightChannel("ray-policy")
        return [ch.publish({f"w{i}": np.full(size // 4, v, dtype=np.float32) for i in range(4)},
                           version=v) for v in range(versions)]


@ray.remote
class Rollout:
    def __init__(self) -> None:
        hray.join()

    def follow(self, until: int) -> list[int]:
        """Fetch newer versions until `until`; versions may be skipped, never mixed."""
        from hoplite_gpu.channel import WeightChannel

        ch, seen, last = WeightChannel("ray-policy"), [], -1
        while last < until:
            version, weights = ch.fetch(newer_than=last, timeout=60)
            assert all(a.min() == a.max() == version for a in weights.values())
            seen.append(version)
            last = version
        return seen


def test_weight_channel_between_actors(ray_cluster):
    readers = [Rollout.remote() for _ in range(3)]
    futures = [r.follow.remote(5) for r in readers]
    learner = Learner.remote()
    assert ray.get(learner.publish.remote(6, 1 << 20), timeout=120) == list(range(6))
    for seen in ray.get(futures, timeout=120):
        assert seen == sorted(set(seen)) and seen[-1] == 5


@ray.remote
class Member:
    """A node of the directory group `name`."""

    def __init__(self, name: str) -> None:
        hray.join(name=name, timeout_s=30)

    def put(self, n: int):
        return hg.put(np.full(n, 3.0, dtype=np.float32))

    def get_sum(self, oid) -> float:
        return float(hg.get(oid, timeout=30).astype(np.float64).sum())

    def directory(self, name: str) -> tuple[str, list[str], str]:
        """After a join (again): the directory in use, every address this
        node may use, and the node's id (the same runtime: the same id)."""
        hray.join(name=name)
        return hg.runtime().address, hg.runtime().addresses, hg.node_id()


def test_nodes_move_to_a_standby_directory_actor(ray_cluster):
    """start_directory(standbys=1) starts a second directory actor with the
    first's token, and join() gives nodes both addresses (a join again
    keeps the node's runtime): once the first's process is killed, a node
    that had joined moves to the standby and still gets what another holds,
    a node joining afterwards finds the standby, and start_directory
    attaches to the group as it is."""
    name = "standby-group"
    try:
        info = hray.start_directory(name=name, standbys=1)
        first, standby = info["address"].split(",")
        assert hray.start_directory(name=name, standbys=1) == info
        holder, reader = Member.remote(name), Member.remote(name)
        oid = ray.get(holder.put.remote(500_000))
        *before, reader_id = ray.get(reader.directory.remote(name))
        assert before == [first, [first, standby]]
        actor = ray.get_actor(name)
        os.kill(ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30), 9)
        assert ray.get(reader.get_sum.remote(oid), timeout=60) == 1_500_000.0
        assert ray.get(reader.directory.remote(name)) == (standby, [first, standby], reader_id)
        late = Member.remote(name)
        assert ray.get(late.get_sum.remote(oid), timeout=60) == 1_500_000.0
        assert ray.get(late.directory.remote(name))[:2] == (standby, [first, standby])
        assert hray.start_directory(name=name, standbys=1) == info
    finally:
        hray.stop_directory(name=name)
    with pytest.raises(ValueError):
        ray.get_actor(f"{name}-standby-1")
