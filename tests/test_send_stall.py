"""The data server's send stall: a puller that reads steadily, however
slowly, is not cut off; only one that reads nothing is. Every wait is
bounded."""

from __future__ import annotations

import asyncio
import socket
import time

import numpy as np
from in_process import run_nodes

from hoplite_gpu.auth import client_handshake
from hoplite_gpu.config import Config
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.protocol import send_msg
from hoplite_gpu.transports import get_backend

MiB = 1 << 20


def _send_buffer() -> int:
    """SO_SNDBUF of a data connection here (as `transports.tcp._tune` sets it)."""
    from hoplite_gpu.transports.tcp import _tune

    sock = socket.socket()
    try:
        _tune(sock)
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    finally:
        sock.close()


def test_a_puller_that_reads_steadily_is_not_cut_off_by_the_send_stall():
    """947d029: "a send whose bytes stop moving for the stall timeout closes
    the stream"; docs/fault-tolerance.md: only a puller that "reads
    nothing" is cut, "an honest puller has given up by then". Here a puller
    takes bytes every 20 ms, never pausing, yet the data server cuts it
    off after one stall. `TCPStream._send_steadily` does not watch bytes
    move: it waits for the socket to become writable, which the kernel
    reports only once a third of the send buffer has drained (8 MiB here,
    `_tune`), so any reader slower than sndbuf/3 per stall timeout (with
    the default 10 s, below ~2 Mbit/s; with a 1 s stall, ~22 Mbit/s) is
    disconnected mid-object, again and again: each time its pull fails
    over, and a reduce step's child stream ends in StepLost and restarts
    the tree."""
    stall = 0.5
    third = _send_buffer() // 3
    tick = 0.02
    # reads at a rate that drains a third of the send buffer in 3 stalls
    per_tick = max(4096, int(third / (3 * stall) * tick))

    async def body(directory, origin):
        big = ObjectID.from_name("review-scheduling-steady-reader")
        await origin.put(np.full(64 * MiB, 1, np.uint8), big)
        stream = await get_backend("tcp").connect(origin.server.address, 2)
        try:
            await client_handshake(stream, "tok", 2)
            await send_msg(stream, {"op": "pull", "oid": big.binary, "offset": 0,
                                    "end": 64 * MiB, "stall": stall})
            buf = memoryview(bytearray(per_tick))
            start = last = time.monotonic()
            gap, ended = 0.0, None
            while time.monotonic() - start < 4 * stall:
                await asyncio.wait_for(stream.recv_into(buf), stall)
                now = time.monotonic()
                gap, last = max(gap, now - last), now
                if ended is None and not origin.server.serving(big):
                    ended = now - start
                await asyncio.sleep(tick)
            assert gap < stall / 2, f"the test's reader itself paused {gap:.2f}s"
            assert ended is None, (
                f"the data server ended the serve {ended:.2f}s in, while the puller took "
                f"{per_tick} bytes every {tick * 1000:.0f} ms (largest gap {gap * 1000:.0f} ms, "
                f"its stall timeout {stall}s): an honest, steady reader is cut off")
        finally:
            await stream.close()

    config = Config(shared_memory=False, chunk_size=MiB, timeout_s=10.0, stall_timeout_s=5.0)
    run_nodes([config], body, bound=30)
