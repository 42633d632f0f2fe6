"""Review of the directory's per-node indexes and relay
shortcut, a put's fingerprint, and the data server's send stall. Each test
fails on the code it was written against; every wait is bounded."""

from __future__ import annotations

import asyncio
import socket
import time

import numpy as np
from in_process import eventually, run_nodes

import hoplite_gpu as hg
from hoplite_gpu.auth import client_handshake
from hoplite_gpu.config import Config
from hoplite_gpu.directory.state import (
    Completed,
    Directory,
    Locate,
    NodeJoined,
    NodeLost,
    Put,
    ReduceRequested,
    Reply,
    StartReduceStep,
)
from hoplite_gpu.ids import ObjectID
from hoplite_gpu.protocol import send_msg
from hoplite_gpu.transports import get_backend

MiB = 1 << 20
LAYOUT = {"kind": "numpy", "dtype": "<f4", "shape": [1250], "nbytes": 5000}


# ------------------------------------------------------------ directory ---
def test_a_relay_node_that_came_back_and_left_again_still_frees_its_successor():
    """A relayed result (R, A, B: each node pulls from the one before) is
    complete at R. A is declared dead (a missed lease) and reconnects under
    its node id, as a node does, without getting the result again; B's get
    then waits for A, its relay predecessor, which is alive. When A leaves
    for good, B must be sent to R, which holds the result and serves nobody
    (before f8c31f8 a node's loss looked at every object and did so).
    `Directory.holding` is popped whole at A's first loss (`_forget_node`)
    and A's relay membership is never put back when it rejoins, so its
    second loss visits nothing: B waits on, and its get ends in Timeout
    while a complete copy sits idle at R."""
    d = Directory(max_receivers_per_sender=1)
    for n in "RAB":
        d.handle(NodeJoined(n, "addr-" + n))
    ir, ia, ib, target = b"r" * 20, b"a" * 20, b"b" * 20, b"t" * 20
    for n, oid in (("R", ir), ("A", ia), ("B", ib)):
        d.handle(Put(n, 1, oid, 5000, LAYOUT))
        d.handle(Completed(n, oid))
    out = d.handle(ReduceRequested("R", 2, target, (ia, ib, ir), "sum", 3, root_input=ir,
                                   relay=True))
    (root,) = [c.node for c in out if isinstance(c, StartReduceStep)
               and c.step.output == target]
    assert root == "R" and d.objects[target].relay == ("R", "A", "B")
    d.handle(Completed("R", target, tag=d.reduces[target].tag))
    assert d.reduces[target].done

    d.handle(NodeLost("A"))  # declared dead ...
    d.handle(NodeJoined("A", "addr-A"))  # ... and back, under its id
    assert d.handle(Locate("B", 5, target)) == []  # B waits for A, its predecessor
    out = d.handle(NodeLost("A"))  # A leaves for good
    answers = [c for c in out if isinstance(c, Reply) and (c.node, c.request) == ("B", 5)]
    assert answers and getattr(answers[0].body, "sender", None) == "R", (
        f"A left for good, yet B's get still waits ({list(d.objects[target].waiting)}) "
        f"while R holds the result complete and serves nobody; "
        f"holding['A'] = {d.holding.get('A')}")


# ---------------------------------------------------------- fingerprint ---
def test_a_put_of_other_bytes_is_refused_after_a_directory_restart_too():
    """a404ac1 refuses a second put of an id with other bytes (docs/api.md: "with
    ... other bytes it raises ObjectExists"), because a reader failing over
    between the two copies resumes mid-object and returns a mix. The
    fingerprint lives only in the directory's entry, taken from the first
    `put`. After a directory restart the entry is rebuilt from the nodes'
    `complete` announcements, which carry none (`Entry.fingerprint` stays
    None), so the next put of the id with other bytes is accepted as one
    more origin: the mix a404ac1 fixed comes back after any restart."""
    from hoplite_gpu.directory.server import DirectoryServer
    from hoplite_gpu.node.node import Node

    config = Config(shared_memory=False, chunk_size=256 * 1024, connect_timeout_s=2.0,
                    timeout_s=10.0)
    oid = ObjectID.from_name("review-scheduling-print-after-restart")

    async def main() -> None:
        first = DirectoryServer("tok")
        address = await first.start()
        port = int(address.rpartition(":")[2])
        a, b = Node(config, "tok", address), Node(config, "tok", address)
        second = None
        try:
            await a.start()
            await b.start()
            await a.put(np.full(8 * MiB, 1, np.uint8), oid)
            await first.close()
            second = DirectoryServer("tok", port=port)
            await second.start()
            assert await eventually(lambda: oid.binary in second.state.objects
                                and {a.node_id, b.node_id} <= set(second.state.nodes), 8.0), \
                "the nodes did not come back to the restarted directory"
            try:
                await b.put(np.full(8 * MiB, 2, np.uint8), oid)
            except hg.ObjectExists:
                return  # refused, as before the restart
            origins = [n for n, h in second.state.objects[oid.binary].holders.items() if h.origin]
            raise AssertionError(
                f"after a directory restart a put of other bytes under an existing id was "
                f"accepted: origins {origins} now hold different bytes, and a reader failing "
                f"over between them returns a mix")
        finally:
            await b.close()
            await a.close()
            if second is not None:
                await second.close()
            await first.close()

    asyncio.run(asyncio.wait_for(main(), 40))


# --------------------------------------------------------------- stall ---
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
