"""Sender choice: which holder a receiver pulls from, and serving the gets
that wait for one.

Broadcast is receiver-driven, as in the Hoplite paper: a receiver asks where
to pull an object from; the directory prefers a complete copy, else a partial
one, registers the receiver as a partial holder at once (so the next receiver
can pipeline from it), and lets each holder serve a bounded number of
receivers. A receiver is never sent to a holder that pulls from it, directly
or transitively, so failover can never create a cycle.

This part keeps no table of its own: it works on the entry it is given (the
objects part's), and asks the objects part to record a new holder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hoplite_gpu import messages as m

from .commands import Command, PushLocated, Reply
from .entry import Entry, Holder
from .events import Key, NodeId
from .leases import Leases
from .objects import _held, _held_body
from .racks import Racks
from .reduce_plan import broadcast_fanout
from .requests import Requests
from .settings import Settings
from .stripes import Striping

if TYPE_CHECKING:
    from .objects import Objects
    from .reduce_task import ReduceTask
    from .reduces import Reduces


class Senders:
    """Chooses senders and answers the gets waiting on an object."""

    def __init__(self, settings: Settings, leases: Leases, requests: Requests,
                 objects: Objects, scan_only: bool = False) -> None:
        self.settings = settings
        #: the live nodes (`Leases.nodes`, read here, written there only)
        self._nodes = leases.nodes
        #: the addresses of nodes with several (`Leases.rails_of`)
        self.rails_of = leases.rails_of
        #: the direct locates (`Requests.direct`, read here)
        self._direct = requests.direct
        self._objects = objects
        #: striped objects' senders
        self.striping = Striping(settings, leases, objects)
        #: the nodes' racks: a sender in the receiver's rack first
        self.racks = Racks(settings, leases, objects)
        self._tasks: dict[Key, ReduceTask]
        #: Pick every sender by the scan of `Entry.open` alone, never by the
        #: earliest open complete copy (`Entry.senders`): the reference that
        #: tests/test_sender_choice.py holds the fast choice to.
        self._scan_only = scan_only

    def bind(self, reduces: Reduces) -> None:
        #: the reduce tasks (`Reduces.reduces`, read here, written there only:
        #: a get of a tree's result is told the tree's tag)
        self._tasks = reduces.reduces

    # ------------------------------------------------------------ serving ---
    def serve_waiting(self, oid: Key, entry: Entry, out: list[Command]) -> None:
        """Hand senders to waiting receivers, oldest first, while any sender is free.

        Each assignment creates a new partial holder that an earlier waiter may
        pull from, so passes repeat until one assigns nobody. (A striped
        object's receivers that lack a sender of some stripe get one first.)
        """
        if entry.stripes is not None:
            self.striping.settle(oid, entry, out)
        progress = True
        while progress and entry.waiting:
            progress = False
            for node, request in list(entry.waiting):  # (the ones served leave it)
                if self.serve_one(oid, entry, node, request, out):
                    entry.waiting.discard((node, request))
                    progress = True

    def serve_one(self, oid: Key, entry: Entry, node: NodeId, request: int,
                  out: list[Command]) -> bool:
        """Answer one waiting request if a sender (or the bytes) can be had
        now; False if it must wait on. The caller keeps the queue."""
        if (node, request) in self._direct and _held(entry, node):
            out.append(Reply(node, request, _held_body(entry)))
            return True
        # (a direct call's thread keeps no copy of inline bytes: it
        # is no holder, or a later drop would be mistaken for newer
        # than the node's next put of the id)
        body = self.assign(oid, entry, node, record=(node, request) not in self._direct, out=out)
        if body is None:
            return False
        if (node, request) in self._direct and body.inline is None:
            out.append(PushLocated(node, oid, m.Located(
                oid=oid, size=body.size, layout=body.layout, reduce_tag=body.reduce_tag,
                local=body.local, sender=body.sender, address=body.address, also=body.also,
                stripes=body.stripes, seq=body.seq, piece=body.piece, rails=body.rails)))
            body = m.Location(size=entry.size, layout=entry.layout, pushed=True)
        out.append(Reply(node, request, body))
        return True

    def serve_relay_arrival(self, oid: Key, entry: Entry, node: NodeId, request: int,
                            out: list[Command]) -> None:
        """A get of a relayed result from a node of the relay, while others
        wait. Its arrival changes no holder, so no one else can be served
        now but through it: serve it if its node's predecessor can, then the
        next node of the relay if it waits, and so on. (A pass over every
        waiter per get cost a slice of an allreduce of N ranks O(N^2); the
        others are still checked at every progress and completion.)"""
        entry.waiting.append((node, request))
        while True:
            served = False
            for req in entry.waiting.of_node(node):
                if self.serve_one(oid, entry, node, req, out):
                    entry.waiting.discard((node, req))
                    served = True
            at = entry.relay_at.get(node, len(entry.relay))
            if not served or at + 1 >= len(entry.relay):
                return
            node = entry.relay[at + 1]

    def assign(self, oid: Key, entry: Entry, receiver: NodeId, record: bool = True,
               out: list[Command] | None = None) -> m.Location | None:
        """`receiver`'s answer to a locate of `oid` (None: it waits). Pushes
        the assignment makes (a striped object's receivers moved, or a
        receiver of another rack moved below this one: racks.py) go to `out`."""
        task = self._tasks.get(oid)
        reducing = task is not None and not (task.done or task.failed or task.inline)
        tag = task.tag if reducing else None  # (confirm the copy before handing it out)
        mine = entry.holders.get(receiver)
        if entry.inline is not None:
            if record and receiver not in entry.holders:
                self._objects.new_holder(oid, entry, receiver,
                                         Holder(nbytes=entry.size, complete=True))
            return m.Location(size=entry.size, layout=entry.layout, reduce_tag=tag,
                              inline=entry.inline)
        if mine is not None and mine.complete:
            return m.Location(size=entry.size, layout=entry.layout, reduce_tag=tag, local=True)
        if mine is not None and mine.origin and reducing:
            # The reduce's root step runs on this node and makes the result
            # here: pulling it as well would only move its bytes twice.
            return None
        if entry.size == 0:
            self._objects.new_holder(oid, entry, receiver, Holder(complete=True))
            return m.Location(size=entry.size, layout=entry.layout, reduce_tag=tag, local=True)
        if entry.stripes is None and (k := self.striping.wanted(entry, reducing)):
            self.striping.start(oid, entry, k, [] if out is None else out)
        if entry.stripes is not None:
            if mine is not None and mine.origin:
                return None  # (its put makes the bytes here: its own completion answers it)
            return self.striping.assign(oid, entry, receiver, tag, [] if out is None else out)
        if mine is not None and mine.upstream is not None:
            entry.detach(receiver)  # asked again while pulling: free the old slot
        sender = self.pick_sender(entry, receiver)
        moved = self._rack_move(oid, entry, receiver, sender, mine, tag, out)
        if moved is not None:
            return moved
        if sender is None:
            return None
        if mine is None:
            mine = self._objects.new_holder(oid, entry, receiver, Holder())
        mine.upstream = sender
        entry.holders[sender].serving.add(receiver)
        entry.edges.append((receiver, sender))
        # (the check of `more_sources`, inline: once per assignment)
        also = (self.more_sources(entry, receiver, sender)
                if entry.size >= self.settings.multi_source_bytes else None)
        if not also:
            mine.also, mine.several = (), False
            return m.Location(size=entry.size, layout=entry.layout, reduce_tag=tag,
                              sender=sender, address=self._nodes[sender], seq=entry.moves,
                              rails=self.rails_of((sender,)))
        for node in also:
            entry.holders[node].serving.add(receiver)
            entry.edges.append((receiver, node))
        mine.also, mine.several = tuple(also), True
        return m.Location(size=entry.size, layout=entry.layout, reduce_tag=tag, sender=sender,
                          address=self._nodes[sender],
                          also=[m.Source(sender=n, address=self._nodes[n]) for n in also],
                          seq=entry.moves, rails=self.rails_of((sender, *also)))

    def _rack_move(self, oid: Key, entry: Entry, receiver: NodeId, sender: NodeId | None,
                   mine: Holder | None, tag: bytes | None,
                   out: list[Command] | None) -> m.Location | None:
        """Where `sender` sits in another rack than `receiver` (or there is
        none): `receiver` in the place of a fresh receiver of another rack
        below a holder of its own (racks.py). None: no rack, or no such move."""
        rack = self.racks.of(receiver)
        if (rack is None or (sender is not None and self.racks.of(sender) == rack)
                or entry.relay or (mine is not None and (mine.serving or mine.origin))):
            return None
        place = self.racks.displaced(entry, receiver, lambda node: self.may_serve(
            entry, node, receiver, mine, True))
        return None if place is None else self.racks.take_place(
            oid, entry, receiver, *place, tag, [] if out is None else out)

    def more_sources(self, entry: Entry, receiver: NodeId, sender: NodeId) -> list[NodeId]:
        """Other senders for a pull from `sender`, when the object is large
        (`multi_source_bytes`) and `sender` a complete copy: complete copies
        that serve nobody (so no other pull is slowed), up to `max_sources`
        in all, the earliest first. Complete copies pull from nobody, so no
        cycle can come of them. A scan of at most a few times that many of
        the open complete copies: a hot object's many idle copies cost no
        more than that per receiver."""
        settings = self.settings
        want = settings.max_sources - 1
        if (want < 1 or entry.size < settings.multi_source_bytes
                or not entry.holders[sender].complete):
            return []
        mine, nodes = entry.holders[receiver], self._nodes
        found: list[NodeId] = []
        for _, node in sorted(entry.senders.items[:4 * want + 4]):
            holder = entry.holders[node]
            if (node != sender and node != receiver and node in nodes and not holder.serving
                    and node not in mine.failed_from):
                found.append(node)
                if len(found) == want:
                    break
        return found

    # ------------------------------------------------------------- choice ---
    def fanout(self, entry: Entry) -> int:
        """Receivers one holder may serve at once: the configured number, or
        with 0 ("auto") the cost model's choice for the receivers seen so far."""
        settings = self.settings
        if settings.max_receivers_per_sender > 0:
            return settings.max_receivers_per_sender
        receivers = len(entry.holders) + len(entry.waiting)
        return broadcast_fanout(entry.size, receivers, settings.latency_s, settings.bytes_per_s,
                                settings.chunk_size)

    def pick_sender(self, entry: Entry, receiver: NodeId) -> NodeId | None:
        choice = self.best_sender(entry, receiver, avoid_failed=True)
        mine = entry.holders.get(receiver)
        if choice is None and mine is not None and mine.failed_from:
            # Only senders that failed us before are left. A stall may have been
            # passing, and one that is truly dead is removed when its lease ends:
            # try them again rather than wait for nothing.
            choice = self.best_sender(entry, receiver, avoid_failed=False)
            if choice is not None:
                mine.failed_from.discard(choice)
        return choice

    def best_sender(self, entry: Entry, receiver: NodeId, avoid_failed: bool) -> NodeId | None:
        mine = entry.holders.get(receiver)
        have = mine.nbytes if mine else 0
        # (nobody can pull from a receiver that serves nobody, even through others)
        served = mine is not None and bool(mine.serving)
        if entry.relay_at.get(receiver, 0) > 0:
            before = entry.relay[entry.relay_at[receiver] - 1]
            if before in self._nodes and not (avoid_failed and mine is not None
                                              and before in mine.failed_from):
                # The node before this one in the relay serves it, and only it:
                # wait until that node holds (or pulls) the result, as it will.
                holder = entry.holders.get(before)
                if (holder is None or not (holder.complete or self.can_complete(entry, before))
                        or (served and self.depends_on(entry, before, receiver))):
                    return None
                if holder.complete or holder.origin or holder.nbytes >= have:
                    return before
            # that node is gone, failed us, or is behind us: any other holder
        fanout = self.fanout(entry)
        if fanout > entry.open_fanout:  # (holders found full before may have room now)
            entry.reopen_all()
        entry.open_fanout = fanout
        rack = self.racks.of(receiver)
        if entry.senders.items and not self._scan_only:
            choice = self._earliest_copy(entry, receiver, mine, served, fanout, avoid_failed)
            if choice is not None and (rack is None or self.racks.of(choice) == rack):
                return choice
        # The scan: the best of every open holder that may serve the receiver
        # (one in its rack first, then complete, then the furthest ahead,
        # then the earliest).
        best: tuple[bool, bool, int, int] | None = None
        choice: NodeId | None = None
        racks = self.racks.racks
        for node in list(entry.open):
            holder = entry.holders.get(node)
            if holder is None or len(holder.serving) >= fanout:
                entry.close(node)  # (reopened when it frees a slot or the fanout grows)
                continue
            if not self.may_serve(entry, node, receiver, mine, avoid_failed, served):
                continue
            if not holder.complete and holder.nbytes < have and not holder.origin:
                # A partial copy behind ours helps only once it overtakes us; a
                # complete or further-ahead one is better, so wait for it.
                continue
            rank = (rack is not None and racks.get(node) == rack, holder.complete,
                    holder.nbytes, -holder.seq)
            if best is None or rank > best:
                best, choice = rank, node
        return choice

    def may_serve(self, entry: Entry, node: NodeId, receiver: NodeId, mine: Holder | None,
                  avoid_failed: bool, served: bool = False) -> bool:
        """Whether holder `node` may serve `receiver` (its holder `mine`;
        `served`: it serves others): alive, not the receiver itself nor one
        it failed on (with `avoid_failed`), able to complete, and not
        pulling from the receiver (no cycle)."""
        holder = entry.holders[node]
        return not (node == receiver or node not in self._nodes
                    or (avoid_failed and mine is not None and node in mine.failed_from)
                    or not (holder.complete or self.can_complete(entry, node))
                    or (served and self.depends_on(entry, node, receiver)))

    def _earliest_copy(self, entry: Entry, receiver: NodeId, mine: Holder | None,
                       served: bool, fanout: int, avoid_failed: bool) -> NodeId | None:
        """The earliest open complete copy, if it may serve `receiver` (None:
        the scan decides). It outranks every other candidate: where it may
        serve this receiver (the checks below, for a complete copy), it is
        the scan's choice too."""
        senders, nodes = entry.senders, self._nodes
        while senders.items:
            node = senders.first()
            holder = entry.holders[node]
            if len(holder.serving) >= fanout:
                entry.close(node)  # (as the scan would: full)
                continue
            if not (node == receiver or node not in nodes
                    or (avoid_failed and mine is not None and node in mine.failed_from)
                    or (served and self.depends_on(entry, node, receiver))):
                return node
            break  # (not for this receiver: any other may be)
        return None

    @staticmethod
    def depends_on(entry: Entry, candidate: NodeId, receiver: NodeId) -> bool:
        """True if `candidate` pulls from `receiver`, directly or through others."""
        seen: set[NodeId] = set()
        node: NodeId | None = candidate
        while node is not None and node not in seen:
            if node == receiver:
                return True
            seen.add(node)
            holder = entry.holders.get(node)
            node = holder.upstream if holder else None
        return False

    @staticmethod
    def can_complete(entry: Entry, node: NodeId) -> bool:
        """A holder can finish if it is complete, an origin, or pulls (transitively) from one."""
        seen: dict[NodeId, Holder] = {}
        cur: NodeId | None = node
        while cur is not None and cur not in seen and cur in entry.holders:
            holder = entry.holders[cur]
            if holder.complete or holder.origin or holder.anchored == entry.epoch:
                for walked in seen.values():  # (until the next break, without the walk)
                    walked.anchored = entry.epoch
                return True
            seen[cur] = holder
            cur = holder.upstream
        return False
