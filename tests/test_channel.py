"""The versioned weight channel across processes."""

from __future__ import annotations

import cluster_tasks as t
import pytest

import hoplite_gpu as hg
from hoplite_gpu.channel import WeightChannel
from hoplite_gpu.cluster import LocalCluster


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


def test_old_versions_are_freed():
    hg.init()
    try:
        ch = WeightChannel("freed", keep=2)
        import numpy as np

        for v in range(4):
            ch.publish({"w": np.full(300_000, v, dtype=np.float32)})
        version, weights = ch.fetch()
        assert version == 3 and weights["w"][0] == 3
        old = hg.ObjectID.from_name("hoplite-channel/freed/1/t/w")
        with pytest.raises(hg.ObjectNotFound):
            hg.object_info(old)
        kept = hg.ObjectID.from_name("hoplite-channel/freed/2/t/w")
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
