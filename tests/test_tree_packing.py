"""Packed spanning trees (Blink): the bound R*, the packing, the fewest trees,
reduce and allreduce plans, and the split of an object's bytes."""

from __future__ import annotations

import itertools
import math
import time

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hoplite_gpu.topology import Link, Topology, TopologyError, fixture
from hoplite_gpu.trees import PlanError, Tree, TreePlan, bound, pack, planner
from hoplite_gpu.trees import packing as packing_mod
from hoplite_gpu.trees.packing import cut_bound
from hoplite_gpu.trees.routing import Network, Oracle


def assert_valid(plan: TreePlan, topology: Topology) -> None:
    """Checked here without the plan's own `check`: every tree a spanning
    arborescence of the members rooted at the root, every path along links
    through relays only, no link over its capacity."""
    load: dict[tuple, float] = {}
    for tree in plan.trees:
        assert tree.rate > 0
        g = nx.DiGraph(list(tree.edges))
        assert set(g.nodes) == set(plan.members), tree
        assert nx.is_arborescence(g) and g.in_degree(plan.root) == 0, tree
        for (p, c), path in zip(tree.edges, tree.paths, strict=True):
            assert path[0] == p and path[-1] == c
            assert all(h in topology.relays for h in path[1:-1])
            for a, b in zip(path, path[1:], strict=False):
                hops = {"broadcast": [(a, b)], "reduce": [(b, a)],
                        "allreduce": [(a, b), (b, a)]}[plan.flow]
                for link in hops:
                    assert topology.capacity(*link) > 0, link
                    load[link] = load.get(link, 0.0) + tree.rate
    for link, used in load.items():
        assert used <= topology.capacity(*link) * (1 + 1e-7), (link, used)
    assert math.isclose(sum(t.rate for t in plan.trees), plan.rate, rel_tol=1e-9)
    assert plan.rate <= plan.packed * (1 + 1e-9) and plan.packed <= plan.upper * (1 + 1e-9)
    assert plan.upper <= plan.bound * (1 + 1e-9)
    plan.check(topology)


# -- acceptance -----------------------------------------------------------


def test_all_eight_dgx1v_gpus_reach_r_star_in_four_trees():
    """R* is 150 GB/s (six NVLinks into each GPU); four trees carry it: the
    two directions of the NV2 ring at 50 and of the NV1 ring at 25."""
    t = fixture("dgx1v")
    for root in t.nodes:
        plan = pack(t, root)
        assert_valid(plan, t)
        assert plan.bound == 150.0 and plan.packed >= 0.99 * plan.bound
        assert len(plan.trees) <= 6 and plan.rate >= 0.98 * plan.packed
        assert len(plan.trees) == 4 and plan.rate == pytest.approx(150.0)
        assert sorted(t.rate for t in plan.trees) == pytest.approx([25, 25, 50, 50])


def _dgx1v_questions():
    t = fixture("dgx1v")
    for k in range(2, len(t.nodes) + 1):
        for members in itertools.combinations(t.nodes, k):
            for root in members:
                yield t, root, members


def _check_question(t, root, members) -> int:
    r_star = bound(t, root, members)
    if r_star == 0:  # no NVLink path to some member among these GPUs
        with pytest.raises(TopologyError, match="cannot be reached from root"):
            pack(t, root, members)
        return 0
    plan = pack(t, root, members, max_loss=0.02)
    assert_valid(plan, t)
    assert plan.bound == pytest.approx(r_star)
    assert plan.packed >= 0.99 * r_star, (root, members, plan.packed, r_star)
    assert plan.rate >= 0.98 * plan.packed
    return 1


def test_every_root_and_member_subset_of_a_dgx1v_reaches_r_star():
    """Acceptance: all 1,016 (root, members) questions of at least two GPUs
    (247 subsets, each root among them): 864 connected over NVLink, packed
    at >= 0.99 R*. About 7 s of CPU, the longest test here: the sweep is the
    acceptance, and every plan in it is checked."""
    packed = sum(_check_question(*q) for q in _dgx1v_questions())
    assert packed == 864


def test_every_root_and_member_subset_of_an_nvswitch_board_reaches_r_star():
    """Through one NVSwitch each GPU's port caps its rate: R* is 450 GB/s for
    any set, and one chain through the switch carries it all."""
    t = fixture("nvswitch")
    for k in (2, 3, 5, 8):
        for members in itertools.combinations(t.nodes, k):
            plan = pack(t, members[-1], members)
            assert_valid(plan, t)
            assert plan.bound == 450.0 and plan.packed >= 0.99 * 450.0
            assert len(plan.trees) == 1


@pytest.mark.parametrize("name, r_star, trees", [
    ("dgx1v-x2", 50.0, 4), ("nvswitch16", 150.0, 1),
])
def test_sixteen_gpus_plan_in_under_a_second(name, r_star, trees):
    """Acceptance: 16 GPUs (two DGX-1Vs joined by four 100 Gb/s NICs each; a
    DGX-2's NVSwitch) in under 1 s of CPU, caches bypassed."""
    t = fixture(name)
    pack(fixture("dgx1v"), 0, (0, 1))  # (imports networkx and SciPy first)
    planner._cached_pack.cache_clear()
    start = time.process_time()
    plan = pack(t, 0)
    assert time.process_time() - start < 1.0
    assert_valid(plan, t)
    assert plan.bound == r_star and plan.rate == pytest.approx(r_star)
    assert len(plan.trees) == trees


def test_pcie_trees_add_to_nvlink_trees_on_a_dgx1v_with_its_pcie():
    """The hybrid: four NVLink trees (150 GB/s) and one PCIe chain through
    the switches and both CPUs (16 GB/s) make R* = 166."""
    t = fixture("dgx1v-pcie")
    plan = pack(t, 0)
    assert_valid(plan, t)
    assert plan.bound == 166.0 and plan.rate == pytest.approx(166.0)
    kinds = sorted(tree.kinds for tree in plan.trees)
    assert kinds == [("nvlink",)] * 4 + [("pcie", "smp")]


def test_pcie_only_box_is_one_chain():
    t = fixture("pcie")
    plan = pack(t, 5)
    assert_valid(plan, t)
    assert plan.bound == 31.5 and len(plan.trees) == 1 and plan.rate == 31.5


# -- the bound and the proof ------------------------------------------------


def test_relays_that_copy_nothing_can_make_r_star_unreachable_and_the_plan_says_so():
    """Two members behind a switch they cannot send back into: each max-flow
    is 10, but both trees' edges pass the root's one link into the switch,
    so 5 is all trees carry; `upper` proves it."""
    t = Topology([0, 1, 2], [Link(0, "sw", 10.0), Link("sw", 1, 10.0), Link("sw", 2, 10.0)],
                 relays=["sw"])
    plan = pack(t, 0)
    assert_valid(plan, t)
    assert plan.bound == 10.0
    assert plan.rate == pytest.approx(5.0) and plan.upper == pytest.approx(5.0)


def test_the_multiplicative_weights_alone_reach_the_optimum():
    """Without the wide trees as seeds, the packing's own rounds and the
    LP over what they found reach R* and prove it."""
    for name in ("dgx1v", "nvswitch", "dgx1v-pcie", "dgx1v-x2"):
        t = fixture(name)
        net = Network(t, 0, t.nodes)
        r_star, _ = cut_bound(net)
        got = packing_mod.pack(net, r_star, seed=False)
        assert got.rounds > 1
        assert got.rate >= (1 - 0.005) * got.upper and got.upper <= r_star * (1 + 1e-9)
        assert got.rate >= 0.99 * r_star


def test_a_round_limit_stops_the_packing_with_an_honest_gap():
    t = fixture("dgx1v")
    net = Network(t, 0, t.nodes)
    got = packing_mod.pack(net, 150.0, seed=False, max_rounds=2)
    assert got.rounds == 2 and got.rate < got.upper <= 150.0


def test_bound_is_zero_when_the_root_cannot_reach_a_member():
    assert bound(fixture("dgx1v"), 0, [0, 5, 6]) == 0
    assert bound(fixture("dgx1v-pcie"), 0, [0, 5, 6]) == 16.0


# -- the oracle -------------------------------------------------------------


def _brute_cheapest(net: Network, lengths) -> float:
    """The cheapest spanning tree by trying every parent for every member,
    each edge along its cheapest relay path."""
    k = net.k
    best_edge = {}
    for p in range(k):
        for c, (d, _) in net.routes_from(p, lengths).items():
            best_edge[(p, c)] = d
    best = math.inf
    for parents in itertools.product(range(k), repeat=k - 1):
        edges = [(p, c) for c, p in zip(range(1, k), parents, strict=True)]
        if any(e not in best_edge for e in edges):
            continue
        g = nx.DiGraph(edges)
        if len(g) == k and nx.is_arborescence(g):
            best = min(best, sum(best_edge[e] for e in edges))
    return best


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_oracle_finds_the_cheapest_tree(data):
    """Through relays an edge takes the cheapest path; Edmonds over those
    paths finds the cheapest tree (checked by trying every tree)."""
    t = fixture(data.draw(st.sampled_from(["dgx1v-pcie", "nvswitch", "pcie"])))
    members = data.draw(st.lists(st.sampled_from(t.nodes), min_size=2, max_size=5, unique=True))
    net = Network(t, members[0], members)
    lengths = data.draw(st.lists(st.floats(0.0, 10.0), min_size=len(net.caps),
                                 max_size=len(net.caps)))
    key, uses, length = Oracle(net)(lengths)
    assert length == pytest.approx(_brute_cheapest(net, lengths), abs=1e-9)
    assert sum(n * lengths[e] for e, n in uses.items()) == pytest.approx(length)


# -- random small topologies -----------------------------------------------


@st.composite
def topologies(draw):
    n = draw(st.integers(2, 5))
    relays = [f"r{i}" for i in range(draw(st.integers(0, 2)))]
    names = list(range(n)) + relays
    pairs = [(a, b) for a in names for b in names if a != b]
    chosen = draw(st.lists(st.sampled_from(pairs), min_size=1, max_size=len(pairs), unique=True))
    links = [Link(a, b, draw(st.sampled_from([1.0, 2.0, 3.0, 5.0, 12.5]))) for a, b in chosen]
    t = Topology(range(n), links, relays=relays, name="random")
    members = draw(st.lists(st.sampled_from(range(n)), min_size=2, max_size=n, unique=True))
    return t, members[0], members


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topologies(), st.sampled_from(["broadcast", "reduce", "allreduce"]))
def test_plans_on_random_topologies_hold(question, flow):
    """Rate <= R* always, no link over capacity, every tree a spanning
    arborescence; without relays a broadcast's or a reduce's packing reaches
    R* (Edmonds' branching theorem; an allreduce's trees, used both ways,
    need not)."""
    t, root, members = question
    r_star = bound(t, root, members, flow=flow)
    if r_star == 0:
        with pytest.raises(TopologyError, match="cannot be reached"):
            pack(t, root, members, flow=flow)
        return
    plan = pack(t, root, members, flow=flow)
    assert_valid(plan, t)
    assert plan.bound == pytest.approx(r_star)
    assert plan.rate <= r_star * (1 + 1e-9)
    assert plan.packed >= (1 - 0.005) * plan.upper * (1 - 1e-9)
    assert plan.rate >= (1 - 0.01) * plan.packed * (1 - 1e-9)
    if not t.relays and flow != "allreduce":
        assert plan.packed >= 0.995 * r_star * (1 - 1e-9)


# -- reduce and allreduce ---------------------------------------------------


def test_a_reduce_packs_over_the_links_turned_around_and_an_allreduce_both_ways():
    """A triangle, fat (10) away from 0 and around 0 -> 1 -> 2, thin (1) the
    other ways. A broadcast from 0 gets 10 + 1; a reduce to 0 only the two
    thin links into 0; an allreduce's trees use their links both ways, so
    each pair's smaller capacity is shared by every tree through it: three
    pairs of 1, two per tree, make 1.5, below its R* of 2 (proven)."""
    links = [Link(a, b, 10.0) for a, b in [(0, 1), (1, 2), (0, 2)]]
    links += [Link(b, a, 1.0) for a, b in [(0, 1), (1, 2), (0, 2)]]
    t = Topology([0, 1, 2], links)
    down, up, both = pack(t, 0), pack(t, 0, flow="reduce"), pack(t, 0, flow="allreduce")
    for plan in (down, up, both):
        assert_valid(plan, t)
    assert down.rate == pytest.approx(11.0) and up.rate == pytest.approx(2.0)
    assert both.flow == "allreduce" and both.bound == 2.0
    assert both.rate == pytest.approx(1.5) and both.upper == pytest.approx(1.5)
    assert bound(t, 0, flow="reduce") == 2.0


def test_allreduce_trees_on_a_dgx1v_share_each_nvlink_both_ways():
    """Undirected, a DGX-1V has 600 GB/s of link over 7 edges a tree: at
    most 600 / 7 all told, reached."""
    t = fixture("dgx1v")
    plan = pack(t, 0, flow="allreduce")
    assert_valid(plan, t)
    assert plan.packed == pytest.approx(600 / 7, rel=0.005) and plan.bound == 150.0


def test_a_broadcast_plan_reversed_is_a_reduce_plan_on_symmetric_links():
    t = fixture("dgx1v-pcie")
    plan = pack(t, 2)
    up = plan.reversed()
    assert up.flow == "reduce" and up.trees == plan.trees and up.reversed() == plan
    assert_valid(up, t)
    with pytest.raises(PlanError, match="already uses its trees both ways"):
        pack(fixture("nvswitch"), 2, flow="allreduce").reversed()


def test_a_reversed_plan_over_links_too_thin_fails_its_check():
    t = Topology([0, 1], [Link(0, 1, 10.0), Link(1, 0, 1.0)])
    with pytest.raises(PlanError, match="carries 10, over its capacity 1"):
        pack(t, 0).reversed().check(t)


# -- splitting an object across the trees ------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.01, 500.0), min_size=1, max_size=8),
       st.integers(0, 1 << 40), st.integers(1, 1 << 22))
def test_split_covers_every_byte_once_in_proportion(rates, size, align):
    trees = tuple(Tree(r, ((0, 1),), ((0, 1),)) for r in rates)
    plan = TreePlan(root=0, members=(0, 1), flow="broadcast", bound=sum(rates),
                    upper=sum(rates), packed=sum(rates), rate=sum(rates), trees=trees)
    ranges = plan.split(size, align=align)
    assert len(ranges) == len(rates)
    at = 0
    for start, end in ranges:
        assert start == at and end >= start
        assert start % align == 0 or start == size
        assert end % align == 0 or end == size
        at = end
    assert at == size
    units = -(-size // align)
    for (start, end), r in zip(ranges, rates, strict=True):
        share = units * r / sum(rates)
        assert abs(-(-(end - start) // align) - share) <= 1 + 1e-9 or end == size


def test_split_with_start_delays_gives_a_slow_starting_tree_less():
    """A PCIe tree that starts 20 us later: a 1 MB object skips it, a 1 GB
    object gives it about its share of the rate, and every tree finishes at
    once."""
    plan = pack(fixture("dgx1v-pcie"), 0)
    delays = {"pcie": 20e-6}
    small = plan.split(1_000_000, delays=delays)
    big = plan.split(1_000_000_000, delays=delays)
    pcie = [i for i, t in enumerate(plan.trees) if "pcie" in t.kinds]
    assert pcie and all(small[i][0] == small[i][1] for i in pcie)
    share = (big[pcie[0]][1] - big[pcie[0]][0]) / 1e9
    assert 0.9 * 16 / 166 < share < 16 / 166
    finish = [20e-6 * ("pcie" in t.kinds) + (e - s) / (t.rate * 1e9)
              for t, (s, e) in zip(plan.trees, big, strict=True)]
    assert max(finish) - min(finish) < 1e-6
    assert plan.split(1000) == plan.split(1000, delays={})


@pytest.mark.parametrize("kwargs, match", [
    ({"size": -1}, "size must be a whole number"),
    ({"size": 1.5}, "size must be a whole number"),
    ({"size": 10, "align": 0}, "align must be a whole number >= 1"),
    ({"size": 10, "delays": {"pcie": -1.0}}, "delay of 'pcie' must be 0 or more"),
])
def test_split_refuses_bad_arguments(kwargs, match):
    plan = pack(fixture("dgx1v-pcie"), 0)
    with pytest.raises(PlanError, match=match):
        plan.split(**kwargs)


def test_split_with_delays_needs_the_unit():
    t = Topology.undirected([0, 1], [(0, 1, 5.0, "link")])
    with pytest.raises(PlanError, match="unit_bytes_per_s"):
        pack(t, 0).split(100, delays={"link": 1e-6})


# -- questions that are refused ----------------------------------------------


@pytest.mark.parametrize("args, kwargs, match", [
    ((9,), {}, "pack: root 9 is not a node of dgx1v"),
    ((0, [0, 9]), {}, "pack: member 9 is not a node of dgx1v"),
    ((0, [1, 2]), {}, r"pack: root 0 is not among the members \[1, 2\]"),
    ((0, [0, 0, 1]), {}, "name a node twice"),
    ((0, [0]), {}, "needs the root and at least one other member"),
    ((0,), {"flow": "gather"}, "flow must be one of broadcast, reduce, allreduce"),
    ((0,), {"max_loss": 1.0}, r"max_loss must be a fraction in \[0, 1\)"),
    ((0,), {"target": 0}, r"target must be a fraction in \(0, 1\)"),
    ((0, [0, 5, 6]), {}, r"member\(s\) 5, 6 cannot be reached from root 0"),
])
def test_bad_questions_name_the_call_and_the_cause(args, kwargs, match):
    with pytest.raises(TopologyError, match=match):
        pack(fixture("dgx1v"), *args, **kwargs)


def test_a_relay_is_neither_a_root_nor_a_member():
    with pytest.raises(TopologyError, match="root 'nvswitch' is a relay, which holds no data"):
        pack(fixture("nvswitch"), "nvswitch")


def test_plans_are_cached_and_members_order_does_not_matter():
    t = fixture("dgx1v")
    assert pack(t, 2, [4, 2, 0]) is pack(fixture("dgx1v"), 2, (0, 2, 4))


def test_plan_json_has_bound_rate_and_trees_of_edges():
    plan = pack(fixture("nvswitch"), 0, [0, 1, 2])
    data = plan.to_json()
    assert data["bound"] == 450.0 and data["rate"] == 450.0
    assert data["trees"] == [{"rate": 450.0, "edges": [[0, 1], [1, 2]],
                              "paths": [[0, "nvswitch", 1], [1, "nvswitch", 2]],
                              "kinds": ["nvlink"]}]
