"""`python -m benchmarks directory-scale` (benchmarks/directory_scale.py), run
small: every case is timed at both scales and its ratio is the two costs'."""

from __future__ import annotations

import argparse

from rich.console import Console

from benchmarks import directory_scale
from benchmarks.__main__ import main


def test_every_case_is_timed_at_both_scales_and_the_ratio_is_theirs():
    args = argparse.Namespace(factor=3, shrink=20, repeats=1)
    result = directory_scale.run(args, Console(quiet=True))
    assert result["benchmark"] == "directory-scale"
    assert [r["event"] for r in result["rows"]] == [c[0] for c in directory_scale.CASES]
    for row in result["rows"]:
        assert row["n_large"] == 3 * row["n"]
        assert row["seconds_per_unit"] > 0 and row["seconds_per_unit_large"] > 0
        assert row["ratio"] == row["seconds_per_unit_large"] / row["seconds_per_unit"]


def test_the_subcommand_runs_and_refuses_a_factor_below_two(capsys):
    assert main(["directory-scale", "--shrink", "50", "--factor", "2", "--repeats", "1",
                 "--no-save"]) == 0
    assert "ratio" in capsys.readouterr().out
    try:
        main(["directory-scale", "--factor", "1", "--no-save"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("a factor of 1 was accepted")
