"""Reduce and allreduce over packed spanning trees (Blink): the array is
split across the trees `trees.pack` finds over a topology, in proportion to
their rates, and each tree's range is reduced up that tree, children to
parents, chunk by chunk, every tree at once.

    total = multitree_allreduce(grads, name="g-7", rank=rank, size=8,
                                topology=fixture("dgx1v"))

Rank r sits on the topology's node `members[r]` (default: its r-th node);
every rank packs the same plan (a pure function of the topology, the root
and the members). In tree t, every rank folds, for t's byte range, its own
input with its children's partial results as their bytes arrive, into a
partial result of its own that its parent in t pulls while it grows; a
leaf's partial result is its input's range itself (no copy). The root's
folds land straight in the result.

A reduce packs its trees over the links turned around (`flow="reduce"`).
An allreduce packs trees that are used both ways at once
(`flow="allreduce"`): each tree reduces its range up to the root and
broadcasts it back down as the root's result fills, so the broadcast of a
range starts with its first reduced chunk, not after the whole reduce (on a
symmetric topology such a packing carries at least half of the broadcast's
rate R*, which reduce-then-broadcast reaches; the DGX-1V's 85 against 75).
The broadcast half is `multitree`'s: each rank pulls a pinned plan of one
sub-flow per tree from its parent in that tree, the root as a backup.

Partial results are objects of each rank's own store, named after the call,
that only its parents pull; the directory never hears of them, and each
rank frees its own before its call returns. The ranks learn each other's
node and data address from small inline cards (`messages.TreeMember`, with
the rank's size and layout); the root says how the reduce ended in one more
(``ok``, or why it failed), which is what a non-root rank of a reduce waits
for, and what stops every rank of an allreduce that failed.

A member lost during the call (its process gone, its streams cut or stalled
past `stall_timeout_s`) fails the call on every rank that is left, with a
`ReduceFailed` naming it: its parent's pull of its partial result fails,
that parent fails its own partial results with the error, its parent's pull
fails in turn with the error's text, and so on up to the root, which tells
the others. A root lost before it says so is found by the others' probe of
it (its card pulled again every stall timeout). There is no dynamic path to
move to: a reduce of every rank needs the lost rank's input, which no other rank holds (docs/topology.md,
"Reducing over the trees").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import numpy as np

from . import api, device, kernels
from . import messages as m
from .device import element_view, is_device_buffer
from .directory.reduce_plan import FOLD_PIECES, FOLD_STEP, fold_unit
from .errors import HopliteError, InvalidArgument, ObjectNotFound, ReduceFailed, Timeout
from .ids import ObjectID
from .multitree import _fill, flows_for, members_of
from .node.engine import FlowSink
from .node.flows import PEER_FAILURES
from .node.holdings import complete_msg
from .node.plan import Ledger
from .node.store import StoredObject
from .node.transfer import fetch_range
from .runtime import time_left
from .values import Layout, from_buffer, numpy_dtype, to_buffer

log = logging.getLogger("hoplite_gpu")

#: How an error names the rank it started at; it travels up the trees in
#: the text of each parent's error (a data server's error frame carries it).
_NAMED = re.compile(r"rank (\d+) (?:was lost|failed)")
#: A tree folds its range in at least this many pieces per level of its
#: height (and `FOLD_PIECES` at least), down to `MIN_FOLD_STEP`.
FOLD_PIECES_PER_LEVEL = 4
_OK = b"ok"
_FAILED = b"failed\n"


class _Ids:
    """The objects of one call named `name`."""

    def __init__(self, name: str) -> None:
        self.name = name
        #: the result, held by every rank (an allreduce only)
        self.result = ObjectID.from_name(f"{name}/mtr")
        #: how the reduce ended, put by the root
        self.outcome = ObjectID.from_name(f"{name}/mtr/outcome")

    def card(self, rank: int) -> ObjectID:
        return ObjectID.from_name(f"{self.name}/mtr/who/{rank}")

    def part(self, tree: int, rank: int) -> ObjectID:
        """Rank `rank`'s partial result of tree `tree` (in its store only)."""
        return ObjectID.from_name(f"{self.name}/mtr/part/{tree}/{rank}")


def call_ids(name: str, size: int) -> list[ObjectID]:
    """Every object the directory knows of a reduce or allreduce of `size`
    ranks under `name` (free them once every rank has returned)."""
    ids = _Ids(name)
    return [ids.result, ids.outcome, *(ids.card(r) for r in range(size))]


def multitree_reduce(value: Any, *, name: str, rank: int, size: int, topology: Any,
                     root: int = 0, op: str = "sum", members: Sequence[Any] | None = None,
                     timeout: float | None = None, array_type: str = "numpy") -> Any:
    """The reduction (`op`) of every rank's array on `root`, over trees
    packed on `topology`'s links turned around; None on the other ranks,
    which return once the root has the result. Every rank passes an array of
    one dtype and shape, and leaves it unchanged until the call returns (it
    is read in place). See the module's doc."""
    return _blocking("reduce", value, name, rank, size, topology, root, op, members, timeout,
                     array_type)


def multitree_allreduce(value: Any, *, name: str, rank: int, size: int, topology: Any,
                        op: str = "sum", root: int = 0, members: Sequence[Any] | None = None,
                        timeout: float | None = None, array_type: str = "numpy") -> Any:
    """The reduction (`op`) of every rank's array, on every rank (read-only),
    over trees packed on `topology` to be used both ways: each reduces its
    range up to `root` and broadcasts it down again at once. Inputs as for
    `multitree_reduce`; the result stays on every node until its objects
    (`call_ids`) are deleted."""
    return _blocking("allreduce", value, name, rank, size, topology, root, op, members,
                     timeout, array_type)


def plan_for(kind: str, topology: Any, root: Any, members: Sequence[Any]) -> Any:
    """The trees a reduce (over the links turned around) or an allreduce
    (used both ways) of `members` to `root` goes over."""
    from .trees import pack

    return pack(topology, root, members, flow="reduce" if kind == "reduce" else "allreduce")


def _blocking(kind: str, value: Any, name: str, rank: int, size: int, topology: Any,
              root: int, op: str, members: Sequence[Any] | None, timeout: float | None,
              array_type: str) -> Any:
    call = f"multitree_{kind}"
    if not (isinstance(size, int) and size >= 2 and isinstance(rank, int) and 0 <= rank < size
            and isinstance(root, int) and 0 <= root < size):
        raise InvalidArgument(f"{call}: size must be an int >= 2 (one rank has nothing to "
                              f"reduce over trees), rank {rank!r} and root {root!r} ints in "
                              f"[0, {size!r})")
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"{call}: name must be a non-empty str; got {name!r}")
    try:
        kernels.check_op(op)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{call}: {exc}") from None
    chosen = members_of(topology, size, members, call)
    plan = plan_for(kind, topology, chosen[root], chosen)
    rt = api.runtime()
    limit = api._timeout(rt, timeout)
    return rt.call(tree_reduce(rt.node, value, name, rank, root, chosen, plan, op, limit,
                               everyone=kind == "allreduce", array_type=array_type), limit)


async def tree_reduce(node: Any, value: Any, name: str, rank: int, root: int,
                      chosen: tuple[Any, ...], plan: Any, op: str, limit: float, *,
                      everyone: bool, array_type: str) -> Any:
    """One rank's part of a reduce (`everyone`: an allreduce) over `plan`'s
    trees, on the node's loop, within `limit` seconds."""
    call = _TreeReduce(node, value, name, rank, root, chosen, plan, op, everyone,
                       time.monotonic() + limit)
    try:
        async with asyncio.timeout(limit):
            return await call.run(array_type)
    except TimeoutError as exc:  # (a step's own Timeout too: said with what was missing)
        why = f": {exc}" if isinstance(exc, Timeout) else ""
        raise Timeout(f"{call.what} (rank {rank} of {len(chosen)}) did not finish within "
                      f"{limit:g}s{call.waiting_on()}{why}") from None


class _TreeReduce:
    """One rank's state in one call: its input, its partial result of each
    tree it has children in, and what it waits for."""

    def __init__(self, node: Any, value: Any, name: str, rank: int, root: int,
                 chosen: tuple[Any, ...], plan: Any, op: str, everyone: bool,
                 deadline: float) -> None:
        self.what = f"multitree {'allreduce' if everyone else 'reduce'} {name!r}"
        self.node, self.rank, self.root, self.op = node, rank, root, op
        self.deadline = deadline
        self.everyone, self.plan, self.ids = everyone, plan, _Ids(name)
        self.size, self.chosen = len(chosen), chosen
        self.rank_of = {member: r for r, member in enumerate(chosen)}
        self.me = chosen[rank]
        buf, self.layout = to_buffer(value)  # (on the loop: its stream orders device copies)
        self.dtype = numpy_dtype(self.layout)  # (UnsupportedValue: not an array)
        if self.dtype.name not in kernels.DTYPES:
            raise InvalidArgument(f"{self.what}: cannot reduce dtype {self.dtype}; supported "
                                  f"dtypes are {', '.join(kernels.DTYPES)}")
        if is_device_buffer(buf):
            # Copied, as a put copies a device array: on the device, queued on
            # this thread's stream after the work that produced it (`device`).
            self.input = device.empty(self.layout.nbytes)
            device.copy_into(self.input, buf)
        else:  # (a host array is read in place until the call returns)
            self.input = np.frombuffer(buf, dtype=np.uint8)
        #: per tree with bytes: (index, start, end, children's ranks, parent's rank)
        self.trees: list[tuple[int, int, int, list[int], int | None]] = []
        split = plan.split(self.layout.nbytes, align=self.dtype.itemsize)
        for t, (tree, (a, b)) in enumerate(zip(plan.trees, split, strict=True)):
            if a < b:
                kids = [self.rank_of[c] for p, c in tree.edges if p == self.me]
                up = [self.rank_of[p] for p, c in tree.edges if c == self.me]
                self.trees.append((t, a, b, kids, up[0] if up else None))
        self.split = split
        #: per tree, its height: the most links from its root to a leaf
        self.heights = [_height(tree.edges, plan.root) for tree in plan.trees]
        self.cards: dict[int, m.TreeMember] = {}
        #: this rank's partial results, by tree (not at the root), and the
        #: trees where it is a leaf (its part is a view of the caller's array)
        self.parts: dict[int, StoredObject] = {}
        self.leaves: set[int] = set()
        self.result: StoredObject | None = None
        #: cards asked for, and trees whose fold here is not done (for errors)
        self.asked: set[int] = set()
        self.unfolded = {t for t, *_, kids, _ in self.trees if kids}

    def waiting_on(self) -> str:
        """What this rank was waiting for, said in a Timeout."""
        missing = sorted(self.asked - set(self.cards))
        if missing:
            return f" (no card came from rank{'s' if len(missing) > 1 else ''} " \
                f"{', '.join(map(str, missing))})"
        if not self.asked:
            return ""
        if self.unfolded:
            return f" (its fold of tree{'s' if len(self.unfolded) > 1 else ''} " \
                f"{', '.join(map(str, sorted(self.unfolded)))} was not done)"
        if self.rank == self.root:
            return ""
        return f" (the root, rank {self.root}, never said the reduce was done)" \
            if not self.everyone else " (its copy of the result was not complete)"

    # ------------------------------------------------------------ the call ---
    async def run(self, array_type: str) -> Any:
        error: BaseException | None = None
        try:
            if self.rank == self.root:
                return await self._as_root(array_type)
            return await self._as_member(array_type)
        except BaseException as exc:
            error = exc
            raise
        finally:
            await self._let_go(error)

    async def _as_root(self, array_type: str) -> Any:
        node, layout = self.node, self.layout
        if self.everyone:
            self.result = self._new(self.ids.result, layout)
            self.result.ledger = Ledger(layout.nbytes)
            # A holder from now on: the ranks' copies pull from it as it fills.
            await node._request(m.Put(rid=0, oid=self.ids.result.binary, size=layout.nbytes,
                                      layout=layout.to_wire()), self._left())
            out = self.result.buffer
        else:
            out = node.store.alloc(layout)  # the caller's array, once it is done
            if not is_device_buffer(out):
                node.store.pool.lend(out)
        try:
            await self._put_card()
            await self._read_cards(self._kids())
            self._check(self._card(), sorted(self._kids()))
            await _all([self._fold(t, a, b, kids, out[a:b], self._sink(a))
                        for t, a, b, kids, _ in self.trees])
            if self.result is not None:
                self.result.ledger = None
                self.result.own = True
                node._post(complete_msg(self.result))
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                await self._say(_FAILED + str(exc).encode())
            raise
        await self._say(_OK)
        return from_buffer(out, layout, array_type)

    async def _as_member(self, array_type: str) -> Any:
        for t, a, b, kids, _ in self.trees:
            if kids:
                self.parts[t] = self._new(self.ids.part(t, self.rank), self._range(b - a))
            else:  # a leaf: its partial result is its input's range
                self.parts[t] = part = self._new(self.ids.part(t, self.rank),
                                                 self._range(b - a), self.input[a:b])
                part.advance(part.size)
                self.leaves.add(t)
        await self._put_card()  # (only now: a parent that reads it finds every part here)
        parents = {up for *_, up in self.trees} if self.everyone else set()
        await self._read_cards(self._kids() | parents | {self.root})
        mine, root = self.layout, self.cards[self.root]
        self._check(root, [self.rank, *sorted(self._kids())])
        folds = [self._fold(t, a, b, kids, self.parts[t].buffer, self.parts[t].advance)
                 for t, a, b, kids, _ in self.trees if kids]
        if not self.everyone:
            await _all([*folds, self._outcome()])
            return None
        flows = flows_for(self.plan, mine.nbytes, self.me,
                          {self.chosen[r]: card for r, card in self.cards.items()}, self.split)
        got = await _all(folds + [_fill(self.node, self.ids.result, mine, flows,
                                        self.deadline, root)], watch=self._outcome())
        self.result = got[-1]
        return from_buffer(self.result.buffer, mine, array_type)

    # ------------------------------------------------------------ folding ---
    async def _fold(self, t: int, a: int, b: int, kids: list[int], out: Any,
                    sink: Callable[[int], None]) -> None:
        """Tree `t`'s range [a, b): our input's bytes with each child's partial
        result into `out`, chunk by chunk as they arrive, `sink` told of each.
        The first child's bytes land in `out` itself (one pass fewer)."""
        layout, dtype, store = self._range(b - a), self.dtype, self.node.store
        copies = [StoredObject(self.ids.part(t, k), layout,
                               out if i == 0 else store.alloc(layout))
                  for i, k in enumerate(kids)]
        pulls = [asyncio.ensure_future(self._pull(t, k, copy))
                 for k, copy in zip(kids, copies, strict=True)]
        count = self.size if self.rank == self.root else 0
        try:
            # Every level of the tree adds a piece's time, up (and an
            # allreduce's broadcast, down): a deep tree folds smaller pieces.
            chunk = self.node.config.chunk_bytes(True) if is_device_buffer(out) \
                else fold_unit(b - a, min(self.node.config.chunk_size, FOLD_STEP),
                               max(FOLD_PIECES, FOLD_PIECES_PER_LEVEL * self.heights[t]))
            chunk = max(dtype.itemsize, chunk - chunk % dtype.itemsize)
            for pos in range(0, b - a, chunk):
                end = min(pos + chunk, b - a)
                for copy in copies:
                    await _arrived(copy, end, pulls, self._left())
                acc, kind = element_view(out[pos:end], dtype)
                mine = element_view(self.input[a + pos:a + end], dtype)[0]
                if copies:
                    kernels.reduce_into(acc, mine, self.op, dtype=kind)
                else:
                    acc[...] = mine
                for copy in copies[1:]:
                    kernels.reduce_into(acc, element_view(copy.buffer[pos:end], dtype)[0],
                                        self.op, dtype=kind)
                if count:
                    kernels.finalize(acc, self.op, count, dtype=kind)
                sink(end)
                await asyncio.sleep(0)  # (the parent's pull sends what is ready)
            self.unfolded.discard(t)
        finally:
            for task in pulls:
                task.cancel()
            await asyncio.gather(*pulls, return_exceptions=True)
            for copy in copies[1:]:
                store.recycle(copy)

    async def _pull(self, t: int, kid: int, copy: StoredObject) -> None:
        """Child `kid`'s partial result of tree `t`, into `copy` as it grows."""
        try:
            await fetch_range(self.node.pool, self.cards[kid].address, copy, copy.size,
                              self.node.config, lambda _pos: None)
        except PEER_FAILURES as exc:
            raise self._lost(kid, t, exc) from None

    def _lost(self, kid: int, t: int, exc: BaseException) -> ReduceFailed:
        """The error of a child's pull that failed: the rank that an error it
        relays names, or else the child itself."""
        text = str(exc)
        named = _NAMED.search(text)
        if named is not None:
            return ReduceFailed(f"{self.what}: {text[named.start():]}")
        return ReduceFailed(f"{self.what}: rank {kid} was lost: its partial result of tree {t} "
                            f"stopped coming ({type(exc).__name__}: {text})")

    def _sink(self, a: int) -> Callable[[int], None]:
        """The root's record of what its fold of the range from `a` wrote: the
        result's ledger (an allreduce serves each range as it fills)."""
        if self.result is None:
            return lambda _end: None
        flow = FlowSink(self.result, self.result.ledger, a)
        return lambda end: flow.advance(a + end)

    # ---------------------------------------------------- cards, outcome ---
    def _card(self) -> m.TreeMember:
        return m.TreeMember(node=self.node.node_id, address=self.node.server.address,
                            size=self.layout.nbytes, layout=self.layout.to_wire())

    async def _put_card(self) -> None:
        await self.node.put(m.encode(self._card()), self.ids.card(self.rank),
                            timeout=self._left())

    def _check(self, root: m.TreeMember, ranks: list[int]) -> None:
        """Refuse the call if one of `ranks` (by its card) passed an array of
        another dtype or shape than the root's: InvalidArgument on that rank,
        ReduceFailed naming it on its neighbours (and through them, all)."""
        for r in ranks:
            card = self._card() if r == self.rank else self.cards[r]
            if (card.size, card.layout) == (root.size, root.layout):
                continue
            text = (f"{self.what}: rank {r} failed: it passed {_kind(card)}, the root "
                    f"{_kind(root)}; every rank must pass the same dtype and shape")
            raise InvalidArgument(text) if r == self.rank else ReduceFailed(text)

    async def _read_cards(self, ranks: set[int]) -> None:
        self.asked |= ranks

        async def one(r: int) -> None:
            raw = await self.node.get(self.ids.card(r), self._left(), "numpy")
            self.cards[r] = m.decode_tree_member(f"the card of rank {r}", bytes(raw))

        await _all([one(r) for r in sorted(ranks)])

    async def _say(self, outcome: bytes) -> None:
        """The root's word on how the reduce ended (given up quietly past the deadline)."""
        try:
            await self.node.put(outcome, self.ids.outcome, timeout=max(1.0, self._left()))
        except HopliteError as exc:
            log.warning("%s: the outcome could not be put: %s", self.what, exc)

    async def _outcome(self) -> None:
        """Return once the root says the reduce is done; raise what it says if
        it failed, or that the root was lost if it stops answering first."""
        said = await _all([self.node.get(self.ids.outcome, self._left(), "numpy")],
                          watch=self._root_alive())
        said = bytes(said[0])
        if said != _OK:
            raise ReduceFailed(said.removeprefix(_FAILED).decode(errors="replace"))

    async def _root_alive(self) -> None:
        """Fail once the root's data server stops serving: every stall
        timeout, pull its card (a few dozen bytes, on a pooled connection)
        from it again. Without this a rank waiting for the root's word, whose
        root died, would wait out the call's deadline: nothing else tells
        it (its own parts were pulled in full, or the root was its parent)."""
        root = self.cards[self.root]
        mine = self.node.store.get(self.ids.card(self.root))
        every = self.node.config.stall_timeout_s
        while True:
            await asyncio.sleep(min(every, max(0.0, self._left())))
            if mine is None or self._left() <= 0:
                return  # (no card in hand to size the probe by; past the deadline)
            probe = StoredObject(mine.oid, mine.layout, np.empty(mine.size, np.uint8))
            try:
                await fetch_range(self.node.pool, root.address, probe, probe.size,
                                  self.node.config, lambda _pos: None)
            except PEER_FAILURES as exc:
                raise ReduceFailed(f"{self.what}: rank {self.root} was lost: the root stopped "
                                   f"serving ({type(exc).__name__}: {exc})") from None

    # ------------------------------------------------------------ helpers ---
    def _kids(self) -> set[int]:
        return {k for *_, kids, _ in self.trees for k in kids}

    def _range(self, nbytes: int) -> Layout:
        """The layout of a range of `nbytes` of the array: its elements, flat."""
        return Layout(self.layout.kind, self.layout.dtype, (nbytes // self.dtype.itemsize,),
                      nbytes)

    def _new(self, oid: ObjectID, layout: Layout, buffer: Any = None) -> StoredObject:
        if self.node.store.get(oid) is not None:
            raise InvalidArgument(f"{self.what}: object {oid.hex()} is here already: a call "
                                  "under this name ran on this node (a name serves one call)")
        obj = self.node.store.create(oid, layout, buffer, borrowed=buffer is not None)
        obj.own = True  # (never evicted: made here)
        return obj

    def _left(self) -> float:
        return time_left(self.deadline)

    async def _let_go(self, error: BaseException | None) -> None:
        """Free this rank's partial results, and (after a failure) its copy
        of the result: their parents' pulls fail with `error`'s text, and
        none of them reads the caller's array once this returns."""
        why = (ObjectNotFound(f"{self.what}: rank {self.rank} is done with its part")
               if error is None else error if isinstance(error, HopliteError)
               else ReduceFailed(f"{self.what}: rank {self.rank} failed: its call ended "
                                 f"({type(error).__name__})"))
        failed = []
        for t, part in self.parts.items():
            if not part.complete:
                part.fail(why)
                if t not in self.leaves:
                    failed.append(part)
        # A failed part of our own memory stays a while, failed: a parent that
        # asks for it late still reads why (not only that it is gone here).
        now = [p for p in self.parts.values() if p not in failed]
        stall = self.node.config.stall_timeout_s
        # (a parent still pulling one of them reads `why`, which names the
        # rank the failure started at, not a bare "dropped")
        told = why if error is not None else None
        if failed:
            self.node.in_background(self._drop(failed, stall, told))
        await self._drop(now, 0.0, told)
        if error is not None and self.everyone:  # (a copy not complete leaves)
            self.node.unreceived(self.ids.result)

    async def _drop(self, parts: list[StoredObject], after: float,
                    why: BaseException | None = None) -> None:
        """Free `parts` after `after` seconds (a send of one under way ends
        with `why`, if given); a send of one stuck on a peer that does not
        read is cut, as on a drop, and none reads it afterwards."""
        if after:
            await asyncio.sleep(after)
        store, server = self.node.store, self.node.server
        for part in parts:
            store.remove(part.oid, why)
            server.dropped_here(part.oid)
        stuck = min(1.0, self.node.config.stall_timeout_s)
        await asyncio.gather(*[server.release(p.oid, stuck) for p in parts])


def _height(edges: Sequence[tuple[Any, Any]], root: Any) -> int:
    """The most links from `root` to a leaf of the tree of `edges` (parent, child)."""
    kids: dict[Any, list[Any]] = {}
    for parent, child in edges:
        kids.setdefault(parent, []).append(child)
    height, level = 0, [root]
    while True:
        level = [c for p in level for c in kids.get(p, ())]
        if not level:
            return height
        height += 1


def _kind(card: m.TreeMember) -> str:
    layout = card.layout or {}
    return f"{layout.get('dtype')} {tuple(layout.get('shape', ()))}"


async def _arrived(copy: StoredObject, end: int, pulls: list[asyncio.Future],
                   left: float) -> None:
    """Wait for `copy` to hold bytes [0, end), failing at once if a pull fails
    (any of them, also after another has ended well: a child's part that came
    in full must not stop the watch on its siblings')."""
    if copy.ready >= end:
        return
    waiter = asyncio.ensure_future(copy.wait_ready(end, left))
    try:
        while True:
            for task in pulls:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()
            if waiter.done():
                return waiter.result()  # (its Timeout, past the deadline)
            going = [task for task in pulls if not task.done()]
            await asyncio.wait([waiter, *going], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not waiter.done():
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter


async def _all(steps: list[Coroutine], watch: Coroutine | None = None) -> list[Any]:
    """Run `steps` at once and return their results; `watch` runs beside
    them until they are done (it only ever fails, or returns). The first
    error of any is raised, the rest cancelled first."""
    tasks = [asyncio.ensure_future(c) for c in steps]
    watcher = None if watch is None else asyncio.ensure_future(watch)
    pending = set(tasks) | ({watcher} if watcher is not None else set())
    try:
        while not all(task.done() for task in tasks):
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()
        return [task.result() for task in tasks]
    finally:
        everything = tasks + ([watcher] if watcher is not None else [])
        for task in everything:
            task.cancel()
        await asyncio.gather(*everything, return_exceptions=True)


__all__ = ["call_ids", "multitree_allreduce", "multitree_reduce", "plan_for", "tree_reduce"]
