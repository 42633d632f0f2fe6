"""Reduce tree shapes and the cost model that picks them. Pure functions.

Inputs take tree positions in the order they become ready, and the tree is
numbered so that its in-order traversal is that arrival order (the Hoplite
paper's rule): position p's first subtree holds earlier arrivals, its other
subtrees later ones. With degree 1 this is a chain whose leaf is the first
arrival and whose root is the last, so reduction starts with the second
arrival instead of waiting for all of them.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=4096)
def inorder_tree(k: int, d: int) -> tuple[tuple[int | None, ...], tuple[tuple[int, ...], ...]]:
    """(parent, children) of a balanced d-ary tree of k positions numbered in order.

    For a node with subtrees T0..T(d-1) the in-order numbering is
    [T0] node [T1] ... [T(d-1)]; subtree sizes differ by at most one.
    """
    if k < 1 or d < 1:
        raise ValueError(f"need k >= 1 and d >= 1; got k={k}, d={d}")
    if d == 1:  # a chain: built directly (recursion would be k deep)
        return (tuple([*range(1, k), None]),
                tuple([()] + [(i - 1,) for i in range(1, k)]))
    parent: list[int | None] = [None] * k
    children: list[list[int]] = [[] for _ in range(k)]

    def build(lo: int, hi: int) -> int | None:
        m = hi - lo
        if m <= 0:
            return None
        sizes = [(m - 1) // d + (1 if i < (m - 1) % d else 0) for i in range(d)]
        root = lo + sizes[0]
        start, subtrees = lo, []
        for i, size in enumerate(sizes):
            if i == 1:
                start = root + 1
            subtrees.append(build(start, start + size))
            start += size
        for child in subtrees:
            if child is not None:
                parent[child] = root
                children[root].append(child)
        return root

    build(0, k)
    return tuple(parent), tuple(tuple(c) for c in children)


@functools.lru_cache(maxsize=4096)
def tree_root(k: int, d: int) -> int:
    parent, _ = inorder_tree(k, d)
    return parent.index(None)


@functools.lru_cache(maxsize=4096)
def tree_depth(k: int, d: int) -> int:
    if d == 1:
        return k - 1
    parent, _ = inorder_tree(k, d)
    best = 0
    for p in range(k):
        depth, cur = 0, parent[p]
        while cur is not None:
            depth, cur = depth + 1, parent[cur]
        best = max(best, depth)
    return best


def reduce_time(size: int, k: int, d: int, latency_s: float, bytes_per_s: float,
                chunk: int) -> float:
    """Modelled time of a pipelined reduce of k inputs of `size` bytes on a d-ary tree.

    Each parent pulls its d children's streams through one link, so moving the
    object takes d*S/B; every level adds one hop latency and one chunk time
    (at the parent's share of the link) before the pipeline is full.
    """
    c = min(chunk, size) if size else 1
    return d * size / bytes_per_s + tree_depth(k, d) * (latency_s + d * c / bytes_per_s)


def choose_degree(size: int, k: int, latency_s: float, bytes_per_s: float, chunk: int,
                  max_degree: int = 8) -> int:
    """The degree with the lowest modelled time (ties go to the smaller degree)."""
    if k <= 2:
        return 1
    candidates = range(1, min(max_degree, k - 1) + 1)
    return min(candidates, key=lambda d: (reduce_time(size, k, d, latency_s, bytes_per_s, chunk), d))


@functools.lru_cache(maxsize=4096)
def broadcast_fanout(size: int, receivers: int, latency_s: float, bytes_per_s: float,
                     chunk: int, max_fanout: int = 4) -> int:
    """Receivers per sender for a broadcast to `receivers` nodes: the chain
    (1) until its pipeline fill, (N-1) chunk times, costs more than a wider tree's
    extra bandwidth term; same model as `reduce_time`."""
    if receivers <= 2:
        return 1
    return min(range(1, max_fanout + 1),
               key=lambda d: (reduce_time(size, receivers + 1, d, latency_s, bytes_per_s, chunk), d))


def allreduce_slices(nbytes: int, ranks: int, chunk: int) -> int:
    """Slices of an allreduce of `ranks` objects of `nbytes` each: 1 (reduce the
    whole object, then broadcast it) or `ranks` (slice j reduced on a chain
    rooted at rank j, then sent from there to every rank, as a ring allreduce
    moves data).

    Whole, a host in the middle of both chains sends 2 S (the reduce's stream
    and the broadcast's); sliced, every uplink carries 2 (N-1)/N S, 1.75 S at
    N = 8 (the same total, spread evenly). Slicing costs N reduces and N^2 pulls
    instead of one and N, and each slice pays its own pipeline fill, so it is
    chosen only when every slice is at least one chunk."""
    if ranks < 2 or nbytes < ranks * max(chunk, 1):
        return 1
    return ranks
