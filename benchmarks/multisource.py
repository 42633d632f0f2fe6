"""`python -m benchmarks multisource`: one receiver pulling a large object held
complete by several hosts, from all of them at once (the directory's default)
against one sender (`HOPLITE_MAX_SOURCES=1`), and with one holder killed
midway, on emulated hosts (benchmarks/emulated.py: network namespaces, links
shaped with tc; needs root).

Hosts: 0 runs the directory and a watching node, on a link of its own
(`--directory-gbit`, fast), so that no control message queues behind the
measured bytes on a holder's or the receiver's host, and the watcher's queries
cross no measured link; 1..H are the holders (`--holder-gbit` each); H+1 is
the receiver (`--receiver-gbit`). Rates are in units of `--unit-mbit` Mbit/s
(1000: Gbit/s), so they can be scaled down until the machine's cores are not
what limits.

Every launch starts a fresh directory and fresh nodes (`benchmarks/msnode.py`,
JSON lines on stdin and stdout, as `benchmarks/netnode.py`): the mode is the
directory's environment (single: `HOPLITE_MAX_SOURCES=1`). Holder 1 puts a
deterministic array (`payload.make_input`), holders 2..H get it, and once the
directory knows H complete copies serving nobody the receiver gets it, timed
from the call to its return, and checked exactly against the input
(`payload.check`) and by CRC32 against holder 1's. In the kill mode the
watcher waits until the directory says the receiver has `--kill-at` of the
object (its progress reports come every 0.1 s) and the harness then SIGKILLs
the last holder's process (not the origin's). Launches are interleaved per
repeat: multi, single, kill.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import statistics
import subprocess
import threading
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from hoplite_gpu.auth import new_token
from hoplite_gpu.config import available_memory

from .args import at_least, seconds
from .args import size as parse_bytes
from .emulated import PY
from .emurun import _stop_on_signals, fmt_s, human, parse_size
from .netbench import ROOT, CpuSampler

MODES = ("multi", "single", "kill")
#: What the acceptance asks: multi <= 1/2.7 of single, kill <= 1.5 x multi
TARGET_MULTI_TO_SINGLE = 1 / 2.7
TARGET_KILL_TO_MULTI = 1.5
#: Whole-machine CPU busy (all cores) above which a timed get is flagged:
#: the time may then be the cores', not the links'
NEAR_SATURATION = 0.9
PORT = 7777


# ------------------------------------------------------------- processes ---
class _Process:
    """A process on an emulated host whose stdout is read, line by line, by a
    thread of its own, so that every read has a deadline."""

    def __init__(self, popen: subprocess.Popen, what: str, host: int) -> None:
        self.popen, self.what, self.host = popen, what, host
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"{what}-stdout", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            for line in self.popen.stdout:
                self._lines.put(line)
        self._lines.put(None)

    def line(self, timeout: float) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.what} said nothing within {timeout:g}s") from None
        if line is None:
            self._lines.put(None)  # (every later read sees the end too)
            raise RuntimeError(f"{self.what} exited (code {self.popen.wait(10)})")
        return line

    def send(self, **command: Any) -> None:
        try:
            self.popen.stdin.write(json.dumps(command) + "\n")
            self.popen.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise RuntimeError(f"{self.what} exited before the command "
                               f"{command.get('op')!r} (code {self.popen.wait(10)})") from None

    def answer(self, timeout: float) -> dict:
        got = json.loads(self.line(timeout))
        if "error" in got:
            raise RuntimeError(f"{self.what}: {got['error']}")
        return got

    def ask(self, timeout: float, **command: Any) -> dict:
        """Send a command (it is given `timeout` to do its work) and wait for
        its answer a little longer than that."""
        self.send(timeout=timeout, **command)
        return self.answer(timeout + 30)

    def end_input(self) -> None:
        """Close its stdin: a node shuts down, the directory stops."""
        with contextlib.suppress(OSError, ValueError):
            self.popen.stdin.close()

    def close(self, grace: float = 30.0) -> None:
        """End it (`end_input`); after `grace` seconds it is killed."""
        self.end_input()
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
        self._reader.join(10)
        self.popen.stdout.close()


class _Launch:
    """One directory and one node per role on the emulated hosts; closes them all."""

    def __init__(self, cluster, holders: int) -> None:
        self.cluster, self.holders = cluster, holders
        self.procs: list[_Process] = []
        self.node_ids: dict[str, str] = {}

    def start(self, env: dict[str, str], directory_env: dict[str, str],
              timeout: float) -> None:
        """Start the directory, then every node, and wait until each said it is
        ready, within `timeout` seconds in all (`close` stops what started)."""
        cluster = self.cluster
        self.directory = self._start(0, "the directory", [
            PY, "-m", "hoplite_gpu", "directory", "--host", cluster.address(0), "--port",
            str(PORT), "--until-stdin-closes"], {**env, **directory_env})
        deadline = time.monotonic() + timeout
        while "listening on" not in self.directory.line(max(0.0, deadline - time.monotonic())):
            pass
        self.watcher = self._node(0, "the watcher", env)
        self.holder = [self._node(1 + k, f"holder {1 + k}", env) for k in range(self.holders)]
        self.receiver = self._node(self.holders + 1, "the receiver", env)
        for proc in (self.watcher, *self.holder, self.receiver):
            ready = json.loads(proc.line(max(0.0, deadline - time.monotonic())))
            if ready.get("host") != cluster.address(proc.host):
                raise RuntimeError(f"{proc.what} runs on {ready.get('host')!r}, not on host "
                                   f"{proc.host} ({cluster.address(proc.host)})")
            self.node_ids[proc.what] = ready["node"]

    def _start(self, host: int, what: str, argv: list[str], env: dict[str, str]) -> _Process:
        popen = self.cluster.popen(host, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True, env=env, cwd=ROOT)
        proc = _Process(popen, what, host)
        self.procs.append(proc)
        return proc

    def _node(self, host: int, what: str, env: dict[str, str]) -> _Process:
        return self._start(host, what, [
            PY, "-m", "benchmarks.msnode", "--address", f"{self.cluster.address(0)}:{PORT}",
            f"--token={env['HOPLITE_TOKEN']}", "--node-host", self.cluster.address(host)], env)

    def close(self) -> None:
        # The nodes leave first, all at once, then the directory stops.
        for proc in self.procs[1:]:
            proc.end_input()
        for proc in reversed(self.procs):
            proc.close()


# ------------------------------------------------------------- one launch ---
def launch(cluster, mode: str, args: argparse.Namespace, name: str, cpu: CpuSampler) -> dict:
    """One timed get of `args.size` bytes by the receiver in `mode` (MODES)."""
    token = new_token()
    env = {**os.environ, "PYTHONPATH": ROOT, "HOPLITE_TOKEN": token}
    directory_env = {}
    if mode == "single":
        directory_env["HOPLITE_MAX_SOURCES"] = "1"
    if args.multi_source_bytes is not None:
        directory_env["HOPLITE_MULTI_SOURCE_BYTES"] = str(args.multi_source_bytes)
    size, h, wait = args.size, args.holders, args.timeout
    run = _Launch(cluster, h)
    try:
        run.start(env, directory_env, wait)
        original = run.holder[0].ask(wait, op="put", name=name, size=size)["crc"]
        for proc in run.holder[1:]:  # at once: the directory chains them
            proc.send(op="get", name=name, size=size, timeout=wait)
        for proc in run.holder[1:]:
            got = proc.answer(wait + 30)
            if not got["ok"] or got["crc"] != original:
                raise AssertionError(f"{proc.what}'s copy differs from the original")
        run.watcher.ask(wait, op="complete", name=name, count=h)
        receiver = run.node_ids["the receiver"]
        before = cluster.link_counters()
        run.receiver.send(op="get", name=name, size=size, timeout=wait)
        killed = None
        if mode == "kill":
            killed = _kill_midway(run, cluster, name, receiver, before, args)
        got = run.receiver.answer(wait + 30)
        after = cluster.link_counters()
        if killed is not None and killed["at"] >= got["end"]:
            raise AssertionError(
                "the holder was killed after the receiver's get had returned: the pull was "
                "done before a progress report (every 0.1 s, from a piece that takes that "
                "long) showed it: use a larger --size or lower rates")
        info = run.watcher.ask(wait, op="info", name=name)
        failovers = run.receiver.ask(wait, op="failovers")["failovers"]
    finally:
        run.close()
    moved = [[a - b for a, b in zip(x, y, strict=True)] for x, y in zip(after, before, strict=True)]
    down = moved[h + 1][0]
    if down < size:
        raise AssertionError(f"only {down} bytes crossed the receiver's link, fewer than the "
                             f"object's {size}: some went another way")
    holder_ids = [run.node_ids[p.what] for p in run.holder]
    # (holders by number, 1..H, in the order the directory named them)
    named = list(dict.fromkeys(holder_ids.index(n) + 1 for r, n in info["edges"]
                               if r == receiver and n in holder_ids))
    return {"mode": mode, "size_bytes": size, "seconds": got["end"] - got["start"],
            "byte_identical": bool(got["ok"] and got["crc"] == original),
            "crc": got["crc"], "crc_original": original,
            "receiver_link_bytes": down,
            "holder_uplink_bytes": [moved[1 + k][1] for k in range(h)],
            "senders_named": named, "killed": killed,
            "failovers_s": [b - a for a, b in failovers],
            "cpu": cpu.window(got["start"], got["end"])}


def _kill_midway(run: _Launch, cluster, name: str, receiver: str, before, args) -> dict:
    """SIGKILL the last holder's process once the directory says the receiver
    has `args.kill_at` of the object; what it had then, and what had crossed
    the receiver's link just after the kill."""
    victim = run.holder[-1]
    seen = run.watcher.ask(args.timeout, op="reach", name=name, node=receiver,
                           nbytes=int(args.kill_at * args.size))
    os.kill(victim.popen.pid, signal.SIGKILL)
    at = time.time()
    now = cluster.link_counters()
    h = run.holders
    return {"holder": h, "at": at, "reported_fraction": seen["nbytes"] / args.size,
            "link_fraction": (now[h + 1][0] - before[h + 1][0]) / args.size,
            "victim_sent_fraction": (now[h][1] - before[h][1]) / args.size,
            "seen_to_kill_s": at - seen["seen"]}


# ------------------------------------------------------------- the run ---
def bounds(args: argparse.Namespace, kill_at: float | None = None) -> dict:
    """Least times: all senders at once are held to S / the receiver's rate
    (or to S / the holders' summed rate, if that is less); one sender to S /
    its own rate; with a holder lost at `kill_at` (default `args.kill_at`) of
    the object, the rest at the survivors'."""
    kill_at = args.kill_at if kill_at is None else min(1.0, kill_at)
    s = args.size * 8
    unit = args.unit_mbit * 1e6
    recv, hold = args.receiver_gbit * unit, args.holder_gbit * unit
    multi = s / min(recv, args.holders * hold)
    after = s / min(recv, (args.holders - 1) * hold) if args.holders > 1 else float("inf")
    return {"receiver_bps": recv, "holder_bps": hold, "multi_s": multi,
            "single_s": s / min(recv, hold), "s_over_receiver_s": s / recv,
            "s_over_holder_s": s / hold,
            "kill_s": kill_at * multi + (1 - kill_at) * after}


def row_bound(row: dict, args: argparse.Namespace) -> float:
    """A launch's least time; a kill's at the share that had crossed the
    receiver's link when the holder died (`killed.link_fraction`)."""
    killed = row.get("killed")
    return bounds(args, killed["link_fraction"] if killed else None)[f"{row['mode']}_s"]


def summarize(rows: list[dict], args: argparse.Namespace) -> dict:
    out: dict[str, Any] = {"modes": {}}
    for mode in MODES:
        rs = [r for r in rows if r["mode"] == mode]
        if not rs:
            continue
        samples = [r["seconds"] for r in rs]
        busy = [r["cpu"]["busy"] for r in rs if r.get("cpu")]
        out["modes"][mode] = {
            "n": len(rs), "median_s": statistics.median(samples), "samples_s": samples,
            "min_s": min(samples), "max_s": max(samples),
            "bound_s": statistics.median(row_bound(r, args) for r in rs),
            "cpu_busy_median": statistics.median(busy) if busy else None,
            "cpu_busy_max": max(busy) if busy else None}
    med = {m: e["median_s"] for m, e in out["modes"].items()}
    out["bounds"] = bounds(args)
    out["ratio_to_bound"] = {m: e["median_s"] / e["bound_s"] for m, e in out["modes"].items()}
    out["ratio_single_to_multi"] = (med["single"] / med["multi"]
                                    if {"single", "multi"} <= med.keys() else None)
    out["ratio_multi_to_single"] = (med["multi"] / med["single"]
                                    if {"single", "multi"} <= med.keys() else None)
    out["ratio_kill_to_multi"] = (med["kill"] / med["multi"]
                                  if {"kill", "multi"} <= med.keys() else None)
    out["targets"] = {"multi_to_single_at_most": TARGET_MULTI_TO_SINGLE,
                      "kill_to_multi_at_most": TARGET_KILL_TO_MULTI}
    identical = all(r["byte_identical"] for r in rows)
    out["pass_multi"] = (out["ratio_multi_to_single"] is not None and identical
                         and out["ratio_multi_to_single"] <= TARGET_MULTI_TO_SINGLE)
    out["pass_kill"] = (out["ratio_kill_to_multi"] is not None and identical
                        and out["ratio_kill_to_multi"] <= TARGET_KILL_TO_MULTI)
    busy = [r["cpu"]["busy"] for r in rows if r.get("cpu")]
    out["cpu_near_saturation"] = sum(x >= NEAR_SATURATION for x in busy)
    return out


def run(args: argparse.Namespace, console: Console) -> dict:
    from .emulated import EmulatedCluster

    _stop_on_signals()
    b = bounds(args)
    h = args.holders
    need = int((h + 2) * args.size * 1.1) + (h + 3) * (200 << 20)
    if need > 0.85 * available_memory():
        raise SystemExit(f"multisource: {human(args.size)} on {h} holders needs about "
                         f"{need / 2**30:.1f} GiB, {available_memory() / 2**30:.1f} GiB "
                         "available: use a smaller --size")
    rates = [args.directory_gbit * args.unit_mbit * 1e6, *[b["holder_bps"]] * h, b["receiver_bps"]]
    rows: list[dict] = []
    failed: list[dict] = []
    with EmulatedCluster(h + 2, b["holder_bps"], rates_bps=rates) as cluster, CpuSampler() as cpu:
        if cluster.swept:
            console.print(f"removed {len(cluster.swept)} namespaces left by an earlier run that "
                          f"was killed: {', '.join(cluster.swept)}")
        measured = _measure_links(cluster, b, console)
        for r in range(args.repeats):
            for mode in MODES:
                name = f"ms-{r}-{mode}"
                t = time.monotonic()
                try:
                    row = launch(cluster, mode, args, name, cpu)
                except (RuntimeError, AssertionError, TimeoutError, subprocess.SubprocessError,
                        ValueError, OSError) as exc:  # a launch that failed: said and kept
                    error = f"{type(exc).__name__}: {str(exc)[-600:]}"
                    failed.append({"mode": mode, "repeat": r, "error": error})
                    console.print(f"[red]repeat {r} {mode} failed: {error[:300]}[/]")
                    continue
                row.update(repeat=r, launch_wall_s=time.monotonic() - t,
                           lower_bound_s=row_bound(row, args))
                rows.append(row)
                _say(console, row)
    summary = summarize(rows, args)
    console.print(table(summary, args))
    _verdict(console, summary, rows)
    settings = {"size_bytes": args.size, "holders": h, "unit_mbit": args.unit_mbit,
                "receiver_bps": b["receiver_bps"], "holder_bps": b["holder_bps"],
                "directory_bps": rates[0], "repeats": args.repeats, "kill_at": args.kill_at,
                "multi_source_bytes": args.multi_source_bytes, "timeout_s": args.timeout,
                "measured_bps": measured,
                "hosts": {"directory and watcher": 0, "holders": list(range(1, h + 1)),
                          "receiver": h + 1},
                "killed_holder": h}
    return {"benchmark": "multisource", "settings": settings, "rows": rows, "summary": summary,
            "failed": failed,
            "byte_identical": not failed and all(r["byte_identical"] for r in rows)}


def _measure_links(cluster, b: dict, console: Console) -> dict:
    """Each kind of link's rate as a plain TCP stream measures it, from the
    directory's fast host: a holder's and the receiver's."""
    out = {}
    for what, dst, bps in (("holder", 1, b["holder_bps"]),
                           ("receiver", cluster.hosts - 1, b["receiver_bps"])):
        nbytes = max(1 << 20, int(bps / 8 * 0.25))  # about a quarter of a second
        out[what] = cluster.measure_link(nbytes, src=0, dst=dst)
        console.print(f"{what} link shaped to {bps / 1e6:g} Mbit/s: measured "
                      f"{out[what] / 1e6:.0f} Mbit/s")
    return out


def _say(console: Console, row: dict) -> None:
    cpu = row["cpu"]
    line = (f"repeat {row['repeat']} {row['mode']}: {fmt_s(row['seconds'])} "
            f"({row['seconds'] / row['lower_bound_s']:.2f} x bound), senders named: "
            f"{row['senders_named']}, holders sent "
            + ", ".join(f"{x / row['size_bytes']:.0%}" for x in row["holder_uplink_bytes"])
            + ("" if cpu is None else f", CPU busy {cpu['busy']:.0%}")
            + ("" if row["byte_identical"] else " [red]BYTES DIFFER[/]"))
    if row["killed"]:
        k = row["killed"]
        line += (f"; holder {k['holder']} killed when the directory said "
                 f"{k['reported_fraction']:.0%} ({k['link_fraction']:.0%} had crossed the "
                 f"receiver's link, {k['victim_sent_fraction']:.0%} from holder {k['holder']}), "
                 "failover: " + (", ".join(fmt_s(x) for x in row["failovers_s"]) or "none seen"))
    console.print(line)


def table(summary: dict, args: argparse.Namespace) -> Table:
    b = summary["bounds"]
    t = Table(title=f"{human(args.size)} to a receiver at {b['receiver_bps'] / 1e6:g} Mbit/s "
                    f"from {args.holders} holders at {b['holder_bps'] / 1e6:g} Mbit/s each")
    t.caption = ("bound: the links' least time (kill: the median of each launch's, at the "
                 "share received when the holder died); CPU: the whole machine's cores busy "
                 "during the timed get (median)")
    for col in ("mode", "n", "median", "min", "max", "bound", "x bound", "CPU"):
        t.add_column(col, justify="right", no_wrap=True)
    for mode, e in summary["modes"].items():
        t.add_row(mode, str(e["n"]), fmt_s(e["median_s"]), fmt_s(e["min_s"]),
                  fmt_s(e["max_s"]), fmt_s(e["bound_s"]),
                  f"{summary['ratio_to_bound'][mode]:.2f}",
                  "-" if e["cpu_busy_median"] is None else f"{e['cpu_busy_median']:.0%}")
    return t


def _verdict(console: Console, summary: dict, rows: list[dict]) -> None:
    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    ok = {True: "[green]pass[/]", False: "[red]FAIL[/]"}
    b = summary["bounds"]
    console.print(f"bounds: S / receiver link {fmt_s(b['s_over_receiver_s'])}, S / holder "
                  f"link {fmt_s(b['s_over_holder_s'])} (single)")
    console.print(f"multi / single: {fmt(summary['ratio_multi_to_single'])} "
                  f"(target <= {TARGET_MULTI_TO_SINGLE:.3f}; single / multi "
                  f"{fmt(summary['ratio_single_to_multi'])}): {ok[summary['pass_multi']]}")
    console.print(f"kill / no kill: {fmt(summary['ratio_kill_to_multi'])} "
                  f"(target <= {TARGET_KILL_TO_MULTI}): {ok[summary['pass_kill']]}")
    if not all(r["byte_identical"] for r in rows):
        console.print("[red]some receiver's bytes differ from the original[/]")
    alone = [r["repeat"] for r in rows if r["mode"] != "single" and len(r["senders_named"]) < 2]
    if alone:
        console.print(f"[red]in repeat(s) {alone} the directory named one sender where several "
                      "were wanted: is the object below HOPLITE_MULTI_SOURCE_BYTES?[/]")
    hot = summary["cpu_near_saturation"]
    if hot:
        console.print(f"[yellow]CPU near saturation (>= {NEAR_SATURATION:.0%} of all cores busy) "
                      f"in {hot} of {len(rows)} timed gets: those times may be the cores', not "
                      "the links'; rerun with a smaller --unit-mbit[/]")
    else:
        console.print(f"CPU below {NEAR_SATURATION:.0%} busy in every timed get")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", type=parse_size, default=parse_size("256M"),
                   help="object size, binary units (256M, 1G; a bare number is MiB)")
    p.add_argument("--receiver-gbit", type=seconds(0.0, above=True), default=3.0,
                   help="the receiver's link, in units of --unit-mbit Mbit/s")
    p.add_argument("--holder-gbit", type=seconds(0.0, above=True), default=1.0,
                   help="each holder's link, in units of --unit-mbit Mbit/s")
    p.add_argument("--directory-gbit", type=seconds(0.0, above=True), default=10.0,
                   help="the directory's host's link (control traffic only)")
    p.add_argument("--unit-mbit", type=seconds(0.001), default=1000.0,
                   help="Mbit/s per unit of the rates above: 1000 (Gbit/s) or less, so that "
                        "the machine's cores are not what limits")
    p.add_argument("--holders", type=at_least(2), default=3)
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--kill-at", type=_fraction, default=1 / 3,
                   help="share of the object the receiver has when a holder is killed")
    p.add_argument("--multi-source-bytes", type=parse_bytes, default=None,
                   help="the directory's HOPLITE_MULTI_SOURCE_BYTES (default: its own, 16 MiB)")
    p.add_argument("--timeout", type=seconds(1.0), default=600.0,
                   help="seconds any one step of a launch may take")
    p.add_argument("--json", action="store_true",
                   help="also print the result (as saved) on stdout as one line of JSON")


def _fraction(text: str) -> float:
    value = seconds(0.0, above=True)(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be below 1; got {text}")
    return value
