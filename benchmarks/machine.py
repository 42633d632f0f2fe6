"""`python -m benchmarks machine`: two properties of the machine that shape
the results here, measured the way the runtime meets them.

- First touch: N processes at once each write a fresh buffer, allocated by
  `np.empty` (NumPy advises transparent huge pages for large arrays) or as an
  anonymous map in plain pages, faulted in page by page as written or all at
  once by the kernel (`MAP_POPULATE`). Reports each
  kind's slowest process.
- Cold Python: a fixed piece of Python (msgpack round trips of a control
  message) timed back to back, and after sleeping as a process does between
  calls of a training loop.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def _touch(kind: str, nbytes: int) -> float:
    import mmap

    import numpy as np

    t = time.perf_counter()
    if kind == "numpy":
        a = np.empty(nbytes, np.uint8)
    elif kind == "mmap":
        a = np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)
    else:  # the map's pages faulted in by the kernel at once (MAP_POPULATE)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
        a = np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), np.uint8)
    a[:] = 1
    return time.perf_counter() - t


def _work() -> None:
    import msgpack

    for i in range(300):
        msgpack.unpackb(msgpack.packb({"op": "locate", "oid": b"x" * 20, "rid": i}))


def run(args: argparse.Namespace, console) -> dict:
    first_touch = {}
    for kind in ("numpy", "mmap", "populate"):
        procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.machine", "--touch", kind,
                                   str(args.mib << 20)], stdout=subprocess.PIPE, text=True)
                 for _ in range(args.procs)]
        times = [float(p.communicate(timeout=600)[0]) for p in procs]
        first_touch[kind] = {"seconds": times, "slowest_s": max(times)}
        console.print(f"first touch, {args.procs} processes x {args.mib} MiB, {kind}: "
                      f"slowest {max(times):.3f} s")
    cold = {}
    for sleep in (0.0, 0.005, 0.05):
        n = 100 if sleep >= 0.05 else 400
        total = 0.0
        for _ in range(n):
            if sleep:
                time.sleep(sleep)
            t = time.perf_counter()
            _work()
            total += time.perf_counter() - t
        cold[str(sleep)] = total / n
        console.print(f"fixed Python work after sleeping {sleep * 1e3:g} ms: "
                      f"{total / n * 1e6:.0f} us")
    return {"benchmark": "machine", "rows": [
        {"what": "first_touch", "procs": args.procs, "bytes": args.mib << 20, **first_touch},
        {"what": "cold_python", "seconds_per_run_by_sleep_s": cold}]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--procs", type=int, default=8)
    p.add_argument("--mib", type=int, default=256)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--touch"]:
        print(json.dumps(_touch(sys.argv[2], int(sys.argv[3]))))
        sys.exit(0)
    sys.exit("run it as: python -m benchmarks machine")
