"""`shutdown()` lets peers finish pulling what only this node holds whole
(bounded by `shutdown_grace_s` and by Ctrl-C), and is prompt otherwise."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import cluster_tasks as t
import numpy as np
import pytest
from in_process import eventually, run_nodes

import hoplite_gpu as hg
from hoplite_gpu.cluster import LocalCluster
from hoplite_gpu.config import Config
from hoplite_gpu.ids import ObjectID


@pytest.mark.parametrize("size, receivers", [
    (64 << 20, 3),
    # (the case: 256 MiB to 7 receivers)
    pytest.param(256 << 20, 7, marks=pytest.mark.slow),
])
def test_a_root_that_shuts_down_right_after_its_broadcast_lets_every_receiver_finish(
        size, receivers):
    """A broadcast's root whose call returned once its put was done, and which
    then called `shutdown()`, made every receiver still pulling fail with
    "object ... was lost". Now the root waits for them: every receiver gets
    the bytes (over TCP)."""
    with LocalCluster(receivers + 1, shared_memory=False) as c:
        for r in range(1, receivers + 1):
            c.submit(r, t.broadcast_receive, "leave", r, receivers + 1)
        crc, filling = c.run(0, t.broadcast_and_leave, "leave", size, receivers, timeout=120)
        got = [c.result(r, 120) for r in range(1, receivers + 1)]
    assert filling >= 1, "every receiver was done before the root left: nothing was tested"
    assert got == [crc] * receivers


@pytest.fixture
def held():
    """A local runtime holding a 4 MiB object (not inline); shut down at the end."""
    hg.init(shutdown_grace_s=30)
    hg.put(np.ones(1 << 19))
    yield hg.api.runtime()
    hg.shutdown()


def test_shutdown_is_prompt_when_nobody_pulls(held):
    start = time.monotonic()
    hg.shutdown()
    assert time.monotonic() - start < 5, "shutdown waited though nobody was pulling"


def test_the_wait_for_pulls_ends_at_shutdown_grace_s(monkeypatch):
    hg.init(shutdown_grace_s=0.5)
    try:
        hg.put(np.ones(1 << 19))
        rt = hg.api.runtime()
        # a peer that pulls and never finishes
        monkeypatch.setattr(rt.node.server, "serving", lambda oid: True)
        start = time.monotonic()
    finally:
        hg.shutdown()
    took = time.monotonic() - start
    assert 0.5 <= took < 5 and rt.closed


def test_ctrl_c_cuts_the_wait_for_pulls_short(held, monkeypatch):
    rt = held
    monkeypatch.setattr(rt.node.server, "serving", lambda oid: True)
    draining = threading.Event()
    real = rt.node.drain

    async def drain(grace: float) -> int:
        draining.set()
        return await real(grace)

    monkeypatch.setattr(rt.node, "drain", drain)

    def interrupt() -> None:
        if draining.wait(10):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        hg.shutdown()
    assert time.monotonic() - start < 10 and draining.is_set()
    assert rt.closed, "Ctrl-C during the wait left the runtime open"


def test_ctrl_c_as_the_wait_for_pulls_starts_still_closes_the_runtime(held, monkeypatch):
    """Ctrl-C that landed between the drain's submission to the loop and the
    wait on it (a slow machine: the drain had begun, the main thread not yet
    in its `try`) escaped `Runtime._drain` and left the runtime open."""
    rt = held
    monkeypatch.setattr(rt.node.server, "serving", lambda oid: True)
    real = asyncio.run_coroutine_threadsafe

    def submit_then_interrupted(coro, loop):
        fut = real(coro, loop)
        if getattr(coro, "__name__", "") == "drain":
            raise KeyboardInterrupt  # (as a SIGINT handled right after the submission)
        return fut

    monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", submit_then_interrupted)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        hg.shutdown()
    assert time.monotonic() - start < 10
    assert rt.closed, "Ctrl-C as the wait began left the runtime open"


def test_ctrl_c_while_the_runtime_closes_still_stops_its_loop(held):
    """A second Ctrl-C, during the wait for the node and directory to close
    (`Runtime.close` waited with `fut.result(15)` and caught only
    Exception), escaped before the loop was stopped: its thread ran on, the
    calls waiting on it were never cancelled, and the runtime stayed open."""
    rt = held
    real = rt._close
    main = threading.main_thread().ident

    async def close_then_interrupted() -> None:
        await real()  # (everything closed: nothing is left open by the test)
        signal.pthread_kill(main, signal.SIGINT)
        await asyncio.sleep(5)  # the rest of a slow close, cut short

    rt._close = close_then_interrupted
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        hg.shutdown()
    assert time.monotonic() - start < 5
    assert rt.closed, "Ctrl-C while the runtime closed left its loop running"


def _held_connections(node) -> asyncio.Event:
    """`node`'s pulls wait, before they connect to their sender, until the
    returned event is set."""
    gate = asyncio.Event()
    real = node.pool.acquire

    async def held(address: str, local: bool = True, bind=None):
        await gate.wait()
        return await real(address, local, bind)

    node.pool.acquire = held
    return gate


def _holds(directory, oid, node) -> bool:
    entry = directory.state.objects.get(oid.binary)
    return entry is not None and node.node_id in entry.holders


def test_a_receiver_sent_here_that_has_not_connected_yet_is_waited_for():
    """The data server sees a pull only once its receiver connects; the
    directory already counts the receiver it sent here (an incomplete holder
    of an object whose only complete copy is ours): the node waits for it."""
    oid = ObjectID.from_name("drain-early")

    async def body(directory, a, b):
        await a.put(np.ones(1 << 20), oid)  # 8 MiB
        gate = _held_connections(b)
        got = asyncio.ensure_future(b.get(oid, 20))
        assert await eventually(lambda: _holds(directory, oid, b))
        drain = asyncio.ensure_future(a.drain(10))
        await asyncio.sleep(0.3)
        assert not drain.done(), "the node left while its receiver had not even connected"
        gate.set()
        assert await asyncio.wait_for(drain, 10) == 1
        assert float((await got).sum()) == 1 << 20

    run_nodes([Config(shared_memory=False, timeout_s=20)] * 2, body)


def test_no_wait_when_another_node_holds_a_complete_copy():
    oid = ObjectID.from_name("drain-copied")

    async def body(directory, a, b, c):
        await a.put(np.ones(1 << 20), oid)
        await c.get(oid, 20)  # a second complete copy
        _held_connections(b)
        got = asyncio.ensure_future(b.get(oid, 20))
        try:
            assert await eventually(lambda: _holds(directory, oid, b))
            start = time.monotonic()
            assert await a.drain(10) == 0
            assert time.monotonic() - start < 2
        finally:
            got.cancel()
            await asyncio.gather(got, return_exceptions=True)

    run_nodes([Config(shared_memory=False, timeout_s=20)] * 3, body)
