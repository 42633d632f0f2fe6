"""Topologies: directed graphs of link capacities among GPUs or hosts, from
NVML, from `nvidia-smi topo -m` text, from a JSON file, or built in.

Imports the standard library alone; networkx loads when a graph is asked for.
"""

from __future__ import annotations

from .files import from_file, from_json, to_json
from .fixtures import FIXTURES, fixture
from .graph import Link, Node, Topology, TopologyError, TopologyUnavailable
from .nvidia import from_nvml, from_smi_text

__all__ = [
    "FIXTURES", "Link", "Node", "Topology", "TopologyError", "TopologyUnavailable",
    "fixture", "from_file", "from_json", "from_nvml", "from_smi_text", "to_json",
]
