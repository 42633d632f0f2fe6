"""Reduce tree shapes, the cost model, and the state machine's reduce decisions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hoplite_gpu import messages as m
from hoplite_gpu.directory import state as s
from hoplite_gpu.directory.reduce_plan import (
    allreduce_slices,
    choose_degree,
    fold_unit,
    inorder_tree,
    reduce_time,
    tree_depth,
    tree_root,
    tree_walk_time,
)

MiB = 1 << 20


def inorder(children, root):
    out = []

    def walk(p):
        kids = children[p]
        if kids:
            walk(kids[0])
        out.append(p)
        for c in kids[1:]:
            walk(c)

    walk(root)
    return out


@settings(max_examples=200, deadline=None)
@given(k=st.integers(1, 200), d=st.integers(1, 8))
def test_inorder_traversal_is_arrival_order(k, d):
    parent, children = inorder_tree(k, d)
    root = tree_root(k, d)
    assert inorder(children, root) == list(range(k))
    assert all(len(c) <= d for c in children)
    assert sum(p is None for p in parent) == 1


def test_chain_leaf_is_first_arrival_and_root_last():
    parent, children = inorder_tree(5, 1)
    assert parent == (1, 2, 3, 4, None)
    assert tree_depth(5, 1) == 4


def test_binary_tree_is_balanced():
    assert tree_depth(7, 2) == 2 and tree_root(7, 2) == 3
    assert tree_depth(15, 2) == 3


@pytest.mark.parametrize("size,expected", [(64 * MiB, 1), (256 * MiB, 1)])
def test_large_objects_use_a_chain(size, expected):
    assert choose_degree(size, 8, 1e-4, 1.25e8, 4 * MiB) == expected


def test_small_objects_use_a_tree():
    assert choose_degree(256 * 1024, 8, 1e-4, 1.25e8, 4 * MiB) > 1
    assert choose_degree(1024, 16, 1e-3, 1.25e9, 4 * MiB) > 2


@settings(max_examples=100, deadline=None)
@given(size=st.integers(1, 1 << 30), k=st.integers(3, 40),
       lat=st.floats(1e-6, 1e-2), bw=st.floats(1e7, 1e11))
def test_chosen_degree_minimises_the_model(size, k, lat, bw):
    d = choose_degree(size, k, lat, bw, 4 * MiB)
    best = min(tree_walk_time(size, k, e, lat, bw, 4 * MiB) for e in range(1, min(8, k - 1) + 1))
    assert tree_walk_time(size, k, d, lat, bw, 4 * MiB) == pytest.approx(best)


def walked_over_the_tree(size, k, d, lat, bw, chunk):
    """The walk done position by position over `inorder_tree` (O(k)): the
    oracle for `tree_walk_time`, which walks one subtree per size."""
    c = min(chunk, size) / bw
    parent, children = inorder_tree(k, d)
    first, last, order, todo = [0.0] * k, [0.0] * k, [], [parent.index(None)]
    while todo:
        p = todo.pop()
        order.append(p)
        todo.extend(children[p])
    for p in reversed(order):
        kids = children[p]
        if kids:
            n = len(kids)
            first[p] = max(first[x] for x in kids) + lat + n * c
            last[p] = max(min(first[x] for x in kids) + lat + n * size / bw,
                          max(last[x] for x in kids) + lat + c)
    return last[order[0]]


@settings(max_examples=300, deadline=None)
@given(size=st.integers(1, 1 << 30), k=st.integers(1, 300), d=st.integers(1, 8),
       lat=st.floats(1e-6, 1e-2), bw=st.floats(1e7, 1e11),
       chunk=st.sampled_from([1 << 18, 1 << 20, 4 << 20]))
def test_the_walk_by_subtree_size_is_the_walk_by_position(size, k, d, lat, bw, chunk):
    assert tree_walk_time(size, k, d, lat, bw, chunk) == pytest.approx(
        walked_over_the_tree(size, k, d, lat, bw, chunk), rel=1e-9, abs=1e-12)


def test_the_walk_sees_one_chunk_objects_that_the_closed_form_overcounts():
    """For one-chunk objects of k = 64 at 125 MB/s the closed form
    (`reduce_time`) counts the root hop's chunk time twice and picks degree
    2, which the simulator finds 1.11 x slower than 3, the walk's choice
    (`python -m benchmarks degree-sweep --proposed`)."""
    for size in (64 * 1024, MiB):
        assert choose_degree(size, 64, 1e-4, 1.25e8, 4 * MiB) == 3
        assert min(range(1, 9), key=lambda d: reduce_time(size, 64, d, 1e-4, 1.25e8, 4 * MiB)) == 2


# --------------------------------------------------------- state machine ---
def oid(i: int) -> bytes:
    return i.to_bytes(20, "big")


LAYOUT = {"kind": "numpy", "dtype": "<f4", "shape": [1 << 22], "nbytes": 16 * MiB}


def directory(n_nodes=9, **kw):
    d = s.Directory(**kw)
    for i in range(n_nodes):
        d.handle(s.NodeJoined(f"n{i}", f"tcp://127.0.0.1:{1000 + i}"))
    return d


def put_complete(d, node, key, size=16 * MiB, layout=LAYOUT):
    out = d.handle(s.Put(node, 1, key, size, layout))
    out += d.handle(s.Completed(node, key))
    return out


def steps(cmds):
    return [c for c in cmds if isinstance(c, s.StartReduceStep)]


@pytest.mark.parametrize("size,step,unit", [
    (64 << 10, MiB, 256 << 10),      # smaller than a piece: folded whole
    (MiB, MiB, 256 << 10),           # an eighth would be under the receive step
    (4 * MiB, MiB, 512 << 10),       # an eighth
    (8 * MiB, MiB, MiB),
    (256 * MiB, MiB, MiB),           # at most the fold step
    (256 * MiB, 4 * MiB, 4 * MiB),
    (4 * MiB, 64 << 10, 64 << 10),   # a smaller fold step (a simulator's chunk) is kept
])
def test_a_small_object_is_folded_in_eighths_down_to_the_receive_step(size, step, unit):
    assert fold_unit(size, step) == unit


@pytest.mark.parametrize("kind,fold_step,degree", [
    ("numpy", None, 1), ("numpy", 4 * MiB, 1), ("device", None, 2)])
def test_the_model_counts_the_pieces_a_step_hands_on(kind, fold_step, degree):
    """Three 4 MiB inputs, 4 MiB chunks, 1.25 GB/s. A host step folds and
    hands on pieces of at most 1 MiB (`FOLD_STEP`), an eighth of an object
    smaller than 8 MiB (`fold_unit`: so even with a 4 MiB fold step), so a
    chain fills in a fraction of the object and beats a binary tree (whose
    root takes both streams through one downlink); counted in whole 4 MiB
    chunks, as a device step moves them, the tree wins by a hop. With the
    chunk as the unit, host reduces got the tree the data path makes
    slower."""
    kw = {} if fold_step is None else {"fold_step": fold_step}
    d = directory(chunk_size=4 * MiB, **kw)
    layout = {"kind": kind, "dtype": "<f4", "shape": [MiB], "nbytes": 4 * MiB}
    target = oid(100)
    d.handle(s.ReduceRequested("n0", 1, target, tuple(oid(i) for i in range(3)), "sum", 3))
    put_complete(d, "n1", oid(0), 4 * MiB, layout)
    assert d.reduces[target].degree == degree


def test_chain_steps_follow_arrival_order():
    d = directory(bytes_per_s=1.25e8)
    target = oid(100)
    d.handle(s.ReduceRequested("n0", 1, target, tuple(oid(i) for i in range(4)), "sum", 4))
    arrival = [2, 0, 3, 1]
    started = []
    for i in arrival:
        started += steps(put_complete(d, f"n{i + 1}", oid(i)))
    # chain: position p reduces position p-1's stream; the last arrival is the root
    assert [c.node for c in started] == ["n1", "n4", "n2"]
    root = started[-1].step
    assert root.output == target and root.count == 4
    assert [c.oid for c in started[0].step.children] == [oid(2)]  # leaf's own input
    assert d.objects[target].holders["n2"].origin
    assert d.reduces[target].chosen == [oid(i) for i in arrival]


@pytest.mark.parametrize("root_first", [True, False])
def test_root_input_takes_the_chain_root_whenever_it_arrives(root_first):
    d = directory(bytes_per_s=1.25e8)
    target = oid(100)
    d.handle(s.ReduceRequested("n0", 1, target, tuple(oid(i) for i in range(4)), "sum", 4,
                               root_input=oid(0)))
    arrival = [0, 2, 3, 1] if root_first else [2, 3, 0, 1]
    started = []
    for i in arrival:
        started += steps(put_complete(d, f"n{i + 1}", oid(i)))
    root = started[-1]
    assert root.node == "n1" and root.step.output == target and root.step.input == oid(0)
    assert d.objects[target].holders["n1"].origin
    # the others keep the in-order rule: the first arrival other than the root is the leaf
    assert [c.oid for c in started[0].step.children] == [oid(2)]
    assert d.reduces[target].chosen == [oid(i) for i in arrival]


def test_root_input_that_comes_too_late_for_a_subset_reduce_is_not_waited_for():
    d = directory(bytes_per_s=1.25e8)
    target = oid(100)
    d.handle(s.ReduceRequested("n0", 1, target, tuple(oid(i) for i in range(5)), "sum", 3,
                               root_input=oid(4)))
    started = []
    for i in [0, 1, 2]:
        started += steps(put_complete(d, f"n{i + 1}", oid(i)))
    assert started and started[-1].step.output == target
    assert d.reduces[target].chosen == [oid(0), oid(1), oid(2)]
    put_complete(d, "n5", oid(4))
    assert d.reduces[target].backups == [oid(4)]


@settings(max_examples=100, deadline=None)
@given(k=st.integers(2, 12), d=st.integers(1, 4), data=st.data())
def test_root_input_tree_is_complete_and_rooted_there(k, d, data):
    arrival = data.draw(st.permutations(range(k)))
    want = data.draw(st.integers(0, k - 1))
    task = s.ReduceTask(oid(100), tuple(oid(i) for i in range(k)), "sum", k, degree=d,
                        root_input=oid(want))
    for i in arrival:
        pos = task.place(oid(i))
        assert 0 <= pos < k and pos not in task.at
        task.at[pos] = len(task.slots)
        task.slots.append((oid(i), f"n{i}"))
    assert task.slot(tree_root(k, d))[0] == oid(want)


def test_deleting_a_finished_reduce_result_forgets_the_reduce():
    d = directory()
    target = oid(100)
    d.handle(s.ReduceRequested("n0", 1, target, (oid(0), oid(1)), "sum", 2))
    put_complete(d, "n1", oid(0))
    out = put_complete(d, "n2", oid(1))
    root = steps(out)[-1].node
    d.handle(s.Completed(root, target))
    assert d.reduces[target].done
    out = d.handle(s.Delete("n0", 7, target))
    assert target not in d.reduces and target not in d.objects
    assert any(isinstance(c, s.Drop) and c.node == root and c.oid == target for c in out)


def test_subset_reduce_keeps_backups_and_answers_reduced_inputs():
    d = directory()
    target = oid(100)
    d.handle(s.ReduceRequested("n0", 1, target, tuple(oid(i) for i in range(5)), "sum", 3))
    waiting = d.handle(s.ReducedInputs("n0", 2, target))
    assert waiting == []
    out = []
    for i in [4, 1, 2, 0, 3]:
        out += put_complete(d, f"n{i + 1}", oid(i))
    assert not [c for c in out if isinstance(c, s.Reply) and c.request == 2]  # not done yet
    assert d.reduces[target].backups == [oid(0), oid(3)]
    root = next(n for n, h in d.objects[target].holders.items() if h.origin)
    out = d.handle(s.Completed(root, target))
    replies = [c for c in out if isinstance(c, s.Reply) and c.request == 2]
    assert replies and replies[0].body.inputs == [oid(4), oid(1), oid(2)]


def test_lost_participant_restarts_the_reduce_with_a_backup():
    d = directory(bytes_per_s=1.25e8)
    target = oid(100)
    d.handle(s.ReduceRequested("n0", 1, target, tuple(oid(i) for i in range(4)), "sum", 3))
    for i in range(4):  # inputs 0,1,2 chosen (chain), input 3 is a backup
        put_complete(d, f"n{i + 1}", oid(i))
    d.handle(s.Locate("n8", 5, target))  # a reader pulling the result from the root
    assert d.reduces[target].chosen == [oid(0), oid(1), oid(2)]
    out = d.handle(s.NodeLost("n2"))  # holds input 1 (the chain's middle)
    task = d.reduces[target]
    assert task.chosen == [oid(0), oid(2), oid(3)] and task.restarts == 1
    drops = [c for c in out if isinstance(c, s.Drop)]
    assert any(c.oid == target and c.node == "n8" and c.retry for c in drops)
    new_steps = steps(out)
    assert new_steps and new_steps[-1].step.output == target
    assert d.objects[target].holders[new_steps[-1].node].origin


def test_a_copy_of_a_rebuilt_tree_is_not_confirmed():
    """A reader can finish copying the result just before a failover rebuilds
    the tree (the root's completion still in flight). Its copy is handed out
    only once the directory confirms that tree finished; a rebuilt tree's
    copies are refused, so `get` and `reduced_inputs` always agree."""
    d = directory(bytes_per_s=1.25e8)
    target = oid(100)
    d.handle(s.ReduceRequested("n0", 1, target, tuple(oid(i) for i in range(4)), "sum", 3))
    for i in range(4):
        put_complete(d, f"n{i + 1}", oid(i))
    reply = [c for c in d.handle(s.Locate("n8", 5, target)) if isinstance(c, s.Reply)][0]
    first = reply.body.reduce_tag
    assert first == d.reduces[target].tag
    # n8's copy is complete, and it asks before the root's Completed arrived
    assert d.handle(s.ReduceConfirm("n8", 6, target, first)) == []
    out = d.handle(s.NodeLost("n2"))  # input 1's holder dies: the tree is rebuilt
    assert s.Reply("n8", 6, m.Current(current=False)) in out
    assert d.reduces[target].tag != first
    # a late question about the old tree is refused at once
    assert d.handle(s.ReduceConfirm("n8", 7, target, first)) == [s.Reply("n8", 7, m.Current(current=False))]
    # a copy of the new tree is confirmed when its root completes
    second = d.reduces[target].tag
    assert d.handle(s.ReduceConfirm("n8", 8, target, second)) == []
    root = steps(out)[-1].node
    assert steps(out)[-1].step.tag == second
    done = d.handle(s.Completed(root, target))
    assert s.Reply("n8", 8, m.Current(current=True)) in done
    assert d.handle(s.ReduceConfirm("n8", 9, target, second)) == [s.Reply("n8", 9, m.Current(current=True))]
    # once done, locate replies carry no tag: nothing left to confirm
    later = [c for c in d.handle(s.Locate("n7", 10, target)) if isinstance(c, s.Reply)]
    assert later and later[0].body.reduce_tag is None


def test_step_lost_restarts_and_too_many_restarts_fail():
    d = directory()
    target = oid(100)
    d.handle(s.ReduceRequested("n0", 1, target, (oid(0), oid(1)), "sum", 2))
    put_complete(d, "n1", oid(0))
    put_complete(d, "n2", oid(1))
    for _ in range(2 * 2 + 5):
        d.handle(s.StepLost("n2", target, "child stalled"))
    assert d.reduces[target].failed is None
    out = d.handle(s.StepLost("n2", target, "child stalled"))
    assert d.reduces[target].failed and "gave up" in d.reduces[target].failed
    assert not [c for c in out if isinstance(c, s.StartReduceStep)]


def test_mismatched_input_fails_the_reduce_for_every_waiter():
    d = directory()
    target = oid(100)
    d.handle(s.ReduceRequested("n0", 1, target, (oid(0), oid(1)), "sum", 2))
    d.handle(s.Locate("n5", 7, target))
    put_complete(d, "n1", oid(0))
    other = {**LAYOUT, "shape": [3], "nbytes": 12}
    out = put_complete(d, "n2", oid(1), size=12, layout=other)
    errors = [c for c in out if isinstance(c, s.Reply) and isinstance(c.body, m.Failure)]
    assert errors and all(c.body.error == "ReduceFailed" for c in errors)
    assert oid(1).hex() in errors[0].body.message
    late = d.handle(s.Locate("n6", 8, target))
    assert late[0].body.error == "ReduceFailed"


@pytest.mark.parametrize("kind,accepted", [("numpy", True), ("device", True), ("bytes", False),
                                           ("torch", False)])
def test_reduce_accepts_typed_arrays_only(kind, accepted):
    d = directory()
    target = oid(100)
    layout = {**LAYOUT, "kind": kind}
    d.handle(s.ReduceRequested("n0", 1, target, (oid(0), oid(1)), "sum", 2))
    d.handle(s.Locate("n5", 7, target))
    out = put_complete(d, "n1", oid(0), layout=layout) + put_complete(d, "n2", oid(1), layout=layout)
    errors = [c for c in out if isinstance(c, s.Reply) and isinstance(c.body, m.Failure)]
    assert bool(steps(out)) == accepted and bool(errors) == (not accepted)
    if not accepted:
        assert f"a {kind!r} object" in errors[0].body.message


def test_inline_inputs_are_reduced_by_the_directory():
    d = directory()
    target = oid(100)
    small = {"kind": "numpy", "dtype": "<i4", "shape": [2], "nbytes": 8}
    d.handle(s.ReduceRequested("n0", 1, target, (oid(0), oid(1)), "sum", 2))
    d.handle(s.Put("n1", 1, oid(0), 8, small, inline=b"\x01\x00\x00\x00\x02\x00\x00\x00"))
    out = d.handle(s.Put("n2", 1, oid(1), 8, small, inline=b"\x03\x00\x00\x00\x04\x00\x00\x00"))
    cmd = [c for c in out if isinstance(c, s.InlineReduce)]
    assert len(cmd) == 1 and len(cmd[0].inputs) == 2
    d.handle(s.InlineReduced(target, b"\x04\x00\x00\x00\x06\x00\x00\x00"))
    reply = d.handle(s.Locate("n3", 9, target))
    assert reply[0].body.inline == b"\x04\x00\x00\x00\x06\x00\x00\x00"


@pytest.mark.parametrize("bad,msg", [
    ((), "at least one"), ((oid(1), oid(1)), "distinct"), ((oid(1), oid(2)), "num_objects"),
])
def test_bad_reduce_requests_are_refused(bad, msg):
    d = directory()
    k = 3 if msg == "num_objects" else max(1, len(bad))
    out = d.handle(s.ReduceRequested("n0", 1, oid(100), bad, "sum", k))
    assert out[0].body.error == "InvalidArgument" and msg in out[0].body.message


def test_long_chains_build_without_recursion():
    parent, children = inorder_tree(5000, 1)
    assert parent[0] == 1 and parent[4999] is None and children[4999] == (4998,)
    assert tree_depth(5000, 1) == 4999


def test_inputs_ready_before_the_request_take_the_chain_in_the_listed_order():
    """A sliced allreduce asks for its reduces after every input is ready, and
    rotates each chain by listing the inputs in the order it wants."""
    d = directory(bytes_per_s=1.25e8)
    for i in range(4):
        put_complete(d, f"n{i + 1}", oid(i))
    listed = (oid(2), oid(3), oid(0), oid(1))
    out = d.handle(s.ReduceRequested("n0", 1, oid(100), listed, "sum", 4, root_input=oid(1)))
    assert d.reduces[oid(100)].chosen == list(listed)
    assert [c.node for c in steps(out)] == ["n4", "n1", "n2"]  # chain 2 -> 3 -> 0 -> 1


def relayed(d, asked):
    """Ask a relayed reduce of oid(0..3) on n1..n4, listed 2, 3, 0, rooted at 1
    (a sliced allreduce's slice 1), then locate its result from the nodes
    `asked`, in that order; returns {receiver: sender}."""
    for i in range(4):
        put_complete(d, f"n{i + 1}", oid(i))
    listed = (oid(2), oid(3), oid(0), oid(1))
    d.handle(s.ReduceRequested("n0", 1, oid(100), listed, "sum", 4, root_input=oid(1), relay=True))
    for node in asked:
        d.handle(s.Locate(node, 50, oid(100)))
    return {r: snd for r, snd in d.objects[oid(100)].edges}


def test_a_relayed_result_travels_along_the_listed_inputs_nodes_whoever_asks_first():
    # Relay order: the root's node n2, then n3, n4, n1 (inputs 2, 3, 0).
    d = directory(bytes_per_s=1.25e8, max_receivers_per_sender=2)
    assert relayed(d, ["n1", "n4", "n3"]) == {"n3": "n2", "n4": "n3", "n1": "n4"}
    assert d.objects[oid(100)].relay == ("n2", "n3", "n4", "n1")
    assert not d.objects[oid(100)].waiting


def test_a_relay_waits_for_the_node_before_then_skips_it_once_it_is_gone():
    d = directory(bytes_per_s=1.25e8)
    assert relayed(d, ["n4", "n1"]) == {}  # both wait: n3 has not asked yet
    d.handle(s.Completed("n2", oid(100)))  # the reduce is done: its inputs may go
    d.handle(s.NodeLost("n3"))
    # n4 now pulls from the root, n1 from n4; a receiver outside the relay as configured
    d.handle(s.Locate("n7", 51, oid(100)))
    assert dict(d.objects[oid(100)].edges) == {"n4": "n2", "n1": "n4", "n7": "n1"}


def test_a_relay_that_failed_a_receiver_is_passed_over():
    d = directory(bytes_per_s=1.25e8, max_receivers_per_sender=2)
    assert relayed(d, ["n3", "n4"]) == {"n3": "n2", "n4": "n3"}
    d.handle(s.TransferFailed("n4", oid(100), "n3", 0))
    out = d.handle(s.Locate("n4", 52, oid(100)))
    assert [(r.node, getattr(r.body, "sender", None)) for r in out if isinstance(r, s.Reply)] == [("n4", "n2")]


def test_a_non_bool_relay_is_refused_on_the_wire():
    from hoplite_gpu.directory.wire import to_event
    from hoplite_gpu.errors import ProtocolError

    msg = {"op": "reduce", "rid": 1, "target": oid(100), "inputs": [oid(0), oid(1)],
           "op_name": "sum", "num_objects": 2}
    assert to_event("n0", {**msg, "relay": True}).relay is True
    with pytest.raises(ProtocolError, match="relay"):
        to_event("n0", {**msg, "relay": 1})


def test_a_reduce_root_asking_for_its_own_result_waits_for_its_step_instead_of_pulling_it():
    d = directory(bytes_per_s=1.25e8, max_receivers_per_sender=4)
    inputs = tuple(oid(i) for i in range(3))
    for i in range(3):
        put_complete(d, f"n{i + 1}", oid(i))
    d.handle(s.ReduceRequested("n0", 1, oid(100), inputs, "sum", 3, root_input=oid(0)))
    for node in ("n5", "n6"):
        d.handle(s.Locate(node, 40, oid(100)))
    d.handle(s.Completed("n6", oid(100)))  # a receiver done first
    assert d.handle(s.Locate("n1", 41, oid(100))) == []  # the root: no sender, it waits
    out = d.handle(s.Completed("n1", oid(100)))
    assert [(r.node, getattr(r.body, "local", None)) for r in out if isinstance(r, s.Reply)] == [("n1", True)]
    assert ("n1", "n6") not in d.objects[oid(100)].edges


@pytest.mark.parametrize("nbytes,ranks,chunk,want", [
    (256 * MiB, 8, 4 * MiB, 8), (32 * MiB, 8, 4 * MiB, 8), (32 * MiB - 1, 8, 4 * MiB, 1),
    (1024, 8, 4 * MiB, 1), (256 * MiB, 1, 4 * MiB, 1)])
def test_an_allreduce_is_sliced_only_when_every_slice_is_a_chunk(nbytes, ranks, chunk, want):
    assert allreduce_slices(nbytes, ranks, chunk) == want
