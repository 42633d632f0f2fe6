"""Emulated hosts with k rails (benchmarks/rails.py) and their benchmark
(`python -m benchmarks rails`, benchmarks/railsrun.py): refusals of bad
settings, the build (a switch per rail, every link shaped both ways), clean-up
after errors and interrupts, the sweep of a killed run's namespaces, a
hoplite-gpu pull split over both rails, and a tiny run of every system.
Tests that need network namespaces make them only through the harness and
skip with the reason where namespaces cannot be made."""

from __future__ import annotations

import argparse
import json
import subprocess

import pytest
from namespaces import (
    check_a_killed_runs_namespaces_are_swept,
    check_an_error_inside_the_run_tears_it_down,
    dead_tag,
    ours,
)

from benchmarks import emulated, rails
from benchmarks.emulated import EmulationUnavailable
from benchmarks.rails import RailCluster, sweep_stale

MiB = 1 << 20


def _ip(*argv: str) -> str:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, check=True).stdout


# ---------------------------------------------------- layout, no root needed ---
def test_addresses_put_rail_r_of_every_host_on_one_subnet():
    c = RailCluster(8, 4, rail_bps=50e6)
    assert c.bandwidth_bps == 200e6 and c.rail_bps == 50e6  # a host's rails together
    assert c.address(5) == "10.66.0.6" and c.address(5, rail=3) == "10.66.3.6"
    assert c.node_host(0) == "10.66.0.1/24,10.66.1.1/24,10.66.2.1/24,10.66.3.1/24"
    assert c.interfaces == "eth0,eth1,eth2,eth3"
    one = c.advertising(1)
    assert one.node_host(2) == "10.66.0.3/24" and one.interfaces == "eth0"
    assert one.hosts == 8 and one.bandwidth_bps == c.bandwidth_bps and one.ns(1) == c.ns(1)
    assert c.prefix != RailCluster(2, 2).prefix  # two clusters of one process never share a name


@pytest.mark.parametrize("args, message", [
    ((1, 2), "hosts must be a whole number from 2"),
    ((251, 2), "hosts must be a whole number from 2 to 250"),
    ((8, 0), "rails must be a whole number from 1 to 16"),
    ((8, 17), "rails must be"),
    ((8, True), "rails must be"),
    ((8, 2, -1e9), "rail_bps must be a finite rate of at least 1000"),
    ((8, 2, float("nan")), "rail_bps"),
    ((8, 2, 500), "rail_bps must be a finite rate"),
    ((8, 2, "100M"), "rail_bps"),
])
def test_bad_settings_are_refused_before_anything_is_made(args, message):
    with pytest.raises(ValueError, match=message):
        RailCluster(*args)


@pytest.mark.parametrize("used", [0, 3, 1.0])
def test_advertising_more_rails_than_there_are_is_refused(used):
    with pytest.raises(ValueError, match=r"RailCluster.advertising: rails must be 1 to 2"):
        RailCluster(4, 2).advertising(used)


# ------------------------------------------------------------- namespaces ---
@pytest.mark.timeout(60)
def test_builds_a_switch_per_rail_shapes_every_link_and_tears_down():
    cluster = RailCluster(3, 2, rail_bps=80e6)
    try:
        with cluster:
            assert sorted(ours(cluster)) == sorted(
                [*map(cluster.ns, range(3)), *map(cluster.switch_ns, range(2))])
            for r in range(2):
                sw = cluster.switch_ns(r)
                ports = json.loads(_ip("-n", sw, "-j", "link", "show", "master", "br0"))
                assert sorted(p["ifname"] for p in ports) == ["h0", "h1", "h2"]
                for i in range(3):
                    for ns, dev in ((cluster.ns(i), f"eth{r}"), (sw, f"h{i}")):  # both ways
                        qdisc = subprocess.run(["tc", "-n", ns, "-j", "qdisc", "show", "dev", dev],
                                               capture_output=True, text=True).stdout
                        tbf = [q for q in json.loads(qdisc) if q["kind"] == "tbf"]
                        assert len(tbf) == 1 and tbf[0]["options"]["rate"] == 10_000_000, qdisc
            addrs = json.loads(_ip("-n", cluster.ns(2), "-j", "-4", "addr", "show"))
            assert {(a["ifname"], f"{i['local']}/{i['prefixlen']}") for a in addrs
                    for i in a["addr_info"] if a["ifname"] != "lo"} == {
                ("eth0", "10.66.0.3/24"), ("eth1", "10.66.1.3/24")}
            # rail 1 of another host is reached over rail 1 only
            route = _ip("-n", cluster.ns(0), "route", "get", cluster.address(1, rail=1))
            assert "dev eth1" in route and "src 10.66.1.1" in route, route
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    assert not ours(cluster)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("error", [KeyboardInterrupt, subprocess.CalledProcessError])
def test_a_failed_build_leaves_nothing(monkeypatch, error):
    # a Ctrl-C or a failing command halfway through the build: rail 0's
    # switch made, rail 1's bridge being added
    real, calls = rails._sh, []

    def sh(*argv, check=True):
        calls.append(argv)
        if argv[-3:] == ("br0", "type", "bridge") and argv[2] == f"{cluster.prefix}r1":
            raise error(1, argv) if error is subprocess.CalledProcessError else error()
        return real(*argv, check=check)

    monkeypatch.setattr(rails, "_sh", sh)
    monkeypatch.setattr(emulated, "_sh", sh)  # (namespaces are made by the shared base)
    cluster = RailCluster(2, 2)
    try:
        with pytest.raises(error), cluster:
            pass
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    assert ("ip", "netns", "add", cluster.switch_ns(1)) in calls
    assert not ours(cluster)


@pytest.mark.timeout(60)
def test_an_error_inside_the_run_tears_the_cluster_down():
    check_an_error_inside_the_run_tears_it_down(RailCluster(2, 2), 4)


@pytest.mark.timeout(60)
def test_namespaces_of_a_killed_run_are_swept_and_live_ones_kept():
    dead = dead_tag()
    check_a_killed_runs_namespaces_are_swept(
        sweep_stale, [f"rl{dead}x0h0", f"rl{dead}x2r1"], f"{RailCluster(2, 2).prefix}h9")


@pytest.mark.timeout(60)
def test_a_pull_between_two_hosts_carries_half_on_each_rail():
    """A hoplite-gpu node on each of two hosts, both advertising their two
    rails: host 1's pull of 4 MiB is split into a sub-flow per rail, and the
    rails' switches count about half of it each (about 2 s: three
    processes start)."""
    from benchmarks.netbench import run_launch

    cluster = RailCluster(2, 2, rail_bps=200e6)
    try:
        with cluster:
            before = cluster.rail_counters()
            row = run_launch(cluster, "hoplite-gpu", "broadcast", 4 * MiB, tag="rails",
                             env={"HOPLITE_MULTI_SOURCE_BYTES": str(MiB)})
            after = cluster.rail_counters()
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    got = [a[1][0] - b[1][0] for a, b in zip(after, before, strict=True)]  # host 1, downlink
    assert row["crc"] is not None and sum(got) >= 4 * MiB
    assert all(0.4 * 4 * MiB <= g <= 0.6 * 4 * MiB + 256 * 1024 for g in got), got
    assert not ours(cluster)


# ------------------------------------------------ python -m benchmarks rails ---
@pytest.mark.parametrize("argv, message", [
    (["--rails", "17"], "rails: RailCluster: rails must be a whole number from 1 to 16"),
    (["--hosts", "300"], "rails: RailCluster: hosts must be"),
    (["--mbit", "0.0001"], "rail_bps must be a finite rate of at least 1000 bit/s"),
])
def test_bad_arguments_are_refused_before_anything_is_made(argv, message):
    from benchmarks.__main__ import main

    with pytest.raises(SystemExit, match=message):
        main(["rails", *argv, "--no-save"])


@pytest.mark.parametrize("argv", [["--hosts", "1"], ["--rails", "0"], ["--mbit", "0"],
                                  ["--systems", "nccl"], ["--op", "reduce"], ["--repeats", "0"],
                                  ["--size", "0"]])
def test_bad_arguments_are_usage_errors(argv, capsys):
    from benchmarks.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["rails", *argv, "--no-save"])
    assert exc.value.code == 2 and "usage:" in capsys.readouterr().err


def test_both_hoplite_systems_split_pulls_of_a_rings_piece():
    from benchmarks.railsrun import hoplite_env

    # a sliced ring pulls pieces of size / hosts: split over the rails only if
    # the threshold is that low
    assert hoplite_env("allreduce", 64 * MiB, 8) == {"HOPLITE_ALLREDUCE_SLICING": "auto",
                                                     "HOPLITE_MULTI_SOURCE_BYTES": str(8 * MiB)}
    assert hoplite_env("broadcast", 256 * MiB, 8) == {}


def _row(system: str, op: str, seconds: float, rails: list[int], crc: int = 7) -> dict:
    return {"system": system, "op": op, "hosts": 8, "size_bytes": 64 * MiB,
            "bandwidth_bps": 200e6, "samples_s": [seconds], "lower_bound_s": 2.0,
            "cpu": None, "cpu_s_per_call": None, "crc": crc, "rail_bytes_down": rails,
            "failed_attempts": []}


def test_the_summary_says_how_much_faster_hoplite_gpu_was_and_where_the_bytes_went():
    from benchmarks.emurun import summarize
    from benchmarks.railsrun import _rail_summary, speedups

    rows = [_row("hoplite-gpu", "broadcast", 2.5, [50, 50]),
            _row("hoplite-gpu", "broadcast", 2.7, [52, 48]),
            _row("hoplite-single-rail", "broadcast", 5.2, [100, 0]),
            _row("gloo", "broadcast", 26.0, [100, 0], crc=8)]
    failed = [{"system": "openmpi-tuned", "op": "broadcast", "repeat": 1, "errors": ["x"]}]
    summary = summarize(rows)
    _rail_summary(summary, rows, failed)
    by = {e["system"]: e for e in summary}
    assert by["hoplite-gpu"]["rail_share_down"] == [0.51, 0.49]
    assert by["hoplite-single-rail"]["speedup"] == pytest.approx(5.2 / 2.6)
    assert by["hoplite-gpu"]["byte_identical"] and by["gloo"]["byte_identical"]
    assert speedups(summary) == {"broadcast": {"hoplite-single-rail": pytest.approx(2.0),
                                               "gloo": pytest.approx(10.0)}}


def test_the_plot_draws_time_and_bytes_per_rail_for_every_op(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.emurun import summarize
    from benchmarks.plots import plot_file
    from benchmarks.railsrun import _rail_summary

    rows = [_row(s, op, t, b) for op in ("broadcast", "allreduce")
            for s, t, b in (("hoplite-gpu", 2.5, [50, 50]), ("gloo", 26.0, [100, 0]))]
    summary = summarize(rows)
    _rail_summary(summary, rows, [])
    path = tmp_path / "rails-2026-12-10.json"
    path.write_text(json.dumps({"benchmark": "rails", "rows": rows, "summary": summary,
                                "settings": {"cluster": {"hosts": 8, "rails": 2,
                                                         "rail_bps": 100e6}}}))
    made = plot_file(path)
    assert [p.name for p in made] == ["rails-2026-12-10.png"] and made[0].stat().st_size > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tiny_run_of_every_system():
    """hoplite-gpu on two rails and on one, OpenMPI tuned and Gloo (where
    OpenMPI and torch are here) run both ops on 3 hosts with 2 rails, 1 MiB:
    about 30 s, most of it processes starting."""
    import signal

    from rich.console import Console

    from benchmarks import railsrun
    from benchmarks.mpi import have_mpi

    systems = ["hoplite-gpu", "hoplite-single-rail"]
    systems += ["openmpi-tuned"] if have_mpi() else []  # (never installed by a test)
    try:
        import torch  # noqa: F401

        systems.append("gloo")
    except ImportError:
        pass
    p = argparse.ArgumentParser()
    railsrun.add_arguments(p)
    args = p.parse_args(["--hosts", "3", "--rails", "2", "--mbit", "200", "--size", "1M",
                         "--repeats", "1", "--retries", "0", "--systems", *systems])
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = railsrun.run(args, Console(quiet=True))
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert not result["failed"], result["failed"]
    assert sorted((r["system"], r["op"]) for r in result["rows"]) == sorted(
        (s, op) for s in systems for op in ("broadcast", "allreduce"))
    assert result["byte_identical"]
    json.dumps(result)  # (what the command saves)
    share = {(r["system"], r["op"]): r["rail_share_down"] for r in result["rows"]}
    for op in ("broadcast", "allreduce"):
        assert share["hoplite-single-rail", op][1] < 0.02  # rail 0 only
        assert share.get(("gloo", op), [1, 0])[1] < 0.02
    assert min(share["hoplite-gpu", "broadcast"]) > 0.35  # a pull's halves on each rail
    if "openmpi-tuned" in systems:  # its TCP BTL stripes over both interfaces
        assert min(share["openmpi-tuned", "broadcast"]) > 0.2
    for e in result["summary"]:
        assert e["byte_identical"] and e["cpu_bound"] in (True, False)
        assert e["speedup"] is not None and e["lower_bound_s"] > 0
    assert set(result["speedups"]) == {"broadcast", "allreduce"}
