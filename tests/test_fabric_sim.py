"""The flow-level fabric simulator (hoplite_gpu/fabric): topologies and their
paths, max-min rates, the event engine, the routings, the collectives against
their closed forms, and hoplite-gpu's own broadcast and reduce."""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

from hoplite_gpu.errors import InvalidArgument
from hoplite_gpu.fabric.hoplite_ops import HopliteBroadcast, HopliteReduce
from hoplite_gpu.fabric.maxmin import max_min_rates
from hoplite_gpu.fabric.network import Network
from hoplite_gpu.fabric.ops import (
    AllToAll,
    PointToPoint,
    RingAllreduce,
    TreeBroadcast,
    TreeReduce,
    chain,
)
from hoplite_gpu.fabric.routes import NO_ROUTE, RouteTable
from hoplite_gpu.fabric.routing import Ecmp
from hoplite_gpu.fabric.run import simulate
from hoplite_gpu.fabric.topology import LEAF_UP, fat_tree, leaf_spine
from hoplite_gpu.simulator import simulate_broadcast, simulate_reduce

MiB = 1 << 20
B = 1.25e9
S = 64 * MiB
ROUTINGS = ["ecmp", "spray", "ethereal"]


# ---------------------------------------------------------------- topology ---
def test_fat_tree_has_its_hosts_links_and_equal_cost_paths():
    f = fat_tree(4)
    assert f.hosts == 16 and f.leaves == 8
    assert f.links == 2 * (16 + 16 + 16)  # host, edge-agg and agg-core cables, both ways
    assert f.middles(0, 0).shape == (1, 0)           # same edge switch: no middle
    assert f.middles(0, 1).shape == (2, 2)           # same pod: one per aggregation switch
    assert f.middles(0, 2).shape == (4, 4)           # other pod: (k/2)^2 through the core
    assert f.middles(0, 2) is f.middles(0, 2)        # cached per pair of leaves
    for path in f.middles(0, 7):
        ends = [f.ends[i] for i in path]
        assert ends[0][0] == "edge0" and ends[-1][1] == "edge7"
        assert all(a[1] == b[0] for a, b in zip(ends, ends[1:], strict=False))


def test_leaf_spine_uplinks_carry_the_oversubscribed_share():
    f = leaf_spine(8, 4, 2, oversubscription=2.0, host_bps=B)
    up = f.capacity[f.layer == LEAF_UP]
    assert f.hosts == 32 and len(up) == 8
    assert up == pytest.approx(np.full(8, 8 * B / (2 * 2.0)))
    assert f.middles(0, 3).shape == (2, 2)


@pytest.mark.parametrize("call, match", [
    (lambda: fat_tree(5), "fat_tree: k must be an even"),
    (lambda: fat_tree(4, host_bps=0), "fat_tree: host_bps"),
    (lambda: leaf_spine(0, 2, 2), "leaf_spine: hosts_per_leaf"),
    (lambda: leaf_spine(2, 2, 2, oversubscription=-1), "leaf_spine: oversubscription"),
    (lambda: fat_tree(4, failed=[("h0", "edge0")]), "host's own link"),
    (lambda: fat_tree(4, failed=[("edge0", "core0")]), "no cable between"),
    (lambda: fat_tree(4, failed=10**6), "fat-tree: failed must be 0 to"),
])
def test_bad_fabrics_are_refused_naming_the_call_and_the_cause(call, match):
    with pytest.raises(InvalidArgument, match=match):
        call()


def test_failed_links_are_left_out_of_every_path():
    f = fat_tree(4, failed=[("edge0", "agg0")])
    dead = set(f.failed)
    assert len(dead) == 2
    assert f.capacity[list(dead)].sum() == 0
    assert f.middles(0, 2).shape == (2, 4)           # agg0's two cores are gone
    assert not set(f.middles(0, 2).ravel()) & dead
    assert not set(f.middles(2, 0).ravel()) & dead   # and the way back
    assert f.uplinks(0) == 1 and f.uplinks(1) == 2
    chosen = fat_tree(8, failed=3, seed=7)
    assert chosen.failed == fat_tree(8, failed=3, seed=7).failed and len(chosen.failed) == 6


def test_a_pair_cut_off_by_failures_is_refused():
    f = leaf_spine(2, 2, 1, failed=[("leaf0", "spine0")])
    with pytest.raises(InvalidArgument, match="leave no shortest path from leaf 0 to leaf 1"):
        f.middles(0, 1)


# ------------------------------------------------------------------ max-min ---
def _max_min_conditions(cap, up, down, route, table, rate):
    """Feasible, and every flow has a bottleneck: a full link on which no flow
    is faster (what defines the max-min fair allocation)."""
    ptr, link, weight = table.flat()
    load = np.bincount(up, rate, len(cap)) + np.bincount(down, rate, len(cap))
    links_of = []
    for i, r in enumerate(route):
        ls = [(up[i], 1.0), (down[i], 1.0)]
        if r != NO_ROUTE:
            ls += list(zip(link[ptr[r]:ptr[r + 1]].tolist(), weight[ptr[r]:ptr[r + 1]].tolist(),
                           strict=True))
            np.add.at(load, link[ptr[r]:ptr[r + 1]], rate[i] * weight[ptr[r]:ptr[r + 1]])
        links_of.append(ls)
    assert (load <= cap * (1 + 1e-9)).all()
    for i, ls in enumerate(links_of):
        ok = False
        for li, _ in ls:
            if load[li] < cap[li] * (1 - 1e-9):
                continue
            on = [j for j, other in enumerate(links_of) if any(li == x for x, _ in other)]
            if rate[i] >= max(rate[j] for j in on) * (1 - 1e-9):
                ok = True
        assert ok, f"flow {i} at {rate[i]} has no bottleneck"


def test_max_min_rates_of_the_textbook_example():
    # link 0 (cap 1) carries a, b, c; link 1 (cap 1) carries c, d; link 2 (cap 10): c's other end
    cap = np.array([1.0, 1.0, 10.0, 10.0, 10.0, 10.0, 0.3])
    up = np.array([0, 0, 0, 1])
    down = np.array([3, 4, 2, 6])
    rate = max_min_rates(cap, up, down, np.full(4, NO_ROUTE), RouteTable(len(cap)).flat())
    # d is held to 0.3 by link 6, so c gets 1/3 on link 0 with a and b
    assert rate == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.3])


def test_max_min_rates_meet_the_bottleneck_conditions_on_random_flows():
    rng = np.random.default_rng(3)
    f = fat_tree(4)
    for routing in ROUTINGS:
        net = Network(f, routing, seed=1)
        table = net.routes
        src = rng.integers(0, 16, 60)
        dst = (src + rng.integers(1, 16, 60)) % 16
        flow, route, _ = net.router.assign(src, dst, np.full(60, 1.0))
        up, down = f.host_up[src[flow]], f.host_down[dst[flow]]
        cap = f.capacity * rng.uniform(0.5, 1.5, f.links)
        rate = max_min_rates(cap, up, down, route, table.flat())
        _max_min_conditions(cap, up, down, route, table, rate)


# ------------------------------------------------------------------- engine ---
def _reference_ends(fabric, flows, routes_table, route):
    """Completion times by the plainest event loop: every active flow's rates
    recomputed from scratch at every start and end."""
    t, rem = 0.0, {}
    starts = sorted(range(len(flows)), key=lambda i: flows[i][0])
    ends = {}
    while starts or rem:
        ids = sorted(rem)
        if ids:
            rate = max_min_rates(fabric.capacity,
                                 fabric.host_up[[flows[i][1] for i in ids]],
                                 fabric.host_down[[flows[i][2] for i in ids]],
                                 np.array([route[i] for i in ids]), routes_table.flat())
            dt_end = min(rem[i] / r for i, r in zip(ids, rate, strict=True))
        else:
            rate, dt_end = [], math.inf
        dt_start = flows[starts[0]][0] - t if starts else math.inf
        dt = min(dt_end, dt_start)
        for i, r in zip(ids, rate, strict=True):
            rem[i] -= r * dt
        t += dt
        for i in [i for i in ids if rem[i] <= 1e-9 * flows[i][3]]:
            ends[i] = t
            del rem[i]
        while starts and flows[starts[0]][0] <= t:
            i = starts.pop(0)
            rem[i] = flows[i][3]
    return ends


@pytest.mark.parametrize("routing", ROUTINGS)
def test_engine_matches_a_full_recomputation_at_every_event(routing):
    """The calendar and the partial refill after ends change nothing: flows of
    random sizes starting at random times end when recomputing everything at
    every event says they do."""
    rng = np.random.default_rng(11)
    f = fat_tree(4)
    flows = [(float(rng.choice([0.0, rng.uniform(0, 0.05)])), int(s), int((s + d) % 16),
              float(rng.uniform(1, 20) * MiB))
             for s, d in zip(rng.integers(0, 16, 80), rng.integers(1, 16, 80), strict=True)]
    net = Network(f, routing, seed=5)
    got, route = {}, {}

    def start(i):
        def go(t):
            net.send(flows[i][1], flows[i][2], flows[i][3], lambda u: got.__setitem__(i, u))
        return go
    for i, fl in enumerate(flows):
        net.at(fl[0], start(i))
    net.run()
    if routing != "ethereal":  # (one flow, one route: the reference can replay it)
        # replay the routes the router drew, in the order flows were sent
        replay = Network(f, routing, seed=5)
        order = sorted(range(len(flows)), key=lambda i: (flows[i][0], i))
        for i in order:
            _, r, _ = replay.router.assign(np.array([flows[i][1]]), np.array([flows[i][2]]),
                                           np.array([flows[i][3]]))
            route[i] = int(r[0])
        ref = _reference_ends(f, flows, replay.routes, route)
        for i in range(len(flows)):
            assert got[i] == pytest.approx(ref[i], rel=1e-9)
    assert len(got) == len(flows)
    assert net.engine.partial + net.engine.full <= net.engine.events + len(flows)


def test_merged_ends_stay_within_the_merge_fraction():
    f = fat_tree(4)
    exact = simulate(f, AllToAll(list(range(16)), S), "ecmp", seed=2)
    merged = simulate(f, AllToAll(list(range(16)), S), "ecmp", seed=2, merge=1e-3)
    assert merged.completion_s == pytest.approx(exact.completion_s, rel=1e-3)
    assert merged.events <= exact.events


# -------------------------------------------------------------- closed forms ---
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("fabric", [fat_tree(4), leaf_spine(4, 4, 4)], ids=["fat-tree", "leaf-spine"])
def test_point_to_point_takes_size_over_bandwidth(fabric, routing):
    r = simulate(fabric, PointToPoint(0, fabric.hosts - 1, S), routing)
    assert r.completion_s == pytest.approx(S / B, rel=1e-12)
    assert r.bound_s == pytest.approx(S / B, rel=1e-12)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("placement", ["linear", "shuffled"])
def test_ring_allreduce_takes_2_p_minus_1_over_p_size_over_bandwidth(routing, placement):
    f = fat_tree(4)
    ring = list(range(16)) if placement == "linear" else np.random.default_rng(0).permutation(
        16).tolist()
    r = simulate(f, RingAllreduce(ring, S), routing, seed=1)
    closed = 2 * 15 / 16 * S / B
    assert r.bound_s == pytest.approx(closed, rel=1e-12)
    if routing != "spray" and placement == "shuffled":
        # single-path flows can collide in the core (ECMP's draws; Ethereal's
        # greedy with 2 sub-flows per flow on a 16-host fabric)
        assert r.completion_s >= closed * (1 - 1e-12)
    else:
        assert r.completion_s == pytest.approx(closed, rel=0.01)


@pytest.mark.parametrize("op", [TreeBroadcast, TreeReduce])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_a_pipelined_chain_takes_chunks_plus_hops_minus_one_chunk_times(op, routing):
    f = fat_tree(4)
    hops, chunks = 15, 32
    # (spraying never collides; single paths stay off each other only with
    # the chain laid in host order)
    order = (np.random.default_rng(4).permutation(16).tolist() if routing == "spray"
             else list(range(16)))
    r = simulate(f, op(order[0], chain(order), S, chunks), routing)
    closed = (chunks + hops - 1) * (S / chunks) / B
    assert r.completion_s == pytest.approx(closed, rel=0.01)
    assert r.bound_s == pytest.approx(S / B)


def test_a_star_shares_the_root_uplink():
    f = leaf_spine(4, 2, 2)
    r = simulate(f, TreeBroadcast(0, {h: 0 for h in range(1, 8)}, S, 8), "spray")
    assert r.completion_s == pytest.approx(7 * S / B, rel=1e-9)


def test_all_to_all_sprayed_on_a_nonblocking_fabric_is_host_bound():
    f = fat_tree(4)
    r = simulate(f, AllToAll(list(range(16)), S), "spray")
    assert r.completion_s == pytest.approx(15 / 16 * S / B, rel=1e-9)
    assert r.bound_s == pytest.approx(15 / 16 * S / B, rel=1e-9)


def test_oversubscription_bounds_a_ring_across_leaves_by_the_uplinks():
    """Every rank's neighbour is under another leaf (a ring striding over the
    leaves), so each leaf sends h pieces per step through uplinks carrying
    h B / x: each step takes x times longer."""
    f = leaf_spine(4, 4, 2, oversubscription=2.0)
    ring = [leaf * 4 + j for j in range(4) for leaf in range(4)]
    r = simulate(f, RingAllreduce(ring, S), "spray")
    closed = 2.0 * 2 * 15 / 16 * S / B
    assert r.bound_s == pytest.approx(closed, rel=1e-9)
    assert r.completion_s == pytest.approx(closed, rel=0.01)


# ------------------------------------------------------------------ routings ---
def _max_load_distribution(n: int, m: int) -> dict[int, Fraction]:
    """P(the fullest of m bins holds k) for n balls thrown uniformly at random:
    P(max <= k) = n!/m^n [x^n] (sum_{j<=k} x^j/j!)^m."""
    def at_most(k: int) -> Fraction:
        poly = [Fraction(1)]
        one = [Fraction(1, math.factorial(j)) for j in range(k + 1)]
        for _ in range(m):
            nxt = [Fraction(0)] * min(len(poly) + k, n + 1)
            for i, a in enumerate(poly):
                for j, b in enumerate(one):
                    if i + j <= n:
                        nxt[i + j] += a * b
            poly = nxt
        coef = poly[n] if n < len(poly) else Fraction(0)
        return coef * math.factorial(n) / Fraction(m) ** n
    cdf = {k: at_most(k) for k in range(n + 1)}
    return {k: cdf[k] - (cdf[k - 1] if k else 0) for k in range(1, n + 1)}


def test_the_exact_max_load_distribution_sums_to_one():
    d = _max_load_distribution(3, 2)
    assert sum(d.values()) == 1 and d[2] == Fraction(3, 4) and d[3] == Fraction(1, 4)


def test_ecmp_max_uplink_load_follows_balls_in_bins():
    """n flows from n hosts of one leaf to another leaf over m spines: ECMP's
    fullest uplink holds the maximum of n balls in m bins. Over 3,000 seeded
    draws the counts pass a chi-square test against the exact distribution
    (fixed seeds: the outcome is the same every run), and the mean sits within
    four standard errors of the exact expectation."""
    n, m, runs = 8, 8, 3000
    f = leaf_spine(n, 2, m)
    dist = _max_load_distribution(n, m)
    table = RouteTable(f.links)
    router = Ecmp(f, table, seed=2026)
    src, dst = np.arange(n), np.arange(n, 2 * n)
    counts = np.zeros(n + 1)
    for _ in range(runs):
        _, route, _ = router.assign(src, dst, np.ones(n))
        per = np.bincount(route, minlength=len(table))
        loads = table.link_bytes(per.astype(float))
        counts[int(loads[f.layer == LEAF_UP].max())] += 1
    expected = np.array([float(dist.get(k, 0)) * runs for k in range(n + 1)])
    from scipy.stats import chi2
    keep = expected >= 5
    stat = float((((counts - expected) ** 2 / np.where(keep, expected, 1))[keep]).sum()
                 + 0.0)
    lumped_obs, lumped_exp = counts[~keep].sum(), expected[~keep].sum()
    stat += (lumped_obs - lumped_exp) ** 2 / lumped_exp
    assert chi2.sf(stat, int(keep.sum())) > 1e-3, (counts, expected)
    mean = sum(k * float(p) for k, p in dist.items())
    var = sum(k * k * float(p) for k, p in dist.items()) - mean ** 2
    got = (counts * np.arange(n + 1)).sum() / runs
    assert abs(got - mean) < 4 * math.sqrt(var / runs)


def test_ecmp_max_link_load_in_a_run_is_the_fullest_bin():
    f = leaf_spine(8, 2, 8)
    r = simulate(f, AllToAll(list(range(16)), 16 * MiB), "ecmp", seed=9)
    loads = r.link_bytes[f.layer == LEAF_UP]
    assert r.max_link_load_bytes == pytest.approx(loads.max())
    assert np.allclose(loads / MiB % 1, 0)   # whole flows of 1 MiB per uplink


@pytest.mark.parametrize("op, f", [("ring", leaf_spine(4, 8, 4)), ("alltoall", fat_tree(8))],
                         ids=["ring-leaf-spine", "alltoall-fat-tree"])
def test_ethereal_loads_links_within_one_sub_flow_of_spraying(op, f):
    hosts = np.random.default_rng(1).permutation(f.hosts).tolist()
    make = (lambda: RingAllreduce(hosts, S)) if op == "ring" else (lambda: AllToAll(hosts, S))
    spray = simulate(f, make(), "spray")
    eth = simulate(f, make(), "ethereal")
    again = simulate(f, make(), "ethereal")
    assert eth.max_link_load_bytes <= spray.max_link_load_bytes + eth.largest_part_bytes * (1 + 1e-9)
    assert eth.completion_s == again.completion_s                 # deterministic
    assert eth.completion_s <= spray.completion_s * 1.05


def test_sprayed_bytes_avoid_failed_links():
    f = fat_tree(4, failed=[("edge0", "agg0"), ("agg3", "core2")])
    r = simulate(f, AllToAll(list(range(16)), S), "spray")
    assert r.link_bytes[list(f.failed)].sum() == 0
    assert r.completion_s >= r.bound_s * (1 - 1e-9)


def test_ethereal_splits_only_as_much_as_the_uplinks_need():
    f = fat_tree(4)
    net = Network(f, "ethereal")
    one, _, size = net.router.assign(np.array([0]), np.array([8]), np.array([8.0]))
    assert len(one) == 2 and size.tolist() == [4.0, 4.0]      # one flow over 2 uplinks
    many, _, _ = net.router.assign(np.array([0, 0]), np.array([8, 9]), np.array([8.0, 8.0]))
    assert len(many) == 2                                     # two flows: no split


# ------------------------------------------------------------ hoplite's ops ---
def test_hoplite_broadcast_on_a_quiet_fabric_matches_the_host_link_simulator():
    """Placed in order on a non-blocking fat-tree, hoplite-gpu's chain meets no
    other flow in the core: the fabric's time is simulator.py's."""
    f = fat_tree(4)
    for routing in ROUTINGS:
        r = simulate(f, HopliteBroadcast(list(range(16)), S, chunk=4 * MiB), routing)
        ref = simulate_broadcast(15, S, bandwidth=B, latency=1e-4, chunk=4 * MiB)
        assert r.completion_s == pytest.approx(ref.makespan, rel=1e-9)


def test_hoplite_reduce_on_a_quiet_fabric_matches_the_host_link_simulator():
    f = fat_tree(4)
    r = simulate(f, HopliteReduce(list(range(16)), S, chunk=4 * MiB), "ethereal")
    ref = simulate_reduce(15, S, bandwidth=B, latency=1e-4, chunk=4 * MiB)
    assert r.completion_s == pytest.approx(ref.makespan, rel=1e-9)
    assert r.bound_s == pytest.approx(S / B)


def test_hoplite_broadcast_shuffled_over_a_fabric_reaches_every_host():
    f = fat_tree(4)
    hosts = np.random.default_rng(2).permutation(16).tolist()
    op = HopliteBroadcast(hosts, S, arrivals=[0.0] * 14 + [0.5])
    r = simulate(f, op, "ecmp", seed=3)
    assert sorted(op.done_at) == sorted(hosts[1:])
    assert op.done_at[hosts[-1]] > 0.5
    assert r.completion_s >= r.bound_s


# ------------------------------------------------------------------ refusals ---
@pytest.mark.parametrize("call, match", [
    (lambda n: n.send(0, 0, 1.0, print), "sending to itself"),
    (lambda n: n.send(0, 99, 1.0, print), "Network.send: hosts are 0 to 15"),
    (lambda n: n.send(0, 1, -1.0, print), "Network.send: nbytes must be positive"),
    (lambda n: n.at(-1.0, print), "Network.at: time -1.0 is before now"),
])
def test_bad_messages_are_refused_naming_the_call(call, match):
    with pytest.raises(InvalidArgument, match=match):
        call(Network(fat_tree(4), "spray"))


def test_bad_routing_and_ops_are_refused():
    with pytest.raises(InvalidArgument, match="make_router: routing must be one of"):
        Network(fat_tree(4), "valiant")
    with pytest.raises(InvalidArgument, match="RingAllreduce: needs at least 2 hosts"):
        RingAllreduce([3], S)
    with pytest.raises(InvalidArgument, match="TreeBroadcast: the tree has a cycle"):
        TreeBroadcast(0, {1: 2, 2: 1}, S)
    with pytest.raises(InvalidArgument, match="HopliteReduce: a float32 input"):
        HopliteReduce([0, 1, 2], 7)


def test_the_directory_driver_imports_with_the_standard_library_alone():
    root = pathlib.Path(__file__).resolve().parents[1]
    code = (f"import sys; sys.path.insert(0, {str(root)!r}); "
            "from hoplite_gpu.sim_directory import BroadcastDirector; "
            "d = BroadcastDirector(2, 1 << 20); d.start(); "
            "print([p.sender for p in d.locate('n1') + d.locate('n2')])")
    r = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "['n0', 'n1']", r.stderr


def test_a_reduce_bound_spares_the_tightest_leaf_which_may_hold_the_root():
    """Leaf 0 lost one of its two uplinks (a quarter of B each): a reduce whose
    root the directory picks may put it there, so the bound is the next leaf's
    S / (B/2); a broadcast from leaf 1 must get into leaf 0: S / (B/4)."""
    from hoplite_gpu.fabric.bounds import spread_bound
    f = leaf_spine(2, 3, 2, oversubscription=4.0, failed=[("leaf0", "spine0")])
    inputs = np.arange(6)
    assert spread_bound(f, None, inputs, S, inward=False) == pytest.approx(2 * S / B)
    assert spread_bound(f, 2, np.array([0, 1, 3, 4, 5]), S, inward=True) == pytest.approx(
        4 * S / B)


@pytest.mark.slow
def test_all_to_all_on_1024_hosts_sprayed_meets_the_host_bound():
    """A million flows at once (1,024 hosts, fat-tree k = 16): spraying keeps
    every host link the bottleneck, so all end together at (p-1)/p S/B."""
    f = fat_tree(16)
    r = simulate(f, AllToAll(list(range(f.hosts)), S), "spray")
    assert r.flows == 1024 * 1023
    assert r.completion_s == pytest.approx(1023 / 1024 * S / B, rel=1e-9)
    assert r.completion_s == pytest.approx(r.bound_s, rel=1e-9)
