"""`python -m benchmarks dirfailover` (benchmarks/dirfailover.py), run small:
the directory in use killed during a broadcast and a reduce, the copies
checked, the time to move over read from every node, the result saved."""

from __future__ import annotations

import json

import pytest

import benchmarks.__main__ as entry


@pytest.mark.slow  # an end-to-end launch of the benchmark
def test_a_small_run_kills_each_directory_in_turn_and_saves_every_figure(monkeypatch, tmp_path):
    """The broadcast's kill round kills the first directory, the reduce's the
    second (the first started again is its standby): nodes move both ways."""
    monkeypatch.setattr(entry, "RESULTS", tmp_path)
    assert entry.main(["dirfailover", "--size", "2M", "--reduce-size", "1M", "--receivers", "2",
                       "--inputs", "3", "--repeats", "1"]) == 0
    [saved] = tmp_path.glob("dirfailover-loopback-*.json")
    result = json.loads(saved.read_text())
    assert result["command"].startswith("python -m benchmarks dirfailover")
    assert [r["op"] for r in result["rows"]] == ["broadcast", "reduce"]
    for row in result["rows"]:
        assert row["byte_identical"] and row["nodes"] == 4  # 3 workers and the harness
        assert len(row["no_kill_s"]) == len(row["with_kill_s"]) == 1
        assert row["ratio_kill_to_no_kill"] == row["with_kill_median_s"] / row["no_kill_median_s"]
        for total, each in zip(row["move_over_s"], row["node_move_over_s"], strict=True):
            assert len(each) == 4 and total == max(each) and 0 < total < 30


@pytest.mark.parametrize("argv", [
    ["--inputs", "4", "--receivers", "2"],  # an input per worker: 3 workers
    ["--size", "1025"],                     # not whole float32 elements
    ["--kill-at", "1.5"],
    ["--repeats", "0"],
], ids=lambda a: " ".join(a))
def test_arguments_it_cannot_run_are_refused_before_any_process(argv, monkeypatch):
    import hoplite_gpu.cluster

    def started(*args, **kwargs):
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(hoplite_gpu.cluster, "LocalCluster", started)
    with pytest.raises(SystemExit) as info:
        entry.main(["dirfailover", *argv, "--no-save"])
    assert info.value.code not in (0, None)
