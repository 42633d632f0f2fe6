"""The directory's connections: what a malformed, hostile, silent or bursty
peer of the directory (or of a UCX stream) can do to the directory and to
other nodes. Each test is bounded; all traffic stays on loopback."""

from __future__ import annotations

import asyncio
import struct

import numpy as np
import pytest
import transport_checks as tc
from in_process import eventually, run_nodes
from raw_directory import TOKEN, authenticated, memory_held_for_unproven_peers, registered, run

from hoplite_gpu.config import Config
from hoplite_gpu.directory.server import DirectoryServer
from hoplite_gpu.errors import ConfigError, HopliteError, TransportClosed
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.protocol import recv_msg, send_msg
from hoplite_gpu.transports import get_backend

OID = b"o" * 20
MiB = 1 << 20


async def closed_within(stream, seconds: float) -> bool:
    """Whether the peer closes `stream` within `seconds` (messages are skipped)."""
    try:
        async with asyncio.timeout(seconds):
            while True:
                await recv_msg(stream)
    except TransportClosed:
        return True
    except TimeoutError:
        return False


# ------------------------------------------------ the directory's deadlines ---
def test_a_peer_that_authenticates_but_never_registers_is_dropped():
    """The handshake is bounded by handshake_timeout, but the register (or
    attach) message after it is awaited with no deadline: an authenticated
    peer that stays silent holds its connection and task forever."""
    async def body():
        server = DirectoryServer(TOKEN, handshake_timeout=0.5)
        address = await server.start()
        try:
            stream = await authenticated(address)
            try:
                assert await closed_within(stream, 3.0), \
                    "the directory still waits for 'register' long after handshake_timeout"
            finally:
                await stream.close()
        finally:
            await server.close()
    run(body)


def test_a_node_that_stops_reading_is_cut_off_and_lost():
    """A node that keeps its lease with pings but takes none of its replies
    made the directory queue them for ever. Now the directory gives a write a
    lease's time: the node is cut off and lost, and its queue freed."""
    async def body():
        server = DirectoryServer(TOKEN, lease_s=1.0, heartbeat_interval_s=0.25)
        address = await server.start()
        stream = await registered(address, "deaf")
        pinging = None
        try:
            blob = b"b" * 60_000
            await send_msg(stream, {"op": "put", "rid": 1, "oid": OID, "size": len(blob),
                                    "layout": {"kind": "bytes"}, "inline": blob})

            async def ping():
                while True:
                    await send_msg(stream, {"op": "ping"})
                    await asyncio.sleep(0.2)
            pinging = asyncio.get_running_loop().create_task(ping())
            for rid in range(2, 600):  # ~36 MB of replies, never read
                await send_msg(stream, {"op": "locate", "rid": rid, "oid": OID})
            deadline = asyncio.get_running_loop().time() + 6.0
            while "deaf" in server.peers and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.1)
            assert "deaf" not in server.peers, "a node that reads nothing is kept for ever"
            assert "deaf" not in server.state.nodes
        finally:
            if pinging is not None:
                pinging.cancel()
                await asyncio.gather(pinging, return_exceptions=True)
            await stream.close()
            await server.close()
    run(body)


def test_connecting_to_a_directory_is_bounded_by_one_timeout():
    """connect, handshake and register each had the whole timeout: a directory
    that answered the handshake late and the register never took 2-3 x it."""
    from hoplite_gpu.auth import server_handshake
    from hoplite_gpu.directory.client import DirectoryClient
    from hoplite_gpu.errors import Timeout

    async def body():
        async def slow(stream):
            await asyncio.sleep(0.7)
            await server_handshake(stream, TOKEN, 5)
            await asyncio.sleep(10)  # and never answers the register

        listener = await get_backend("tcp").listen("127.0.0.1", 0, slow)
        try:
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(Timeout):
                await DirectoryClient.connect(listener.address, token=TOKEN, node="n",
                                              data_address="tcp://127.0.0.1:1", timeout=1.0,
                                              on_push=lambda msg: None)
            assert loop.time() - start < 1.5
        finally:
            await listener.close()
    run(body)


def test_a_reduce_with_an_unknown_op_is_refused_at_once():
    """A raw reduce request naming an unknown op was accepted and failed only
    later, inside a step on some node; now the directory refuses it."""
    async def body():
        server = DirectoryServer(TOKEN)
        address = await server.start()
        stream = await registered(address, "r")
        try:
            await send_msg(stream, {"op": "reduce", "rid": 7, "target": OID,
                                    "inputs": [b"i" * 20, b"j" * 20], "op_name": "median",
                                    "num_objects": 2})
            async with asyncio.timeout(5):
                reply = await recv_msg(stream)
            assert reply["rid"] == 7 and reply["error"] == "ProtocolError"
            assert "median" in reply["message"]
        finally:
            await stream.close()
            await server.close()
    run(body)


def test_a_node_registering_a_bad_data_address_is_refused():
    """Any string was taken as a node's data address, and other nodes failed
    on it only when they dialled it for a pull."""
    async def body():
        server = DirectoryServer(TOKEN)
        address = await server.start()
        stream = await authenticated(address)
        try:
            await send_msg(stream, {"op": "register", "node": "bad", "address": "nowhere"})
            async with asyncio.timeout(5):
                reply = await recv_msg(stream)
            assert reply["error"] == "ProtocolError" and "nowhere" in reply["message"]
            assert "bad" not in server.state.nodes
        finally:
            await stream.close()
            await server.close()
    run(body)


# ------------------------------------------------- direct connections ---
def test_a_direct_cancel_with_a_malformed_request_id_gets_a_protocol_error():
    """On a node's own connection a cancel whose `request` is not an int is
    answered ProtocolError; on a direct connection it is used as a dict key
    (server.py `_received_direct`): a list raises TypeError out of the
    handler, and the connection dies without an answer."""
    async def body():
        server = DirectoryServer(TOKEN)
        address = await server.start()
        control = direct = None
        try:
            control = await registered(address, "victim")
            direct = await authenticated(address)
            await send_msg(direct, {"op": "attach", "node": "victim"})
            async with asyncio.timeout(5):
                assert await recv_msg(direct) == {"ok": True, "node": "victim"}
            # a locate that waits (nobody put OID): the connection's requests are not empty
            await send_msg(direct, {"op": "locate", "rid": 1, "oid": OID})
            await send_msg(direct, {"op": "cancel", "request": [1]})
            await send_msg(direct, {"op": "put", "rid": 2, "oid": b"p" * 20, "size": 1,
                                    "layout": {"kind": "bytes"}, "inline": b"x"})
            async with asyncio.timeout(5):
                replies = [await recv_msg(direct)]  # TransportClosed today
                while replies[-1].get("rid") != 2:
                    replies.append(await recv_msg(direct))
            assert replies[-1] == {"rid": 2, "ok": True}
        finally:
            for s in (direct, control):
                if s is not None:
                    await s.close()
            await server.close()
    run(body)


# -------------------------------------- one node's ids reach other nodes ---
def test_a_short_object_id_from_one_node_does_not_cut_off_the_others():
    """The directory takes object ids of any length (wire.py checks only
    reduce inputs). A node announces a 3-byte id as a complete object (a
    'recovered' entry, as after a restart) and deletes it: the directory
    sends `drop` with that id to every node, and each node's push handler
    raises InvalidArgument (ObjectID), which its client takes for a lost
    directory connection."""
    from in_process import run_nodes

    async def body(directory, victim):
        hostile = await registered(directory.address, "hostile")
        try:
            await send_msg(hostile, {"op": "complete", "oid": b"abc", "size": 1,
                                     "layout": {"kind": "bytes", "dtype": "uint8", "shape": [1],
                                                "nbytes": 1}})
            await send_msg(hostile, {"op": "delete", "rid": 1, "oid": b"abc"})
            async with asyncio.timeout(5):
                reply = await recv_msg(hostile)
            await asyncio.sleep(0.3)  # (the drop reaches the victim meanwhile)
            assert victim.client._lost is None and victim._connected.is_set(), \
                f"another node's message cut the victim off the directory (reply {reply})"
        finally:
            await hostile.close()

    run_nodes([Config(shared_memory=False, timeout_s=10)], body, bound=20)


# -------------------------------------------------------------- UCX heads ---
def _ucx_or_skip():
    try:
        get_backend("ucx")
    except ConfigError as exc:
        pytest.skip(f"UCX not usable here: {exc}")


@pytest.mark.parametrize("head", [
    struct.pack("<HI", 1, 0) + struct.pack("<BQ", 1, 1 << 62),  # a data record of 4 EiB
    struct.pack("<HI", 60000, 0),                                # more records than a head holds
], ids=["huge-record", "too-many-records"])
def test_a_malformed_ucx_head_is_a_transport_error(head):
    """`UCXStream._next_head` trusts the peer's head: a record's size is
    allocated for staging as it is (MemoryError, or a multi-GiB allocation
    for a smaller lie) and the record count is not checked against the head
    buffer (struct.error). Either escapes recv_into as a non-HopliteError,
    before any handshake (the directory's first recv_msg)."""
    _ucx_or_skip()

    async def body():
        async with tc.connected_pair("ucx") as (client, server):
            await client._send(head, 0)  # (the head lane, as a peer would send it)
            with pytest.raises(HopliteError):
                async with asyncio.timeout(5):
                    await server.recv_exactly(4)
    run(body)


# ------------------------------------------------- before authentication ---
def test_an_unauthenticated_peer_cannot_make_the_directory_allocate_max_message():
    """The handshake reads its one small message with recv_msg, whose bound
    is MAX_MESSAGE (64 MiB): a peer that has proved nothing announces 64 MiB
    and the directory allocates (and zero-fills) that much at once, per
    connection, for up to handshake_timeout. A few hundred such connections
    exhaust the directory's memory."""
    async def body():
        server = DirectoryServer(TOKEN, handshake_timeout=5)
        grown = await memory_held_for_unproven_peers(  # each announces 60 MiB, sends no body
            server, "tcp", lambda stream: stream.send((60 << 20).to_bytes(4, "big")))
        assert grown < 16 << 20, f"3 unauthenticated peers made the directory hold {grown >> 20} MiB"
    run(body)


# --------------------------------------------------- bursts of inline bytes ---
def test_a_node_holding_many_inline_objects_registers_them_again_after_a_directory_restart(
        caplog):
    """After a directory restart a node re-announces every object it holds,
    small ones with their bytes, all posted at once (`Node._announce`). The
    new cut-off of an outbox past `MAX_QUEUED` (256 MiB) queued bytes takes
    that burst for a peer that reads nothing: the node cuts its own, healthy,
    connection, reconnects, announces again and is cut again, for good. Its
    objects never reach the new directory."""
    from hoplite_gpu.directory.server import DirectoryServer
    from hoplite_gpu.node.node import Node

    config = Config(inline_threshold=16 * MiB, connect_timeout_s=2.0, timeout_s=20.0)
    n, size = 20, 16 * MiB  # 320 MiB of inline objects, each within the threshold

    async def main() -> None:
        first = DirectoryServer("tok")
        address = await first.start()
        port = int(address.rpartition(":")[2])
        node = Node(config, "tok", address)
        second = None
        try:
            await node.start()
            ids = [ObjectID.from_name(f"review-announce-{i}") for i in range(n)]
            for i, oid in enumerate(ids):
                await node.put(np.full(size, i, dtype=np.uint8), oid)
            await first.close()
            second = DirectoryServer("tok", port=port)
            await second.start()
            known = lambda: all(oid.binary in second.state.objects for oid in ids)  # noqa: E731
            assert await eventually(known, 15.0), (  # (320 MiB re-announced: a slow machine)
                f"the restarted directory learnt {sum(o.binary in second.state.objects for o in ids)}"
                f" of the node's {n} objects")
            cuts = [r.getMessage() for r in caplog.records if "piled up" in r.getMessage()]
            assert not cuts, f"the node cut its own directory connection: {cuts[0]}"
        finally:
            await node.close()
            if second is not None:
                await second.close()
            await first.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_node_getting_many_inline_objects_at_once_is_not_cut_off_by_the_directory(caplog):
    """The directory reads a burst of a node's locates in one receive and
    posts every reply at once; replies to inline objects carry their bytes.
    Twenty concurrent gets of 16 MiB objects (inline_threshold may be up to
    16 MiB) queue 320 MiB for a node that reads as fast as it can, and the
    outbox's `MAX_QUEUED` cut-off takes it for a stuck reader: the node is
    cut off, reconnects, asks again, is cut off again, and every get ends
    in Timeout. (Before the cut-off: all 20 arrive in well under a second;
    the gets' 10 s leave a slow machine room, and any cut in the log fails.)"""
    config = Config(inline_threshold=16 * MiB, connect_timeout_s=2.0, timeout_s=10.0)

    async def body(directory, a, b):
        ids = [ObjectID.from_name(f"review-burst-{i}") for i in range(20)]
        for i, oid in enumerate(ids):
            await a.put(np.full(16 * MiB, i, dtype=np.uint8), oid)
        got = await asyncio.gather(*[b.get(oid, 10.0, "numpy") for oid in ids],
                                   return_exceptions=True)
        failed = [type(g).__name__ for g in got if not isinstance(g, np.ndarray)]
        assert not failed, f"{len(failed)} of 20 gets failed: {failed[:3]}"
        assert [int(g[0]) for g in got] == list(range(20))
        cuts = [r.getMessage() for r in caplog.records if "piled up" in r.getMessage()]
        assert not cuts, f"the node was cut off: {cuts[0]}"

    run_nodes([config, config], body, bound=30.0)
