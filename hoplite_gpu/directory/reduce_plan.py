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

#: Host reduce steps fold, and hand on to their parent, in pieces of this size
#: (at most `chunk_size`): big enough that NumPy's per-call cost stays small,
#: small enough that a parent can pull the first piece soon. Finer steps cost
#: CPU and gained nothing (a 256 MiB emulated reduce: 2.58 s and 6.1 CPU s per
#: call at 256 KiB; 2.56 s and 4.4 CPU s at 1 MiB). It is the pipelining unit
#: the cost model counts for host objects.
FOLD_STEP = 1 << 20
#: A smaller object folds in `FOLD_PIECES` pieces, down to this size: a step's
#: parent sees pulled bytes in pieces of the receive step (256 KiB,
#: node/transfer.py `STEP`), so smaller pieces would gain nothing.
MIN_FOLD_STEP = 1 << 18
FOLD_PIECES = 8


def fold_unit(size: int, step: int = FOLD_STEP, pieces: int = FOLD_PIECES) -> int:
    """Bytes per piece that a host reduce step folds and hands on for an
    object of `size` bytes: `step` (at most), or a `pieces`-th of the object
    (an eighth by default) down to `MIN_FOLD_STEP`. After the last input every
    level of a tree adds one piece's time, so a 1 MiB object folded whole pays
    its full `S/B` per level; in 256 KiB pieces, a quarter of it."""
    return max(1, min(step, max(MIN_FOLD_STEP, -(-size // max(1, pieces)))))


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


@functools.lru_cache(maxsize=4096)
def tree_walk_time(size: int, k: int, d: int, latency_s: float, bytes_per_s: float,
                   chunk: int) -> float:
    """Modelled time of a pipelined reduce of k inputs, all ready at once, on
    the d-ary in-order tree the directory builds, walked from the leaves up.

    A position with n children has its output's first chunk once its slowest
    child's first chunk is in (n chunk times through its one downlink, plus a
    hop), and its last chunk no sooner than its downlink has carried n*S from
    the first child able to send, nor than a hop and a chunk time after its
    slowest child's last. Unlike `reduce_time` it sees that a wide node's
    children finish at different times (leaves at once, subtrees later), so
    its downlink works while it waits, and it counts the root's chunk time
    once. Subtrees of one size are alike, and a balanced tree has at most two
    sizes per level, so the walk costs O(d log k), not O(k).
    """
    if k < 1 or d < 1:
        raise ValueError(f"need k >= 1 and d >= 1; got k={k}, d={d}")
    c = (min(chunk, size) if size else 1) / bytes_per_s
    whole = size / bytes_per_s
    if k == 1:
        return 0.0
    if d == 1:  # a chain: position j's last chunk is (j-1)(L + c) + L + S/B after the start
        return (k - 2) * (latency_s + c) + latency_s + whole
    memo: dict[int, tuple[float, float]] = {1: (0.0, 0.0)}

    def walk(m: int) -> tuple[float, float]:
        """(first, last) output chunk times of a subtree of m positions."""
        if m not in memo:
            sizes = [(m - 1) // d + (1 if i < (m - 1) % d else 0) for i in range(d)]
            kids = [walk(x) for x in sizes if x]
            n = len(kids)
            first = max(f for f, _ in kids) + latency_s + n * c
            last = max(min(f for f, _ in kids) + latency_s + n * whole,
                       max(x for _, x in kids) + latency_s + c)
            memo[m] = (first, last)
        return memo[m]

    return walk(k)[1]


def choose_degree(size: int, k: int, latency_s: float, bytes_per_s: float, chunk: int,
                  max_degree: int = 8) -> int:
    """The degree with the lowest walked time (`tree_walk_time`; ties go to
    the smaller degree)."""
    if k <= 2:
        return 1
    candidates = range(1, min(max_degree, k - 1) + 1)
    return min(candidates,
               key=lambda d: (tree_walk_time(size, k, d, latency_s, bytes_per_s, chunk), d))


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


# ------------------------------------------------------------- striping ---
#: Stripes are chosen only where the model says they save at least this share
#: of S/B over a single tree: the model leaves out what striping costs a
#: real node (k pulls and connections instead of one, a pull moved to another
#: sender as the trees grow), and a gain of a few percent is within what it
#: cannot see.
STRIPE_MARGIN = 0.05
#: The stripes a striped object is cut into. Two is the most a tree of
#: arrivals can take without over-filling an uplink (docs/design.md,
#: "Striped broadcast"): a new receiver needs a slot in every stripe it is a
#: leaf of, and beside the origin's the free slots are only those of the
#: receivers before it.
STRIPES = 2


#: A striped pull's messages are sized so that its tree's pipeline fill (a
#: hop waits for k of them: its sender's k children of the stripe take
#: turns) stays within this share of S/B, as far as `MIN_PIECE` allows
STRIPE_FILL = 0.05
#: ... and no smaller than this: a relay over TCP passes bytes on every
#: 256 KiB whatever the message (node/pull_modes.py, STEP), and a message
#: transport pays a cost per message
MIN_PIECE = 1 << 18
#: Pieces are sized for trees of at least this many receivers: the first
#: receivers to ask sit at the top of the trees, and the pieces they pull
#: in set the top levels' fill however many come after them
STRIPE_PLAN = 1024


def stripe_piece(size: int, receivers: int, k: int, chunk: int) -> int:
    """Bytes per message of a striped pull: chunk/k (so that a hop, k
    messages, costs a chain's one chunk), smaller where a tree of
    `receivers` (at least `STRIPE_PLAN`) is deep enough that its fill would
    pass `STRIPE_FILL` of S/B, down to `MIN_PIECE`; a multiple of 4 KiB
    where it can be."""
    top = -(-chunk // k)
    fit = int(STRIPE_FILL * size / (k * stripe_depth(max(receivers, STRIPE_PLAN), k)))
    piece = max(min(top, MIN_PIECE), min(top, fit))
    return piece // 4096 * 4096 if piece >= 4096 else max(1, piece)


def stripe_depth(receivers: int, k: int) -> int:
    """Hops from the origin to the deepest receiver of one stripe's tree: the
    stripe's home receivers (N/k of them) as a k-ary tree under the origin,
    filled level by level, and every other receiver a leaf below them."""
    if receivers <= 1:
        return 1
    interior, levels, width = -(-receivers // k), 0, 1
    while interior > 0:
        interior -= width
        width *= k
        levels += 1
    return levels + 1


def stripe_time(size: int, receivers: int, k: int, latency_s: float, bytes_per_s: float,
                chunk: int, relay: int) -> float:
    """Modelled time of a broadcast in k stripes: every uplink and downlink
    carries S in all, and a hop of a stripe's tree adds a latency and k of
    the units its relays pass on (its sender's k children take turns): a
    message (`stripe_piece`), or `relay` bytes if fewer."""
    unit = min(stripe_piece(size, receivers, k, chunk), relay, -(-size // k)) if size else 1
    return size / bytes_per_s + stripe_depth(receivers, k) * (latency_s + k * unit / bytes_per_s)


@functools.lru_cache(maxsize=4096)
def broadcast_stripes(size: int, receivers: int, latency_s: float, bytes_per_s: float,
                      chunk: int, relay: int, fanout: int) -> int:
    """Stripes for a broadcast of `size` bytes to `receivers` nodes: `STRIPES`
    where the model says they beat the single tree of `fanout` receivers per
    sender (0: the cost model's, `broadcast_fanout`) by more than
    `STRIPE_MARGIN` of S/B, else 1. `relay` is the bytes a relay waits for
    before it passes them on (over TCP a receive step, over UCX a message)."""
    if receivers < 2 or size < STRIPES:
        return 1
    if fanout < 1:
        fanout = broadcast_fanout(size, receivers, latency_s, bytes_per_s, relay)
    single = reduce_time(size, receivers + 1, fanout, latency_s, bytes_per_s, relay)
    striped = stripe_time(size, receivers, STRIPES, latency_s, bytes_per_s, chunk, relay)
    return STRIPES if single - striped > STRIPE_MARGIN * size / bytes_per_s else 1
