"""A node declared dead while alive that comes back: what the directory
knows of its copies and its place in a relay (the `gone` record of lost
ids, the per-node indexes), and the Drop for a completion that crossed a
removal.

Each test fails on the code it was written against, for the reason in its
docstring.
"""

from __future__ import annotations

import asyncio

import numpy as np
from in_process import eventually, miss_the_lease, run_nodes, two_nodes_short_lease

from hoplite_gpu.config import Config
from hoplite_gpu.directory import state as s
from hoplite_gpu.directory.state import (
    Completed,
    Directory,
    Locate,
    NodeJoined,
    NodeLost,
    Put,
    ReduceRequested,
    Reply,
    StartReduceStep,
)
from hoplite_gpu.errors import HopliteError
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.node.node import Node
from hoplite_gpu.values import to_buffer

X = bytes([7]) * 20
BYTES = {"kind": "bytes", "nbytes": 1000}

LAYOUT = {"kind": "numpy", "dtype": "<f4", "shape": [1250], "nbytes": 5000}


def joined(*nodes: str) -> s.Directory:
    d = s.Directory(lease_s=5.0)
    for node in nodes:
        d.handle(s.NodeJoined(node, "addr-" + node, 0.0))
    return d


def declare_dead(d: s.Directory, dead: str, now: float = 10.0) -> list[s.Command]:
    """`dead` misses its lease while every other node renews its own."""
    for node in list(d.nodes):
        if node != dead:
            d.handle(s.Heartbeat(node, now))
    out = d.handle(s.Tick(now))
    assert dead not in d.nodes
    return out


def drops_to(out: list[s.Command], node: str, oid: bytes) -> list[s.Drop]:
    return [c for c in out if isinstance(c, s.Drop) and c.node == node and c.oid == oid]


# ------------------------------------------ a node declared dead comes back ---
def test_a_returning_node_s_copy_of_an_object_that_survived_is_not_left_unknown():
    """n0 put X and n1 pulled it. n0 misses its lease while alive: X is not
    lost (n1 holds it), so it is not in `gone`. n0 reconnects and announces
    its own copy: the announcement is ignored (not registered, no Drop), so
    the directory no longer counts n0's copy. When n1 deletes X, n0 hears
    nothing and keeps the deleted bytes: its gets return them, and its own
    later put of X is a no-op that registers nothing (see the end-to-end
    test below). The copy must be counted again, or dropped."""
    d = joined("n0", "n1")
    d.handle(s.Put("n0", 1, X, 1000, BYTES))
    d.handle(s.Completed("n0", X))
    d.handle(s.Locate("n1", 1, X))
    d.handle(s.Completed("n1", X))
    declare_dead(d, "n0")
    assert X in d.objects  # n1's complete copy keeps it
    d.handle(s.NodeJoined("n0", "addr-n0", 10.0))
    said = d.handle(s.Completed("n0", X, 1000, BYTES, own=True))
    said += d.handle(s.Delete("n1", 2, X))
    assert drops_to(said, "n0", X), (
        "n0's re-announced copy was neither counted nor dropped: the delete never reaches it")


def test_a_declared_dead_node_s_copy_of_a_surviving_object_blocks_a_later_put():
    """End to end, the case above: a puts x, b gets it; a is declared dead
    while alive and reconnects. b deletes x; a puts a new value under x. a's
    put finds its old (unregistered) copy in its store and returns without
    telling the directory: the new value is never registered, and b's get of
    x waits until its deadline."""
    async def main() -> None:
        async with two_nodes_short_lease() as (server, a, b):
            x = ObjectID.from_name("review-session/survivor")
            old = np.arange(40_000, dtype=np.float64)  # 320 KB: not inline
            await a.put(old, x)
            await b.get(x, 3.0, "numpy")
            await miss_the_lease(server, a)  # declared dead, then back
            await b.delete(x)
            await a.put(old + 1, x)
            try:
                got = await b.get(x, 1.5, "numpy")
            except HopliteError as exc:
                raise AssertionError(
                    f"a's put after the delete registered nothing: {exc!r}") from None
            assert np.array_equal(got, old + 1)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_lost_object_brought_back_takes_no_completion_from_a_node_told_to_drop_it():
    """n1 pulls X from n0, which is still putting it. n0 misses its lease: X
    is lost, and n1 (a partial holder) is sent a Drop; it drops its copy. A
    `complete` n1 sent just before that Drop arrived crosses it. If n0 comes
    back and announces its own copy first, X is recovered with
    `recovered=True`, and n1's crossed completion then registers n1 as a
    complete holder of a copy it no longer has: later receivers are sent to
    n1 (and wait for bytes that never come), and if n0 dies X is never
    declared lost. docs/fault-tolerance.md: a pulled copy of a removed id gets
    a drop; it must not be counted."""
    d = joined("n0", "n1", "n2", "n3")
    d.handle(s.Put("n0", 1, X, 1000, BYTES))  # still copying
    d.handle(s.Locate("n1", 1, X))  # pipelines from n0
    lost = declare_dead(d, "n0")
    assert drops_to(lost, "n1", X) and d.gone.get(X) is True
    d.handle(s.NodeJoined("n0", "addr-n0", 10.0))
    d.handle(s.Completed("n0", X, 1000, BYTES, own=True))  # n0 brings X back
    assert X in d.objects
    d.handle(s.Completed("n1", X, 1000, BYTES))  # crossed the Drop n1 has since taken
    holders = d.objects[X].holders
    assert "n1" not in holders or not holders["n1"].complete, (
        "n1, told to drop X, is counted as a complete holder of it")


# ------------------------------------- a completion that crossed a delete ---
def test_a_put_made_after_a_crossed_completion_is_not_wiped_by_its_drop():
    """b pulled x; a deletes x, and the directory drops b's copy. b's pull
    completion crossed that delete (the directory sees Delete(a),
    Completed(b), then b's new Put of x, in that order, whatever b's timing),
    so the directory answers it with a Drop(retry). b has meanwhile put a
    new value under x: that Drop arrives while the put waits for its reply
    and removes the put's object from b's store. The put then carries on
    with the emptied object: it "copies" 0 bytes, sends `complete` and
    returns as if it had worked. The directory counts b as the complete
    holder of x, b holds nothing, and a's get of x waits out its deadline."""
    cfg = Config(timeout_s=3.0, shared_memory=False, stall_timeout_s=2.0)

    async def body(directory, a: Node, b: Node) -> None:
        x = ObjectID.from_name("review-session/crossed")
        old = np.arange(40_000, dtype=np.float64)  # 320 KB: not inline
        await a.put(old, x)
        await b.get(x, 3.0, "numpy")
        await a.delete(x)
        assert await eventually(lambda: b.store.get(x) is None, 3.0)  # the delete's drop
        # b's completion of the pull, as it reaches the directory after the delete
        _, layout = to_buffer(old)
        b._post({"op": "complete", "oid": x.binary, "size": old.nbytes,
                 "layout": layout.to_wire()})
        await b.put(old + 1, x)
        held = b.store.get(x)
        assert held is not None and held.complete, (
            "b's put returned, but its object was removed from b's store")
        try:
            got = await a.get(x, 1.5, "numpy")
        except HopliteError as exc:
            raise AssertionError(f"b's put is registered but cannot be read: {exc!r}") from None
        assert np.array_equal(got, old + 1)

    run_nodes([cfg, cfg], body, 20)


# -------------------------------------------- a relay member that came back ---
def test_a_relay_node_that_came_back_and_left_again_still_frees_its_successor():
    """A relayed result (R, A, B: each node pulls from the one before) is
    complete at R. A is declared dead (a missed lease) and reconnects under
    its node id, as a node does, without getting the result again; B's get
    then waits for A, its relay predecessor, which is alive. When A leaves
    for good, B must be sent to R, which holds the result and serves nobody
    (before f8c31f8 a node's loss looked at every object and did so).
    `Directory.holding` is popped whole at A's first loss (`_forget_node`)
    and A's relay membership is never put back when it rejoins, so its
    second loss visits nothing: B waits on, and its get ends in Timeout
    while a complete copy sits idle at R."""
    d = Directory(max_receivers_per_sender=1)
    for n in "RAB":
        d.handle(NodeJoined(n, "addr-" + n))
    ir, ia, ib, target = b"r" * 20, b"a" * 20, b"b" * 20, b"t" * 20
    for n, oid in (("R", ir), ("A", ia), ("B", ib)):
        d.handle(Put(n, 1, oid, 5000, LAYOUT))
        d.handle(Completed(n, oid))
    out = d.handle(ReduceRequested("R", 2, target, (ia, ib, ir), "sum", 3, root_input=ir,
                                   relay=True))
    (root,) = [c.node for c in out if isinstance(c, StartReduceStep)
               and c.step.output == target]
    assert root == "R" and d.objects[target].relay == ("R", "A", "B")
    d.handle(Completed("R", target, tag=d.reduces[target].tag))
    assert d.reduces[target].done

    d.handle(NodeLost("A"))  # declared dead ...
    d.handle(NodeJoined("A", "addr-A"))  # ... and back, under its id
    assert d.handle(Locate("B", 5, target)) == []  # B waits for A, its predecessor
    out = d.handle(NodeLost("A"))  # A leaves for good
    answers = [c for c in out if isinstance(c, Reply) and (c.node, c.request) == ("B", 5)]
    assert answers and getattr(answers[0].body, "sender", None) == "R", (
        f"A left for good, yet B's get still waits ({list(d.objects[target].waiting)}) "
        f"while R holds the result complete and serves nobody; "
        f"holding['A'] = {d.holding.get('A')}")
