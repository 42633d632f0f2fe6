"""Bare messages (one buffer, no head) and pulls answered in them, over UCX.

With `bare_pulls` on, a pull over a transport with bare messages asks for its
bytes in messages of its chunk size; the sender sends each once it is ready, keepalive heads while
it waits, and a data frame header with the byte count at the end (see
docs/protocol.md, "Answers in bare messages").
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
import transport_checks as tc

from hoplite_gpu.auth import new_token
from hoplite_gpu.config import Config
from hoplite_gpu.errors import ConfigError, ObjectNotFound, TransportClosed
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.node import transfer
from hoplite_gpu.node.store import ChunkStore
from hoplite_gpu.transports import SendWindow, get_backend, usable
from hoplite_gpu.values import to_buffer

MiB = 1 << 20




needs_ucx = pytest.mark.skipif(not usable("ucx"), reason="ucxx is not installed")


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


@needs_ucx
def test_a_pull_over_ucx_is_answered_in_bare_messages_with_keepalives_while_bytes_come(caplog):
    """The sender's copy is partial and grows slowly: it sends keepalives while
    it waits (stall timeout 0.6 s, bytes every 0.8 s), a message per whole
    chunk, and the end marker; the puller's copy is byte-identical."""
    config = Config(transport="ucx", chunk_size=MiB, stall_timeout_s=0.6, timeout_s=10.0,
                    shared_memory=False, bare_pulls=True)

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
        bare_in = [r for r in caplog.records if "bare message of" in r.getMessage()
                   and r.getMessage().endswith(" in")]
        assert len(bare_in) == 4  # the puller took 4 bare messages, no frames
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


@needs_ucx
def test_a_bare_answer_cut_short_by_an_error_frame_fails_the_pull():
    """The object leaves the sender's store half-way: the puller gets the
    error frame (ObjectNotFound) instead of waiting for bytes that never come."""
    config = Config(transport="ucx", chunk_size=MiB, stall_timeout_s=3.0, timeout_s=10.0,
                    shared_memory=False, bare_pulls=True)

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


@needs_ucx
@pytest.mark.parametrize("bare", [0, -1, "lots", 1.5])
def test_a_sender_refuses_a_bad_bare_size(bare):
    from hoplite_gpu.auth import client_handshake
    from hoplite_gpu.protocol import FRAME_ERROR, recv_error_body, recv_frame_header, send_msg

    config = Config(transport="ucx", shared_memory=False)

    async def main():
        token, store, server = await _serving(config)
        obj, _ = _object(store, MiB, MiB)
        stream = await get_backend("ucx").connect(server.address, 10)
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


@needs_ucx
def test_host_pulls_are_framed_by_default(caplog):
    """By default (`bare_pulls="device"`) a pull of a host object over UCX is
    answered in frames: on a CPU host bare messages were no faster."""
    config = Config(transport="ucx", chunk_size=MiB, shared_memory=False)

    async def main():
        token, store, server = await _serving(config)
        obj, value = _object(store, 2 * MiB, 2 * MiB)
        copy = ChunkStore().create(obj.oid, obj.layout)
        pool = transfer.PeerPool(token, config)
        with caplog.at_level(logging.DEBUG, logger="hoplite_gpu.transfer"):
            async with asyncio.timeout(20):
                await transfer.fetch_range(pool, server.address, copy, obj.size, config,
                                           lambda _: None)
        np.testing.assert_array_equal(np.asarray(copy.buffer), value)
        assert not [r for r in caplog.records if "bare" in r.getMessage()]
        assert [r for r in caplog.records if "frame of" in r.getMessage()]
        await pool.close()
        await server.close()

    asyncio.run(main())


@pytest.mark.parametrize("given, stored", [
    (True, "on"), (False, "off"), ("1", "on"), ("no", "off"), ("ON", "on"),
    ("device", "device"), ("Device", "device")])
def test_bare_pulls_takes_a_switch_or_device(given, stored):
    assert Config(bare_pulls=given).bare_pulls == stored
    assert Config.from_env({"HOPLITE_BARE_PULLS": str(given)}).bare_pulls == stored


def test_bare_pulls_refuses_other_values():
    with pytest.raises(ConfigError, match="bare_pulls must be 'off', 'device' or 'on'"):
        Config(bare_pulls="sometimes")
    for wrong in (["on"], 1.5, None):
        with pytest.raises(ConfigError, match="bare_pulls must be str"):
            Config(bare_pulls=wrong)


def test_which_pulls_are_bare():
    """(device object, reduce input) -> bare, for each setting."""
    cases = [(True, False), (True, True), (False, False), (False, True)]
    assert [Config().bare_pull(*c) for c in cases] == [True, False, False, False]
    assert [Config(bare_pulls="on").bare_pull(*c) for c in cases] == [True] * 4
    assert [Config(bare_pulls="off").bare_pull(*c) for c in cases] == [False] * 4


def test_reduce_steps_pull_their_children_as_reduce_inputs(monkeypatch):
    """A reduce step's pulls of its children ask as reduce inputs (framed by
    default on a GPU: a bare receive posted for a child still being reduced
    would be polled while the step folds); a get's pull does not."""
    from in_process import run_nodes

    import hoplite_gpu as hg

    asked = []
    real = Config.bare_pull

    def spy(self, device, reduce_input):
        asked.append(reduce_input)
        return real(self, device, reduce_input)

    monkeypatch.setattr(Config, "bare_pull", spy)
    values = [np.full(MiB // 4, i + 1, np.float32) for i in range(3)]
    ids = [ObjectID.from_name(f"bare-rule-in-{i}") for i in range(3)]
    target = ObjectID.from_name("bare-rule-out")

    async def body(directory, *nodes):
        for node, value, oid in zip(nodes, values, ids, strict=True):
            await node.put(value, oid)
        await nodes[0].reduce(ids, "sum", 3, target)
        for node in nodes:
            got = await node.get(target, 20, "numpy")
            np.testing.assert_array_equal(got, np.sum(values, axis=0))

    run_nodes([hg.Config(shared_memory=False)] * 3, body, bound=60)
    assert True in asked, "no reduce step pulled a child as a reduce input"
    assert False in asked, "no get pulled the result"
