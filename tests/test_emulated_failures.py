"""Failures in the emulated multi-host harness (benchmarks/emulated.py,
netbench.py, emurun.py): clean-up after an interrupt at awkward moments,
refusal of bad link settings, a rank dying mid-launch, and what the results
claim. Tests that need network namespaces make them only through the
harness's own context manager (2 hosts), remove only what that cluster made,
and skip with the reason where namespaces cannot be created."""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import threading
import time

import pytest
from rich.console import Console

from benchmarks import emulated, emurun
from benchmarks.emulated import EmulatedCluster, EmulationUnavailable


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _root_link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", "dev", name], capture_output=True,
                          check=False).returncode == 0


def _interrupt_once(monkeypatch, matches) -> None:
    """Make the harness's command runner raise KeyboardInterrupt (a Ctrl-C, or
    SIGTERM turned into one by emurun) instead of running the first command
    that `matches`; every other command runs for real."""
    real, fired = emulated._sh, []

    def sh(*argv: str, check: bool = True):
        if not fired and matches(argv):
            fired.append(argv)
            raise KeyboardInterrupt("simulated Ctrl-C")
        return real(*argv, check=check)

    monkeypatch.setattr(emulated, "_sh", sh)


def _interrupted_start(monkeypatch, cluster: EmulatedCluster, after) -> None:
    """Open `cluster` with a Ctrl-C in place of the first command that follows
    one that `after` matches; skips where namespaces cannot be made."""
    seen: list[tuple[str, ...]] = []
    _interrupt_once(monkeypatch, lambda a: (seen.append(a), len(seen) > 1 and after(seen[-2]))[1])
    try:
        with pytest.raises(KeyboardInterrupt), cluster:
            pass
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    monkeypatch.undo()


def _reopen(cluster_bw: float = 1e9) -> None:
    """A fresh cluster in this same process must open and close cleanly."""
    with EmulatedCluster(2, cluster_bw):
        pass


# --------------------------------------------------------- clean-up on Ctrl-C ---
@pytest.mark.timeout(60)
def test_interrupt_between_veth_creation_and_move_leaves_no_veth(monkeypatch):
    # _build made the veth pair in the root namespace, then moved each end into
    # its namespace; close() only deletes namespaces, so a Ctrl-C in between
    # left hg<tag>h0/hg<tag>s0 in the root namespace, and the next cluster of
    # this process failed with "RTNETLINK answers: File exists". Interrupted
    # at the first command after the pair is made:
    cluster = EmulatedCluster(2, 1e9)
    host_if, sw_if = f"{cluster.prefix}h0", f"{cluster.prefix}s0"
    _interrupted_start(monkeypatch, cluster, lambda before: before[:3] == ("ip", "link", "add"))
    try:
        leaked = [n for n in (host_if, sw_if) if _root_link_exists(n)]
        assert not leaked, f"veths left in the root namespace after Ctrl-C: {leaked}"
        assert not [ns for ns in _namespaces() if ns.startswith(cluster.prefix)]
        _reopen()
    finally:
        if _root_link_exists(host_if):  # made by the cluster above: ours to remove
            subprocess.run(["ip", "link", "del", host_if], capture_output=True, check=False)


@pytest.mark.timeout(60)
def test_interrupt_during_the_namespace_probe_leaves_no_probe(monkeypatch):
    # _check adds hg<tag>probe then deletes it; close() does not know about it,
    # so a Ctrl-C in between leaves it, and every later cluster of this process
    # is refused with "this machine does not allow creating network namespaces"
    # (its `ip netns add` of the probe now fails with "File exists").
    cluster = EmulatedCluster(2, 1e9)
    probe = f"{cluster.prefix}probe"
    _interrupted_start(monkeypatch, cluster, lambda before: before == ("ip", "netns", "add", probe))
    try:
        assert probe not in _namespaces(), "the probe namespace outlived the interrupted start"
        _reopen()
    finally:
        if probe in _namespaces():  # made by the cluster above: ours to remove
            subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)


def _tracking_popen(monkeypatch, cluster: EmulatedCluster, *, interrupt_at: int | None = None):
    """Record every process the cluster starts; optionally raise KeyboardInterrupt
    in place of the `interrupt_at`-th start (1-based)."""
    started: list[subprocess.Popen] = []
    real = cluster.popen

    def popen(i, argv, **kw):
        if interrupt_at is not None and len(started) + 1 == interrupt_at:
            raise KeyboardInterrupt("simulated Ctrl-C")
        p = real(i, argv, **kw)
        started.append(p)
        return p

    monkeypatch.setattr(cluster, "popen", popen)
    return started


def _reap(procs: list[subprocess.Popen]) -> None:
    for p in procs:  # only processes this test's cluster started
        if p.poll() is None:
            p.kill()
        p.wait(10)
        for pipe in (p.stdin, p.stdout):
            if pipe is not None and not pipe.closed:
                try:
                    pipe.close()
                except BrokenPipeError:
                    pass


@pytest.mark.timeout(60)
def test_interrupted_link_measurement_stops_its_processes(monkeypatch):
    # measure_link starts a sink on host 1, then the source on host 0, with no
    # try/finally: a Ctrl-C (or emurun's SIGTERM -> KeyboardInterrupt) while
    # the source starts leaves the sink blocked in accept() for ever, holding
    # its host's namespace alive after the cluster "cleaned up".
    cluster = EmulatedCluster(2, 1e9)
    try:
        with cluster:
            started = _tracking_popen(monkeypatch, cluster, interrupt_at=2)
            with pytest.raises(KeyboardInterrupt):
                cluster.measure_link(1 << 20)
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    try:
        assert started, "measure_link started nothing"
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and any(p.poll() is None for p in started):
            time.sleep(0.05)
        alive = [p.args for p in started if p.poll() is None]
        assert not alive, f"processes of the interrupted measurement still running: {alive}"
    finally:
        _reap(started)


@pytest.mark.timeout(60)
def test_link_measurement_does_not_hang_when_the_sink_starts_slowly(monkeypatch):
    # The source is started a fixed 0.5 s after the sink. If the sink's Python
    # takes longer than that to listen (a loaded 2-core VM, another run beside
    # it), the source dies with ConnectionRefusedError, its exit status is not
    # looked at, and measure_link waits 120 s on a sink that will never be
    # connected to (then TimeoutExpired, the sink left running). It should wait
    # for the sink to listen, or fail promptly.
    monkeypatch.setattr(emulated, "_SINK", "import time; time.sleep(1.5)\n" + emulated._SINK)
    cluster = EmulatedCluster(2, 1e9)
    result: dict = {}
    try:
        with cluster:
            started = _tracking_popen(monkeypatch, cluster)

            def measure() -> None:
                try:
                    result["bps"] = cluster.measure_link(1 << 20)
                except BaseException as exc:  # noqa: BLE001 (reported below)
                    result["error"] = exc

            t = threading.Thread(target=measure, daemon=True)
            t.start()
            t.join(6)
            hung = t.is_alive()
            _reap(started)  # unblocks a hung measurement
            t.join(10)
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    assert not hung, "measure_link still waiting 6 s after a sink that started 1.5 s late"


# ------------------------------------------------------------- bad settings ---
@pytest.mark.timeout(60)
@pytest.mark.parametrize("bandwidth_bps", [0.0, -1e9])
def test_non_positive_bandwidth_is_refused(bandwidth_bps):
    # --gbit 0 fails deep in _build with a CalledProcessError from tc ("rate"
    # is mandatory) after namespaces were made; --gbit -1 is worse: tc takes
    # "-1000000000bit" as an unsigned 18446744 Tbit/s, the links are silently
    # unshaped and every lower bound and ratio comes out negative.
    try:
        with pytest.raises(ValueError), EmulatedCluster(2, bandwidth_bps):
            pass
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("rates, why", [([1e9], "one rate per host"),
                                        ([1e9, 0.0], "at least 1000 bit/s"),
                                        ([1e9, -1e9], "at least 1000 bit/s")])
def test_per_host_rates_are_checked_before_anything_is_made(rates, why):
    # (refused in the constructor: no namespace is made, so no skip is needed)
    with pytest.raises(ValueError, match=why):
        EmulatedCluster(2, 1e9, rates_bps=rates)


# ------------------------------------------------- emurun with stand-in hosts ---
_DIRECTORY = "import sys, time; print('listening', flush=True); time.sleep(60)"
_NODE_OK = ("import json, sys; print(json.dumps({'ready': True}), flush=True); "
            "sys.stdin.readline(); sys.stdin.read()")
# a rank that dies right after saying ready (killed by the OOM killer, a crash):
# its end of the pipe is gone before the harness sends the start time
_NODE_DIES = "import json, os; os.close(0); print(json.dumps({'ready': True}), flush=True)"


class _StandInHosts:
    """What emurun and netbench use of an EmulatedCluster, with each 'host'
    process run as plain local Python (no namespaces, no network)."""

    swept: list[str] = []

    def __init__(self, hosts: int, bandwidth_bps: float) -> None:
        self.hosts, self.bandwidth_bps = hosts, bandwidth_bps
        self.procs: list[subprocess.Popen] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        _reap(self.procs)

    def measure_link(self, nbytes: int = 0) -> float:
        return self.bandwidth_bps

    def address(self, i: int) -> str:
        return f"10.255.0.{i + 1}"

    def link_counters(self) -> list[tuple[int, int, int, int]]:
        return [(0, 0, 0, 0)] * self.hosts

    def popen(self, i: int, argv, **kw) -> subprocess.Popen:
        if "directory" in argv:
            code = _DIRECTORY
        else:
            code = _NODE_DIES if i == self.hosts - 1 else _NODE_OK
        p = subprocess.Popen([sys.executable, "-c", code], **kw)
        self.procs.append(p)
        return p


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    emurun.add_arguments(p)
    return p.parse_args(["--hosts", "2", "--ops", "broadcast", "--sizes", "4K",
                         "--systems", "hoplite-gpu", *argv])


def _run(monkeypatch, args: argparse.Namespace) -> dict:
    monkeypatch.setattr(emulated, "EmulatedCluster", _StandInHosts)
    monkeypatch.setattr(emurun, "_stop_on_signals", lambda: None)  # keep pytest's handlers
    return emurun.run(args, Console(file=io.StringIO(), width=200))


@pytest.mark.timeout(30)
def test_a_rank_dying_after_ready_is_a_failed_launch_not_a_crash(monkeypatch):
    # hoplite_run writes the start time to every node's stdin; a node gone by
    # then raises BrokenPipeError (an OSError), which the retry loop does not
    # catch: the whole run aborts with a traceback and nothing is saved,
    # instead of the launch being listed under "failed" as a rank that exits
    # before saying ready is.
    result = _run(monkeypatch, _args("--retries", "0"))
    assert result["rows"] == []
    assert len(result["failed"]) == 1, result["failed"]
    assert result["failed"][0]["system"] == "hoplite-gpu"
    assert result["byte_identical"] is False


@pytest.mark.timeout(30)
def test_a_wrong_result_on_a_retried_attempt_still_marks_the_run(monkeypatch):
    # A launch whose result was wrong (the exact check failed) is retried like
    # a flaky start; when the retry is right the run reports byte_identical
    # true and `python -m benchmarks emulated` exits 0, although one attempt
    # delivered wrong bytes.
    calls = []

    def measure(cluster, system, op, size, tag, args):
        calls.append(tag)
        if len(calls) == 1:
            raise AssertionError(f"{system} {op}: wrong result on rank(s) [1]")
        return {"system": system, "op": op, "hosts": cluster.hosts, "size_bytes": size,
                "bandwidth_bps": cluster.bandwidth_bps, "iters": 1, "samples_s": [0.01],
                "seconds": 0.01, "lower_bound_s": 0.005, "ratio_to_bound": 2.0,
                "late_calls": 0, "cpu": None, "cpu_s_per_call": None}

    monkeypatch.setattr(emurun, "_measure", measure)
    result = _run(monkeypatch, _args("--retries", "1"))
    assert len(calls) == 2 and len(result["rows"]) == 1
    assert result["rows"][0]["failed_attempts"], "the wrong result was not kept"
    assert result["byte_identical"] is False, "a wrong result was retried away"
