"""A machine's GPU topology from NVML (nvidia-ml-py) or from the text of
`nvidia-smi topo -m`.

Capacities are in GB/s per direction (`unit_bytes_per_s` = 1e9): an NVLink
is 25 GB/s per direction on NVLink 2 to 4 (V100, A100, H100) and 50 on
NVLink 5; a PCIe link is its lanes times the generation's rate (NVML), or
`pcie_gb_s` when the text does not say. A GPU's NVLinks to an NVSwitch go to
one relay, "nvswitch" (the switches of a board form one non-blocking plane);
the PCIe tree comes from the GPUs' pairwise PCIe distances (see pcie.py).
"""

from __future__ import annotations

import re
from typing import Any

from .graph import Link, Node, Topology, TopologyError, TopologyUnavailable
from .pcie import LEVELS, pcie_tree

#: GB/s per direction of one NVLink, by NVLink version.
NVLINK_GB_S = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}
#: GB/s per direction of one PCIe lane, by generation.
PCIE_LANE_GB_S = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
#: When the text does not say: a Gen3 x16 link, and two QPI links at 9.6 GT/s
#: between the sockets (a DGX-1V's).
PCIE_GB_S = 16.0
SMP_GB_S = 38.4
#: The most NVLinks any GPU has had (H100, B200): a GPU that shows more to
#: its peers together reaches them through NVSwitch.
MAX_LINKS_PER_GPU = 18

_NVML_LEVELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
NVSWITCH = "nvswitch"


# -- NVML -----------------------------------------------------------------

def from_nvml(nvml: Any = None) -> Topology:
    """This machine's GPUs, NVLinks (to peers and to NVSwitch) and PCIe tree.
    `nvml` replaces the pynvml module (tests pass a fake). Raises
    TopologyUnavailable, saying why, when there is no NVML, driver or GPU."""
    if nvml is None:
        try:
            import pynvml as nvml  # noqa: PLC0415 - optional
        except ImportError:
            raise TopologyUnavailable("no GPU topology: nvidia-ml-py is not installed "
                                      "(pip install 'hoplite-gpu[gpu]')") from None
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise TopologyUnavailable(f"no GPU topology: no NVIDIA driver found ({exc})") from None
    try:
        try:
            return _read_nvml(nvml)
        except nvml.NVMLError as exc:
            raise TopologyUnavailable(f"no GPU topology: NVML could not read it ({exc})") from None
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def _bus_key(bus_id: Any) -> tuple[int, int, str]:
    text = (bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)).strip().lower()
    parts = text.split(":")
    domain = int(parts[0], 16) if len(parts) == 3 else 0
    return domain, int(parts[-2], 16), parts[-1]


def _read_nvml(nvml: Any) -> Topology:
    count = nvml.nvmlDeviceGetCount()
    if count == 0:
        raise TopologyUnavailable("no GPU topology: the NVIDIA driver reports no GPU")
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    by_bus = {_bus_key(nvml.nvmlDeviceGetPciInfo(h).busId): i for i, h in enumerate(handles)}
    gpus = list(range(count))
    links: list[Link] = []
    to_switch: dict[int, float] = {}
    for i, h in enumerate(handles):
        peers, switch = _nvlinks(nvml, h, by_bus)
        links += [Link(i, j, cap, "nvlink") for j, cap in sorted(peers.items())]
        if switch:
            to_switch[i] = switch
    relays: list[Node] = []
    if to_switch:
        relays.append(NVSWITCH)
        for i, cap in sorted(to_switch.items()):
            links += [Link(i, NVSWITCH, cap, "nvlink"), Link(NVSWITCH, i, cap, "nvlink")]
    levels, notes = _pcie_levels(nvml, handles)
    capacity = {i: _pcie_gb_s(nvml, h) for i, h in enumerate(handles)}
    tree = pcie_tree(gpus, levels, gpu_capacity=capacity,
                     switch_capacity=max(capacity.values()), smp_capacity=SMP_GB_S)
    relays += tree.relays
    for a, b, cap, kind in tree.links:
        links += [Link(a, b, cap, kind), Link(b, a, cap, kind)]
    name = nvml.nvmlDeviceGetName(handles[0])
    name = name.decode() if isinstance(name, bytes) else str(name)
    return Topology(gpus, links, relays=relays, unit_bytes_per_s=1e9,
                    name=f"this machine ({count} x {name})", notes=notes)


def _nvlinks(nvml: Any, handle: Any, by_bus: dict) -> tuple[dict[int, float], float]:
    """GB/s from this GPU to each NVLink peer, and to NVSwitch."""
    peers: dict[int, float] = {}
    switch = 0.0
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                continue
            remote = _bus_key(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
        except nvml.NVMLError:
            continue  # no such link, or no NVLink on this GPU
        try:
            version = nvml.nvmlDeviceGetNvLinkVersion(handle, link)
        except nvml.NVMLError:
            version = 4
        try:
            kind = nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
        except (nvml.NVMLError, AttributeError):  # older drivers and bindings
            kind = None
        gb_s = NVLINK_GB_S.get(version, 25.0)
        if kind == getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2) or (
                kind is None and remote not in by_bus):
            switch += gb_s
        elif remote in by_bus:
            peers[by_bus[remote]] = peers.get(by_bus[remote], 0.0) + gb_s
    return peers, switch


def _pcie_levels(nvml: Any, handles: list) -> tuple[dict[frozenset, str | None], list[str]]:
    levels: dict[frozenset, str | None] = {}
    notes = []
    read = getattr(nvml, "NVML_P2P_CAPS_INDEX_READ", 0)
    for i in range(len(handles)):
        for j in range(i + 1, len(handles)):
            try:
                ancestor = nvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                levels[frozenset((i, j))] = _NVML_LEVELS.get(int(ancestor))
            except nvml.NVMLError:
                levels[frozenset((i, j))] = None
            try:
                status = nvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], read)
            except nvml.NVMLError:
                continue
            if status != nvml.NVML_P2P_STATUS_OK:
                notes.append(f"GPUs {i} and {j}: no peer-to-peer access (NVML status {status}); "
                             "their bytes are staged through host memory, over the same links")
    return levels, notes


def _pcie_gb_s(nvml: Any, handle: Any) -> float:
    try:
        gen = nvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)
        width = nvml.nvmlDeviceGetMaxPcieLinkWidth(handle)
    except nvml.NVMLError:
        return PCIE_GB_S
    lane = PCIE_LANE_GB_S.get(gen)
    return round(lane * width, 3) if lane and width > 0 else PCIE_GB_S


# -- nvidia-smi topo -m ---------------------------------------------------

_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
_NV = re.compile(r"NV(\d+)")
_TRAILING = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")


def from_smi_text(text: str, *, source: str = "nvidia-smi topo -m",
                  nvlink_gb_s: float = 25.0, pcie_gb_s: float = PCIE_GB_S,
                  smp_gb_s: float = SMP_GB_S) -> Topology:
    """The GPUs, NVLinks and PCIe tree that `nvidia-smi topo -m` printed.

    NV# is # links of `nvlink_gb_s`; when a GPU shows more links to its peers
    together than any GPU has (MAX_LINKS_PER_GPU), they go through NVSwitch.
    NICs are left out. The PCIe distance of a pair shown as NV# is unknown;
    such GPUs are placed under one CPU unless their NUMA nodes differ."""
    columns, rows = _matrix(text, source)
    gpus = sorted(rows)
    nv: dict[tuple[int, int], int] = {}
    levels: dict[frozenset, str | None] = {}
    for g, (cells, _) in rows.items():
        for col, cell in zip(columns, cells, strict=True):
            peer = _gpu_index(col)
            if peer is None or peer == g:
                continue
            m = _NV.fullmatch(cell)
            if m:
                nv[(g, peer)] = int(m.group(1))
                levels.setdefault(frozenset((g, peer)), None)
            else:
                levels[frozenset((g, peer))] = "SYS" if cell == "SOC" else cell
    links: list[Link] = []
    relays: list[Node] = []
    notes = []
    per_gpu = {g: sum(n for (a, _), n in nv.items() if a == g) for g in gpus}
    if any(total > MAX_LINKS_PER_GPU for total in per_gpu.values()):
        relays.append(NVSWITCH)
        for g in gpus:
            k = max((n for (a, _), n in nv.items() if a == g), default=0)
            if k:
                links += [Link(g, NVSWITCH, k * nvlink_gb_s, "nvlink"),
                          Link(NVSWITCH, g, k * nvlink_gb_s, "nvlink")]
        notes.append(f"a GPU shows {max(per_gpu.values())} NVLinks to its peers together, more "
                     f"than a GPU has ({MAX_LINKS_PER_GPU}): they go through NVSwitch, modelled "
                     f"as one switch")
    else:
        links += [Link(a, b, n * nvlink_gb_s, "nvlink") for (a, b), n in sorted(nv.items())]
    numa = {g: rows[g][1] for g in gpus}
    tree = pcie_tree(gpus, levels, gpu_capacity=dict.fromkeys(gpus, pcie_gb_s),
                     switch_capacity=pcie_gb_s, smp_capacity=smp_gb_s, numa=numa)
    relays += tree.relays
    for a, b, cap, kind in tree.links:
        links += [Link(a, b, cap, kind), Link(b, a, cap, kind)]
    if any(v is None for v in levels.values()):
        notes.append("the PCIe distance of GPUs shown as NV# is not printed: they are placed "
                     "under one CPU (NVML reports it)")
    return Topology(gpus, links, relays=relays, unit_bytes_per_s=1e9, name=source, notes=notes)


def _gpu_index(name: str) -> int | None:
    m = re.fullmatch(r"GPU(\d+)", name)
    return int(m.group(1)) if m else None


def _matrix(text: str, source: str) -> tuple[list[str], dict[int, tuple[list[str], Any]]]:
    """The column names and, per GPU, its row's cells and NUMA key."""
    lines = [_ESCAPE.sub("", line).rstrip() for line in text.splitlines()]
    start = next((i for i, line in enumerate(lines) if re.search(r"\bGPU0\b", line)), None)
    if start is None:
        raise TopologyError(f"{source}: no header line naming GPU0: not the output of "
                            "`nvidia-smi topo -m`")
    header = lines[start].split()
    ncols = next((i for i, tok in enumerate(header) if tok in ("CPU", "NUMA", "GPU")),
                 len(header))
    columns = header[:ncols]
    rest = " ".join(header[ncols:])
    trailing = sorted((c for c in _TRAILING if c in rest), key=rest.index)
    rows: dict[int, tuple[list[str], Any]] = {}
    for n, line in enumerate(lines[start + 1:], start + 2):
        toks = line.split()
        if not toks or toks[0].rstrip(":") == "Legend":
            break
        g = _gpu_index(toks[0])
        if g is None:
            continue  # a NIC's row
        cells = toks[1:1 + ncols]
        if len(cells) < ncols:
            raise TopologyError(f"{source}: line {n} ({toks[0]}): {len(cells)} entries for "
                                f"{ncols} columns")
        for cell in cells:
            if cell != "X" and not _NV.fullmatch(cell) and cell not in LEVELS + ("SOC",):
                raise TopologyError(f"{source}: line {n} ({toks[0]}): unknown entry {cell!r} "
                                    f"(expected X, NV#, {', '.join(LEVELS)})")
        extra = toks[1 + ncols:]
        rows[g] = (cells, _numa_key(extra, trailing))
    if not rows:
        raise TopologyError(f"{source}: the matrix has no GPU rows")
    missing = [c for c in columns if _gpu_index(c) is not None and _gpu_index(c) not in rows]
    if missing:
        raise TopologyError(f"{source}: no row for {', '.join(missing)}")
    return columns, rows


def _numa_key(extra: list[str], trailing: list[str]) -> Any:
    """The NUMA node of a row (its NUMA Affinity), else its CPU affinity; None if neither."""
    values = dict(zip(trailing, extra, strict=False))
    numa = values.get("NUMA Affinity")
    if numa is not None and numa != "N/A":
        return numa
    return values.get("CPU Affinity")
