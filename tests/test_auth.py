"""The mutual HMAC handshake (hoplite_gpu.auth) over every usable transport."""

import asyncio
import time

import msgpack
import pytest
import transport_checks as tc

from hoplite_gpu.auth import PROTOCOL_VERSION, client_handshake, new_token, server_handshake
from hoplite_gpu.errors import AuthenticationFailed, ProtocolError, Timeout, TransportClosed
from hoplite_gpu.protocol import pack, recv_msg, send_msg
from hoplite_gpu.transports import Stream

by_scheme = pytest.mark.parametrize("scheme", tc.scheme_params())
HANDSHAKE_TIMEOUT = 5.0


class RecordingStream(tc.BytesOnly):
    """Wraps a stream and keeps a copy of every byte sent and received through it."""

    def __init__(self, inner: Stream) -> None:
        self.inner, self.peer = inner, inner.peer
        self.sent, self.received = bytearray(), bytearray()

    async def send(self, *buffers) -> None:
        for buf in buffers:
            self.sent += bytes(buf)
        await self.inner.send(*buffers)

    async def recv_into(self, buffer: memoryview) -> None:
        await self.inner.recv_into(buffer)
        self.received += bytes(buffer)

    async def close(self) -> None:
        await self.inner.close()

    @property
    def closed(self) -> bool:
        return self.inner.closed


def run(coro, seconds: float = 10) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(seconds):
            await coro

    asyncio.run(bounded())


async def both_sides(scheme: str, client_token: str, server_token: str, record: bool = False):
    """Run both handshakes concurrently; return (client outcome, server outcome, streams)."""
    async with tc.connected_pair(scheme) as (client, server):
        if record:
            client, server = RecordingStream(client), RecordingStream(server)
        outcomes = await asyncio.gather(
            client_handshake(client, client_token, HANDSHAKE_TIMEOUT),
            server_handshake(server, server_token, HANDSHAKE_TIMEOUT),
            return_exceptions=True,
        )
    return outcomes[0], outcomes[1], (client, server)


@by_scheme
def test_same_token_succeeds(scheme):
    async def body() -> None:
        token = new_token()
        client, server, _ = await both_sides(scheme, token, token)
        assert client is None and server is None, (client, server)

    run(body())


@by_scheme
def test_wrong_token_fails_on_both_sides(scheme):
    async def body() -> None:
        t0 = time.monotonic()
        client, server, _ = await both_sides(scheme, new_token(), new_token())
        assert time.monotonic() - t0 < HANDSHAKE_TIMEOUT, "a wrong token must not wait for a timeout"
        assert isinstance(client, AuthenticationFailed), repr(client)
        assert isinstance(server, AuthenticationFailed), repr(server)
        assert "token" in str(client) and "HOPLITE_TOKEN" in str(client), str(client)
        assert "token" in str(server), str(server)

    run(body())


@by_scheme
def test_token_never_on_the_wire(scheme):
    async def body() -> None:
        token = new_token()
        client, server, (c, s) = await both_sides(scheme, token, token, record=True)
        assert client is None and server is None, (client, server)
        assert c.sent and s.sent
        assert bytes(c.sent) == bytes(s.received) and bytes(s.sent) == bytes(c.received)
        for wire in (bytes(c.sent), bytes(s.sent)):
            assert token.encode() not in wire
        # Also on a failed attempt, where a careless implementation might echo it back.
        wrong = new_token()
        _, _, (c, s) = await both_sides(scheme, wrong, token, record=True)
        for wire in (bytes(c.sent), bytes(s.sent)):
            assert token.encode() not in wire and wrong.encode() not in wire

    run(body())


@by_scheme
def test_nonces_are_fresh(scheme):
    """Two handshakes never reuse the server's challenge, so a recorded answer can't be replayed."""

    async def hello(scheme: str) -> bytes:
        async with tc.connected_pair(scheme) as (client, server):
            task = asyncio.ensure_future(server_handshake(server, "t", HANDSHAKE_TIMEOUT))
            msg = await recv_msg(client)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert msg["version"] == PROTOCOL_VERSION
        return msg["nonce"]

    async def body() -> None:
        assert await hello(scheme) != await hello(scheme)

    run(body())


@by_scheme
def test_silent_peer_times_out(scheme):
    async def body() -> None:
        async with tc.connected_pair(scheme) as (_client, server):
            t0 = time.monotonic()
            with pytest.raises(Timeout) as info:
                await server_handshake(server, new_token(), 0.3)
            elapsed = time.monotonic() - t0
        assert 0.25 <= elapsed < 1.5, elapsed
        assert "0.3" in str(info.value)

    run(body())


@by_scheme
def test_silent_server_times_out(scheme):
    async def body() -> None:
        async with tc.connected_pair(scheme) as (client, _server):
            with pytest.raises(Timeout):
                await client_handshake(client, new_token(), 0.3)

    run(body())


GARBAGE = [
    pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", id="http"),
    pytest.param(b"SSH-2.0-OpenSSH_9.6\r\n", id="ssh"),
    pytest.param(b"\x00\x00\x00\x05hello", id="bad-msgpack"),
    pytest.param(pack({"nonce": 5, "mac": "not bytes"}), id="wrong-types"),
    pytest.param(b"\x00\x00\x00\x03" + msgpack.packb([1, 2]), id="not-a-map"),
]


@by_scheme
@pytest.mark.parametrize("garbage", GARBAGE)
def test_server_rejects_garbage(scheme, garbage):
    async def body() -> None:
        async with tc.connected_pair(scheme) as (client, server):
            await client.send(garbage)
            with pytest.raises(ProtocolError):
                await server_handshake(server, new_token(), HANDSHAKE_TIMEOUT)

    run(body())


SERVER_GARBAGE = [
    pytest.param(b"SSH-2.0-OpenSSH_9.6\r\n", id="ssh"),
    pytest.param(pack({"hello": "someone-else", "version": 1, "nonce": b"x" * 32}), id="not-hoplite"),
    pytest.param(pack({"hello": "hoplite-gpu", "version": 999, "nonce": b"x" * 32}), id="version"),
    pytest.param(
        pack({"hello": "hoplite-gpu", "version": PROTOCOL_VERSION}),
        id="no-nonce",
    ),
    pytest.param(
        pack({"hello": "hoplite-gpu", "version": PROTOCOL_VERSION, "nonce": 7}),
        id="int-nonce",
    ),
]


@by_scheme
@pytest.mark.parametrize("garbage", SERVER_GARBAGE)
def test_client_rejects_garbage(scheme, garbage):
    async def body() -> None:
        async with tc.connected_pair(scheme) as (client, server):
            await server.send(garbage)
            with pytest.raises(ProtocolError):
                await client_handshake(client, new_token(), HANDSHAKE_TIMEOUT)

    run(body())


@by_scheme
def test_client_rejects_impostor_server(scheme):
    """A server that says ok without knowing the token is caught by the server MAC check."""

    async def body() -> None:
        async with tc.connected_pair(scheme) as (client, server):

            async def impostor() -> None:
                await send_msg(server, {"hello": "hoplite-gpu", "version": PROTOCOL_VERSION, "nonce": b"n" * 32})
                await recv_msg(server)
                await send_msg(server, {"ok": True, "mac": b"\0" * 32})

            task = asyncio.ensure_future(impostor())
            with pytest.raises(AuthenticationFailed) as info:
                await client_handshake(client, new_token(), HANDSHAKE_TIMEOUT)
            await task
        assert "token" in str(info.value)

    run(body())


@by_scheme
def test_server_hangs_up_during_auth(scheme):
    """A peer that closes instead of answering has died or gone away: TransportClosed,
    which pullers treat as a lost peer (a refusal always sends a verdict first)."""

    async def body() -> None:
        async with tc.connected_pair(scheme) as (client, server):

            async def hang_up() -> None:
                await send_msg(server, {"hello": "hoplite-gpu", "version": PROTOCOL_VERSION, "nonce": b"n" * 32})
                await recv_msg(server)
                await server.close()

            task = asyncio.ensure_future(hang_up())
            with pytest.raises(TransportClosed, match="during the handshake"):
                await client_handshake(client, new_token(), HANDSHAKE_TIMEOUT)
            await task

    run(body())
