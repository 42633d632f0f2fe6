"""The command line as a newcomer uses it: `hoplite-gpu demo`, `calibrate`,
`directory` and `bench` with small or odd arguments and settings, the
HOPLITE_LOG_LEVEL they honour, and interrupted from a terminal or by `kill`.
Each test fails on a confirmed bug."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from hoplite_gpu.config import Config, available_memory

CLI = [sys.executable, "-m", "hoplite_gpu"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MiB = 1 << 20


def _env(**extra: str) -> dict[str, str]:
    """A newcomer's environment: no HOPLITE_* settings but the ones given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOPLITE_")}
    env.update(extra)
    return env


def _run(*args: str, timeout: float = 30, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], env=_env(**extra), capture_output=True, text=True,
                          timeout=timeout)


def _session_pids(sid: int) -> list[str]:
    out = subprocess.run(["ps", "-ww", "-o", "pid=,cmd=", "-s", str(sid)], capture_output=True,
                         text=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


class _Demo:
    """A long demo in a session of its own (as a terminal's foreground job),
    its output in a file (its children may keep a pipe open after it exits)."""

    def __init__(self, tmp_path, **extra: str) -> None:
        self.log = tmp_path / "demo.out"
        self.file = open(self.log, "w")  # noqa: SIM115
        # Ctrl-C as a terminal delivers it: a shell that started these tests in
        # the background left SIGINT ignored, and children inherit that.
        self.proc = subprocess.Popen(
            [*CLI, "demo", "--workers", "3", "--size", "1MiB", "--repeats", "100000"],
            env=_env(**extra), stdout=self.file, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def wait_running(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while "broadcast 1/" not in self.log.read_text():
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "the demo did not start broadcasting"
            time.sleep(0.05)
        time.sleep(0.3)

    def output(self) -> str:
        return self.log.read_text()

    def cleanup(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(5)
        self.file.close()


def test_ctrl_c_during_the_demo_exits_promptly(tmp_path):
    """Ctrl-C in a terminal signals the whole foreground process group, so the
    directory stops too. The demo's main thread then joins its progress
    watcher (demo.py, `_broadcast_round`), which is inside `api.object_info`
    waiting for the gone directory for HOPLITE_TIMEOUT_S: the demo sits there
    for 300 s before it exits."""
    demo = _Demo(tmp_path)
    try:
        demo.wait_running()
        os.killpg(demo.proc.pid, signal.SIGINT)
        try:
            rc = demo.proc.wait(6)
        except subprocess.TimeoutExpired:
            pytest.fail("the demo was still running 6 s after Ctrl-C")
        assert rc == 130
    finally:
        demo.cleanup()


def test_ctrl_c_during_the_demo_prints_no_worker_tracebacks(tmp_path):
    """On Ctrl-C every idle worker process of the demo dies of KeyboardInterrupt
    inside `conn.recv()` (cluster.py, `_worker_main`) and prints a full
    traceback ("Process SpawnProcess-2: Traceback ...") over the screen."""
    demo = _Demo(tmp_path)
    try:
        demo.wait_running()
        os.killpg(demo.proc.pid, signal.SIGINT)
        time.sleep(2)  # (the workers' last words)
        out = demo.output()
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    finally:
        demo.cleanup()


def test_sigterm_to_the_demo_leaves_no_process_running(tmp_path):
    """`kill <pid>` (or `timeout`, a CI job being cancelled) ends the demo's
    process at once, without closing its LocalCluster: the directory
    subprocess runs on for ever, reparented to init, and the workers linger
    until their `get(timeout=600)` gives up."""
    demo = _Demo(tmp_path)
    try:
        demo.wait_running()
        demo.proc.send_signal(signal.SIGTERM)
        demo.proc.wait(15)
        deadline = time.monotonic() + 5
        while (left := _session_pids(demo.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"still running after the demo exited: {left}"
    finally:
        demo.cleanup()


def test_demo_error_in_a_worker_is_one_line_not_a_traceback():
    """A documented, user-caused error (a store limit below the demo's size:
    StoreFull) comes out of `hoplite-gpu demo` as the worker's full traceback,
    some 30 lines of runtime internals after the one line that matters."""
    res = _run("demo", "--workers", "2", "--size", "4MiB", HOPLITE_STORE_BYTES="1MiB")
    assert res.returncode == 1
    assert "StoreFull" in res.stderr
    assert "Traceback" not in res.stderr, res.stderr


def test_demo_size_beyond_memory_is_a_clear_error():
    """`--size 1TiB` is accepted, and the sender's data generation dies of a raw
    NumPy MemoryError (`_ArrayMemoryError: Unable to allocate 1.00 TiB`),
    shown with its traceback; docs/guide-memory.md promises memory the machine cannot
    give is StoreFull, not an error from deep inside NumPy."""
    res = _run("demo", "--workers", "2", "--size", "1TiB")
    assert res.returncode != 0
    assert "MemoryError" not in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_demo_reports_small_sizes_as_they_are():
    """With `--size 100KiB` the demo prints "broadcast 1/1: 0 MiB from worker 0"
    and "point-to-point 0 MiB": sizes are formatted as whole MiB."""
    res = _run("demo", "--workers", "2", "--size", "100KiB")
    assert res.returncode == 0, res.stderr
    assert "0 MiB" not in res.stdout, res.stdout


def _printed_settings(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^(HOPLITE_LINK_\w+)=(\S+)$", stdout, re.M))


@pytest.mark.parametrize("size", ["1KiB", "64KiB"])
def test_calibrate_never_prints_settings_the_config_refuses(size):
    """`calibrate --size` at or below the small probe (the inline threshold + 1)
    divides a negative byte difference: it prints e.g.
    HOPLITE_LINK_BYTES_PER_S=-6.45e+13 with exit 0, which the config then
    refuses ("link_bytes_per_s must be > 0")."""
    res = _run("calibrate", "--size", size, "--repeats", "1")
    if res.returncode != 0:  # refusing the size is fine, if said plainly
        assert "Traceback" not in res.stderr, res.stderr
        return
    settings = _printed_settings(res.stdout)
    assert settings, res.stdout
    Config.from_env(settings)


def test_calibrate_size_equal_to_the_small_probe_is_no_zero_division():
    """`calibrate --size 65537` (the inline threshold + 1, so both probes are one
    size) dies of ZeroDivisionError in calibrate.py with a traceback."""
    res = _run("calibrate", "--size", "65537", "--repeats", "1")
    assert "ZeroDivisionError" not in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_demo_usage_errors_go_to_stderr():
    """`demo --workers 1` said why on stdout, unlike argparse's usage errors."""
    res = _run("demo", "--workers", "1")
    assert res.returncode == 2
    assert "at least 2 workers" in res.stderr and "at least 2 workers" not in res.stdout


def test_bench_runs_the_source_trees_benchmarks_and_says_where_they_are(tmp_path):
    """`hoplite-gpu bench ...` is `python -m benchmarks ...` of the checkout in
    the current directory; elsewhere it says the benchmarks are not installed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    here = subprocess.run([*CLI, "bench", "--help"], capture_output=True, text=True,
                          timeout=60, cwd=root)
    assert here.returncode == 0, here.stderr
    assert "emulated" in here.stdout and "python -m benchmarks" in here.stdout
    away = subprocess.run([*CLI, "bench", "broadcast"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert away.returncode == 2
    assert "source checkout" in away.stderr and "Traceback" not in away.stderr


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_directory_port_out_of_range_is_an_argument_error(port):
    """`hoplite-gpu directory --port 70000` printed a generated token and then
    a ConnectionRefused traceback: a port outside 0-65535 is refused by the
    argument parser, before anything starts."""
    r = subprocess.run([sys.executable, "-m", "hoplite_gpu", "directory", "--port", port],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "argument --port" in r.stderr, r.stderr
    assert "token" not in r.stdout and "Traceback" not in r.stderr


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def _close_stdin() -> None:
    os.close(0)


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


def test_calibrate_size_beyond_memory_is_a_clear_error():
    """`calibrate --size 1024TiB` is accepted, and the worker dies of NumPy's
    MemoryError ("Unable to allocate ...") shown with its traceback, where
    `demo` with such a size says how much memory it needs and is free."""
    res = subprocess.run([*CLI, "calibrate", "--size", "1024TiB", "--repeats", "1"],
                         env=_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "MemoryError" not in res.stderr and "Traceback" not in res.stderr, res.stderr[-1500:]


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


def test_the_demo_counts_reclaimable_page_cache_as_available_memory(monkeypatch):
    """`run_demo` refuses a size beyond "free memory", measured as
    SC_AVPHYS_PAGES, which is MemFree: memory the page cache holds, which
    the kernel hands out on demand, counts as used. On a machine that has
    read a few GB of files MemFree is small while MemAvailable is large, and
    the default 256 MiB demo is refused although there is room for it."""
    from hoplite_gpu import demo

    if available_memory() < 4 << 30:
        pytest.skip("needs 4 GiB available to tell the two measures apart")
    real = os.sysconf

    def sysconf(name):  # a page-cache-heavy host: 100 MiB free, the rest cached
        if name == "SC_AVPHYS_PAGES":
            return (100 * MiB) // real("SC_PAGE_SIZE")
        return real(name)

    class Started(Exception):
        pass

    def no_cluster(*args, **kwargs):
        raise Started  # (the check was passed; no cluster is needed to show it)

    monkeypatch.setattr(os, "sysconf", sysconf)
    monkeypatch.setattr(demo, "LocalCluster", no_cluster)
    with pytest.raises(Started):
        demo.run_demo(num_workers=2, size=256 * MiB)
