"""Blink-style packed spanning trees: for a root and a set of members of a
`Topology`, trees over the links that together carry (nearly) the most a
broadcast can, and the fewest of them that keep that rate.

    plan = pack(fixture("dgx1v"), root=0)          # all 8 GPUs
    plan.bound, plan.rate, len(plan.trees)           # 150.0 150.0 4 (GB/s)
    plan.split(size)                                 # a byte range per tree

Pure functions of the topology and the members (the directory and the
simulators call them); plans are cached. Importing this package needs the
standard library alone; packing needs networkx and SciPy (the `plan` extra).
"""

from __future__ import annotations

from .plan import FLOWS, PlanError, Tree, TreePlan
from .planner import bound, pack

__all__ = ["FLOWS", "PlanError", "Tree", "TreePlan", "bound", "pack"]
