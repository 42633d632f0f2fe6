"""A group's roster: who holds each rank of a `Group`, and what each rank
says of each call. The agreement of `hoplite_gpu.group` lives here: the
descriptors the ranks put and read, the claims that form a group under its
name, and the seals that refuse two groups forming under one name at once
(docs/collectives.md, "Agreement" and "Two groups under one name")."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from . import collectives
from .errors import GroupConflict, GroupMismatch, ObjectExists, ObjectNotFound, Timeout
from .ids import ObjectID
from .runtime import GIVE_UP_S, time_left

#: Where every id of a group lives: ``hoplite-group/<name>/...``.
_PREFIX = "hoplite-group"
#: How long a rank that found a disagreement still waits for the other ranks'
#: descriptors, so that its error names them all.
_PICTURE_S = 0.2
#: How long after a rank has read every claim it waits before it seals its own
#: (the end of the first call): a Group of another group that claims one of
#: these ranks within that time, under the same name, is seen, and both groups
#: are refused instead of one being formed of ranks of both. Later claimants
#: are refused as long as this group lives (its claims hold the name).
_SETTLE_S = 0.1
#: Tokens of this process's Groups that failed or were closed: a claim of one
#: of them still in the directory is stale, and a new Group may take its rank.
stale_tokens: set[str] = set()

#: What each kind of call needs the ranks to agree on, besides its kind and
#: the group's size.
_AGREED: dict[str, tuple[str, ...]] = {
    "broadcast": ("root",), "reduce": ("root", "op", "dtype", "shape"),
    "allreduce": ("op", "dtype", "shape"), "reduce_scatter": ("op", "dtype", "shape"),
    "gather": ("root",), "allgather": (), "barrier": (), "close": (),
}
_LABELS = {"size": "the group's size", "kind": "the call", "root": "root", "op": "op",
           "dtype": "dtype", "shape": "shape"}


@dataclass(frozen=True)
class Descriptor:
    """What one rank says of its call (and, in the first call, its claim)."""

    token: str  # the Group object's, random: which object made the call
    node: str  # its node id, for errors and stale claims
    rank: int
    size: int
    call: int
    kind: str
    op: str | None = None
    root: int | None = None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    #: the rank's node of the group's topology (said in the first call only)
    place: int | str | None = None

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: Any, where: str) -> Descriptor:
        try:
            fields = json.loads(bytes(raw))
            if fields.get("shape") is not None:
                fields["shape"] = tuple(fields["shape"])
            return cls(**fields)
        except (TypeError, ValueError) as exc:
            raise GroupConflict(f"{where} holds an object that is not a Group's descriptor "
                                f"({exc}); another program uses the group's name") from None


def ranks_text(ranks: list[int]) -> str:
    return (f"rank {ranks[0]}" if len(ranks) == 1
            else "ranks " + ", ".join(str(r) for r in sorted(ranks)))


def _differs(descriptors: dict[int, Descriptor], field: str) -> list[str]:
    by_value: dict[Any, list[int]] = {}
    for rank, d in sorted(descriptors.items()):
        by_value.setdefault(getattr(d, field), []).append(rank)
    if len(by_value) < 2:
        return []
    shown = "; ".join(f"{value!r} on {ranks_text(ranks)}" if field != "kind"
                      else f"{value} on {ranks_text(ranks)}" for value, ranks in by_value.items())
    return [f"{_LABELS[field]}: {shown}"]


def disagreement(descriptors: dict[int, Descriptor]) -> str | None:
    """What the ranks' descriptors disagree on, said with the ranks (None: nothing)."""
    parts = _differs(descriptors, "size") + _differs(descriptors, "kind")
    if not parts and descriptors:
        kind = next(iter(descriptors.values())).kind
        for field in _AGREED.get(kind, ()):
            parts += _differs(descriptors, field)
    return " | ".join(parts) or None


def array_kind(value: Any) -> tuple[str, tuple[int, ...] | None]:
    """(dtype, shape) of an array; (type name, None) of anything else."""
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        return str(value.dtype), tuple(int(n) for n in value.shape)
    return type(value).__name__, None


class GroupIds:
    """The object ids of one group: claims under its name, the rest under its incarnation."""

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size
        self.incarnation = ""

    def claim(self, rank: int) -> ObjectID:
        return ObjectID.from_name(f"{_PREFIX}/{self.name}/claim/{rank}")

    def seal(self, rank: int) -> ObjectID:
        return ObjectID.from_name(f"{_PREFIX}/{self.name}/{self.incarnation}/seal/{rank}")

    def call(self, k: int) -> str:
        """The name-based collectives' name of call `k`."""
        return f"{_PREFIX}/{self.name}/{self.incarnation}/{k}"

    def descriptor(self, k: int, rank: int) -> ObjectID:
        return ObjectID.from_name(f"{self.call(k)}/descriptor/{rank}")

    def held(self) -> list[ObjectID]:
        """The claims and seals: they hold the name while the group lives."""
        return [self.claim(r) for r in range(self.size)] + [self.seal(r) for r in range(self.size)]

    def scatter(self, k: int, op: str) -> tuple[list[list[ObjectID]], list[ObjectID]]:
        """(inputs[j][r], results[j]) of reduce_scatter call `k`: block j's reduce."""
        name, size = self.call(k), self.size
        return ([[ObjectID.from_name(f"{name}/scatter/{j}/in/{r}") for r in range(size)]
                 for j in range(size)],
                [ObjectID.from_name(f"{name}/scatter/{j}/{op}") for j in range(size)])

    def spent(self, k: int, kind: str, op: str | None, how: str = "whole") -> list[ObjectID]:
        """Every object call `k` (of `kind`, `op`; gone `how`: "whole",
        "sliced" or over packed "trees", `Group._how`) may have made; its
        descriptors too (the first call's are the claims, kept until
        `close`: `held`)."""
        size, name = self.size, self.call(k)
        ids = [] if k == 0 else [self.descriptor(k, r) for r in range(size)]
        if kind == "broadcast" and how == "trees":  # (hoplite_gpu.multitree)
            from .multitree import call_ids

            ids += call_ids(name, size)
        elif kind in ("reduce", "allreduce") and how == "trees":
            from .multitree_reduce import call_ids as reduce_ids

            ids += reduce_ids(name, size)
        elif kind == "broadcast":
            ids.append(ObjectID.from_name(f"{name}/bcast"))
        elif kind in ("reduce", "allreduce") and how == "sliced":
            ids += collectives._doomed(name, size, op or "sum", None)
        elif kind in ("reduce", "allreduce"):
            inputs, target = collectives._reduce_ids(name, size, op or "sum", None)
            ids += [target, *inputs]
            if kind == "allreduce" and size > 1:  # (its barrier markers, with "auto")
                ids += collectives._ready_ids(name, size)
        elif kind in ("gather", "allgather"):
            ids += [collectives.input_id(name, r) for r in range(size)]
        elif kind == "reduce_scatter":
            inputs, results = self.scatter(k, op or "sum")
            ids += [oid for row in inputs for oid in row] + results
        return ids


async def collect(node: Any, ids: list[ObjectID], deadline: float,
                  decode: Callable[[int, Any], Any],
                  wrong: Callable[[dict[int, Any]], bool] = lambda got: False) -> dict[int, Any]:
    """Each object of `ids` that comes by `deadline`, decoded, by index (those
    missing are left out). Once `wrong(got)` holds, the rest get only
    `_PICTURE_S` more, so that an error can name every rank it concerns."""
    tasks = {asyncio.ensure_future(node.get(oid, time_left(deadline), "numpy")): i
             for i, oid in enumerate(ids)}
    got: dict[int, Any] = {}
    pending = set(tasks)
    until = min(deadline, time.monotonic() + _PICTURE_S) if wrong(got) else deadline
    try:
        while pending and time.monotonic() < until:
            done, pending = await asyncio.wait(pending, timeout=until - time.monotonic(),
                                               return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not isinstance(task.exception(), Timeout):  # (Timeout: missing)
                    got[tasks[task]] = decode(tasks[task], task.result())
            if until == deadline and wrong(got):
                until = min(deadline, time.monotonic() + _PICTURE_S)
        return got
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=GIVE_UP_S)
        for task in tasks:  # (each error read: none is logged as never retrieved)
            if task.done() and not task.cancelled():
                task.exception()


class Roster:
    """This rank's view of its group: its claim, every rank's Group token (as
    the first call found them), and the agreement of each call."""

    def __init__(self, name: str, rank: int, size: int, token: str) -> None:
        self.name, self.rank, self.size, self.token = name, rank, size, token
        self.ids = GroupIds(name, size)
        #: each rank's Group token, as the first call found them
        self.members: list[str] = []
        #: whether this rank's claim was put (and is held until `close`)
        self.claimed = False
        #: each rank's node of the group's topology, as the first call found them
        self.places: list[int | str | None] = []
        #: when the first call had read every claim (time.monotonic())
        self.joined = 0.0

    def label(self, k: int, kind: str) -> str:
        return f"Group {self.name!r} call {k} ({kind})"

    def descriptor(self, node_id: str, k: int, kind: str, value: Any, op: str | None,
                   root: int | None, place: int | str | None = None) -> Descriptor:
        """This rank's descriptor of call `k`: only what `kind` must agree on
        (and, in the first call, where on the topology it sits)."""
        agreed = _AGREED[kind]
        dtype, shape = array_kind(value) if "dtype" in agreed else (None, None)
        return Descriptor(self.token, node_id, self.rank, self.size, k, kind,
                          op if "op" in agreed else None, root if "root" in agreed else None,
                          dtype, shape, place if k == 0 else None)

    async def descriptors(self, node: Any, ids: list[ObjectID], k: int, kind: str,
                          deadline: float,
                          have: dict[int, Descriptor] | None = None) -> dict[int, Descriptor]:
        """The descriptors of call `k` that come by `deadline`, by rank: those
        of `ids` (rank r's at ids[r], None for ranks in `have`) and `have`'s.
        Once they disagree, the rest get only a moment more."""
        have = have or {}
        wanted = [r for r in range(self.size) if r not in have]

        def decode(i: int, raw: Any) -> Descriptor:
            return Descriptor.decode(raw, f"{self.label(k, kind)}: rank {wanted[i]}'s descriptor")

        def wrong(got: dict[int, Descriptor]) -> bool:
            return disagreement({**have, **{wanted[i]: d for i, d in got.items()}}) is not None

        got = await collect(node, [ids[r] for r in wanted], deadline, decode, wrong)
        return {**have, **{wanted[i]: d for i, d in got.items()}}

    def check(self, got: dict[int, Descriptor], k: int, kind: str, limit: float,
              left_over: list[int] | tuple = (), hint: str | None = None) -> None:
        """Raise the error that says which ranks disagree on what, or which did
        not come (`left_over`: ranks whose only claim was a stale one)."""
        wrong = disagreement(got)
        if wrong is not None:
            raise GroupMismatch(
                f"Group {self.name!r} call {k}: the ranks disagree, so none makes the call: "
                f"{wrong}. Every rank makes the same calls in the same order, with the same "
                "size, op and root, and arrays of one dtype and shape where they are reduced")
        missing = [r for r in range(self.size) if r not in got]
        if missing:
            came = f"; {ranks_text(sorted(got))} came" if got else ""
            stale = (f" ({ranks_text(sorted(left_over))}: only a claim left by a Group that was "
                     "closed or whose process is gone"
                     + (f", which disagreed: {hint}" if hint else "") + ")" if left_over else "")
            raise Timeout(f"{self.label(k, kind)}: {ranks_text(missing)} of {self.size} did not "
                          f"come within {limit:g}s{came}{stale}")

    async def agree(self, node: Any, mine: Descriptor, deadline: float, limit: float,
                    put: bool = True) -> None:
        """Put our descriptor of call k >= 1 (unless `put` is False: it is), and
        read every rank's."""
        k, ids = mine.call, self.ids
        if put:
            await node.put(mine.encode(), ids.descriptor(k, self.rank),
                           timeout=time_left(deadline), same_bytes=True)
        got = await self.descriptors(node, [ids.descriptor(k, r) for r in range(self.size)],
                                      k, mine.kind, deadline)
        self.check(got, k, mine.kind, limit)
        strangers = [r for r, d in got.items() if d.token != self.members[r]]
        if strangers:
            raise GroupConflict(
                f"{self.label(k, mine.kind)}: the call of {ranks_text(strangers)} comes from "
                f"another Group object than the one that joined as that rank (node "
                f"{got[strangers[0]].node}); each rank keeps its one Group object")

    async def join(self, node: Any, mine: Descriptor, deadline: float, limit: float) -> None:
        """The first call's agreement: claim this rank, read every rank's claim."""
        # (Groups closed during the join are not stale to it: their ranks are
        # still being read, and they said what differed.)
        closed = set(stale_tokens)
        await self.claim(node, mine, deadline, closed)
        ids = [self.ids.claim(r) for r in range(self.size)]
        got: dict[int, Descriptor] = {}
        hint = None
        while True:
            got = await self.descriptors(node, ids, 0, mine.kind, deadline, got)
            # A claim left by a Group that was closed, or whose process is
            # gone, read before its rank's new Group took it over, is read again.
            stale = await self.stale(node, got, closed)
            if stale:
                hint = disagreement(got) or hint
            for r in stale:
                node.forget_copy(ids[r])
                del got[r]
            if not stale or time.monotonic() >= deadline:
                break
            await asyncio.sleep(min(0.05, time_left(deadline)))
        self.check(got, 0, mine.kind, limit, stale, hint)
        self.members = [got[r].token for r in range(self.size)]
        #: each rank's node of the topology, as it said in the first call
        self.places = [got[r].place for r in range(self.size)]
        self.ids.incarnation = got[0].token
        self.joined = time.monotonic()

    async def claim(self, node: Any, mine: Descriptor, deadline: float,
                    closed: set[str]) -> None:
        """Put our claim of this rank; a stale one (of a Group of this process
        that failed or closed, or of a node that died) is taken over."""
        oid = self.ids.claim(self.rank)
        for _ in range(3):
            try:
                await node.put(mine.encode(), oid, timeout=time_left(deadline), same_bytes=True)
                self.claimed = True
                return
            except ObjectExists:
                holder = await self.read_claim(node, self.rank, min(deadline, time.monotonic() + 2))
            if holder is None:
                continue  # (taken back meanwhile: claim again)
            if await self.stale(node, {self.rank: holder}, closed):
                await node.delete(oid)
                continue
            await self.mark_clash(node, holder, deadline)
            raise GroupConflict(
                f"{self.label(0, mine.kind)}: rank {self.rank} of group {self.name!r} is "
                f"claimed by another Group (node {holder.node}) that is forming now (or that "
                "failed in a process still running, or that died less than a node lease "
                "ago); two groups that use one name at once are refused: give each its own "
                "name")
        raise GroupConflict(f"{self.label(0, mine.kind)}: rank {self.rank} of group "
                            f"{self.name!r} could not be claimed: other Groups took it in turn")

    async def stale(self, node: Any, claims: dict[int, Descriptor],
                    closed: set[str]) -> list[int]:
        """The ranks whose claim is left by a Group of this process that was
        `closed`, or by a node that is not alive."""
        others = {r: d for r, d in claims.items() if d.token != self.token}
        stale = [r for r, d in others.items() if d.token in closed]
        if any(d.node != node.node_id for r, d in others.items() if r not in stale):
            live = await node.nodes()
            stale += [r for r, d in others.items() if r not in stale and d.node not in live]
        return sorted(stale)

    async def read_claim(self, node: Any, rank: int, deadline: float) -> Descriptor | None:
        try:
            raw = await node.get(self.ids.claim(rank), time_left(deadline), "numpy")
        except (Timeout, ObjectNotFound):
            return None
        return Descriptor.decode(raw, f"Group {self.name!r}: the claim of rank {rank}")

    async def mark_clash(self, node: Any, holder: Descriptor, deadline: float) -> None:
        """Tell the group that holds our rank that another Group wanted it: its
        seals then fail, and none of its ranks returns from the first call."""
        first = holder if self.rank == 0 else await self.read_claim(node, 0, deadline)
        if first is None:
            return  # (no rank 0 came: that group cannot form before our deadline)
        marks = GroupIds(self.name, self.size)
        marks.incarnation = first.token
        try:
            await node.put(f"clash {self.token} {node.node_id}".encode(),
                           marks.seal(self.rank), timeout=time_left(deadline), same_bytes=True)
        except ObjectExists:
            pass  # (sealed before our mark: that group had formed)

    async def seal(self, node: Any, deadline: float, limit: float) -> None:
        """The end of the first call: every rank seals its claim, unless a
        Group that lost a claim marked it first; a mark on any rank fails
        every rank. No rank seals before `_SETTLE_S` after it read every claim,
        so that a Group whose claim came a moment after ours is seen."""
        await asyncio.sleep(max(0.0, min(self.joined + _SETTLE_S, deadline) - time.monotonic()))
        ok = f"ok {self.token}".encode()
        try:
            await node.put(ok, self.ids.seal(self.rank), timeout=time_left(deadline),
                           same_bytes=True)
        except ObjectExists:
            pass  # (marked: read below, as every rank does)
        seals = await collect(node, [self.ids.seal(r) for r in range(self.size)], deadline,
                               lambda r, raw: bytes(raw).decode(errors="replace"))
        missing = [r for r in range(self.size) if r not in seals]
        if missing:
            raise Timeout(f"Group {self.name!r} call 0: {ranks_text(missing)} did not finish the "
                          f"call within {limit:g}s")
        clashes = sorted(r for r, s in seals.items() if s != f"ok {self.members[r]}")
        if clashes:
            nodes = sorted({seals[r].split()[-1] for r in clashes if seals[r].startswith("clash")})
            raise GroupConflict(
                f"Group {self.name!r} call 0: other Group objects claimed {ranks_text(clashes)} at "
                f"the same moment{' (node ' + ', '.join(nodes) + ')' if nodes else ''}: two "
                "groups formed under one name at once, so neither is used; give each its own "
                "name")

    async def await_freed(self, node: Any, k: int, deadline: float, limit: float) -> None:
        """A close of rank r > 0: return once rank 0 has freed our close
        descriptor, and with it every object of the group (it is dropped here)."""
        mine = self.ids.descriptor(k, self.rank)
        while node.store.get(mine) is not None:
            if time.monotonic() >= deadline:
                raise Timeout(f"{self.label(k, 'close')}: rank 0 did not free the group's "
                              f"objects within {limit:g}s (it did not close, or failed to)")
            await asyncio.sleep(0.005)
