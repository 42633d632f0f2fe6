"""Drawings of packed trees (`hoplite-gpu topology pack --png`), one panel per
tree: the members on a circle, the relays inside it, the topology's links in
grey and the tree's paths as arrows."""

from __future__ import annotations

import math
from typing import Any

from .topology import Topology
from .trees import TreePlan


def _positions(plan: TreePlan, topology: Topology) -> dict[Any, tuple[float, float]]:
    pos = {}
    ring = list(plan.members)
    for i, node in enumerate(ring):
        a = math.pi / 2 - 2 * math.pi * i / len(ring)
        pos[node] = (math.cos(a), math.sin(a))
    relays = list(topology.relays)
    for i, node in enumerate(relays):
        a = math.pi / 2 - 2 * math.pi * (i + 0.5) / max(1, len(relays))
        r = 0.0 if len(relays) == 1 else 0.45
        pos[node] = (r * math.cos(a), r * math.sin(a))
    return pos


def draw_trees(plt: Any, plan: TreePlan, topology: Topology, path: str) -> None:
    """Write a PNG of `plan`'s trees to `path` (`plt` is matplotlib.pyplot)."""
    n = max(1, len(plan.trees))
    cols = min(4, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.4 * rows), squeeze=False)
    pos = _positions(plan, topology)
    unit = "GB/s" if topology.unit_bytes_per_s == 1e9 else "units"
    shown = set(pos)
    for k, ax in enumerate(axes.flat):
        ax.set_axis_off()
        ax.set_xlim(-1.3, 1.3)
        ax.set_ylim(-1.3, 1.3)
        if k >= len(plan.trees):
            continue
        tree = plan.trees[k]
        for link in topology.links:
            if link.src in shown and link.dst in shown:
                (x0, y0), (x1, y1) = pos[link.src], pos[link.dst]
                ax.plot([x0, x1], [y0, y1], color="0.85", lw=0.8, zorder=1)
        for p in tree.paths:
            for a, b in zip(p, p[1:], strict=False):
                (x0, y0), (x1, y1) = pos[a], pos[b]
                if plan.flow == "reduce":
                    (x0, y0), (x1, y1) = (x1, y1), (x0, y0)
                ax.annotate("", xy=(x1, y1), xytext=(x0, y0), zorder=2,
                            arrowprops={"arrowstyle": "->", "color": "C0", "lw": 1.6,
                                        "shrinkA": 9, "shrinkB": 9})
        for node, (x, y) in pos.items():
            relay = topology.is_relay(node)
            color = "C3" if node == plan.root else ("0.6" if relay else "C2")
            ax.scatter([x], [y], s=90 if relay else 260, marker="s" if relay else "o",
                       color=color, zorder=3)
            if relay:
                ax.text(x, y - 0.1, str(node), ha="center", va="top", fontsize=5, zorder=4)
            else:
                ax.text(x, y, str(node), ha="center", va="center", fontsize=8,
                        color="white", zorder=4)
        ax.set_title(f"tree {k}: {tree.rate:.4g} {unit}\n{', '.join(tree.kinds)}", fontsize=9)
    fig.suptitle(f"{topology.name}: {plan.flow} from {plan.root}, {plan.rate:.4g} {unit} "
                 f"of R* {plan.bound:.4g}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
