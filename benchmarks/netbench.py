"""Broadcast on the emulated cluster: host 0 puts S bytes, hosts 1..N-1 get it
at the same moment; time from the first get to the last byte, against the
lower bound S/B (every receiver's downlink must carry S)."""

from __future__ import annotations

import json
import os
import subprocess
import time

from hoplite_gpu.auth import new_token

from .emulated import PY, EmulatedCluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hoplite_broadcast(c: EmulatedCluster, size: int, name: str, chunk: int | None = None,
                      fanout: int = 1) -> dict:
    """hoplite-gpu's receiver-driven broadcast; `fanout` = receivers per sender
    (1: the pipelined chain; hosts - 1: the naive star, every receiver on the root)."""
    token = new_token()
    env = {**os.environ, "PYTHONPATH": ROOT, "HOPLITE_TOKEN": token,
           "HOPLITE_MAX_RECEIVERS_PER_SENDER": str(fanout)}
    directory = c.popen(0, [PY, "-m", "hoplite_gpu", "directory", "--host", c.address(0),
                            "--port", "7777"], stdout=subprocess.PIPE, text=True, env=env)
    procs: list[subprocess.Popen] = []
    try:
        directory.stdout.readline()
        address = f"{c.address(0)}:7777"
        common = ["--address", address, f"--token={token}", "--name", name, "--size", str(size)]
        if chunk:
            common += ["--chunk-size", str(chunk)]
        sender = c.popen(0, [PY, "-m", "benchmarks.netnode", *common, "--role", "put",
                             "--node-host", c.address(0)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        procs.append(sender)
        crc = json.loads(sender.stdout.readline())["crc"]
        start_at = time.time() + 2.0  # every receiver has joined by then
        for i in range(1, c.hosts):
            procs.append(c.popen(i, [PY, "-m", "benchmarks.netnode", *common, "--role", "get",
                                     "--node-host", c.address(i), "--start-at", str(start_at)],
                                 stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT))
        results = [json.loads(p.communicate(timeout=900)[0]) for p in procs[1:]]
        sender.stdin.close()
        sender.wait(60)
    finally:
        for p in [*procs, directory]:
            if p.poll() is None:
                p.kill()
            p.wait(30)
            for pipe in (p.stdin, p.stdout):
                if pipe is not None:
                    pipe.close()
    if any(r["crc"] != crc for r in results):
        raise AssertionError("a receiver's copy differs from the sender's")
    seconds = max(r["end"] for r in results) - min(r["start"] for r in results)
    bound = lower_bound("broadcast", size, c.hosts, c.bandwidth_bps)
    return {"system": "hoplite-gpu" if fanout == 1 else f"star (hoplite-gpu, fan-out {fanout})",
            "op": "broadcast", "hosts": c.hosts, "size_bytes": size,
            "bandwidth_bps": c.bandwidth_bps, "seconds": seconds, "lower_bound_s": bound,
            "ratio_to_bound": seconds / bound}


def lower_bound(op: str, size: int, hosts: int, bandwidth_bps: float) -> float:
    """S/B for broadcast and reduce; 2(N-1)/N * S/B for allreduce."""
    t = size * 8 / bandwidth_bps
    return 2 * (hosts - 1) / hosts * t if op == "allreduce" else t


def gloo_broadcast(c: EmulatedCluster, size: int, op: str = "broadcast",
                   ready: list[float] | None = None) -> dict:
    """Gloo (torch.distributed defaults) on every host: broadcast, reduce or allreduce."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = [c.popen(i, [PY, "-m", "benchmarks.gloonode", "--rank", str(i), "--world", str(c.hosts),
                         "--master", c.address(0), "--size", str(size), "--op", op,
                         "--ready-after", str(ready[i] if ready else 0.0)],
                     stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT) for i in range(c.hosts)]
    try:
        results = [json.loads(p.communicate(timeout=900)[0]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)
    if op != "reduce" and len({r["crc"] for r in results}) != 1:
        raise AssertionError(f"Gloo ranks disagree on the {op} result")
    seconds = max(r["end"] for r in results) - min(r["start"] for r in results)
    bound = lower_bound(op, size, c.hosts, c.bandwidth_bps)
    return {"system": "gloo", "op": op, "end_max": max(r["end"] for r in results),
            "start_max": max(r["start"] for r in results), "hosts": c.hosts, "size_bytes": size,
            "bandwidth_bps": c.bandwidth_bps, "seconds": seconds, "lower_bound_s": bound,
            "ratio_to_bound": seconds / bound}


def hoplite_collective(c: EmulatedCluster, op: str, size: int, name: str,
                       ready: list[float] | None = None) -> dict:
    """hoplite-gpu's reduce (result on host 0) or allreduce across every host."""
    token = new_token()
    env = {**os.environ, "PYTHONPATH": ROOT, "HOPLITE_TOKEN": token}
    directory = c.popen(0, [PY, "-m", "hoplite_gpu", "directory", "--host", c.address(0),
                            "--port", "7777"], stdout=subprocess.PIPE, text=True, env=env)
    procs: list[subprocess.Popen] = []
    try:
        directory.stdout.readline()
        start_at = time.time() + 2.5
        for i in range(c.hosts):
            procs.append(c.popen(i, [PY, "-m", "benchmarks.netnode", "--address", f"{c.address(0)}:7777",
                                     f"--token={token}", "--name", name, "--size", str(size),
                                     "--role", op, "--rank", str(i), "--world", str(c.hosts),
                                     "--node-host", c.address(i), "--start-at", str(start_at),
                                     "--ready-at", str(ready[i] if ready else 0.0)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env=env, cwd=ROOT))
        results = [json.loads(p.stdout.readline()) for p in procs]
    finally:
        directory.terminate()
        for p in [*procs, directory]:
            if p.stdin is not None:
                p.stdin.close()  # the nodes stop serving and exit
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
            if p.stdout is not None:
                p.stdout.close()
    checks = {r["check"] for r in results if r["check"] is not None}
    if len(checks) != 1:
        raise AssertionError(f"ranks disagree on the {op} result: {checks}")
    ends = [r["end"] for r in results] if op == "allreduce" else [results[0]["end"]]
    seconds = max(ends) - min(r["start"] for r in results)
    bound = lower_bound(op, size, c.hosts, c.bandwidth_bps)
    return {"system": "hoplite-gpu", "op": op, "end_max": max(ends),
            "start_max": max(r["start"] for r in results), "hosts": c.hosts, "size_bytes": size,
            "bandwidth_bps": c.bandwidth_bps, "seconds": seconds, "lower_bound_s": bound,
            "ratio_to_bound": seconds / bound}


def dynamic_allreduce(c: EmulatedCluster, size: int, gap: float, system: str, tag: str) -> dict:
    """Inputs become ready one every `gap` seconds, as tasks finish; the time that
    matters is from the last input's readiness to the allreduce's end everywhere."""
    if system == "gloo":  # ready times count from Gloo's first barrier (torch starts slowly)
        row = gloo_broadcast(c, size, "allreduce", [gap * i for i in range(c.hosts)])
    else:
        first = time.time() + 4.0  # after every node has started and joined
        row = hoplite_collective(c, "allreduce", size, tag, [first + gap * i for i in range(c.hosts)])
    # each rank reports when its input was ready (its "start"): measured, not assumed
    row["seconds_after_last_ready"] = row["end_max"] - row["start_max"]
    row.update(op="allreduce-dynamic", gap_s=gap)
    return row
