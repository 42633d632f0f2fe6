"""Control-connection framing: read_messages (many messages per receive) and
Outbox (write at once, queue the rest, keep the order), on a scripted stream
whose receive and send sizes the test chooses, and over every real transport."""

from __future__ import annotations

import asyncio
import time

import pytest

import tests.transport_checks as tc
from hoplite_gpu.errors import ProtocolError, Timeout, TransportClosed, TransportError
from hoplite_gpu.protocol import MAX_MESSAGE, Outbox, pack, read_messages
from hoplite_gpu.transports import Stream, get_backend


class Scripted(tc.BytesOnly):
    """A byte stream fed from `data`, at most `piece` bytes per receive; sends
    take at most `takes` bytes at once (None: everything) and record the rest."""

    partial_receive = True

    def __init__(self, data: bytes = b"", piece: int = 1 << 30, takes: int | None = None) -> None:
        self.data, self.piece, self.takes = bytearray(data), piece, takes
        self.receives = 0
        self.sent = bytearray()
        self.waited_sends = 0
        self.fail_send: Exception | None = None
        self._closed = False
        self.peer = "scripted"

    async def recv_some(self, buffer: memoryview) -> int:
        if not self.data:
            raise TransportClosed("scripted stream ended")
        self.receives += 1
        n = min(len(buffer), self.piece, len(self.data))
        buffer[:n] = self.data[:n]
        del self.data[:n]
        return n

    async def recv_into(self, buffer: memoryview) -> None:
        got = 0
        while got < len(buffer):
            got += await self.recv_some(buffer[got:])

    def send_nowait(self, data) -> int:
        if self.fail_send is not None:
            raise self.fail_send
        n = len(data) if self.takes is None else min(self.takes, len(data))
        self.sent += bytes(data[:n])
        return n

    async def send(self, *buffers) -> None:
        if self.fail_send is not None:
            raise self.fail_send
        self.waited_sends += 1
        await asyncio.sleep(0)
        for b in buffers:
            self.sent += bytes(b)

    async def close(self) -> None:
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed


def _msgs(n: int, size: int = 10) -> list[dict]:
    return [{"op": "x", "i": i, "blob": bytes([i % 256]) * size} for i in range(n)]


def _read_all(stream: Stream, count: int, size: int = 64 * 1024) -> list[dict]:
    """Every message until the scripted stream ends, which must be after `count`."""
    got: list[dict] = []

    async def go():
        with pytest.raises(TransportClosed):
            await read_messages(stream, got.append, size)
    asyncio.run(go())
    assert len(got) == count
    return got


def test_a_burst_of_messages_is_one_receive():
    msgs = _msgs(200)
    stream = Scripted(b"".join(pack(m) for m in msgs))
    assert _read_all(stream, 200) == msgs
    assert stream.receives == 1


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_messages_split_anywhere_are_reassembled(piece):
    msgs = _msgs(50, size=333)
    stream = Scripted(b"".join(pack(m) for m in msgs), piece=piece)
    assert _read_all(stream, 50, size=4096) == msgs


def test_messages_larger_than_the_buffer_and_wrapping_the_end():
    msgs = [{"i": 0, "b": b"a" * 3000}, {"i": 1, "b": b"b" * 100_000}, {"i": 2, "b": b"c" * 900},
            {"i": 3, "b": b"d" * 4000}, {"i": 4, "b": b""}]
    for piece in (5000, 1 << 20):
        stream = Scripted(b"".join(pack(m) for m in msgs), piece=piece)
        assert _read_all(stream, len(msgs), size=4096) == msgs


def test_an_oversized_or_undecodable_message_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="exceeds"):
        _read_all(Scripted((MAX_MESSAGE + 1).to_bytes(4, "big")), 1)
    with pytest.raises(ProtocolError, match="undecodable"):
        _read_all(Scripted(b"\x00\x00\x00\x01\xc1"), 1)
    with pytest.raises(ProtocolError, match="expected a map"):
        _read_all(Scripted(b"\x00\x00\x00\x01\x05"), 1)


def test_a_large_announced_length_allocates_with_the_bytes_that_come():
    """A peer that announced a message of MAX_MESSAGE (64 MiB) and sent a few
    bytes of it made the reader allocate all 64 MiB at once (the framer
    resized its buffer to the announced length): found by fuzzing an
    authenticated directory connection. The buffer now grows with the bytes
    received, and a large message still arrives whole."""
    from hoplite_gpu import protocol

    sizes: list[int] = []
    real = protocol._Framer._resize

    def resize(self, size):
        sizes.append(size)
        real(self, size)

    head = (MAX_MESSAGE - 10).to_bytes(4, "big")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(protocol._Framer, "_resize", resize)
        assert _read_all(Scripted(head + b"\x80" * 1000), 0, size=4096) == []
        assert max(sizes, default=0) <= 2 * 4096, sizes
        sizes.clear()
        msg = {"b": b"z" * (3 << 20)}
        assert _read_all(Scripted(pack(msg), piece=64 << 10), 1, size=4096) == [msg]
        assert max(sizes) == len(pack(msg))  # (grown to the message, no further)


def test_a_stream_that_ends_mid_message_is_closed():
    data = pack({"a": 1}) + pack({"b": b"x" * 100})[:50]
    assert _read_all(Scripted(data), 1) == [{"a": 1}]


def test_the_handlers_error_ends_the_reading_and_reaches_the_caller():
    stream = Scripted(b"".join(pack(m) for m in _msgs(5)))
    seen = []

    def handle(msg):
        seen.append(msg["i"])
        if msg["i"] == 2:
            raise KeyError("boom")

    async def go():
        with pytest.raises(KeyError, match="boom"):
            await read_messages(stream, handle)
    asyncio.run(go())
    assert seen == [0, 1, 2]


@pytest.mark.parametrize("takes", [None, 0, 1, 13])
def test_outbox_keeps_the_order_whatever_the_stream_takes_at_once(takes):
    msgs = _msgs(40, size=50)

    async def go():
        stream = Scripted(takes=takes)
        lost = []
        out = Outbox(stream, lost.append)
        for m in msgs[:20]:
            out.post(m)
        await asyncio.sleep(0.01)
        for m in msgs[20:]:
            out.post(m)
        out.finish()
        out.post({"after": "finish"})  # dropped, never sent
        await out.drain(5)
        out.post({"after": "drain"})
        assert not lost
        return stream
    stream = asyncio.run(go())
    assert bytes(stream.sent) == b"".join(pack(m) for m in msgs)  # in order, nothing after finish
    if takes is None:
        assert stream.waited_sends == 0  # everything went out without a task switch


def test_outbox_failure_is_reported_once_and_later_posts_are_dropped():
    async def go():
        stream = Scripted(takes=0)
        lost = []
        out = Outbox(stream, lost.append)
        out.post({"a": 1})
        stream.fail_send = TransportClosed("gone")
        out.post({"a": 2})
        await asyncio.sleep(0.01)
        out.post({"a": 3})
        stream.fail_send = None
        out.post({"a": 4})
        await asyncio.sleep(0.01)
        await out.close()
        return stream, lost, out
    stream, lost, out = asyncio.run(go())
    assert len(lost) == 1 and isinstance(lost[0], TransportClosed)
    assert out.failed is lost[0]
    assert stream.sent == b""


class Stuck(Scripted):
    """A peer that takes nothing: the first bytes fit, every later send waits."""

    async def send(self, *buffers) -> None:
        await asyncio.sleep(3600)


def test_an_outbox_cuts_off_a_peer_that_takes_nothing_for_stall_s():
    async def go():
        stream = Stuck(takes=0)
        lost = []
        out = Outbox(stream, lost.append, stall_s=0.2)
        out.post({"a": 1})
        out.post({"a": 2})
        await asyncio.sleep(0.5)
        out.post({"a": 3})  # dropped
        await out.close()
        return stream, lost, out
    stream, lost, out = asyncio.run(go())
    assert len(lost) == 1 and isinstance(lost[0], Timeout)
    assert stream.closed, "the stream of a peer cut off is closed, so its reader ends too"


class Slow(Scripted):
    """A peer that reads steadily at `rate` bytes a second."""

    rate = 8 << 20

    async def send(self, *buffers) -> None:
        for b in buffers:
            await asyncio.sleep(len(b) / self.rate)
            self.sent += bytes(b)


def test_an_outbox_keeps_a_slow_but_steady_reader_of_a_large_message():
    """A 4 MiB reply read at 8 MiB/s takes 0.5 s, longer than the 0.2 s stall
    deadline, but bytes flow all along: the peer is not stuck, and used to be
    cut off (the deadline timed the whole message)."""
    big = {"big": b"q" * (4 << 20)}

    async def go():
        stream = Slow(takes=0)
        lost = []
        out = Outbox(stream, lost.append, stall_s=0.2)
        out.post(big)
        out.post({"after": 1})
        out.finish()
        await out.drain(5)
        await out.close()
        return stream, lost
    stream, lost = asyncio.run(go())
    assert not lost, lost
    assert bytes(stream.sent) == pack(big) + pack({"after": 1})


def test_an_outbox_cuts_off_a_peer_that_lets_too_much_pile_up():
    async def go():
        stream = Stuck(takes=0)
        lost = []
        out = Outbox(stream, lost.append, limit=1000, stall_s=5.0)
        for i in range(30):  # a burst over the limit: not cut (the peer may be reading)
            out.post({"i": i, "blob": b"x" * 100})
        assert not lost
        await asyncio.sleep(0.5)
        assert not lost
        await asyncio.sleep(1.0)  # nothing taken for a second after the burst: cut
        assert lost
        out.post({"i": 30})  # dropped
        await out.close()
        return stream, lost, out
    stream, lost, out = asyncio.run(go())
    assert len(lost) == 1 and isinstance(lost[0], TransportError)
    assert "cut off" in str(lost[0]) and stream.closed


def _burst_reaches_a_reader(stream: Scripted, post) -> None:
    """`post(out, msgs)` posts 30 messages over an outbox's 1,000-byte limit to
    `stream`, a peer that reads: none may be cut off, all must arrive in order."""
    async def go():
        lost = []
        out = Outbox(stream, lost.append, limit=1000, stall_s=5.0)
        msgs = [{"i": i, "blob": b"x" * 100} for i in range(30)]
        await post(out, msgs)
        out.finish()
        await out.drain(5)
        await out.close()
        return lost, msgs
    lost, msgs = asyncio.run(go())
    assert not lost, lost
    assert bytes(stream.sent) == b"".join(pack(m) for m in msgs)


def test_a_burst_that_takes_its_poster_over_a_second_does_not_cut_a_reading_peer():
    """The pile-up cut-off timed a second from the last write that ended, and
    judged it in `post`: a poster that took over a second to post a burst
    past the limit (a node announcing 20 inline 16 MiB objects after a
    directory restart, on a slow machine) gave the writer no turn to send,
    and cut its own healthy connection to the directory. Now the second is
    timed from the end of the burst."""
    async def post(out, msgs):
        for i, m in enumerate(msgs):
            out.post(m)
            if i == 15:
                time.sleep(1.2)  # the poster busy mid-burst, over the limit, the writer unrun
    _burst_reaches_a_reader(Scripted(takes=10), post)  # (the first bytes go at once)


class Paced(Scripted):
    """A peer that reads steadily: each write takes a moment."""

    async def send(self, *buffers) -> None:
        await asyncio.sleep(0.001)
        for b in buffers:
            self.sent += bytes(b)


def test_a_pile_up_check_the_busy_loop_ran_late_does_not_cut_a_reading_peer():
    """A poster that yielded once mid-burst (arming the pile-up check) and
    then held the loop for over a second: the check, run late in the same
    turn as the socket's readiness, found no progress yet (the writer
    resumes a turn or more later) and cut a peer that reads."""
    async def post(out, msgs):
        for m in msgs[:20]:
            out.post(m)
        await asyncio.sleep(0)  # the poster yields once: the check is armed
        for m in msgs[20:]:
            out.post(m)
        time.sleep(1.2)  # ... then its next step holds the loop
    _burst_reaches_a_reader(Paced(takes=10), post)


@pytest.mark.parametrize("scheme", tc.scheme_params())
def test_reader_and_outbox_over_a_real_transport(scheme):
    """Bursts both ways, small and large, through a real connection."""
    msgs = _msgs(300, size=100) + [{"big": b"z" * (1 << 20)}] + _msgs(50, size=5000)

    async def go():
        backend = get_backend(scheme)
        echoed = asyncio.get_running_loop().create_future()

        async def handler(stream):
            stream.authenticated()  # (no handshake here: its large messages may be staged)
            # (a stall deadline: large messages go out in pieces, each timed)
            out = Outbox(stream, lambda exc: None, stall_s=30.0)
            echo = asyncio.get_running_loop().create_task(read_messages(stream, out.post))
            await asyncio.sleep(0)
            await echoed
            echo.cancel()
            out.finish()
            await out.drain(10)
            await asyncio.sleep(1)

        listener = await backend.listen(tc.HOST, 0, handler)
        try:
            stream = await backend.connect(listener.address, tc.CONNECT_TIMEOUT)
            stream.authenticated()
            out = Outbox(stream, lambda exc: None)
            got: list[dict] = []

            def collect(msg):
                got.append(msg)
                if len(got) == len(msgs):
                    echoed.set_result(True)
            reading = asyncio.get_running_loop().create_task(read_messages(stream, collect))
            for m in msgs:
                out.post(m)
            async with asyncio.timeout(30):
                await echoed
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            await out.close()
            await stream.close()
            return got
        finally:
            await listener.close()
    assert asyncio.run(go()) == msgs


@pytest.mark.parametrize("scheme", tc.scheme_params())
def test_reading_ends_cleanly_when_the_peer_goes_or_the_stream_is_closed(scheme):
    """The two ways a control connection's reading ends: the peer closes after
    half a message (the whole messages before it are handed over, then
    TransportClosed), and a close of our own stream from another task (the
    reader must wake with TransportClosed, not hang)."""
    msgs = _msgs(3, size=200)

    async def go():
        backend = get_backend(scheme)
        served = asyncio.get_running_loop().create_future()

        connections = []

        async def handler(stream):
            connections.append(stream)
            if len(connections) > 1:  # the second: says nothing, the client closes it
                await asyncio.sleep(10)
                return
            for m in msgs:
                await stream.send(pack(m))
            await stream.send(pack({"cut": b"y" * 500})[:100])
            await asyncio.sleep(0.2)
            await stream.close()
            served.set_result(True)

        listener = await backend.listen(tc.HOST, 0, handler)
        try:
            got: list[dict] = []
            stream = await backend.connect(listener.address, tc.CONNECT_TIMEOUT)
            async with asyncio.timeout(10):
                with pytest.raises(TransportClosed):
                    await read_messages(stream, got.append)
            await served
            await stream.close()

            second = await backend.connect(listener.address, tc.CONNECT_TIMEOUT)
            ours: list[dict] = []
            reading = asyncio.get_running_loop().create_task(read_messages(second, ours.append))
            await asyncio.sleep(0.1)
            assert not reading.done()
            await second.close()
            async with asyncio.timeout(10):
                with pytest.raises(TransportClosed):
                    await reading
            return got
        finally:
            await listener.close()

    assert asyncio.run(go()) == msgs
