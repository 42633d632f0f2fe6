"""One simulated op on one fabric with one routing, and what it measured."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .bounds import spread_bound, traffic_bound
from .engine import MERGE
from .hoplite_ops import HopliteBroadcast, HopliteReduce
from .network import Network
from .ops import AllToAll, Op, PointToPoint, RingAllreduce, TreeBroadcast, TreeReduce
from .topology import HOST_DOWN, HOST_UP, LAYER_NAMES, Fabric


@dataclass
class FabricResult:
    fabric: str
    hosts: int
    op: str
    routing: str
    size_bytes: float
    #: when the last host was done
    completion_s: float
    #: what no schedule beats on this fabric (bounds.py)
    bound_s: float
    #: the most bytes any switch-to-switch link carried (host links carry the
    #: same under every routing)
    max_link_load_bytes: float
    #: the same, per layer (leaf-up, leaf-down, core-up, core-down; host links too)
    max_load_by_layer: dict[str, float] = field(default_factory=dict)
    #: the largest part a flow was split into that crossed a switch
    largest_part_bytes: float = 0.0
    events: int = 0
    full_recomputations: int = 0
    partial_recomputations: int = 0
    messages: int = 0
    flows: int = 0
    wall_s: float = 0.0
    failed_links: str = ""
    extra: dict = field(default_factory=dict)
    #: bytes each link carried (not in `as_dict`)
    link_bytes: np.ndarray | None = field(default=None, repr=False)

    def as_dict(self) -> dict:
        out = asdict(self)
        del out["link_bytes"]
        return out


def op_bound(fabric: Fabric, op: Op) -> float:
    """The bound for `op` on `fabric` (see bounds.py for what is used)."""
    cap = fabric.capacity
    if isinstance(op, RingAllreduce):
        ring = np.array(op.ring)
        nxt = np.roll(ring, -1)
        steps = op.steps
        chain = steps * op.piece / np.minimum(cap[fabric.host_up[ring]],
                                              cap[fabric.host_down[nxt]])
        return max(float(chain.max()),
                   traffic_bound(fabric, ring, nxt, np.full(len(ring), steps * op.piece)))
    if isinstance(op, AllToAll):
        hosts = np.array(op.hosts)
        p = len(hosts)
        src = np.repeat(hosts, p)
        dst = np.tile(hosts, p)
        keep = src != dst
        return traffic_bound(fabric, src[keep], dst[keep], np.full(int(keep.sum()), op.size / p))
    if isinstance(op, PointToPoint):
        return traffic_bound(fabric, np.array([op.src]), np.array([op.dst]),
                             np.array([op.size]))
    if isinstance(op, HopliteBroadcast | TreeBroadcast):
        root, others = _root_and_others(op)
        return spread_bound(fabric, root, others, op.size, inward=True)
    if isinstance(op, HopliteReduce | TreeReduce):
        root, others = _root_and_others(op)
        return spread_bound(fabric, root, others, op.size, inward=False)
    raise TypeError(f"op_bound: no bound for {type(op).__name__}")


def _root_and_others(op: Op) -> tuple[int | None, np.ndarray]:
    if isinstance(op, HopliteBroadcast):
        return op.hosts[0], np.array(op.hosts[1:])
    if isinstance(op, HopliteReduce):
        # (the directory picks the root among the inputs' nodes)
        return None, np.array(op.hosts[:-1])
    return op.root, np.array([h for h in op.children if h != op.root])


def simulate(fabric: Fabric, op: Op, routing: str, *, seed: int = 0, merge: float = MERGE,
             subflows: int | None = None) -> FabricResult:
    """Play `op` on `fabric` with `routing` until every host is done."""
    started = time.perf_counter()
    net = Network(fabric, routing, seed=seed, merge=merge, subflows=subflows)
    op.start(net)
    net.run()
    if isinstance(op, HopliteReduce):
        op.finish()
    wall = time.perf_counter() - started
    carried = net.link_bytes()
    fabric_links = (fabric.layer != HOST_UP) & (fabric.layer != HOST_DOWN)
    by_layer = {}
    for i, name in enumerate(LAYER_NAMES):
        on = fabric.layer == i
        if on.any():
            by_layer[name] = float(carried[on].max())
    e = net.engine
    return FabricResult(
        fabric=fabric.describe(), hosts=fabric.hosts, op=op.name, routing=routing,
        size_bytes=float(op.size), completion_s=op.finished, bound_s=op_bound(fabric, op),
        max_link_load_bytes=float(carried[fabric_links].max()) if fabric_links.any() else 0.0,
        max_load_by_layer=by_layer, largest_part_bytes=net.largest_part,
        events=e.events, full_recomputations=e.full, partial_recomputations=e.partial,
        messages=net.messages, flows=net.flows, wall_s=wall,
        failed_links=fabric.describe_failed() if fabric.failed else "", link_bytes=carried)
