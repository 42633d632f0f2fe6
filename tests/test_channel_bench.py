"""`python -m benchmarks channel`: the state dict it moves, how its summary
judges the targets, and (tiny, slow-linked) a run of the channel's modes and
of Gloo end to end. It checks what runs and what the result holds, never how
fast it was."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from benchmarks import channel, weights
from benchmarks.__main__ import main as bench_main
from benchmarks.emulated import EmulationUnavailable

KiB, MiB = 1 << 10, 1 << 20


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    channel.add_arguments(p)
    return p.parse_args(list(argv))


def test_the_state_dict_is_hundreds_of_tensors_of_4_kib_to_64_mib():
    sizes = weights.mixed_sizes(256 * MiB)
    assert sum(sizes) == 256 * MiB and len(sizes) >= 200
    assert min(sizes) == 4 * KiB and max(sizes) == 64 * MiB
    for total in (4 * MiB, 1000, 4):
        assert sum(weights.mixed_sizes(total)) == total
    with pytest.raises(ValueError, match="multiple of 4"):
        weights.mixed_sizes(6)
    small = weights.mixed_sizes(300 * KiB)
    a, b = weights.state_dict(small, 1), weights.state_dict(small, 2)
    assert list(a) == weights.names(small) and len(set(a)) == len(small)
    assert all(x.nbytes == n for x, n in zip(a.values(), small, strict=True))
    assert weights.crc(a.values()) != weights.crc(b.values())
    np.testing.assert_array_equal(next(iter(b.values())) - next(iter(a.values())), 1)


def _row(system: str, seconds: float, ok: bool = True) -> dict:
    return {"system": system, "seconds": seconds, "byte_identical": ok}


@pytest.mark.parametrize(("hoplite", "kill", "bound_ok", "kill_ok"), [
    ([2.2, 2.4, 2.3], [2.5], True, True),     # 1.07 x S/B; kill 1.09 x
    ([2.5, 2.5, 2.6], [2.6], False, True),    # 1.16 x S/B
    ([2.2, 2.3], [2.6], True, False),         # kill 1.16 x
])
def test_the_targets_are_judged_on_the_medians(hoplite, kill, bound_ok, kill_ok):
    args = _args("--size", "256M", "--gbit", "1")  # S/B 2.147 s
    rows = [_row("hoplite", s) for s in hoplite] + [_row("hoplite-kill", s) for s in kill]
    rows.append(_row("ray", 9.0))
    summary = channel.summarize(rows, args)
    assert summary["pass_bound"] is bound_ok and summary["pass_kill"] is kill_ok
    assert summary["ratio_to_hoplite"]["ray"] == pytest.approx(9.0 / np.median(hoplite))
    assert summary["systems"]["hoplite"]["to_bound"] == pytest.approx(
        np.median(hoplite) / (256 * MiB * 8 / 1e9))


def test_bytes_that_differ_fail_both_targets():
    args = _args("--size", "256M")
    summary = channel.summarize([_row("hoplite", 2.2, ok=False), _row("hoplite-kill", 2.2)], args)
    assert not summary["pass_bound"] and not summary["pass_kill"]


@pytest.mark.parametrize("argv", [["--hosts", "2"], ["--size", "3B"], ["--kill-at", "1"],
                                  ["--systems", "mpi"], ["--gbit", "0"]])
def test_bad_settings_are_refused_before_anything_starts(argv, capsys):
    with pytest.raises(SystemExit):
        bench_main(["channel", *argv, "--no-save"])


@pytest.mark.slow  # four launches of five processes and four Gloo ranks on 4 hosts: ~35 s
@pytest.mark.timeout(300)
def test_the_channel_and_gloo_run_end_to_end(monkeypatch, capsys):
    monkeypatch.setattr(channel, "_stop_on_signals", lambda: None)  # keep pytest's handlers
    # 8 MiB at 80 Mbit/s: 0.8 s a version, so the kill lands mid-fetch (at 2 MiB and
    # 20 Mbit/s the learner never saw an actor relaying a part: the kill timed out)
    try:
        bench_main(["channel", "--hosts", "4", "--gbit", "0.08", "--size", "8M",
                    "--repeats", "1", "--warmup", "1", "--timeout", "60", "--systems", "hoplite",
                    "hoplite-out",
                    "hoplite-kill", "hoplite-get", "gloo", "--no-save", "--json"])
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["byte_identical"] and not result["failed"], result["failed"]
    rows = {r["system"]: r for r in result["rows"]}
    assert sorted(rows) == ["gloo", "hoplite", "hoplite-get", "hoplite-kill", "hoplite-out"]
    for row in rows.values():
        assert row["seconds"] > 0 and row["tensors"] == len(weights.mixed_sizes(8 * MiB))
    assert (rows["hoplite"]["actors_timed"] == rows["gloo"]["actors_timed"]
            == rows["hoplite-get"]["actors_timed"] == 3)
    assert rows["hoplite-kill"]["actors_timed"] == 2
    killed = rows["hoplite-kill"]["killed"]
    assert killed["late_joiner_ok"] and 0 < killed["had"] < 1
    # the learner's uplink carried the version about once: a chain, not a star
    assert rows["hoplite"]["learner_uplink_bytes"] < 2 * 8 * MiB
    assert set(result["summary"]["systems"]) == set(rows)
