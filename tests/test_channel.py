"""The versioned weight channel across processes."""

from __future__ import annotations

import cluster_tasks as t
import pytest

import hoplite_gpu as hg
from hoplite_gpu.channel import WeightChannel
from hoplite_gpu.cluster import LocalCluster, WorkerError


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(4, chunk_size=1 << 20) as c:
        yield c


def test_late_joiner_gets_the_current_version(cluster):
    assert cluster.run(0, t.publish_versions, "late", 3, 1 << 20) == [0, 1, 2]
    assert cluster.run(2, t.fetch_latest, "late") == 2


def test_readers_wait_for_newer_versions_and_never_see_a_mix(cluster):
    for w in (1, 2, 3):
        cluster.submit(w, t.fetch_consistent, "live", 7)
    published = cluster.run(0, t.publish_versions, "live", 8, 2 << 20, 0.05)
    seen = [cluster.result(w, 60) for w in (1, 2, 3)]
    assert published == list(range(8))
    for versions in seen:
        assert versions == sorted(set(versions)) and versions[-1] == 7


def fetch_or_error(channel: str, timeout: float) -> tuple:
    """(version, None, seconds), or (error name, message, seconds)."""
    import time

    start = time.monotonic()
    try:
        version, _ = WeightChannel(channel).fetch(timeout=timeout)
    except hg.HopliteError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return version, None, time.monotonic() - start


def holders_of(channel: str, version: int) -> dict:
    return WeightChannel(channel).holders(version)


def latest(channel: str) -> int:
    return WeightChannel(channel).latest_version()


def test_the_publisher_hears_who_holds_a_version(cluster):
    assert cluster.run(0, t.publish_versions, "who", 1, 1 << 20) == [0]
    assert cluster.run(0, holders_of, "who", 0)["complete"] == [cluster.node_ids[0]]
    for w in (1, 3):
        assert cluster.run(w, t.fetch_latest, "who") == 0
    info = cluster.run(0, holders_of, "who", 0)
    assert info["complete"] == sorted(cluster.node_ids[w] for w in (0, 1, 3))
    assert info == {"version": 0, "nbytes": info["nbytes"], "complete": info["complete"],
                    "partial": {}, "lost": False} and info["nbytes"] >= 3 << 20
    with pytest.raises(WorkerError, match="no version 7"):
        cluster.run(0, holders_of, "who", 7)


def test_a_late_joiner_after_its_publisher_left_hears_at_once_that_the_version_is_lost(cluster):
    """The issue's late joiner: versions 0-2 published, nobody fetched them,
    the publisher exited; latest_version() said 2, then fetch(timeout=5)
    waited 5 s and raised "had no version newer than 2", where the cause is
    that version 2 left with its publisher."""
    assert cluster.run(0, t.publish_versions, "orphan", 3, 1 << 20) == [0, 1, 2]
    cluster.restart(0)
    assert cluster.run(2, latest, "orphan") == 2
    name, message, seconds = cluster.run(2, fetch_or_error, "orphan", 5.0)
    assert name == "VersionLost" and seconds < 2.0, (name, message, seconds)
    assert "version 2 is lost" in message and "left the cluster" in message
    assert cluster.run(2, holders_of, "orphan", 2)["lost"] is True
    # a new publisher (the learner, restarted) carries on with version 3
    assert cluster.run(0, t.publish_versions, "orphan", 1, 1 << 20) == [3]
    assert cluster.run(2, fetch_or_error, "orphan", 5.0)[:2] == (3, None)


def test_old_versions_are_freed():
    hg.init()
    try:
        ch = WeightChannel("freed", keep=2)
        import numpy as np

        for v in range(4):
            ch.publish({"w": np.full(300_000, v, dtype=np.float32)})
        version, weights = ch.fetch()
        assert version == 3 and weights["w"][0] == 3
        old = hg.ObjectID.from_name("hoplite-channel/freed/1/pack/0")
        with pytest.raises(hg.ObjectNotFound):
            hg.object_info(old)
        kept = hg.ObjectID.from_name("hoplite-channel/freed/2/pack/0")
        assert hg.object_info(kept)["size"] == 1_200_000
    finally:
        hg.shutdown()


def test_bad_arguments():
    with pytest.raises(hg.InvalidArgument):
        WeightChannel("")
    with pytest.raises(hg.InvalidArgument):
        WeightChannel("x", keep=0)
    with pytest.raises(hg.InvalidArgument):
        WeightChannel("x", keep=True)  # (a bool is an int to Python; not a count here)


def test_a_channel_can_be_awaited_from_the_callers_own_loop():
    """publish_async / fetch_async / latest_version_async, as a Ray async actor
    or a serving replica calls them: a reader waiting for a newer version
    leaves its loop free, and a cancelled fetch stops its pull."""
    import asyncio
    import time

    import numpy as np

    hg.init(timeout_s=20)
    try:
        learner, actor = WeightChannel("async"), WeightChannel("async")

        async def main():
            assert await actor.latest_version_async() == -1
            assert await learner.publish_async({"w": np.zeros(300_000)}) == 0
            version, weights = await actor.fetch_async(timeout=5)
            assert version == 0 and (weights["w"] == 0).all()
            waiting = asyncio.ensure_future(actor.fetch_async(newer_than=0, timeout=5))
            ticks, start = 0, time.monotonic()
            while time.monotonic() - start < 0.3:
                await asyncio.sleep(0.01)
                ticks += 1
            assert ticks >= 10 and not waiting.done()
            assert await learner.publish_async({"w": np.ones(300_000)}) == 1
            version, weights = await waiting
            assert version == 1 and (weights["w"] == 1).all()
            assert await actor.latest_version_async() == 1

            never = asyncio.ensure_future(actor.fetch_async(newer_than=5, timeout=10))
            await asyncio.sleep(0.2)
            start = time.monotonic()
            never.cancel()
            with pytest.raises(asyncio.CancelledError):
                await never
            assert time.monotonic() - start < 2
            with pytest.raises(hg.InvalidArgument):
                await learner.publish_async({})
            with pytest.raises(hg.Timeout):
                await actor.fetch_async(newer_than=5, timeout=0.2)

        asyncio.run(main())
    finally:
        hg.shutdown()
