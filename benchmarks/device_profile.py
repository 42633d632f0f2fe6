"""Where a device put and get between two processes spend their time.

Two nodes over UCX (``LocalCluster(2)``): rank 0 puts a CuPy array of SIZE
MiB, rank 1 gets it, four rounds one second apart, each a new object (with
``reuse``, rank 0 deletes the last round's object first, so the device memory
is reused; with ``late``, rank 1 asks 0.3 s after the put began). Prints
each round's wall time on both ranks, a fresh device allocation's cost, an
inline put's (one round trip to the directory), and cProfile of each
runtime's loop thread over the last round (on Python 3.12 one profiler sees
every thread), and both ranks' debug log lines of that round on one time line.

Run: ``python -m benchmarks.device_profile [SIZE_MIB] [TRANSPORT] [reuse] [late]``
(needs a GPU; default 256 ucx).
"""

from __future__ import annotations

import json
import sys
import time

from hoplite_gpu.cluster import LocalCluster

from . import device_tasks as dt


def main(argv: list[str]) -> int:
    size = (int(argv[0]) if argv else 256) << 20
    transport = argv[1] if len(argv) > 1 else "ucx"
    reuse = "reuse" in argv[2:]
    get_after = 0.3 if "late" in argv[2:] else 0.0
    with LocalCluster(2, transport=transport) as c:
        start = time.time() + 3.0
        got = c.map(dt.profile_put_get,
                    [(rank, size, "profile", start, 4, reuse, get_after) for rank in (0, 1)], timeout=120)
    for g in got:
        print(json.dumps({k: v for k, v in g.items() if k not in ("loop_profile", "trace")}))
    # Both ranks' debug lines of the last round on one time line (ms from the first).
    lines = sorted((t, g["rank"], text) for g in got for t, text in g["trace"])
    print("==== the last round, both ranks")
    for t, rank, text in lines:
        print(f"{(t - lines[0][0]) * 1e3:8.3f} ms  rank {rank}  {text}")
    for g in got:
        print(f"==== rank {g['rank']} ({'put' if g['rank'] == 0 else 'get'}), loop thread\n"
              f"{g['loop_profile']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
