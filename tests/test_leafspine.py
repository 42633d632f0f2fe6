"""The emulated leaf-spine fabric (benchmarks/leafspine.py): built and torn
down, ECMP per flow over every spine, path probes, per-link counters, clean-up
after errors and interrupts, and refusals of bad settings. Tests that need
network namespaces make them only through the harness (2 hosts on 2 leaves
under 2 spines) and skip with the reason where namespaces cannot be made."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from namespaces import (
    check_a_killed_runs_namespaces_are_swept,
    check_an_error_inside_the_run_tears_it_down,
    dead_tag,
    ours,
)

from benchmarks import emulated, leafspine
from benchmarks.emulated import EmulationUnavailable
from benchmarks.leafspine import LeafSpine, spine_that_carried, sweep_stale


def _tiny(**kw) -> LeafSpine:
    return LeafSpine(2, 2, 2, host_bps=kw.pop("host_bps", 200e6), **kw)


# ---------------------------------------------------- layout, no root needed ---
def test_rates_placement_and_addresses():
    f = LeafSpine(8, 2, 4, host_bps=100e6, oversubscription=2)
    assert f.hosts_per_leaf == 4 and f.bandwidth_bps == 100e6
    assert f.uplink_bps == pytest.approx(4 * 100e6 / (4 * 2))  # h B / (u x)
    assert [f.leaf_of(i) for i in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert f.address(5) == "10.88.1.2" and f.ns(5) == f"{f.prefix}h5"
    g = LeafSpine(8, 2, 4, placement="interleaved")
    assert [g.leaf_of(i) for i in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert g.hosts_on(1) == [1, 3, 5, 7] and g.address(5) == "10.88.1.3"
    assert sorted(g.fabric_host(i) for i in range(8)) == list(range(8))
    assert all(g.fabric().host_leaf[g.fabric_host(i)] == g.leaf_of(i) for i in range(8))
    assert f.prefix != g.prefix  # two fabrics of one process never share a name


def test_fabric_matches_the_simulators_leaf_spine():
    from hoplite_gpu.fabric.ops import RingAllreduce
    from hoplite_gpu.fabric.run import op_bound
    from hoplite_gpu.fabric.topology import LEAF_UP

    f = LeafSpine(8, 2, 2, host_bps=80e6, oversubscription=2, placement="interleaved")
    fab = f.fabric()
    assert fab.capacity[fab.host_up[0]] == pytest.approx(10e6)  # bytes/s
    assert np.allclose(fab.capacity[fab.layer == LEAF_UP], f.uplink_bps / 8)
    # every ring step crosses leaves: 4 flows leave a leaf over 2 x 40 Mbit/s,
    # so the ring takes oversubscription x its host-link time
    size = 8 << 20
    ring = RingAllreduce([f.fabric_host(r) for r in range(8)], size)
    assert op_bound(fab, ring) == pytest.approx(2 * 2 * 7 / 8 * size / 10e6)


@pytest.mark.parametrize("kw, message", [
    ({"hosts": 7}, "split evenly"),
    ({"leaves": 1}, "leaves must be"),
    ({"spines": 0}, "spines must be"),
    ({"oversubscription": 0}, "oversubscription"),
    ({"host_bps": -1e9}, "host_bps"),
    ({"host_bps": 1e3, "oversubscription": 4}, "leaf-spine rate"),
    ({"placement": "random"}, "placement"),
    ({"hash_seed": -1}, "hash seed"),
    ({"congestion": "bbr; reboot"}, "congestion"),
])
def test_bad_settings_are_refused_before_anything_is_made(kw, message):
    args = {"hosts": 8, "leaves": 2, "spines": 2, **kw}
    with pytest.raises(ValueError, match=message):
        LeafSpine(args.pop("hosts"), args.pop("leaves"), args.pop("spines"), **args)


def test_a_probe_names_the_one_spine_that_carried_it():
    assert spine_that_carried([120, 300_000, 0], 262_144, "probe") == 1
    for moved in ([0, 0], [300_000, 300_000], [300_000, 80_000]):  # none; two; a busy other
        with pytest.raises(RuntimeError, match="no single spine carried"):
            spine_that_carried(moved, 262_144, "probe")


# ------------------------------------------------------------- namespaces ---
@pytest.mark.timeout(60)
def test_builds_routes_over_every_spine_and_tears_down():
    fabric = _tiny(hash_seed=7)
    try:
        with fabric:
            assert sorted(ours(fabric)) == sorted(
                [fabric.ns(0), fabric.ns(1), *map(fabric.leaf_ns, (0, 1)),
                 *map(fabric.spine_ns, (0, 1))])
            route = subprocess.run(["ip", "-n", fabric.leaf_ns(0), "route", "show",
                                    "10.88.1.0/24"], capture_output=True, text=True).stdout
            assert route.count("nexthop via") == 2, route
            for ns in (fabric.leaf_ns(0), fabric.spine_ns(1)):
                got = subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-n",
                                      "net.ipv4.fib_multipath_hash_policy",
                                      "net.ipv4.fib_multipath_hash_fields",
                                      "net.ipv4.fib_multipath_hash_seed", "net.ipv4.ip_forward"],
                                     capture_output=True, text=True).stdout.split()
                assert got[0] == "3" and int(got[1], 0) == 0x37 and got[2:] == ["7", "1"], got
            before = fabric.link_bytes()
            spine = fabric.probe_path(0, 1, 41000, 5600)
            moved = {k: v - before[k] for k, v in fabric.link_bytes().items()}
            # the probe's bytes went up host 0's link, over that spine, down to host 1
            for link in (("h0", "leaf0"), ("leaf0", f"spine{spine}"), (f"spine{spine}", "leaf1"),
                         ("leaf1", "h1")):
                assert moved[link] >= leafspine.PROBE_BYTES, (link, moved)
            other = f"spine{1 - spine}"
            assert moved["leaf0", other] < 4096 and moved[other, "leaf1"] < 4096, moved
            down, up = fabric.link_counters()[1][:2]
            assert down >= leafspine.PROBE_BYTES and up < down
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    assert not ours(fabric)


def _congestion(which: str) -> list[str]:
    with open(f"/proc/sys/net/ipv4/tcp_{which}_congestion_control") as f:
        return f.read().split()


@pytest.mark.timeout(60)
def test_the_hosts_get_the_congestion_control_asked_for_and_one_not_allowed_is_refused():
    """The hosts' TCP congestion control was this machine's default, unset
    and unrecorded, and a run with another one was not to be had: it is set
    in every host namespace, and one a namespace may not use is refused
    before anything is built."""
    allowed = _congestion("allowed")
    if not allowed:
        pytest.skip("no congestion control is allowed in a namespace here")
    fabric = _tiny(congestion=allowed[-1])
    try:
        with fabric:
            for i in range(fabric.hosts):
                got = subprocess.run(["ip", "netns", "exec", fabric.ns(i), "sysctl", "-n",
                                      "net.ipv4.tcp_congestion_control"],
                                     capture_output=True, text=True).stdout.strip()
                assert got == allowed[-1]
        barred = next((c for c in ("cubic", "reno", "bbr", "vegas") if c not in allowed),
                      "no-such-control")
        refused = _tiny(congestion=barred)
        with pytest.raises(EmulationUnavailable, match=f"'{barred}'.*allowed: "):
            with refused:
                pass
        assert not ours(refused)
    except EmulationUnavailable as exc:
        if "congestion control" in str(exc):  # (the allowed one refused)
            raise
        pytest.skip(str(exc))
    assert not ours(fabric)


@pytest.mark.timeout(60)
def test_ecmp_spreads_flows_over_both_spines_and_the_ports_decide_the_spine():
    """The spine must be a function of the 5-tuple and the seed alone: with
    the plain L4 policy (fib_multipath_hash_policy=1) the kernel hashed the
    sending socket's random hash instead, so one 4-tuple probed twice landed
    on either spine and no port could be chosen for a path."""
    fabric = _tiny(hash_seed=1)
    try:
        with fabric:
            spread = fabric.ecmp_spread(0, 1, flows=16)
            ports = [(p, 5600) for p in spread["src_ports"]]
            again = fabric.probe_paths(0, 1, ports, nbytes=64 << 10)
            fabric.set_hash_seed(2)
            reseeded = fabric.probe_paths(0, 1, ports, nbytes=64 << 10)
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    assert all(n >= 2 for n in spread["flows_per_spine"]), spread
    assert sum(spread["flows_per_spine"]) == 16
    assert again == spread["spines"]
    assert reseeded != spread["spines"]  # (all 16 alike by chance: 2 ** -16)
    assert not ours(fabric)


def _hold(fabric: LeafSpine, host: int, port: int) -> subprocess.Popen:
    """A process on `host` listening on `port` until killed."""
    hold = fabric.popen(host, [sys.executable, "-c", (
        "import socket, sys; s = socket.socket(); "
        f"s.bind(('{fabric.address(host)}', {port})); s.listen(); print('up', flush=True); "
        "sys.stdin.read()")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert hold.stdout.readline().strip() == "up"
    return hold


@pytest.mark.timeout(60)
def test_a_trace_finds_the_spine_a_probe_does_even_from_a_port_in_use():
    """The path map is traced from a node's data port, which its server
    holds: a connection's probe cannot use it, the TTL-limited trace can,
    and it names the spine the data takes (checked against probes of
    connections that carried bytes)."""
    fabric = _tiny(hash_seed=3)
    try:
        with fabric:
            ports = [(61000 + k, 5600) for k in range(12)]
            probed = fabric.probe_paths(0, 1, ports, nbytes=64 << 10)
            traced = fabric.trace_paths(0, [(1, p, q) for p, q in ports])
            hold = _hold(fabric, 0, 5601)
            try:
                held = fabric.trace_paths(0, [(1, 5601, 61000 + k) for k in range(64)])
                listening = fabric.listening_ports(0, hold.pid)
            finally:
                hold.kill()
                hold.communicate()
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    assert traced == probed and set(probed) == {0, 1}
    assert set(held) == {0, 1} and listening == [5601]
    with pytest.raises(ValueError, match="both on leaf"):
        LeafSpine(4, 2, 2).trace_paths(0, [(1, 5601, 61000)])


@pytest.mark.timeout(60)
def test_probe_refuses_hosts_on_one_leaf_and_ports_in_use():
    fabric = LeafSpine(4, 2, 2, host_bps=200e6)
    held = []
    try:
        with fabric:
            with pytest.raises(ValueError, match="both on leaf 0"):
                fabric.probe_path(0, 1, 41000, 5600)
            held += [_hold(fabric, 0, 41001), _hold(fabric, 2, 5601)]
            with pytest.raises(RuntimeError, match="41001.*[Aa]ddress already in use"):
                fabric.probe_path(0, 2, 41001, 5600)
            with pytest.raises(RuntimeError, match="(?s)sink on host 2: exited.*[Aa]ddress already"):
                fabric.probe_path(0, 2, 41002, 5601)
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    finally:
        for hold in held:
            hold.kill()
            hold.communicate()
    assert not ours(fabric)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("error", [KeyboardInterrupt, subprocess.CalledProcessError])
def test_a_failed_build_leaves_nothing(monkeypatch, error):
    # a Ctrl-C or a failing command halfway through the build (after the
    # leaves, the spines and a host were made, during a cable)
    real, calls = leafspine._sh, []

    def sh(*argv, check=True):
        calls.append(argv)
        if argv[:3] == ("ip", "link", "add") and sum(a[:3] == ("ip", "link", "add")
                                                    for a in calls) == 2:
            raise error(1, argv) if error is subprocess.CalledProcessError else error()
        return real(*argv, check=check)

    monkeypatch.setattr(leafspine, "_sh", sh)
    monkeypatch.setattr(emulated, "_sh", sh)  # (namespaces are made by the shared base)
    fabric = _tiny()
    try:
        with pytest.raises(error), fabric:
            pass
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    assert any(a[:3] == ("ip", "netns", "add") for a in calls)
    assert not ours(fabric)


@pytest.mark.timeout(60)
def test_an_error_inside_the_run_tears_the_fabric_down():
    check_an_error_inside_the_run_tears_it_down(_tiny(), 6)


@pytest.mark.timeout(60)
def test_namespaces_of_a_killed_run_are_swept_and_live_ones_kept():
    dead = dead_tag()
    check_a_killed_runs_namespaces_are_swept(
        sweep_stale, [f"ls{dead}x0h0", f"ls{dead}x3s1"], f"{_tiny().prefix}l9")


# ------------------------------------------- python -m benchmarks leafspine ---
def test_the_paths_system_passes_the_runtimes_path_setting_to_every_node():
    import dataclasses

    from benchmarks import leafspinerun
    from hoplite_gpu.config import Config

    assert leafspinerun.PATHS_SETTING in {f.name for f in dataclasses.fields(Config)}
    assert leafspinerun.paths_env(3) == {"HOPLITE_PATHS": "3"}
    # a sliced ring pulls pieces of size / hosts: split only if the threshold is that low
    assert leafspinerun.paths_env(2, 64 << 20, 8) == {"HOPLITE_PATHS": "2",
                                                      "HOPLITE_MULTI_SOURCE_BYTES": str(8 << 20)}
    assert leafspinerun.paths_env(2, 256 << 20, 8) == {"HOPLITE_PATHS": "2"}


def test_the_racks_systems_start_every_node_with_its_leaf_as_its_rack():
    """`--racks`: each hoplite-gpu system runs again as "<system>-racks",
    whose nodes (and only they) get HOPLITE_RACK=leaf<k> of their host."""
    import argparse

    from benchmarks import leafspinerun

    class Fabric:
        leaves = 2

        def leaf_of(self, i: int) -> int:
            return i % 2

        def popen(self, i, argv, **kw):
            return i, kw.get("env")

    on = leafspinerun.LeafRacks(Fabric())
    assert on.leaves == 2  # (the fabric's, otherwise)
    host, env = on.popen(3, ["python", "-m", "benchmarks.netnode"], env={"A": "1"})
    assert host == 3 and env == {"A": "1", "HOPLITE_RACK": "leaf1"}
    assert on.popen(0, ["python", "-m", "hoplite_gpu.cli", "directory"]) == (0, None)
    p = argparse.ArgumentParser()
    leafspinerun.add_arguments(p)
    assert p.parse_args(["--racks"]).racks and not p.parse_args([]).racks


# ------------------------------------------------------------- path maps ---
def _addr(i: int) -> str:
    return f"10.88.{i // 2}.{i % 2 + 1}"


def test_path_maps_put_each_path_on_its_spine_lowest_ports_first():
    from benchmarks.leafspinepaths import path_maps

    # sender 0 (data port 5000) -> puller 2: ports 61000.. on spines 1, 0, 1, 1, 0
    probed = {(0, 5000, 2, 61000 + k): s for k, s in enumerate([1, 0, 1, 1, 0])}
    probed[2, 7000, 0, 61000] = 0
    probed[2, 7000, 0, 61001] = 1
    maps = path_maps(probed, 2, 2, _addr)
    assert maps == {2: {"10.88.0.1:5000": {"61000": 1, "61001": 0, "61002": 1, "61003": 1,
                                           "61004": 0}},
                    0: {"10.88.1.1:7000": {"61000": 0, "61001": 1}}}
    assert path_maps(dict(reversed(list(probed.items()))), 2, 2, _addr) == maps
    json.dumps(maps)  # (what the node reads: keys are strings)


def test_path_maps_share_a_spine_evenly_among_its_paths():
    from benchmarks.leafspinepaths import path_maps, ports_wanted

    # 4 paths on 2 spines: paths 0 and 2 on spine 0, 1 and 3 on spine 1
    probed = {(0, 5000, 2, 61000 + k): k % 2 for k in range(8)}
    table = path_maps(probed, 4, 2, _addr)[2]["10.88.0.1:5000"]
    assert table == {"61000": 0, "61001": 1, "61002": 2, "61003": 3,
                     "61004": 0, "61005": 1, "61006": 2, "61007": 3}
    assert ports_wanted(4, 2, per_path=3) == [6, 6]
    assert ports_wanted(1, 2, per_path=3) == [3, 0]
    # fewer paths than spines: the other spines' ports are left out
    assert path_maps(probed, 1, 2, _addr)[2]["10.88.0.1:5000"] == {
        "61000": 0, "61002": 0, "61004": 0, "61006": 0}


def test_path_maps_refuse_a_path_without_a_port_and_an_unknown_spine():
    from benchmarks.leafspinepaths import path_maps

    with pytest.raises(ValueError, match=r"10.88.0.1:5000 to host 2 took spine 1 \(path 1\)"):
        path_maps({(0, 5000, 2, 61000): 0, (0, 5000, 2, 61001): 0}, 2, 2, _addr)
    with pytest.raises(ValueError, match="took spine 3; spines are 0 to 1"):
        path_maps({(0, 5000, 2, 61000): 3}, 2, 2, _addr)


class _HashFabric:
    """Stands for a LeafSpine in `learn`: 4 hosts on 2 leaves, the spine a
    hash of the tuple; counts the probes."""

    hosts, spines = 4, 2

    def __init__(self, spine=lambda s, d, r, p: (s * 7 + d + r * 3 + p) % 2) -> None:
        self.spine, self.probes = spine, 0

    def leaf_of(self, i: int) -> int:
        return i // 2

    def trace_paths(self, src, probes):
        self.probes += len(probes)
        return [self.spine(src, q, dst, p) for dst, q, p in probes]


def test_learning_traces_only_pairs_across_leaves_until_each_spine_has_enough():
    from benchmarks.leafspinepaths import learn, path_maps

    fab = _HashFabric()
    probed = learn(fab, {0: [5000], 1: [5001], 2: [5002], 3: [5003]}, 2, range(61000, 62000),
                   per_path=4)
    # each sender to the 2 hosts of the other leaf, one round of 2 x (4 + 4) ports
    assert fab.probes == len(probed) == 4 * 2 * 16
    assert {(s // 2, r // 2) for s, _, r, _ in probed} == {(0, 1), (1, 0)}
    maps = path_maps(probed, 2, 2, _addr)
    assert all(sorted(table.values()).count(k) >= 4 for m in maps.values()
               for table in m.values() for k in (0, 1))


def test_learning_stops_when_the_range_has_too_few_ports_for_a_spine():
    from benchmarks.leafspinepaths import learn

    lopsided = _HashFabric(spine=lambda s, d, r, p: 0 if p % 8 else 1)
    with pytest.raises(RuntimeError, match="did not give every spine 4 ports from 0:5000 to 2"):
        learn(lopsided, {0: [5000]}, 2, range(61000, 61020), per_path=4)


def test_the_start_time_waits_for_the_maps_and_the_nodes_read_their_own(tmp_path):
    """Every node reads a map file of its own, which exists (empty) from the
    start, and the start time sent to the nodes is the one after the maps
    were written, the same for all."""
    import io
    import os

    from benchmarks import leafspinepaths

    class Proc:
        def __init__(self, env):
            self.env, self.pid, self.stdin = env, 4242, io.StringIO()

    fab = _HashFabric()
    fab.address = _addr
    fab.popen = lambda i, argv, **kw: Proc(kw.get("env"))
    fab.listening_ports = lambda i, pid: [5000 + i]
    mapper = leafspinepaths.PathMapper(fab, 2, range(61000, 62000), per_path=2)
    try:
        procs = [mapper.popen(i, ["python", "-m", "benchmarks.netnode"], env={"A": "1"})
                 for i in range(4)]
        def read(p):
            with open(p.env["HOPLITE_PATH_MAP"], encoding="utf-8") as f:
                return json.load(f)

        assert [read(p) for p in procs] == [{}] * 4
        assert mapper.popen(0, ["python", "-m", "hoplite_gpu", "directory"], env={}).env == {}
        t0 = 1000.0
        for p in procs:
            p.stdin.write(json.dumps({"t0": t0}) + "\n")
        sent = [json.loads(p.stdin.getvalue())["t0"] for p in procs]
        assert len(set(sent)) == 1 and sent[0] >= t0
        maps = [read(p) for p in procs]
        assert set(maps[0]) == {"10.88.1.1:5002", "10.88.1.2:5003"}
        assert mapper.report["ports_per_path_min"] >= 2
    finally:
        mapper.close()
    assert not os.path.exists(mapper.dir)


def test_uneven_hosts_are_a_usage_error_before_anything_runs():
    from benchmarks.__main__ import main

    with pytest.raises(SystemExit, match="must split evenly"):
        main(["leafspine", "--hosts", "5", "--leaves", "2", "--no-save"])


def test_bounds_come_from_the_fabric_simulator():
    from benchmarks.leafspinerun import fabric_bound

    size = 64 << 20
    # 4 spines at 2:1: a leaf's uplinks carry 2 host links' worth, so a
    # broadcast is bound by a host's downlink, S/B
    f = LeafSpine(8, 2, 4, host_bps=100e6, oversubscription=2)
    assert fabric_bound(f, "broadcast", size) == pytest.approx(size * 8 / 100e6)
    # ranks in host order: one ring step leaves each leaf, the ring's own 2(p-1)/p S/B
    assert fabric_bound(f, "allreduce", size) == pytest.approx(2 * 7 / 8 * size * 8 / 100e6)
    g = LeafSpine(8, 2, 4, host_bps=100e6, oversubscription=2, placement="interleaved")
    assert fabric_bound(g, "allreduce", size) == pytest.approx(2 * fabric_bound(f, "allreduce",
                                                                                 size))


def test_the_simulator_plays_each_op_on_the_same_fabric():
    from benchmarks.leafspinerun import simulated

    fabric = {"hosts": 8, "leaves": 2, "spines": 4, "host_bps": 100e6, "oversubscription": 2,
              "placement": "interleaved"}
    out = simulated({"fabric": fabric}, ["broadcast", "allreduce"], 16 << 20, seeds=3)
    for op in ("broadcast", "allreduce"):
        times = out[op]["completion_s"]
        assert set(times) == {"spray", "ethereal", "ecmp"}
        assert min(times.values()) >= out[op]["bound_s"] * (1 - 1e-9)
    # every ring step sends 4 flows out of each leaf over its 4 uplinks, each
    # uplink one flow's share at the bound: spraying meets it; ECMP draws a
    # spine per message and puts two on a link in most steps (seeds fixed)
    ring = out["allreduce"]
    assert ring["completion_s"]["spray"] <= 1.01 * ring["bound_s"]
    assert ring["completion_s"]["ecmp"] >= 1.5 * ring["bound_s"]


def test_the_per_link_plot_draws_every_op(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.plots import _spine_links

    links = {"leaf0>spine0": 3 << 20, "leaf0>spine1": 0, "spine0>leaf1": 3 << 20,
             "spine1>leaf1": 0}
    rows = [{"op": op, "system": system, "seed": seed, "size_bytes": 1 << 20,
             "spine_link_bytes": links} for op in ("broadcast", "allreduce")
            for system in ("hoplite-gpu", "gloo") for seed in (1, 2)]
    made = _spine_links({"rows": rows}, tmp_path / "leafspine-2026-12-10.json")
    assert sorted(p.name for p in made) == ["leafspine-2026-12-10-allreduce-links.png",
                                            "leafspine-2026-12-10-broadcast-links.png"]
    assert all(p.stat().st_size > 0 for p in made)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_tiny_run_of_every_system_on_the_fabric(monkeypatch):
    """hoplite-gpu, Gloo (where torch is here) and hoplite-gpu with paths (a
    map learned per launch) run the allreduce on 4 hosts under 2 leaves:
    about 20 s, most of it processes starting (Gloo's torch)."""
    import argparse
    import signal

    from rich.console import Console

    from benchmarks import leafspinerun

    p = argparse.ArgumentParser()
    leafspinerun.add_arguments(p)
    systems = ["hoplite-gpu"]
    try:
        import torch  # noqa: F401

        systems.append("gloo")
    except ImportError:
        pass
    args = p.parse_args(["--hosts", "4", "--spines", "2", "--mbit", "40", "--size", "1M",
                         "--seeds", "1", "--probe-flows", "4", "--paths", "2", "--op",
                         "allreduce", "--systems", *systems])
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = leafspinerun.run(args, Console(quiet=True))
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    ran = sorted((r["system"], r["op"]) for r in result["rows"])
    assert ran == sorted((s, "allreduce") for s in [*systems, "hoplite-gpu-paths2"]), \
        result["failed"]
    assert result["byte_identical"]
    json.dumps(result)  # (what the command saves)
    assert all(e["cpu_softirq"] is not None and e["cpu_bound"] in (True, False)
               for e in result["summary"])
    assert sum(result["ecmp_probe"][0]["flows_per_spine"]) == 4
    for r in result["rows"]:
        assert r["lower_bound_s"] >= r["host_bound_s"] > 0 and r["ratio_to_bound"] > 0.5
        up = sum(v for k, v in r["spine_link_bytes"].items() if k.startswith("leaf"))
        down = sum(v for k, v in r["spine_link_bytes"].items() if k.startswith("spine"))
        # (what went up came down, less what a spine's queue dropped; counters
        # are read leaf by leaf, so a few control packets may fall between)
        assert up >= 1 << 20 and abs(down - up) <= 0.1 * up, r["spine_link_bytes"]
        assert 0 < r["cpu"]["busy"] <= 1
    paths = [e for e in result["summary"] if e["system"] == "hoplite-gpu-paths2"]
    assert len(paths) == 1 and "hoplite-gpu" in paths[0]["ratio_to"]
    mapped = [r["path_map"] for r in result["rows"] if r["system"] == "hoplite-gpu-paths2"]
    assert mapped[0]["ports_per_path_min"] >= 1 and len(mapped[0]["data_ports"]) == 4
    assert set(result["simulated"]["allreduce"]["completion_s"]) == {"spray", "ethereal", "ecmp"}
