"""The floor under hoplite-gpu's small-call latency: the message pattern of a
1 KiB `collectives.broadcast` (each receiver asks the directory to locate the
object, the root puts it, the directory answers every waiting receiver with
the bytes) in as little Python as it takes, timed the way `latency` times
hoplite-gpu (`python -m benchmarks latency --floor`).

Two shapes of rank process:

* ``threaded``: the caller's thread hands each call to an asyncio loop on a
  second thread and waits for its result, as hoplite-gpu's blocking API does
  (a node must go on serving its peers between calls);
* ``direct``: the caller's thread writes the request and reads the reply on a
  blocking socket itself: the least a Python process can do.

The directory is one asyncio process either way. Framing is hoplite-gpu's
(4-byte length, msgpack map), over TCP on loopback. Nothing else of
hoplite-gpu runs: no ids, layouts, store, pulls, deadlines or failover.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import resource
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

import msgpack

_LEN = struct.Struct(">I")
SHAPES = ("threaded", "direct")


def _pack(msg: dict) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def _take(buf: bytearray) -> dict | None:
    """The next whole message in `buf` (removed from it), or None."""
    if len(buf) < _LEN.size:
        return None
    (n,) = _LEN.unpack_from(buf, 0)
    if len(buf) < _LEN.size + n:
        return None
    msg = msgpack.unpackb(bytes(buf[_LEN.size:_LEN.size + n]))
    del buf[:_LEN.size + n]
    return msg


class _Conn:
    """A socket read from a loop reader callback; each message goes to `on_msg`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, on_msg) -> None:
        self.sock, self.on_msg, self.buf = sock, on_msg, bytearray()
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        try:
            data = self.sock.recv(65536)
        except BlockingIOError:
            return
        self.buf += data
        while (msg := _take(self.buf)) is not None:
            self.on_msg(self, msg)

    def send(self, msg: dict) -> None:
        self.sock.sendall(_pack(msg))  # a few hundred bytes: the socket takes them at once


def _directory() -> None:
    loop = asyncio.new_event_loop()
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    print(server.getsockname()[1], flush=True)
    objects: dict[str, bytes] = {}
    waiting: dict[str, list] = {}

    def on_msg(conn: _Conn, msg: dict) -> None:
        oid = msg["oid"]
        if msg["op"] == "put":
            objects[oid] = msg["data"]
            conn.send({"rid": msg["rid"]})
            for other, rid in waiting.pop(oid, []):
                other.send({"rid": rid, "data": msg["data"]})
        elif oid in objects:
            conn.send({"rid": msg["rid"], "data": objects[oid]})
        else:
            waiting.setdefault(oid, []).append((conn, msg["rid"]))

    loop.add_reader(server.fileno(), lambda: _Conn(loop, server.accept()[0], on_msg))
    loop.run_forever()


def _threaded_caller(sock: socket.socket):
    """call(msg) -> reply, through a loop on a second thread."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    pending: dict[int, asyncio.Future] = {}
    ids = iter(range(1, 1 << 62))

    def on_msg(_conn: _Conn, msg: dict) -> None:
        pending.pop(msg["rid"]).set_result(msg)

    conn = asyncio.run_coroutine_threadsafe(_make(loop, sock, on_msg), loop).result(10)

    async def request(msg: dict) -> dict:
        rid = next(ids)
        fut = pending[rid] = loop.create_future()
        conn.send({**msg, "rid": rid})
        return await fut

    def call(msg: dict) -> dict:
        done: concurrent.futures.Future = concurrent.futures.Future()

        def start() -> None:
            task = loop.create_task(request(msg))
            task.add_done_callback(lambda t: done.set_result(t.result()))

        loop.call_soon_threadsafe(start)
        return done.result(10)

    return call


async def _make(loop, sock, on_msg) -> _Conn:
    return _Conn(loop, sock, on_msg)


def _direct_caller(sock: socket.socket):
    """call(msg) -> reply, on a blocking socket in the caller's thread."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(10)
    buf = bytearray()
    ids = iter(range(1, 1 << 62))

    def call(msg: dict) -> dict:
        rid = next(ids)
        sock.sendall(_pack({**msg, "rid": rid}))
        while True:
            reply = _take(buf)
            if reply is None:
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionError("the directory closed the connection")
                buf.extend(chunk)
            elif reply["rid"] == rid:
                return reply

    return call


def _rank(argv: list[str]) -> int:
    shape, port, rank, size, calls, warmup, period, t0 = argv
    rank, size, calls, warmup = int(rank), int(size), int(calls), int(warmup)
    period, t0 = float(period), float(t0)
    sock = socket.create_connection(("127.0.0.1", int(port)), timeout=10)
    call = _threaded_caller(sock) if shape == "threaded" else _direct_caller(sock)
    data = bytes(size)

    def cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    starts, ends, cpu0 = [], [], 0.0
    for k in range(warmup + calls):
        if k == warmup:
            cpu0 = cpu()
        delay = t0 + k * period - time.time()
        if delay > 0:
            time.sleep(delay)
        start = time.time()
        oid = f"call/{k}"
        reply = call({"op": "put", "oid": oid, "data": data} if rank == 0
                     else {"op": "locate", "oid": oid})
        if rank and len(reply["data"]) != size:
            raise RuntimeError(f"got {len(reply['data'])} bytes, not {size}")
        starts.append(start)
        ends.append(time.time())
    print(json.dumps({"rank": rank, "starts": starts[warmup:], "ends": ends[warmup:],
                      "cpu_s": cpu() - cpu0}), flush=True)
    return 0


def run(shape: str, ranks: int, size: int, calls: int, warmup: int, period: float) -> dict:
    """One floor row, shaped like a `latency` row."""
    me = [sys.executable, "-m", "benchmarks.latency_floor"]
    directory = subprocess.Popen([*me, "directory"], stdout=subprocess.PIPE, text=True)
    try:
        port = directory.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError(f"the floor directory did not start: {port!r}")
        t0 = time.time() + 1.0 + 0.1 * ranks
        procs = [subprocess.Popen([*me, shape, port, str(r), str(size), str(calls), str(warmup),
                                   str(period), str(t0)], stdout=subprocess.PIPE, text=True)
                 for r in range(ranks)]
        reports = []
        try:
            for p in procs:
                out, _ = p.communicate(timeout=60 + (calls + warmup) * period)
                if p.returncode:
                    raise RuntimeError(f"a floor rank ({shape}) failed (exit {p.returncode})")
                reports.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate(timeout=10)
    finally:
        directory.kill()
        directory.communicate(timeout=10)
    times = [max(r["ends"][k] for r in reports) - min(r["starts"][k] for r in reports)
             for k in range(calls)]
    return {"op": "broadcast", "system": f"python floor, {shape}", "ranks": ranks,
            "size_bytes": size, "calls": calls, "period_s": period, "samples_s": times,
            "median_s": statistics.median(times), "min_s": min(times),
            "cpu_s_per_call_rank": [r["cpu_s"] / calls for r in reports]}


if __name__ == "__main__":
    if sys.argv[1:] == ["directory"]:
        _directory()
    elif len(sys.argv) == 9 and sys.argv[1] in SHAPES:
        sys.exit(_rank(sys.argv[1:]))
    else:
        sys.exit("usage: python -m benchmarks.latency_floor directory | "
                 "{threaded,direct} PORT RANK SIZE CALLS WARMUP PERIOD T0")
