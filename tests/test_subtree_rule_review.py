"""Review of the subtree rule of reduce trees (directory/state.py
`_add_input` and `_start_ready_steps`): a position folds a child only once
the child's whole subtree of positions is filled (`ReduceTask.whole`).

Each test fails on the code it was written against, for the reason in its
docstring.
"""

from __future__ import annotations

import random
import time

from benchmarks import directory_scale
from hoplite_gpu.directory import state as s

oid, joined, ARRAY = directory_scale.oid, directory_scale.joined, directory_scale.ARRAY


def test_an_arriving_input_of_a_relayed_slice_costs_the_same_however_many_ranks():
    """A relayed reduce (one slice of a sliced allreduce, as collectives.py
    asks it) is a chain: degree 1, position p's parent is p + 1, the root
    k - 1. When the rule was first written, `_add_input` counted the filled
    positions of every subtree, walking from the new position up to the
    root for each input, so each arriving input cost O(ranks) and one slice
    O(ranks^2); an allreduce has a slice per rank, O(ranks^3). The
    directory is one thread: every other request waits meanwhile. Before
    the rule a slice of 1,024 ranks cost the state machine 40 ms of
    arrivals, with that walk 143 ms (147 s against 41 s for the 1,024 slices of one
    allreduce; at 256 ranks 5.3 s against 2.4 s), and docs/architecture.md
    still promises that "per-event work stays bounded as groups grow: an
    arriving reduce input checks only its own tree position and that
    position's parent". Here one arrival costs ~6 times as much at 4,000
    ranks as at 200 (~1.1 times before the rule; the walk now goes up only
    through the subtrees an arrival completes)."""

    def per_arrival(ranks: int) -> float:
        d = joined(ranks)
        inputs = [oid(100 + r) for r in range(ranks)]
        target = oid(7)
        # slice 0, as collectives.py asks it: the chain from rank 1 around to rank 0
        chain = tuple(inputs[(1 + i) % ranks] for i in range(ranks))
        d.handle(s.ReduceRequested("n0", 2, target, chain, "sum", ranks, inputs[0], relay=True))
        order = list(range(ranks))
        random.Random(ranks).shuffle(order)
        took = 0.0
        for r in order:
            start = time.perf_counter()
            d.handle(s.Put(f"n{r}", 1, inputs[r], ARRAY["nbytes"], ARRAY))
            d.handle(s.Completed(f"n{r}", inputs[r]))
            took += time.perf_counter() - start
        task = d.reduces[target]
        assert task.degree == 1 and len(task.slots) == ranks and target in d.objects
        return took / ranks

    few = min(per_arrival(200) for _ in range(3))
    many = min(per_arrival(4000) for _ in range(2))
    assert many < 3 * few, (f"an input of a relayed slice arrives in {many * 1e6:.0f} us at "
                            f"4,000 ranks and {few * 1e6:.0f} us at 200")
