"""`python -m benchmarks coldget`: what one small blocking `get` costs the
calling thread, back to back and after a sleep, beside the least a Python
process can do for the same answer.

On some VMs a process woken from a sleep runs the same Python several times
slower than in a tight loop (`python -m benchmarks machine`, "cold Python"),
so a training loop's small calls, each after a sleep, pay for every line of
Python on their path. Three ways of fetching a 1 KiB object that another
process put, each timed in the caller's thread CPU (`time.thread_time`) and
interleaved call by call so that the machine's drift hits them alike:

* ``get``: `hoplite_gpu.get`, the direct path (`hoplite_gpu.direct`);
* ``link``: the same request on a `DirectLink`, then the value rebuilt from
  the reply: the runtime's own bookkeeping left out;
* ``bare``: the locate written and the reply read on the link's blocking
  socket, unpacked with msgpack and wrapped by `np.frombuffer`.

The directory is a separate process (`python -m hoplite_gpu directory`); its
CPU per locate is reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from hoplite_gpu.lifecycle import stop_process

from .args import at_least, seconds
from .latency import _proc_cpu_s

WAYS = ("get", "link", "bare")


def _putter(address: str, count: int) -> None:
    import numpy as np

    import hoplite_gpu as hg

    hg.init(address)
    value = np.ones(256, np.float32)  # 1 KiB: inline, answered with the locate
    for i in range(count):
        hg.put(value, hg.ObjectID.from_name(f"coldget/{i}"))
    print("ready", flush=True)
    sys.stdin.read()  # hold the objects until told
    hg.shutdown()


def _caller(address: str, calls: int, sleep: float, first: int) -> dict:
    import msgpack
    import numpy as np

    import hoplite_gpu as hg
    from hoplite_gpu import messages as m
    from hoplite_gpu.direct import DirectLink
    from hoplite_gpu.protocol import pack
    from hoplite_gpu.transports import split_address
    from hoplite_gpu.values import Layout, from_buffer

    rt = hg.init(address)
    _, host, port = split_address(rt.node.directory_address)
    link = DirectLink(host, port, rt.config.token, rt.node.node_id, 10.0)
    sock = link._sock  # (blocking: the bare exchange is a send and a receive)
    ids = iter(hg.ObjectID.from_name(f"coldget/{i}")
               for i in range(first, first + calls * len(WAYS) + 1))

    def via_get(oid):
        return hg.get(oid)

    def via_link(oid):
        reply = link.requests([m.Locate(rid=0, oid=oid.binary)], time.monotonic() + 10)[0]
        return from_buffer(reply.inline, Layout.from_wire(reply.layout), "numpy")

    def via_bare(oid):
        sock.settimeout(None)
        sock.sendall(pack({"op": "locate", "oid": oid.binary, "rid": 0}))
        reply = msgpack.unpackb(sock.recv(1 << 16)[4:])
        return np.frombuffer(reply["inline"], np.float32)

    ways = {"get": via_get, "link": via_link, "bare": via_bare}
    via_get(next(ids))  # the first get opens the runtime's own direct connection
    cpu = {w: [] for w in WAYS}
    wall = {w: [] for w in WAYS}
    for _ in range(calls):
        for w in WAYS:
            oid = next(ids)
            if sleep:
                time.sleep(sleep)
            c, t = time.thread_time(), time.perf_counter()
            value = ways[w](oid)
            cpu[w].append(time.thread_time() - c)
            wall[w].append(time.perf_counter() - t)
            if len(value) != 256 or value[0] != 1:
                raise RuntimeError(f"{w}: wrong value {value!r:.80}")
    link.close()
    hg.shutdown()
    return {"cpu_s": cpu, "wall_s": wall}


def run(args: argparse.Namespace, console) -> dict:
    from rich.table import Table

    env = {**os.environ, "HOPLITE_TOKEN": os.urandom(8).hex()}
    rows = []
    count = len(WAYS) * (args.calls_hot + args.calls_cold) + 2
    directory = subprocess.Popen([sys.executable, "-m", "hoplite_gpu", "directory", "--port", "0"],
                                 stdout=subprocess.PIPE, text=True, env=env)
    putter = None
    try:
        address = directory.stdout.readline().rsplit(" ", 1)[1].strip()
        putter = subprocess.Popen([sys.executable, "-m", "benchmarks.coldget", "--put", address,
                                   str(count)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=env)
        if putter.stdout.readline().strip() != "ready":
            raise RuntimeError("the putting process did not start")
        first = 0
        for sleep, calls in ((0.0, args.calls_hot), (args.period, args.calls_cold)):
            d0 = _proc_cpu_s(directory.pid)
            out = subprocess.run([sys.executable, "-m", "benchmarks.coldget", "--call", address,
                                  str(calls), str(sleep), str(first)], capture_output=True,
                                 text=True, env=env, timeout=600, check=True)
            d1 = _proc_cpu_s(directory.pid)
            first += len(WAYS) * calls + 1
            res = json.loads(out.stdout.strip().splitlines()[-1])
            row = {"sleep_s": sleep, "calls": calls,
                   "directory_cpu_s_per_locate": None if d0 is None or d1 is None
                   else (d1 - d0) / (calls * len(WAYS) + 1)}
            for w in WAYS:
                row[f"{w}_cpu_median_s"] = statistics.median(res["cpu_s"][w])
                row[f"{w}_wall_median_s"] = statistics.median(res["wall_s"][w])
                row[f"{w}_cpu_s"] = res["cpu_s"][w]
            rows.append(row)
    finally:
        if putter is not None:
            putter.stdin.close()
            putter.wait(10)
            putter.stdout.close()
        stop_process(directory)
        directory.stdout.close()
    table = Table(title="one 1 KiB get: the caller's thread CPU per call, median (wall)")
    for col in ("calls", *WAYS, "get / bare", "directory CPU per locate"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row("back to back" if not r["sleep_s"] else f"after {r['sleep_s'] * 1e3:g} ms",
                      *(f"{r[f'{w}_cpu_median_s'] * 1e6:.0f} us ({r[f'{w}_wall_median_s'] * 1e6:.0f})"
                        for w in WAYS),
                      f"{r['get_cpu_median_s'] / r['bare_cpu_median_s']:.2f}",
                      "-" if r["directory_cpu_s_per_locate"] is None
                      else f"{r['directory_cpu_s_per_locate'] * 1e6:.0f} us")
    console.print(table)
    return {"benchmark": "coldget", "rows": rows}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calls-hot", type=at_least(1), default=1000,
                   help="calls of each way back to back")
    p.add_argument("--calls-cold", type=at_least(1), default=100,
                   help="calls of each way after a sleep")
    p.add_argument("--period", type=seconds(0.0), default=0.05,
                   help="seconds slept before a cold call")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--put"]:
        _putter(sys.argv[2], int(sys.argv[3]))
        sys.exit(0)
    if sys.argv[1:2] == ["--call"]:
        print(json.dumps(_caller(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]),
                                 int(sys.argv[5]))))
        sys.exit(0)
    sys.exit("run it as: python -m benchmarks coldget")
