"""`Group`: a communicator. It holds a group's name, this process's rank and
the group's size, so its collectives take only values and options, as
mpi4py's and torch.distributed's do:

    with hg.Group("grads", rank=r, size=n) as g:
        for step in range(steps):
            grads = g.allreduce(grads, op="sum")

Each call is numbered by the group, and its objects live under ids made of
the group's name, its incarnation and the call's number, so no call's name
needs managing and no call meets another's objects. A call goes in two steps:

1. **Agreement** (`hoplite_gpu.roster`). Each rank puts a small descriptor of
   its call (the kind of call, op, root, the group's size, the dtype and shape
   of an array that is reduced, and a token naming this Group object) and
   reads every rank's. A call the ranks disagree on is refused on every rank,
   with an error that says what differs on which ranks (`GroupMismatch`); a
   rank that does not come makes the others' `Timeout` name the group, the
   call and the missing ranks. Since every rank puts call k's descriptor only
   after it returned from call k-1, rank 0 then frees everything of call k-1:
   a loop keeps its memory flat with no delete, and nothing a slow rank still
   reads is freed.
2. **The call itself**, through the name-based collectives
   (`hoplite_gpu.collectives`), under the call's own name.

The first call also forms the group: each rank claims its rank under the
group's name (an object only one Group can put), and the incarnation is rank
0's token. The claims hold the name until `close`: a second group under the
name is refused while the first lives (`GroupConflict`), and two that form at
the same moment are both refused (docs/collectives.md).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Coroutine
from typing import Any

import numpy as np

from . import api, collectives
from .config import check_timeout
from .errors import (
    GroupBroken,
    GroupConflict,
    GroupMismatch,
    HopliteError,
    InvalidArgument,
    Timeout,
)
from .ids import ObjectID
from .multitree import _broadcast as multitree_over
from .multitree import members_of
from .multitree_reduce import plan_for, tree_reduce
from .roster import Descriptor, Roster, array_kind, ranks_text, stale_tokens
from .runtime import GIVE_UP_S, time_left

log = logging.getLogger("hoplite_gpu")


def block_edges(rows: int, size: int) -> list[int]:
    """Where `numpy.array_split(x, size, axis=0)` cuts `rows` rows: block j is
    rows [edges[j], edges[j + 1])."""
    q, extra = divmod(rows, size)
    edges = [0]
    for j in range(size):
        edges.append(edges[-1] + q + (j < extra))
    return edges


async def _reduce_scatter(value: Any, name: str, ids: tuple[list[list[ObjectID]], list[ObjectID]],
                          rank: int, size: int, op: str, limit: float) -> Any:
    """Block `rank` (of `numpy.array_split(..., size, axis=0)`) of the reduction:
    one reduce per block, rooted at its rank, so each rank receives its block
    alone. Every rank lends its blocks (no copy) and returns once every
    block's reduce is done. A device array is allreduced whole and cut."""
    if not isinstance(value, np.ndarray):
        whole = await collectives.allreduce_async(value, name=name, rank=rank, size=size, op=op,
                                                  timeout=limit)
        edges = block_edges(int(whole.shape[0]), size)
        return whole[edges[rank]:edges[rank + 1]]
    value = np.ascontiguousarray(value)
    edges = block_edges(value.shape[0], size)
    blocks = [value[edges[j]:edges[j + 1]] for j in range(size)]
    inputs, results = ids
    reduced = [j for j in range(size) if blocks[j].size]  # (alike on every rank)
    lent = [inputs[j][rank] for j in reduced]

    def steps(node: Any, left: float) -> list[Coroutine]:
        asks: list[Coroutine] = []
        for j in reduced:  # (each reduce asked for before our input of it is put)
            asks += [node.reduce(inputs[j], op, size, results[j], inputs[j][j]),
                     node.put(blocks[j], inputs[j][rank], lend=True)]
        waits = [node.get(results[j], left) if j == rank else node.reduced_inputs(results[j], left)
                 for j in reduced]
        return asks + waits

    out = await api.runtime().together_async(steps, limit, lent)
    if rank not in reduced:
        return np.empty(blocks[rank].shape, blocks[rank].dtype)
    return out[2 * len(reduced) + reduced.index(rank)]


class Group:
    """The ranks ``0 .. size-1`` of group `name`, as this process's `rank`.

    Every rank makes the same calls, in the same order, with the same group
    size, op and root, and arrays of one dtype and shape where they are
    reduced; a call they disagree on is refused on every rank. A call waits
    at most `timeout` seconds (default: the runtime's ``timeout_s``), or its
    own `timeout`. After a call fails, the group is broken (`GroupBroken`):
    close it and make a new one. A Group makes one call at a time; use one
    Group per concurrent stream of calls. `close()` (or leaving a ``with``
    block) frees what the last call left, on every node.

    With a `topology` (`hoplite_gpu.topology`) and two ranks or more, a broadcast
    goes over the spanning trees packed for it (`hoplite_gpu.multitree`),
    the object split across them by their rates, and so do a reduce and an
    allreduce of an array larger than `inline_threshold`, up the trees turned
    around (`hoplite_gpu.multitree_reduce`); other calls are unchanged. Each
    rank says where it sits: `node`, its own node of the topology (its GPU's
    index, its host: whatever the topology names), which the first call
    tells every rank; or `members`, every rank's node in rank order, the same
    list on every rank; or neither: rank r on the topology's r-th node. The
    first call checks that the ranks agree (each on a distinct node, all with
    a topology or none) and fails on every rank, saying which differ, if not."""

    def __init__(self, name: str, *, rank: int, size: int, timeout: float | None = None,
                 topology: Any = None, members: Any = None, node: Any = None) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"Group: name must be a non-empty str; got {name!r}")
        if not (collectives._int(size) and size >= 1):
            raise InvalidArgument(f"Group {name!r}: size must be a positive int; got {size!r}")
        if not (collectives._int(rank) and 0 <= rank < size):
            raise InvalidArgument(f"Group {name!r}: rank must be an int in [0, {size}); "
                                  f"got {rank!r}")
        self.name, self.rank, self.size = name, int(rank), int(size)
        self.timeout = None if timeout is None else check_timeout(timeout)
        self.topology = topology
        #: the topology node of each rank (with a topology; with `node`, once
        #: the first call has told every rank's)
        self.members: tuple[Any, ...] | None = None
        #: this rank's topology node
        self.place: Any = None
        if topology is None:
            if members is not None or node is not None:
                raise InvalidArgument(f"Group {name!r}: members= and node= place ranks on a "
                                      "topology; give topology= too")
        elif node is not None:
            if members is not None:
                raise InvalidArgument(f"Group {name!r}: give node= (this rank's node) or "
                                      "members= (every rank's), not both")
            if isinstance(node, bool) or not isinstance(node, int | str) \
                    or node not in topology.nodes:
                raise InvalidArgument(f"Group {name!r} rank {rank}: node {node!r} is not a "
                                      f"node of topology {topology.name!r} "
                                      f"({list(topology.nodes)})")
            self.place = node
        else:
            self.members = members_of(topology, self.size, members, f"Group {name!r}")
            self.place = self.members[self.rank]
        token = self._token = os.urandom(8).hex()
        # A Group dropped without `close` leaves its claim: stale to this process.
        weakref.finalize(self, stale_tokens.add, token)
        self._roster = Roster(name, self.rank, self.size, token)
        self._ids = self._roster.ids
        #: calls made so far (the next call's number)
        self.calls = 0
        #: (kind, op, how) of the last call made: rank 0 frees its objects at the next
        self._last: tuple[str, str | None, str] = ("barrier", None, "whole")
        #: packed trees by (flow, root), made once (off the loop: packing takes a while)
        self._plans: dict[tuple[str, int], Any] = {}
        self._broken: BaseException | None = None
        self._closed = False
        self._busy = threading.Lock()

    def __repr__(self) -> str:
        return f"Group({self.name!r}, rank={self.rank}, size={self.size}, calls={self.calls})"

    # ------------------------------------------------------------ the calls ---
    def broadcast(self, value: Any, root: int = 0, *, timeout: float | None = None) -> Any:
        """`root`'s value on every rank (the others' `value` is not read)."""
        return self._blocking("broadcast", value, None, root, timeout)

    def reduce(self, value: Any, root: int = 0, op: str = "sum", *,
               timeout: float | None = None) -> Any:
        """The reduction of every rank's array on `root`; None elsewhere."""
        return self._blocking("reduce", value, op, root, timeout)

    def allreduce(self, value: Any, op: str = "sum", *, timeout: float | None = None) -> Any:
        """The reduction of every rank's array, on every rank (read-only)."""
        return self._blocking("allreduce", value, op, None, timeout)

    def reduce_scatter(self, value: Any, op: str = "sum", *, timeout: float | None = None) -> Any:
        """This rank's block of the reduction: ``numpy.array_split(result,
        size, axis=0)[rank]``, where each rank receives only its own block."""
        return self._blocking("reduce_scatter", value, op, None, timeout)

    def gather(self, value: Any, root: int = 0, *,
               timeout: float | None = None) -> list[Any] | None:
        """Every rank's value, in rank order, on `root`; None elsewhere."""
        return self._blocking("gather", value, None, root, timeout)

    def allgather(self, value: Any, *, timeout: float | None = None) -> list[Any]:
        """Every rank's value, in rank order, on every rank."""
        return self._blocking("allgather", value, None, None, timeout)

    def barrier(self, *, timeout: float | None = None) -> None:
        """Return once every rank has called `barrier`."""
        self._blocking("barrier", None, None, None, timeout)

    async def broadcast_async(self, value: Any, root: int = 0, *,
                              timeout: float | None = None) -> Any:
        return await self._awaited("broadcast", value, None, root, timeout)

    async def reduce_async(self, value: Any, root: int = 0, op: str = "sum", *,
                           timeout: float | None = None) -> Any:
        return await self._awaited("reduce", value, op, root, timeout)

    async def allreduce_async(self, value: Any, op: str = "sum", *,
                              timeout: float | None = None) -> Any:
        return await self._awaited("allreduce", value, op, None, timeout)

    async def reduce_scatter_async(self, value: Any, op: str = "sum", *,
                                   timeout: float | None = None) -> Any:
        return await self._awaited("reduce_scatter", value, op, None, timeout)

    async def gather_async(self, value: Any, root: int = 0, *,
                           timeout: float | None = None) -> list[Any] | None:
        return await self._awaited("gather", value, None, root, timeout)

    async def allgather_async(self, value: Any, *, timeout: float | None = None) -> list[Any]:
        return await self._awaited("allgather", value, None, None, timeout)

    async def barrier_async(self, *, timeout: float | None = None) -> None:
        await self._awaited("barrier", None, None, None, timeout)

    # -------------------------------------------------------------- closing ---
    def close(self, *, timeout: float | None = None) -> None:
        """Leave the group, every rank together: once every rank has called
        `close`, rank 0 frees the last call's objects and the close's own, and
        each rank's `close` returns (a rank whose rank 0 does not close waits
        out `timeout`). A broken group closes at once, on this rank alone."""
        if self._closing():
            self._blocking("close", None, None, None, timeout)

    async def close_async(self, *, timeout: float | None = None) -> None:
        if self._closed:
            return
        if self._broken is not None or self.calls == 0:
            await self._abandon_async()
        else:
            await self._awaited("close", None, None, None, timeout)

    def __enter__(self) -> Group:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:  # (the other ranks may be anywhere: do not wait for them)
            self._abandon()

    async def __aenter__(self) -> Group:
        return self

    async def __aexit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            await self.close_async()
        else:
            await self._abandon_async()

    def _closing(self) -> bool:
        """Whether `close` has a collective close to make (or else it is done)."""
        if self._closed:
            return False
        if self._broken is not None or self.calls == 0:
            self._abandon()
            return False
        return True

    def _abandon(self) -> None:
        """Close on this rank alone: a claim that a failed first call left is
        taken back, so that the name is free again."""
        claim = self._let_go()
        if claim is not None:
            try:
                rt = api.runtime()
                rt.call(rt.node.delete(claim), rt.config.timeout_s)
            except HopliteError as exc:  # (the runtime is gone: so is the claim's holder)
                log.debug("%r: its claim was not taken back: %s", self, exc)

    async def _abandon_async(self) -> None:
        claim = self._let_go()
        if claim is not None:
            try:
                rt = api.runtime()
                await rt.call_async(rt.node.delete(claim))
            except HopliteError as exc:
                log.debug("%r: its claim was not taken back: %s", self, exc)

    def _let_go(self) -> ObjectID | None:
        """Mark this Group closed (its claim, if left, is stale: a new Group of
        this process takes it over); the id of its claim if it must be taken
        back now. A claim that disagreed stays, so that the ranks still
        reading it say what differed (other processes take it over once this
        one is gone)."""
        if self._closed:
            return None
        self._closed = True
        stale_tokens.add(self._token)
        kept = isinstance(self._broken, (GroupMismatch, GroupConflict))
        return self._ids.claim(self.rank) if self._roster.claimed and self.calls == 0 and not kept \
            else None

    # ------------------------------------------------------- running a call ---
    def _label(self, k: int, kind: str) -> str:
        return self._roster.label(k, kind)

    def _begin(self, kind: str, value: Any, op: str | None, root: int | None) -> None:
        """Refuse a call that cannot start (nothing is sent, the group stays
        as it was), and take the group for it."""
        if self._closed and kind != "close":
            raise GroupBroken(f"Group {self.name!r} rank {self.rank} is closed")
        if self._broken is not None:
            raise GroupBroken(
                f"Group {self.name!r} rank {self.rank}: call {self.calls} failed "
                f"({type(self._broken).__name__}: {self._broken}); its ranks may now be at "
                "different calls, so the group cannot go on: close it and make a new Group")
        if root is not None and not (collectives._int(root) and 0 <= root < self.size):
            raise InvalidArgument(f"{self._label(self.calls, kind)}: root must be an int in "
                                  f"[0, {self.size}); got {root!r}")
        if op is not None:
            from .kernels import check_op

            check_op(op)
        if kind == "reduce_scatter" and not getattr(value, "shape", ()):
            raise InvalidArgument(f"{self._label(self.calls, kind)}: reduce_scatter takes an "
                                  "array of at least one dimension, split along its first; "
                                  f"got {array_kind(value)[0]} of shape "
                                  f"{getattr(value, 'shape', None)}")
        if not self._busy.acquire(blocking=False):
            raise InvalidArgument(
                f"{self._label(self.calls, kind)}: another call of this Group is running; "
                "a Group makes one call at a time (use one Group per concurrent stream)")

    def _ended(self, error: BaseException | None) -> None:
        if error is not None:
            self._broken = error
        self._busy.release()

    def _blocking(self, kind: str, value: Any, op: str | None, root: int | None,
                  timeout: float | None) -> Any:
        rt = api.runtime()
        limit = api._timeout(rt, self.timeout if timeout is None else timeout)
        self._begin(kind, value, op, root)
        error: BaseException | None = None
        try:
            return rt.call(self._run(kind, value, op, root, limit), limit)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._ended(error)

    async def _awaited(self, kind: str, value: Any, op: str | None, root: int | None,
                       timeout: float | None) -> Any:
        rt = api.runtime()
        limit = api._timeout(rt, self.timeout if timeout is None else timeout)
        self._begin(kind, value, op, root)
        error: BaseException | None = None
        try:
            return await rt.call_async(self._run(kind, value, op, root, limit))
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._ended(error)

    async def _run(self, kind: str, value: Any, op: str | None, root: int | None,
                   limit: float) -> Any:
        """Call number `self.calls`, on the runtime's loop, within `limit` seconds."""
        node = api.runtime().node
        deadline = time.monotonic() + limit
        k = self.calls
        roster = self._roster
        mine = roster.descriptor(node.node_id, k, kind, value, op, root, self.place)
        if kind == "close":
            return await self._close(node, mine, deadline, limit)
        if k == 0:
            await roster.join(node, mine, deadline, limit)
            self._placed(roster.places)
        else:
            await roster.agree(node, mine, deadline, limit)
        spent = self._ids.spent(k - 1, *self._last) if k and self.rank == 0 else []
        result = await self._work(node, kind, value, op, root, k, deadline, limit, spent)
        if k == 0:
            await roster.seal(node, deadline, limit)
        self.calls, self._last = k + 1, (kind, op, self._how(kind, value, root))
        return result

    def _placed(self, places: list[Any]) -> None:
        """Take the ranks' topology nodes as the first call found them, or
        fail the call (on every rank alike: all read the same) if they do not
        agree with each other or with this rank's `members`."""
        where = f"Group {self.name!r} call 0: the ranks' places on the topology differ"
        if self.topology is None and all(p is None for p in places):
            return
        none = [r for r, p in enumerate(places) if p is None]
        if none:
            said = [r for r in range(self.size) if r not in none]
            raise GroupMismatch(f"{where}: {ranks_text(none)} made the group without a "
                                f"topology, {ranks_text(said)} with one")
        by_node: dict[Any, list[int]] = {}
        for r, p in enumerate(places):
            by_node.setdefault(p, []).append(r)
        shared = [f"{ranks_text(rs)} on node {p!r}" for p, rs in by_node.items() if len(rs) > 1]
        if shared:
            raise GroupMismatch(f"{where}: each rank needs a node of its own; "
                                + "; ".join(shared))
        unknown = [r for r, p in enumerate(places) if p not in self.topology.nodes]
        if unknown:
            raise GroupMismatch(f"{where}: {ranks_text(unknown)} sit on nodes that this "
                                f"rank's topology {self.topology.name!r} lacks "
                                f"({[places[r] for r in unknown]}): the ranks' topologies "
                                "differ")
        if self.members is not None and tuple(places) != self.members:
            wrong = [r for r in range(self.size) if places[r] != self.members[r]]
            raise GroupMismatch(f"{where}: {ranks_text(wrong)} said "
                                f"{[places[r] for r in wrong]} where rank {self.rank}'s "
                                f"members put {[self.members[r] for r in wrong]}")
        self.members = tuple(places)

    async def _work(self, node: Any, kind: str, value: Any, op: str | None, root: int | None,
                    k: int, deadline: float, limit: float, spent: list[ObjectID]) -> Any:
        """The call itself, beside the freeing of the call before (rank 0)."""
        freeing = asyncio.ensure_future(node.delete_many(spent)) if spent else None
        try:
            return await self._collective(kind, value, op, root, k, time_left(deadline))
        except Timeout as exc:
            raise Timeout(f"{self._label(k, kind)}: every rank came, but the call did not "
                          f"finish within {limit:g}s: {exc}") from None
        except HopliteError as exc:
            if str(exc).startswith("Group "):
                raise
            raise type(exc)(f"{self._label(k, kind)}: {exc}") from exc
        finally:
            if freeing is not None:
                await asyncio.wait([freeing], timeout=time_left(deadline) + GIVE_UP_S)
                if not freeing.done():
                    freeing.cancel()
                elif not freeing.cancelled() and freeing.exception() is not None:
                    log.warning("%s: the objects of call %d were not freed: %s",
                                self._label(k, kind), k - 1, freeing.exception())

    async def _collective(self, kind: str, value: Any, op: str | None, root: int | None,
                          k: int, left: float) -> Any:
        name, rank, size = self._ids.call(k), self.rank, self.size
        if self._how(kind, value, root) == "trees":
            node, root = api.runtime().node, root or 0
            plan = await self._plan(kind, root)
            if kind == "broadcast":
                return await multitree_over(node, value, name, rank, root, self.members, plan,
                                            left, "cupy")
            return await tree_reduce(node, value, name, rank, root, self.members, plan, op,
                                     left, everyone=kind == "allreduce", array_type="cupy")
        if kind == "broadcast":
            return await collectives.broadcast_async(value, name=name, rank=rank, size=size,
                                                     root=root, timeout=left)
        if kind == "reduce":
            return await collectives.reduce_async(value, name=name, rank=rank, size=size,
                                                  root=root, op=op, timeout=left)
        if kind == "allreduce":
            return await collectives.allreduce_async(value, name=name, rank=rank, size=size,
                                                     op=op, timeout=left)
        if kind == "reduce_scatter":
            return await _reduce_scatter(value, name, self._ids.scatter(k, op), rank, size, op,
                                         left)
        if kind == "gather":
            return await collectives.gather_async(value, name=name, rank=rank, size=size,
                                                  root=root, timeout=left)
        if kind == "allgather":
            return await collectives.allgather_async(value, name=name, rank=rank, size=size,
                                                     timeout=left)
        return None  # a barrier: the agreement was all of it

    def _how(self, kind: str, value: Any, root: int | None) -> str:
        """How a call goes: over packed trees ("trees"), sliced ("sliced", an
        allreduce of `allreduce_slicing`) or whole. Every rank decides alike:
        by the kind, and the dtype and shape the ranks agreed on."""
        if self.topology is not None and self.size > 1:
            if kind == "broadcast":
                return "trees"
            nbytes = getattr(value, "nbytes", None)
            if kind in ("reduce", "allreduce") and collectives._int(nbytes) \
                    and nbytes > api.runtime().config.inline_threshold:
                # (smaller arrays travel inline through the directory: trees
                # of data connections would only add round trips)
                return "trees"
        if kind == "allreduce" and collectives._slices(value, self.size, None) > 1:
            return "sliced"
        return "whole"

    async def _plan(self, kind: str, root: int) -> Any:
        """The trees of a call of `kind` rooted at rank `root`."""
        flow = "broadcast" if kind == "broadcast" else kind
        plan = self._plans.get((flow, root))
        if plan is None:
            if flow == "broadcast":
                from .trees import pack

                make = functools.partial(pack, self.topology, self.members[root], self.members)
            else:
                make = functools.partial(plan_for, flow, self.topology, self.members[root],
                                         self.members)
            plan = self._plans[(flow, root)] = await asyncio.to_thread(make)
        return plan

    async def _close(self, node: Any, mine: Descriptor, deadline: float, limit: float) -> None:
        """`close`'s work: rank 0 frees the last call's objects, the claims and
        every close descriptor; the others wait until theirs is freed (they do
        not read every descriptor: rank 0 frees them once it has)."""
        k, ids = mine.call, self._ids
        self._closed = True
        stale_tokens.add(self._token)
        await node.put(mine.encode(), ids.descriptor(k, self.rank), timeout=time_left(deadline),
                       same_bytes=True)
        if self.rank != 0:
            await self._roster.await_freed(node, k, deadline, limit)
            return
        await self._roster.agree(node, mine, deadline, limit, put=False)
        await node.delete_many(ids.spent(k - 1, *self._last) + ids.held()
                               + [ids.descriptor(k, r) for r in range(self.size)])
