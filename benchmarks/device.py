"""Device benchmarks on one GPU, printed side by side with their ceilings.

1. Chunk reduction kernel throughput (acc += chunk, float32) against a
   device-to-device copy of the same size: the memory-bandwidth ceiling. The
   kernel reads two arrays and writes one, the copy reads one and writes one, so
   both are reported as bytes moved per second.
2. UCX between two processes on the GPU (CUDA IPC): a device buffer sent with
   the project's UCX transport (head + data, one send in flight and two;
   messages, as a pull sends and receives them), and
   with ucxx alone, against the same device copy; then ucxx alone in the
   transport's message patterns (benchmarks/ucx_patterns.py).
3. Device get between 2 processes, broadcast and allreduce among 4 processes
   sharing the GPU (hoplite-gpu over UCX, CuPy arrays end to end), with new
   memory each round and with memory reused.

Run: ``python -m benchmarks.device`` (needs CuPy and a GPU; ucxx for 2 and 3).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

from hoplite_gpu.node.transfer import POSTED_RECEIVES as POSTED

MiB = 1 << 20
PARTS = ("kernel", "ucx", "raw", "patterns", "collectives")


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


def _copy_s(cp: Any, size: int, repeats: int = 10) -> float:
    """Median seconds of one device-to-device copy of `size` bytes."""
    src = cp.ones(size, cp.uint8)
    dst = cp.empty_like(src)
    return _timed(cp, lambda: dst.__setitem__(Ellipsis, src), repeats)


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


def _peer(port_q: Any, size: int, groups: list[int], out_q: Any, raw: bool,
          bare: bool = False) -> None:
    """Receiver process: listen (with the UCX transport, or with ucxx alone when
    `raw`), receive device buffers in `groups` (one ack after each group), then
    report the first bytes of the last buffer."""
    import cupy as cp

    from hoplite_gpu.transports import get_backend, ucx

    async def main() -> None:
        dest = cp.empty(size, cp.uint8)
        done = asyncio.Event()

        async def handler(conn: Any) -> None:
            # ucxx alone: one tagged message per buffer; the transport: its stream.
            recv, ack = (conn.recv, np.ones(1, np.uint8)) if raw else (conn.recv_into, b"k")
            for group in groups:
                if bare:  # messages, received as a pull receives them: POSTED at once
                    posted = 0
                    for landed in range(group):
                        while posted < min(group, landed + POSTED):
                            conn.post_message(dest)  # (all into one buffer here)
                            posted += 1
                        if await conn.recv_next() is not None:
                            raise AssertionError("a head where a message was due")
                else:
                    for _ in range(group):
                        await recv(dest)
                await conn.send(ack)
            done.set()

        if raw:
            listener = ucx._load().create_listener(handler, 0)  # the transport's UCX settings
            port_q.put(listener.port)
        else:
            listener = await get_backend("ucx").listen("127.0.0.1", 0, handler)
            port_q.put(listener.address)
        await asyncio.wait_for(done.wait(), 300)
        out_q.put(float(cp.asnumpy(dest[:8]).sum()))
        if not raw:
            await listener.close()

    asyncio.run(main())


def ucx_vs_copy(size: int, raw: bool = False, repeats: int = 10, window: int = 8,
                depth: int | None = None, bare: bool = False) -> dict:
    """Two measures of UCX between two processes on the GPU (CUDA IPC), against
    a device copy: `one_s`, one buffer and the receiver's ack per round (what a
    single request-reply costs), and `streamed_s`, `window` buffers back to back
    before one ack, per buffer (the bandwidth a long transfer sees). The
    transport's sends go through a `SendWindow` of `depth` (None: the stream's
    own `send_window`, as a pull's sender uses it; 1: one send at a time). With
    `raw`, ucxx alone, one send at a time (what UCX itself gives, without the
    transport's head messages and Python layer above it). With `bare`, the
    transport's bare messages (one message per buffer, no head), as a pull
    over UCX sends its chunks."""
    cp = _cupy()
    from hoplite_gpu.transports import SendWindow, get_backend, ucx

    src = cp.ones(size, cp.uint8)
    copy_s = _copy_s(cp, size, repeats)
    groups = [1] * (repeats + 1) + [window] * repeats
    ctx = mp.get_context("spawn")
    port_q, out_q = ctx.Queue(), ctx.Queue()
    peer = ctx.Process(target=_peer, args=(port_q, size, groups, out_q, raw, bare))
    peer.start()
    address = port_q.get(timeout=120)

    async def send_all() -> tuple[list[float], int]:
        if raw:
            conn = await ucx._load().create_endpoint("127.0.0.1", address)
            recv_ack, ack = conn.recv, np.empty(1, np.uint8)
        else:
            conn = await get_backend("ucx").connect(address, 30)
            recv_ack, ack = conn.recv_into, memoryview(bytearray(1))
        in_flight = 1 if raw else max(1, conn.send_window if depth is None else depth)
        cp.cuda.get_current_stream().synchronize()
        times = []
        for group in groups:
            t0 = time.perf_counter()
            if raw:
                for _ in range(group):
                    await conn.send(src)
            else:
                async with SendWindow(conn, in_flight) as out:
                    for _ in range(group):
                        await (out.send_message(src) if bare else out.send(src))
            await recv_ack(ack)
            times.append((time.perf_counter() - t0) / group)
        await conn.close()
        return times, in_flight

    times, in_flight = asyncio.run(send_all())
    check = out_q.get(timeout=120)
    peer.join(60)
    if check != 8.0:
        raise AssertionError("the receiver's device buffer does not hold the sent bytes")
    one_s = float(np.median(times[1:repeats + 1]))  # the first sets up CUDA IPC handles
    streamed_s = float(np.median(times[repeats + 1:]))
    who = "ucxx alone" if raw else "UCX"
    return {"what": f"{who} between two processes vs device copy", "size": size,
            "copy_s": copy_s, "one_s": one_s, "streamed_s": streamed_s, "window": window,
            "in_flight": in_flight, "bare": bare,
            "copy_GBps": size / copy_s / 1e9, "one_GBps": size / one_s / 1e9,
            "streamed_GBps": size / streamed_s / 1e9,
            "one_ratio": copy_s / one_s, "ratio": copy_s / streamed_s}


def collectives(size: int, copy_s: float, chunk_sizes: list[int], workers: int = 4,
                repeats: int = 3, reuse: bool = False) -> list[dict]:
    """Device broadcast and allreduce among `workers` processes on one GPU, over
    UCX, for each device chunk size (HOPLITE_DEVICE_CHUNK_SIZE). `floor_s` is what the GPU's memory alone needs:
    a broadcast writes `workers - 1` copies (each a device copy); an allreduce
    reads every input once and writes `workers` results, at least
    `2 * workers - 1` copies' worth of traffic. Each round's objects are new;
    with `reuse`, each round first deletes the last round's, so the device
    memory (and UCX's CUDA IPC mappings of it) is reused, as in a training loop."""
    from hoplite_gpu.cluster import LocalCluster

    from . import device_tasks as dt

    floors = {"get": copy_s, "broadcast": (workers - 1) * copy_s,
              "allreduce": (2 * workers - 1) * copy_s}
    want = {"get": 1.0, "broadcast": 1.0, "allreduce": workers * (workers + 1) / 2}
    rows = []
    for chunk in chunk_sizes:
        with LocalCluster(workers, transport="ucx", device_chunk_size=chunk) as c:
            for op in ("get", "broadcast", "allreduce"):
                among = "between 2" if op == "get" else f"among {workers}"
                row = {"what": f"device {op} {among} processes (UCX)", "size": size,
                       "chunk": chunk, "floor_s": floors[op], "reuse": reuse}
                try:
                    times, phases = [], []
                    for r in range(repeats + 1):  # the first sets up connections
                        tag = f"{op}-{size}-{chunk}-{reuse}-{r}"
                        drop = f"{op}-{size}-{chunk}-{reuse}-{r - 1}" if reuse and r else None
                        start = time.time() + 2.0
                        got = c.map(dt.device_collective,
                                    [(op, tag, rank, workers, size, start, drop)
                                     for rank in range(workers)], timeout=300)
                        if {g["check"] for g in got} != {want[op] * 1024}:
                            raise AssertionError(f"{op}: wrong result {[g['check'] for g in got]}")
                        if r:
                            times.append(max(g["end"] for g in got) - start)
                            phases.append([(g["put_s"], g["get_s"]) for g in got])
                    seconds = float(np.median(times))
                    row.update(seconds=seconds, repeats=repeats, GBps=size / seconds / 1e9,
                               put_get_s=phases)
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def run(sizes_mib: list[int], chunks_mib: list[int], save: str | None,
        parts: tuple[str, ...] = PARTS, depths: tuple[int | None, ...] = (1, None)) -> list[dict]:
    cp = _cupy()
    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    rows: list[dict] = []
    for mib in sizes_mib:
        size = mib * MiB
        if "kernel" in parts:
            rows.append(kernel_vs_copy(size))
            print(json.dumps(rows[-1]), flush=True)
        if "ucx" not in parts and "collectives" not in parts:
            continue
        try:
            # By default one send at a time, then as a pull sends (the stream's window).
            for depth in depths if "ucx" in parts else ():
                rows.append(ucx_vs_copy(size, depth=depth))
                print(json.dumps(rows[-1]), flush=True)
            if "ucx" in parts:
                rows.append(ucx_vs_copy(size, bare=True))  # as a pull over UCX sends
                print(json.dumps(rows[-1]), flush=True)
        except Exception as exc:  # no ucxx: say so, keep the kernel numbers
            rows.append({"what": "UCX transfer", "size": size,
                         "error": f"{type(exc).__name__}: {exc}"[:2000]})
            print(json.dumps(rows[-1]), flush=True)
            continue
        if "raw" in parts:
            try:
                rows.append(ucx_vs_copy(size, raw=True))
            except Exception as exc:
                rows.append({"what": "ucxx alone", "size": size,
                             "error": f"{type(exc).__name__}: {exc}"[:2000]})
            print(json.dumps(rows[-1]), flush=True)
        if "patterns" in parts:
            from . import ucx_patterns

            try:
                rows.extend(ucx_patterns.run(size))
            except Exception as exc:
                rows.append({"what": "ucxx alone, message patterns", "size": size,
                             "error": f"{type(exc).__name__}: {exc}"[:2000]})
                print(json.dumps(rows[-1]), flush=True)
        if "collectives" in parts:
            copy_s = next((r["copy_s"] for r in reversed(rows) if "streamed_s" in r), None)
            if copy_s is None:  # the collectives alone: time the copy here
                copy_s = _copy_s(cp, size)
            for reuse in (False, True):
                rows.extend(collectives(size, copy_s, [c * MiB for c in chunks_mib], reuse=reuse))
    name = dev["name"]
    result = {"gpu": name.decode() if isinstance(name, bytes) else name,
              "date": time.strftime("%Y-%m-%d"),
              "command": "python -m benchmarks.device --sizes "
                         f"{' '.join(map(str, sizes_mib))} --chunks {' '.join(map(str, chunks_mib))}"
                         f" --parts {' '.join(parts)}"
                         f" --depths {' '.join(str(d or 0) for d in depths)}",
              "ucx_progress_mode": os.environ.get("UCXPY_PROGRESS_MODE", "blocking"),
              "rows": rows}
    if save:
        with open(save, "w") as f:
            json.dump(result, f, indent=1)
    _table(rows)
    return rows


def _table(rows: list[dict]) -> None:
    print("\n| measure | size | result | against | ratio |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        mib = f"{r['size'] // MiB} MiB"
        if "error" in r:
            print(f"| {r['what']} | {mib} | error: {r['error'][:80]} | | |")
        elif "per_buffer_us" in r:
            copy = next((x for x in rows if x.get("size") == r["size"] and "streamed_s" in x), None)
            against = (f"device copy {copy['copy_GBps']:.0f} GB/s | "
                       f"{copy['copy_s'] * 1e6 / r['per_buffer_us']:.2f}"
                       if copy and r.get("device") else " | ")
            print(f"| {r['what']}, 8 buffers back to back | {mib} | {r['GBps']:.0f} GB/s | "
                  f"{against} |")
        elif "reduce_s" in r:
            print(f"| reduce kernel (sum, float32) | {mib} | {r['reduce_GBps']:.0f} GB/s | "
                  f"device copy {r['copy_GBps']:.0f} GB/s | {r['ratio']:.2f} |")
        elif "streamed_s" in r:
            who = "ucxx alone" if r["what"].startswith("ucxx") else "UCX transport"
            flying = r.get("in_flight", 1)
            who += ", messages" if r.get("bare") else ""
            who += ", 1 send in flight" if flying == 1 else f", {flying} sends in flight"
            print(f"| {who}, {r['window']} buffers back to back | {mib} | "
                  f"{r['streamed_GBps']:.0f} GB/s | device copy {r['copy_GBps']:.0f} GB/s | "
                  f"{r['ratio']:.2f} |")
            print(f"| {who}, one buffer and ack | {mib} | {r['one_GBps']:.0f} GB/s | "
                  f"device copy {r['copy_GBps']:.0f} GB/s | {r['one_ratio']:.2f} |")
        else:
            again = ", memory reused" if r.get("reuse") else ""
            print(f"| {r['what']}, device chunk {r['chunk'] // MiB} MiB{again} | {mib} | "
                  f"{r['seconds'] * 1e3:.2f} ms | memory floor {r['floor_s'] * 1e3:.2f} ms | "
                  f"{r['floor_s'] / r['seconds']:.2f} |")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.device", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 256], help="MiB")
    p.add_argument("--save", default=f"benchmarks/results/device-{time.strftime('%Y-%m-%d')}.json")
    p.add_argument("--chunks", type=int, nargs="+", default=[16, 64, 256],
                   help="device chunk sizes (MiB) for the collectives")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                   help="what to run")
    p.add_argument("--depths", type=int, nargs="+", default=[1, 0],
                   help="UCX transport rows: sends in flight (0: the stream's own window)")
    args = p.parse_args(argv)
    run(args.sizes, args.chunks, args.save, tuple(args.parts),
        tuple(d or None for d in args.depths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
