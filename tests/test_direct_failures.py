"""Direct calls (hoplite_gpu.direct) when things go wrong, and how they meet
the runtime's loop: a call that falls back to the loop's path keeps its
deadline, an interrupted or timed-out direct put is withdrawn, what a direct
call leaves behind when the node's own connection and the thread's
connection deliver things in a different order or the directory restarts
under it, and what the link pool keeps."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest
from in_process import ThreadedDirectory, holders_after_direct_calls, swallow_first_ok

import hoplite_gpu as hg
from hoplite_gpu import collectives
from hoplite_gpu import direct as direct_module
from hoplite_gpu.config import Config
from hoplite_gpu.directory import state
from hoplite_gpu.runtime import Runtime

TOKEN = "review-token"


def _Directory(port: int = 0) -> ThreadedDirectory:
    return ThreadedDirectory(TOKEN, port)


@pytest.mark.timeout(60)
def test_a_put_after_a_delete_elsewhere_is_held_by_its_node():
    """Node B reads X with a direct get (inline: B keeps no copy, yet the
    directory records B as a complete holder, `state._assign`). Node A then
    deletes X, and the directory sends B a drop. B, told of the delete (by
    anything quicker than its loop, e.g. a direct call), puts X anew, direct.
    If B's loop reads the old drop only after its thread read `forgets` for
    the put (a loop a few hundred microseconds behind: the very cost direct
    calls exist to avoid), `keep_inline` takes the old drop for one that
    overtook this put, or the drop removes the copy just kept: B's put
    returned, the directory lists B as the object's origin, and B holds
    nothing. The object then exists only in the directory's memory: after
    a directory restart it is gone, and a get of it waits out its timeout
    ("nobody has put it yet"). Through the loop's get (which keeps the
    copy) the same sequence keeps the put."""
    first = _Directory()
    second = None
    a = None
    try:
        hg.init(first.address, token=TOKEN, timeout_s=5)
        b = hg.runtime()
        a = Runtime(Config.from_env(token=TOKEN, timeout_s=5), first.address)
        x = hg.ObjectID.from_name("review-reused-id")
        a.call(a.node.put(b"v1", x), 5)
        assert hg.get(x) == b"v1"  # direct, inline

        b._loop.call_soon_threadsafe(time.sleep, 1.0)  # B's loop lags behind
        a.call(a.node.delete(x), 5)
        hg.put(b"v2", x)  # returns: registered, B is its origin
        hg.node_stats()  # (through B's loop: what the put handed it is done)
        held = b.node.store.get(x) is not None

        first.close()
        second = _Directory(first.port)  # restarted: nodes re-announce what they hold
        try:
            got = a.call(a.node.get(x, 3, "numpy"), 5)
        except hg.Timeout as exc:
            pytest.fail(f"B's put returned, yet the object did not survive a directory "
                        f"restart (B holds its copy: {held}): {exc}")
        assert got == b"v2"
    finally:
        if a is not None:
            a.close()
        hg.shutdown()
        (second or first).close()


@pytest.mark.timeout(30)
def test_a_get_falling_back_after_a_directory_restart_names_the_callers_timeout():
    """A direct get waiting for an object when the directory restarts falls
    back to the loop's path "with the time left". If the object still does
    not come, the Timeout the caller sees names that remainder: a call made
    with timeout=2 says "was not available within 0.79s", as if the caller
    had asked for 0.79 s."""
    first = _Directory()
    second: list[_Directory] = []

    def restart() -> None:
        time.sleep(1.2)
        first.close()
        second.append(_Directory(first.port))

    try:
        hg.init(first.address, token=TOKEN, timeout_s=5)
        restarter = threading.Thread(target=restart)
        restarter.start()
        with pytest.raises(hg.Timeout) as caught:
            hg.get(hg.ObjectID.from_name("review-never-put"), timeout=2)
        restarter.join(10)
        assert "within 2s" in str(caught.value), str(caught.value)
    finally:
        hg.shutdown()
        for directory in second or [first]:
            directory.close()


@pytest.mark.timeout(30)
def test_a_timed_out_direct_put_is_withdrawn_after_a_directory_stall():
    """A direct put whose answer does not come in time raises Timeout and is
    withdrawn: the node posts `dropped` on its own connection, while the put
    went on the thread's. When the directory stalls past the put's deadline
    with the node's connection already readable (a heartbeat sent before the
    put), it reads the node's connection first on waking: the withdrawal is
    handled before the put, which then registers the node as the complete
    origin of an object it never kept. The caller was told the put failed;
    object_info lists this node as holding it."""
    hg.init(timeout_s=0.5)
    try:
        rt = hg.runtime()
        hg.put(b"warm")  # a direct link exists
        node = rt.node

        def stall() -> None:
            node.client.post({"op": "ping"})  # a heartbeat, then a stall
            time.sleep(1.5)
        rt._loop.call_soon_threadsafe(stall)
        time.sleep(0.05)
        oid = hg.ObjectID.from_name("review-overtaken")
        with pytest.raises(hg.Timeout):
            hg.put(b"lost", oid)
        assert rt.direct.puts == 1  # (only the warm-up went through)
        assert holders_after_direct_calls(rt, oid) == [], \
            "the put that raised Timeout is registered to a node that does not hold it"
    finally:
        hg.shutdown()


@pytest.mark.timeout(30)
def test_idle_links_are_closed_once_idle_too_long(monkeypatch):
    """docs/architecture.md "Direct calls": "up to 8 idle ones are kept for
    30 s". Links are taken last-in first-out and only a link taken is
    checked for its age: after a burst of concurrent calls, a process that
    goes on making one call at a time keeps reusing the newest link, and
    the others stay open (each a connection and a descriptor on the
    directory) for as long as the process lives."""
    monkeypatch.setattr(direct_module, "_IDLE_S", 0.3)
    hg.init(timeout_s=5)
    try:
        rt = hg.runtime()
        oid = hg.ObjectID.from_name("review-burst")
        getters = [threading.Thread(target=hg.get, args=(oid,), kwargs={"timeout": 5})
                   for _ in range(3)]
        for t in getters:
            t.start()
        time.sleep(0.3)
        hg.put(b"x", oid)
        for t in getters:
            t.join(5)
        assert len(rt.direct._idle) >= 3  # the burst's links
        for _ in range(10):  # one call at a time, for over twice _IDLE_S
            hg.put(b"y")
            time.sleep(0.1)

        async def directs() -> int:
            return sum(len(p.directs) for p in rt.directory.peers.values())
        assert rt.call(directs(), 5) <= 1, "links idle for over _IDLE_S are still open"
    finally:
        hg.shutdown()


def _slow_allreduce() -> None:
    collectives.allreduce(np.ones(4, dtype=np.float32), name="slow-ar", rank=0, size=2,
                          timeout=1.0)


def _slow_put() -> None:
    hg.put(b"abc", hg.ObjectID.from_name("slow-put"))


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
