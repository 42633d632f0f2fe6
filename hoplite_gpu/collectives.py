"""Collectives as thin compositions of put / get / reduce, as in the Hoplite paper.

Participants need no group object: they agree on a `name` for this one
collective call (e.g. ``f"grads-step-{step}"``), their `rank` and the `size`.
Object ids are derived from the name, so nobody has to exchange ids. A name must
be used for one call only (objects are immutable); `delete` frees its objects.
Every call has an asyncio twin (`allreduce_async`, ...) at the end of the module.

Migration: `hoplite_gpu.Group` holds the name, rank and size instead, numbers
its calls, refuses a call the ranks disagree on (op, root, size, dtype,
shape) on every rank, names missing ranks in its timeouts and frees each
call's objects once every rank is past it, so a loop needs no names per step
and no `delete`: ``g = hg.Group("grads", rank=r, size=n)`` once, then
``g.allreduce(x, op="avg")`` where this module's call was
``allreduce(x, name=f"grads-{step}", rank=r, size=n, op="avg")`` plus a
`delete` of the step before (docs/collectives.md, "Migration"). These calls
stay for what a Group does not do: `num_objects` (the first k inputs), a
non-root `reduce(wait=True)`, and ranks that do not all make every call.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import numbers
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from . import api
from .directory.reduce_plan import allreduce_slices
from .errors import HopliteError, InvalidArgument, ObjectNotFound, Timeout
from .ids import ObjectID
from .values import encode, is_masked, to_buffer


def input_id(name: str, rank: int) -> ObjectID:
    return ObjectID.from_name(f"{name}/in/{rank}")


def _int(x: Any) -> bool:
    # (NumPy's integers too, as from np.ceil(...).astype(int); True is no rank)
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check(name: str, rank: int, size: int, root: int = 0) -> None:
    # Every object id of the call is made from the name: None or b"x" would
    # silently meet other calls (every name None) or miss the ranks passing "x".
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"name must be a non-empty str naming this one call; got {name!r}")
    if not (_int(size) and size >= 1):
        raise InvalidArgument(f"size must be a positive int; got {size!r}")
    for what, r in (("rank", rank), ("root", root)):
        if not (_int(r) and 0 <= r < size):
            raise InvalidArgument(f"{what} must be an int in [0, {size}); got {r!r}")


def _put(value: Any, oid: ObjectID, timeout: float | None) -> float:
    """Put a rank's `value` as `oid` within the call's `timeout`; returns the
    call's deadline (time.monotonic()) for what follows. A put given up at
    the deadline is withdrawn (see `Runtime.together`)."""
    rt = api.runtime()
    limit = api._timeout(rt, timeout)
    deadline = time.monotonic() + limit
    if not rt.put_here(value, oid, limit):
        _together(lambda node, _limit: [node.put(value, oid)], api.time_left(deadline))
    return deadline


def _names_its_timeout(fn: Callable) -> Callable:
    """A Timeout out of a collective names the call, its rank and size, and
    the call's own timeout (a step that ran out reports only the time that was
    left to it, which alone reads as a setting never made, or only object
    ids); a gather's, an allgather's or a broadcast's also names the ranks
    whose value the directory never saw (`_missing`)."""
    call = fn.__name__.removesuffix("_async")

    def renamed(exc: Timeout, kw: dict, missing: str) -> Timeout:
        try:
            limit = api._timeout(api.runtime(), kw.get("timeout"))
        except HopliteError:
            return exc
        return Timeout(f"{call} {kw.get('name')!r} (rank {kw.get('rank')} of {kw.get('size')}) "
                       f"did not finish within its timeout of {limit:g}s{missing}: {exc}")

    if asyncio.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def awaited(value: Any, **kw: Any) -> Any:
            try:
                return await fn(value, **kw)
            except Timeout as exc:
                known = await _known_async(_inputs_of(call, kw))
                raise renamed(exc, kw, _missing(call, kw, known)) from None
        return awaited

    @functools.wraps(fn)
    def called(value: Any, **kw: Any) -> Any:
        try:
            return fn(value, **kw)
        except Timeout as exc:
            known = _known(_inputs_of(call, kw))
            raise renamed(exc, kw, _missing(call, kw, known)) from None
    return called


def _inputs_of(call: str, kw: dict) -> list[ObjectID]:
    """The objects whose absence says which ranks a timed-out call waited
    for: a gather's inputs, a broadcast's value. (A reduce's inputs are lent
    and leave as each rank's call ends, so they cannot say.)"""
    name, size = kw.get("name"), kw.get("size")
    if not isinstance(name, str) or not _int(size) or size > 4096:
        return []
    if call in ("gather", "allgather"):
        return [input_id(name, r) for r in range(size)]
    if call == "broadcast":
        return [ObjectID.from_name(f"{name}/bcast")]
    return []


def _missing(call: str, kw: dict, known: list[bool | None]) -> str:
    if call == "broadcast":
        return f" (the root, rank {kw.get('root', 0)}, never put its value)" \
            if known == [False] else ""
    absent = [r for r, there in enumerate(known) if there is False]
    if not absent:
        return ""
    return f" (no value came from rank{'s' if len(absent) > 1 else ''} " \
        f"{', '.join(map(str, absent))})"


#: How long a timed-out collective asks the directory which ranks' objects it knows.
_ASK_S = 0.5


def _asks(ids: list[ObjectID]) -> Callable[[Any, float], list[Coroutine]]:
    async def known(node: Any, oid: ObjectID) -> bool | None:
        try:
            await node.query(oid)
        except ObjectNotFound:
            return False
        except HopliteError:
            return None
        return True
    return lambda node, _limit: [known(node, oid) for oid in ids]


def _known(ids: list[ObjectID]) -> list[bool | None]:
    """Whether the directory knows each of `ids` (None: it could not say
    within `_ASK_S`)."""
    try:
        return api.runtime().together(_asks(ids), _ASK_S) if ids else []
    except HopliteError:
        return [None] * len(ids)


async def _known_async(ids: list[ObjectID]) -> list[bool | None]:
    try:
        return await api.runtime().together_async(_asks(ids), _ASK_S) if ids else []
    except HopliteError:
        return [None] * len(ids)


@_names_its_timeout
def broadcast(value: Any, *, name: str, rank: int, size: int, root: int = 0,
              timeout: float | None = None) -> Any:
    """Root's value on every rank (receiver-driven, pipelined); `timeout`
    bounds the call on every rank, the root's put included."""
    _check(name, rank, size, root)
    oid = ObjectID.from_name(f"{name}/bcast")
    if rank == root:
        if _held_here(oid):
            return api.get(oid, timeout=timeout)
        _put(value, oid, timeout)
        return value
    return api.get(oid, timeout=timeout)


def _held_here(oid: ObjectID) -> bool:
    """Whether this node holds `oid` already: a broadcast's root called again
    under the same name, whose put would keep the first call's bytes. It
    returns those, as every other rank gets them, not its new argument."""
    rt = api.runtime()
    return rt.direct.held(oid) if rt.direct is not None else rt.node.store.get(oid) is not None


def _reduce_ids(name: str, size: int, op: str, num_objects: int | None) -> tuple[list, ObjectID]:
    ids = [input_id(name, r) for r in range(size)]
    k = size if num_objects is None else num_objects
    return ids, ObjectID.from_name(f"{name}/reduce/{op}/{k}")


@_names_its_timeout
def reduce(value: Any, *, name: str, rank: int, size: int, root: int = 0, op: str = "sum",
           num_objects: int | None = None, timeout: float | None = None,
           wait: bool = False) -> Any:
    """The reduction of the first `num_objects` ready values, returned on `root`
    (None elsewhere). The root's own host array is read in place, not copied
    (leave it unchanged until the call returns). A non-root returns as soon as
    its input is put, so its input is copied (a restarted tree may need it
    later); with `wait`, it returns only once the reduce is done, as
    MPI_Reduce does, and its input is read in place too: no copy, and S less
    memory per rank."""
    _check(name, rank, size, root)
    ids, target = _reduce_ids(name, size, op, num_objects)
    # Idempotent across ranks; the root's own input takes the tree's root, so
    # the result is produced where it is wanted (no extra hop to fetch it).
    args = api._reduce_args(ids, op, num_objects, target, ids[root])
    return _reduce_and_get(args, value, ids[rank], rank == root, timeout, wait)


@_names_its_timeout
def allreduce(value: Any, *, name: str, rank: int, size: int, op: str = "sum",
              num_objects: int | None = None, timeout: float | None = None) -> Any:
    """Reduce, then broadcast the result while it is still being reduced.

    The input is not copied: the reduce reads `value`'s own memory (a host
    array's), so leave it unchanged until the call returns. Every rank returns
    only once the reduce is done, so its input is no longer needed then and
    leaves the cluster (it cannot be fetched by its id afterwards); an input
    small enough to travel inline (`inline_threshold`) is copied instead, and
    stays until `delete`.

    With the setting ``allreduce_slicing="auto"``, a large NumPy array (each
    rank's 1/size of it at least one chunk) of an allreduce of every rank is
    sliced: slice j is reduced on a chain rooted at rank j and sent from there
    to every rank, so each link carries 2 (size-1)/size of the object instead
    of twice it (see `_sliced`). The result is then a new read-only array,
    whose memory the node serves to other ranks until `delete`. With
    ``"adaptive"`` (the default) it is sliced only if every rank's input is
    ready within ``allreduce_slicing_window_s`` of each rank's own and the
    ranks are on more than one host, and reduced whole, in the order the
    inputs arrive, if not."""
    _check(name, rank, size)
    if _slices(value, size, num_objects) > 1:
        # (a non-contiguous array is sliced from a contiguous copy, as every
        # rank decides alike from its size alone)
        return _sliced_allreduce(_sliceable(value), name, rank, size, op, timeout)
    ids, target = _reduce_ids(name, size, op, num_objects)
    args = api._reduce_args(ids, op, num_objects, target)
    if _marks_unsliced(size, num_objects):
        # Each rank decides alone whether to slice: one whose array is sliced
        # reads this marker at its barrier, and fails at once (see there).
        deadline = _put(_marker(value, sliced=False), _slice_ids(name, size, op)[2][rank], timeout)
        timeout = api.time_left(deadline)
    return _reduce_and_get(args, value, ids[rank], True, timeout)


def _slicing(size: int, num_objects: int | None) -> bool:
    """Whether an allreduce of these ranks may be sliced at all."""
    return (api.runtime().config.allreduce_slicing != "off" and num_objects in (None, size)
            and size > 1)


def _marks_unsliced(size: int, num_objects: int | None) -> bool:
    """Whether an allreduce not sliced puts a barrier marker (saying so) for
    ranks that slice theirs. Only with "auto": there a slicing rank waits for
    every marker. With "adaptive" it waits for them only its window, then
    reduces whole objects, and the whole-object reduce fails at once if the
    ranks' arrays differ; so a small allreduce costs no extra put."""
    return _slicing(size, num_objects) and api.runtime().config.allreduce_slicing == "auto"


def _marker(value: Any, sliced: bool, domain: str = "") -> bytes:
    """What a rank of a sliced allreduce says it passed (its barrier marker):
    the array's kind, and which host its node is on (`Node.host_key`)."""
    kind = f"{value.dtype.str} {value.shape}" if isinstance(value, np.ndarray) \
        else type(value).__name__
    return (f"{kind}\n{domain}" if sliced else f"{kind} (not sliced)").encode()


def _slices(value: Any, size: int, num_objects: int | None) -> int:
    """How many slices an allreduce of `value` takes. Only an allreduce of every
    rank is sliced: with a subset (`num_objects` < size), the slices' reduces
    could each choose different inputs."""
    if (not _slicing(size, num_objects) or not isinstance(value, np.ndarray)
            or is_masked(value) or value.size < size):
        return 1  # (a masked array is refused by the put of the whole path)
    return allreduce_slices(value.nbytes, size, api.runtime().config.chunk_size)


def _sliceable(value: np.ndarray) -> np.ndarray:
    """`value` contiguous, as it is sliced; refused here, before the call
    sends anything, if it cannot be sent at all (an object dtype...)."""
    value = np.ascontiguousarray(value)
    to_buffer(value)
    return value


def _ready_ids(name: str, size: int) -> list[ObjectID]:
    """ready[r]: rank r's barrier marker of an allreduce named `name` (sliced,
    or not sliced with ``allreduce_slicing="auto"``)."""
    return [ObjectID.from_name(f"{name}/slice/ready/{r}") for r in range(size)]


def _slice_ids(name: str, size: int, op: str) -> tuple[list[list[ObjectID]], list[ObjectID],
                                                        list[ObjectID]]:
    """(inputs[j][r], results[j], ready[r]) of a sliced allreduce named `name`."""
    inputs = [[ObjectID.from_name(f"{name}/slice/{j}/in/{r}") for r in range(size)]
              for j in range(size)]
    results = [ObjectID.from_name(f"{name}/slice/{j}/reduce/{op}") for j in range(size)]
    ready = _ready_ids(name, size)
    return inputs, results, ready


def _sliced_allreduce(value: np.ndarray, name: str, rank: int, size: int, op: str,
                      timeout: float | None) -> np.ndarray:
    call = _SlicedAllreduce(value, name, rank, size, op, timeout)
    return call.finish(_together(lambda node, _limit: [call.run(node)], call.limit,
                                 lent=call.lent)[0])


async def _sliced_allreduce_async(value: np.ndarray, name: str, rank: int, size: int, op: str,
                                  timeout: float | None) -> np.ndarray:
    call = _SlicedAllreduce(value, name, rank, size, op, timeout)
    return call.finish((await _together_async(lambda node, _limit: [call.run(node)],
                                              call.limit, lent=call.lent))[0])


def _vote_ids(name: str, size: int, op: str) -> list[ObjectID]:
    """votes[r] of an adaptive sliced allreduce named `name` (see `_SlicedAllreduce`)."""
    return [ObjectID.from_name(f"{name}/slice/vote/{op}/{r}") for r in range(size)]


class _SlicedAllreduce:
    """One rank's allreduce as `size` reduces and broadcasts of slices, a
    ring's traffic with the directory's trees: `run` on the loop (within
    `limit`, lending `lent`), then `finish` on its answer makes the result.

    1. Every rank lends its slices (views of `value`, no copy).
    2. A barrier (a tiny marker object per rank, each fetched by every rank):
       all slices are ready before any reduce is asked for, so the directory
       places each chain's inputs in the order the request lists them.
       With ``allreduce_slicing="adaptive"`` a rank waits for the markers only
       `allreduce_slicing_window_s`, then votes (a tiny object per rank):
       "sliced" if every marker came and not every rank is on one host (each
       marker says which host its node is on), "whole" if not; it
       lends its slices (step 1) just before it votes "sliced". The call is
       sliced only if every rank votes "sliced": a rank that voted "whole"
       knows that already, and the others read every vote, which comes soon,
       as every rank has arrived. Otherwise every rank reduces its whole
       input as `allreduce` does with slicing off: a chain in the order the
       inputs arrive, the schedule for inputs ready at different times
       (docs/cost-model.md, "Allreduce with late inputs").
    3. Slice j's chain is rank j+1, j+2, ..., j-1, ending at rank j: every rank
       starts at the leaf of one chain, at once, and sits one step further in
       each of the others, as in a ring. Its result is relayed on from rank j
       to j+1, j+2, ..., j-1 (the request's `relay`), so every slice, reduced
       or finished, travels from rank r to rank r+1 only, a ring's
       allgather pipelined with its reduce-scatter.
    4. Every rank gets every slice's result, each pulled (or, its own slice,
       reduced) straight into its part of the output array, which is
       returned read-only, as `get` returns a view of the node's copy: the
       node serves those bytes to other ranks until `delete`."""

    def __init__(self, value: np.ndarray, name: str, rank: int, size: int, op: str,
                 timeout: float | None) -> None:
        self.value, self.name, self.rank, self.size, self.op = value, name, rank, size, op
        self.flat = value.reshape(-1)
        self.edges = [self.flat.size * j // size for j in range(size + 1)]
        self.inputs, self.results, self.ready = _slice_ids(name, size, op)
        self.votes = _vote_ids(name, size, op)
        self.whole, target = _reduce_ids(name, size, op, None)
        self.mine = [self.inputs[j][rank] for j in range(size)]
        self.rt = rt = api.runtime()
        self.limit = api._timeout(rt, timeout)
        # a bad op: refused before any put
        self.whole_args = api._reduce_args(self.whole, op, None, target)
        self.window = (rt.config.allreduce_slicing_window_s
                       if rt.config.allreduce_slicing == "adaptive" else None)
        # The barrier's marker says what this rank passed: ranks whose arrays
        # differ fail at once, as a whole-object reduce does, instead of reducing
        # slices that do not line up. (A node whose host is unknown is a host of
        # its own.)
        self.marker = _marker(value, sliced=True, domain=rt.node.host_key or os.urandom(8).hex())
        self.shape = self.marker.split(b"\n")[0]
        self.out: list[np.ndarray] = []  # filled on the loop thread, which owns the pool
        self.targets: list[np.ndarray] = []
        #: the inputs the call lends, reclaimed however it ends
        self.lent = [*self.mine, self.whole[rank]]

    async def barrier(self, node: Any, prepared: list[ObjectID],
                      later: list[asyncio.Future]) -> bool:
        """Whether the call is sliced (steps 1 and 2)."""
        window, size, rank = self.window, self.size, self.rank
        if window is None:
            await self.lend_slices(node, prepared)  # before any rank can pass the barrier
        await node.put(self.marker, self.ready[rank])
        markers = asyncio.ensure_future(asyncio.gather(*[node.get(oid, self.limit)
                                                         for oid in self.ready]))
        # (cancelled by the window or a call given up, its error is nobody's)
        markers.add_done_callback(lambda f: f.cancelled() or f.exception())
        if window is not None and self.rt.one_host_groups.get(size):
            # As the last call of this many ranks found: no wait, and the
            # markers are read once the call is done, for the next one.
            later.append(markers)
            await node.put(b"whole", self.votes[rank])
            return False
        try:
            shapes = await (markers if window is None else asyncio.wait_for(markers, window))
        except TimeoutError as exc:
            if isinstance(exc, Timeout) or window is None:
                raise  # a step's own deadline error
            shapes = None  # (wait_for has cancelled the gets)
        one_host = shapes is not None and await self.check(node, shapes)
        if window is None:
            return True
        return await self.vote(node, prepared, shapes, one_host)

    async def vote(self, node: Any, prepared: list[ObjectID], shapes: list[Any] | None,
                   one_host: bool) -> bool:
        """An adaptive call's vote (step 2): whether every rank voted "sliced"."""
        if shapes is not None:
            self.rt.one_host_groups[self.size] = one_host
        if shapes is None or one_host:
            # Late inputs; or every rank on one host, where no byte crosses a
            # link, the CPU is the limit, and slicing only adds work
            # (docs/cost-model.md, "Sliced allreduce").
            await node.put(b"whole", self.votes[self.rank])
            return False
        await self.lend_slices(node, prepared)  # before any rank can read our vote
        await node.put(b"sliced", self.votes[self.rank])
        return all(bytes(v) == b"sliced"
                   for v in await asyncio.gather(*[node.get(oid, self.limit)
                                                   for oid in self.votes]))

    @staticmethod
    def hosts(shapes: list[Any]) -> int:
        return len({bytes(s).split(b"\n")[-1] for s in shapes})

    async def check(self, node: Any, shapes: list[Any]) -> bool:
        """Whether every rank passed what we did (or else fail), and every
        rank's node is on one host."""
        kinds = [bytes(s).split(b"\n")[0] for s in shapes]
        odd = {r: k.decode() for r, k in enumerate(kinds) if k != self.shape}
        if odd:
            # A rank that does not slice ("(not sliced)"), or that gave up
            # waiting for our marker, waits on the whole-object reduce: our
            # whole input, whose layout differs, fails it at once there.
            await node.put(self.value, self.whole[self.rank])
            raise InvalidArgument(
                f"allreduce {self.name!r}: rank {self.rank} passed {self.shape.decode()}, but "
                + ", ".join(f"rank {r} {s}" for r, s in odd.items())
                + "; every rank must pass the same dtype and shape")
        return self.hosts(shapes) == 1

    async def lend_slices(self, node: Any, prepared: list[ObjectID]) -> None:
        """Lend our slices, and have every slice's result made, pulled or
        relayed here, straight into its part of the output array."""
        edges, flat, size = self.edges, self.flat, self.size
        await asyncio.gather(*[node.put(flat[edges[j]:edges[j + 1]], self.mine[j], lend=True)
                               for j in range(size)])
        # The output is one of the store pool's buffers (plain pages, already
        # touched when reused: a fresh 256 MiB cost each rank 65,536 page
        # faults per call on the emulated hosts), lent to the caller: the pool
        # takes it back once the caller and the store have dropped every view.
        buffer = node.store.pool.acquire(self.value.nbytes)
        node.store.pool.lend(buffer)
        self.out.append(buffer.view(self.value.dtype).reshape(self.value.shape))
        parts = self.out[0].reshape(-1)
        self.targets.extend(parts[edges[j]:edges[j + 1]] for j in range(size))
        prepared += [self.results[j] for j in range(size)
                     if node.receive_into(self.results[j], self.targets[j])]

    async def run(self, node: Any) -> Any:
        prepared: list[ObjectID] = []
        later: list[asyncio.Future] = []
        done = False
        try:
            async with asyncio.timeout(self.limit):
                if await self.barrier(node, prepared, later):
                    got = await self.sliced(node)
                else:
                    got = await self.unsliced(node, prepared, later)
                done = True
                return got
        except TimeoutError as exc:
            if isinstance(exc, Timeout):
                raise  # a step's own, more precise deadline error
            raise Timeout(f"allreduce {self.name!r} did not finish within "
                          f"{self.limit:g}s") from None
        finally:
            for oid in prepared:
                node.unreceived(oid)  # only those that did not complete
            for markers in later:
                markers.cancel()
            if not done:
                # An error the caller keeps (a retry's log, a cancelled task)
                # holds this frame: it must not hold the output buffer too.
                self.out.clear()
                self.targets.clear()

    async def sliced(self, node: Any) -> list[Any]:
        """Steps 3 and 4: every slice's chain asked for, every result got."""
        size, inputs = self.size, self.inputs
        await asyncio.gather(*[
            node.reduce([inputs[j][(j + 1 + i) % size] for i in range(size)], self.op, size,
                        self.results[j], inputs[j][j], relay=True)
            for j in range(size)])
        return await asyncio.gather(*[node.get(oid, self.limit) for oid in self.results])

    async def unsliced(self, node: Any, prepared: list[ObjectID],
                       later: list[asyncio.Future]) -> Any:
        """The whole-object allreduce, as `allreduce` runs it."""
        for oid in prepared:
            node.unreceived(oid)
        prepared.clear()
        self.out.clear()  # (the pool takes the buffer back)
        self.targets.clear()
        steps, _ = _reduce_steps(self.whole_args, self.value, self.whole[self.rank], True, False)
        got = (await asyncio.gather(*steps(node, self.limit)))[2]
        for markers in later:
            # Every rank put its marker before its input: here by now.
            with contextlib.suppress(TimeoutError, HopliteError):
                self.rt.one_host_groups[self.size] = \
                    self.hosts(await asyncio.wait_for(markers, 1.0)) == 1
        return got

    def finish(self, got: Any) -> Any:
        if not self.out:
            return got  # reduced whole
        for part_target, part in zip(self.targets, got, strict=True):
            if not np.may_share_memory(part_target, part):  # pulled again elsewhere (a reduce restarted)
                part_target[...] = part
        result = self.out[0]
        result.flags.writeable = False
        return result


def _reduce_and_get(args: tuple, value: Any, mine: ObjectID, fetch: bool,
                    timeout: float | None, wait: bool = False) -> Any:
    """Ask for the reduce, put our input `mine` and, if `fetch`, get the result,
    all at once. A rank that fetches or `wait`s returns only once the reduce is
    done, so it lends its input instead of copying it; one that does neither (a
    non-root of `reduce`) returns once its input is put, and a restarted tree
    may still need it, so it copies."""
    rt = api.runtime()
    limit = api._timeout(rt, timeout)

    def through_the_loop(left: float) -> Any:  # (with what the direct try left)
        steps, lent = _reduce_steps(args, value, mine, fetch, wait)
        out = _together(steps, left, lent)
        return out[2] if fetch else None

    # Small host inputs: the whole call from this thread (hoplite_gpu.direct).
    return rt.reduce_here(rt.node.reduce_msg(*args), value, mine,
                          "get" if fetch else "wait" if wait else None, limit, through_the_loop)


async def _reduce_and_get_async(args: tuple, value: Any, mine: ObjectID, fetch: bool,
                                timeout: float | None, wait: bool = False) -> Any:
    steps, lent = _reduce_steps(args, value, mine, fetch, wait)
    out = await _together_async(steps, timeout, lent)
    return out[2] if fetch else None


def _reduce_steps(args: tuple, value: Any, mine: ObjectID, fetch: bool,
                  wait: bool) -> tuple[Callable[[Any, float], list[Coroutine]], ObjectID | None]:
    """`_reduce_and_get`'s node operations, and the input they lend (if any)."""
    target = args[3]
    lend = fetch or wait
    # Refused here, before the reduce request goes out, if it cannot be sent.
    value = encode(value)
    return (lambda node, limit: [
        node.reduce(*args), node.put(value, mine, lend=lend),
        *([node.get(target, limit)] if fetch else
          [node.reduced_inputs(target, limit)] if wait else [])]), mine if lend else None


@_names_its_timeout
def gather(value: Any, *, name: str, rank: int, size: int, root: int = 0,
           timeout: float | None = None) -> list[Any] | None:
    """Every rank's value, in rank order, on `root` (None elsewhere). The root
    pulls all of them at once; `timeout` bounds the whole call."""
    _check(name, rank, size, root)
    deadline = _put(value, input_id(name, rank), timeout)
    if rank != root:
        return None
    return _get_all([input_id(name, r) for r in range(size)], api.time_left(deadline))


def _get_all(ids: list[ObjectID], timeout: float | None) -> list[Any]:
    """Every object of `ids`, pulled at once (not one after another: a gather
    of small objects then costs one round trip, not N)."""
    rt = api.runtime()
    return rt.get_many(ids, api._timeout(rt, timeout))


def _together(steps: Callable[[Any, float], list[Coroutine]], timeout: float | None,
              lent: ObjectID | list[ObjectID] | None = None) -> list[Any]:
    """Run a call's node operations at once, in one blocking call, and return
    their results. Each starts in order (so the directory sees e.g. a reduce
    request before the put of an input, on the one ordered connection), and a
    call of small objects costs one round trip instead of one per step. If one
    fails, the others are cancelled and its error is raised; `timeout` bounds
    the whole call. `lent`: inputs put with ``lend=True``, reclaimed before the
    call returns, however it ends."""
    rt = api.runtime()
    return rt.together(steps, api._timeout(rt, timeout), lent)


async def _together_async(steps: Callable[[Any, float], list[Coroutine]],
                          timeout: float | None,
                          lent: ObjectID | list[ObjectID] | None = None) -> list[Any]:
    """`_together` awaited from another event loop; cancelling the awaiting
    task cancels the steps (and reclaims `lent`) as a failed step does."""
    rt = api.runtime()
    return await rt.together_async(steps, api._timeout(rt, timeout), lent)


def delete(name: str, *, size: int, op: str = "sum", num_objects: int | None = None) -> None:
    """Free every object that one call named `name` made (its inputs, a
    broadcast value, a reduce's result), on every node. Call it once, from any
    rank, after every rank has its result: a training loop that deletes step
    k-1 at step k keeps its memory flat, and the freed buffers are reused.
    A sliced allreduce's objects are freed where this process has
    ``allreduce_slicing`` on, as the ranks that made them do."""
    doomed = _doomed(name, size, op, num_objects)
    _together(lambda node, _limit: [node.delete_many(doomed)], None)


def _doomed(name: str, size: int, op: str, num_objects: int | None) -> list[ObjectID]:
    """Every object a call named `name` may have made (see `delete`)."""
    _check(name, 0, size)
    ids, target = _reduce_ids(name, size, op, num_objects)
    api._reduce_args(ids, op, num_objects, target)  # (an op or count no call could have used)
    doomed = [ObjectID.from_name(f"{name}/bcast"), target, *ids]
    if _slicing(size, num_objects):  # a sliced allreduce's, or its markers
        inputs, results, ready = _slice_ids(name, size, op)
        # The slices' inputs first: N^2 ids that mostly never existed (lent
        # slices leave with their call), so the directory's memory of removed
        # ids (`Directory.gone`) keeps the ids that did exist longest.
        doomed = [oid for row in inputs for oid in row] + doomed + results + ready \
            + _vote_ids(name, size, op)
    return doomed


@_names_its_timeout
def allgather(value: Any, *, name: str, rank: int, size: int,
              timeout: float | None = None) -> list[Any]:
    """Every rank's value, in rank order, on every rank (pulled at once;
    `timeout` bounds the whole call)."""
    _check(name, rank, size)
    deadline = _put(value, input_id(name, rank), timeout)
    return _get_all([input_id(name, r) for r in range(size)], api.time_left(deadline))


# ------------------------------------------------------------ asyncio twins ---
# The same calls, awaitable from any event loop (a Ray async actor's, a
# serving replica's) without blocking it. They take the node's loop for every
# step (no direct calls: those block the calling thread), and cancelling the
# awaiting task gives the call up as its timeout would: lent inputs are
# reclaimed before the cancellation completes.


async def _put_async(value: Any, oid: ObjectID, timeout: float | None) -> float:
    """`_put` awaited; returns the call's deadline."""
    deadline = time.monotonic() + api._timeout(api.runtime(), timeout)
    await _together_async(lambda node, _limit: [node.put(value, oid)], timeout)
    return deadline


async def _get_all_async(ids: list[ObjectID], timeout: float | None) -> list[Any]:
    return await _together_async(lambda node, left: [node.get(oid, left) for oid in ids], timeout)


@_names_its_timeout
async def broadcast_async(value: Any, *, name: str, rank: int, size: int, root: int = 0,
                          timeout: float | None = None) -> Any:
    """`broadcast`, awaitable."""
    _check(name, rank, size, root)
    oid = ObjectID.from_name(f"{name}/bcast")
    if rank == root:
        if _held_here(oid):
            return await api.get_async(oid, timeout=timeout)
        await _put_async(value, oid, timeout)
        return value
    return await api.get_async(oid, timeout=timeout)


@_names_its_timeout
async def reduce_async(value: Any, *, name: str, rank: int, size: int, root: int = 0,
                       op: str = "sum", num_objects: int | None = None,
                       timeout: float | None = None, wait: bool = False) -> Any:
    """`reduce`, awaitable."""
    _check(name, rank, size, root)
    ids, target = _reduce_ids(name, size, op, num_objects)
    args = api._reduce_args(ids, op, num_objects, target, ids[root])
    return await _reduce_and_get_async(args, value, ids[rank], rank == root, timeout, wait)


@_names_its_timeout
async def allreduce_async(value: Any, *, name: str, rank: int, size: int, op: str = "sum",
                          num_objects: int | None = None, timeout: float | None = None) -> Any:
    """`allreduce`, awaitable (sliced alike, with ``allreduce_slicing`` on)."""
    _check(name, rank, size)
    if _slices(value, size, num_objects) > 1:
        return await _sliced_allreduce_async(_sliceable(value), name, rank, size, op, timeout)
    ids, target = _reduce_ids(name, size, op, num_objects)
    args = api._reduce_args(ids, op, num_objects, target)
    if _marks_unsliced(size, num_objects):
        deadline = await _put_async(_marker(value, sliced=False),
                                    _slice_ids(name, size, op)[2][rank], timeout)
        timeout = api.time_left(deadline)
    return await _reduce_and_get_async(args, value, ids[rank], True, timeout)


@_names_its_timeout
async def gather_async(value: Any, *, name: str, rank: int, size: int, root: int = 0,
                       timeout: float | None = None) -> list[Any] | None:
    """`gather`, awaitable."""
    _check(name, rank, size, root)
    deadline = await _put_async(value, input_id(name, rank), timeout)
    if rank != root:
        return None
    return await _get_all_async([input_id(name, r) for r in range(size)],
                                api.time_left(deadline))


@_names_its_timeout
async def allgather_async(value: Any, *, name: str, rank: int, size: int,
                          timeout: float | None = None) -> list[Any]:
    """`allgather`, awaitable."""
    _check(name, rank, size)
    deadline = await _put_async(value, input_id(name, rank), timeout)
    return await _get_all_async([input_id(name, r) for r in range(size)],
                                api.time_left(deadline))


async def delete_async(name: str, *, size: int, op: str = "sum",
                       num_objects: int | None = None) -> None:
    """`delete`, awaitable."""
    doomed = _doomed(name, size, op, num_objects)
    await _together_async(lambda node, _limit: [node.delete_many(doomed)], None)
