"""The weight channel (hoplite_gpu/channel.py) across restarts: a restarted
publisher's adoption of its predecessor's versions, a reader of a version
whose only holder died, version numbers the wire cannot carry, a version
number used again after the directory and the learner both restarted, and
the freed-version probe's deadline. Each test fails on the code it was
written against; every wait is bounded."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from in_process import channel_object_exists, eventually, local_mode, run_nodes

import hoplite_gpu as hg
from hoplite_gpu.channel import WeightChannel
from hoplite_gpu.cluster import LocalCluster


# ------------------------------------------------------- worker functions ---
def publish_values(channel: str, values: list[float]) -> list[int]:
    """A fresh publisher (a learner just started) publishing one version per
    value, {"w": 1000 float32 holding the value}."""
    ch = WeightChannel(channel)
    return [ch.publish({"w": np.full(1000, v, dtype=np.float32)}) for v in values]


def fetch_value(channel: str) -> tuple[int, float, float]:
    version, weights = WeightChannel(channel).fetch(timeout=10)
    return version, float(weights["w"].min()), float(weights["w"].max())


# -------------------------------------------------------------- in-process ---
def test_a_restarted_publisher_frees_its_predecessors_versions_with_explicit_numbers():
    """docs/guide-weight-channel.md: "the publisher frees versions older than its last `keep` (2)
    published ones, and a restarted publisher frees its predecessor's too"
    (architecture.md: "adopts the last `keep` versions an earlier one
    left"). `_adopt` (channel.py:157) looks only at the version *numbers*
    head-keep+1..head, while `_free_old` counts published versions. With
    explicit versions (a training step: 0, 10, 20, as rl_weights.py passes
    `version=`) or a skipped number, the predecessor's second newest version
    (10) is never adopted, so no publisher ever frees it: it stays in every
    reader that fetched it, for good."""
    with local_mode(timeout_s=10):
        old = WeightChannel("steps-restart", keep=2)
        for v in (0, 10, 20):
            old.publish({"w": np.full(1000, v, dtype=np.float32)}, version=v)
        assert [v for v in (0, 10, 20) if channel_object_exists("steps-restart", v)] == [10, 20]
        restarted = WeightChannel("steps-restart", keep=2)  # the learner, restarted
        for v in (30, 40):
            restarted.publish({"w": np.full(1000, v, dtype=np.float32)}, version=v)
        left = [v for v in (10, 20, 30, 40) if channel_object_exists("steps-restart", v)]
        assert left == [30, 40], f"keep=2, head 40: versions {left} are still held"


def test_a_reader_of_a_version_lost_with_its_publisher_does_not_spin_on_the_directory():
    """The learner dies (its process exits) holding the only copy of the head
    version: the directory answers a get of it with ObjectNotFound at once,
    `_get` returns None as if the version had been freed, and `_fetch`
    (channel.py:239) sets newer_than = head - 1 and asks again, getting the
    same head at once: a tight loop. Every actor's fetch(timeout=...) burns a
    core and floods the shared directory with thousands of channel_head and
    locate requests per second until its deadline (300 s by default), then
    reports "version N did not arrive in time". Here: ~3000 head lookups in
    one second; a reader should wait for a newer version (or say the version
    was lost) with a handful."""
    cfg = hg.Config(shared_memory=False, timeout_s=5)

    async def body(directory, learner, reader):
        await WeightChannel("lost-head")._publish(
            learner, {"w": np.zeros(300_000, dtype=np.float32)}, None, 5.0)
        await learner.close()  # the learner's process is gone
        assert await eventually(lambda: learner.node_id not in directory.state.nodes)
        calls = [0]
        real = reader.channel_head

        async def counting(*args, **kwargs):
            calls[0] += 1
            return await real(*args, **kwargs)

        reader.channel_head = counting
        with pytest.raises(hg.HopliteError):
            await WeightChannel("lost-head")._fetch(reader, -1, 1.0)
        assert calls[0] < 50, (f"fetch(timeout=1) of a lost version asked the directory for "
                               f"the head {calls[0]} times")

    run_nodes([cfg, cfg], body, bound=20)


def test_publish_with_a_version_the_wire_cannot_carry_is_refused_and_harms_nothing():
    """`_check_publish` accepts any int >= 0; version=2**64 (a 64-bit hash or
    uuid.int as a version) fails deep inside msgpack with a raw
    `OverflowError: Integer value out of range`, and `_claim` has already
    recorded it in `_tried` (channel.py:175): from then on every publish of
    this channel object picks 2**64 + 1 and fails with the same
    OverflowError, for good. Expected: InvalidArgument up front, and the
    channel still usable."""
    with local_mode(timeout_s=10):
        ch = WeightChannel("too-big")
        with pytest.raises(hg.InvalidArgument):
            ch.publish({"w": np.zeros(4, dtype=np.float32)}, version=2**64)
        assert ch.publish({"w": np.ones(4, dtype=np.float32)}) == 0


def test_fetch_newer_than_the_wire_cannot_carry_is_an_invalid_argument():
    """`_check_fetch` accepts any int: fetch(newer_than=2**64) (or -2**64)
    raises a raw `OverflowError: Integer value out of range` from msgpack
    inside the runtime's loop instead of InvalidArgument."""
    with local_mode(timeout_s=10):
        with pytest.raises(hg.InvalidArgument):
            WeightChannel("too-big-fetch").fetch(newer_than=2**64, timeout=1)


def test_the_freed_version_probe_keeps_the_fetchs_deadline_when_the_directory_goes():
    """Every `_PROBE_S` without its array, `_get` asks `_freed`: its head
    lookup is bounded by the fetch's deadline, but once a newer version is
    out (the learner published while this reader's large array was still
    arriving), its `_exists` -> `node.query` (channel.py:287) waits
    `timeout_s` (300 s by default) for a directory that went away meanwhile.
    fetch_async has no other bound (`call_async`), so fetch_async(timeout=1.5)
    here returns after about 7 s (1 s probe + the node's timeout_s of 6 s);
    with the defaults, after 5 minutes."""
    cfg = hg.Config(shared_memory=False, timeout_s=6)

    async def body(directory, learner, reader):
        ch = WeightChannel("probe-dir")
        await ch._publish(learner, {"w": np.zeros(1000, dtype=np.float32)}, None, 5.0)

        async def slow_get(oid, timeout, *args, **kwargs):  # a large array, still arriving
            await asyncio.sleep(timeout)
            raise hg.Timeout("still arriving")

        real_head = reader.channel_head

        async def head_then_directory_gone(name, newer_than, timeout, wait=True):
            if not wait:  # the probe's lookup: version 1 is out; the directory dies after it
                await ch._publish(learner, {"w": np.ones(1000, dtype=np.float32)}, None, 5.0)
                head = await real_head(name, newer_than, timeout, wait)
                await directory.close()
                return head
            return await real_head(name, newer_than, timeout, wait)

        reader.get = slow_get
        reader.channel_head = head_then_directory_gone
        start = time.monotonic()
        with pytest.raises(hg.HopliteError):
            await WeightChannel("probe-dir")._fetch(reader, -1, 1.5)
        elapsed = time.monotonic() - start
        assert elapsed < 3.0, f"fetch(timeout=1.5) took {elapsed:.1f}s"

    run_nodes([cfg, cfg], body, bound=30)


# ------------------------------------------------------- across processes ---
def test_a_version_number_used_again_after_the_directory_and_learner_restart_is_not_stale():
    """The learner and the directory restart (e.g. both on the head node);
    the actors live on, holding the last version they fetched (1). The new
    directory has no head (heads are re-announced only by the node that
    published them, which is gone), so the new learner numbers its versions
    from 0 again; its version 1's claim is free, and its puts of version 1's
    ids are accepted as further holders of the ids the actor re-announced
    with the same size (`_on_Put`, state.py). The actor's fetch then returns
    version 1 from its own stale copy: the old learner's weights (1.0), not
    the new ones (101.0), and other readers may mix the two."""
    with LocalCluster(2, shared_memory=False, timeout_s=10) as cluster:
        assert cluster.run(0, publish_values, "reborn", [0.0, 1.0], timeout=30) == [0, 1]
        assert cluster.run(1, fetch_value, "reborn", timeout=30) == (1, 1.0, 1.0)
        cluster.restart(0)
        cluster.restart_directory()
        time.sleep(1.0)  # (the actor reconnects and re-announces its copies)
        published = cluster.run(0, publish_values, "reborn", [100.0, 101.0], timeout=30)
        assert published[-1] >= 1
        version, low, high = cluster.run(1, fetch_value, "reborn", timeout=30)
        assert version == published[-1] and low == high == 101.0, (
            f"version {version} fetched with values {low}..{high}: the old learner's bytes")


def fetch_newer(channel: str, newer_than: int) -> tuple[int, float, float]:
    version, weights = WeightChannel(channel).fetch(newer_than=newer_than, timeout=10)
    return version, float(weights["w"].min()), float(weights["w"].max())


def test_after_the_directory_and_learner_restart_new_versions_are_newer_than_the_readers():
    """The learner and the directory restart; the actor lives on, having
    fetched version 1, and waits for a newer one (`newer_than=1`). Heads were
    re-announced only by the node that published them, which is gone, so the
    new directory knew no head and the new learner numbered from 0 again: its
    first versions (0, then 1 skipped as the actor's copy exists) were all
    "not newer" for the actor, whose fetch timed out while weights were being
    published. A node now re-announces the newest version it fetched too, so
    the learner's first version after the restart is 2."""
    with LocalCluster(2, shared_memory=False, timeout_s=10) as cluster:
        assert cluster.run(0, publish_values, "renumbered", [0.0, 1.0], timeout=30) == [0, 1]
        assert cluster.run(1, fetch_value, "renumbered", timeout=30) == (1, 1.0, 1.0)
        cluster.restart(0)
        cluster.restart_directory()
        time.sleep(1.0)  # (the actor reconnects and re-announces what it holds)
        assert cluster.run(0, publish_values, "renumbered", [100.0], timeout=30) == [2]
        assert cluster.run(1, fetch_newer, "renumbered", 1, timeout=30) == (2, 100.0, 100.0)
