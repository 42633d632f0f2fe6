"""The simulator drives the real directory state machine; its broadcast times
must match the cost model (docs/cost-model.md)."""

from __future__ import annotations

import pytest

from hoplite_gpu.simulator import simulate_broadcast

MiB = 1 << 20
S, B, C, L = 256 * MiB, 1.25e8, 4 * MiB, 1e-4


@pytest.mark.parametrize("n", [1, 7, 63])
def test_chain_matches_the_pipelined_model(n):
    r = simulate_broadcast(n, S, bandwidth=B, latency=L, chunk=C)
    model = S / B + (n - 1) * (C / B + L) + 2 * L * n  # + locate and first-send latencies
    assert len(r.done_at) == n
    assert r.makespan == pytest.approx(model, rel=0.02)
    assert r.depth() == n  # one receiver per sender: a chain


def test_star_pays_n_times():
    n = 7
    r = simulate_broadcast(n, S, bandwidth=B, latency=L, chunk=C, max_receivers_per_sender=n)
    assert r.depth() == 1
    assert r.makespan == pytest.approx(n * S / B, rel=0.02)


def test_thousands_of_nodes_run_quickly():
    r = simulate_broadcast(2000, 64 * MiB, bandwidth=B, latency=L, chunk=C)
    assert len(r.done_at) == 2000
    # a chain of 2000 pays 1999 chunk-times of fill: still far below a star
    assert r.makespan < 2000 * 64 * MiB / B / 10


def test_late_receivers_are_served_from_complete_copies():
    r = simulate_broadcast(3, 16 * MiB, bandwidth=B, latency=L, chunk=C, arrivals=[0.0, 0.0, 5.0])
    late = dict(r.edges)["n3"]
    assert late in {"n0", "n1", "n2"} and r.done_at["n3"] > 5.0


def test_auto_fanout_beats_the_chain_for_wide_broadcasts():
    n, size = 400, 64 * MiB
    chain = simulate_broadcast(n, size, bandwidth=B, latency=L, chunk=C)
    auto = simulate_broadcast(n, size, bandwidth=B, latency=L, chunk=C, max_receivers_per_sender=0)
    assert auto.makespan < chain.makespan / 2
    small = simulate_broadcast(7, size, bandwidth=B, latency=L, chunk=C, max_receivers_per_sender=0)
    assert small.depth() == 7  # few receivers: the model keeps the chain
