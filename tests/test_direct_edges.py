"""Edge cases of direct calls (hoplite_gpu.direct): what a direct call that
fails over to the loop's path, or is interrupted, leaves behind."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest
from in_process import holders_after_direct_calls, swallow_first_ok

import hoplite_gpu as hg
from hoplite_gpu import collectives
from hoplite_gpu.directory import state


def _stall_then_cut_direct(rt, swallow: type, after: float) -> threading.Timer:
    """The embedded directory never answers events of type `swallow` (on any
    connection), and closes the node's direct connections `after` seconds
    from now: a direct call then waits, and falls back to the loop's path."""
    server = rt.directory
    real_apply = server.apply

    def apply(ev):
        if isinstance(ev, swallow):
            return
        real_apply(ev)
    server.apply = apply

    async def cut():
        for peer in list(server.peers.values()):
            for direct in list(peer.directs):
                await direct.stream.close()

    def later():
        rt._loop.call_soon_threadsafe(lambda: rt._loop.create_task(cut()))
    timer = threading.Timer(after, later)
    timer.start()
    return timer


def _slow_put() -> None:
    hg.put(b"abc", hg.ObjectID.from_name("slow-put"))


def _slow_allreduce() -> None:
    collectives.allreduce(np.ones(4, dtype=np.float32), name="slow-ar", rank=0, size=2,
                          timeout=1.0)


@pytest.mark.parametrize("settings, event, call", [
    # api.put: the loop was handed the whole timeout_s again
    ({"timeout_s": 1.0}, state.Put, _slow_put),
    # a small collective: the loop's path got the whole `timeout` again
    ({"timeout_s": 20}, state.ReduceRequested, _slow_allreduce),
], ids=["put", "allreduce"])
def test_a_call_that_falls_back_to_the_loop_keeps_to_its_deadline(settings, event, call):
    """docs/architecture.md "Direct calls": a call whose connection breaks
    (here at 0.6 s) is asked again through the loop "with the time left",
    not with its whole timeout (1 s) again."""
    hg.init(**settings)
    try:
        timer = _stall_then_cut_direct(hg.runtime(), event, 0.6)
        started = time.monotonic()
        with pytest.raises(hg.Timeout):
            call()
        elapsed = time.monotonic() - started
        timer.join(5)
        assert elapsed < 1.35, f"{call.__name__} with a 1 s deadline blocked {elapsed:.2f}s"
    finally:
        hg.shutdown()


def test_an_interrupted_direct_put_is_withdrawn():
    """A direct put interrupted (KeyboardInterrupt) while it waits for the
    directory's ok raises, but leaves the object registered with this node
    as its complete origin holder, a node that holds nothing (the put is
    never kept). A put given up at its deadline is withdrawn
    (DirectCalls.put), and so is the loop's put when its call is cancelled;
    an interrupted one must be too."""
    hg.init(timeout_s=5)
    old = signal.getsignal(signal.SIGALRM)
    try:
        rt = hg.runtime()
        server = rt.directory
        swallowed = swallow_first_ok(server)

        def interrupt(*_):
            raise KeyboardInterrupt
        signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        oid = hg.ObjectID.from_name("interrupted")
        with pytest.raises(KeyboardInterrupt):
            hg.put(b"lost", oid)
        signal.setitimer(signal.ITIMER_REAL, 0)
        assert swallowed, "the put did not go direct"
        assert holders_after_direct_calls(rt, oid) == [], "registered to a node that does not hold it"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        hg.shutdown()
