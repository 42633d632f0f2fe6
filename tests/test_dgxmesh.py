"""The emulated GPU mesh (benchmarks/dgxmesh.py) and its benchmark
(`python -m benchmarks dgxmesh`, benchmarks/dgxmeshrun.py): links and
units from the topology, fixed routes between GPUs with no link, member
sets, refusals of bad settings and arguments, building, shaping, routing,
tearing down after errors and sweeping killed runs' namespaces; a tree
broadcast's bytes on its trees' links alone. Tests that need network
namespaces make them only through the harness and skip with the reason
where namespaces cannot be made."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
from namespaces import (
    check_a_killed_runs_namespaces_are_swept,
    check_an_error_inside_the_run_tears_it_down,
    dead_tag,
    ours,
)

from benchmarks import dgxmesh, emulated
from benchmarks.dgxmesh import DgxMesh, sweep_stale
from benchmarks.emulated import EmulationUnavailable
from hoplite_gpu.topology import fixture, from_json

#: GPUs of the DGX-1V each GPU has a link to
DGX1V_NEIGHBOURS = {0: {1, 2, 3, 4}, 1: {0, 2, 3, 5}, 2: {0, 1, 3, 6}, 3: {0, 1, 2, 7},
                    4: {0, 5, 6, 7}, 5: {1, 4, 6, 7}, 6: {2, 4, 5, 7}, 7: {3, 4, 5, 6}}


# ---------------------------------------------------- layout, no root needed ---
def test_links_and_units_come_from_the_topology():
    m = DgxMesh(unit_bps=10e6)
    assert m.hosts == 8 and len(m.pairs) == 16 and m.base == 25.0
    for i in range(8):
        assert set(m.neighbours(i)) == DGX1V_NEIGHBOURS[i]
    assert m.multiplicity(0, 3) == m.multiplicity(3, 0) == 2  # NV2
    assert m.multiplicity(0, 1) == 1 and m.multiplicity(0, 5) == 0  # NV1; none
    assert m.rate_bps(4, 7) == 20e6
    hosts = m.node_hosts(0).split(",")
    assert hosts[0] == "10.66.0.1/32" and len(hosts) == 5
    # the two ends of a link share its /30, and no other link's
    a, b = m.link_address(2, 6), m.link_address(6, 2)
    assert a.rsplit(".", 1)[0] == b.rsplit(".", 1)[0] and a != b
    assert f"{a}/30" in m.node_hosts(2) and f"{b}/30" in m.node_hosts(6)
    assert m.prefix != DgxMesh().prefix  # two meshes of one process never share a name


def test_gpus_with_no_link_take_a_fixed_two_hop_path_the_same_both_ways():
    m = DgxMesh()
    routed = 0
    for i in range(8):
        for j in range(8):
            if i == j:
                continue
            p = m.path(i, j)
            assert p == list(reversed(m.path(j, i)))
            if j in DGX1V_NEIGHBOURS[i]:
                assert p == [i, j]
                continue
            routed += 1
            assert len(p) == 3 and p[1] in DGX1V_NEIGHBOURS[i] & DGX1V_NEIGHBOURS[j]
    assert routed == 24
    # the widest of the common neighbours, the lowest index on a tie
    assert m.path(0, 5) == [0, 1, 5] and m.path(3, 4) == [3, 0, 4]
    assert m.report()["routed"]["0-7"] == [0, 4, 7]


def test_a_member_set_has_only_the_links_among_its_members():
    m = DgxMesh(members=[0, 1, 4])
    assert m.hosts == 3 and m.pairs == [(0, 1), (0, 2)]  # 0-1 (NV1), 0-4 (NV2)
    assert m.multiplicity(0, 2) == 2 and m.path(1, 2) == [1, 0, 2]
    assert m.topology.nodes == (0, 1, 4) and len(m.topology.links) == 4
    # a path through members only, three hops where the set needs them
    far = DgxMesh(members=[0, 1, 5, 7])
    assert [far.members[k] for k in far.path(0, 3)] == [0, 1, 5, 7]
    # one unit stays the whole topology's smallest link, though the set has none
    assert DgxMesh(members=[0, 3]).multiplicity(0, 1) == 2


def test_another_topology_builds_its_own_mesh():
    line = from_json({"name": "line", "nodes": ["a", "b", "c"],
                      "links": [{"a": "a", "b": "b", "capacity": 10},
                                {"a": "b", "b": "c", "capacity": 30}]})
    m = DgxMesh(line, unit_bps=1e6)
    assert m.multiplicity(0, 1) == 1 and m.rate_bps(1, 2) == 3e6
    assert m.path(0, 2) == [0, 1, 2] and m.report()["routed"] == {"a-c": ["a", "b", "c"]}


@pytest.mark.parametrize("kw, message", [
    ({"topology": "dgx1v"}, "must be a hoplite_gpu.topology.Topology"),
    ({"topology": fixture("nvswitch")}, "has relays"),
    ({"members": [0]}, "at least 2 members"),
    ({"members": [0, 1, 1]}, "distinct"),
    ({"members": [0, 9]}, r"\[9\] are not nodes"),
    ({"members": [0, 5]}, "0 and 5 are joined by no path over links among the members"),
    ({"unit_bps": 999}, "at least 1000"),
    ({"unit_bps": math.nan}, "finite"),
    ({"unit_bps": True}, "unit_bps"),
])
def test_bad_settings_are_refused_before_anything_is_made(kw, message):
    with pytest.raises(ValueError, match=message):
        DgxMesh(**kw)


def test_a_link_one_way_only_is_refused():
    one_way = from_json({"nodes": [0, 1], "links": [
        {"a": 0, "b": 1, "capacity": 1, "directed": True}]})
    with pytest.raises(ValueError, match="0 -> 1 goes one way only"):
        DgxMesh(one_way)


# ------------------------------------------------------------- namespaces ---
@pytest.mark.timeout(60)
def test_builds_shapes_routes_through_one_hop_and_tears_down():
    mesh = DgxMesh(members=[0, 1, 4], unit_bps=400e6)  # ranks 0, 1, 2 on GPUs 0, 1, 4
    try:
        with mesh:
            assert sorted(ours(mesh)) == sorted(mesh.ns(i) for i in range(3))
            qdiscs = json.loads(subprocess.run(["tc", "-n", mesh.ns(0), "-j", "qdisc", "show"],
                                               capture_output=True, text=True).stdout)
            rates = {q["dev"]: q["options"]["rate"] for q in qdiscs if q["kind"] == "tbf"}
            assert rates == {"to1": 50_000_000, "to2": 100_000_000}  # bytes/s: 1 and 2 units
            # GPU 1 reaches GPU 4 through GPU 0, and its host address is the source
            route = subprocess.run(["ip", "-n", mesh.ns(1), "route", "get", mesh.address(2)],
                                   capture_output=True, text=True).stdout
            assert f"via {mesh.link_address(0, 1)} dev to0 src {mesh.address(1)}" in route
            before, forwarded = mesh.link_bytes(), mesh.forwarded()
            nbytes = 1 << 20
            mesh.measure_link(nbytes, src=1, dst=2)
            moved = {k: v - before[k] for k, v in mesh.link_bytes().items()}
            assert moved[1, 0] >= nbytes and moved[0, 4] >= nbytes, moved
            assert moved[0, 1] < nbytes / 8 and moved[4, 0] < nbytes / 8, moved  # (acks)
            assert [b - a for a, b in zip(forwarded, mesh.forwarded(), strict=True)][0] > 0
            assert [c[0] for c in mesh.link_counters()][2] >= nbytes  # what reached GPU 4
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    assert not ours(mesh)


@pytest.mark.timeout(60)
def test_every_tree_edge_of_the_full_mesh_is_routed_over_its_own_link():
    """A tree broadcast pulls each range from its parent's host address: the
    route there must be the direct link, both ways, or the bytes would be
    forwarded through a third GPU."""
    from hoplite_gpu.trees import pack

    mesh = DgxMesh()
    plan = pack(mesh.topology, 0, mesh.members)
    edges = {(p, c) for tree in plan.trees for p, c in tree.edges}
    assert len(plan.trees) == 4
    ends = {}  # namespace -> the ranks it must reach over its own link
    for parent, child in edges:
        ends.setdefault(child, set()).add(parent)
        ends.setdefault(parent, set()).add(child)
    try:
        with mesh:
            for a, others in sorted(ends.items()):
                asks = "".join(f"route get {mesh.address(b)}\n" for b in sorted(others))
                routes = subprocess.run(["ip", "-n", mesh.ns(a), "-batch", "-"], input=asks,
                                        capture_output=True, text=True).stdout.splitlines()
                got = [ln for ln in routes if ln.startswith("10.66.")]
                assert len(got) == len(others), routes
                for b, route in zip(sorted(others), got, strict=True):
                    assert f"dev to{b} " in route and f"src {mesh.address(a)}" in route, route
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("error", [KeyboardInterrupt, subprocess.CalledProcessError])
def test_a_failed_build_leaves_nothing(monkeypatch, error):
    # a Ctrl-C or a failing command halfway through the build (after every
    # namespace was made, during a link)
    real, calls = dgxmesh._sh, []

    def sh(*argv, check=True):
        calls.append(argv)
        if argv[:3] == ("ip", "link", "add") and sum(a[:3] == ("ip", "link", "add")
                                                    for a in calls) == 2:
            raise error(1, argv) if error is subprocess.CalledProcessError else error()
        return real(*argv, check=check)

    monkeypatch.setattr(dgxmesh, "_sh", sh)
    monkeypatch.setattr(emulated, "_sh", sh)  # (namespaces are made by the shared base)
    mesh = DgxMesh(members=[0, 1, 2])
    try:
        with pytest.raises(error), mesh:
            pass
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    # (the namespaces of the three ranks; the check's probe is not one)
    assert sum(a[:3] == ("ip", "netns", "add") and not a[3].endswith("probe")
               for a in calls) == 3
    assert not ours(mesh)


@pytest.mark.timeout(60)
def test_an_error_inside_the_run_tears_the_mesh_down():
    check_an_error_inside_the_run_tears_it_down(DgxMesh(members=[0, 3]), 2)


@pytest.mark.timeout(60)
def test_namespaces_of_a_killed_run_are_swept_and_live_ones_kept():
    dead = dead_tag()
    check_a_killed_runs_namespaces_are_swept(
        sweep_stale, [f"dm{dead}x0g0", f"dm{dead}x3probe"], f"{DgxMesh().prefix}g9")


# ------------------------------------------------ python -m benchmarks dgxmesh ---
@pytest.mark.parametrize("argv, message", [
    (["--sets", "0,9"], "--sets 0,9: GPU '9' is not in dgx1v"),
    (["--sets", "full", "0,5"], "--sets 0,5: .*0 and 5 are joined by no path"),
    (["--sets", "0,1,1"], "--sets 0,1,1: .*distinct"),
    (["--sets", "0"], "--sets 0: .*at least 2 members"),
    (["--topology", "no-such-file.json"], "--topology no-such-file.json: .*cannot be read"),
    (["--topology", "nvswitch"], "--topology nvswitch: nvswitch has relays"),
    (["--sets", "full", "0,1", "full"], "--sets full: given twice"),
])
def test_bad_sets_and_topologies_are_refused_before_anything_runs(argv, message):
    from benchmarks.__main__ import main

    with pytest.raises(SystemExit, match=f"^dgxmesh: {message}"):
        main(["dgxmesh", "--no-save", *argv])


@pytest.mark.parametrize("argv", [["--unit", "999"], ["--unit", "40Q"], ["--repeats", "0"],
                                  ["--op", "reduce"], ["--systems", "gloo"], ["--size", "6B"]])
def test_bad_arguments_are_usage_errors(argv, capsys):
    from benchmarks.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["dgxmesh", "--no-save", *argv])
    assert exc.value.code == 2
    assert f"argument {argv[0]}" in capsys.readouterr().err


def test_a_rate_reads_decimal_units():
    from benchmarks.dgxmeshrun import unit

    assert unit("40M") == 40e6 and unit("1.5G") == 1.5e9 and unit("2500") == 2500


def test_a_tree_broadcast_is_checked_for_bytes_off_its_trees():
    from benchmarks.dgxmeshrun import OFF_TREE_SLACK, tree_links
    from hoplite_gpu.trees import pack

    mesh = DgxMesh(members=[0, 3, 4, 7])
    plan = pack(mesh.topology, 0, mesh.members)
    size = 8 << 20
    want = {}
    for tree, (a, b) in zip(plan.trees, plan.split(size), strict=True):
        for p, c in tree.edges:
            want[f"{p}>{c}"] = want.get(f"{p}>{c}", 0) + (b - a)
    links = [f"{mesh.members[i]}>{mesh.members[j]}" for i, j in mesh.pairs]
    links += [f"{b}>{a}" for a, b in (x.split(">") for x in links)]
    moved = {k: want.get(k, 0) + 4000 for k in links}  # (a little control traffic)
    assert tree_links(mesh, plan, size, 1, moved)["direct_links"]
    unused = next(k for k in links if k not in want)
    moved[unused] += OFF_TREE_SLACK + 1  # bytes forwarded over a link no tree has
    bad = tree_links(mesh, plan, size, 1, moved)
    assert not bad["direct_links"] and list(bad["off_tree_bytes"]) == [unused]
    used = next(iter(want))
    moved[used] = want[used] - 1
    assert used in tree_links(mesh, plan, size, 1, moved)["tree_links_short"]


def test_the_plot_draws_every_set_and_op(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.plots import dgxmesh_ratios

    sets = [{"set": s, "op": op, "system": system, "size_bytes": 1 << 20, "bound_s": 1.0,
             "ratio_to_bound": r, "p25_s": r - 0.05, "p75_s": r + 0.05}
            for s in ("full", "0,1,4") for op in ("broadcast", "allreduce")
            for system, r in (("hoplite-multitree", 1.1), ("openmpi-tuned", 3.0))
            if op == "broadcast" or s == "full"]
    out = dgxmesh_ratios({"sets": sets, "settings": {"topology": "dgx1v"}},
                         tmp_path / "dgxmesh-2026-12-10.png")
    assert out.stat().st_size > 0


@pytest.mark.slow  # a directory and 8 nodes started in namespaces: about 7 s here
@pytest.mark.timeout(240)
def test_a_tree_broadcast_crosses_only_its_trees_links():
    """Every GPU of the mesh pulls each tree's range from its parent: the
    bytes on each link must be those of the trees using it, and no link
    outside the trees carries more than control traffic (nothing forwarded
    through a third GPU)."""
    from benchmarks.dgxmeshrun import launch, plan_of

    size = 8 << 20
    mesh = DgxMesh(unit_bps=400e6)
    try:
        with mesh:
            row = launch(mesh, "hoplite-multitree", "broadcast", size, 1, tag="bytes",
                         unit_bps=400e6)
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    assert row["direct_links"], (row["tree_links_short"], row["off_tree_bytes"])
    wanted = row["tree_link_bytes_wanted"]
    assert sum(wanted.values()) == 7 * size and len(plan_of(mesh, "broadcast").trees) == 4
    for link, n in wanted.items():  # (headers and control: a few percent)
        assert n <= row["link_bytes"][link] <= 1.1 * n + (64 << 10), (link, row["link_bytes"])
    assert row["check"] == "exact" and row["ratio_to_bound"] > 0.5


@pytest.mark.slow  # every system launched on two meshes: about 40 s here
@pytest.mark.timeout(600)
def test_a_tiny_run_of_every_system():
    import argparse
    import signal

    from rich.console import Console

    from benchmarks import dgxmeshrun
    from benchmarks.mpi import have_mpi

    p = argparse.ArgumentParser()
    dgxmeshrun.add_arguments(p)
    p.add_argument("--no-save", action="store_true")
    systems = ["hoplite-multitree", "hoplite-single", *(["openmpi-tuned"] if have_mpi() else [])]
    args = p.parse_args(["--size", "1M", "--unit", "200M", "--sets", "full", "0,3,4,7",
                         "--repeats", "2", "--retries", "0", "--no-save", "--systems", *systems])
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = dgxmeshrun.run(args, Console(quiet=True))
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    ran = sorted((r["set"], r["op"], r["system"]) for r in result["rows"])
    assert ran == sorted([(s, "broadcast", x) for s in ("full", "0,3,4,7") for x in systems]
                         + [("full", "allreduce", x) for x in systems]), result["failed"]
    assert result["ok"] and result["byte_identical"] and not result["failed"]
    json.dumps(result)  # (what the command saves)
    for r in result["rows"]:
        assert r["check"] == "exact" and len(r["samples_s"]) == 2
        assert r["bound_s"] > 0 and r["nominal_bound_s"] > 0 and len(r["cpu"]) == 2
    for e in result["sets"]:
        assert set(e["speedup_over"]) == set(systems) - {e["system"]}
    four = next(m for m in result["meshes"] if m["set"] == "0,3,4,7")
    assert four["members"] == [0, 3, 4, 7] and four["routed"] == {"0-7": [0, 4, 7],
                                                                  "3-4": [3, 0, 4]}
    assert 0.5 < four["link"]["unit_bps"] / 200e6 < 1.2


@pytest.mark.slow  # six TCP streams over shaped links: about 3 s here
@pytest.mark.timeout(120)
def test_a_probed_topology_has_the_links_measured_rates():
    """`probe_topology` measures every built link: on GPUs 0, 1, 4 (0-1 one
    unit, 0-4 two) the NV2 link reads about twice the NV1 one, each within
    a loose band of its nominal rate, and trees packed over what was
    measured reach its own bound."""
    from benchmarks.dgxmeshrun import probe_topology
    from hoplite_gpu.trees import pack

    unit = 80e6
    try:
        with DgxMesh(members=[0, 1, 4], unit_bps=unit) as mesh:
            probed = probe_topology(mesh, seconds=0.2)
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    assert sorted(probed.nodes) == [0, 1, 4] and probed.unit_bytes_per_s == 1
    rate = {(link.src, link.dst): link.capacity for link in probed.links}
    assert set(rate) == {(0, 1), (1, 0), (0, 4), (4, 0)}  # 1-4 has no link: none probed
    one, two = rate[0, 1], rate[0, 4]
    assert 0.8 * unit / 8 <= one <= 1.1 * unit / 8, one
    assert 1.6 <= two / one <= 2.4, (one, two)
    plan = pack(probed, 0, [0, 1, 4])
    assert plan.rate >= 0.99 * plan.bound and plan.bound == pytest.approx(one, rel=0.01)
