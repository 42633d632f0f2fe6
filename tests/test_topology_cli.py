"""`hoplite-gpu topology show | pack`: output, JSON, drawings, and bad input
as one line naming the flag, with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from nvidia_fakes import DGX1V_TEXT, fake_nvml

import hoplite_gpu.topology as topology_pkg
from hoplite_gpu.cli import main
from hoplite_gpu.topology import TopologyUnavailable, fixture, from_json, from_nvml


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["topology", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_show_a_fixture_lists_each_link_once(capsys):
    code, out, _ = _run(capsys, "show", "--fixture", "dgx1v-pcie")
    assert code == 0
    assert out.startswith("dgx1v-pcie: 8 nodes, 6 relays, capacities in GB/s per direction")
    lines = out.splitlines()
    assert any(line.split() == ["0", "<->", "3", "50", "nvlink"] for line in lines)
    assert any(line.split() == ["cpu0", "<->", "cpu1", "38.4", "smp"] for line in lines)
    assert sum("<->" in line for line in lines) == 29


def test_show_json_is_the_file_format(capsys, tmp_path):
    code, out, _ = _run(capsys, "show", "--fixture", "nvswitch", "--json")
    assert code == 0 and from_json(json.loads(out)) == fixture("nvswitch")
    path = tmp_path / "t.json"
    path.write_text(out)
    code, again, _ = _run(capsys, "show", "--file", str(path), "--json")
    assert code == 0 and json.loads(again) == json.loads(out)


def test_show_reads_saved_smi_text(capsys, tmp_path):
    path = tmp_path / "topo.txt"
    path.write_text(DGX1V_TEXT)
    code, out, _ = _run(capsys, "show", "--file", str(path))
    assert code == 0 and "cpu0 <-> cpu1" in " ".join(out.split())
    assert "note: the PCIe distance of GPUs shown as NV#" in out


def test_show_without_a_gpu_says_so_plainly(capsys, monkeypatch):
    def none():
        raise TopologyUnavailable("no GPU topology: no NVIDIA driver found (test)")

    monkeypatch.setattr(topology_pkg, "from_nvml", none)
    code, out, _ = _run(capsys, "show")
    assert code == 0
    assert out.startswith("no GPU topology: no NVIDIA driver found (test); the CPU path")
    assert "--fixture NAME (dgx1v, " in out


def test_show_this_machine_through_nvml(capsys, monkeypatch):
    monkeypatch.setattr(topology_pkg, "from_nvml",
                        lambda: from_nvml(fake_nvml(pairs=[(0, 1, 4)], count=2)))
    code, out, _ = _run(capsys, "show")
    assert code == 0 and out.startswith("this machine (2 x NVIDIA A100-SXM4-80GB)")
    assert any(line.split() == ["0", "<->", "1", "100", "nvlink"] for line in out.splitlines())


def test_pack_prints_the_bound_the_rate_and_each_tree(capsys):
    code, out, _ = _run(capsys, "pack", "--fixture", "dgx1v", "--root", "0")
    assert code == 0
    assert "bound R* 150 GB/s; packed 150 GB/s" in out
    assert "kept 4 trees carrying 150 GB/s = 100.0 % of R*" in out
    assert sum(line.startswith("tree ") for line in out.splitlines()) == 4
    assert "0->3 3->2 2->1 1->5 5->6 6->7 7->4" in out


def test_pack_json_holds_bound_rate_and_trees_of_parent_child_edges(capsys):
    code, out, _ = _run(capsys, "pack", "--fixture", "dgx1v-pcie", "--root", "5",
                        "--members", "5,0,6", "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["topology"] == "dgx1v-pcie" and plan["root"] == 5
    assert plan["bound"] == 16.0 and plan["rate"] == pytest.approx(16.0)
    assert plan["members"] == [0, 5, 6]
    for tree in plan["trees"]:
        assert tree["rate"] > 0 and {c for _, c in tree["edges"]} == {0, 6}
        assert all(len(edge) == 2 for edge in tree["edges"])


def test_pack_a_reduce_and_an_allreduce(capsys):
    code, out, _ = _run(capsys, "pack", "--fixture", "nvswitch", "--root", "0",
                        "--flow", "allreduce", "--json")
    assert code == 0 and json.loads(out)["flow"] == "allreduce"
    assert json.loads(out)["rate"] == pytest.approx(450 * 8 / 14)
    code, out, _ = _run(capsys, "pack", "--fixture", "nvswitch", "--root", "0",
                        "--flow", "reduce")
    assert code == 0 and "reduce from 0" in out


@pytest.mark.parametrize("argv, flag, cause", [
    (["--fixture", "dgx9", "--root", "0"], "--fixture", "unknown fixture 'dgx9'"),
    (["--fixture", "dgx1v", "--root", "8"], "--root", "root '8' is not in dgx1v"),
    (["--fixture", "dgx1v", "--root", "0", "--members", "1,2"], "--root",
     "0 is not among --members 1,2"),
    (["--fixture", "dgx1v", "--root", "0", "--members", "0,x"], "--members",
     "member 'x' is not in dgx1v"),
    (["--fixture", "dgx1v", "--root", "0", "--members", "0,,1"], "--members",
     "expected comma-separated nodes"),
    (["--fixture", "dgx1v", "--root", "0", "--members", "0,5,6"], "--members",
     "member(s) 5, 6 cannot be reached from root 0"),
    (["--fixture", "dgx1v", "--root", "0", "--max-loss", "1.5"], "--max-loss",
     "must be a fraction in [0, 1)"),
    (["--fixture", "nvswitch", "--root", "nvswitch"], "--root",
     "root 'nvswitch' is a relay, which holds no data"),
])
def test_bad_input_is_one_line_naming_the_flag_and_exit_2(capsys, argv, flag, cause):
    code, out, err = _run(capsys, "pack", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1, err
    assert err.startswith(f"hoplite-gpu topology pack: error: {flag}: ") and cause in err


def test_a_malformed_file_is_one_line_naming_the_flag(capsys, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"nodes": [0, 1], "links": [{"a": 0, "b": 2, "capacity": 1}]}')
    for command in (["pack", "--root", "0"], ["show"]):
        code, _, err = _run(capsys, *command, "--file", str(path))
        assert code == 2 and err.count("\n") == 1
        assert f"error: --file: topology file {path}: links[0] (0 - 2): 2 is not in" in err


def test_pack_needs_a_topology_and_a_root(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["topology", "pack", "--root", "0"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["topology", "pack", "--fixture", "dgx1v", "--file", "x", "--root", "0"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_png_without_matplotlib_says_what_to_install(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, out, err = _run(capsys, "pack", "--fixture", "dgx1v", "--root", "0",
                          "--png", str(tmp_path / "t.png"))
    assert code == 1 and out == ""
    assert err.startswith("hoplite-gpu topology pack: error: --png needs matplotlib "
                          "(pip install matplotlib)")


def test_png_draws_the_trees(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "trees.png"
    code, out, _ = _run(capsys, "pack", "--fixture", "dgx1v-pcie", "--root", "0",
                        "--png", str(path))
    assert code == 0 and "kept 5 trees" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_installed_command_prints_json_a_reader_can_parse():
    r = subprocess.run([sys.executable, "-m", "hoplite_gpu", "topology", "pack", "--fixture",
                        "dgx1v", "--root", "3", "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["bound"] == 150.0 and len(plan["trees"]) == 4


def test_native_prints_during_packing_stay_out_of_the_output():
    """Regression: HiGHS (in SciPy) printf()s "HighsMipSolverData::
    transformNewIntegerFeasibleSolution tmpSolver.run();" while solving some
    MILPs, which put a stray line into `pack --json`'s output."""
    code = (
        "import ctypes\n"
        "from hoplite_gpu.topology_cli import _native_stdout_muted\n"
        "print('before', flush=True)\n"
        "with _native_stdout_muted():\n"
        "    ctypes.CDLL(None).printf(b'HighsMipSolverData::stray\\n')\n"
        "print('after')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "before\nafter\n"
