"""A directory that stops without dying (SIGSTOP, as Ctrl-Z in its
terminal, a debugger or a frozen container does) and then goes on, with
real processes (docs/fault-tolerance.md)."""

from __future__ import annotations

import os
import re
import signal
import time

import cluster_tasks as t
import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu.cluster import LocalCluster

FAST = {"stall_timeout_s": 1.0, "heartbeat_interval_s": 0.2, "node_lease_s": 1.5}


def _stop_directory(c: LocalCluster, seconds: float) -> None:
    pid = c._directory.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.timeout(60)
def test_a_directory_that_was_stopped_does_not_declare_live_nodes_dead():
    """docs/fault-tolerance.md: a node is declared dead "after `node_lease_s`
    without" a ping. Here every node pings on time (every 0.2 s) while the
    directory process is stopped for 2.5 s (lease 1.5 s); the pings wait in
    its sockets. When it goes on, its first `Tick` runs before it reads
    them (`DirectoryServer._tick_loop` -> `state.Directory._on_Tick` measures
    `now - last_seen`, and the time it was stopped counts against every
    node), so it declares every node dead ("no heartbeat for 2.6s") and
    disconnects them all. Objects whose only complete copies are pulled
    copies (the putting task exited, as a Ray task's worker does) are then
    declared lost, and the copy announced again on reconnection is told to
    drop. The user sees `ObjectNotFound: ... was lost: every node holding a
    complete copy ... died` for an object a live process held whole
    throughout, on every node, the holder's own `get` included."""
    with LocalCluster(3, **FAST) as c:
        crc = c.run(0, t.put_pattern, "held-by-a-puller", 4 << 20)
        assert c.run(1, t.get_summary, "held-by-a-puller", 10.0)[0] == crc
        c.kill(0)  # the putter exits; worker 1 keeps a complete copy
        deadline = time.monotonic() + 5
        while len(c.run(2, t.object_info, "held-by-a-puller")["holders"]) != 1:
            assert time.monotonic() < deadline, "the putter was not seen to leave"
            time.sleep(0.05)
        assert c.run(2, t.get_summary, "held-by-a-puller", 10.0)[0] == crc  # served by worker 1

        _stop_directory(c, 2.5)
        time.sleep(1.0)  # (nodes that were cut off have reconnected by now)

        elsewhere = c.run(2, t.get_error_text, "held-by-a-puller", 5.0)
        own = c.run(1, t.get_error_text, "held-by-a-puller", 5.0)
    assert (elsewhere, own) == ("no error", "no error"), (
        "a live node's complete copy was lost because the directory itself was "
        f"stopped: worker 2 got {elsewhere!r}; worker 1, which held it, got {own!r}")


def _first_call_timing_out(kind: str, timeout: float) -> str:
    """A small put, or a one-rank allreduce, as this process's first call
    (no direct connection open yet); its Timeout's message."""
    from hoplite_gpu import collectives

    try:
        if kind == "put":
            hg.put(np.arange(10.0), hg.ObjectID.from_name("stalled-put"))
        else:
            collectives.allreduce(np.arange(10.0), name="stalled-ar", rank=0, size=1,
                                  timeout=timeout)
    except hg.Timeout as exc:
        return str(exc)
    return "no Timeout"


@pytest.mark.timeout(60)
def test_a_timeout_against_a_stalled_directory_names_the_calls_own_timeout():
    """docs/fault-tolerance.md, "Deadlines": a put's directory request is
    bounded by `timeout_s` and a collective by its `timeout`; they are
    (both end on time), but what they say is not. Against a directory that
    takes connections and answers nothing (stopped), a small call's first
    direct connection spends the whole deadline in its handshake
    (`DirectCalls._take`, hoplite_gpu/direct.py: `min(connect_timeout_s,
    deadline - now)`), returns MISS, and the loop's path is given the
    millisecond left (`api.put`: `rt.node.put(..., timeout=left)`;
    `collectives._reduce_and_get`: `_together(steps, time_left(deadline))`),
    whose Timeout names it: "the directory did not answer 'put' within
    0.001s" for a put of `timeout_s` 2 s, and "object ... was not available
    within 0.001s: nobody has put it yet" for an allreduce given 1.5 s
    (tests/test_many_nodes.py fixed the same for a shared get). Idle direct
    connections close after 30 s, so a step every minute opens one anew."""
    with LocalCluster(2, timeout_s=2.0, **FAST) as c:
        pid = c._directory.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            c.submit(0, _first_call_timing_out, "put", 1.5)
            c.submit(1, _first_call_timing_out, "allreduce", 1.5)
            said = {"put": c.result(0, 30), "allreduce": c.result(1, 30)}
        finally:
            os.kill(pid, signal.SIGCONT)
    wrong = {}
    for what, want in (("put", 2.0), ("allreduce", 1.5)):
        named = [float(x) for x in re.findall(r"within ([0-9.]+) ?s", said[what])]
        if not (named and abs(named[0] - want) < 0.3):
            wrong[what] = f"named {named} s, not its own {want} s: {said[what]!r}"
    assert not wrong, wrong
