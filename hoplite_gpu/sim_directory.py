"""The directory's side of a simulated broadcast or reduce: the events a
simulator feeds the real state machine (`directory.state.Directory`) and what
it makes of the commands that come back, with no notion of time or links.

A simulator owns the clock and the bytes; it tells these drivers what happened
(a node asked for the object, has n bytes of it, holds it all; an input was
put; a reduce's root finished) and gets back what the directory decided (who
pulls from whom; which reduce steps start where). Nodes are named "n0",
"n1", ...: a broadcast's object is put on n0; a reduce's inputs are put on
n0 .. n(k-1) and its result is asked for on n(k). Standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from . import messages as m
from .directory import state as s

OBJECT = b"\x01" * 20
TARGET = b"\x02" * 20


@dataclass(frozen=True)
class Pull:
    """`receiver` pulls the object from `sender`; sender None: nothing to
    move (the answer held the bytes, or the node has them). `moved`: a
    receiver pulling already goes on from `sender` (a push; only where
    nodes have racks: directory/racks.py)."""

    receiver: str
    sender: str | None
    moved: bool = False


def node_number(name: str) -> int:
    return int(name.removeprefix("n"))


class BroadcastDirector:
    """One object of `size` bytes put on n0, wanted by n1 .. n(receivers);
    `racks`: node i's rack (`Config.rack`), if any is told."""

    def __init__(self, receivers: int, size: int, *, max_receivers_per_sender: int = 1,
                 latency: float = 1e-4, bandwidth: float = 1.25e9, chunk: int = 4 << 20,
                 racks: Sequence[str | None] | None = None) -> None:
        self.receivers, self.size = receivers, size
        self.racks = racks
        self.directory = s.Directory(max_receivers_per_sender=max_receivers_per_sender,
                                     latency_s=latency, bytes_per_s=bandwidth, chunk_size=chunk)

    def start(self) -> None:
        """Every node joins; n0 puts the object and holds it all."""
        for i in range(self.receivers + 1):
            rack = None if self.racks is None else self.racks[i]
            self.directory.handle(s.NodeJoined(f"n{i}", f"sim://{i}", rack=rack))
        self.directory.handle(s.Put("n0", 0, OBJECT, self.size, {"kind": "bytes"}))
        self.directory.handle(s.Completed("n0", OBJECT))

    def locate(self, node: str) -> list[Pull]:
        return self._pulls(s.Locate(node, 1, OBJECT))

    def progress(self, node: str, nbytes: int) -> list[Pull]:
        """`node` holds the object's first `nbytes` (a partial copy others may pull)."""
        return self._pulls(s.Progress(node, OBJECT, nbytes))

    def completed(self, node: str) -> list[Pull]:
        return self._pulls(s.Completed(node, OBJECT))

    def _pulls(self, event: object) -> list[Pull]:
        out = []
        for cmd in self.directory.handle(event):
            if isinstance(cmd, s.Reply) and isinstance(cmd.body, m.Location):
                body = cmd.body
                if body.sender is not None:
                    out.append(Pull(cmd.node, body.sender))
                elif body.local or body.inline is not None:
                    out.append(Pull(cmd.node, None))
            elif isinstance(cmd, s.PushRestripe) and len(cmd.body.stripes) == 1:
                out.append(Pull(cmd.node, cmd.body.stripes[0].sender, moved=True))
        return out


def input_id(i: int) -> bytes:
    return b"in" + i.to_bytes(18, "big")


def input_number(oid: bytes) -> int:
    return int.from_bytes(oid[2:], "big")


class ReduceDirector:
    """A sum of `inputs` float32 arrays of `size` bytes; input i is put on n<i>
    and n<inputs> asks for the first `num_objects` ready. The directory's
    steps fold in pieces of `chunk` (pass `reduce_plan.fold_unit(size, fold
    step)`, as a host step does)."""

    def __init__(self, inputs: int, size: int, *, num_objects: int | None = None,
                 latency: float = 1e-4, bandwidth: float = 1.25e9, chunk: int = 4 << 20) -> None:
        self.inputs, self.size = inputs, size
        self.k = inputs if num_objects is None else num_objects
        self.layout = {"kind": "numpy", "dtype": "<f4", "shape": [size // 4], "nbytes": size}
        self.directory = s.Directory(latency_s=latency, bytes_per_s=bandwidth, chunk_size=chunk,
                                     fold_step=chunk)

    def start(self) -> list[s.StartReduceStep]:
        """Every node joins; the root's node asks for the reduce."""
        for i in range(self.inputs + 1):
            self.directory.handle(s.NodeJoined(f"n{i}", f"sim://{i}"))
        ids = tuple(input_id(i) for i in range(self.inputs))
        return self.tell(s.ReduceRequested(f"n{self.inputs}", 1, TARGET, ids, "sum", self.k))

    def put(self, i: int) -> list[s.StartReduceStep]:
        """Input i is in its node's store, whole."""
        oid, node = input_id(i), f"n{i}"
        return self.tell(s.Put(node, 1, oid, self.size, self.layout), s.Completed(node, oid))

    def root_done(self, node: str, tag: bytes) -> list[s.StartReduceStep]:
        """The root step made the whole result (as a node's own completion)."""
        return self.tell(s.Completed(node, TARGET, self.size, self.layout, own=True, tag=tag))

    def tell(self, *events: object) -> list[s.StartReduceStep]:
        """Apply events; return the steps to start. A refusal or an inline
        reduce is this driver's misuse, raised as RuntimeError."""
        steps = []
        for ev in events:
            for cmd in self.directory.handle(ev):
                if isinstance(cmd, s.StartReduceStep):
                    steps.append(cmd)
                elif isinstance(cmd, s.Reply) and isinstance(cmd.body, m.Failure):
                    raise RuntimeError(f"the directory refused {ev}: {cmd.body}")
                elif isinstance(cmd, s.InlineReduce):
                    raise RuntimeError("an inline reduce: inputs here are never inline")
        return steps

    def task(self):
        """The reduce task, once finished: its degree and chosen inputs."""
        task = self.directory.reduces.get(TARGET)
        if task is None or not task.done:
            raise RuntimeError(f"the reduce never finished: {task and (task.failed or task.done)}")
        return task
