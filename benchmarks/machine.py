"""`python -m benchmarks machine`: two properties of the machine that shape
the results here, measured the way the runtime meets them.

- First touch: N processes at once each write a fresh buffer, allocated by
  `np.empty` (NumPy advises transparent huge pages for large arrays) or as an
  anonymous map in plain pages, faulted in page by page as written or all at
  once by the kernel (`MAP_POPULATE`). Reports each
  kind's slowest process.
- Cold memory: one process touches `--big-gib` GiB one GiB at a time, frees
  it and does it again. On a VM the host backs guest memory on its first
  touch, and a balloon with free page reporting takes freed memory back over
  time, so memory not used for a while costs far more than memory just freed.
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

from .args import at_least


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


def _touch_gibs(nbytes: int) -> list[float]:
    """Map `nbytes` one GiB at a time, writing one byte per page and keeping
    every map until the end (so each GiB is new memory); the seconds per GiB."""
    import mmap

    import numpy as np

    times, maps = [], []
    for start in range(0, nbytes, 1 << 30):
        t = time.perf_counter()
        m = mmap.mmap(-1, min(1 << 30, nbytes - start))
        np.frombuffer(m, np.uint8)[::4096] = 1
        times.append(time.perf_counter() - t)
        maps.append(m)
    for m in maps:
        m.close()
    return times


def _big(nbytes: int) -> dict:
    """Touch `nbytes` GiB by GiB, free it, and do it again at once. On this VM
    the first pass is dear beyond what was freed recently (the host backs that
    memory on its first touch, and takes freed memory back over minutes: the
    balloon has free page reporting); the second reuses the warm pages."""
    return {"first_pass_s_per_gib": _touch_gibs(nbytes), "again_s_per_gib": _touch_gibs(nbytes)}


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
    out = subprocess.run([sys.executable, "-m", "benchmarks.machine", "--big",
                          str(args.big_gib << 30)], capture_output=True, text=True, timeout=900,
                         check=True)
    big = json.loads(out.stdout)
    for key, label in (("first_pass_s_per_gib", "first pass"), ("again_s_per_gib", "again")):
        console.print(f"{args.big_gib} GiB touched one GiB at a time, {label}: seconds per GiB "
                      + " ".join(f"{x:.2f}" for x in big[key]))
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
        {"what": "large_allocation", "bytes": args.big_gib << 30, **big},
        {"what": "cold_python", "seconds_per_run_by_sleep_s": cold}]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--procs", type=at_least(1), default=8)
    p.add_argument("--mib", type=at_least(1), default=256)
    p.add_argument("--big-gib", type=at_least(1), default=8,
                   help="GiB touched one GiB at a time, twice (the VM's cost for cold memory)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--big"]:
        print(json.dumps(_big(int(sys.argv[2]))))
        sys.exit(0)
    if sys.argv[1:2] == ["--touch"]:
        print(json.dumps(_touch(sys.argv[2], int(sys.argv[3]))))
        sys.exit(0)
    sys.exit("run it as: python -m benchmarks machine")
