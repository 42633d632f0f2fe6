"""A conformance suite for `hoplite_gpu.transports` backends.

Every ``check_*`` coroutine takes a scheme name and exercises the backend that
`get_backend` returns for it, through the public `Backend`/`Listener`/`Stream`
interface only. A new backend is covered by adding its scheme to the
parametrisation in test_transports.py; nothing here knows about sockets.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import gc
import struct
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np
import pytest

from hoplite_gpu.errors import (
    ConfigError,
    ConnectionRefused,
    InvalidArgument,
    Timeout,
    TransportClosed,
    TransportError,
)
from hoplite_gpu.transports import HEAD, Listener, SendWindow, Stream, get_backend
from hoplite_gpu.transports.base import BytesOnly as _BytesOnly

#: Transports a node's connections may use (its data `transport`, the
#: directory's); each is skipped where its backend is unusable.
CANDIDATE_SCHEMES = ("tcp", "ucx")
#: Every backend the conformance suite covers: those, and the same-host one.
STREAM_SCHEMES = (*CANDIDATE_SCHEMES, "local")
#: Loopback host every backend is expected to listen on.
HOST = "127.0.0.1"
CONNECT_TIMEOUT = 5.0
MiB = 1024 * 1024
_LEN = struct.Struct(">Q")

Check = Callable[..., Awaitable[None]]


BytesOnly = _BytesOnly  # (transports.base.BytesOnly: streams that carry bytes only)


def scheme_params(known_bugs: dict[str, pytest.MarkDecorator] | None = None,
                  schemes: tuple[str, ...] = CANDIDATE_SCHEMES) -> list:
    """pytest params for every scheme of `schemes`. Unusable backends skip with the reason;
    `known_bugs` maps a scheme to the xfail mark of a bug its backend has today."""
    params = []
    for scheme in schemes:
        try:
            get_backend(scheme)
        except ConfigError as exc:
            params.append(pytest.param(scheme, marks=pytest.mark.skip(reason=str(exc))))
        else:
            bug = (known_bugs or {}).get(scheme)
            params.append(pytest.param(scheme, marks=[bug] if bug else []))
    return params


def deadline(seconds: float) -> Callable[[Check], Check]:
    """Bound a check with asyncio.timeout, so a hung transport fails instead of stalling."""

    def wrap(check: Check) -> Check:
        @functools.wraps(check)
        async def bounded(*args, **kwargs) -> None:
            async with asyncio.timeout(seconds):
                await check(*args, **kwargs)

        return bounded

    return wrap


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


# -- fixtures as async context managers ---------------------------------------------------------


@contextlib.asynccontextmanager
async def serving(scheme: str, handler: Callable[[Stream], Awaitable[None]]) -> AsyncIterator[Listener]:
    listener = await get_backend(scheme).listen(HOST, 0, handler)
    try:
        yield listener
    finally:
        await listener.close()


@contextlib.asynccontextmanager
async def connected_pair(scheme: str) -> AsyncIterator[tuple[Stream, Stream]]:
    """(client, server) ends of one stream; the server end stays open until the block exits."""
    accepted: asyncio.Queue[Stream] = asyncio.Queue()
    release = asyncio.Event()

    async def hold(stream: Stream) -> None:
        await accepted.put(stream)
        await release.wait()

    async with serving(scheme, hold) as listener:
        client = await get_backend(scheme).connect(listener.address, CONNECT_TIMEOUT)
        try:
            server = await accepted.get()
            yield client, server
        finally:
            release.set()
            await client.close()


async def recv_sized(stream: Stream) -> np.ndarray:
    """Receive one length-prefixed message into a freshly allocated array."""
    (n,) = _LEN.unpack(await stream.recv_exactly(_LEN.size))
    out = np.empty(n, dtype=np.uint8)
    await stream.recv_into(memoryview(out))
    return out


async def send_sized(stream: Stream, data: np.ndarray) -> None:
    await stream.send(_LEN.pack(data.nbytes), memoryview(data))


async def echo_forever(stream: Stream) -> None:
    """Handler: echo length-prefixed messages until the peer goes away."""
    with contextlib.suppress(TransportClosed):
        while True:
            await send_sized(stream, await recv_sized(stream))


# -- data path ----------------------------------------------------------------------------------


async def _recv_in_place(stream: Stream, expected: np.ndarray) -> None:
    """recv_into a slice of a larger array with guard bytes around it, then check the
    destination array itself holds the data and nothing beyond the slice was touched."""
    n, guard = expected.nbytes, 16
    dest = np.full(n + 2 * guard, 0xA5, dtype=np.uint8)
    window = dest[guard : guard + n]
    await stream.recv_into(memoryview(window))
    # Read back through the parent array, not the view handed to recv_into.
    np.testing.assert_array_equal(dest[guard : guard + n], expected)
    assert (dest[:guard] == 0xA5).all() and (dest[guard + n :] == 0xA5).all(), "recv_into overran"


@deadline(60)
async def check_round_trip(scheme: str, size: int) -> None:
    """client -> server -> client, each side receiving in place into a preallocated array."""
    data = random_bytes(size, seed=size)
    async with connected_pair(scheme) as (client, server):

        async def server_side() -> None:
            got = np.empty(size, dtype=np.uint8)
            await server.recv_into(memoryview(got))
            np.testing.assert_array_equal(got, data)
            await server.send(memoryview(got))

        async def client_side() -> None:
            await client.send(memoryview(data))
            await _recv_in_place(client, data)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(server_side())
            tg.create_task(client_side())


@deadline(30)
async def check_full_duplex(scheme: str, size: int = 4 * MiB + 3) -> None:
    """Both ends send at once, larger than any socket buffer: neither may deadlock."""
    a, b = random_bytes(size, seed=1), random_bytes(size, seed=2)
    async with connected_pair(scheme) as (client, server):
        async with asyncio.TaskGroup() as tg:
            tg.create_task(client.send(memoryview(a)))
            tg.create_task(server.send(memoryview(b)))
            tg.create_task(_recv_in_place(server, a))
            tg.create_task(_recv_in_place(client, b))


@deadline(3)
async def check_typed_buffers(scheme: str) -> None:
    """Multi-byte, multi-dimensional buffers go out and come in by bytes, not by items."""
    src = np.random.default_rng(3).standard_normal((257, 129))
    dst = np.zeros_like(src)
    async with connected_pair(scheme) as (client, server):
        async with asyncio.TaskGroup() as tg:
            tg.create_task(client.send(memoryview(src)))
            tg.create_task(server.recv_into(memoryview(dst)))
    np.testing.assert_array_equal(dst, src)


@deadline(10)
async def check_recv_into_multidim(scheme: str) -> None:
    """recv_into accepts a C-contiguous non-byte view (sender uses a plain byte view)."""
    src = np.random.default_rng(4).standard_normal((64, 33))
    dst = np.zeros_like(src)
    async with connected_pair(scheme) as (client, server):
        async with asyncio.TaskGroup() as tg:
            tg.create_task(client.send(memoryview(src).cast("B")))
            tg.create_task(server.recv_into(memoryview(dst)))
    np.testing.assert_array_equal(dst, src)


@deadline(10)
async def check_send_gathers(scheme: str) -> None:
    """send(*buffers) puts the buffers on the wire back to back, in order."""
    parts = [b"", b"a", bytearray(b"bc"), memoryview(random_bytes(70_000, seed=5)), b"\xff"]
    joined = b"".join(bytes(p) for p in parts)
    async with connected_pair(scheme) as (client, server):
        async with asyncio.TaskGroup() as tg:
            tg.create_task(client.send(*parts))
            got = tg.create_task(server.recv_exactly(len(joined)))
    assert got.result() == joined
    assert await _empty_recv_exactly(scheme) == b""


async def _empty_recv_exactly(scheme: str) -> bytes:
    async with connected_pair(scheme) as (client, _):
        return await client.recv_exactly(0)


@deadline(60)
async def check_send_window_keeps_order(scheme: str, depth: int) -> None:
    """Sends through a SendWindow overlap (up to `depth` at once, whatever the
    stream's own `send_window`) and still arrive whole and in call order: small
    control-sized frames, inline-sized buffers and large ones, mixed."""
    sizes = [3, 1 << 20, 10, 20_000, 5 * MiB + 1, 0, 7, 2 * MiB, 1] * 3
    frames = [random_bytes(n, seed=i) for i, n in enumerate(sizes)]
    async with connected_pair(scheme) as (client, server):

        async def sender() -> None:
            async with SendWindow(client, depth) as out:
                for i, data in enumerate(frames):
                    await out.send(_LEN.pack(i), memoryview(data))

        async def receiver() -> None:
            for i, data in enumerate(frames):
                (seq,) = _LEN.unpack(await server.recv_exactly(_LEN.size))
                assert seq == i, f"frame {seq} arrived where frame {i} was due"
                got = np.empty(data.nbytes, np.uint8)
                if data.nbytes:
                    await server.recv_into(memoryview(got))
                np.testing.assert_array_equal(got, data)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(sender())
            tg.create_task(receiver())


@deadline(30)
async def check_send_window_reports_a_failed_send(scheme: str) -> None:
    """A send that fails inside a window (the peer closed) surfaces as
    TransportClosed from a later `send` or from leaving the block, never lost."""
    big = random_bytes(4 * MiB, seed=9)
    async with connected_pair(scheme) as (client, server):
        await server.close()
        with pytest.raises(TransportClosed):
            async with SendWindow(client, 3) as out:
                for _ in range(200):  # the peer reads nothing; sends fail or fill buffers
                    await out.send(memoryview(big))


@deadline(30)
async def check_many_streams(scheme: str, count: int = 20) -> None:
    """Many clients at once on one listener, each echoing its own data several times."""
    async with serving(scheme, echo_forever) as listener:

        async def one_client(i: int) -> None:
            stream = await get_backend(scheme).connect(listener.address, CONNECT_TIMEOUT)
            try:
                for round_ in range(3):
                    data = random_bytes(64 * 1024 + 97 * i + round_, seed=1000 * i + round_)
                    await send_sized(stream, data)
                    np.testing.assert_array_equal(await recv_sized(stream), data)
            finally:
                await stream.close()

        async with asyncio.TaskGroup() as tg:
            for i in range(count):
                tg.create_task(one_client(i))


@deadline(120)
async def check_bulk_transfer(scheme: str, total: int, chunk: int = 4 * MiB) -> None:
    """Move `total` bytes in `chunk`-sized sends into one preallocated destination."""
    data = random_bytes(total, seed=7)
    dest = np.zeros(total, dtype=np.uint8)
    view = memoryview(dest)
    async with connected_pair(scheme) as (client, server):

        async def sender() -> None:
            for off in range(0, total, chunk):
                await client.send(memoryview(data[off : off + chunk]))

        async def receiver() -> None:
            for off in range(0, total, chunk):
                await server.recv_into(view[off : off + chunk])

        async with asyncio.TaskGroup() as tg:
            tg.create_task(sender())
            tg.create_task(receiver())
    np.testing.assert_array_equal(dest, data)


@deadline(20)
async def check_recv_steps(scheme: str, total: int = 9 * MiB + 5, step: int = 256 * 1024) -> None:
    """recv_steps fills the buffer exactly and reports progress: marks rise, the
    last is the whole buffer, and every reported byte is already in place."""
    data = random_bytes(total, seed=11)
    dest = np.zeros(total, dtype=np.uint8)
    marks: list[int] = []

    def on_step(n: int) -> None:
        if n >= 64:  # the bytes a mark reports are in the buffer when it is reported
            np.testing.assert_array_equal(dest[n - 64:n], data[n - 64:n])
        marks.append(n)

    async with connected_pair(scheme) as (client, server):
        sending = asyncio.ensure_future(client.send(memoryview(data)))
        await server.recv_steps(memoryview(dest), step, on_step)
        await sending
    np.testing.assert_array_equal(dest, data)
    assert marks and marks[-1] == total
    assert marks == sorted(set(marks)), "marks only rise"
    assert all(b - a >= step for a, b in zip(marks, marks[1:-1], strict=False)), \
        "a mark comes after at least a step"


@deadline(10)
async def check_recv_steps_peer_closes_early(scheme: str) -> None:
    """recv_steps when the peer sends part and closes: TransportClosed, and the
    marks never pass what arrived."""
    marks: list[int] = []
    async with connected_pair(scheme) as (client, server):
        await server.send(bytes(1000))
        await server.close()
        with pytest.raises(TransportClosed):
            await client.recv_steps(memoryview(bytearray(100_000)), 100, marks.append)
    assert all(m <= 1000 for m in marks)


@deadline(10)
async def check_close_wakes_pending_recv_steps(scheme: str) -> None:
    """close() while another task waits in recv_steps: it raises TransportClosed."""
    async with connected_pair(scheme) as (client, _server):
        pending = asyncio.ensure_future(
            client.recv_steps(memoryview(bytearray(1 << 20)), 4096, lambda n: None))
        await asyncio.sleep(0.05)
        assert not pending.done()
        await _close_and_expect_closed(client, pending)


@deadline(10)
async def check_cancelled_recv_never_misplaces_a_message(scheme: str) -> None:
    """A receive cancelled before anything arrived (a timeout) must not take the
    next message: the next receive gets it whole, or the stream says it is
    closed (UCX cannot withdraw a posted receive, so it ends the stream)."""
    async with connected_pair(scheme) as (client, server):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await client.recv_into(memoryview(bytearray(5)))
        with contextlib.suppress(TransportClosed):
            await server.send(b"first")
            await server.send(b"secon")
        dest = bytearray(5)
        try:
            await client.recv_into(memoryview(dest))
        except TransportClosed:
            assert client.closed
        else:
            assert bytes(dest) == b"first"


@deadline(10)
async def check_a_cancelled_receive_nobody_awaits_frees_its_buffer(scheme: str) -> None:
    """Regression (a training loop over UCX whose buffers were not reused
    within 15 s): a cancelled task keeps its error, whose traceback holds
    the frames it ran; a transport frame that held its own task made a
    cycle, so a receive cancelled and not awaited (a reduce step stopped)
    kept the buffer it was filling, and every object behind it, until the
    garbage collector's next full pass, which large buffers do not hasten.
    Freed at once now, by reference counts alone (the collector is off)."""
    async with connected_pair(scheme) as (client, _server):
        buf = np.zeros(64 * 1024, np.uint8)
        freed = weakref.ref(buf)
        gc.collect()
        gc.disable()
        try:
            task = asyncio.ensure_future(client.recv_into(memoryview(buf)))
            await asyncio.sleep(0.05)
            task.cancel()
            while not task.done():
                await asyncio.sleep(0.01)
            del task, buf
            assert freed() is None, "a cancelled receive's buffer waits for the collector"
        finally:
            gc.enable()


# -- closing ------------------------------------------------------------------------------------


@deadline(10)
async def check_peer_closes_early(scheme: str) -> None:
    """recv_into of 1000 bytes when the peer sends 100 and closes: TransportClosed saying 100."""
    async with connected_pair(scheme) as (client, server):
        await server.send(bytes(range(100)))
        await server.close()
        dest = bytearray(1000)
        with pytest.raises(TransportClosed) as info:
            await client.recv_into(memoryview(dest))
        assert "100" in str(info.value), f"message should say how many bytes arrived: {info.value}"
        assert dest[:100] == bytes(range(100)), "the bytes that did arrive are in the buffer"
        with pytest.raises(TransportClosed):
            await client.recv_into(memoryview(bytearray(1)))
        with pytest.raises(TransportClosed):
            await client.recv_exactly(1)


@deadline(10)
async def check_watch_idle_hears_the_peer_close(scheme: str) -> None:
    """An idle stream that is watched hears its peer close (a pool of idle
    connections lets go of dead peers); one unwatched again does not."""
    loop = asyncio.get_running_loop()
    async with connected_pair(scheme) as (client, server):
        ended = asyncio.Event()
        client.watch_idle(ended.set)
        await asyncio.sleep(0.05)
        assert not ended.is_set(), "a live idle peer is not an ended one"
        await server.close()
        async with asyncio.timeout(5):
            await ended.wait()
    async with connected_pair(scheme) as (client, server):
        calls: list[float] = []
        client.watch_idle(lambda: calls.append(loop.time()))
        client.unwatch_idle()
        await server.close()
        await asyncio.sleep(0.5)
        assert not calls, "an unwatched stream is not told of its peer's close"


@deadline(10)
async def check_close_semantics(scheme: str) -> None:
    """`closed` flips on close; close is idempotent; send/recv after close raise TransportClosed."""
    async with connected_pair(scheme) as (client, server):
        assert not client.closed and not server.closed
        await client.close()
        assert client.closed
        await client.close()
        assert client.closed
        with pytest.raises(TransportClosed):
            await client.send(b"x")
        with pytest.raises(TransportClosed):
            await client.recv_into(memoryview(bytearray(4)))
        # The peer sees the end of the stream, not a hang.
        with pytest.raises(TransportClosed):
            await server.recv_exactly(4)


@deadline(20)
async def check_send_to_closed_peer(scheme: str) -> None:
    """Sending to a peer that has gone away eventually raises TransportClosed, never OSError."""
    block = memoryview(random_bytes(4 * MiB, seed=8))
    async with connected_pair(scheme) as (client, server):
        await server.close()
        with pytest.raises(TransportClosed):
            for _ in range(64):  # more than any send buffer could absorb
                await client.send(block)
        assert client.closed


async def _close_and_expect_closed(stream, pending: asyncio.Future) -> None:
    """Close `stream`; the operation parked on it must end with TransportClosed, soon."""
    await stream.close()
    try:
        async with asyncio.timeout(1):
            with pytest.raises(TransportClosed):
                await pending
    finally:
        pending.cancel()
        with contextlib.suppress(BaseException):
            await pending


@deadline(10)
async def check_close_wakes_pending_recv(scheme: str) -> None:
    """close() while another task waits in recv_into: that receive raises TransportClosed."""
    async with connected_pair(scheme) as (client, _server):
        pending = asyncio.ensure_future(client.recv_into(memoryview(bytearray(10))))
        await asyncio.sleep(0.05)
        assert not pending.done()
        await _close_and_expect_closed(client, pending)


@deadline(10)
async def check_close_wakes_pending_send(scheme: str) -> None:
    """close() while another task is blocked sending (peer not reading): it raises TransportClosed."""
    block = memoryview(random_bytes(64 * MiB, seed=9))
    async with connected_pair(scheme) as (client, _server):
        pending = asyncio.ensure_future(client.send(block))
        await asyncio.sleep(0.2)
        assert not pending.done(), "64 MiB unread should not fit in the send buffers"
        await _close_and_expect_closed(client, pending)


@deadline(20)
async def check_send_stall_cuts_a_peer_that_reads_nothing(scheme: str) -> None:
    """With `send_stall_s` set, a send to a peer that takes nothing (alive,
    connected, never reading) fails with Timeout after about that long and
    closes the stream; without it a data server's serve would hold its task
    and its view of the copy for as long as the peer lives."""
    stall = 0.5
    block = memoryview(random_bytes(64 * MiB, seed=11))
    async with connected_pair(scheme) as (client, _server):
        client.send_stall_s = stall
        started = time.monotonic()
        with pytest.raises(Timeout, match="cut off"):
            async with SendWindow(client) as out:
                for _ in range(8):  # more than any send buffer holds
                    await out.send(block)
        took = time.monotonic() - started
        assert took < 10 * stall, f"cut off after {took:.1f}s, the stall is {stall}s"
        assert client.closed, "a stalled send leaves the stream closed (mid-message)"


@deadline(30)
async def check_send_stall_spares_a_slow_steady_reader(scheme: str) -> None:
    """A reader that takes every message, but each only after a pause shorter
    than the stall, is never cut off, though the whole transfer lasts several
    stalls."""
    stall = 0.6
    pause = stall / 3
    frames = [random_bytes(8 * MiB, seed=i) for i in range(12)]  # 96 MiB: several stalls long
    async with connected_pair(scheme) as (client, server):
        client.send_stall_s = stall

        async def sender() -> None:
            async with SendWindow(client) as out:
                for data in frames:
                    await out.send(memoryview(data))

        async def reader() -> None:
            got = np.empty(8 * MiB, np.uint8)
            for data in frames:
                await asyncio.sleep(pause)
                await server.recv_into(memoryview(got))
                np.testing.assert_array_equal(got, data)

        started = time.monotonic()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(sender())
            tg.create_task(reader())
        assert time.monotonic() - started > 2 * stall, "the reader was not slow: no test"


@deadline(10)
async def check_close_while_pending_spares_other_streams(scheme: str) -> None:
    """Closing a stream under a parked receive must not disturb streams opened afterwards
    (a backend that leaves the closed handle registered with the event loop would)."""
    async with connected_pair(scheme) as (client, _server):
        pending = asyncio.ensure_future(client.recv_into(memoryview(bytearray(10))))
        await asyncio.sleep(0.05)
        await client.close()
        try:
            async with asyncio.timeout(1.5):
                async with serving(scheme, echo_forever) as listener:
                    stream = await get_backend(scheme).connect(listener.address, CONNECT_TIMEOUT)
                    try:
                        data = random_bytes(1000, seed=12)
                        await send_sized(stream, data)
                        np.testing.assert_array_equal(await recv_sized(stream), data)
                    finally:
                        await stream.close()
        finally:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending


# -- connecting and listening -------------------------------------------------------------------


async def _dead_address(scheme: str) -> str:
    """An address that had a listener a moment ago and has none now."""

    async def unused(stream: Stream) -> None:
        raise AssertionError("nobody should connect")

    async with serving(scheme, unused) as listener:
        return listener.address


@deadline(10)
async def check_connect_refused(scheme: str) -> None:
    backend = get_backend(scheme)
    address = await _dead_address(scheme)
    with pytest.raises(ConnectionRefused) as info:
        await backend.connect(address, CONNECT_TIMEOUT)
    assert isinstance(info.value, TransportError)
    assert not isinstance(info.value, OSError)


@deadline(10)
async def check_bad_address(scheme: str) -> None:
    backend = get_backend(scheme)
    for bad in ("nohost", f"{scheme}://nohost", "host:port", ""):
        with pytest.raises(InvalidArgument):
            await backend.connect(bad, CONNECT_TIMEOUT)


@deadline(10)
async def check_unresolvable_host(scheme: str) -> None:
    with pytest.raises(TransportError):
        await get_backend(scheme).connect(f"{scheme}://no-such-host.invalid:1", CONNECT_TIMEOUT)


@deadline(10)
async def check_listen_unresolvable_host(scheme: str) -> None:
    """A listen address that does not resolve is a hoplite error, not a raw socket.gaierror."""

    async def unused(stream: Stream) -> None:
        raise AssertionError("nobody should connect")

    with pytest.raises(TransportError):
        listener = await get_backend(scheme).listen("no-such-host.invalid", 0, unused)
        await listener.close()


@deadline(10)
async def check_listen_conflict(scheme: str) -> None:
    """Listening where something already listens is a TransportError, not an OSError."""
    backend = get_backend(scheme)

    async def unused(stream: Stream) -> None:
        raise AssertionError("nobody should connect")

    async with serving(scheme, unused) as listener:
        port = int(listener.address.rsplit(":", 1)[1])
        with pytest.raises(TransportError):
            second = await backend.listen(HOST, port, unused)
            await second.close()


@deadline(10)
async def check_listener_address(scheme: str) -> None:
    async with connected_pair(scheme) as (client, server):
        assert client.peer and server.peer
    async with serving(scheme, echo_forever) as listener:
        assert listener.address.startswith(f"{scheme}://{HOST}:")
        assert int(listener.address.rsplit(":", 1)[1]) > 0


@deadline(10)
async def check_listen_ipv6(scheme: str) -> None:
    backend = get_backend(scheme)
    if not backend.ipv6:
        with pytest.raises(InvalidArgument, match="IPv4"):
            await backend.listen("::1", 0, echo_forever)
        return
    listener = await backend.listen("::1", 0, echo_forever)
    try:
        assert listener.address.startswith(f"{scheme}://[::1]:")
        stream = await backend.connect(listener.address, CONNECT_TIMEOUT)
        try:
            data = random_bytes(1000, seed=11)
            await send_sized(stream, data)
            np.testing.assert_array_equal(await recv_sized(stream), data)
        finally:
            await stream.close()
    finally:
        await listener.close()


@deadline(15)
async def check_listener_close(scheme: str, count: int = 3) -> None:
    """Listener.close closes open streams, finishes handler tasks and stops accepting."""
    backend = get_backend(scheme)
    started, finished = asyncio.Semaphore(0), []
    server_streams: list[Stream] = []

    async def block_reading(stream: Stream) -> None:
        server_streams.append(stream)
        started.release()
        try:
            await stream.recv_exactly(1)
        finally:
            finished.append(stream)

    listener = await backend.listen(HOST, 0, block_reading)
    address, clients = listener.address, []
    try:
        for _ in range(count):
            clients.append(await backend.connect(address, CONNECT_TIMEOUT))
        for _ in range(count):
            await started.acquire()
        t0 = time.monotonic()
        await listener.close()
        assert time.monotonic() - t0 < 5, "Listener.close should not wait for peers"
        assert len(finished) == count, "every handler has returned when close() returns"
        assert all(s.closed for s in server_streams)
        for client in clients:
            with pytest.raises(TransportClosed):
                await client.recv_exactly(1)
        with pytest.raises(ConnectionRefused):
            extra = await backend.connect(address, CONNECT_TIMEOUT)
            await extra.close()
        await listener.close()  # idempotent
    finally:
        for client in clients:
            await client.close()
        await listener.close()


@deadline(10)
async def check_listener_survives_handler_error(scheme: str) -> None:
    """A handler that raises costs its own stream only; the listener keeps serving."""
    calls = 0

    async def flaky(stream: Stream) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("handler bug")
        await echo_forever(stream)

    backend = get_backend(scheme)
    async with serving(scheme, flaky) as listener:
        first = await backend.connect(listener.address, CONNECT_TIMEOUT)
        try:
            with pytest.raises(TransportClosed):
                await first.recv_exactly(1)
        finally:
            await first.close()
        second = await backend.connect(listener.address, CONNECT_TIMEOUT)
        try:
            await send_sized(second, random_bytes(10))
            np.testing.assert_array_equal(await recv_sized(second), random_bytes(10))
        finally:
            await second.close()



# -- messages and heads -------------------------------------------------------------------------

#: A keepalive-like head and an error-like head with a body: the protocol's
#: frame kinds, which a stream hands to `recv_head` as they are.
KEEPALIVE = HEAD.pack(0, 0)


def _guarded(n: int, guard: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """A destination of `n` bytes inside guard bytes: (the whole, the window)."""
    whole = np.full(n + 2 * guard, 0xA5, dtype=np.uint8)
    return whole, whole[guard:guard + n]


def _intact(whole: np.ndarray, n: int, guard: int = 16) -> bool:
    return bool((whole[:guard] == 0xA5).all() and (whole[guard + n:] == 0xA5).all())


@deadline(60)
async def check_messages_in_order(scheme: str) -> None:
    """Messages posted several at a time land whole, in order, each in place
    in a buffer of exactly its size; `on_step` marks rise, every byte they
    report is in, the last is the whole message, and each is reported before
    `recv_next` says the message is in."""
    sizes = [1, 4095, 70_000, 4 * MiB + 3, 1, 9 * MiB]
    data = [random_bytes(n, seed=200 + i) for i, n in enumerate(sizes)]
    dests = [_guarded(n) for n in sizes]
    marks: list[list[int]] = [[] for _ in sizes]

    def stepper(i: int) -> Callable[[int], None]:
        def on_step(n: int) -> None:
            window = dests[i][1]
            np.testing.assert_array_equal(window[max(0, n - 64):n], data[i][max(0, n - 64):n])
            marks[i].append(n)
        return on_step

    async with connected_pair(scheme) as (client, server):

        async def sender() -> None:
            async with SendWindow(client) as out:
                for d in data:
                    await out.send_message(memoryview(d))

        sending = asyncio.ensure_future(sender())
        posted = 0
        for i in range(len(sizes)):
            while posted < len(sizes) and posted < i + 2:  # two posted at once
                server.post_message(memoryview(dests[posted][1]), on_step=stepper(posted),
                                    step=256 * 1024)
                posted += 1
            assert await server.recv_next() is None
            assert marks[i] and marks[i][-1] == sizes[i], f"message {i}: marks {marks[i]}"
            assert marks[i] == sorted(set(marks[i])), "marks only rise"
            np.testing.assert_array_equal(dests[i][1], data[i])
            assert _intact(dests[i][0], sizes[i]), "a message overran its buffer"
        await sending


@deadline(30)
async def check_message_frames(scheme: str) -> None:
    """A message of several frames fills one buffer per frame, each exactly
    its frame's size, with `recv_message`."""
    frames = [random_bytes(n, seed=300 + n) for n in (3, 20_000, 1, 2 * MiB + 1)]
    dests = [_guarded(f.nbytes) for f in frames]
    async with connected_pair(scheme) as (client, server):
        sending = asyncio.ensure_future(client.send_message(*(memoryview(f) for f in frames)))
        totals: list[int] = []
        await server.recv_message(*(memoryview(w) for _, w in dests), on_step=totals.append)
        await sending
    for f, (whole, window) in zip(frames, dests, strict=True):
        np.testing.assert_array_equal(window, f)
        assert _intact(whole, f.nbytes)
    assert totals[-1] == sum(f.nbytes for f in frames)


@deadline(20)
async def check_message_larger_than_its_buffer(scheme: str) -> None:
    """A message longer than the buffer posted for it ends the stream with
    TransportClosed that says so; nothing lands past the buffer."""
    async with connected_pair(scheme) as (client, server):
        await client.send_message(b"0123456789")
        whole, window = _guarded(4)
        with pytest.raises(TransportClosed, match="message"):
            await server.recv_message(memoryview(window))
        assert server.closed
        assert _intact(whole, 4)


@deadline(20)
async def check_message_shorter_than_its_buffer(scheme: str) -> None:
    """A message shorter than the buffer posted for it ends the stream with
    TransportClosed that says so, instead of taking part of the next one."""
    async with connected_pair(scheme) as (client, server):
        await client.send_message(b"0123")
        await client.send_message(b"456789")
        with pytest.raises(TransportClosed, match="message"):
            await server.recv_message(memoryview(bytearray(10)))
        assert server.closed


@deadline(20)
async def check_message_frames_must_match_buffers(scheme: str) -> None:
    """Frames of 5 and 3 bytes posted as buffers of 3 and 5: the stream ends
    with TransportClosed rather than spreading frames over other buffers."""
    async with connected_pair(scheme) as (client, server):
        await client.send_message(b"abcde", b"fgh")
        with pytest.raises(TransportClosed, match="message"):
            await server.recv_message(memoryview(bytearray(3)), memoryview(bytearray(5)))
        assert server.closed


@deadline(30)
async def check_heads_between_messages(scheme: str) -> None:
    """Heads sent between messages reach `recv_next` (or `recv_head`) as
    (kind, length), a head's body is read with `recv_exactly` after it, and
    messages still land whole and in order. On a byte stream everything
    comes in the order it was sent; on UCX heads keep their order among
    themselves and messages theirs."""
    sent = [("head", KEEPALIVE, b""), ("msg", random_bytes(5 * MiB, seed=31)),
            ("head", HEAD.pack(1, 5), b"hello"), ("msg", random_bytes(7, seed=32)),
            ("head", HEAD.pack(0, 77), b""), ("msg", random_bytes(MiB, seed=33))]
    msgs = [item[1] for item in sent if item[0] == "msg"]
    async with connected_pair(scheme) as (client, server):

        async def sender() -> None:
            async with SendWindow(client) as out:
                for item in sent:
                    if item[0] == "msg":
                        await out.send_message(memoryview(item[1]))
                    else:
                        await out.send(item[1], item[2])

        sending = asyncio.ensure_future(sender())
        dests = [np.zeros(m.nbytes, np.uint8) for m in msgs]
        for d in dests:
            server.post_message(memoryview(d))
        order: list[object] = []
        while len(order) < len(sent):
            got = await server.recv_next()
            if got is None:
                order.append("msg")
                continue
            body = await server.recv_exactly(5) if got == (1, 5) else b""
            order.append((got, body))
        await sending
        heads = [o for o in order if o != "msg"]
        assert heads == [((0, 0), b""), ((1, 5), b"hello"), ((0, 77), b"")]
        for d, m in zip(dests, msgs, strict=True):
            np.testing.assert_array_equal(d, m)
        if client.caps.message_parts:  # a byte stream: one order for everything
            assert order == ["msg" if i[0] == "msg" else ((HEAD.unpack(i[1])), i[2])
                             for i in sent]


@deadline(30)
async def check_heads_and_messages_taken_apart(scheme: str) -> None:
    """One task takes messages (`recv_message`), another heads (`recv_head`),
    each head's body after it: neither takes the other's."""
    msgs = [random_bytes(n, seed=40 + n) for n in (3 * MiB, 10, 1)]
    async with connected_pair(scheme) as (client, server):

        async def sender() -> None:
            async with SendWindow(client) as out:
                for i, m in enumerate(msgs):
                    await out.send(HEAD.pack(1, 3), b"e%02d" % i)
                    await out.send_message(memoryview(m))
                await out.send(HEAD.pack(0, 99))

        async def messages() -> list[np.ndarray]:
            got = []
            for m in msgs:
                dest = np.zeros(m.nbytes, np.uint8)
                await server.recv_message(memoryview(dest))
                got.append(dest)
            return got

        async def heads() -> list:
            got = []
            while True:
                head = await server.recv_head()
                if head == (0, 99):
                    return got
                got.append((head, await server.recv_exactly(head[1])))

        async with asyncio.TaskGroup() as tg:
            tg.create_task(sender())
            taking = tg.create_task(messages())
            reading = tg.create_task(heads())
    for got, m in zip(taking.result(), msgs, strict=True):
        np.testing.assert_array_equal(got, m)
    assert reading.result() == [((1, 3), b"e%02d" % i) for i in range(len(msgs))]


@deadline(30)
async def check_message_parts(scheme: str) -> None:
    """On a byte stream a one-frame message may go in parts as its bytes
    become ready, with heads between them; the receiver's `on_step` follows
    the parts. A message transport sends each frame whole."""
    data = random_bytes(3 * MiB + 17, seed=51)
    async with connected_pair(scheme) as (client, server):
        if not client.caps.message_parts:
            with pytest.raises(NotImplementedError):
                await client.send_message_part(b"x", last=True)
            return
        cuts = [0, 100, MiB, 2 * MiB + 5, data.nbytes]
        dest = np.zeros(data.nbytes, np.uint8)
        marks: list[int] = []
        server.post_message(memoryview(dest), on_step=marks.append, step=1)

        async def sender() -> None:
            for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
                await client.send_message_part(memoryview(data[a:b]), last=b == data.nbytes)
                if b < data.nbytes:
                    await client.send(KEEPALIVE)
                    await asyncio.sleep(0.01 * (i + 1))

        sending = asyncio.ensure_future(sender())
        keepalives = 0
        while (got := await server.recv_next()) is not None:
            assert got == (0, 0)
            keepalives += 1
        await sending
        np.testing.assert_array_equal(dest, data)
        assert keepalives == len(cuts) - 2
        assert marks[-1] == data.nbytes and set(cuts[1:]) <= set(marks)


@deadline(20)
async def check_message_cut_short_by_the_peer(scheme: str) -> None:
    """A peer that closes before a posted message is in: `recv_next` raises
    TransportClosed."""
    async with connected_pair(scheme) as (client, server):
        dest = bytearray(MiB)
        server.post_message(memoryview(dest))
        if client.caps.message_parts:
            await client.send_message_part(bytes(1000), last=False)
        await client.close()
        with pytest.raises(TransportClosed):
            await server.recv_next()


@deadline(10)
async def check_close_wakes_posted_receives(scheme: str) -> None:
    """close() while a message receive is posted and waited for (`recv_next`,
    `recv_message`) or a head is waited for: each raises TransportClosed."""
    for waiting in ("next", "message", "head"):
        async with connected_pair(scheme) as (client, _server):
            if waiting == "next":
                client.post_message(memoryview(bytearray(10)))
                pending = asyncio.ensure_future(client.recv_next())
            elif waiting == "message":
                pending = asyncio.ensure_future(client.recv_message(memoryview(bytearray(10))))
            else:
                pending = asyncio.ensure_future(client.recv_head())
            await asyncio.sleep(0.1)  # (past a UCX recv_next's poll: heads are awaited too)
            assert not pending.done()
            await _close_and_expect_closed(client, pending)
            with pytest.raises(TransportClosed):
                client.post_message(memoryview(bytearray(1)))


@deadline(10)
async def check_a_message_needs_a_frame(scheme: str) -> None:
    """A message of no frames is refused, on both sides, naming the call."""
    async with connected_pair(scheme) as (client, server):
        with pytest.raises(InvalidArgument, match="send_message"):
            await client.send_message()
        with pytest.raises(InvalidArgument, match="post_message"):
            server.post_message()


@deadline(10)
async def check_cancelled_message_receive_never_misplaces_one(scheme: str) -> None:
    """A message receive cancelled before anything arrived must not take the
    next message: the next receive gets it whole, or the stream says it is
    closed (UCX cannot withdraw a posted receive, so it ends the stream)."""
    async with connected_pair(scheme) as (client, server):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await client.recv_message(memoryview(bytearray(5)))
        with contextlib.suppress(TransportClosed):
            await server.send_message(b"first")
            await server.send_message(b"secon")
        dest = bytearray(5)
        try:
            await client.recv_message(memoryview(dest))
        except TransportClosed:
            assert client.closed
        else:
            assert bytes(dest) == b"first"


@deadline(60)
async def check_device_messages(scheme: str) -> None:
    """Device frames (CuPy) land in device buffers where the stream moves
    device memory (`caps.device`); a host-only stream refuses them with
    InvalidArgument, naming the call."""
    import cupy

    host = random_bytes(2 * MiB + 3, seed=61)
    src = cupy.asarray(host)
    async with connected_pair(scheme) as (client, server):
        if not client.caps.device:
            with pytest.raises(InvalidArgument, match="send_message"):
                await client.send_message(src)
            with pytest.raises(InvalidArgument, match="post_message"):
                server.post_message(cupy.empty(4, cupy.uint8))
            return
        dest = cupy.zeros(host.nbytes, cupy.uint8)
        small = np.zeros(5, np.uint8)
        sending = asyncio.ensure_future(client.send_message(src, b"hello"))
        await server.recv_message(dest, memoryview(small))
        await sending
        np.testing.assert_array_equal(cupy.asnumpy(dest), host)
        assert bytes(small) == b"hello"


@deadline(10)
async def check_descriptors(scheme: str) -> None:
    """A same-host stream (`caps.local`) passes a file descriptor with a byte:
    the receiver gets its own descriptor of the same file, and a byte without
    one; other streams cannot (NotImplementedError)."""
    import os

    async with connected_pair(scheme) as (client, server):
        if not client.caps.local:
            with pytest.raises(NotImplementedError):
                await client.send_descriptor(b"F", None, 1)
            with pytest.raises(NotImplementedError):
                await server.recv_descriptor(1)
            return
        fd = os.memfd_create("hoplite-gpu-check")
        try:
            await client.send_descriptor(b"F", fd, 5)
            tag, fds = await server.recv_descriptor(5)
            assert tag == b"F" and len(fds) == 1 and fds[0] != fd
            assert os.fstat(fds[0]).st_ino == os.fstat(fd).st_ino, "another file came"
            os.close(fds[0])
        finally:
            os.close(fd)
        await client.send_descriptor(b"B", None, 5)
        assert await server.recv_descriptor(5) == (b"B", [])
        with pytest.raises(Timeout):
            await server.recv_descriptor(0.1)
        await client.close()
        assert await server.recv_descriptor(5) == (b"", [])  # the peer closed


@deadline(10)
async def check_message_posted_after_it_came(scheme: str) -> None:
    """A message that arrives while only a head is waited for is kept until a
    receive is posted for it, an empty one too, and the head that comes after
    it still reaches its reader. (A byte stream read an empty message's head
    while nothing was posted and, once a receive was, waited for the socket
    to become readable: with nothing more on the wire, for good.)"""
    async with connected_pair(scheme) as (client, server):
        waiting = asyncio.ensure_future(server.recv_head())
        await client.send_message(b"")
        await asyncio.sleep(0.1)  # (it is in before anything is posted for it)
        await server.recv_message(memoryview(bytearray(0)))
        await client.send_message(b"xyz")
        await asyncio.sleep(0.1)
        dest = bytearray(3)
        await server.recv_message(memoryview(dest))
        assert bytes(dest) == b"xyz"
        assert not waiting.done()
        await client.send(KEEPALIVE)
        assert await waiting == (0, 0)


@deadline(20)
async def check_messages_sent_ahead_of_their_receives(scheme: str) -> None:
    """Messages sent long before their receives are posted, two at a time as a
    pull posts them, land whole, the short last one too, and the head after
    them comes. (A byte stream read ahead into a message posted early, then
    waited with its wake-up mark (SO_RCVLOWAT) still at 256 KiB from the long
    message, so the few bytes of the last message and the head, already in
    the socket, never woke it: pulls of 3 MiB + 3 bytes stalled.)"""
    size = 3 * MiB + 3
    data = random_bytes(size, seed=71)
    async with connected_pair(scheme) as (client, server):

        async def sender() -> None:  # (over UCX a large send ends once received)
            async with SendWindow(client) as out:
                for at in range(0, size, MiB):
                    await out.send_message(memoryview(data[at:at + MiB]))
                await out.send(HEAD.pack(0, size))

        sending = asyncio.ensure_future(sender())
        await asyncio.sleep(0.2)  # (a byte stream's bytes are all in before anything is posted)
        dest = np.zeros(size, np.uint8)
        ends: collections.deque[int] = collections.deque()
        posted = landed = 0
        while landed < size:
            while len(ends) < 2 and posted < size:
                upto = min(posted + MiB, size)
                server.post_message(memoryview(dest[posted:upto]))
                ends.append(upto)
                posted = upto
            async with asyncio.timeout(5):
                assert await server.recv_next() is None
            landed = ends.popleft()
        async with asyncio.timeout(5):
            assert await server.recv_next() == (0, size)
        await sending
        np.testing.assert_array_equal(dest, data)


@deadline(30)
async def check_mixed_traffic(scheme: str, seed: int) -> None:
    """Messages of many sizes (empty to over a MiB; on a byte stream sent in
    random parts), keepalive heads between and inside them, pauses on both
    sides, and two receives posted at a time as a pull posts them: every
    message lands whole and in order, every head comes, and no wait stalls
    (each is bounded far below the check's deadline)."""
    rng = np.random.default_rng(seed)
    sizes = [int(rng.choice([0, 1, 100, 64 * 1024 - 1, 64 * 1024, 300_000, MiB + 7]))
             for _ in range(24)]
    data = [random_bytes(n, seed=1000 * seed + i) for i, n in enumerate(sizes)]
    plan = [(float(rng.random()), int(rng.integers(1, 4))) for _ in sizes]
    keepalives = [0]
    async with connected_pair(scheme) as (client, server):

        async def sender() -> None:
            async with SendWindow(client) as out:
                for d, (chance, pieces) in zip(data, plan, strict=True):
                    if chance < 0.3:
                        await out.send(KEEPALIVE)
                        keepalives[0] += 1
                    if chance < 0.2:
                        await asyncio.sleep(0.01)
                    if not client.caps.message_parts or d.nbytes < pieces:
                        await out.send_message(memoryview(d))
                        continue
                    cuts = sorted(set(int(c) for c in rng.integers(1, d.nbytes, pieces - 1)))
                    bounds = [0, *cuts, d.nbytes]
                    for a, b in zip(bounds, bounds[1:], strict=False):
                        await out.send_message_part(memoryview(d[a:b]), last=b == d.nbytes)
                        if b < d.nbytes and chance < 0.5:
                            await out.send(KEEPALIVE)
                            keepalives[0] += 1
                await out.send(HEAD.pack(0, 12345))

        sending = asyncio.ensure_future(sender())
        dests = [np.zeros(n, np.uint8) for n in sizes]
        posted = landed = heads = 0
        while True:
            while posted < len(sizes) and posted - landed < 2:
                server.post_message(memoryview(dests[posted]))
                posted += 1
            if rng.random() < 0.2:
                await asyncio.sleep(0.005)
            async with asyncio.timeout(5):
                got = await server.recv_next()
            if got is None:
                landed += 1
            elif got == (0, 12345):
                break
            else:
                assert got == (0, 0), got
                heads += 1
        while landed < len(sizes):  # (over UCX the last head may pass messages)
            async with asyncio.timeout(5):
                assert await server.recv_next() is None
            landed += 1
        await sending
        for d, want in zip(dests, data, strict=True):
            np.testing.assert_array_equal(d, want)
        assert heads == keepalives[0], f"{heads} heads came of {keepalives[0]} sent"
