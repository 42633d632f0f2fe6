"""Pulls answered in messages, on every transport.

A pull asks for its bytes in messages of its chunk size; the sender sends
each as its bytes become ready (over a byte stream in parts, as they do;
over UCX whole), keepalive frames while it waits, and a data frame header
with the byte count at the end (docs/protocol.md, "Data connections").
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
import transport_checks as tc

from hoplite_gpu.auth import client_handshake, new_token
from hoplite_gpu.config import Config
from hoplite_gpu.errors import ObjectNotFound, TransportClosed
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.node import transfer
from hoplite_gpu.node.store import ChunkStore
from hoplite_gpu.protocol import FRAME_ERROR, recv_error_body, recv_frame_header, send_msg
from hoplite_gpu.transports import SendWindow, get_backend, usable
from hoplite_gpu.values import to_buffer

MiB = 1 << 20

needs_ucx = pytest.mark.skipif(not usable("ucx"), reason="ucxx is not installed")
by_scheme = pytest.mark.parametrize("scheme", tc.scheme_params())


@needs_ucx
def test_messages_keep_their_order_beside_headed_sends():
    """Messages arrive in order and whole, interleaved with ordinary sends
    that go their own way (UCX: lanes apart), through a window of three."""
    sizes = [1, 5 * MiB, 7, 2 * MiB + 3, 64 * 1024, 1]
    bare = [tc.random_bytes(n, seed=i) for i, n in enumerate(sizes)]
    headed = [tc.random_bytes(n, seed=100 + i) for i, n in enumerate(reversed(sizes))]

    async def main():
        async with tc.connected_pair("ucx") as (client, server):
            assert not client.caps.message_parts  # each frame whole, on its own lane

            async def sender():
                async with SendWindow(client, 3) as out:
                    for b, h in zip(bare, headed, strict=True):
                        await out.send_message(memoryview(b))
                        await out.send(memoryview(h))

            async def bare_receiver():
                for b in bare:
                    got = np.empty(b.nbytes, np.uint8)
                    await server.recv_message(memoryview(got))
                    np.testing.assert_array_equal(got, b)

            async def headed_receiver():
                for h in headed:
                    got = np.empty(h.nbytes, np.uint8)
                    await server.recv_into(memoryview(got))
                    np.testing.assert_array_equal(got, h)

            async with asyncio.timeout(30), asyncio.TaskGroup() as tg:
                tg.create_task(sender())
                tg.create_task(bare_receiver())
                tg.create_task(headed_receiver())

    asyncio.run(main())


@needs_ucx
def test_a_message_larger_than_the_buffer_ends_the_stream():
    async def main():
        async with tc.connected_pair("ucx") as (client, server):
            await client.send_message(b"0123456789")
            with pytest.raises(TransportClosed):
                async with asyncio.timeout(10):
                    await server.recv_message(bytearray(4))
            assert server.closed

    asyncio.run(main())


async def _serving(config: Config):
    token = new_token()
    store = ChunkStore()
    server = transfer.DataServer(store, token, config)
    await server.start()
    return token, store, server


def _object(store: ChunkStore, size: int, ready: int):
    value = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    buf, layout = to_buffer(value)
    obj = store.create(ObjectID.random(), layout)
    obj.buffer[:] = np.frombuffer(buf, dtype=np.uint8)
    obj.advance(ready)
    return obj, value


def _messages_in(caplog) -> list:
    return [r for r in caplog.records if "message of" in r.getMessage()
            and r.getMessage().endswith(" in")]


@by_scheme
def test_a_pull_is_answered_in_messages_with_keepalives_while_bytes_come(scheme, caplog):
    """The sender's copy is partial and grows slowly: it sends keepalives while
    it waits (stall timeout 0.6 s, bytes every 0.8 s), a message per chunk
    (over TCP in parts, as its bytes come), and the end marker; the puller's
    copy is byte-identical."""
    config = Config(transport=scheme, chunk_size=MiB, stall_timeout_s=0.6, timeout_s=10.0,
                    shared_memory=False)

    async def main():
        token, store, server = await _serving(config)
        size = 3 * MiB + 123
        obj, value = _object(store, size, MiB)
        mine = ChunkStore()
        copy = mine.create(obj.oid, obj.layout)
        pool = transfer.PeerPool(token, config)
        seen = []

        async def grow():
            for upto in (2 * MiB, 3 * MiB, size):
                await asyncio.sleep(0.8)
                obj.advance(upto)

        grower = asyncio.create_task(grow())
        try:
            with caplog.at_level(logging.DEBUG, logger="hoplite_gpu.transfer"):
                async with asyncio.timeout(20):
                    await transfer.fetch_range(pool, server.address, copy, size, config,
                                               seen.append)
        finally:
            await grower
        assert len(_messages_in(caplog)) == 4  # the puller took 4 messages
        np.testing.assert_array_equal(np.asarray(copy.buffer), value)
        assert seen == [MiB, 2 * MiB, 3 * MiB, size]  # one message per chunk, in order
        # The connection went back to the pool, in step: a second pull reuses it.
        again = mine.create(ObjectID.random(), obj.layout)
        store._objects[again.oid] = obj  # the same bytes under another id, complete
        async with asyncio.timeout(20):
            await transfer.fetch_range(pool, server.address, again, size, config, lambda _: None)
        np.testing.assert_array_equal(np.asarray(again.buffer), value)
        await pool.close()
        await server.close()

    asyncio.run(main())


@by_scheme
def test_an_answer_cut_short_by_an_error_frame_fails_the_pull(scheme):
    """The object leaves the sender's store half-way: the puller gets the
    error frame (ObjectNotFound) instead of waiting for bytes that never come."""
    config = Config(transport=scheme, chunk_size=MiB, stall_timeout_s=3.0, timeout_s=10.0,
                    shared_memory=False)

    async def main():
        token, store, server = await _serving(config)
        size = 4 * MiB
        obj, _ = _object(store, size, MiB)
        copy = ChunkStore().create(obj.oid, obj.layout)
        pool = transfer.PeerPool(token, config)

        async def drop():
            await asyncio.sleep(0.3)
            store.remove(obj.oid, ObjectNotFound("deleted while it was being pulled"))

        dropper = asyncio.create_task(drop())
        with pytest.raises(ObjectNotFound, match="deleted while"):
            async with asyncio.timeout(20):
                await transfer.fetch_range(pool, server.address, copy, size, config,
                                           lambda _: None)
        await dropper
        assert copy.ready == MiB  # what came before the error stays counted
        await pool.close()
        await server.close()

    asyncio.run(main())


@by_scheme
@pytest.mark.parametrize("bare", [0, -1, "lots", 1.5])
def test_a_sender_refuses_a_bad_message_size(scheme, bare):
    config = Config(transport=scheme, shared_memory=False)

    async def main():
        token, store, server = await _serving(config)
        obj, _ = _object(store, MiB, MiB)
        stream = await get_backend(scheme).connect(server.address, 10)
        await client_handshake(stream, token, 10)
        await send_msg(stream, {"op": "pull", "oid": obj.oid.binary, "offset": 0,
                                "end": MiB, "bare": bare})
        async with asyncio.timeout(10):
            kind, n = await recv_frame_header(stream)
            assert kind == FRAME_ERROR
            assert (await recv_error_body(stream, n))["error"] == "ProtocolError"
        await stream.close()
        await server.close()

    asyncio.run(main())


@by_scheme
def test_a_host_pull_takes_one_message_per_chunk(scheme, caplog):
    """A host object's pull is answered in messages on every transport (over
    UCX too, where frames were the default before): one per chunk, and no
    frame carries bytes."""
    config = Config(transport=scheme, chunk_size=MiB, shared_memory=False)

    async def main():
        token, store, server = await _serving(config)
        obj, value = _object(store, 2 * MiB + 5, 2 * MiB + 5)
        copy = ChunkStore().create(obj.oid, obj.layout)
        pool = transfer.PeerPool(token, config)
        with caplog.at_level(logging.DEBUG, logger="hoplite_gpu.transfer"):
            async with asyncio.timeout(20):
                await transfer.fetch_range(pool, server.address, copy, obj.size, config,
                                           lambda _: None)
        np.testing.assert_array_equal(np.asarray(copy.buffer), value)
        assert len(_messages_in(caplog)) == 3
        assert not [r for r in caplog.records if "frame of" in r.getMessage()]
        await pool.close()
        await server.close()

    asyncio.run(main())


def test_a_relay_over_a_byte_stream_serves_a_message_before_it_is_whole():
    """Over TCP a message goes in parts as its sender's bytes become ready, and
    the puller's watermark follows the parts: with 4 MiB chunks and a sender
    that has only 1 MiB so far, the puller holds (and a relay of it could
    serve) that MiB long before the chunk is whole, not a whole chunk later."""
    config = Config(transport="tcp", chunk_size=4 * MiB, stall_timeout_s=2.0, timeout_s=10.0,
                    shared_memory=False)

    async def main():
        token, store, server = await _serving(config)
        size = 8 * MiB
        obj, value = _object(store, size, MiB)
        copy = ChunkStore().create(obj.oid, obj.layout)
        pool = transfer.PeerPool(token, config)
        pulling = asyncio.ensure_future(transfer.fetch_range(
            pool, server.address, copy, size, config, lambda _: None))
        try:
            async with asyncio.timeout(5):
                while copy.ready < MiB:
                    await asyncio.sleep(0.01)
            assert copy.ready == MiB, "more than the sender had"
            obj.advance(size)
            async with asyncio.timeout(10):
                await pulling
        finally:
            if not pulling.done():
                pulling.cancel()
            await asyncio.gather(pulling, return_exceptions=True)
        np.testing.assert_array_equal(np.asarray(copy.buffer), value)
        await pool.close()
        await server.close()

    asyncio.run(main())


@by_scheme
def test_an_empty_range_is_answered_with_nothing(scheme):
    """A pull of no bytes gets no answer, and the connection stays in step:
    the next pull on it gets its bytes."""
    config = Config(transport=scheme, chunk_size=MiB, shared_memory=False)

    async def main():
        token, store, server = await _serving(config)
        obj, value = _object(store, 2 * MiB, 2 * MiB)
        pool = transfer.PeerPool(token, config)
        empty = ChunkStore().create(obj.oid, obj.layout)
        async with asyncio.timeout(10):
            await transfer.fetch_range(pool, server.address, empty, 0, config, lambda _: None,
                                       start=0)
            copy = ChunkStore().create(obj.oid, obj.layout)
            await transfer.fetch_range(pool, server.address, copy, obj.size, config,
                                       lambda _: None)
        np.testing.assert_array_equal(np.asarray(copy.buffer), value)
        assert sum(len(v) for v in pool._idle.values()) == 1, "one connection, reused"
        await pool.close()
        await server.close()

    asyncio.run(main())


def test_a_message_slower_than_the_stall_timeout_is_not_a_stall():
    """A pull's stall timeout ran per message: a 4 MiB message that took
    longer than `stall_timeout_s` to arrive on a busy link failed the pull as
    a stalled sender though its bytes kept coming (on the emulated leaf-spine,
    ring allreduces whose flows shared an uplink failed over 4 to 18 times a
    run). The timeout now counts from the last step of a message heard: a
    1 MiB message sent in 64 KiB parts every 0.05 s (1.2 s in all, no
    keepalive) against a stall timeout of 0.5 s arrives whole; a sender that
    then goes quiet still trips it."""
    from hoplite_gpu.node.pull_modes import Messages
    from hoplite_gpu.protocol import FRAME, FRAME_DATA

    config = Config(transport="tcp", chunk_size=MiB, stall_timeout_s=0.5, timeout_s=10.0,
                    shared_memory=False)
    part = 64 << 10

    class Landed:
        def __init__(self):
            self.at = 0

        def advance(self, pos: int) -> None:
            self.at = max(self.at, pos)

    async def main():
        store = ChunkStore()
        value = np.random.default_rng(7).integers(0, 256, 2 * MiB, dtype=np.uint8)
        obj, _ = _object(store, 2 * MiB, 0)
        async with tc.connected_pair("tcp") as (client, server):
            assert client.caps.message_parts

            async def trickle(upto: int, end: bool) -> None:
                for at in range(0, upto, part):
                    await asyncio.sleep(0.05)
                    await client.send_message_part(memoryview(value[at:at + part]),
                                                   last=end and at + part >= upto)
                if end:
                    await client.send(FRAME.pack(FRAME_DATA, upto))

            sink = Landed()
            pull = Messages(server, obj, sink, 0, MiB, "tcp://test", config, lambda _: None)
            sender = asyncio.create_task(trickle(MiB, end=True))
            async with asyncio.timeout(10):
                assert await pull.receive()
            await sender
            assert sink.at == MiB
            np.testing.assert_array_equal(np.asarray(obj.buffer[:MiB]), value[:MiB])

            # the second MiB: half of it, then silence: a stall, after about 0.5 s
            quiet = Messages(server, obj, Landed(), MiB, 2 * MiB, "tcp://test", config,
                             lambda _: None)
            half = asyncio.create_task(trickle(MiB // 2, end=False))  # (the message unended)
            await half
            loop = asyncio.get_running_loop()
            began = loop.time()
            with pytest.raises(Exception, match="sent nothing for 0.5s"):
                async with asyncio.timeout(10):
                    await quiet.receive()
            assert loop.time() - began < 2.0

    asyncio.run(main())
