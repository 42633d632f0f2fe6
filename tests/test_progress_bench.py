"""`python -m benchmarks progress` measures what it says on a real cluster: an idle
node's CPU and a round trip over the transport (TCP here; the UCX settings run in
the benchmark itself, each in processes of their own)."""

from __future__ import annotations

import pytest

from benchmarks import progress


def test_idle_cpu_is_read_for_every_process_of_a_cluster():
    fractions = progress._idle("tcp", 2, 0.5)  # after an object moved between the nodes
    assert len(fractions) == 3  # two nodes and the directory
    assert all(0 <= f < 0.5 for f in fractions)  # an idle TCP node does not spin


def test_round_trips_are_timed_per_size():
    times = progress._round_trips("tcp", [1024, 1 << 16], 20)
    assert set(times) == {"1024", "65536"}
    assert all(0 < t < 1.0 for t in times.values())


def test_an_idle_ucx_node_does_not_spin_with_event_progress(monkeypatch):
    """ucxx's own blocking mode keeps a core busy per process once it has
    moved bytes over UCX (99-100 % here); the opt-in event-driven progress
    (transports/ucx_progress.py) must not, also after a transfer."""
    pytest.importorskip("ucxx")
    monkeypatch.setenv("UCXPY_PROGRESS_MODE", "event")
    fractions = progress._idle("ucx", 2, 1.0)
    assert len(fractions) == 3  # two nodes and the directory
    assert all(0 <= f < 0.3 for f in fractions), fractions


def test_ucx_round_trips_still_complete_with_event_progress(monkeypatch):
    pytest.importorskip("ucxx")
    monkeypatch.setenv("UCXPY_PROGRESS_MODE", "event")
    times = progress._round_trips("ucx", [1024, 1 << 20], 20)
    assert all(0 < t < 1.0 for t in times.values())


@pytest.mark.parametrize("shape", ["threaded", "direct"])
def test_the_latency_floor_delivers_every_call_to_every_rank(shape):
    """`latency --floor`: each receiver checks it got the root's bytes in every
    call, and a rank that did not would fail the run."""
    from benchmarks import latency_floor

    row = latency_floor.run(shape, 3, 1024, 4, 1, 0.02)
    assert row["system"] == f"python floor, {shape}" and len(row["samples_s"]) == 4
    assert all(0 < t < 1.0 for t in row["samples_s"])
    assert len(row["cpu_s_per_call_rank"]) == 3
