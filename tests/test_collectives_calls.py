"""How the collectives take a call (one local runtime, as in
test_collectives.py): `timeout` bounds the whole call while the directory is
away and the error names it, names, ranks, sizes and counts are checked,
reduce requests asked in any order or again are one reduce, and a second
call under one name returns the first call's value. Each test fails on a
confirmed bug."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from in_process import ThreadedDirectory

import hoplite_gpu as hg
from hoplite_gpu import collectives

NAMED_CALLS = {
    "allgather": lambda name: collectives.allgather(np.ones(3), name=name, rank=0, size=1,
                                                    timeout=1),
    "broadcast": lambda name: collectives.broadcast(np.ones(3), name=name, rank=0, size=1,
                                                    timeout=1),
    "reduce_async": lambda name: asyncio.run(collectives.reduce_async(
        np.ones(3), name=name, rank=0, size=1, timeout=1)),
    "delete": lambda name: collectives.delete(name, size=1),
}

TOKEN = "collectives-token"


@pytest.fixture
def runtime_settings() -> dict:
    """The `local` runtime's settings here."""
    return {"timeout_s": 5}


# --- `timeout` bounds the whole call ---------------------------------------------


CALLS = {
    "allgather": lambda: collectives.allgather(np.ones(10), name="away-ag", rank=0, size=2,
                                               timeout=1),
    "gather-root": lambda: collectives.gather(np.ones(10), name="away-g0", rank=0, size=2,
                                              timeout=1),
    "gather-non-root": lambda: collectives.gather(np.ones(10), name="away-g1", rank=1, size=2,
                                                  timeout=1),
    "reduce-non-root": lambda: collectives.reduce(np.ones(10), name="away-r", rank=1, size=2,
                                                  timeout=1),
    "broadcast-root": lambda: collectives.broadcast(np.ones(10), name="away-b", rank=0, size=2,
                                                    timeout=1),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_collectives_timeout_bounds_the_call_while_the_directory_is_away(local, call):
    """gather/allgather say "`timeout` bounds the whole call" (and
    docs/architecture.md says so of every collective). With the directory
    unreachable, allreduce, a reduce's root and a broadcast's receiver give up
    at their 1 s; but the put in gather/allgather and a broadcast root's put
    wait the runtime's `timeout_s` (5 s here, 300 s by default), and a
    non-root `reduce`'s steps are bounded only by the blocking call's grace
    (timeout + 5 s, "the runtime did not answer")."""
    rt = local
    rt.call(rt.directory.close(), 10)  # (its node keeps trying to reconnect)
    start = time.monotonic()
    with pytest.raises(hg.HopliteError):
        CALLS[call]()
    assert time.monotonic() - start < 3.0


# --- arguments ----------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [dict(op="mean"), dict(num_objects=0),
                                    dict(num_objects=3)],
                         ids=["unknown-op", "no-objects", "more-objects-than-ranks"])
def test_delete_refuses_what_no_call_could_have_used(local, kwargs):
    """`delete(name, size=, op=, num_objects=)` must name the call's op and
    num_objects to free its result. Values no call accepts (every collective
    refuses them with InvalidArgument) are taken silently: the result of the
    call the user meant is never freed, and nothing says so."""
    with pytest.raises(hg.InvalidArgument):
        collectives.delete("some-call", size=2, **kwargs)


@pytest.mark.parametrize("kwargs", [dict(rank=True, size=2), dict(rank=0, size=True)],
                         ids=["bool-rank", "bool-size"])
def test_a_bool_rank_or_size_is_invalid_argument(local, kwargs):
    """`num_objects=True` and `timeout=True` are refused as InvalidArgument,
    but `_check` takes a bool rank or size as the int it subclasses: rank=True
    silently acts as rank 1, size=True as a group of one."""
    with pytest.raises(hg.InvalidArgument):
        collectives.allgather(np.ones(3), name="bools", timeout=0.5, **kwargs)


def test_an_allreduce_with_slicing_on_honours_its_timeout_while_the_directory_is_away():
    """With `allreduce_slicing="auto"`, an allreduce too small to slice first
    puts its barrier marker with `api.put`, bounded by `timeout_s` (5 s here,
    300 s by default), not by the call's `timeout` (a sliced one does stop at
    its 1 s)."""
    hg.init(timeout_s=5, allreduce_slicing="auto")
    try:
        rt = hg.api.runtime()
        rt.call(rt.directory.close(), 10)
        start = time.monotonic()
        with pytest.raises(hg.HopliteError):
            collectives.allreduce(np.ones(10), name="away-marker", rank=0, size=2, timeout=1)
        assert time.monotonic() - start < 3.0
    finally:
        hg.shutdown()


# --- reduce requests, names and numbers ---------------------------------------


def test_the_same_reduce_asked_with_its_inputs_in_another_order_is_accepted(local):
    """`reduce` is meant to be asked by every task that wants the result (the
    collectives do exactly that: "idempotent across ranks"), with the target
    named by agreement (`ObjectID.from_name`). The directory compares the
    input *lists* (`state.py` `_on_ReduceRequested`: `old.inputs ==
    ev.inputs`), so a second task that lists the very same inputs in
    another order (its own first, as `root_input` invites, or a set) gets
    `ObjectExists: a different reduce already produces ...` although it
    asked for the same reduce. Even `hg.reduce({a, b, c})` twice in one
    process fails whenever the two sets iterate differently."""
    ids = [hg.ObjectID.from_name(f"review-order-{r}") for r in range(3)]
    target = hg.ObjectID.from_name("review-order-sum")
    assert hg.reduce(ids, object_id=target) == target
    # a second worker lists them its own way, its own input first
    assert hg.reduce([ids[2], ids[0], ids[1]], object_id=target, root_input=ids[2]) == target
    for r, oid in enumerate(ids):
        hg.put(np.full(4, float(r + 1)), oid)
    assert hg.get(target, timeout=5).tolist() == [6.0] * 4
    assert set(hg.reduced_inputs(target, timeout=5)) == set(ids)


def test_reduced_inputs_asked_before_the_reduce_waits_for_it(local):
    """`reduced_inputs` "waits until the reduce is done" (api.py) and takes a
    `timeout`; a `get` of the same target asked before the reduce request
    waits for it too. But a `reduced_inputs` that reaches the directory
    before the reduce request (another worker checking whether its input was
    used, racing the driver's `reduce`) is answered at once with
    `ObjectNotFound: no reduce produces ...`: its timeout is never used."""
    a, b = (hg.ObjectID.from_name(f"review-early-{x}") for x in "ab")
    target = hg.ObjectID.from_name("review-early-sum")
    got: dict = {}

    def worker() -> None:
        start = time.monotonic()
        try:
            got["inputs"] = hg.reduced_inputs(target, timeout=5)
        except hg.HopliteError as exc:
            got["inputs"] = exc
        got["after"] = time.monotonic() - start

    thread = threading.Thread(target=worker)
    thread.start()
    time.sleep(0.3)  # the driver asks a moment later
    hg.reduce([a, b], object_id=target)
    hg.put(np.ones(3), a)
    hg.put(np.ones(3), b)
    thread.join(10)
    assert not thread.is_alive()
    assert isinstance(got["inputs"], list), \
        f"{got['inputs']!r} after {got['after']:.3f}s of a 5 s timeout"
    assert set(got["inputs"]) == {a, b}


@pytest.mark.parametrize("name", [None, "", b"grads-1"], ids=["None", "empty", "bytes"])
def test_a_collective_refuses_a_name_that_is_not_a_non_empty_str(local, name):
    """`ObjectID.from_name` refuses anything but a non-empty str
    (InvalidArgument), but the collectives build their ids with an f-string
    (`f"{name}/bcast"`, `input_id`), so any name is taken: `name=None` (a
    config lookup that found nothing) makes every step the same call, whose
    later steps silently return the first step's objects; `b"grads-1"` is
    the call "b'grads-1'", which a rank passing "grads-1" never meets (both
    wait out their timeout); "" names ids like "/in/0"."""
    taken = []
    for call, run in NAMED_CALLS.items():
        try:
            run(name)
        except hg.InvalidArgument:
            continue
        taken.append(call)
    assert not taken, f"name={name!r} taken by {taken}"


def test_numpy_integers_are_ranks_sizes_and_counts(local):
    """A NumPy integer is a timeout and a setting (config.check_timeout,
    "NumPy numbers are timeouts and settings"), and the reduce kernels take
    an `np.integer` count, but `_check` and `_reduce_args` refuse one as a
    rank, size, root or num_objects, with a message that contradicts
    itself: "rank must be an int in [0, 2); got np.int64(0)". Such values
    come straight from NumPy code (`np.ceil(0.75 * size).astype(int)`, an
    index from `np.argsort`)."""
    refused = {}
    for what, value in (("rank", np.int64(0)), ("size", np.int64(2)),
                        ("num_objects", np.int64(1)), ("root", np.int32(0))):
        args = dict(rank=0, size=2, num_objects=1) | {what: value}  # (its own input is enough)
        try:
            got = collectives.reduce(np.ones(3), name=f"review-np-{what}", timeout=1, **args)
        except hg.InvalidArgument as exc:
            refused[what] = str(exc)
            continue
        assert got.tolist() == [1.0] * 3
    assert not refused, refused


def test_a_reduce_known_done_is_not_asked_again_of_a_restarted_directory(local):
    """A node asks its reduces again of a restarted directory until it sees
    the result. A rank that never reads the result (a non-root of
    `collectives.reduce(wait=True)`, which learns the reduce is done from
    `reduced_inputs`) kept every one: up to 4096 per node, each asked again
    after a restart, and each a task the new directory kept for good once
    the inputs were deleted."""
    ids = [hg.ObjectID.from_name(f"review-done-{r}") for r in range(2)]
    target = hg.ObjectID.from_name("review-done-sum")
    hg.reduce(ids, object_id=target)
    for oid in ids:
        hg.put(np.ones(4), oid)
    assert set(hg.reduced_inputs(target, timeout=5)) == set(ids)
    assert target not in local.node._my_reduces


@pytest.mark.parametrize("call", ["broadcast", "reduce", "allreduce", "gather", "allgather"])
@pytest.mark.parametrize("awaited", [False, True])
def test_a_collective_that_times_out_names_the_timeout_it_was_given(local, call, awaited):
    """Rank 0 of 2 alone: the call must time out, and say so with the timeout
    the caller gave (0.7 s). gather and allgather said "within 0.698s", the
    time left after their put, and a call whose direct try fell back late
    named what little was left ("within 0.001s"): a setting nobody made."""
    kw = {"root": 1} if call == "broadcast" else {}
    fn = getattr(collectives, call + ("_async" if awaited else ""))
    args = dict(name=f"review-timeout-{call}-{awaited}", rank=0, size=2, timeout=0.7, **kw)
    with pytest.raises(hg.Timeout) as caught:
        if awaited:
            asyncio.run(fn(np.ones(4, np.float32), **args))
        else:
            fn(np.ones(4, np.float32), **args)
    assert "0.7s" in str(caught.value), caught.value


# --- a second call under one name ---------------------------------------------


def _Directory(port: int = 0) -> ThreadedDirectory:
    return ThreadedDirectory(TOKEN, port)


@pytest.mark.timeout(60)
def test_a_broadcast_root_called_twice_in_a_row_returns_the_first_calls_value():
    """docs/api.md "Collectives": "a second call under the same name returns the
    first call's objects, on every rank (a broadcast's root included)".
    `collectives._held_here` decides that from the node's store, but a small
    root value goes through a direct put, whose copy the thread only hands
    to the loop (`DirectCalls._keep` -> `Node.keep_inline`, queued with
    call_soon_threadsafe). A root that calls again at once, before the loop
    has run that (a busy loop; with an idle one it already loses the race
    about 19 times in 20, since the caller's thread keeps the GIL), finds
    nothing held, puts again and returns its NEW argument, while every other
    rank gets the first call's bytes: the two ranks of one broadcast
    silently return different arrays."""
    directory = _Directory()
    try:
        hg.init(directory.address, token=TOKEN, timeout_s=5)
        rt = hg.runtime()
        rt._loop.call_soon_threadsafe(time.sleep, 0.5)  # the node's loop is busy a moment
        first = collectives.broadcast(np.arange(4), name="review-twice", rank=0, size=2,
                                      timeout=5)
        again = collectives.broadcast(np.arange(4) + 100, name="review-twice", rank=0, size=2,
                                      timeout=5)
        other = collectives.broadcast(None, name="review-twice", rank=1, size=2, timeout=5)
        np.testing.assert_array_equal(first, np.arange(4))
        np.testing.assert_array_equal(other, np.arange(4))
        assert np.array_equal(again, other), (
            f"the root's second call returned {again}, the other rank got {other}: one "
            "broadcast, two different values")
    finally:
        hg.shutdown()
        directory.close()
