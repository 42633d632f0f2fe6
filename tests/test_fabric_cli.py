"""`hoplite-gpu simulate --fabric ...`: its JSON, its one-line refusals, and the
plain `simulate` left as it was."""

from __future__ import annotations

import importlib.util
import json

import pytest

from hoplite_gpu import cli


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["simulate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("op", ["ring-allreduce", "alltoall", "broadcast", "reduce"])
def test_json_holds_the_completion_the_bound_and_the_largest_link_load(capsys, op):
    rc, out, err = _run(capsys, "--fabric", "fat-tree", "--k", "4", "--op", op, "--routing",
                        "ethereal", "--size", "4MiB", "--chunk", "1MiB", "--json")
    assert rc == 0, err
    got = json.loads(out)
    assert got["op"] in {op, f"hoplite-{op}"} and got["hosts"] == 16
    assert 0 < got["bound_s"] <= got["completion_s"] * (1 + 1e-9)
    assert got["max_link_load_bytes"] > 0
    assert got["command"].startswith("hoplite-gpu simulate --fabric fat-tree")


def test_the_summary_line_names_the_op_the_fabric_and_the_routing(capsys):
    rc, out, _ = _run(capsys, "--fabric=leaf-spine", "--hosts", "16", "--spines", "4",
                      "--oversubscription", "2", "--op", "alltoall", "--routing", "spray",
                      "--size", "1MiB", "--failed-links", "1", "--seed", "3")
    assert rc == 0
    assert out.startswith("alltoall of 1 MiB on leaf-spine 4 leaves x 4 hosts, 4 spines, "
                          "oversubscription 2")
    assert "failed: leaf" in out and "x the bound" in out


@pytest.mark.parametrize("argv, flag", [
    (["--fabric", "fat-tree", "--k", "5"], "--k 5: a fat-tree needs an even k"),
    (["--fabric", "fat-tree", "--hosts", "100"], "--hosts 100: a fat-tree has k^3/4 hosts"),
    (["--fabric", "fat-tree", "--k", "4", "--hosts", "128"],
     "--hosts 128: a fat-tree with --k 4 has 16 hosts"),
    (["--fabric", "leaf-spine", "--hosts", "10", "--spines", "4"],
     "--hosts 10: a leaf-spine needs a multiple of --hosts-per-leaf (4)"),
    (["--fabric", "leaf-spine", "--hosts", "16", "--k", "4"], "--k is for --fabric fat-tree"),
    (["--fabric", "leaf-spine", "--hosts", "16", "--spines", "4", "--oversubscription", "0"],
     "--oversubscription 0: must be a positive ratio"),
    (["--fabric", "fat-tree", "--k", "4", "--failed-links", "999"],
     "--failed-links 999: this fabric has 32 switch-to-switch cables"),
    (["--fabric", "fat-tree", "--k", "4", "--subflows", "4"],
     "--subflows 4: a whole number of at least 1, for --routing ethereal only"),
    (["--fabric", "fat-tree", "--k", "4", "--size", "lots"], "--size lots:"),
    (["--fabric", "fat-tree", "--k", "4", "--size", "6", "--op", "reduce"],
     "--size 6: reduce sums float32 arrays"),
])
def test_bad_flags_are_refused_in_one_line_naming_the_flag(capsys, argv, flag):
    base = {"--op": "ring-allreduce", "--routing": "ecmp"}
    for key, value in base.items():
        if key not in argv:
            argv = [*argv, key, value]
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1
    assert err.startswith(f"hoplite-gpu simulate: error: {flag}")


def test_a_failure_that_cuts_off_a_pair_is_an_error_not_a_crash(capsys):
    rc, _, err = _run(capsys, "--fabric", "leaf-spine", "--hosts", "4", "--spines", "1",
                      "--hosts-per-leaf", "2", "--failed-links", "1", "--op", "alltoall",
                      "--routing", "spray")
    assert rc == 1 and "leave no shortest path from leaf" in err


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None,
                    reason="matplotlib is installed: the drawing is tested instead")
def test_png_without_matplotlib_says_what_to_install(capsys, tmp_path):
    rc, _, err = _run(capsys, "--fabric", "fat-tree", "--k", "4", "--op", "alltoall",
                      "--routing", "spray", "--size", "1MiB", "--png", str(tmp_path / "x.png"))
    assert rc == 2 and "drawing needs matplotlib" in err


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_png_draws_the_link_loads(capsys, tmp_path):
    path = tmp_path / "loads.png"
    rc, _, err = _run(capsys, "--fabric", "fat-tree", "--k", "4", "--op", "alltoall",
                      "--routing", "ecmp", "--size", "1MiB", "--png", str(path))
    assert rc == 0, err
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_simulate_without_a_fabric_is_the_host_link_simulator(capsys):
    rc, out, _ = _run(capsys, "--receivers", "3", "--size", "4MiB", "--chunk", "1MiB")
    assert rc == 0 and out.startswith("simulated broadcast of 4 MiB to 3 receivers")
