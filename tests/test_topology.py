"""Topologies: the graph, JSON files, `nvidia-smi topo -m` text, NVML (a fake
module) and the built-in fixtures."""

from __future__ import annotations

import json

import pytest
from nvidia_fakes import DGX1V_TEXT, fake_nvml

from hoplite_gpu.topology import (
    FIXTURES,
    Link,
    Topology,
    TopologyError,
    TopologyUnavailable,
    fixture,
    from_file,
    from_json,
    from_nvml,
    from_smi_text,
    to_json,
)
from hoplite_gpu.topology.pcie import pcie_tree

# -- the graph ------------------------------------------------------------


def test_undirected_links_go_both_ways_and_unknown_pairs_have_no_capacity():
    t = Topology.undirected([0, 1, "h"], [(0, 1, 50, "nvlink"), (1, "h", 12.5, "net")])
    assert t.capacity(0, 1) == t.capacity(1, 0) == 50
    assert t.capacity("h", 1) == 12.5 and t.capacity(0, "h") == 0
    assert t.link(0, 1).kind == "nvlink" and t.is_symmetric()
    assert t.lookup("1") == 1 and t.lookup("h") == "h"


@pytest.mark.parametrize("kwargs, match", [
    ({"nodes": [0, 0], "links": []}, "named twice"),
    ({"nodes": [1, "1"], "links": []}, "named twice"),
    ({"nodes": [0, 1], "links": [Link(0, 2, 1.0)]}, "2 is neither a node nor a relay"),
    ({"nodes": [0, 1], "links": [Link(0, "1", 1.0)]}, "'1' is neither a node"),
    ({"nodes": [0, 1], "links": [Link(0, 0, 1.0)]}, "two different nodes"),
    ({"nodes": [0, 1], "links": [Link(0, 1, 0)]}, "positive finite"),
    ({"nodes": [0, 1], "links": [Link(0, 1, float("inf"))]}, "positive finite"),
    ({"nodes": [0, 1], "links": [Link(0, 1, True)]}, "positive finite"),
    ({"nodes": [0, 1], "links": [Link(0, 1, 1.0), Link(0, 1, 2.0)]}, "given twice"),
    ({"nodes": [0, None], "links": []}, "int or a non-empty string"),
    ({"nodes": [0, 1], "links": [(0, 1, 5.0)]}, r"links are Link\(src, dst, capacity, kind\)"),
])
def test_a_malformed_topology_is_refused_with_the_cause(kwargs, match):
    with pytest.raises(TopologyError, match=match):
        Topology(**kwargs)


def test_lookup_of_an_unknown_node_lists_the_nodes():
    with pytest.raises(TopologyError, match=r"member '9' is not in dgx1v \(its nodes: 0, 1"):
        fixture("dgx1v").lookup("9", what="member")


def test_reversed_and_symmetrized():
    t = Topology([0, 1, 2], [Link(0, 1, 4.0), Link(1, 0, 1.0), Link(1, 2, 3.0)])
    r = t.reversed()
    assert r.capacity(1, 0) == 4 and r.capacity(0, 1) == 1 and r.capacity(2, 1) == 3
    s = t.symmetrized()
    assert s.capacity(0, 1) == s.capacity(1, 0) == 1
    assert s.capacity(1, 2) == 0  # one way only: dropped
    assert not t.is_symmetric() and s.is_symmetric()


def test_equal_topologies_hash_alike_so_plans_can_be_cached():
    assert fixture("dgx1v") == fixture("dgx1v")
    assert hash(fixture("dgx1v")) == hash(fixture("dgx1v"))
    assert fixture("dgx1v") != fixture("dgx1v-pcie")


def test_graph_is_a_networkx_view():
    g = fixture("nvswitch").graph()
    assert g.number_of_nodes() == 9 and g.nodes["nvswitch"]["relay"]
    assert g[0]["nvswitch"]["capacity"] == 450.0


# -- fixtures -------------------------------------------------------------


def test_dgx1v_has_six_nvlinks_per_gpu_in_its_hybrid_cube_mesh():
    t = fixture("dgx1v")
    assert t.nodes == tuple(range(8)) and not t.relays and t.is_symmetric()
    for g in t.nodes:
        assert sum(t.capacity(g, h) for h in t.nodes) == 6 * 25.0
    assert t.capacity(0, 3) == 50 and t.capacity(0, 1) == 25 and t.capacity(0, 5) == 0


def test_every_fixture_is_symmetric_and_named():
    for name in FIXTURES:
        t = fixture(name)
        assert t.name == name and t.is_symmetric() and t.unit_bytes_per_s == 1e9


def test_an_unknown_fixture_names_the_known_ones():
    with pytest.raises(TopologyError, match=r"unknown fixture 'dgx9' \(known: dgx1v, "):
        fixture("dgx9")


# -- JSON files -----------------------------------------------------------


def _write(tmp_path, data) -> str:
    path = tmp_path / "topo.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_json_file_round_trips(tmp_path):
    for name in FIXTURES:
        t = fixture(name)
        assert from_file(_write(tmp_path, to_json(t))) == t


def test_json_file_with_relays_kinds_and_a_directed_link(tmp_path):
    t = from_file(_write(tmp_path, {
        "name": "two boxes", "nodes": ["a", "b", 3], "relays": ["sw"], "unit_bytes_per_s": 1e9,
        "links": [{"a": "a", "b": "sw", "capacity": 10, "kind": "net"},
                  {"a": "sw", "b": "b", "capacity": 10},
                  {"a": 3, "b": "a", "capacity": 2, "directed": True}]}))
    assert t.name == "two boxes" and t.relays == ("sw",)
    assert t.capacity("sw", "a") == 10 and t.link("sw", "b").kind == "link"
    assert t.capacity(3, "a") == 2 and t.capacity("a", 3) == 0


@pytest.mark.parametrize("data, match", [
    ("{not json", "not valid JSON"),
    ([1, 2], "expected a JSON object"),
    ({"nodes": [0, 1], "links": [], "extra": 1}, "unknown key.*'extra'"),
    ({"links": []}, "no 'nodes' list"),
    ({"nodes": [], "links": []}, "'nodes' must be a non-empty list"),
    ({"nodes": [0, 0], "links": []}, "node 0 is listed twice"),
    ({"nodes": [0, 1.5], "links": []}, r"nodes\[1\]: a node is named by an int"),
    ({"nodes": [0, 1], "links": {}}, "'links' must be a list"),
    ({"nodes": [0, 1], "unit_bytes_per_s": -1, "links": []}, "unit_bytes_per_s must be a positive number"),
    ({"nodes": [0, 1], "links": [[0, 1, 5]]}, r"links\[0\]: expected an object"),
    ({"nodes": [0, 1], "links": [{"a": 0, "b": 1}]}, r"links\[0\]: no 'capacity'"),
    ({"nodes": [0, 1], "links": [{"a": 0, "b": 1, "capacity": 1, "speed": 2}]},
     r"links\[0\]: unknown key.*'speed'"),
    ({"nodes": [0, 1], "links": [{"a": 0, "b": 7, "capacity": 1}]},
     r"links\[0\] \(0 - 7\): 7 is not in 'nodes' or 'relays'"),
    ({"nodes": [0, 1], "links": [{"a": 0, "b": "1", "capacity": 1}]},
     r"links\[0\] \(0 - '1'\): '1' is not in 'nodes'"),
    ({"nodes": [0, 1], "links": [{"a": 0, "b": 0, "capacity": 1}]}, "two different nodes"),
    ({"nodes": [0, 1], "links": [{"a": 0, "b": 1, "capacity": "fast"}]},
     r"links\[0\] \(0 - 1\): capacity must be a positive finite number; got 'fast'"),
    ({"nodes": [0, 1], "links": [{"a": 0, "b": 1, "capacity": 0}]}, "positive finite"),
    ({"nodes": [0, 1], "links": [{"a": 0, "b": 1, "capacity": 1, "kind": 3}]},
     "kind must be a non-empty string"),
    ({"nodes": [0, 1], "links": [{"a": 0, "b": 1, "capacity": 1, "directed": "yes"}]},
     "directed must be true or false"),
    ({"nodes": [0, 1], "links": [{"a": 0, "b": 1, "capacity": 1},
                                 {"a": 1, "b": 0, "capacity": 1}]},
     r"links\[1\] \(1 - 0\): repeats links\[0\]"),
])
def test_a_malformed_json_file_names_the_file_the_entry_and_the_problem(tmp_path, data, match):
    path = _write(tmp_path, data)
    with pytest.raises(TopologyError, match=match) as err:
        from_file(path)
    assert str(err.value).startswith(f"topology file {path}: ")


def test_a_missing_file_says_it_cannot_be_read(tmp_path):
    with pytest.raises(TopologyError, match="nope.json: cannot be read"):
        from_file(tmp_path / "nope.json")


def test_from_json_takes_a_decoded_object():
    t = from_json({"nodes": [0, 1], "links": [{"a": 0, "b": 1, "capacity": 3}]}, source="x")
    assert t.capacity(1, 0) == 3 and t.unit_bytes_per_s is None


# -- nvidia-smi topo -m ---------------------------------------------------

# An 8-GPU NVSwitch board (DGX A100): every pair shows NV12, though each GPU
# has 12 links in all, into the switches. Older output: no NUMA column.
DGXA100_TEXT = "\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tCPU Affinity\n" + "\n".join(
    f"GPU{i}\t" + "\t".join(" X " if i == j else "NV12" for j in range(8))
    + f"\t{'0-63' if i < 4 else '64-127'}" for i in range(8)) + "\n"

# A PCIe-only box: GPUs 0,1 behind one switch, 2 beside them under the same
# host bridge's tree (PXB), 3 on the other socket (SOC, the old name of SYS).
PCIE_TEXT = """        GPU0    GPU1    GPU2    GPU3    CPU Affinity
GPU0     X      PIX     PXB     SOC     0-11
GPU1    PIX      X      PXB     SOC     0-11
GPU2    PXB     PXB      X      SOC     0-11
GPU3    SOC     SOC     SOC      X      12-23
"""


def test_dgx1v_text_gives_its_nvlinks_and_a_pcie_tree_under_two_cpus():
    t = from_smi_text(DGX1V_TEXT)
    assert t.nodes == tuple(range(8))
    nv = Topology(t.nodes, [x for x in t.links if x.kind == "nvlink"])
    assert nv == Topology(t.nodes, fixture("dgx1v").links)
    # NV# hides the PCIe distance among GPUs 0-3 (and 4-7): one CPU each, by NUMA node
    assert set(t.relays) == {"cpu0", "cpu1"}
    assert t.capacity(0, "cpu0") == 16.0 and t.capacity(5, "cpu1") == 16.0
    assert t.link("cpu0", "cpu1").kind == "smp" and t.capacity("cpu1", "cpu0") == 38.4
    assert any("NV#" in n for n in t.notes)


def test_an_nvswitch_board_is_one_switch_not_a_mesh_of_nv12_pairs():
    t = from_smi_text(DGXA100_TEXT, nvlink_gb_s=25.0)
    assert "nvswitch" in t.relays
    assert t.capacity(0, 1) == 0  # no direct links
    assert t.capacity(3, "nvswitch") == t.capacity("nvswitch", 3) == 12 * 25.0
    assert any("NVSwitch" in n for n in t.notes)
    # the CPU affinity stands in for the NUMA node
    assert t.capacity(0, "cpu0") > 0 and t.capacity(7, "cpu1") > 0


def test_a_pcie_only_box_gives_switches_under_the_cpus():
    t = from_smi_text(PCIE_TEXT, pcie_gb_s=32.0, smp_gb_s=40.0)
    assert not [x for x in t.links if x.kind == "nvlink"]
    # 0,1 behind switch0; switch0 and 2 behind switch1 (PXB); that and 3 under the CPUs
    assert t.capacity(0, "pcie-switch0") == 32 and t.capacity(1, "pcie-switch0") == 32
    assert t.capacity("pcie-switch0", "pcie-switch1") == 32
    assert t.capacity(2, "pcie-switch1") == 32
    cpus = [r for r in t.relays if str(r).startswith("cpu")]
    assert len(cpus) == 2 and t.capacity(cpus[0], cpus[1]) == 40
    assert t.capacity(3, cpus[1]) == 32 or t.capacity(3, cpus[0]) == 32


@pytest.mark.parametrize("text, match", [
    ("hello\nworld\n", "no header line naming GPU0"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV1\n", "no row for GPU1"),
    ("\tGPU0\tGPU1\nGPU0\t X \nGPU1\tNV1\t X \n", r"line 2 \(GPU0\): 1 entries for 2 columns"),
    ("\tGPU0\tGPU1\nGPU0\t X \tFAST\nGPU1\tNV1\t X \n", "unknown entry 'FAST'"),
])
def test_malformed_smi_text_names_the_line_and_the_problem(text, match):
    with pytest.raises(TopologyError, match=match):
        from_smi_text(text, source="topo.txt")


def test_from_file_reads_saved_smi_text(tmp_path):
    path = tmp_path / "topo.txt"
    path.write_text(DGX1V_TEXT)
    t = from_file(path)
    assert t.name == f"topology file {path}" and t.capacity(0, 3) == 50


def test_pcie_tree_of_known_levels():
    """Two switches of two GPUs under one host bridge, under one CPU; a fifth
    GPU on the other socket."""
    levels = {}
    gpus = [0, 1, 2, 3, 4]
    for a in gpus:
        for b in gpus:
            if a < b:
                levels[frozenset((a, b))] = (
                    "SYS" if 4 in (a, b) else "PIX" if a // 2 == b // 2 else "PHB")
    tree = pcie_tree(gpus, levels, gpu_capacity=dict.fromkeys(gpus, 16.0), switch_capacity=16.0,
                     smp_capacity=40.0)
    links = {(a, b): (cap, kind) for a, b, cap, kind in tree.links}
    assert links[(0, "pcie-switch0")] == (16.0, "pcie")
    assert links[(2, "pcie-switch1")] == (16.0, "pcie")
    assert links[("pcie-switch0", "host-bridge0")] == (16.0, "pcie")
    assert links[("host-bridge0", "cpu0")] == (16.0, "pcie")
    assert links[(4, "cpu1")] == (16.0, "pcie")
    assert links[("cpu0", "cpu1")] == (40.0, "smp")
    assert len(tree.links) == 9


# -- NVML -----------------------------------------------------------------


def test_nvml_counts_nvlinks_per_pair_and_builds_the_pcie_tree():
    nvml = fake_nvml(pairs=[(0, 1, 2), (1, 2, 1), (2, 3, 4)],
                     levels=lambda a, b: 10 if a // 2 == b // 2 else 50, p2p_bad=[(0, 3)])
    t = from_nvml(nvml)
    assert t.name == "this machine (4 x NVIDIA A100-SXM4-80GB)"
    assert t.capacity(0, 1) == 50 and t.capacity(1, 2) == 25 and t.capacity(2, 3) == 100
    assert t.capacity(0, 2) == 0
    gen4x16 = round(1.969 * 16, 3)
    assert t.capacity(0, "pcie-switch0") == gen4x16 and t.capacity(3, "pcie-switch1") == gen4x16
    assert t.capacity("cpu0", "cpu1") > 0 and t.link("cpu0", "cpu1").kind == "smp"
    assert any("GPUs 0 and 3: no peer-to-peer" in n for n in t.notes)


def test_nvml_links_to_an_nvswitch_go_to_one_relay():
    t = from_nvml(fake_nvml(switch_links=12, count=8))
    assert "nvswitch" in t.relays
    assert t.capacity(5, "nvswitch") == t.capacity("nvswitch", 5) == 12 * 25.0
    assert t.capacity(0, 1) == 0


def test_nvml_nvlink5_links_are_50_gb_s():
    t = from_nvml(fake_nvml(pairs=[(0, 1, 1)], count=2, nvlink_version=5))
    assert t.capacity(0, 1) == 50.0


def test_no_driver_or_no_package_is_said_plainly(monkeypatch):
    with pytest.raises(TopologyUnavailable, match="no GPU topology: no NVIDIA driver found"):
        from_nvml(fake_nvml(init_error="NVML Shared Library Not Found"))
    with pytest.raises(TopologyUnavailable, match="the NVIDIA driver reports no GPU"):
        from_nvml(fake_nvml(count=0))
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)
    with pytest.raises(TopologyUnavailable, match="nvidia-ml-py is not installed"):
        from_nvml()


def test_this_machine_either_has_a_topology_or_says_why_not():
    try:
        t = from_nvml()
    except TopologyUnavailable as exc:
        assert str(exc).startswith("no GPU topology: ")
    else:
        assert t.nodes and t.unit_bytes_per_s == 1e9
