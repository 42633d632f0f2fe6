"""Built-in topologies of well-known machines, in GB/s per direction."""

from __future__ import annotations

from collections.abc import Callable

from .graph import Node, Topology, TopologyError

#: One NVLink 2-4, GB/s per direction.
NVLINK = 25.0

#: A DGX-1V's NVLink 2 "hybrid cube mesh": each V100 has six links, bonded
#: in pairs (NV2) to some neighbours.
DGX1V_NV2 = ((0, 3), (0, 4), (1, 2), (1, 5), (2, 3), (4, 7), (5, 6), (6, 7))
DGX1V_NV1 = ((0, 1), (0, 2), (1, 3), (2, 6), (3, 7), (4, 5), (4, 6), (5, 7))


def _dgx1v_links(offset: int = 0) -> list[tuple[Node, Node, float, str]]:
    return ([(a + offset, b + offset, 2 * NVLINK, "nvlink") for a, b in DGX1V_NV2]
            + [(a + offset, b + offset, NVLINK, "nvlink") for a, b in DGX1V_NV1])


def dgx1v() -> Topology:
    return Topology.undirected(range(8), _dgx1v_links(), unit_bytes_per_s=1e9, name="dgx1v")


def dgx1v_pcie() -> Topology:
    """The DGX-1V with its PCIe tree: GPU pairs (0,1) (2,3) (4,5) (6,7) behind
    PCIe Gen3 x16 switches, two switches per CPU, two QPI links between CPUs."""
    pcie = 16.0
    pairs = _dgx1v_links()
    for k in range(4):
        switch = f"pcie-switch{k}"
        pairs += [(2 * k, switch, pcie, "pcie"), (2 * k + 1, switch, pcie, "pcie"),
                  (switch, f"cpu{k // 2}", pcie, "pcie")]
    pairs.append(("cpu0", "cpu1", 38.4, "smp"))
    relays = [f"pcie-switch{k}" for k in range(4)] + ["cpu0", "cpu1"]
    return Topology.undirected(range(8), pairs, relays=relays, unit_bytes_per_s=1e9,
                               name="dgx1v-pcie")


def _switched(n: int, links_per_gpu: int, name: str) -> Topology:
    cap = links_per_gpu * NVLINK
    return Topology.undirected(range(n), [(g, "nvswitch", cap, "nvlink") for g in range(n)],
                               relays=["nvswitch"], unit_bytes_per_s=1e9, name=name)


def nvswitch() -> Topology:
    """An HGX H100: 8 GPUs, 18 NVLinks each into a non-blocking NVSwitch plane
    (450 GB/s per GPU and direction), modelled as one switch that forwards but
    does not copy (no NVLink SHARP multicast)."""
    return _switched(8, 18, "nvswitch")


def nvswitch16() -> Topology:
    """A DGX-2: 16 V100s, 6 NVLinks each into the NVSwitch plane (150 GB/s)."""
    return _switched(16, 6, "nvswitch16")


def pcie() -> Topology:
    """A PCIe-only server: 8 GPUs in pairs behind Gen4 x16 switches (31.5 GB/s),
    two switches per CPU, three UPI links (62.4 GB/s) between the CPUs."""
    gen4 = 31.5
    pairs: list[tuple[Node, Node, float, str]] = []
    for k in range(4):
        switch = f"pcie-switch{k}"
        pairs += [(2 * k, switch, gen4, "pcie"), (2 * k + 1, switch, gen4, "pcie"),
                  (switch, f"cpu{k // 2}", gen4, "pcie")]
    pairs.append(("cpu0", "cpu1", 62.4, "smp"))
    relays = [f"pcie-switch{k}" for k in range(4)] + ["cpu0", "cpu1"]
    return Topology.undirected(range(8), pairs, relays=relays, unit_bytes_per_s=1e9, name="pcie")


def dgx1v_x2() -> Topology:
    """Two DGX-1Vs (GPUs 0-7 and 8-15) joined by 100 Gb/s InfiniBand: GPUs 0, 2,
    4 and 6 of each reach one switch through a NIC (12.5 GB/s) by GPUDirect
    RDMA; the PCIe between a GPU and its NIC is left out."""
    pairs = _dgx1v_links() + _dgx1v_links(8)
    pairs += [(g, "ib-switch", 12.5, "net") for g in (0, 2, 4, 6, 8, 10, 12, 14)]
    return Topology.undirected(range(16), pairs, relays=["ib-switch"], unit_bytes_per_s=1e9,
                               name="dgx1v-x2")


FIXTURES: dict[str, tuple[Callable[[], Topology], str]] = {
    "dgx1v": (dgx1v, "DGX-1V, 8 V100s, NVLink hybrid cube mesh (NV1 25, NV2 50 GB/s)"),
    "dgx1v-pcie": (dgx1v_pcie, "DGX-1V with its PCIe Gen3 tree and QPI besides NVLink"),
    "dgx1v-x2": (dgx1v_x2, "two DGX-1Vs joined by four 100 Gb/s NICs each"),
    "nvswitch": (nvswitch, "HGX H100, 8 GPUs, 450 GB/s each into one NVSwitch plane"),
    "nvswitch16": (nvswitch16, "DGX-2, 16 V100s, 150 GB/s each into one NVSwitch plane"),
    "pcie": (pcie, "8 GPUs on a PCIe Gen4 switch tree under two CPUs, no NVLink"),
}


def fixture(name: str) -> Topology:
    """The built-in topology `name` (see FIXTURES)."""
    try:
        build = FIXTURES[name][0]
    except KeyError:
        raise TopologyError(f"unknown fixture {name!r} (known: {', '.join(FIXTURES)})") from None
    return build()

