"""Lower bounds on an op's completion time that no routing or schedule beats
on a given fabric, from cuts the op's bytes must cross.

A cut is a host's uplink or downlink, a leaf's uplinks or downlinks together,
or (fat-tree) a pod's links to or from the core: every byte from a host to a
host under another leaf leaves through its leaf's uplinks, whatever the
path. Failed links are not in their cut.

* traffic known up front (ring allreduce, all-to-all, point-to-point): the
  busiest cut's bytes over its capacity; for the ring also its chain: each
  rank sends its 2(p-1) pieces one after another through its own uplink;
* broadcast: the object must enter every receiver and every leaf (pod) with
  a receiver but not the root, so S over the slowest of those cuts; reduce
  likewise, out of every input's host, leaf and pod but the root's (which
  the directory picks: the slowest may be spared).
"""

from __future__ import annotations

import numpy as np

from .topology import CORE_DOWN, CORE_UP, LEAF_DOWN, LEAF_UP, Fabric


def _cut_capacity(fabric: Fabric, layer: int, groups: int) -> np.ndarray:
    working = (fabric.layer == layer) & (fabric.capacity > 0)
    return np.bincount(fabric.owner()[working], weights=fabric.capacity[working],
                       minlength=groups)


def traffic_bound(fabric: Fabric, src: np.ndarray, dst: np.ndarray,
                  nbytes: np.ndarray) -> float:
    """The busiest cut's time for messages src -> dst of nbytes, all of them."""
    src, dst, nbytes = np.asarray(src), np.asarray(dst), np.asarray(nbytes, float)
    cap = fabric.capacity
    worst = max((np.bincount(src, nbytes, fabric.hosts) / cap[fabric.host_up]).max(),
                (np.bincount(dst, nbytes, fabric.hosts) / cap[fabric.host_down]).max())
    for group_of, up, down, groups in _tiers(fabric):
        a, b = group_of[src], group_of[dst]
        cross = a != b
        for layer, side in ((up, a), (down, b)):
            vol = np.bincount(side[cross], nbytes[cross], groups)
            c = _cut_capacity(fabric, layer, groups)
            with np.errstate(divide="ignore", invalid="ignore"):
                t = np.where(vol > 0, vol / c, 0.0)
            worst = max(worst, float(t.max()))
    return float(worst)


def _tiers(fabric: Fabric):
    """(group of each host, uplink layer, downlink layer, groups) per tier."""
    tiers = [(fabric.host_leaf, LEAF_UP, LEAF_DOWN, fabric.leaves)]
    if fabric.kind == "fat-tree":
        pods = fabric.params["k"]
        tiers.append((fabric.leaf_pod[fabric.host_leaf], CORE_UP, CORE_DOWN, pods))
    return tiers


def spread_bound(fabric: Fabric, root: int | None, others: np.ndarray, size: float, *,
                 inward: bool) -> float:
    """The object of `size` bytes entering (inward: a broadcast) or leaving (a
    reduce) every host of `others` and every leaf and pod with one of them
    but without `root`. With no `root` (a reduce whose root the schedule
    picks among `others`), the tightest host, leaf and pod may hold it."""
    others = np.asarray(others)
    host_cap = np.sort(fabric.capacity[fabric.host_down if inward else fabric.host_up][others])
    worst = size / float(host_cap[0 if root is not None else min(1, len(host_cap) - 1)])
    for group_of, up, down, groups in _tiers(fabric):
        touched = np.unique(group_of[others])
        if root is not None:
            touched = touched[touched != group_of[root]]
        caps = np.sort(_cut_capacity(fabric, down if inward else up, groups)[touched])
        if root is None:
            caps = caps[1:]
        if len(caps):
            worst = max(worst, size / float(caps[0]))
    return worst
