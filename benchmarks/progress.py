"""`python -m benchmarks progress`: what each transport setting costs when idle and
per message. For TCP and for UCX under each ucxx progress setting, side by side:

* idle CPU: a LocalCluster of `--workers` nodes (at least 2) and its
  directory, after one object moved from node 0 to every other node over the
  transport (a node that has not used UCX yet does not spin in any mode), then
  doing nothing for `--seconds`; the CPU seconds each process used (from
  /proc), as a fraction of one core;
* round trip: one buffer sent and a 1-byte ack back, between two processes
  (the transport's own send / recv_into), median over `--repeats`.

Each setting runs in fresh processes, since ucxx reads its variables once.
Those processes end with os._exit: in ucxx's thread mode (0.52) a process that
used UCX did not exit after its work was done (its threads kept it alive),
which left orphans behind in our first runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

from .args import at_least, seconds

#: (name, transport, environment) for each setting measured.
SETTINGS = [
    ("tcp", "tcp", {}),
    ("ucx blocking (default)", "ucx", {"UCXPY_PROGRESS_MODE": "blocking"}),
    ("ucx event (opt-in)", "ucx", {"UCXPY_PROGRESS_MODE": "event"}),
    ("ucx thread + python future", "ucx",
     {"UCXPY_PROGRESS_MODE": "thread", "UCXPY_ENABLE_PYTHON_FUTURE": "1"}),
]


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _warm_put(name: str) -> None:
    import hoplite_gpu as hg

    hg.put(np.ones(1 << 20, np.uint8), hg.ObjectID.from_name(name))


def _warm_get(name: str) -> int:
    import hoplite_gpu as hg

    return int(hg.get(hg.ObjectID.from_name(name), timeout=60).sum())


def _idle(transport: str, workers: int, seconds: float) -> list[float]:
    from hoplite_gpu.cluster import LocalCluster

    if workers < 2:
        raise SystemExit("--workers must be at least 2: the idle nodes first move an object")
    # Bytes over the transport itself, not through shared memory.
    with LocalCluster(workers, transport=transport, shared_memory=False) as c:
        pids = [c.pid(i) for i in range(workers)] + [c._directory.pid]
        c.run(0, _warm_put, "warm")
        if c.map(_warm_get, [("warm",)] * (workers - 1), workers=range(1, workers)) != \
                [1 << 20] * (workers - 1):
            raise AssertionError("the warm-up object arrived wrong")
        time.sleep(1.0)  # the transfer settles
        before = [_proc_cpu_s(p) for p in pids]
        time.sleep(seconds)
        return [(_proc_cpu_s(p) - b) / seconds for p, b in zip(pids, before, strict=True)]


def _echo(transport: str, sizes: list[int], repeats: int, q) -> None:
    from hoplite_gpu.transports import get_backend

    async def main() -> None:
        done = asyncio.Event()

        async def handler(stream) -> None:
            for size in sizes:
                dest = np.empty(size, np.uint8)
                for _ in range(repeats):
                    await stream.recv_into(memoryview(dest))
                    await stream.send(b"k")
            done.set()

        listener = await get_backend(transport).listen("127.0.0.1", 0, handler)
        q.put(listener.address)
        await asyncio.wait_for(done.wait(), 300)
        await listener.close()

    asyncio.run(main())
    os._exit(0)  # in ucxx's thread mode the interpreter's exit hangs (see run())


def _round_trips(transport: str, sizes: list[int], repeats: int) -> dict[str, float]:
    """Median round trip per size, all in one event loop (ucxx's thread mode ties
    its notifier to the first loop of the process)."""
    from hoplite_gpu.transports import get_backend

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    peer = ctx.Process(target=_echo, args=(transport, sizes, repeats, q))
    peer.start()
    address = q.get(timeout=60)

    async def main() -> dict[str, float]:
        stream = await get_backend(transport).connect(address, 30)
        ack, out = bytearray(1), {}
        for size in sizes:
            src, times = np.ones(size, np.uint8), []
            for _ in range(repeats):
                t0 = time.perf_counter()
                await stream.send(src)
                await stream.recv_into(memoryview(ack))
                times.append(time.perf_counter() - t0)
            out[str(size)] = statistics.median(times[repeats // 10:])
        await stream.close()
        return out

    result = asyncio.run(main())
    peer.join(60)
    return result


def _one_setting(argv: list[str]) -> int:
    """Child process: measure one setting, print one JSON line."""
    p = argparse.ArgumentParser()
    p.add_argument("--transport")
    p.add_argument("--workers", type=int)
    p.add_argument("--seconds", type=float)
    p.add_argument("--repeats", type=int)
    a = p.parse_args(argv)
    idle = _idle(a.transport, a.workers, a.seconds)
    rt = _round_trips(a.transport, [1024, 1 << 20], a.repeats)
    print(json.dumps({"idle_core_fraction": idle, "round_trip_s": rt}), flush=True)
    sys.stderr.flush()
    os._exit(0)  # in ucxx's thread mode the interpreter's exit hangs (see run())


def run(args: argparse.Namespace, console) -> dict:
    rows = []
    for name, transport, env in SETTINGS:
        cmd = [sys.executable, "-m", "benchmarks.progress", "--transport", transport,
               "--workers", str(args.workers), "--seconds", str(args.seconds),
               "--repeats", str(args.repeats)]
        # A session of its own, so that a hang (seen once in ucxx's thread mode) is
        # ended with every process it started, and reported, not waited out.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True,
                                env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n", **env})
        try:
            out, err = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            err = f"no result within {args.timeout:g} s (hung; its processes were killed)"
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            rows.append({"setting": name, "error": (err or out)[-2000:]})
        else:
            rows.append({"setting": name, "transport": transport, "env": env,
                         **json.loads(lines[-1])})
    console.print(f"\n{args.workers} worker(s) + directory idle for {args.seconds:g} s; round "
                  f"trip = one buffer and a 1-byte ack, median of {args.repeats}")
    console.print("| setting | idle CPU per process (of one core) | 1 KiB round trip | "
                  "1 MiB round trip |\n| --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            console.print(f"| {r['setting']} | error: {r['error'][-200:]!r} | | |")
            continue
        idle = ", ".join(f"{f:.0%}" for f in r["idle_core_fraction"])
        rt = r["round_trip_s"]
        console.print(f"| {r['setting']} | {idle} | {rt['1024'] * 1e6:.0f} us | "
                      f"{rt[str(1 << 20)] * 1e6:.0f} us |")
    return {"benchmark": "progress", "workers": args.workers, "seconds": args.seconds,
            "repeats": args.repeats, "rows": rows}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=at_least(2), default=2,
                   help="idle nodes (plus the directory), at least 2")
    p.add_argument("--seconds", type=seconds(0.0, above=True), default=5.0, help="idle window")
    p.add_argument("--repeats", type=at_least(1), default=300, help="round trips per size")
    p.add_argument("--timeout", type=seconds(0.0, above=True), default=120.0,
                   help="seconds per setting")


if __name__ == "__main__":
    sys.exit(_one_setting(sys.argv[1:]))
