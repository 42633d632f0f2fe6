"""One reduce's record (`ReduceTask`) and the pure functions on its tree: the
id of a partial result, the command of a step, the checks a reduce's
arguments and inputs pass. Owned by the reduces part (`reduces.Reduces`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hoplite_gpu import messages as m

from .entry import Entry
from .events import Key, NodeId, ReduceRequested
from .reduce_plan import choose_degree, fold_unit, inorder_tree, tree_root
from .settings import Settings

#: Layout kinds a reduce accepts: typed arrays, folded by the NumPy kernels on a
#: host buffer and by the CuPy kernels where a node keeps the object on a GPU.
REDUCIBLE_KINDS = ("numpy", "device")


@dataclass
class ReduceTask:
    target: Key
    inputs: tuple[Key, ...]
    op: str
    k: int
    size: int = -1
    layout: dict[str, Any] | None = None
    inline: bool = False
    degree: int = 1
    #: (input, node hosting it) in arrival order; the first k fill tree positions.
    slots: list[tuple[Key, NodeId]] = field(default_factory=list)
    #: tree position -> index into `slots`
    at: dict[int, int] = field(default_factory=dict)
    #: the input that takes the tree's root when it arrives among the first k
    root_input: Key | None = None
    #: relay the result in the inputs' order (see ReduceRequested.relay)
    relay: bool = False
    inline_data: list[bytes] = field(default_factory=list)
    backups: list[Key] = field(default_factory=list)
    #: every input in `slots` or `backups` (membership in O(1) at thousands of inputs)
    placed: set[Key] = field(default_factory=set)
    started: set[int] = field(default_factory=set)
    #: tree position -> its children already folded by the position's early
    #: steps (`Reduces._start_ready_steps`), in the order they were folded
    folded: dict[int, list[int]] = field(default_factory=dict)
    #: tree position -> how many early steps it was sent
    phases: dict[int, int] = field(default_factory=dict)
    #: tree positions whose whole subtree (itself too) is filled
    whole: set[int] = field(default_factory=set)
    failed: str | None = None
    done: bool = False
    #: some node heard which inputs the result holds (`reduced_inputs`): a
    #: result lost after that is not made again (a new tree may take others)
    told: bool = False
    restarts: int = 0
    #: names this incarnation of the tree in its partial results' ids
    tag: bytes = b""
    waiters: list[tuple[NodeId, int]] = field(default_factory=list)
    #: ReduceConfirm requests of this tree, answered when it finishes or is rebuilt
    confirms: list[tuple[NodeId, int]] = field(default_factory=list)

    @property
    def chosen(self) -> list[Key]:
        return [oid for oid, _ in self.slots]

    def slot(self, pos: int) -> tuple[Key, NodeId]:
        return self.slots[self.at[pos]]

    def place(self, oid: Key) -> int:
        """The tree position for the next arrival: the lowest free one (the
        in-order rule), except that the root waits for `root_input` while
        another position is still free."""
        root = tree_root(self.k, self.degree)
        if oid == self.root_input and root not in self.at:
            return root
        skip = root if self.root_input is not None and root not in self.at else None
        # Positions fill from 0 up with at most the root out of order, so the
        # lowest free one is next to len(at).
        p = max(0, len(self.at) - 1)
        while p < self.k and (p in self.at or p == skip):
            p += 1
        return p if p < self.k else root


def step_id(target: Key, position: int, tag: bytes = b"", phase: int | None = None) -> Key:
    """Id of the partial result at a tree position. `tag` names one incarnation of
    the tree: a restarted reduce (or a restarted directory) must never match a
    stale partial result that a node still holds under an old id. `phase`
    names the output of the position's early step number `phase` (the
    children that arrived before the rest, folded ahead)."""
    import hashlib

    extra = b"" if phase is None else b"/early" + phase.to_bytes(4, "big")
    return hashlib.blake2b(target + position.to_bytes(4, "big") + tag + extra, digest_size=20,
                           person=b"hoplite-step").digest()



def unreducible_dtype(layout: dict) -> str:
    """Why the element type of arrays of `layout` cannot be reduced ("" if it can),
    so a reduce fails when its first input arrives, not inside a step."""
    from hoplite_gpu.errors import HopliteError
    from hoplite_gpu.kernels import DTYPES
    from hoplite_gpu.values import Layout, numpy_dtype

    try:
        name = numpy_dtype(Layout.from_wire(layout)).name
    except HopliteError as exc:
        return str(exc)
    if name not in DTYPES:
        return f"cannot reduce dtype {name}; supported dtypes are {', '.join(DTYPES)}"
    return ""



def check_reduce_args(ev: ReduceRequested) -> str | None:
    if not ev.inputs:
        return "reduce needs at least one input"
    if len(set(ev.inputs)) != len(ev.inputs):
        return "reduce inputs must be distinct objects"
    if ev.target in ev.inputs:
        return "a reduce cannot write into one of its own inputs"
    if not 1 <= ev.num_objects <= len(ev.inputs):
        return f"num_objects must be between 1 and {len(ev.inputs)}; got {ev.num_objects}"
    return None


def check_input(task: ReduceTask, oid: Key, entry: Entry, settings: Settings) -> str | None:
    """Why input `oid` (its entry `entry`) cannot join `task` (None: it can).
    The first input fixes the reduce's size, layout and tree degree."""
    if task.layout is None:
        if entry.layout.get("kind") not in REDUCIBLE_KINDS:
            return (f"input {oid.hex()} is a {entry.layout.get('kind')!r} object; reduce "
                    "works on NumPy and device arrays")
        refused = unreducible_dtype(entry.layout)
        if refused:
            return f"input {oid.hex()}: {refused}"
        task.size, task.layout, task.inline = entry.size, entry.layout, entry.inline is not None
        # A relayed reduce is one slice of an allreduce: a chain, so that
        # every slice moves from rank r to rank r+1 only, as in a ring (a
        # tree that is best for one reduce alone loads its inner nodes'
        # links twice while every other slice runs too).
        # (the pipelining unit: a host step's fold pieces, a device step's chunks)
        unit = settings.chunk_size if entry.layout.get("kind") == "device" \
            else fold_unit(entry.size, min(settings.chunk_size, settings.fold_step))
        task.degree = 1 if task.relay else choose_degree(
            task.size, task.k, settings.latency_s, settings.bytes_per_s, unit)
        return None
    if entry.size != task.size or entry.layout != task.layout:
        first = task.slots[0][0].hex() if task.slots else "?"
        return (f"input {oid.hex()} has {entry.size} bytes and layout {entry.layout}, but "
                f"input {first} has {task.size} bytes and layout {task.layout}; every input "
                "of a reduce must have the same dtype and shape")
    if task.inline != (entry.inline is not None):
        return f"input {oid.hex()} was put with a different inline threshold than the others"
    return None


def step_command(task: ReduceTask, pos: int, kids: list[int], addresses: dict[NodeId, str],
                 final: bool = False, rails: dict[NodeId, tuple[str, ...]] | None = None
                 ) -> m.ReduceStep:
    """The command of a step at `pos` folding `kids` (children of it) into
    what the position holds so far: its input, or its last early step's
    output. Final: the position's own output (the target at the root);
    else the output of a new early step. `addresses`: the live nodes';
    `rails`: every address of those that listen on several."""
    parent, children = inorder_tree(task.k, task.degree)
    sources = []
    for c in kids:
        source = step_id(task.target, c, task.tag) if children[c] else task.slot(c)[0]
        node = task.slot(c)[1]
        sources.append(m.StepChild(oid=source, address=addresses.get(node, ""), node=node,
                                   rails=list((rails or {}).get(node, ()))))
    done = task.phases.get(pos, 0)
    is_root = final and parent[pos] is None
    output = (task.target if is_root else step_id(task.target, pos, task.tag) if final
              else step_id(task.target, pos, task.tag, done))
    return m.ReduceStep(
        target=task.target, output=output,
        input=step_id(task.target, pos, task.tag, done - 1) if done else task.slot(pos)[0],
        children=sources, reduce_op=task.op, count=task.k if is_root else 0, size=task.size,
        layout=task.layout, tag=task.tag,
        early=bool(done))  # (early: its input is this node's own early step's output)


def step_outputs(task: ReduceTask) -> list[tuple[int, Key]]:
    """(position, output) of every partial result of `task`'s tree: its
    started steps' (but the root's, which is the target) and its early
    steps'."""
    parent, _ = inorder_tree(task.k, task.degree)
    outputs = [(pos, step_id(task.target, pos, task.tag))
               for pos in task.started if parent[pos] is not None]
    for pos, count in task.phases.items():
        outputs.extend((pos, step_id(task.target, pos, task.tag, n)) for n in range(count))
    return outputs
