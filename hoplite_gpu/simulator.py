"""A discrete-event simulation of receiver-driven broadcast, driving the very
same directory state machine (`directory.state.Directory`) that the server runs.

Nodes have a link of `bandwidth` bytes/s in each direction and `latency`
seconds per message; objects move in chunks of `chunk` bytes. A partial holder
forwards a chunk once it has received it, and a sender's uplink carries one
chunk at a time, shared in time order by everyone pulling from it. The
directory's decisions (who pulls from whom, when a waiting receiver is served)
come from `Directory.handle`, so this explores the real schedule at thousands
of nodes in seconds, with no sockets.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from .directory import state as s
from .errors import InvalidArgument

_KEY = b"\x01" * 20
#: The most chunks an object may have here (each is a few events per receiver).
MAX_SIM_CHUNKS = 1 << 20


@dataclass
class _Transfer:
    receiver: str
    sender: str
    next_chunk: int = 0


@dataclass
class SimResult:
    size: int
    receivers: int
    #: receiver -> time it held every byte
    done_at: dict[str, float] = field(default_factory=dict)
    #: (receiver, sender) pairs, as the directory assigned them
    edges: list[tuple[str, str]] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max(self.done_at.values()) if self.done_at else 0.0

    def depth(self) -> int:
        """Hops from the origin to the farthest receiver (last assignment of each)."""
        up = dict(self.edges)
        best = 0
        for node in up:
            hops, seen = 0, set()
            while node in up and node not in seen:
                seen.add(node)
                node, hops = up[node], hops + 1
            best = max(best, hops)
        return best


class BroadcastSim:
    """Simulate one object of `size` bytes put on node "n0" at time 0 and gotten by
    `receivers` other nodes, each asking at its `arrivals` time (default all at 0)."""

    def __init__(self, receivers: int, size: int, *, bandwidth: float = 1.25e9,
                 latency: float = 1e-4, chunk: int = 4 << 20,
                 max_receivers_per_sender: int = 1, arrivals: list[float] | None = None) -> None:
        self.n, self.size, self.bw, self.lat, self.chunk = receivers, size, bandwidth, latency, chunk
        self.chunks = max(1, -(-size // chunk))
        if self.chunks > MAX_SIM_CHUNKS:
            raise InvalidArgument(f"{size} bytes in chunks of {chunk} is {self.chunks} chunks; "
                                  f"at most {MAX_SIM_CHUNKS} are simulated")
        if arrivals is not None and len(arrivals) != receivers:
            raise InvalidArgument(f"arrivals needs one time per receiver ({receivers}); "
                                  f"got {len(arrivals)}")
        self.arrivals = [0.0] * receivers if arrivals is None else list(arrivals)
        self.dir = s.Directory(max_receivers_per_sender=max_receivers_per_sender,
                               latency_s=latency, bytes_per_s=bandwidth, chunk_size=chunk)
        self._events: list[tuple[float, int, str, tuple]] = []
        self._seq = itertools.count()
        self.have: dict[str, int] = {"n0": self.chunks}    # chunks held
        self.uplink_free: dict[str, float] = {}
        self.waiting_on: dict[tuple[str, int], list[_Transfer]] = {}
        self.result = SimResult(size, receivers)

    def _at(self, t: float, kind: str, *args: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, args))

    def run(self) -> SimResult:
        for i in range(self.n + 1):
            self.dir.handle(s.NodeJoined(f"n{i}", f"sim://{i}"))
        self.dir.handle(s.Put("n0", 0, _KEY, self.size, {"kind": "bytes"}))
        self.dir.handle(s.Completed("n0", _KEY))
        for i, t in enumerate(self.arrivals, start=1):
            self._at(t, "locate", f"n{i}")
        while self._events:
            t, _, kind, args = heapq.heappop(self._events)
            getattr(self, "_" + kind)(t, *args)
        return self.result

    # ------------------------------------------------------------- events ---
    def _locate(self, t: float, node: str) -> None:
        self._apply(t + self.lat, self.dir.handle(s.Locate(node, 1, _KEY)))

    def _apply(self, t: float, commands: list) -> None:
        for cmd in commands:
            if not isinstance(cmd, s.Reply):
                continue
            if "sender" in cmd.body:
                self.result.edges.append((cmd.node, cmd.body["sender"]))
                self.have.setdefault(cmd.node, 0)
                self._at(t + self.lat, "send", _Transfer(cmd.node, cmd.body["sender"]))
            elif "local" in cmd.body or "inline" in cmd.body:  # (nothing to move: 0 bytes)
                self.result.done_at[cmd.node] = t + self.lat

    def _send(self, t: float, tr: _Transfer) -> None:
        """Put the transfer's next chunk on the sender's uplink once the sender
        has it and the uplink is free."""
        i = tr.next_chunk
        if i >= self.chunks:
            return
        if self.have[tr.sender] <= i:  # the sender does not have it yet: wait for it
            self.waiting_on.setdefault((tr.sender, i), []).append(tr)
            return
        start = max(t, self.uplink_free.get(tr.sender, 0.0))
        nbytes = min(self.chunk, self.size - i * self.chunk) or 1
        end = start + nbytes / self.bw
        self.uplink_free[tr.sender] = end
        self._at(end, "sent", tr)
        self._at(end + self.lat, "arrive", tr.receiver)  # every hop pays the latency

    def _sent(self, t: float, tr: _Transfer) -> None:
        """A chunk left the sender: the stream goes on with the next (no acks)."""
        tr.next_chunk += 1
        self._send(t, tr)

    def _arrive(self, t: float, r: str) -> None:
        self.have[r] += 1
        for waiter in self.waiting_on.pop((r, self.have[r] - 1), []):
            self._at(t, "send", waiter)
        if self.have[r] < self.chunks:
            # (a real node reports its progress now and then; the directory
            # serves a late receiver from the copy furthest ahead)
            self._apply(t, self.dir.handle(s.Progress(r, _KEY, self.have[r] * self.chunk)))
            return
        self.result.done_at[r] = t
        self._apply(t, self.dir.handle(s.Completed(r, _KEY)))


def simulate_broadcast(receivers: int, size: int, **kw: object) -> SimResult:
    return BroadcastSim(receivers, size, **kw).run()
