"""Transport throughput between two processes over loopback: every usable
transport side by side (S bytes in chunk-sized sends, received in place).

Run: ``python -m benchmarks.transport [--size 256] [--chunk 4] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import time

import numpy as np

MiB = 1 << 20


def _receiver(scheme: str, size: int, chunk: int, repeats: int, q) -> None:
    from hoplite_gpu.transports import get_backend

    async def main() -> None:
        dest = np.empty(size, np.uint8)
        view = memoryview(dest)
        done = asyncio.Event()

        async def handler(stream) -> None:
            for _ in range(repeats + 1):
                for off in range(0, size, chunk):
                    await stream.recv_into(view[off:off + chunk])
                await stream.send(b"k")
            done.set()

        listener = await get_backend(scheme).listen("127.0.0.1", 0, handler)
        q.put(listener.address)
        await asyncio.wait_for(done.wait(), 600)
        q.put(int(dest[::4096].astype(np.int64).sum()))
        await listener.close()

    asyncio.run(main())


def measure(scheme: str, size: int, chunk: int, repeats: int) -> dict:
    from hoplite_gpu.transports import get_backend

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    peer = ctx.Process(target=_receiver, args=(scheme, size, chunk, repeats, q))
    peer.start()
    address = q.get(timeout=120)
    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)

    async def send_all() -> list[float]:
        stream = await get_backend(scheme).connect(address, 30)
        ack, times = bytearray(1), []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            for off in range(0, size, chunk):
                await stream.send(memoryview(src[off:off + chunk]))
            await stream.recv_into(memoryview(ack))
            if i:  # the first round is a warm-up
                times.append(time.perf_counter() - t0)
        await stream.close()
        return times

    times = asyncio.run(send_all())
    check = q.get(timeout=120)
    peer.join(60)
    if check != int(src[::4096].astype(np.int64).sum()):
        raise AssertionError(f"{scheme}: the receiver's bytes differ from the sender's")
    med = float(np.median(times))
    return {"transport": scheme, "size": size, "chunk": chunk, "seconds": med,
            "GBps": size / med / 1e9, "min_s": min(times), "max_s": max(times),
            "repeats": repeats}


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    from hoplite_gpu.errors import ConfigError
    from hoplite_gpu.transports import get_backend

    p = argparse.ArgumentParser(prog="python -m benchmarks.transport", description=__doc__)
    p.add_argument("--size", type=int, default=256, help="MiB")
    p.add_argument("--chunk", type=int, default=4, help="MiB per send")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--save", default=f"benchmarks/results/transport-loopback-"
                                     f"{time.strftime('%Y-%m-%d')}.json")
    args = p.parse_args(argv)
    rows = []
    for scheme in ("tcp", "ucx"):
        try:
            get_backend(scheme)
        except ConfigError as exc:
            print(f"{scheme}: skipped ({exc})")
            continue
        rows.append(measure(scheme, args.size * MiB, args.chunk * MiB, args.repeats))
    table = Table(title=f"two processes, loopback, {args.size} MiB in {args.chunk} MiB sends")
    for col in ("transport", "median s", "GB/s", "vs tcp"):
        table.add_column(col)
    base = rows[0]["seconds"] if rows else 1.0
    for r in rows:
        table.add_row(r["transport"], f"{r['seconds']:.3f}", f"{r['GBps']:.2f}",
                      f"{base / r['seconds']:.2f}x")
    Console().print(table)
    with open(args.save, "w") as f:
        json.dump({"command": "python -m benchmarks.transport " + " ".join(argv or []),
                   "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
