"""`python -m benchmarks channel`: new weights from a learner to N-1 actors on
emulated hosts (benchmarks/emulated.py: network namespaces, links shaped with
tc; needs root), from the publish call to the last actor holding them, with
each system side by side:

- `hoplite`: `WeightChannel.publish` on host 0, `fetch` on every other host
  (the actors wait for the version before it is published); `hoplite-out`:
  the same, each actor fetching into arrays it made once (`fetch(out=...)`);
  `hoplite-kill`: the same as `hoplite`, with one actor SIGKILLed mid-fetch
  while another pulls from it (a relay of the chain; the others' time is
  what counts), then started again to fetch as a late joiner; `hoplite-get`:
  the yardstick, the same bytes as one plain array (`hg.put` on host 0,
  `hg.get` on every other host): what the channel adds to a broadcast.
- `ray`: Ray's object store (`ray.put` in a learner actor, `ray.get` in one
  actor per host, one Ray node per host: benchmarks/rayemu.py), with the
  pull timeout of `rayemu.TUNED` (Ray's default re-sends bytes on these links).
- `gloo`: torch.distributed (Gloo) broadcasting the state dict tensor by
  tensor.

The state dict (`benchmarks/weights.py`) is float32 tensors of mixed sizes, 4
KiB to 64 MiB (766 tensors at 256 MiB), version v's values depending on v;
every actor's copy is checked by CRC32 against the learner's. Each system
moves `--warmup` untimed versions (3: with the channel's keep=2 a node
holds two versions while the next arrives, so the fourth is the first
whose buffers it has had before; fresh memory is slow on first touch on
some machines, `python -m benchmarks machine`), then `--repeats` timed
ones; the first version's time is reported apart. The bound is S/B, the
state dict's bits over one link's rate.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from hoplite_gpu.auth import new_token
from hoplite_gpu.config import available_memory

from .args import at_least, seconds
from .emulated import PY
from .emurun import _stop_on_signals, fmt_s, human, parse_size
from .multisource import _fraction, _Process
from .netbench import ROOT, CpuSampler
from .weights import mixed_sizes

SYSTEMS = ("hoplite", "hoplite-out", "hoplite-kill", "hoplite-get", "ray", "gloo")
#: The acceptance: the channel at or under this many S/B, and an actor killed
#: mid-fetch costing the others less than this much more time
TARGET_TO_BOUND = 1.15
TARGET_KILL = 1.10
PORT = 7777


# ------------------------------------------------------------- hoplite ---
class _Channel:
    """A directory and the learner on host 0, one actor per other host."""

    def __init__(self, cluster, args: argparse.Namespace, name: str) -> None:
        self.cluster, self.args, self.name = cluster, args, name
        self.env = {**os.environ, "PYTHONPATH": ROOT, "HOPLITE_TOKEN": new_token()}
        self.procs: list[_Process] = []
        self.node_ids: dict[_Process, str] = {}

    def start(self) -> None:
        c, wait = self.cluster, self.args.timeout
        self.directory = self._start(0, "the directory", [
            PY, "-m", "hoplite_gpu", "directory", "--host", c.address(0), "--port", str(PORT),
            "--until-stdin-closes"])
        deadline = time.monotonic() + wait
        while "listening on" not in self.directory.line(max(0.0, deadline - time.monotonic())):
            pass
        self.learner = self._node(0, "the learner")
        self.actors = [self._node(i, f"actor {i}") for i in range(1, c.hosts)]
        for proc in (self.learner, *self.actors):
            self._ready(proc, deadline)

    def _start(self, host: int, what: str, argv: list[str]) -> _Process:
        popen = self.cluster.popen(host, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True, env=self.env, cwd=ROOT)
        proc = _Process(popen, what, host)
        self.procs.append(proc)
        return proc

    def _node(self, host: int, what: str) -> _Process:
        return self._start(host, what, [
            PY, "-m", "benchmarks.channelnode", "--address", f"{self.cluster.address(0)}:{PORT}",
            f"--token={self.env['HOPLITE_TOKEN']}", "--node-host", self.cluster.address(host),
            "--channel", self.name, "--size", str(self.args.size)])

    def _ready(self, proc: _Process, deadline: float) -> None:
        ready = json.loads(proc.line(max(0.0, deadline - time.monotonic())))
        if ready.get("host") != self.cluster.address(proc.host):
            raise RuntimeError(f"{proc.what} runs on {ready.get('host')!r}, not on host "
                               f"{proc.host} ({self.cluster.address(proc.host)})")
        self.node_ids[proc] = ready["node"]

    def restart(self, victim: _Process) -> _Process:
        """A killed actor's host gets a fresh node (an actor restarted)."""
        victim.close(grace=5)
        self.procs.remove(victim)
        proc = self._node(victim.host, victim.what)
        self._ready(proc, time.monotonic() + self.args.timeout)
        self.actors[self.actors.index(victim)] = proc
        return proc

    def close(self) -> None:
        for proc in self.procs[1:]:  # the nodes leave first, all at once
            proc.end_input()
        for proc in reversed(self.procs):
            proc.close()


def hoplite_launch(cluster, system: str, args: argparse.Namespace, cpu: CpuSampler) -> list[dict]:
    run = _Channel(cluster, args, f"weights-{system}")
    rows = []
    try:
        run.start()
        for version in range(args.warmup + args.repeats):  # the first `warmup` untimed
            kill = system == "hoplite-kill" and version >= args.warmup
            row = _hoplite_version(cluster, run, version, system == "hoplite-out", kill, args, cpu)
            rows.append(_numbered({"system": system, **row}, version, args))
    finally:
        run.close()
    return rows


def _hoplite_version(cluster, run: _Channel, version: int, out: bool, kill: bool,
                     args: argparse.Namespace, cpu: CpuSampler) -> dict:
    wait = args.timeout
    expected = run.learner.ask(wait, op="prepare", version=version)["crc"]
    plain = run.name.endswith("hoplite-get")
    for actor in run.actors:
        if plain:
            actor.send(op="get_plain", version=version, timeout=wait)
        else:
            actor.send(op="fetch", newer_than=version - 1, out=out, timeout=wait)
    time.sleep(0.3)  # (every actor's wait for a newer head is at the directory)
    before = cluster.link_counters()
    published = run.learner.ask(wait, op="put_plain" if plain else "publish", version=version)
    killed, waiting = None, list(run.actors)
    if kill:
        seen = run.learner.ask(wait, op="relay", version=version,
                               nbytes=int(args.kill_at * args.size))
        victim = next(a for a in run.actors if run.node_ids[a] == seen["node"])
        os.kill(victim.popen.pid, signal.SIGKILL)
        killed = {"host": victim.host, "at": time.time(), "had": seen["nbytes"] / args.size}
        waiting.remove(victim)
    got = [a.answer(wait + 30) for a in waiting]
    after = cluster.link_counters()
    if kill:  # each survivor's failovers this version: (pull failed, bytes flowed again)
        killed["failovers_s"] = [
            [round(b - a, 4) for a, b in w.ask(wait, op="failovers")["failovers"]
             if a >= killed["at"] - 1] for w in waiting]
    end = max(g["end"] for g in got)
    ok = all(g["version"] == version and g["crc"] == expected for g in got)
    if kill:  # the actor restarted: it fetches the version as a late joiner
        late = run.restart(victim).ask(wait, op="fetch", newer_than=-1, out=out)
        killed["late_joiner_ok"] = late["version"] == version and late["crc"] == expected
        ok = ok and killed["late_joiner_ok"]
    return {"seconds": end - published["start"], "publish_s": published["end"] - published["start"],
            "byte_identical": ok, "actors_timed": len(got), "tensors": got[0]["tensors"],
            "killed": killed, "learner_uplink_bytes": after[0][1] - before[0][1],
            "cpu": cpu.window(published["start"], end)}


# ----------------------------------------------------------------- gloo ---
def gloo_launch(cluster, args: argparse.Namespace, cpu: CpuSampler) -> list[dict]:
    rounds = args.warmup + args.repeats
    procs = [cluster.popen(i, [PY, "-m", "benchmarks.channelgloo", "--rank", str(i), "--world",
                               str(cluster.hosts), "--master", cluster.address(0), "--size",
                               str(args.size), "--rounds", str(rounds)],
                           stdout=subprocess.PIPE, text=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": ROOT})
             for i in range(cluster.hosts)]
    try:
        out, _ = procs[0].communicate(timeout=args.timeout * rounds)
        for p in procs[1:]:
            p.communicate(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if procs[0].returncode != 0 or not lines:
        raise RuntimeError(f"gloo rank 0 failed (exit {procs[0].returncode})")
    ranks = json.loads(lines[-1])["ranks"]
    rows = []
    for k in range(rounds):
        start = ranks[0]["rounds"][k]["start"]
        end = max(r["rounds"][k]["end"] for r in ranks[1:])
        crcs = {r["rounds"][k]["crc"] for r in ranks}
        rows.append(_numbered({"system": "gloo", "seconds": end - start,
                               "byte_identical": len(crcs) == 1,
                               "actors_timed": len(ranks) - 1, "tensors": ranks[0]["tensors"],
                               "cpu": cpu.window(start, end)}, k, args))
    return rows


# ------------------------------------------------------------------ ray ---
def ray_launch(cluster, args: argparse.Namespace, cpu: CpuSampler) -> list[dict]:
    from .rayemu import TUNED, RayOnEmulated

    rounds = args.warmup + args.repeats
    with RayOnEmulated(cluster, ray_config=TUNED,
                       object_store_bytes=max(1 << 30, 3 * args.size),
                       head_object_store_bytes=max(5 << 29, 3 * args.size)) as rc:
        spec = {"address": rc.address, "node_ip": cluster.address(0), "hosts": cluster.hosts,
                "size": args.size, "rounds": rounds, "timeout": args.timeout}
        proc = cluster.popen(0, [PY, "-m", "benchmarks.channelray", json.dumps(spec)],
                             stdout=subprocess.PIPE, env=rc.env(0), cwd=ROOT, text=True)
        try:
            out, _ = proc.communicate(timeout=args.timeout * rounds + 300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"the Ray driver failed (exit {proc.returncode}); Ray nodes' "
                               f"logs:\n{rc.log_tail()}")
    rows = []
    for k, r in enumerate(json.loads(lines[-1])["rounds"]):
        end = max(r["ends"])
        rows.append(_numbered({"system": "ray", "seconds": end - r["start"],
                               "byte_identical": all(c == r["expected"] for c in r["crcs"]),
                               "actors_timed": len(r["ends"]), "tensors": r["tensors"],
                               "cpu": cpu.window(r["start"], end)}, k, args))
    return rows


def _numbered(row: dict, version: int, args: argparse.Namespace) -> dict:
    """`row` of version `version`: a warm-up one, or timed repeat `version - warmup`."""
    warm = version < args.warmup
    return {**row, "version": version, "warmup": warm,
            "repeat": None if warm else version - args.warmup}


# -------------------------------------------------------------- the run ---
def bound(args: argparse.Namespace) -> float:
    """S/B: the state dict's bits over one link's rate (the learner's uplink
    must carry every byte once, and every actor's downlink too)."""
    return args.size * 8 / (args.gbit * 1e9)


def summarize(rows: list[dict], args: argparse.Namespace) -> dict:
    s_over_b = bound(args)
    out: dict[str, Any] = {"bound_s": s_over_b, "systems": {}}
    for system in SYSTEMS:
        samples = [r["seconds"] for r in rows if r["system"] == system and not r.get("warmup")]
        first = [r["seconds"] for r in rows if r["system"] == system and r.get("version") == 0]
        if samples:
            med = statistics.median(samples)
            out["systems"][system] = {"n": len(samples), "median_s": med, "samples_s": samples,
                                      "min_s": min(samples), "max_s": max(samples),
                                      "to_bound": med / s_over_b,
                                      "first_version_s": statistics.median(first) if first
                                      else None}
    med = {k: v["median_s"] for k, v in out["systems"].items()}
    hop = med.get("hoplite")
    out["ratio_to_hoplite"] = {k: v / hop for k, v in med.items() if hop and k != "hoplite"}
    identical = all(r["byte_identical"] for r in rows)
    out["pass_bound"] = bool(hop and identical and hop / s_over_b <= TARGET_TO_BOUND)
    kill = out["ratio_to_hoplite"].get("hoplite-kill")
    out["pass_kill"] = bool(kill is not None and identical and kill < TARGET_KILL)
    out["targets"] = {"hoplite_to_bound_at_most": TARGET_TO_BOUND,
                      "kill_to_hoplite_below": TARGET_KILL}
    return out


def run(args: argparse.Namespace, console: Console) -> dict:
    from .emulated import EmulatedCluster

    _stop_on_signals()
    need = int(args.hosts * args.size * 4.5) + args.hosts * (300 << 20)
    if need > 0.85 * available_memory():
        raise SystemExit(f"channel: {human(args.size)} on {args.hosts} hosts needs about "
                         f"{need / 2**30:.1f} GiB, {available_memory() / 2**30:.1f} GiB "
                         "available: use a smaller --size")
    sizes = mixed_sizes(args.size)
    launches = {"ray": ray_launch, "gloo": gloo_launch}
    rows: list[dict] = []
    failed: list[dict] = []
    with EmulatedCluster(args.hosts, args.gbit * 1e9) as cluster, CpuSampler() as cpu:
        if cluster.swept:
            console.print(f"removed {len(cluster.swept)} namespaces left by an earlier run that "
                          f"was killed: {', '.join(cluster.swept)}")
        link = cluster.measure_link(max(1 << 20, int(args.gbit * 1e9 / 8 * 0.25)))
        console.print(f"{args.hosts} hosts at {args.gbit:g} Gbit/s (measured {link / 1e9:.3f}); "
                      f"{human(args.size)} in {len(sizes)} tensors of {human(min(sizes))} to "
                      f"{human(max(sizes))}; S/B {fmt_s(bound(args))}")
        # (rounds of every system in turn, so drift in the machine hits all alike)
        for rnd in range(args.rounds):
            for system in dict.fromkeys(args.systems):
                t = time.monotonic()
                try:
                    got = (launches[system](cluster, args, cpu) if system in launches
                           else hoplite_launch(cluster, system, args, cpu))
                except (RuntimeError, AssertionError, TimeoutError, subprocess.SubprocessError,
                        ValueError, OSError, StopIteration) as exc:  # a launch that failed: kept
                    error = f"{type(exc).__name__}: {str(exc)[-600:]}"
                    failed.append({"system": system, "round": rnd, "error": error})
                    console.print(f"[red]{system} failed: {error[:300]}[/]")
                    continue
                for row in got:
                    row.update(launch_wall_s=time.monotonic() - t, lower_bound_s=bound(args),
                               round=rnd)
                    _say(console, row)
                rows += got
    summary = summarize(rows, args)
    console.print(table(summary, args, len(sizes)))
    _verdict(console, summary)
    settings = {"hosts": args.hosts, "bandwidth_bps": args.gbit * 1e9, "measured_link_bps": link,
                "size_bytes": args.size, "tensors": len(sizes), "smallest": min(sizes),
                "largest": max(sizes), "repeats": args.repeats, "warmup": args.warmup,
                "rounds": args.rounds,
                "kill_at": args.kill_at,
                "systems": args.systems, "timeout_s": args.timeout,
                "ray": "one Ray node per host, object_manager_pull_timeout_ms=100000",
                "gloo": "torch.distributed, one broadcast per tensor, GLOO_SOCKET_IFNAME=eth0"}
    return {"benchmark": "channel-emulated", "settings": settings, "rows": rows,
            "summary": summary, "failed": failed,
            "byte_identical": not failed and all(r["byte_identical"] for r in rows)}


def _say(console: Console, row: dict) -> None:
    cpu = row.get("cpu")
    which = "warm-up" if row.get("warmup") else "repeat"
    line = (f"{row['system']} version {row.get('version')} ({which} "
            f"{'' if row.get('warmup') else row['repeat']}): {fmt_s(row['seconds'])} "
            f"({row['seconds'] / row['lower_bound_s']:.2f} x S/B), {row['actors_timed']} actors"
            + ("" if cpu is None else f", CPU busy {cpu['busy']:.0%}")
            + ("" if row["byte_identical"] else " [red]BYTES DIFFER[/]"))
    if row.get("killed"):
        k = row["killed"]
        line += (f"; the actor on host {k['host']} killed holding {k['had']:.0%}, restarted "
                 f"and fetched as a late joiner: {'ok' if k['late_joiner_ok'] else 'WRONG'}")
    console.print(line)


def table(summary: dict, args: argparse.Namespace, tensors: int) -> Table:
    t = Table(title=f"{human(args.size)} in {tensors} tensors to {args.hosts - 1} actors at "
                    f"{args.gbit:g} Gbit/s: publish -> the last actor holds it")
    t.caption = ("S/B: the state dict over one link; x hoplite: median against the channel's; "
                 "first: the first version (fresh processes and memory), untimed")
    for col in ("system", "n", "median", "min", "max", "x S/B", "x hoplite", "first"):
        t.add_column(col, justify="right", no_wrap=True)
    for system, e in summary["systems"].items():
        ratio = summary["ratio_to_hoplite"].get(system)
        t.add_row(system, str(e["n"]), fmt_s(e["median_s"]), fmt_s(e["min_s"]),
                  fmt_s(e["max_s"]), f"{e['to_bound']:.2f}",
                  "1.00" if system == "hoplite" else "-" if ratio is None else f"{ratio:.2f}",
                  "-" if e["first_version_s"] is None else fmt_s(e["first_version_s"]))
    return t


def _verdict(console: Console, summary: dict) -> None:
    ok = {True: "[green]pass[/]", False: "[red]FAIL[/]"}
    hop = summary["systems"].get("hoplite")
    console.print(f"hoplite / S/B: {'-' if hop is None else format(hop['to_bound'], '.3f')} "
                  f"(target <= {TARGET_TO_BOUND}): {ok[summary['pass_bound']]}")
    kill = summary["ratio_to_hoplite"].get("hoplite-kill")
    console.print(f"with an actor killed / without: {'-' if kill is None else format(kill, '.3f')} "
                  f"(target < {TARGET_KILL}): {ok[summary['pass_kill']]}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hosts", type=at_least(3), default=8, help="the learner's and one per actor")
    p.add_argument("--gbit", type=seconds(0.0, above=True), default=1.0,
                   help="every host's link, Gbit/s")
    p.add_argument("--size", type=parse_size, default=parse_size("256M"),
                   help="the state dict's size, binary units (256M; a bare number is MiB)")
    p.add_argument("--repeats", type=at_least(1), default=3,
                   help="timed versions per launch (after the warm-up ones)")
    p.add_argument("--warmup", type=at_least(1), default=3,
                   help="untimed versions first: with the channel's keep=2, the third is the "
                        "first whose buffers every node has had before (reported apart)")
    p.add_argument("--rounds", type=at_least(1), default=1,
                   help="launches of every system, in turn (drift hits all alike)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--kill-at", type=_fraction, default=1 / 3,
                   help="hoplite-kill: share of the version the killed relay holds")
    p.add_argument("--timeout", type=seconds(1.0), default=600.0,
                   help="seconds any one step of a launch may take")
    p.add_argument("--json", action="store_true",
                   help="also print the result (as saved) on stdout as one line of JSON")
