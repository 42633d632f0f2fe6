"""LocalCluster as a newcomer drives it first: answers matched to the call
that asked for them, arguments checked before anything starts or runs, and
errors that say what is wrong. Each test fails on a confirmed bug; every
wait is bounded."""

from __future__ import annotations

import math
import signal
import time

import pytest

import hoplite_gpu as hg
from hoplite_gpu.cluster import LocalCluster


def _touch(path: str) -> str:  # (run inside a worker: a job with a visible effect)
    with open(path, "w") as f:
        f.write("ran")
    return path


def _interrupt(signum, frame):  # (a Ctrl-C arriving while the caller waits)
    raise KeyboardInterrupt


# ------------------------------------------------- answers to their call ---
def test_run_after_an_interrupted_run_returns_its_own_result():
    """Ctrl-C (in a REPL or notebook) while `run()` waits leaves that job's
    sequence number first in the worker's queue (cluster.py `run`: no
    clean-up when `_recv` raises, unlike `map`'s `finally`). `_recv` then
    returns whichever awaited job answers first, so the next `run(0, str,
    "second")` returns the interrupted job's result (None from time.sleep)
    instead of "second", and every later run on that worker is off by one."""
    with LocalCluster(1) as c:
        old = signal.signal(signal.SIGALRM, _interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(KeyboardInterrupt):
                c.run(0, time.sleep, 1.0, timeout=10)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        assert c.run(0, str, "second", timeout=10) == "second"
        assert c.run(0, str, "third", timeout=10) == "third"


def test_map_after_an_uncollected_submit_returns_its_own_results():
    """`map` submits its jobs and then calls `_recv(worker)`, which returns
    the oldest awaited answer of that worker, not the map's own: after
    `submit(0, str, "earlier")`, `map(str, [("a",), ("b",)])` returns
    ['earlier', 'b'], and `result(0)` then returns 'a', the map's answer.
    Either the map's own results or a clear refusal, and the submitted job's
    answer left for `result`."""
    with LocalCluster(2) as c:
        c.submit(0, str, "earlier")
        try:
            assert c.map(str, [("a",), ("b",)], timeout=10) == ["a", "b"]
        except hg.HopliteError:
            pass  # refusing to mix them, clearly, is fine too
        assert c.result(0, timeout=10) == "earlier"


# ----------------------------------------- arguments checked up front ---
@pytest.mark.parametrize("start_timeout", [None, -1, math.inf, "30"],
                         ids=["none", "negative", "inf", "str"])
def test_a_bad_start_timeout_is_refused_clearly(start_timeout):
    """`start_timeout` is never checked (cluster.py `start`): None or "30"
    die of a raw TypeError from `time.monotonic() + start_timeout`, -1 of a
    raw ValueError from `queue.get` and inf of a raw OverflowError, the last
    two after the directory process was started. docs/fault-tolerance.md
    says LocalCluster refuses bad timeouts before starting anything; every
    other timeout of the package is checked by `check_timeout`."""
    try:
        with LocalCluster(1, start_timeout=start_timeout) as c:
            assert c.run(0, str, "x", timeout=10) == "x"
    except hg.HopliteError:
        pass  # refused as InvalidArgument (or, for None/inf, no limit): fine


@pytest.mark.parametrize("case", ["more-args-than-workers", "workers-shorter-than-args"])
def test_a_map_that_cannot_run_whole_runs_none_of_it(case, tmp_path):
    """`map` checks each (worker, args) pair while it submits them
    (cluster.py `map`: `zip(..., strict=True)` and `_submit` in one loop):
    three argument tuples on a 2-worker cluster raise "no worker 2" only
    after jobs 0 and 1 were sent and run (their side effects happen, their
    answers are dropped); `workers=[0]` with two argument tuples runs the
    first job and then dies of a raw `ValueError: zip() argument 2 is longer
    than argument 1`. The call should be refused (a HopliteError, such as
    InvalidArgument) before any job is sent."""
    paths = [str(tmp_path / f"job{i}") for i in range(3)]
    with LocalCluster(2) as c:
        if case == "more-args-than-workers":
            args, workers = [(p,) for p in paths], None
        else:
            args, workers = [(p,) for p in paths[:2]], [0]
        with pytest.raises(hg.HopliteError):
            c.map(_touch, args, workers=workers, timeout=10)
        time.sleep(0.5)  # (a job sent anyway has run by now)
        ran = sorted(p.name for p in tmp_path.iterdir())
        assert not ran, f"jobs of the refused map ran: {ran}"
        assert c.map(str, [("a",), ("b",)], timeout=10) == ["a", "b"]


# ------------------------------------------------------ clear errors ---
@pytest.mark.parametrize("when", ["before-start", "after-close"])
def test_using_a_cluster_that_is_not_running_says_so(when):
    """A LocalCluster not started yet, or already closed, answers `run(0,
    ...)` with "no worker 0: this cluster has workers 0 to -1"
    (cluster.py `_check_worker`, over the emptied lists): it blames the
    worker index and describes an impossible range, where `restart_directory`
    in the same state says "not running: start() it first"."""
    c = LocalCluster(1)
    if when == "after-close":
        with c:
            pass
    with pytest.raises(hg.HopliteError) as info:
        c.run(0, str, "x", timeout=5)
    message = str(info.value)
    assert "0 to -1" not in message and ("start" in message or "closed" in message), message
