"""hoplite-gpu's own broadcast and reduce on a fabric: the real directory state
machine decides (through `sim_directory`), the fabric moves the chunks.

As in `hoplite_gpu.simulator`: each message to or from the directory costs
`latency`, and so does each chunk's hop; a partial copy is pulled from as it
fills; a reduce step folds chunk i once every child's chunk i is in (folding
is free) and its parent pulls its output chunk by chunk. What differs is the
links: chunks are flows on the fabric, sharing every link they cross max-min
fairly with all others, instead of queueing at a sender's uplink and a
receiver's downlink.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..directory.reduce_plan import fold_unit
from ..errors import InvalidArgument
from ..sim_directory import (
    TARGET,
    BroadcastDirector,
    Pull,
    ReduceDirector,
    input_id,
    input_number,
    node_number,
)
from .ops import Op, _hosts, _positive


class _Pull:
    __slots__ = ("receiver", "sender", "next", "busy")

    def __init__(self, receiver: str, sender: str) -> None:
        self.receiver, self.sender, self.next, self.busy = receiver, sender, 0, False


def _chunk_count(where: str, size: int, chunk: int) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidArgument(f"{where}: size must be a whole number of bytes, at least 1; "
                              f"got {size!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise InvalidArgument(f"{where}: chunk must be a whole number of bytes, at least 1; "
                              f"got {chunk!r}")
    return -(-size // chunk)


class HopliteBroadcast(Op):
    """An object of `size` bytes on hosts[0], gotten by every other host of
    `hosts` (node n<i> runs on hosts[i]), each asking at its `arrivals` time."""

    name = "hoplite-broadcast"

    def __init__(self, hosts: Sequence[int], size: int, *, chunk: int = 4 << 20,
                 latency: float = 1e-4, bandwidth: float = 1.25e9,
                 max_receivers_per_sender: int = 1,
                 arrivals: Sequence[float] | None = None) -> None:
        super().__init__(latency)
        self.hosts = _hosts("HopliteBroadcast", hosts)
        self.size, self.chunk = size, chunk
        self.chunks = _chunk_count("HopliteBroadcast", size, chunk)
        receivers = len(self.hosts) - 1
        if arrivals is not None and len(arrivals) != receivers:
            raise InvalidArgument(f"HopliteBroadcast: arrivals needs one time per receiver "
                                  f"({receivers}); got {len(arrivals)}")
        self.arrivals = [0.0] * receivers if arrivals is None else [float(a) for a in arrivals]
        self.director = BroadcastDirector(receivers, size, latency=latency,
                                          bandwidth=_positive("HopliteBroadcast", "bandwidth",
                                                              bandwidth),
                                          max_receivers_per_sender=max_receivers_per_sender,
                                          chunk=chunk)
        self.have = {"n0": self.chunks}
        self.waiting: dict[str, list[_Pull]] = {}
        #: (receiver, sender) as the directory assigned them
        self.edges: list[tuple[str, str]] = []

    def start(self, net) -> None:
        self.net = net
        self.director.start()
        for i, t in enumerate(self.arrivals, start=1):
            net.at(t, lambda now, node=f"n{i}": self._begin(now, self.director.locate(node), 2))

    def _begin(self, t: float, pulls: list[Pull], hops: int) -> None:
        """Start what the directory decided at t, `hops` latencies later."""
        for p in pulls:
            if p.sender is None:
                self._mark_done(t + hops * self.latency, p.receiver)
                continue
            self.edges.append((p.receiver, p.sender))
            self.have.setdefault(p.receiver, 0)
            pull = _Pull(p.receiver, p.sender)
            self.net.at(t + hops * self.latency, lambda now, pull=pull: self._pump(pull))

    def _mark_done(self, t: float, node: str) -> None:
        self.done_at[self.hosts[node_number(node)]] = t

    def _pump(self, pull: _Pull) -> None:
        i = pull.next
        if pull.busy or i >= self.chunks:
            return
        if self.have[pull.sender] <= i:   # the sender does not have it yet
            self.waiting.setdefault(pull.sender, []).append(pull)
            return
        pull.busy = True
        nbytes = min(self.chunk, self.size - i * self.chunk)
        self.net.send(self.hosts[node_number(pull.sender)], self.hosts[node_number(pull.receiver)],
                      nbytes, lambda t: self._left(t, pull))

    def _left(self, t: float, pull: _Pull) -> None:
        pull.busy = False
        pull.next += 1
        self.net.at(t + self.latency, lambda now: self._arrive(now, pull.receiver))
        self._pump(pull)

    def _arrive(self, t: float, node: str) -> None:
        self.have[node] += 1
        for waiter in self.waiting.pop(node, []):
            self._pump(waiter)
        if self.have[node] < self.chunks:
            self._begin(t, self.director.progress(node, self.have[node] * self.chunk), 1)
            return
        self._mark_done(t, node)
        self._begin(t, self.director.completed(node), 1)


class _Step:
    """One started tree position: folds its input and its children's streams."""

    __slots__ = ("node", "output", "is_root", "tag", "input", "streams", "folded")

    def __init__(self, node: str, output: bytes, is_root: bool, tag: bytes, inp: bytes) -> None:
        self.node, self.output, self.is_root, self.tag, self.input = node, output, is_root, tag, inp
        self.streams: list[_Stream] = []
        self.folded = 0


class _Stream:
    __slots__ = ("source", "sender", "step", "next", "arrived", "busy")

    def __init__(self, source: bytes, sender: str, step: _Step) -> None:
        self.source, self.sender, self.step = source, sender, step
        self.next = self.arrived = 0
        self.busy = False


class HopliteReduce(Op):
    """A sum of float32 inputs of `size` bytes: input i put on hosts[i] at
    `arrivals[i]`, the result asked for by hosts[-1] (node n<len-1>) at time 0,
    over the first `num_objects` inputs ready. Steps fold in pieces of
    `fold_unit(size, chunk)`, as a host step with fold step `chunk` does."""

    name = "hoplite-reduce"

    def __init__(self, hosts: Sequence[int], size: int, *, chunk: int = 4 << 20,
                 latency: float = 1e-4, bandwidth: float = 1.25e9,
                 arrivals: Sequence[float] | None = None, num_objects: int | None = None) -> None:
        super().__init__(latency)
        self.hosts = _hosts("HopliteReduce", hosts)
        if isinstance(size, bool) or not isinstance(size, int) or size < 4 or size % 4:
            raise InvalidArgument(f"HopliteReduce: a float32 input needs a positive multiple of "
                                  f"4 bytes; got {size!r}")
        inputs = len(self.hosts) - 1
        self.size = size
        self.chunk = fold_unit(size, chunk) if isinstance(chunk, int) and chunk > 0 else chunk
        self.chunks = _chunk_count("HopliteReduce", size, self.chunk)
        if arrivals is not None and len(arrivals) != inputs:
            raise InvalidArgument(f"HopliteReduce: arrivals needs one time per input ({inputs}); "
                                  f"got {len(arrivals)}")
        self.arrivals = [0.0] * inputs if arrivals is None else [float(a) for a in arrivals]
        k = inputs if num_objects is None else num_objects
        if not 1 <= k <= inputs:
            raise InvalidArgument(f"HopliteReduce: num_objects must be 1 to {inputs}; got {k!r}")
        self.director = ReduceDirector(inputs, size, num_objects=k, latency=latency,
                                       bandwidth=_positive("HopliteReduce", "bandwidth",
                                                           bandwidth),
                                       chunk=self.chunk)
        self.produced: dict[bytes, int] = {}
        self.waiting: dict[tuple[bytes, int], list[_Stream]] = {}
        self.reads: dict[bytes, list[_Step]] = {}
        self.steps = 0
        self.last_input = 0.0

    def start(self, net) -> None:
        self.net = net
        self._run_steps(0.0, self.director.start())
        for i, t in enumerate(self.arrivals):
            net.at(t, lambda now, i=i: self._put(now, i))

    def _put(self, t: float, i: int) -> None:
        self.produced[input_id(i)] = self.chunks
        self.net.at(t + self.latency, lambda now: self._run_steps(now, self.director.put(i)))

    def _run_steps(self, t: float, commands: list) -> None:
        for cmd in commands:   # directory -> node: one latency
            self.net.at(t + self.latency, lambda now, c=cmd: self._start_step(now, c.node, c.step))

    def _start_step(self, t: float, node: str, step) -> None:
        self.steps += 1
        st = _Step(node, step.output, step.output == TARGET, step.tag, step.input)
        if step.early:
            self.reads.setdefault(st.input, []).append(st)
        for child in step.children:
            x = _Stream(child.oid, "n" + child.address.removeprefix("sim://"), st)
            st.streams.append(x)
            self.net.at(t + self.latency, lambda now, x=x: self._pump(x))
        self._fold_ready(t, st)

    def _pump(self, x: _Stream) -> None:
        i = x.next
        if x.busy or i >= self.chunks:
            return
        if self.produced.get(x.source, 0) <= i:
            self.waiting.setdefault((x.source, i), []).append(x)
            return
        x.busy = True
        nbytes = min(self.chunk, self.size - i * self.chunk)
        self.net.send(self.hosts[node_number(x.sender)], self.hosts[node_number(x.step.node)],
                      nbytes, lambda t: self._left(t, x))

    def _left(self, t: float, x: _Stream) -> None:
        x.busy = False
        x.next += 1
        self.net.at(t + self.latency, lambda now: self._arrive(now, x))
        self._pump(x)

    def _arrive(self, t: float, x: _Stream) -> None:
        x.arrived += 1
        self._fold_ready(t, x.step)

    def _fold_ready(self, t: float, st: _Step) -> None:
        ready = min([x.arrived for x in st.streams] + [self.produced.get(st.input, 0)])
        while st.folded < ready:
            st.folded += 1
            self.produced[st.output] = st.folded
            for waiter in self.waiting.pop((st.output, st.folded - 1), []):
                self._pump(waiter)
            for reader in self.reads.get(st.output, ()):
                self._fold_ready(t, reader)
            if st.folded == self.chunks and st.is_root:
                self.done_at[self.hosts[node_number(st.node)]] = t
                self.net.at(t + self.latency, lambda now, st=st: self._run_steps(
                    now, self.director.root_done(st.node, st.tag)))

    def finish(self) -> None:
        """Check the reduce finished; note the last input that went into it."""
        task = self.director.task()
        self.last_input = max(self.arrivals[input_number(oid)] for oid in task.chosen)
