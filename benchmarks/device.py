"""Device benchmarks on one GPU, printed side by side with their ceilings.

1. Chunk reduction kernel throughput (acc += chunk, float32) against a
   device-to-device copy of the same size: the memory-bandwidth ceiling. The
   kernel reads two arrays and writes one, the copy reads one and writes one, so
   both are reported as bytes moved per second.
2. UCX between two processes on the GPU (CUDA IPC): a device buffer sent with
   the project's UCX transport, against the same device copy.
3. Device broadcast and allreduce among 4 processes sharing the GPU
   (hoplite-gpu over UCX, CuPy arrays end to end).

Run: ``python -m benchmarks.device`` (needs CuPy and a GPU; ucxx for 2 and 3).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import time
from typing import Any

import numpy as np

MiB = 1 << 20


def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        raise SystemExit("CuPy is not installed: pip install -e '.[gpu]' (needs a CUDA GPU)") \
            from None

    if not cupy.cuda.is_available():
        raise SystemExit("no CUDA GPU visible to CuPy: the device benchmark needs one")
    return cupy


def _timed(cp: Any, fn, repeats: int) -> float:
    """Median seconds of `fn` on the current stream, timed with CUDA events."""
    fn()  # warm-up (kernel compilation, allocations)
    times = []
    for _ in range(repeats):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return float(np.median(times))


def kernel_vs_copy(size: int, repeats: int = 20) -> dict:
    from hoplite_gpu import kernels

    cp = _cupy()
    n = size // 4
    acc, chunk, dst = (cp.ones(n, cp.float32) for _ in range(3))
    copy_s = _timed(cp, lambda: dst.__setitem__(Ellipsis, chunk), repeats)
    reduce_s = _timed(cp, lambda: kernels.reduce_into(acc, chunk, "sum"), repeats)
    copy_bw, reduce_bw = 2 * size / copy_s, 3 * size / reduce_s  # bytes read + written
    return {"what": "reduce kernel vs device copy", "size": size, "copy_s": copy_s,
            "reduce_s": reduce_s, "copy_GBps": copy_bw / 1e9, "reduce_GBps": reduce_bw / 1e9,
            "ratio": reduce_bw / copy_bw}


def _ucx_peer(port_q: Any, size: int, repeats: int, out_q: Any) -> None:
    """Receiver process: listen, receive `repeats` device buffers, report timings."""
    import cupy as cp

    from hoplite_gpu.transports import get_backend

    async def main() -> None:
        dest = cp.empty(size, cp.uint8)
        done = asyncio.Event()
        times: list[float] = []

        async def handler(stream: Any) -> None:
            for _ in range(repeats + 1):
                await stream.recv_into(dest)
                times.append(time.perf_counter())
                await stream.send(b"k")
            done.set()

        listener = await get_backend("ucx").listen("127.0.0.1", 0, handler)
        port_q.put(listener.address)
        await asyncio.wait_for(done.wait(), 300)
        out_q.put(float(cp.asnumpy(dest[:8]).sum()))
        await listener.close()

    asyncio.run(main())


def ucx_vs_copy(size: int, repeats: int = 10) -> dict:
    cp = _cupy()
    from hoplite_gpu.transports import get_backend

    src = cp.ones(size, cp.uint8)
    dst = cp.empty_like(src)
    copy_s = _timed(cp, lambda: dst.__setitem__(Ellipsis, src), repeats)
    ctx = mp.get_context("spawn")
    port_q, out_q = ctx.Queue(), ctx.Queue()
    peer = ctx.Process(target=_ucx_peer, args=(port_q, size, repeats, out_q))
    peer.start()
    address = port_q.get(timeout=120)

    async def send_all() -> list[float]:
        stream = await get_backend("ucx").connect(address, 30)
        times = []
        ack = bytearray(1)
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            await stream.send(src)
            await stream.recv_into(memoryview(ack))
            if i:  # the first one sets up CUDA IPC handles
                times.append(time.perf_counter() - t0)
        await stream.close()
        return times

    times = asyncio.run(send_all())
    check = out_q.get(timeout=120)
    peer.join(60)
    if check != 8.0:
        raise AssertionError("the receiver's device buffer does not hold the sent bytes")
    ucx_s = float(np.median(times))
    return {"what": "UCX between two processes vs device copy", "size": size,
            "copy_s": copy_s, "ucx_s": ucx_s, "copy_GBps": size / copy_s / 1e9,
            "ucx_GBps": size / ucx_s / 1e9, "ratio": copy_s / ucx_s}


def collectives(size: int, workers: int = 4, repeats: int = 3) -> list[dict]:
    """Device broadcast and allreduce among `workers` processes on one GPU, over UCX."""
    from hoplite_gpu.cluster import LocalCluster

    from . import device_tasks as dt

    rows = []
    with LocalCluster(workers, transport="ucx") as c:
        for op in ("broadcast", "allreduce"):
            times = []
            for r in range(repeats):
                tag = f"{op}-{size}-{r}"
                start = time.time() + 2.0
                got = c.map(dt.device_collective, [(op, tag, rank, workers, size, start)
                                                   for rank in range(workers)], timeout=600)
                times.append(max(g["end"] for g in got) - start)
                if len({g["check"] for g in got}) != 1:
                    raise AssertionError(f"{op}: ranks disagree on the result")
            rows.append({"what": f"device {op} among {workers} processes (UCX)", "size": size,
                         "seconds": float(np.median(times)), "repeats": repeats})
    return rows


def run(sizes_mib: list[int], save: str | None) -> list[dict]:
    cp = _cupy()
    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    rows: list[dict] = []
    for mib in sizes_mib:
        size = mib * MiB
        rows.append(kernel_vs_copy(size))
        print(json.dumps(rows[-1]), flush=True)
        try:
            rows.append(ucx_vs_copy(size))
            print(json.dumps(rows[-1]), flush=True)
            rows.extend(collectives(size))
            for r in rows[-2:]:
                print(json.dumps(r), flush=True)
        except Exception as exc:  # no ucxx: say so, keep the kernel numbers
            rows.append({"what": "UCX parts", "size": size, "error": f"{type(exc).__name__}: {exc}"})
            print(json.dumps(rows[-1]), flush=True)
    result = {"gpu": dev["name"].decode() if isinstance(dev["name"], bytes) else dev["name"],
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if save:
        with open(save, "w") as f:
            json.dump(result, f, indent=1)
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.device", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 256], help="MiB")
    p.add_argument("--save", default=f"benchmarks/results/device-{time.strftime('%Y-%m-%d')}.json")
    args = p.parse_args(argv)
    run(args.sizes, args.save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
