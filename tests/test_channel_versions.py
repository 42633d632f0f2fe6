"""Versions of the weight channel (hoplite_gpu/channel.py) and the Ray helpers
it runs with (hoplite_gpu/ray.py): several publishers, a restarted
publisher, explicit versions, large arrays, a directory restart, a crashed
directory actor. Each test fails on the code it was written against; every
wait is bounded."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from in_process import local_mode
from ray_local import local_ray

import hoplite_gpu as hg
from hoplite_gpu import api
from hoplite_gpu.channel import WeightChannel
from hoplite_gpu.cluster import LocalCluster


def _exists(channel: str, version: int) -> bool:
    """Is that version's manifest still in the cluster?"""
    try:
        hg.object_info(hg.ObjectID.from_name(f"hoplite-channel/{channel}/{version}/manifest"))
    except hg.ObjectNotFound:
        return False
    return True


# ---------------------------------------------- worker functions (spawned) ---
def publish(channel: str, n: int, count: int) -> list[int]:
    """`count` versions of {"w": n float32 holding the version number}."""
    ch = WeightChannel(channel)
    return [ch.publish({"w": np.full(n, ch.latest_version() + 1, dtype=np.float32)})
            for _ in range(count)]


def fetch(channel: str, timeout: float, probe_s: float | None = None):
    """(version, first value, seconds) or (error name, message, seconds)."""
    import hoplite_gpu.channel as channel_module

    probe = channel_module._PROBE_S
    if probe_s is not None:
        channel_module._PROBE_S = probe_s
    start = time.monotonic()
    try:
        version, weights = WeightChannel(channel).fetch(timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return type(exc).__name__, str(exc), time.monotonic() - start
    finally:
        channel_module._PROBE_S = probe
    return version, float(weights["w"][0]), time.monotonic() - start


def fetch_while_the_directory_dies(channel: str, directory_pid: int, timeout: float):
    """fetch, the directory killed between the head lookup and the gets."""
    import signal

    ch = WeightChannel(channel)
    original = ch._fetch_version

    async def dying(node, version, deadline, *args):
        os.kill(directory_pid, signal.SIGKILL)
        return await original(node, version, deadline, *args)

    ch._fetch_version = dying
    start = time.monotonic()
    try:
        version, weights = ch.fetch(timeout=timeout)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc), time.monotonic() - start
    return version, float(weights["w"][0]), time.monotonic() - start


def held_bytes() -> int:
    return hg.node_stats()["held_bytes"]


# ----------------------------------------------------------- in-process ---
@pytest.fixture
def local():
    with local_mode():
        yield


def test_keep_counts_published_versions_not_version_numbers(local):
    """keep=2 frees every version more than 2 *numbers* below the head: with
    explicit versions (a training step, say) publish(version=0) then
    publish(version=10) frees version 0 at once, so only one version is
    kept, and a reader still fetching it loses it (docs/guide-weight-channel.md: "the publisher
    frees versions older than its last `keep` (2)")."""
    ch = WeightChannel("steps", keep=2)
    ch.publish({"w": np.zeros(8, dtype=np.float32)}, version=0)
    ch.publish({"w": np.ones(8, dtype=np.float32)}, version=10)
    assert _exists("steps", 0), "version 0 (one of the last 2 published) was freed"
    ch.publish({"w": np.ones(8, dtype=np.float32)}, version=20)
    assert not _exists("steps", 0) and _exists("steps", 10)


def test_two_publishers_of_one_channel_never_make_a_mixed_version(local, monkeypatch):
    """Two publishers (two learners, or two threads) both take head + 1 as
    their version; the second one's puts of ids the first already put are
    kept silently, so version 1 ends up with w1 of one publisher and w2 of
    the other, both calls return 1, and readers get the mix."""
    a, b = WeightChannel("two-pubs"), WeightChannel("two-pubs")
    a.publish({"w1": np.zeros(4, dtype=np.float32), "w2": np.zeros(4, dtype=np.float32)})
    node = api.runtime().node
    real_put, versions = node.put, {}

    async def interleaved(value, object_id, *args, **kwargs):
        out = await real_put(value, object_id, *args, **kwargs)
        if "b" not in versions:  # b publishes whole between a's first and second put
            versions["b"] = None
            monkeypatch.setattr(node, "put", real_put)
            try:
                versions["b"] = await b._publish(node, {"w1": np.full(4, 2, dtype=np.float32),
                                                        "w2": np.full(4, 2, dtype=np.float32)},
                                                 None, 10.0)
            except hg.HopliteError:
                pass  # refusing the clash is fine
        return out

    monkeypatch.setattr(node, "put", interleaved)
    try:
        versions["a"] = a.publish({"w1": np.full(4, 1, dtype=np.float32),
                                   "w2": np.full(4, 1, dtype=np.float32)})
    except hg.HopliteError:
        versions["a"] = None
    monkeypatch.setattr(node, "put", real_put)
    version, weights = WeightChannel("two-pubs").fetch(timeout=10)
    values = {k: float(v[0]) for k, v in weights.items()}
    assert len(set(values.values())) == 1, f"version {version} is a mix: {values}"
    assert None in versions.values() or versions["a"] != versions["b"], (
        f"both publishes returned version {versions['a']}")


# ------------------------------------------------------- across processes ---
@pytest.fixture(scope="module")
def cluster():
    # TCP only (no same-host mappings) and small frames: a transfer that takes a while
    with LocalCluster(2, shared_memory=False, chunk_size=4096) as c:
        yield c


def test_fetch_of_an_array_slower_than_the_probe_completes(cluster):
    """_get reads each array with get(timeout=_PROBE_S) (1 s); when that
    expires the pull is abandoned and the next probe starts it again from
    zero, so an array whose transfer takes longer than the probe (1 GB over
    a 10 Gbit/s link, 256 MB over 1 Gbit/s) never arrives: fetch times out.
    Modelled here with a shorter probe (10 ms) and a 128 MiB array whose
    transfer takes about a second."""
    assert cluster.run(0, publish, "big", 32 << 20, 1, timeout=60) == [0]
    result = cluster.run(1, fetch, "big", 5.0, 0.01, timeout=60)
    assert result[:2] == (0, 0.0), f"fetch of the 128 MiB version: {result}"


def test_a_restarted_publisher_frees_its_predecessors_versions(cluster):
    """A new publisher (a learner that was restarted) only frees the versions
    it published itself: the versions its predecessor published, whose
    copies live on in the readers that fetched them, are never freed."""
    assert cluster.run(0, publish, "restarted", 300_000, 2) == [0, 1]
    before = cluster.run(1, held_bytes)
    assert cluster.run(1, fetch, "restarted", 10.0)[:2] == (1, 1.0)  # the reader keeps a copy
    assert cluster.run(1, held_bytes) >= before + 1_200_000
    cluster.restart(0)
    assert cluster.run(0, publish, "restarted", 300_000, 3) == [2, 3, 4]
    deadline = time.monotonic() + 5  # (other nodes drop a deleted copy a moment later)
    while cluster.run(1, held_bytes) > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.run(1, held_bytes) <= before, (
        "the reader still holds version 1, two versions below the head (keep=2)")


def test_fetch_waits_through_a_directory_restart_until_its_deadline(cluster):
    """The directory restarts (its state is soft; the publisher re-announces
    its head and objects) between a reader's head lookup and its gets: the
    probe's get raises DirectoryUnavailable after 1 s, which _get does not
    catch, so fetch(timeout=10) fails after 1 s although the directory is
    back 1.5 s later and a plain get would have waited."""
    assert cluster.run(0, publish, "restart-dir", 1000, 1) == [0]
    directory = cluster._directory
    cluster.submit(1, fetch_while_the_directory_dies, "restart-dir", directory.pid, 10.0)
    directory.wait(10)
    time.sleep(1.5)
    cluster.restart_directory()
    result = cluster.result(1, 30)
    assert result[:2] == (0, 0.0), f"fetch across a directory restart: {result}"


# ------------------------------------------------------------------ Ray ---
@pytest.fixture(scope="module")
def ray_session():
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = pytest.importorskip("ray")
    import hoplite_gpu.ray as hray

    with local_ray("hoplite-channel-edges", num_cpus=4):
        yield ray, hray


@pytest.mark.slow
def test_start_directory_replaces_a_crashed_directory_actor(ray_session):
    """After the directory actor's process died, start_directory() (the way
    to start it again) finds the dead actor by name, takes it for one that
    "did not start" and raises DirectoryUnavailable; only a second call
    starts a new directory."""
    ray, hray = ray_session
    try:
        first = hray.start_directory(name="edge-crashed")
        actor = ray.get_actor("edge-crashed")
        pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
        os.kill(pid, 9)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until Ray has seen it die
            try:
                ray.get(actor.info.remote(), timeout=5)
            except ray.exceptions.RayActorError:
                break
            time.sleep(0.2)
        second = hray.start_directory(name="edge-crashed")
        assert second["address"] != first["address"]
    finally:
        hray.stop_directory(name="edge-crashed")


@pytest.mark.slow
def test_a_directory_started_again_after_stop_stays_alive(ray_session):
    """start_directory(namespace=ns) keeps the creating handle under (name,
    ns); stop_directory(name) (the same actor, the current namespace left
    implicit) pops (name, None), so the dead handle stays. The next
    start_directory(name, namespace=ns) starts a new actor but
    `_handles.setdefault` keeps the dead handle, so the new directory is
    garbage-collected by Ray as soon as the call returns: joins then fail
    with "no hoplite directory actor named ..."."""
    ray, hray = ray_session
    ns = ray.get_runtime_context().namespace
    try:
        hray.start_directory(name="edge-again", namespace=ns)
        hray.stop_directory(name="edge-again")
        info = hray.start_directory(name="edge-again", namespace=ns)
        import gc

        gc.collect()
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                actor = ray.get_actor("edge-again", namespace=ns)
            except ValueError:
                pytest.fail("the directory started again was removed by Ray after the call")
            time.sleep(0.2)
        assert ray.get(actor.info.remote(), timeout=30) == info
    finally:
        hray.stop_directory(name="edge-again", namespace=ns)
