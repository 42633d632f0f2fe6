"""Message patterns with ucxx alone, between two processes: where the UCX
transport's cost per buffer comes from.

The transport sends each buffer as a small head message and a data message
(transports/ucx.py). Each pattern here moves the same device buffers (host
buffers without a GPU) with ucxx alone, 8 back to back per round, one ack per
round, and reports the time per buffer (median of 10 rounds, after one to warm up):

* ``one message``: the data alone, its receive posted before it comes;
* ``head then data``: a 16-byte head and the data, the data's receive posted
  when the head is in (as the transport does);
* ``head then data, both receives posted``: the receiver posts the two
  receives at once, before either comes;
* ``head then data, 2 in flight``: as the transport with a send window of 2;
* ``both receives posted, 2 in flight``: the last two together.

Run: ``python -m benchmarks.ucx_patterns [MiB ...]`` (default 64 256); one of
the parts of ``python -m benchmarks.device``. With ``--first-use``, instead:
one buffer and its ack through the project's UCX transport, when the buffers
were just used, after an idle gap, and when the send or the receive buffer is
new each time (what a pull of a new object meets).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

PATTERNS = {
    "raw1": "one message",
    "head+data": "head then data",
    "head+data-prepost": "head then data, both receives posted",
    "head+data-window2": "head then data, 2 in flight",
    "head+data-prepost-window2": "both receives posted, 2 in flight",
}
VARIANTS = list(PATTERNS)
GROUPS = [8] * 11


def xp() -> Any:
    """CuPy where a GPU is visible, else NumPy (UCX over TCP)."""
    try:
        import cupy
        if cupy.cuda.is_available():
            return cupy
    except ImportError:
        pass
    return np


def peer(port_q: Any, size: int, out_q: Any) -> None:
    cp = xp()

    from hoplite_gpu.transports import ucx

    ucxx = ucx._load()

    async def main():
        dest = cp.empty(size, cp.uint8)
        head = np.empty(16, np.uint8)
        ack = np.ones(1, np.uint8)
        done = asyncio.Event()

        async def handler(ep):
            for v in VARIANTS:
                for g in GROUPS:
                    for _ in range(g):
                        if v in ("raw1",):
                            await ep.recv(dest, tag=2)
                        elif "prepost" in v:
                            await asyncio.gather(ep.recv(head, tag=1), ep.recv(dest, tag=2))
                        else:
                            await ep.recv(head, tag=1)
                            await ep.recv(dest, tag=2)
                    await ep.send(ack, tag=3)
            done.set()

        listener = ucxx.create_listener(handler, 0)
        port_q.put(listener.port)
        await asyncio.wait_for(done.wait(), 600)
        out_q.put(float(np.asarray(dest[:8].get() if hasattr(dest, 'get') else dest[:8]).sum()))

    asyncio.run(main())


def _against_peer(target: Callable[..., None], size: int,
                  send: Callable[[Any], Awaitable[None]]) -> None:
    """Start `target(port_q, size, out_q)` as the receiving process, run
    `send(its address)` here, then check the first bytes of the receiver's
    buffer (all ones)."""
    ctx = mp.get_context("spawn")
    port_q, out_q = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=target, args=(port_q, size, out_q))
    p.start()
    asyncio.run(send(port_q.get(timeout=120)))
    if out_q.get(timeout=60) != 8.0:
        raise AssertionError("the receiver's buffer does not hold the sent bytes")
    p.join(30)


def run(size: int) -> list[dict]:
    cp = xp()

    from hoplite_gpu.transports import ucx

    ucxx = ucx._load()
    src = cp.ones(size, cp.uint8)
    rows = []

    async def main(port: int) -> None:
        ep = await ucxx.create_endpoint("127.0.0.1", port)
        head = np.zeros(16, np.uint8)
        ack = np.empty(1, np.uint8)
        if cp is not np:
            cp.cuda.get_current_stream().synchronize()
        for v in VARIANTS:
            times = []
            for g in GROUPS:
                t0 = time.perf_counter()
                if v == "raw1":
                    for _ in range(g):
                        await ep.send(src, tag=2)
                elif v.endswith("window2"):
                    flying = []
                    for _ in range(g):
                        flying.append(asyncio.ensure_future(
                            asyncio.gather(ep.send(head, tag=1), ep.send(src, tag=2))))
                        if len(flying) >= 2:
                            await flying.pop(0)
                    for f in flying:
                        await f
                else:
                    for _ in range(g):
                        await asyncio.gather(ep.send(head, tag=1), ep.send(src, tag=2))
                await ep.recv(ack, tag=3)
                times.append((time.perf_counter() - t0) / g)
            per = float(np.median(times[1:]))
            rows.append({"what": "ucxx alone: " + PATTERNS[v], "variant": v, "size": size,
                         "device": cp is not np, "per_buffer_us": per * 1e6,
                         "GBps": size / per / 1e9})
            print(json.dumps(rows[-1]), flush=True)
        await ep.close()

    _against_peer(peer, size, main)
    return rows





#: First-use cases: what changes before each buffer (one buffer, then the ack).
FIRST_USE = {
    "again": "the same buffers, back to back",
    "idle": "the same buffers, after 0.5 s idle",
    "new-send": "a new send buffer each time (kept)",
    "new-recv": "a new receive buffer each time (kept)",
}


def _first_peer(port_q: Any, size: int, out_q: Any) -> None:
    cp = xp()

    from hoplite_gpu.transports import get_backend

    async def main() -> None:
        dest = cp.empty(size, cp.uint8)
        kept = []
        done = asyncio.Event()

        async def handler(stream: Any) -> None:
            nonlocal dest
            for case in FIRST_USE:
                for _ in range(6):
                    if case == "new-recv":
                        kept.append(dest)
                        dest = cp.empty(size, cp.uint8)
                    await stream.recv_into(dest)
                    await stream.send(b"k")
            done.set()

        listener = await get_backend("ucx").listen("127.0.0.1", 0, handler)
        port_q.put(listener.address)
        await asyncio.wait_for(done.wait(), 600)
        out_q.put(float(np.asarray(dest[:8].get() if hasattr(dest, "get") else dest[:8]).sum()))
        await listener.close()

    asyncio.run(main())


def first_use(size: int) -> list[dict]:
    """One buffer and its ack through the UCX transport, in each FIRST_USE case:
    the median of 5 (after one to warm up) per case."""
    cp = xp()
    from hoplite_gpu.transports import get_backend

    rows = []

    async def main(address: str) -> None:
        stream = await get_backend("ucx").connect(address, 30)
        src = cp.ones(size, cp.uint8)
        kept = []
        ack = memoryview(bytearray(1))
        for case in FIRST_USE:
            times = []
            for _ in range(6):
                if case == "idle":
                    await asyncio.sleep(0.5)
                if case == "new-send":
                    kept.append(src)
                    src = cp.ones(size, cp.uint8)
                if cp is not np:
                    cp.cuda.get_current_stream().synchronize()
                t0 = time.perf_counter()
                await stream.send(src)
                await stream.recv_into(ack)
                times.append(time.perf_counter() - t0)
            per = float(np.median(times[1:]))
            rows.append({"what": "UCX transport, one buffer and ack: " + FIRST_USE[case],
                         "case": case, "size": size, "device": cp is not np,
                         "seconds": per, "all_s": times})
            print(json.dumps(rows[-1]), flush=True)
        await stream.close()

    _against_peer(_first_peer, size, main)
    return rows


if __name__ == "__main__":
    args = sys.argv[1:]
    first = "--first-use" in args
    for mib in [int(a) for a in args if a.isdigit()] or [64, 256]:
        first_use(mib << 20) if first else run(mib << 20)
