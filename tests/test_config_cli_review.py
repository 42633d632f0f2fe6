"""Configuration and the command line, as a user meets them: HOPLITE_*
settings that do nothing, CLI sub-commands that end in a raw traceback or
leave processes behind. Each test fails on a confirmed bug."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hoplite_gpu.config import check_timeout

CLI = [sys.executable, "-m", "hoplite_gpu"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra: str) -> dict[str, str]:
    """A newcomer's environment: no HOPLITE_* settings but the ones given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOPLITE_")}
    env.update(extra)
    return env


def _session_pids(sid: int) -> list[str]:
    out = subprocess.run(["ps", "-ww", "-o", "pid=,cmd=", "-s", str(sid)], capture_output=True,
                         text=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


# ---------------------------------------------------------- log level ---
def test_directory_cli_honours_hoplite_log_level():
    """`hoplite-gpu directory` reads HOPLITE_* (a bad HOPLITE_LOG_LEVEL is
    refused) but then logs at its `--log-level` default, WARNING: with
    HOPLITE_LOG_LEVEL=INFO its log stays empty, although README
    (Troubleshooting) points at the directory's INFO lines ("cannot write to
    node ...")."""
    proc = subprocess.Popen([*CLI, "directory", "--port", "0", "--token", "t"],
                            env=_env(HOPLITE_LOG_LEVEL="INFO"), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 15)
        assert ready, "the directory did not start"
        assert "listening on" in proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        _kill_session(proc)
    assert "directory listening on" in err, f"no INFO log line with HOPLITE_LOG_LEVEL=INFO: {err!r}"


def test_hoplite_log_level_info_shows_in_a_plain_program():
    """HOPLITE_LOG_LEVEL=INFO (or DEBUG) sets the "hoplite_gpu" logger's level,
    but nothing gives it a handler: Python's last-resort handler passes only
    WARNING and above, so a program that did not configure logging itself
    sees nothing. README (Troubleshooting) says "`HOPLITE_LOG_LEVEL=INFO`
    logs a failed mapping"; here even the embedded directory's INFO line
    ("directory listening on ...") never appears."""
    res = subprocess.run([sys.executable, "-c",
                          "import hoplite_gpu as hg; hg.init(); hg.shutdown()"],
                         env=_env(HOPLITE_LOG_LEVEL="INFO"), capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 0, res.stderr
    assert "directory listening on" in res.stderr, f"nothing logged: {res.stderr!r}"


# ---------------------------------------------- directory --until-stdin ---
def _close_stdin() -> None:
    os.close(0)


@pytest.mark.parametrize("stdin", ["devnull", "closed"])
def test_directory_until_stdin_closes_with_no_readable_stdin_is_no_traceback(stdin):
    """`directory --until-stdin-closes` started with standard input at
    /dev/null (cron, nohup, a parent passing DEVNULL) or a regular file dies
    just after "listening" with a raw PermissionError from epoll (`add_reader`
    on a descriptor epoll cannot watch); with standard input closed it dies of
    AttributeError ('NoneType' object has no attribute 'fileno')."""
    kw = ({"stdin": subprocess.DEVNULL} if stdin == "devnull"
          else {"preexec_fn": _close_stdin})
    proc = subprocess.Popen([*CLI, "directory", "--port", "0", "--token", "t",
                             "--until-stdin-closes"], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)
    try:
        try:
            _, err = proc.communicate(timeout=5)  # (an input that has ended: it may stop)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # (or it may serve on until told)
            _, err = proc.communicate(timeout=10)
    finally:
        _kill_session(proc)
    assert "Traceback" not in err, err[-1500:]


# ---------------------------------------------------------- calibrate ---
def test_calibrate_size_beyond_memory_is_a_clear_error():
    """`calibrate --size 1024TiB` is accepted, and the worker dies of NumPy's
    MemoryError ("Unable to allocate ...") shown with its traceback, where
    `demo` with such a size says how much memory it needs and is free."""
    res = subprocess.run([*CLI, "calibrate", "--size", "1024TiB", "--repeats", "1"],
                         env=_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "MemoryError" not in res.stderr and "Traceback" not in res.stderr, res.stderr[-1500:]


# -------------------------------------------------------------- bench ---
def test_bench_error_is_one_line_not_a_traceback():
    """`main` hands `bench` to the benchmarks before its `try: ... except
    HopliteError`, so a project error (here a misspelt size in the
    environment, which LocalCluster meets) comes out as a full traceback,
    where every other sub-command prints "hoplite-gpu: error: ..."."""
    res = subprocess.run([*CLI, "bench", "broadcast", "--workers", "2", "--sizes", "1",
                          "--repeats", "1", "--shared-memory", "on", "--no-save"],
                         env=_env(HOPLITE_CHUNK_SIZE="lots"), capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert res.returncode == 1
    assert "hoplite-gpu: error:" in res.stderr
    assert "Traceback" not in res.stderr, res.stderr[-1500:]


def test_sigterm_to_bench_leaves_no_process_running(tmp_path):
    """`main` installs its SIGTERM-as-Ctrl-C handler only after the `bench`
    branch has returned: `kill` (or `timeout`, a cancelled CI job) ends
    `hoplite-gpu bench` at once without closing its LocalCluster, and the
    worker processes run on (still there 30 s later)."""
    log = open(tmp_path / "bench.out", "w")  # noqa: SIM115
    proc = subprocess.Popen([*CLI, "bench", "broadcast", "--workers", "2", "--sizes", "1",
                             "--repeats", "100000", "--shared-memory", "on", "--no-save"],
                            env=_env(), stdout=log, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while sum("spawn_main" in p for p in _session_pids(proc.pid)) < 2:
            assert proc.poll() is None, (tmp_path / "bench.out").read_text()
            assert time.monotonic() < deadline, "the bench's workers did not start"
            time.sleep(0.1)
        time.sleep(0.5)  # (broadcasting now)
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
        deadline = time.monotonic() + 5
        while (left := _session_pids(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"still running after the bench exited: {left}"
    finally:
        _kill_session(proc)
        log.close()


# ------------------------------------------------------------ timeouts ---
@pytest.mark.parametrize("timeout", [np.float32(2.5), np.int64(30), np.int32(1)])
def test_timeouts_take_numpy_numbers(timeout):
    """`check_timeout` (every `timeout=` of get, the collectives, LocalCluster)
    tests `isinstance(timeout, int | float)`: a NumPy float32 or integer (a
    timeout computed from an array) is refused with "timeout must be a
    positive number of seconds ...; got np.int64(30)", a positive number."""
    assert check_timeout(timeout) == float(timeout)
