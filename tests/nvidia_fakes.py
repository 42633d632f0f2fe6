"""Stand-ins for what NVIDIA tools report, shared by the topology tests: a
DGX-1V's `nvidia-smi topo -m` text and a fake pynvml module."""

from __future__ import annotations

import types

# A DGX-1V as `nvidia-smi topo -m` prints it: the header underlined with
# terminal escapes, NICs among the columns, the NUMA affinity, a legend.
DGX1V_TEXT = """\x1b[4m\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tmlx5_0\tmlx5_1\
\tmlx5_2\tmlx5_3\tCPU Affinity\tNUMA Affinity\x1b[0m
GPU0\t X \tNV1\tNV1\tNV2\tNV2\tSYS\tSYS\tSYS\tPIX\tPHB\tSYS\tSYS\t0-19,40-59\t0
GPU1\tNV1\t X \tNV2\tNV1\tSYS\tNV2\tSYS\tSYS\tPIX\tPHB\tSYS\tSYS\t0-19,40-59\t0
GPU2\tNV1\tNV2\t X \tNV2\tSYS\tSYS\tNV1\tSYS\tPHB\tPIX\tSYS\tSYS\t0-19,40-59\t0
GPU3\tNV2\tNV1\tNV2\t X \tSYS\tSYS\tSYS\tNV1\tPHB\tPIX\tSYS\tSYS\t0-19,40-59\t0
GPU4\tNV2\tSYS\tSYS\tSYS\t X \tNV1\tNV1\tNV2\tSYS\tSYS\tPIX\tPHB\t20-39,60-79\t1
GPU5\tSYS\tNV2\tSYS\tSYS\tNV1\t X \tNV2\tNV1\tSYS\tSYS\tPIX\tPHB\t20-39,60-79\t1
GPU6\tSYS\tSYS\tNV1\tSYS\tNV1\tNV2\t X \tNV2\tSYS\tSYS\tPHB\tPIX\t20-39,60-79\t1
GPU7\tSYS\tSYS\tSYS\tNV1\tNV2\tNV1\tNV2\t X \tSYS\tSYS\tPHB\tPIX\t20-39,60-79\t1
mlx5_0\tPIX\tPIX\tPHB\tPHB\tSYS\tSYS\tSYS\tSYS\t X \tPHB\tSYS\tSYS
mlx5_1\tPHB\tPHB\tPIX\tPIX\tSYS\tSYS\tSYS\tSYS\tPHB\t X \tSYS\tSYS
mlx5_2\tSYS\tSYS\tSYS\tSYS\tPIX\tPIX\tPHB\tPHB\tSYS\tSYS\t X \tPHB
mlx5_3\tSYS\tSYS\tSYS\tSYS\tPHB\tPHB\tPIX\tPIX\tSYS\tSYS\tPHB\t X

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NV#  = Connection traversing a bonded set of # NVLinks
"""


class _NVMLError(Exception):
    pass


def fake_nvml(pairs=(), switch_links=0, count=4, levels=None, p2p_bad=(), init_error=None,
              nvlink_version=3):
    """A stand-in for pynvml: `pairs` (a, b, links) of direct NVLinks, or
    `switch_links` per GPU to an NVSwitch; PCIe distances from `levels(a, b)`
    (NVML values; default all under one host bridge)."""
    m = types.SimpleNamespace(
        NVMLError=_NVMLError, NVML_FEATURE_ENABLED=1, NVML_NVLINK_MAX_LINKS=18,
        NVML_NVLINK_DEVICE_TYPE_SWITCH=2, NVML_P2P_CAPS_INDEX_READ=0, NVML_P2P_STATUS_OK=0)
    bus = [f"00000000:{0x10 + i:02X}:00.0" for i in range(count)]
    links: dict[int, list] = {i: [] for i in range(count)}
    for a, b, n in pairs:
        links[a] += [("gpu", bus[b])] * n
        links[b] += [("gpu", bus[a])] * n
    for i in range(count):
        links[i] += [("switch", "00000000:C0:00.0")] * switch_links

    def init():
        if init_error:
            raise _NVMLError(init_error)

    def link_of(h, link):
        if link >= len(links[h]):
            raise _NVMLError("Not Supported")
        return links[h][link]

    m.nvmlInit, m.nvmlShutdown = init, lambda: None
    m.nvmlDeviceGetCount = lambda: count
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: b"NVIDIA A100-SXM4-80GB"
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=bus[h].encode())
    m.nvmlDeviceGetNvLinkState = lambda h, link: (link_of(h, link), 1)[1]
    m.nvmlDeviceGetNvLinkRemotePciInfo = lambda h, link: types.SimpleNamespace(
        busId=link_of(h, link)[1].lower())
    m.nvmlDeviceGetNvLinkRemoteDeviceType = lambda h, link: (
        2 if link_of(h, link)[0] == "switch" else 0)
    m.nvmlDeviceGetNvLinkVersion = lambda h, link: nvlink_version
    m.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: (levels or (lambda a, b: 30))(a, b)
    m.nvmlDeviceGetP2PStatus = lambda a, b, what: 4 if {a, b} in map(set, p2p_bad) else 0
    m.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: 4
    m.nvmlDeviceGetMaxPcieLinkWidth = lambda h: 16
    return m
