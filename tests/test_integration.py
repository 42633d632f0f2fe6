"""The integration layer: the weight channel, LocalCluster, the command line
and the Ray helpers, each met as a user meets it. Each test fails on the
code it was written against; every wait is bounded."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from in_process import local_mode
from ray_local import local_ray

import hoplite_gpu as hg
from hoplite_gpu import cli
from hoplite_gpu.channel import WeightChannel
from hoplite_gpu.cluster import LocalCluster


@pytest.fixture
def local():
    with local_mode():
        yield


# ------------------------------------------------------------ channel ---
def test_channel_republishing_an_existing_version_is_not_silently_dropped(local):
    """publish(version=v) for a v that exists returns v as if the new arrays
    were published, but the put keeps the old bytes and the head does not move:
    readers never see the new weights and nothing tells the caller."""
    ch = WeightChannel("republish")
    for v in range(3):
        ch.publish({"w": np.full(8, v, dtype=np.float32)})
    try:
        got = ch.publish({"w": np.full(8, 99, dtype=np.float32)}, version=2)
    except hg.HopliteError:
        return  # refusing it clearly is fine
    version, weights = ch.fetch(timeout=10)
    assert (version, float(weights["w"][0])) == (got, 99.0), (
        f"publish returned {got} but readers get version {version} with w={weights['w'][0]}")


def test_channel_reader_does_not_hang_on_a_version_freed_by_a_keep1_publisher(local):
    """A reader uses its own `keep` to decide whether the version it is
    fetching was freed; with a publisher that keeps 1 (reader: default 2) it
    waits for a version that never comes and times out, although a newer
    complete version is there."""
    name = "keep-mismatch"
    publisher = WeightChannel(name, keep=1)
    reader = WeightChannel(name)  # every actor: docs/guide-weight-channel.md's WeightChannel("policy")
    publisher.publish({"w": np.full(8, 0, dtype=np.float32)})
    original = reader._fetch_version
    raced = []

    async def racing(node, version, deadline, *args):
        if not raced:  # the publisher moves on between the head lookup and the get
            raced.append(await publisher._publish(node, {"w": np.full(8, 1, dtype=np.float32)},
                                                  None, 10.0))
        return await original(node, version, deadline, *args)

    reader._fetch_version = racing
    start = time.monotonic()
    try:
        version, weights = reader.fetch(timeout=6)
    except hg.Timeout:
        pytest.fail(f"fetch timed out after {time.monotonic() - start:.1f}s although "
                    f"version {raced} was complete")
    assert version == 1 and float(weights["w"][0]) == 1.0


# ------------------------------------------------------- LocalCluster ---
@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(2) as c:
        yield c


def test_cluster_run_after_a_timed_out_run_returns_its_own_result(cluster):
    """After result() times out, the late answer stays in the pipe and the
    next run on that worker returns it instead of its own result."""
    with pytest.raises(hg.Timeout):
        cluster.run(0, time.sleep, 1.5, timeout=0.3)
    time.sleep(2.0)
    assert cluster.run(0, str, "fresh", timeout=20) == "fresh"


def test_cluster_run_on_a_killed_worker_raises_a_hoplite_error():
    """A worker that crashed: run() raises a raw BrokenPipeError from
    submit(), not WorkerError naming the dead worker."""
    with LocalCluster(1) as c:
        c.kill(0)
        with pytest.raises(hg.HopliteError, match="worker 0"):
            c.run(0, str, "x", timeout=10)


def test_a_cluster_start_that_fails_halfway_stops_what_it_started():
    """start() called on its own (not through `with`) left the directory
    process running when a worker could not be started."""
    c = LocalCluster(2)
    started = []
    real = c._start_directory

    def directory(*args, **kwargs):
        real(*args, **kwargs)
        started.append(c._directory)

    def no_worker(worker):
        raise OSError("cannot start a worker")
    c._start_directory, c._attach = directory, no_worker
    with pytest.raises(OSError):
        c.start()
    [proc] = started
    assert proc.poll() is not None, "the directory process outlived the failed start"


# -------------------------------------------------------------- CLI ---
@pytest.mark.parametrize("argv", [
    ["simulate", "--bandwidth", "1GB"],
    ["simulate", "--chunk", "0"],
    ["simulate", "--size", "0", "--receivers", "4"],
])
def test_cli_bad_simulate_arguments_give_a_clear_error_not_a_traceback(argv, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as exc:  # argparse or _parse_size: a message, no traceback
        rc = exc.code
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"hoplite-gpu {' '.join(argv)} raised {type(exc).__name__}: {exc}")
    assert rc not in (0, None)


@pytest.mark.slow
@pytest.mark.parametrize("argv", [
    ["demo", "--workers", "2", "--size", "1KiB", "--repeats", "0"],
    ["calibrate", "--size", "1MiB", "--repeats", "0"],
])
def test_cli_zero_repeats_give_a_clear_error_not_a_traceback(argv):
    r = subprocess.run([sys.executable, "-m", "hoplite_gpu", *argv], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "HOPLITE_TOKEN": "t"})
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr[-400:]


# -------------------------------------------------------------- Ray ---
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
try:
    import ray
except ImportError:  # pragma: no cover
    ray = None

needs_ray = pytest.mark.skipif(ray is None, reason="ray is not installed")


@pytest.fixture(scope="module")
def ray_cluster():
    import hoplite_gpu.ray as hray

    with local_ray("hoplite-edges", num_cpus=16):
        try:
            yield hray
        finally:
            for name in ("edge-a", "edge-b", "edge-bad", "edge-bad2"):
                try:
                    hray.stop_directory(name=name)
                except Exception:  # noqa: BLE001
                    pass


if ray is not None:
    @ray.remote(num_cpus=0)
    class Unanswering:
        """Takes a directory actor's name and never answers where it listens."""

        def info(self) -> dict:
            time.sleep(3600)
            return {}

    @ray.remote
    class AsyncJoiner:
        async def join(self, name: str) -> str:
            import hoplite_gpu.ray as hray

            return (await hray.join_async(name=name, timeout=20)).address


@needs_ray
@pytest.mark.slow
def test_join_async_moves_to_another_directory_as_join_does(ray_cluster):
    """join() shuts the old runtime down when the directory's address changed
    (a restarted directory); join_async() calls init() on top of it and fails
    with InvalidArgument ('already called')."""
    hray = ray_cluster
    a = hray.start_directory(name="edge-a")
    b = hray.start_directory(name="edge-b")
    actor = AsyncJoiner.remote()
    try:
        assert ray.get(actor.join.remote("edge-a"), timeout=90) == a["address"]
        assert ray.get(actor.join.remote("edge-b"), timeout=90) == b["address"]
    finally:
        ray.kill(actor)


@needs_ray
@pytest.mark.slow
def test_start_directory_with_a_bad_setting_raises_a_hoplite_error(ray_cluster):
    """A bad setting kills the actor in its constructor: start_directory
    raises Ray's ActorDiedError wrapping the ConfigError, not a HopliteError."""
    with pytest.raises(hg.HopliteError):
        ray_cluster.start_directory(name="edge-bad", no_such_setting=1)


@needs_ray
@pytest.mark.slow
def test_start_directory_works_again_after_a_failed_start(ray_cluster):
    """The dead named actor of a failed start (its handle kept in _handles)
    is found by ray.get_actor, so every later start_directory of that name
    raises ActorDiedError."""
    hray = ray_cluster
    with pytest.raises(Exception):  # noqa: B017 - whatever it raises today
        hray.start_directory(name="edge-bad2", no_such_setting=1)
    info = hray.start_directory(name="edge-bad2")
    assert info["address"].startswith("tcp://")


@needs_ray
@pytest.mark.slow
def test_join_of_a_directory_actor_that_never_answers_is_a_hoplite_error(ray_cluster):
    """join() let Ray's GetTimeoutError through, and join_async a bare TimeoutError."""
    actor = Unanswering.options(name="edge-mute").remote()
    try:
        with pytest.raises(hg.DirectoryUnavailable, match="edge-mute"):
            ray_cluster.join(name="edge-mute", timeout=2)
        with pytest.raises(hg.DirectoryUnavailable, match="edge-mute"):
            asyncio.run(ray_cluster.join_async(name="edge-mute", timeout=2))
    finally:
        ray.kill(actor)
