"""A directory and nodes on one event loop in the test process: a test can
step in exactly where a caller would give up, or hold an answer back."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from hoplite_gpu import messages as m
from hoplite_gpu.config import Config


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Whether `check()` holds within `timeout` seconds (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        await asyncio.sleep(0.01)
    return check()


def wait_child(pid: int, timeout: float, hung: str) -> int:
    """The exit status of forked child `pid`; past `timeout` seconds it is
    killed and AssertionError(`hung`) raised."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(hung)
        time.sleep(0.05)


@contextlib.contextmanager
def local_mode(**settings: Any) -> Iterator[None]:
    """`hoplite_gpu.init()` in local mode for the block, always shut down."""
    import hoplite_gpu as hg

    hg.init(**settings)
    try:
        yield
    finally:
        hg.shutdown()


def swallow_first_ok(server: Any) -> list:
    """Make the directory `server` drop its first `ok` reply to a direct
    connection (a put's answer that never comes); returns the list the
    dropped reply is appended to."""
    swallowed: list = []
    real = server._reply_direct

    def swallow(cmd: Any) -> None:
        if getattr(cmd.body, "ok", False) and not swallowed:
            swallowed.append(cmd)
            return
        real(cmd)
    server._reply_direct = swallow
    return swallowed


def holders_after_direct_calls(rt: Any, oid: Any) -> list:
    """The nodes the in-process directory of local runtime `rt` lists as
    holders of `oid`, once what this thread's direct calls handed the loop
    is done (a call through the loop) and a moment has passed."""
    import hoplite_gpu as hg

    hg.node_stats()

    async def holders() -> list:
        await asyncio.sleep(0.2)
        entry = rt.directory.state.objects.get(oid.binary)
        return [] if entry is None else list(entry.holders)
    return rt.call(holders(), 5)


def free_ports(count: int) -> str:
    """A range of `count` ports no socket here holds now ("low-high"), at a
    random place above the kernel's ephemeral range: concurrent runs of
    these tests do not share one."""
    rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))
    for _ in range(50):
        low = rng.randrange(61000, 65000 - count)
        socks = []
        try:
            for port in range(low, low + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return f"{low}-{low + count - 1}"
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise AssertionError("no free block of ports found")


def run_nodes(configs: list[Config], body: Callable[..., Awaitable[Any]],
              bound: float = 60.0, **directory_settings: Any) -> None:
    """Run `body(directory, *nodes)`, one node per config, within `bound`
    seconds (the directory made with `directory_settings`); the nodes and
    the directory are always closed afterwards."""
    from hoplite_gpu.directory.server import DirectoryServer
    from hoplite_gpu.node.node import Node

    async def main() -> None:
        directory = DirectoryServer("tok", **directory_settings)
        address = await directory.start()
        nodes = [Node(config, "tok", address) for config in configs]
        try:
            for node in nodes:
                await node.start()
            await asyncio.wait_for(body(directory, *nodes), bound)
        finally:
            for node in reversed(nodes):
                await node.close()
            await directory.close()

    asyncio.run(main())


@contextlib.asynccontextmanager
async def two_nodes_short_lease():
    """(directory server, node a, node b) on loopback with a 1 s lease and
    0.2 s heartbeats (TCP only), all closed at the end."""
    from hoplite_gpu.directory.server import DirectoryServer
    from hoplite_gpu.node.node import Node

    server = DirectoryServer("tok", lease_s=1.0, heartbeat_interval_s=0.2)
    address = await server.start()
    config = Config(heartbeat_interval_s=0.2, node_lease_s=1.0, timeout_s=5.0,
                    shared_memory=False)
    started: list[Any] = []
    try:
        for _ in range(2):
            node = Node(config, "tok", address)
            await node.start()
            started.append(node)
        yield server, started[0], started[1]
    finally:
        for node in reversed(started):
            await node.close()
        await server.close()


async def miss_the_lease(server: Any, node: Any) -> None:
    """`node` stops beating while alive (its sockets open) until the directory
    declares it dead and it reconnects; then it beats again, and its
    re-announcements are in when this returns."""
    assert node.link.heartbeat is not None
    first = node.client
    node.link.heartbeat.cancel()
    # (deadlines for a slow machine: each ends as soon as its step is seen)
    assert await eventually(lambda: node.client is not first, 8.0)
    node.link.start_heartbeat()
    assert await eventually(lambda: node._connected.is_set()
                            and node.node_id in server.state.nodes, 8.0)
    await node._request(m.Nodes(), 2.0)


def allreduce_on_threads(name: str, values: list, timeout: float = 20.0,
                         delays: dict[int, float] | None = None) -> list:
    """`collectives.allreduce` of `values[r]` by rank r, each rank a thread of
    this process (rank r starts `delays[r]` seconds late): each rank's result,
    the exception it raised, or "hung"."""
    import threading

    from hoplite_gpu import collectives

    got: dict[int, Any] = {}

    def rank(r: int) -> None:
        time.sleep((delays or {}).get(r, 0))
        try:
            got[r] = collectives.allreduce(values[r], name=name, rank=r, size=len(values),
                                           timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            got[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(values))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout + 10)
    return [got.get(r, "hung") for r in range(len(values))]


def channel_object_exists(channel: str, version: int, part: str = "manifest") -> bool:
    """Whether the directory knows object `part` of `channel`'s `version`."""
    import hoplite_gpu as hg
    from hoplite_gpu.channel import _oid

    try:
        hg.object_info(_oid(channel, version, part))
    except hg.ObjectNotFound:
        return False
    return True


class ThreadedDirectory:
    """A directory server on a loop thread of its own: it answers while the
    nodes' loops are busy, survives what they do, and can be restarted on
    the same port (`ThreadedDirectory(token, old.port)` after `old.close()`)."""

    def __init__(self, token: str, port: int = 0) -> None:
        from hoplite_gpu.directory.server import DirectoryServer

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = DirectoryServer(token, port=port)
        self.address = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(5)
        self.port = int(self.address.rpartition(":")[2])

    def close(self) -> None:
        async def close() -> None:
            await self.server.close()
            for peer in list(self.server.peers.values()):
                await peer.stream.close()
        try:
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(5)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            if not self.loop.is_running():
                self.loop.close()


def hold_child_pulls(monkeypatch: Any, only_from: Any = None) -> dict[str, asyncio.Event]:
    """Reduce steps' pulls of their children wait for the returned dict's
    "event" (set it before the reduce starts): all pulls, or only those from
    the data addresses in `only_from` (a slow network: the steps are under
    way, their outputs not yet made)."""
    from hoplite_gpu.node.flows import Flows

    real = Flows.pull_child
    gate: dict[str, asyncio.Event] = {}

    async def held(self, obj, sender, address, rails, about):
        if only_from is None or address in only_from:
            await gate["event"].wait()
        return await real(self, obj, sender, address, rails, about)

    monkeypatch.setattr(Flows, "pull_child", held)
    return gate


def count_writes(node: Any, counts: Any) -> None:
    """Count in `counts` (one int per byte), for every sub-flow `node` pulls,
    how often its sink recorded each byte: a byte written twice, or never,
    shows."""
    real = node.pulls.flows.fetch

    async def fetch(obj: Any, flow: Any, sink: Any, progress: Any, about: Any = None) -> None:
        class Counting:
            def advance(self, ready: int, _pos: list = [flow.start]) -> None:  # noqa: B006
                if ready > _pos[0]:
                    counts[_pos[0]:ready] += 1
                    _pos[0] = ready
                sink.advance(ready)

        return await real(obj, flow, Counting(), progress, about)

    node.pulls.flows.fetch = fetch


def cut_halfway(server: Any, which: Callable[[Any, int], bool] | None = None) -> list:
    """Make `server` (a node's DataServer) send only the first half of each
    range it is asked for and then close the connection (a sender dying
    mid-pull), where `which(stream, asked_before)` says so (default: every
    range); others are served whole. Returns the (start, end) of each range
    cut, as it comes."""
    real = server._stream_range
    cut: list = []
    asked = 0

    async def serve(stream, obj, pos, end, stall, size):
        nonlocal asked
        asked += 1
        if which is not None and not which(stream, asked - 1):
            return await real(stream, obj, pos, end, stall, size)
        cut.append((pos, end))
        await real(stream, obj, pos, pos + (end - pos) // 2, stall, size)
        await stream.close()
        return False

    server._stream_range = serve
    return cut


@contextlib.contextmanager
def lines_run(folder: str):
    """Count the lines run in `folder`'s modules meanwhile (in `[0]` of the value)."""
    count = [0]

    def trace(frame, event, arg):
        if not frame.f_code.co_filename.startswith(folder):
            return None
        if event == "line":
            count[0] += 1
        return trace

    sys.settrace(trace)
    try:
        yield count
    finally:
        sys.settrace(None)
