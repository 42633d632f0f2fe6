"""`python -m benchmarks multisource`: one receiver pulling an object held by
several hosts, from all of them, from one, and with one of them killed
midway, on emulated hosts; and how its summary judges the targets. The run
here is tiny and slow-linked: it checks that every mode runs end to end and
what the result holds, never how fast it was."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import multisource
from benchmarks.__main__ import main as bench_main
from benchmarks.emulated import EmulationUnavailable

MiB = 1 << 20


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    multisource.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.slow  # three launches of six processes on five emulated hosts: about 20 s
@pytest.mark.timeout(300)
def test_every_mode_runs_end_to_end_and_the_result_has_its_fields(monkeypatch, capsys):
    monkeypatch.setattr(multisource, "_stop_on_signals", lambda: None)  # keep pytest's handlers
    # 4 MiB in 1 MiB pieces at 20 Mbit/s per holder: each piece lasts longer than
    # the 0.1 s between progress reports, so the kill lands mid-pull.
    try:
        rc = bench_main(["multisource", "--size", "4M", "--multi-source-bytes", "1M",
                         "--unit-mbit", "20", "--repeats", "1", "--timeout", "60",
                         "--no-save", "--json"])
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and result["byte_identical"] and not result["failed"], result["failed"]
    assert result["benchmark"] == "multisource" and result["command"].endswith("--json")
    rows = {r["mode"]: r for r in result["rows"]}
    assert sorted(rows) == sorted(multisource.MODES)
    for row in rows.values():
        assert row["byte_identical"] and row["crc"] == row["crc_original"]
        assert row["seconds"] > 0 and row["receiver_link_bytes"] >= 4 * MiB
        assert row["lower_bound_s"] > 0
        assert 0 <= row["cpu"]["busy"] <= 1
    # the directory named every holder for the multi-source pulls, one for the single
    assert sorted(rows["multi"]["senders_named"]) == [1, 2, 3]
    assert sorted(rows["kill"]["senders_named"]) == [1, 2, 3]
    assert len(rows["single"]["senders_named"]) == 1
    assert sum(b > 0 for b in rows["multi"]["holder_uplink_bytes"]) == 3
    killed = rows["kill"]["killed"]
    assert killed["holder"] == 3
    assert killed["reported_fraction"] * 4 * MiB >= int(4 * MiB / 3)
    summary = result["summary"]
    for mode in multisource.MODES:
        assert summary["modes"][mode]["samples_s"] == [rows[mode]["seconds"]]
    for key in ("ratio_single_to_multi", "ratio_multi_to_single", "ratio_kill_to_multi",
                "pass_multi", "pass_kill", "cpu_near_saturation"):
        assert key in summary
    bounds = summary["bounds"]
    assert bounds["s_over_receiver_s"] == pytest.approx(4 * MiB * 8 / 60e6)
    assert bounds["s_over_holder_s"] == pytest.approx(4 * MiB * 8 / 20e6)
    assert result["settings"]["measured_bps"]["receiver"] > 0


def _row(mode: str, seconds: float, identical: bool = True, busy: float = 0.5) -> dict:
    return {"mode": mode, "seconds": seconds, "byte_identical": identical,
            "cpu": {"busy": busy}}


def _rows(multi: float, single: float, kill: float) -> list[dict]:
    """Three samples a mode whose median is the given time."""
    return [_row(mode, t * f) for mode, t in (("multi", multi), ("single", single),
                                               ("kill", kill)) for f in (0.9, 1.0, 3.0)]


@pytest.mark.parametrize("multi, single, kill, passes", [
    (0.8, 2.2, 1.1, (True, True)),     # 1 / 2.75 of single; 1.375 x
    (0.8, 2.1, 1.3, (False, False)),   # 1 / 2.625; 1.625 x
])
def test_the_targets_are_judged_on_the_medians(multi, single, kill, passes):
    s = multisource.summarize(_rows(multi, single, kill), _args())
    assert s["modes"]["multi"]["median_s"] == multi
    assert s["modes"]["single"]["samples_s"] == [single * 0.9, single, single * 3.0]
    assert s["ratio_single_to_multi"] == pytest.approx(single / multi)
    assert s["ratio_multi_to_single"] == pytest.approx(multi / single)
    assert s["ratio_kill_to_multi"] == pytest.approx(kill / multi)
    assert (s["pass_multi"], s["pass_kill"]) == passes


def test_bytes_that_differ_fail_both_targets_whatever_the_times():
    rows = _rows(0.8, 2.2, 1.1)
    rows[4]["byte_identical"] = False
    s = multisource.summarize(rows, _args())
    assert not s["pass_multi"] and not s["pass_kill"]


def test_a_mode_without_samples_has_no_ratio_and_fails_its_target():
    rows = [r for r in _rows(0.8, 2.2, 1.1) if r["mode"] != "kill"]
    s = multisource.summarize(rows, _args())
    assert s["ratio_kill_to_multi"] is None and s["pass_kill"] is False
    assert s["pass_multi"] is True


def test_bounds_follow_the_links_and_scale_with_the_unit():
    b = multisource.bounds(_args("--size", "256M"))
    s = 256 * MiB * 8
    assert b["multi_s"] == pytest.approx(s / 3e9) == b["s_over_receiver_s"]
    assert b["single_s"] == pytest.approx(s / 1e9) == b["s_over_holder_s"]
    # a third at 3 Gbit/s, the rest from the two holders left at 2 Gbit/s
    assert b["kill_s"] == pytest.approx(s / 3e9 / 3 + 2 / 3 * s / 2e9)
    slow = multisource.bounds(_args("--size", "256M", "--unit-mbit", "100"))
    assert slow["multi_s"] == pytest.approx(10 * b["multi_s"])
    # two holders at 1 Gbit/s cannot fill a 3 Gbit/s receiver
    two = multisource.bounds(_args("--size", "256M", "--holders", "2"))
    assert two["multi_s"] == pytest.approx(s / 2e9)


def test_a_kill_is_bounded_at_the_share_received_when_the_holder_died():
    args = _args("--size", "256M")
    s = 256 * MiB * 8
    row = {"mode": "kill", "killed": {"link_fraction": 0.5}}
    assert multisource.row_bound(row, args) == pytest.approx(0.5 * s / 3e9 + 0.5 * s / 2e9)
    # (headers can make the bytes that crossed exceed the object's)
    row["killed"]["link_fraction"] = 1.02
    assert multisource.row_bound(row, args) == pytest.approx(s / 3e9)
    rows = _rows(0.8, 2.2, 1.1)
    for r in rows:
        if r["mode"] == "kill":
            r["killed"] = {"link_fraction": 0.5}
    summary = multisource.summarize(rows, args)
    kill = summary["modes"]["kill"]
    assert kill["bound_s"] == pytest.approx(0.5 * s / 3e9 + 0.5 * s / 2e9)
    assert summary["ratio_to_bound"]["kill"] == pytest.approx(1.1 / kill["bound_s"])


def test_cpu_near_saturation_is_counted():
    rows = _rows(0.8, 2.2, 1.1)
    rows[0]["cpu"]["busy"] = 0.95
    rows[5]["cpu"] = None  # (no samples in the window)
    assert multisource.summarize(rows, _args())["cpu_near_saturation"] == 1


@pytest.mark.parametrize("argv", [["--kill-at", "1"], ["--kill-at", "0"], ["--holders", "1"],
                                  ["--receiver-gbit", "0"], ["--repeats", "0"],
                                  ["--size", "0"]])
def test_bad_settings_are_refused_before_anything_starts(argv, capsys):
    with pytest.raises(SystemExit):
        _args(*argv)
    assert "argument" in capsys.readouterr().err
