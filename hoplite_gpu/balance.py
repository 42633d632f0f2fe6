"""Least loaded first: the choice Ethereal's path assignment makes, in one place.

The fabric simulator's Ethereal router (`hoplite_gpu.fabric.routing`) picks
a sub-flow's middle with it, and a node's path table (`hoplite_gpu.node.paths`)
picks a sub-flow's ECMP path with it: the option least loaded now; among
ties (within `tol`), the one that carried the fewest bytes in all; then the
first. Deterministic: the same loads give the same choice.

Pure: the standard library only, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def least_loaded(now: Sequence[float], ever: Callable[[int], float], tol: float = 0.0) -> int:
    """The index of the option least loaded `now` (its load within `tol` of
    the least ties); among ties, the one whose `ever(i)` (bytes carried in
    all) is least; then the first. `ever` is asked only of tied options."""
    if not now:
        raise ValueError("least_loaded: no option to choose from")
    best = min(now)
    tied = [i for i, load in enumerate(now) if load <= best + tol]
    if len(tied) == 1:
        return tied[0]
    carried = [ever(i) for i in tied]
    return tied[carried.index(min(carried))]
