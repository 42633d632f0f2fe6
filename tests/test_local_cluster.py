"""LocalCluster and the demo as a user drives them: bad arguments and
settings checked before anything starts or runs, tasks whose functions,
arguments or answers do not travel, answers matched to the call that asked
for them (after an interrupt, an uncollected submit, a failed map), pipelined
submits, a cluster not running, and closing. Each test fails on a confirmed
bug; every wait is bounded."""

from __future__ import annotations

import math
import operator
import os
import re
import signal
import threading
import time

import pytest

import hoplite_gpu as hg
from hoplite_gpu import demo
from hoplite_gpu.cluster import LocalCluster, WorkerError
from hoplite_gpu.errors import ConfigError


class _Unloadable:
    """Pickles fine; unpickling it raises ZeroDivisionError (as an object of
    a class the receiving process cannot rebuild does)."""

    def __reduce__(self):
        return (operator.truediv, (1, 0))


class _TwoArgError(Exception):
    """The classic exception that pickles but cannot be unpickled: its
    __init__ wants two arguments, BaseException.__reduce__ gives it one."""

    def __init__(self, what: str, code: int) -> None:
        super().__init__(what)
        self.code = code


def _returns_two_arg_error() -> _TwoArgError:  # (run inside a worker)
    return _TwoArgError("collected", 7)


# --------------------------------------------------- arguments, settings ---
@pytest.mark.parametrize("n", [-1, 2.5])
def test_a_bad_worker_count_is_refused_clearly(n):
    """LocalCluster(-1) starts a directory and reports success with
    num_workers == -1 and no workers; LocalCluster(2.5) starts the directory
    and then dies of a raw TypeError from range()."""
    with pytest.raises(hg.HopliteError):
        with LocalCluster(n):
            pass


@pytest.mark.parametrize("standbys", [-1, 1.5, True])
def test_a_bad_standby_count_is_refused_before_any_process_starts(standbys):
    with pytest.raises(hg.InvalidArgument, match="standbys"):
        LocalCluster(1, standbys=standbys)


@pytest.mark.parametrize("settings", [{"chunk_sze": 8192}, {"chunk_size": 8192.0},
                                      {"chunk_size": None}],
                         ids=["unknown-name", "float-for-int", "none"])
def test_a_bad_setting_is_a_config_error_that_names_it(settings):
    """The settings reach the directory as HOPLITE_* text and the workers as
    keywords; whichever refuses them dies, printing the ConfigError to
    stderr, and the caller only gets "the directory exited with code 1
    before listening" or "worker 0 died (exit code None)". chunk_size=None,
    which init() takes as the default, kills the directory ('None' is no
    size). Either start with it, or say which setting is wrong."""
    name = next(iter(settings))
    try:
        with LocalCluster(1, start_timeout=30, **settings) as c:
            assert c.run(0, str, "x", timeout=10) == "x"
    except ConfigError as exc:
        assert name in str(exc), str(exc)


def test_a_bad_hoplite_variable_is_refused_before_any_process_starts(monkeypatch):
    """The directory and the workers inherit the HOPLITE_* variables; one
    they refuse used to surface only as "the directory exited with code 1
    before listening", after the directory's own message."""
    monkeypatch.setenv("HOPLITE_CHUNK_SIZE", "banana")
    with pytest.raises(ConfigError, match="HOPLITE_CHUNK_SIZE"):
        LocalCluster(1, start_timeout=30)


def test_sizes_are_parsed_exactly():
    """A float rounds 2**53 + 1 to 2**53: a size was silently another."""
    from hoplite_gpu.config import parse_size

    assert parse_size(str(2**53 + 1)) == 2**53 + 1
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("1e3") == 1000
    for bad in ("1/2", "0.5", "nan", "inf", "8EiB", "-1"):
        with pytest.raises(ConfigError):
            parse_size(bad)


# ------------------------------------------------------------ timeouts ---
@pytest.mark.parametrize("timeout", [None, float("inf")], ids=["none", "inf"])
def test_an_unbounded_run_timeout_waits_or_is_refused_and_leaves_the_worker_in_step(timeout):
    """run(timeout=None) dies of a raw TypeError and timeout=inf of a raw
    OverflowError (from poll), after the job was sent: its answer is left
    queued, so the next run on that worker returns the previous job's
    result ("first") instead of its own."""
    with LocalCluster(1) as c:
        try:
            assert c.run(0, str, "first", timeout=timeout) == "first"
        except hg.HopliteError:
            pass  # refusing it clearly is fine
        assert c.run(0, str, "second", timeout=10) == "second"


# --------------------------------------------- what does not travel well ---
def test_an_argument_the_worker_cannot_unpickle_is_reported_and_the_worker_lives():
    """The worker unpickles a job outside its try (cluster.py, `conn.recv()`
    in `_worker_main`): an argument it cannot rebuild (a class only the
    driver has, e.g. one defined in a notebook) kills the worker, which
    prints a traceback; the caller gets "worker 0 died (exit code None)"
    with no reason, and every later run on it fails until restart()."""
    with LocalCluster(1) as c:
        with pytest.raises(WorkerError, match="ZeroDivisionError"):
            c.run(0, str, _Unloadable(), timeout=10)
        assert c.run(0, str, "still here", timeout=10) == "still here"


def test_an_answer_the_driver_cannot_unpickle_is_a_worker_error_and_the_worker_lives():
    """`_recv` catches only EOFError/OSError around `conn.recv()`: an answer
    that cannot be unpickled escapes as a raw TypeError and its job stays
    first in the worker's queue, so every later run on that worker drops its
    own answer as a stale one and times out."""
    with LocalCluster(1) as c:
        with pytest.raises(hg.HopliteError):
            c.run(0, _returns_two_arg_error, timeout=10)
        assert c.run(0, str, "next", timeout=5) == "next"


def test_a_job_that_cannot_be_pickled_is_refused_clearly_and_nothing_is_sent():
    """A lambda, a local function or an argument such as a lock cannot go to
    another process: an InvalidArgument that says so, not pickle's own
    error, and the worker's next job is answered in order."""
    with LocalCluster(2) as c:
        with pytest.raises(hg.InvalidArgument, match="must be picklable.*lambda"):
            c.run(0, lambda: 1, timeout=10)
        with pytest.raises(hg.InvalidArgument, match="must be picklable"):
            c.map(str, [("fine",), (threading.Lock(),)], timeout=10)
        assert c.map(str, [("a",), ("b",)], timeout=10) == ["a", "b"]


# ---------------------------------------------------- results in order ---
def test_run_after_a_map_that_raised_returns_its_own_result():
    """map() raises at the first worker's error and leaves the other
    workers' map jobs awaited: the next run on worker 1 returns worker 1's
    map result (1.0) instead of its own."""
    with LocalCluster(2) as c:
        with pytest.raises(WorkerError, match="ZeroDivisionError"):
            c.map(operator.truediv, [(1, 0), (1, 1)], timeout=10)
        assert c.run(1, str, "fresh", timeout=10) == "fresh"


def test_a_second_submit_with_a_large_argument_does_not_deadlock():
    """submit() writes the job on the pipe from the caller's thread, blocking:
    a worker still writing a large answer nobody reads yet, and a large
    argument to the same worker, each wait for the other for ever (no
    timeout applies: result() is never reached)."""
    size = 8 << 20
    with LocalCluster(1) as c:
        c.submit(0, bytes, size)  # a large answer, collected later
        time.sleep(0.3)
        done = threading.Event()

        def pipeline() -> None:
            try:
                c.submit(0, len, b"x" * size)
            except BaseException:  # noqa: BLE001 (the kill below)
                pass
            finally:
                done.set()

        threading.Thread(target=pipeline, daemon=True).start()
        if not done.wait(3):
            c.kill(0)  # (unblocks the submit)
            done.wait(5)
            pytest.fail("submit() of a large argument was still blocked after 3 s")
        assert len(c.result(0, timeout=10)) == size
        assert c.result(0, timeout=10) == size


# ------------------------------------------------------------- closing ---
def test_close_stops_a_worker_whose_answer_was_never_collected_cleanly():
    """A worker that finished its job but whose large answer nobody read sits
    in `conn.send`; close() sends it None and joins it without reading, so it
    waits the whole grace and then SIGKILLs a worker that had nothing left
    to do (its runtime never shuts down)."""
    c = LocalCluster(1)
    c.start()
    try:
        c.submit(0, bytes, 8 << 20)
        time.sleep(0.5)
        proc = c._procs[0]
    finally:
        start = time.monotonic()
        c.close(grace=3)
    took = time.monotonic() - start
    assert proc.exitcode == 0 and took < 2, f"exit code {proc.exitcode} after {took:.1f}s"


@pytest.mark.parametrize("method", ["restart", "kill", "pid"])
def test_a_worker_index_out_of_range_is_a_hoplite_error(method):
    """submit/result check the index (`_check_worker`), but restart, kill and
    pid index the process list directly: a raw IndexError (and after
    close(), restart(0) too)."""
    with LocalCluster(1) as c:
        with pytest.raises(hg.HopliteError, match="worker"):
            getattr(c, method)(1)


# ---------------------------------------------------------------- demo ---
def test_run_demo_with_zero_repeats_is_refused_before_it_runs(capsys):
    """run_demo checks num_workers and size itself, but repeats=0 starts the
    cluster, runs the warm-up and dies of statistics.StatisticsError on the
    median of no timings."""
    try:
        rc = demo.run_demo(num_workers=2, size=64 << 10, repeats=0)
    except hg.HopliteError:
        return
    assert rc == 2


def test_the_demo_progress_bars_end_full_for_every_receiver(capsys):
    """The watcher draws from polls 0.1 s apart and stops the moment the gets
    return, with no last update: a broadcast that ends between two polls (on
    one machine, most of them) leaves receivers' bars at 0.0/1.0 MiB although
    every copy was checked byte-identical."""
    assert demo.run_demo(num_workers=3, size=1 << 20, repeats=2) == 0
    out = capsys.readouterr().out
    bars = re.findall(r"^receiver \d+\b.*?([\d.]+)/([\d.]+) MiB\s*$", out, re.M)
    assert len(bars) == 6, out  # (2 receivers, a warm-up and 2 rounds)
    assert all(done == total for done, total in bars), out


def test_start_twice_and_restart_directory_after_close_are_refused():
    """A second start() gave a confusing error; restart_directory() after
    close() started a directory that nothing stopped."""
    from hoplite_gpu import HopliteError

    c = LocalCluster(1)
    with c:
        with pytest.raises(HopliteError, match="started already"):
            c.start()
    with pytest.raises(HopliteError, match="not running"):
        c.restart_directory()
    with pytest.raises(HopliteError, match="not running"):
        c.kill_directory()
    assert c._directory is None


def test_a_standby_directory_is_killed_by_its_index_and_stopped_on_close():
    c = LocalCluster(0, standbys=1)
    with c:
        first, standby = c.directory_addresses
        assert c.address == f"{first},{standby}"
        with pytest.raises(hg.HopliteError, match="0 to 1"):
            c.kill_directory(2)
        pids = [c.directory_pid(0), c.directory_pid(1)]
        c.kill_directory(1)
        assert c._directories[1].proc.poll() is not None
        assert c._directories[0].proc.poll() is None
    assert c._directory is None
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# --------------------- interrupted calls, whole maps, a cluster not running ---
def _interrupt(signum, frame):  # (a Ctrl-C arriving while the caller waits)
    raise KeyboardInterrupt


def _touch(path: str) -> str:  # (run inside a worker: a job with a visible effect)
    with open(path, "w") as f:
        f.write("ran")
    return path


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
