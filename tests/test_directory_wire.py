"""The directory process's wire handling: what a node's own client leaves
behind at the directory, fields the directory takes although
docs/protocol.md says they are refused, and first messages refused without a
word to the peer. Every test is bounded; all traffic stays on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest
from in_process import run_nodes
from raw_directory import TOKEN, authenticated, registered, run

from hoplite_gpu import messages as m
from hoplite_gpu.config import Config
from hoplite_gpu.directory.server import DirectoryServer
from hoplite_gpu.errors import Timeout, TransportClosed
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.protocol import recv_msg, send_msg
from hoplite_gpu.transports import get_backend

OID = b"r" * 20
TARGET = b"T" * 20


async def reply_to(stream, rid: int, seconds: float = 2.0) -> dict | None:
    """The reply to request `rid` (other messages skipped); None if none comes."""
    try:
        async with asyncio.timeout(seconds):
            while True:
                msg = await recv_msg(stream)
                if msg.get("rid") == rid:
                    return msg
    except TimeoutError:
        return None


# --------------------------------------------- requests given up by nodes ---
def test_a_timed_out_reduced_inputs_is_withdrawn_from_the_directory():
    """`reduced_inputs` waits at the directory until the reduce is done. A
    caller that gives up (Timeout) leaves its request there: the node sends it
    with `DirectoryClient.request`, which, unlike `Node._wait_reply` (used by
    channel_head and reduce_confirm), never sends `cancel`. A program polling
    `hg.reduced_inputs(t, timeout=...)` while a reduce waits for its inputs
    grows the directory's `task.waiters` and `waits` by one entry per call,
    without bound, and gets all those dead answers at once when it ends."""
    async def body(directory, node):
        await node._request(m.Reduce(rid=0, target=TARGET, inputs=[b"a" * 20, b"b" * 20],
                                     op_name="sum", num_objects=2), 5)  # inputs never put
        for _ in range(10):
            with pytest.raises(Timeout):
                await node.reduced_inputs(ObjectID(TARGET), 0.05)
        await asyncio.sleep(0.3)  # (a cancel, had one been sent, is in by now)
        task = directory.state.reduces[TARGET]
        assert task.waiters == [], \
            f"{len(task.waiters)} reduced_inputs requests whose callers gave up still wait " \
            "at the directory"
        assert not directory.state.waits.get(node.node_id)

    run_nodes([Config(shared_memory=False, timeout_s=10)], body, bound=20)


# ------------------------------------------- fields of the wrong type ---
@pytest.mark.parametrize("msg", [
    # `inline` is "bytes or nil": a str makes it a non-inline put, which no
    # node serves (every get of it waits to its timeout)
    {"op": "put", "oid": OID, "size": 3,
     "layout": {"kind": "bytes", "dtype": "uint8", "shape": [3], "nbytes": 3}, "inline": "abc"},
    # `wait` is a bool: bool("false") is True, so the request waits for a new head
    {"op": "channel_head", "name": "c", "newer_than": 0, "wait": "false"},
], ids=["put-inline-str", "channel_head-wait-str"])
def test_a_mistyped_optional_field_is_a_protocol_error(msg):
    """docs/protocol.md: "a message with a missing or mistyped field gets
    {rid, error: ProtocolError}", and wire.py refuses a mistyped `relay` or
    `root_input` so. But `put`'s `inline` and `channel_head`'s `wait` are
    coerced (wire.py `to_event`: a non-bytes inline becomes None, `wait`
    goes through bool()): the put is answered ok and registered as an object
    whose bytes nobody has, and the channel_head waits instead of answering."""
    async def body():
        server = DirectoryServer(TOKEN)
        address = await server.start()
        stream = await registered(address, "typo")
        try:
            await send_msg(stream, {**msg, "rid": 5})
            reply = await reply_to(stream, 5)
            assert reply is not None and reply.get("error") == "ProtocolError", \
                f"a mistyped field was taken: the directory answered {reply}"
        finally:
            await stream.close()
            await server.close()
    run(body)


# -------------------------------------------- the connection's first message ---
@pytest.mark.parametrize("hello", [
    {"op": "ping"},
    {"op": "register", "node": "n"},
    {"op": "register", "node": 7, "address": "tcp://127.0.0.1:9"},
    {"op": "attach"},
], ids=["not-register", "register-without-address", "register-int-node", "attach-without-node"])
def test_a_malformed_first_message_is_answered_with_what_is_wrong(hello):
    """The directory answers a bad data address, a taken node id and an
    unknown node on attach with {"error": "ProtocolError", "message": ...}.
    Any other malformed first message (another op, a missing or mistyped
    `node` or `address`) raises ProtocolError inside `_serve`, which only
    logs it on the directory's side: the peer sees a bare close
    (TransportClosed), with no word of what it got wrong."""
    async def body():
        server = DirectoryServer(TOKEN)
        address = await server.start()
        stream = await authenticated(address)
        try:
            await send_msg(stream, hello)
            try:
                async with asyncio.timeout(3):
                    reply = await recv_msg(stream)
            except TransportClosed:
                reply = None
            assert reply is not None and reply.get("error") == "ProtocolError", \
                "the directory closed the connection without saying why"
        finally:
            await stream.close()
            await server.close()
    run(body)


def test_a_register_with_a_non_ascii_digit_port_is_refused_cleanly():
    """`split_address` checks the port with str.isdigit(), which is true for
    '²' while int('²') raises ValueError. `_serve` catches only
    InvalidArgument there, so the ValueError escapes the directory's
    connection task ("Task exception was never retrieved", a traceback in
    the directory's log) and the node gets a bare close instead of the
    "bad data address" ProtocolError that other bad addresses get."""
    async def body():
        server = DirectoryServer(TOKEN)
        escaped: list[BaseException] = []
        serve = server._serve

        async def watched(stream):  # what leaves the connection's task, as it is
            try:
                await serve(stream)
            except Exception as exc:
                escaped.append(exc)
                raise
        server._serve = watched
        address = await server.start()
        stream = await authenticated(address)
        try:
            await send_msg(stream, {"op": "register", "node": "sup",
                                    "address": "tcp://127.0.0.1:\u00b2"})
            try:
                async with asyncio.timeout(3):
                    reply = await recv_msg(stream)
            except TransportClosed:
                reply = None
            await asyncio.sleep(0.1)
            assert not escaped, f"a raw exception escaped the directory: {escaped[0]!r}"
            assert reply is not None and reply.get("error") == "ProtocolError", \
                "the directory closed the connection without saying why"
        finally:
            await stream.close()
            await server.close()
    run(body)


# ------------------------------------------------------------ accepting ---
def test_a_transient_accept_error_does_not_stop_the_directory_accepting():
    """`TCPListener._accept_loop` (transports/tcp.py) retries only EMFILE,
    ENFILE and ECONNABORTED; any other OSError from accept() ends the loop
    for good, silently. accept(2) on Linux also returns ENOBUFS/ENOMEM under
    socket-buffer pressure and passes a new connection's pending network
    error on (EPROTO, ENETDOWN, EHOSTUNREACH, ...), which its man page says
    to retry like EAGAIN. After one such error the directory takes no new
    connection ever again: nodes that start, or reconnect after losing it,
    time out in the handshake while the directory seems healthy."""
    import errno

    async def body():
        loop = asyncio.get_running_loop()
        real = loop.sock_accept
        failed: list[int] = []

        async def accept_once_failing(sock):
            if not failed:
                failed.append(errno.ENOBUFS)
                raise OSError(errno.ENOBUFS, "No buffer space available")
            return await real(sock)
        loop.sock_accept = accept_once_failing
        server = DirectoryServer(TOKEN)
        address = await server.start()
        stream = None
        try:
            await asyncio.sleep(0.1)  # (the accept loop meets the error)
            assert failed
            stream = await get_backend("tcp").connect(address, 2)
            try:
                async with asyncio.timeout(3):
                    hello = await recv_msg(stream)
            except TimeoutError:
                hello = None
            assert hello is not None and hello.get("hello") == "hoplite-gpu", \
                "one ENOBUFS from accept() and the directory accepts no connection any more"
        finally:
            if stream is not None:
                await stream.close()
            await server.close()
            del loop.sock_accept
    run(body)
