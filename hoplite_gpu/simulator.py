"""Discrete-event simulations of a receiver-driven broadcast (`BroadcastSim`) and
of a reduce (`ReduceSim`), driving the very same directory state machine
(`directory.state.Directory`) that the server runs.

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
import numbers
from dataclasses import dataclass, field

from . import messages as m
from .directory import state as s
from .directory.reduce_plan import MIN_PIECE, STRIPES, fold_unit, tree_depth, tree_walk_time
from .errors import InvalidArgument

_KEY = b"\x01" * 20
#: The most chunks an object may have here (each is a few events per receiver).
MAX_SIM_CHUNKS = 1 << 20


@dataclass(eq=False)
class _Transfer:
    """One receiver's pull of one range (the whole object, or a stripe) from
    one sender: bytes [pos, end) still to send. A pull the directory moves
    to another sender is cut (`live` False: its chunks on the way are lost,
    as a real node drops a cut connection's unrecorded bytes)."""

    receiver: str
    sender: str
    j: int
    pos: int
    end: int
    #: bytes per chunk (a striped pull's `piece`)
    unit: int
    live: bool = True


@dataclass
class SimResult:
    size: int
    receivers: int
    #: receiver -> time it held every byte
    done_at: dict[str, float] = field(default_factory=dict)
    #: receiver -> time it asked
    asked_at: dict[str, float] = field(default_factory=dict)
    #: (receiver, sender) pairs, as the directory assigned them
    edges: list[tuple[str, str]] = field(default_factory=list)
    #: receiver -> its latest sender of each range (one range, or the stripes)
    senders: dict[str, list[str | None]] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        return max(self.done_at.values()) if self.done_at else 0.0

    @property
    def after_asking(self) -> float:
        """The longest any receiver waited from its locate to its last byte."""
        return max((t - self.asked_at.get(r, 0.0) for r, t in self.done_at.items()), default=0.0)

    @property
    def after_last_ask(self) -> float:
        """From the last receiver's locate to the last byte anywhere."""
        return self.makespan - max(self.asked_at.values(), default=0.0)

    def depth(self) -> int:
        """Hops from the origin to the farthest receiver (of each range, the
        latest sender of each receiver)."""
        ranges = max((len(ups) for ups in self.senders.values()), default=0)
        best = 0
        for j in range(ranges):
            up = {r: ups[j] for r, ups in self.senders.items() if len(ups) > j and ups[j]}
            for node in up:
                hops, seen = 0, set()
                while node in up and node not in seen:
                    seen.add(node)
                    node, hops = up[node], hops + 1
                best = max(best, hops)
        return best


def _check_model(bandwidth: float, latency: float, chunk: int) -> None:
    """The link model and chunk size both simulators take: refused unless a
    run with them means something (a 0-byte chunk ran with 1-byte pieces)."""
    if isinstance(chunk, bool) or not (isinstance(chunk, numbers.Integral) and chunk > 0):
        raise InvalidArgument(f"chunk must be a positive number of bytes; got {chunk!r}")
    if not 0 < bandwidth < float("inf"):
        raise InvalidArgument(f"bandwidth must be a positive number of bytes/s; got {bandwidth!r}")
    if not 0 <= latency < float("inf"):
        raise InvalidArgument(f"latency must be 0 or more seconds; got {latency!r}")


class BroadcastSim:
    """Simulate one object of `size` bytes put on node "n0" at time 0 and gotten by
    `receivers` other nodes, each asking at its `arrivals` time (default all at 0).

    A receiver's downlink carries B in all too: a chunk crosses its sender's
    uplink and then the receiver's downlink, each one chunk at a time (cut
    through: a chunk's last byte arrives no sooner than its sender sent it,
    nor than the downlink has carried what came before). A pull of one
    sender never meets its own downlink busy; a striped receiver's pulls
    share it. A striped object (`stripes`, as the directory's setting) moves
    in chunks of chunk/k per stripe, as a real node pulls a stripe
    (docs/cost-model.md); a pull the directory moves (`Restripe`) restarts
    from the bytes its receiver has.
    """

    def __init__(self, receivers: int, size: int, *, bandwidth: float = 1.25e9,
                 latency: float = 1e-4, chunk: int = 4 << 20,
                 max_receivers_per_sender: int = 1, arrivals: list[float] | None = None,
                 stripes: int = 1, multi_source_bytes: int = 16 << 20) -> None:
        _check_model(bandwidth, latency, chunk)
        if stripes not in (0, 1, STRIPES):
            raise InvalidArgument(f"simulate_broadcast: stripes must be 0 (the cost model's "
                                  f"choice), 1 (off) or 2; got {stripes!r}")
        self.n, self.size, self.bw, self.lat, self.chunk = receivers, size, bandwidth, latency, chunk
        # (a striped pull's messages are at least MIN_PIECE, or chunk/k if smaller)
        unit = chunk if stripes == 1 else min(MIN_PIECE, -(-chunk // STRIPES))
        chunks = max(1, -(-size // unit))
        if chunks > MAX_SIM_CHUNKS:
            raise InvalidArgument(f"{size} bytes in chunks of {chunk} is {chunks} chunks; "
                                  f"at most {MAX_SIM_CHUNKS} are simulated")
        if arrivals is not None and len(arrivals) != receivers:
            raise InvalidArgument(f"arrivals needs one time per receiver ({receivers}); "
                                  f"got {len(arrivals)}")
        self.arrivals = [0.0] * receivers if arrivals is None else list(arrivals)
        # (a relay here passes on whole chunks: the model's unit of fill)
        self.dir = s.Directory(max_receivers_per_sender=max_receivers_per_sender,
                               latency_s=latency, bytes_per_s=bandwidth, chunk_size=chunk,
                               stripes=stripes, relay_bytes=chunk,
                               multi_source_bytes=multi_source_bytes)
        self._events: list[tuple[float, int, str, tuple]] = []
        self._seq = itertools.count()
        #: the ranges the object moves in (the whole, or its stripes), their
        #: chunk size, and each node's bytes of each range (a prefix)
        self.ranges: list[tuple[int, int]] = [(0, size)]
        self.held: dict[str, list[int]] = {"n0": [size]}
        self.flows: dict[tuple[str, int], _Transfer] = {}
        self.uplink_free: dict[str, float] = {}
        self.downlink_free: dict[str, float] = {}
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
        self.result.asked_at[node] = t
        self._apply(t + self.lat, self.dir.handle(s.Locate(node, 1, _KEY)))

    def _apply(self, t: float, commands: list) -> None:
        for cmd in commands:
            if isinstance(cmd, s.PushRestripe):
                self._assigned(t, cmd.node, cmd.body.stripes, cmd.body.piece)
            elif not (isinstance(cmd, s.Reply) and isinstance(cmd.body, m.Location)):
                continue
            elif cmd.body.stripes:
                self._assigned(t, cmd.node, cmd.body.stripes, cmd.body.piece)
            elif cmd.body.sender is not None:
                self._assigned(t, cmd.node, [m.Stripe(start=0, end=self.size,
                                                      sender=cmd.body.sender, address="")])
            elif cmd.body.local or cmd.body.inline is not None:  # (nothing to move: 0 bytes)
                self.result.done_at[cmd.node] = t + self.lat

    def _assigned(self, t: float, node: str, stripes: list[m.Stripe], piece: int = 0) -> None:
        """`node` pulls each range from the sender named, from t + latency on
        (a pull it has from another sender is cut; one from the same goes on)."""
        if node in self.result.done_at:
            return  # (a push that crossed its completion)
        ranges = [(st.start, st.end) for st in stripes]
        if len(ranges) > 1 and self.ranges != ranges:
            self._cut_into(ranges)
        ups = self.result.senders.setdefault(node, [None] * len(self.ranges))
        held = self.held.setdefault(node, [0] * len(self.ranges))
        for st in stripes:
            j = self.ranges.index((st.start, st.end))
            self.result.edges.append((node, st.sender))
            ups[j] = st.sender
            old = self.flows.get((node, j))
            if old is not None and old.live and old.sender == st.sender:
                continue
            if old is not None:
                old.live = False
            tr = self.flows[node, j] = _Transfer(node, st.sender, j, st.start + held[j], st.end,
                                                 piece or self.chunk)
            self._at(t + self.lat, "send", tr)

    def _cut_into(self, ranges: list[tuple[int, int]]) -> None:
        """The object is striped from now on: each node's bytes are counted
        per stripe, and the pulls of the whole object stop (the directory
        tells each receiver its stripes' senders)."""
        for node, held in self.held.items():
            have = held[0]
            self.held[node] = [min(max(have - lo, 0), hi - lo) for lo, hi in ranges]
        for tr in self.flows.values():
            tr.live = False
        self.flows.clear()
        self.waiting_on.clear()
        self.ranges = ranges
        for ups in self.result.senders.values():
            ups[:] = [None] * len(ranges)

    def _send(self, t: float, tr: _Transfer) -> None:
        """Put the transfer's next chunk on the sender's uplink once the sender
        has it and the uplink is free; it crosses the receiver's downlink."""
        if not tr.live or tr.pos >= tr.end:
            return
        lo = self.ranges[tr.j][0]
        nbytes = min(tr.unit, tr.end - tr.pos)
        have = self.held.get(tr.sender)
        if have is None or have[tr.j] < tr.pos + nbytes - lo:  # not there yet: wait for it
            self.waiting_on.setdefault((tr.sender, tr.j), []).append(tr)
            return
        start = max(t, self.uplink_free.get(tr.sender, 0.0))
        sent = start + nbytes / self.bw
        down = max(start, self.downlink_free.get(tr.receiver, 0.0))
        end = max(sent, down + nbytes / self.bw)
        self.uplink_free[tr.sender], self.downlink_free[tr.receiver] = sent, end
        tr.pos += nbytes
        self._at(sent, "send", tr)  # (no acks: the stream goes on)
        self._at(end + self.lat, "arrive", tr, nbytes)  # every hop pays the latency

    def _arrive(self, t: float, tr: _Transfer, nbytes: int) -> None:
        if not tr.live:
            return  # (its pull was cut: the next one asks for these bytes again)
        r, j = tr.receiver, tr.j
        held = self.held[r]
        held[j] += nbytes
        for waiter in self.waiting_on.pop((r, j), []):
            self._at(t, "send", waiter)
        if sum(held) < self.size:
            # (a real node reports its progress now and then; the directory
            # serves a late receiver from the copy furthest ahead)
            prefix = 0
            for (lo, hi), have in zip(self.ranges, held, strict=True):
                prefix += have
                if have < hi - lo:
                    break
            self._apply(t, self.dir.handle(s.Progress(r, _KEY, prefix)))
            return
        self.result.done_at[r] = t
        self._apply(t, self.dir.handle(s.Completed(r, _KEY)))


def simulate_broadcast(receivers: int, size: int, **kw: object) -> SimResult:
    return BroadcastSim(receivers, size, **kw).run()


# ------------------------------------------------------------------ reduce ---
_TARGET = b"\x02" * 20


def _input_id(i: int) -> bytes:
    return b"in" + i.to_bytes(18, "big")


@dataclass(eq=False)
class _Step:
    """One started tree position: folds its own input and its children's streams."""
    node: str
    output: bytes
    is_root: bool
    tag: bytes
    #: its input: a leaf's object, or the output of the position's early step
    input: bytes = b""
    streams: list[_Stream] = field(default_factory=list)
    scheduled: int = 0        # chunks whose fold is scheduled
    folded: int = 0           # chunks of the output produced
    fold_free: float = 0.0    # when this step's fold of the previous chunk ends


@dataclass(eq=False)
class _Stream:
    """A child's output (a partial result, or a leaf's input) pulled by its
    parent's step chunk by chunk: sender uplink -> receiver downlink."""
    source: bytes             # the object pulled: a partial result's id or an input's
    sender: str
    step: _Step
    next_chunk: int = 0
    arrived: int = 0


@dataclass
class ReduceResult:
    size: int
    inputs: int
    num_objects: int
    bandwidth: float
    #: when the root folded the last chunk of the target
    done_at: float = 0.0
    #: arrival of the last input that went into the result
    last_arrival: float = 0.0
    degree: int = 0
    depth: int = 0
    steps: int = 0
    #: reduce_plan.tree_walk_time for this degree (all inputs at once)
    model: float = 0.0

    @property
    def makespan(self) -> float:
        return self.done_at

    @property
    def after_last(self) -> float:
        """Time from the last input to the result, in units of S/B."""
        return (self.done_at - self.last_arrival) / (self.size / self.bandwidth)


class ReduceSim:
    """Simulate a sum of `inputs` float32 arrays of `size` bytes: input i is put
    on node "n<i>" at `arrivals[i]` (default all at 0), and node "n<inputs>"
    asks at time 0 for the first `num_objects` (default all) ready to be reduced.

    The directory's `StartReduceStep` commands build the tree, as on a real
    node (node/reducer.py): a step pulls each child's stream through its node's
    one downlink (d children cost d*S/B), folds chunk i once every child's
    chunk i is in (its own input is there: a step starts only once its input is
    ready), and its output is what its parent pulls, chunk by chunk as it is
    folded. Each message to or from the directory costs `latency`, as does
    each chunk's hop. Folding is free unless `fold_bytes_per_s` is given. The
    unit throughout is the piece a host step with `chunk` as its fold step
    hands on (`reduce_plan.fold_unit`: `chunk`, or an eighth of a smaller
    object down to 256 KiB; a real host folds in at most 1 MiB), and
    inputs are never inline (a real put under 64 KiB is reduced by the
    directory itself).
    """

    def __init__(self, inputs: int, size: int, *, bandwidth: float = 1.25e9,
                 latency: float = 1e-4, chunk: int = 4 << 20,
                 arrivals: list[float] | None = None, num_objects: int | None = None,
                 fold_bytes_per_s: float | None = None) -> None:
        if size < 4 or size % 4:
            raise InvalidArgument(f"a float32 input needs a positive multiple of 4 bytes; got {size}")
        _check_model(bandwidth, latency, chunk)
        self.k = inputs if num_objects is None else num_objects
        if not 1 <= self.k <= inputs:
            raise InvalidArgument(f"num_objects must be 1 to {inputs}; got {num_objects}")
        if arrivals is not None and len(arrivals) != inputs:
            raise InvalidArgument(f"arrivals needs one time per input ({inputs}); got {len(arrivals)}")
        # A step folds and hands on pieces of `fold_unit(size, chunk)`, as a
        # host step whose fold step is `chunk` does: the simulation's unit.
        self.n, self.size, self.bw, self.lat = inputs, size, bandwidth, latency
        self.chunk = chunk = fold_unit(size, chunk)
        self.chunks = -(-size // chunk)
        if self.chunks > MAX_SIM_CHUNKS:
            raise InvalidArgument(f"{size} bytes in chunks of {chunk} is {self.chunks} chunks; "
                                  f"at most {MAX_SIM_CHUNKS} are simulated")
        self.arrivals = [0.0] * inputs if arrivals is None else [float(a) for a in arrivals]
        if not all(0.0 <= a < float("inf") for a in self.arrivals):
            raise InvalidArgument("arrival times must be finite and not negative")
        self.fold_bps = fold_bytes_per_s
        self.layout = {"kind": "numpy", "dtype": "<f4", "shape": [size // 4], "nbytes": size}
        # (its steps fold and hand on whole chunks: the model's unit too)
        self.dir = s.Directory(latency_s=latency, bytes_per_s=bandwidth, chunk_size=chunk,
                               fold_step=chunk)
        self._events: list[tuple[float, int, str, tuple]] = []
        self._seq = itertools.count()
        self.produced: dict[bytes, int] = {}   # object (input or partial result) -> chunks there
        self.waiting_on: dict[tuple[bytes, int], list[_Stream]] = {}
        #: an early step's output -> the steps that take it as their input
        self.reads: dict[bytes, list[_Step]] = {}
        self.uplink_free: dict[str, float] = {}
        self.downlink_free: dict[str, float] = {}
        self.steps = 0
        self.result = ReduceResult(size, inputs, self.k, bandwidth)

    def _at(self, t: float, kind: str, *args: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, args))

    def run(self) -> ReduceResult:
        for i in range(self.n + 1):
            self.dir.handle(s.NodeJoined(f"n{i}", f"sim://{i}"))
        ids = tuple(_input_id(i) for i in range(self.n))
        self._tell(0.0, s.ReduceRequested(f"n{self.n}", 1, _TARGET, ids, "sum", self.k))
        for i, t in enumerate(self.arrivals):
            self._at(t, "put", i)
        while self._events:
            t, _, kind, args = heapq.heappop(self._events)
            getattr(self, "_" + kind)(t, *args)
        return self._finish()

    def _finish(self) -> ReduceResult:
        task = self.dir.reduces.get(_TARGET)
        if task is None or not task.done or not self.result.done_at:
            # (every input arrives and nothing fails: a reduce left unfinished
            # is the state machine's bug, or this simulator's)
            raise RuntimeError(f"the reduce never finished: {task and (task.failed or task.done)}")
        r = self.result
        r.degree, r.steps = task.degree, self.steps
        r.depth = tree_depth(self.k, task.degree)
        r.last_arrival = max(self.arrivals[int.from_bytes(oid[2:], "big")] for oid in task.chosen)
        r.model = tree_walk_time(self.size, self.k, task.degree, self.lat, self.bw, self.chunk)
        return r

    # ------------------------------------------------- directory messages ---
    def _tell(self, t: float, *events: object) -> None:
        """Node -> directory: arrives one latency later."""
        self._at(t + self.lat, "directory", events)

    def _directory(self, t: float, events: tuple) -> None:
        for ev in events:
            for cmd in self.dir.handle(ev):
                if isinstance(cmd, s.StartReduceStep):  # directory -> node: one latency
                    self._at(t + self.lat, "start", cmd.node, cmd.step)
                elif isinstance(cmd, s.Reply) and isinstance(cmd.body, m.Failure):
                    raise RuntimeError(f"the directory refused {ev}: {cmd.body}")
                elif isinstance(cmd, s.InlineReduce):
                    raise RuntimeError("an inline reduce: inputs here are never inline")
                # (Drop: partial results freed once the target is complete; Reply ok)

    def _put(self, t: float, i: int) -> None:
        """Input i is in its node's store at once (a put's copy is not modelled)."""
        oid, node = _input_id(i), f"n{i}"
        self.produced[oid] = self.chunks
        self._tell(t, s.Put(node, 1, oid, self.size, self.layout), s.Completed(node, oid))

    # ------------------------------------------------------------- steps ---
    def _start(self, t: float, node: str, step: m.ReduceStep) -> None:
        """A step begins: one pull request per child, reaching it a latency later
        (a child's partial result may not exist yet: its node serves it as it
        is made, as a real node's data server waits for it)."""
        self.steps += 1
        st = _Step(node, step.output, step.output == _TARGET, step.tag, step.input)
        if step.early:  # folds as its input, the early step's output, grows
            self.reads.setdefault(st.input, []).append(st)
        for child in step.children:
            sender = "n" + child.address.removeprefix("sim://")
            stream = _Stream(child.oid, sender, st)
            st.streams.append(stream)
            self._at(t + self.lat, "send", stream)
        self._fold_ready(t, st)  # (a root with no children: k = 1)

    def _nbytes(self, i: int) -> int:
        return min(self.chunk, self.size - i * self.chunk)

    def _send(self, t: float, x: _Stream) -> None:
        """Put the stream's next chunk on the wire once the child has made it,
        the child's uplink is free and the parent's downlink is free (one
        chunk at a time through each: a parent's children share its downlink)."""
        i = x.next_chunk
        if i >= self.chunks:
            return
        if self.produced.get(x.source, 0) <= i:  # not folded (or put) yet: wait for it
            self.waiting_on.setdefault((x.source, i), []).append(x)
            return
        receiver = x.step.node
        start = max(t, self.uplink_free.get(x.sender, 0.0), self.downlink_free.get(receiver, 0.0))
        end = start + self._nbytes(i) / self.bw
        self.uplink_free[x.sender] = self.downlink_free[receiver] = end
        self._at(end, "sent", x)
        self._at(end + self.lat, "arrive", x)

    def _sent(self, t: float, x: _Stream) -> None:
        x.next_chunk += 1  # (no acks: the stream goes on)
        self._send(t, x)

    def _arrive(self, t: float, x: _Stream) -> None:
        x.arrived += 1
        self._fold_ready(t, x.step)

    def _fold_ready(self, t: float, st: _Step) -> None:
        """Fold, in order, every chunk that has arrived from all children (and
        that its input has, when that is an early step's output)."""
        ready = min([x.arrived for x in st.streams] + [self.produced.get(st.input, 0)])
        while st.scheduled < ready:
            cost = self._nbytes(st.scheduled) / self.fold_bps if self.fold_bps else 0.0
            st.fold_free = max(t, st.fold_free) + cost
            st.scheduled += 1
            self._at(st.fold_free, "folded", st)

    def _folded(self, t: float, st: _Step) -> None:
        """A chunk of the step's output exists: its parent's stream may send it."""
        st.folded += 1
        self.produced[st.output] = st.folded
        for waiter in self.waiting_on.pop((st.output, st.folded - 1), []):
            self._at(t, "send", waiter)
        for reader in self.reads.get(st.output, ()):
            self._fold_ready(t, reader)
        if st.folded == self.chunks and st.is_root:
            self.result.done_at = t
            # (as the node's `_complete_msg`: the directory then finishes the
            # reduce; an inner step's "complete" changes nothing there)
            self._tell(t, s.Completed(st.node, _TARGET, self.size, self.layout, own=True,
                                      tag=st.tag))


def simulate_reduce(inputs: int, size: int, **kw: object) -> ReduceResult:
    return ReduceSim(inputs, size, **kw).run()
