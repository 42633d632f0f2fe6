"""Objects: what the directory knows of each object and who holds it.

Owns the entries (size, layout, holders, waiters), the gets asked before a
put, the node -> objects index a node's loss visits, and the ids removed
lately (`gone`). Who serves whom is the sender choice's (`senders.Senders`);
whether a reduce makes, needs or finished an object, the reduces part's
(`reduces.Reduces`): both are asked through their methods.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any

from hoplite_gpu import messages as m

from .commands import Command, Drop, Reply, error_body
from .entry import EDGES_KEPT, Entry, Holder, Waiters
from .events import (
    Completed,
    DeleteMany,
    Dropped,
    Evict,
    Key,
    Locate,
    NodeId,
    PathTaken,
    Progress,
    Put,
    TransferFailed,
)
from .holdings import Holdings
from .leases import Leases
from .requests import Requests

if TYPE_CHECKING:
    from .reduces import Reduces
    from .senders import Senders

#: Removed ids a directory remembers (see `Objects.gone`): a collective's
#: delete names up to N^2 + 4N + 2 ids (a sliced allreduce of N ranks), 4,354 at
#: N = 64, and several such deletes must fit.
_GONE_KEPT = 1 << 16


def _lost_reason(oid: Key) -> str:
    return (f"object {oid.hex()} was lost: every node holding a complete copy (or still "
            "putting it) died, left or dropped it (an object lives only as long as a "
            "process that holds it); put it again")


def _held(entry: Entry, node: NodeId) -> bool:
    """Does `node` hold or pull this pulled object already (see `Locate.direct`)?"""
    return entry.inline is None and node in entry.holders


def _held_body(entry: Entry) -> m.Location:
    return m.Location(size=entry.size, layout=entry.layout, held=True)


class Objects:
    """The objects' entries and the indexes kept in step with them."""

    def __init__(self, leases: Leases, requests: Requests) -> None:
        #: the live nodes (`Leases.nodes`, read here, written there only)
        self._nodes = leases.nodes
        self._requests = requests
        self._senders: Senders
        self._reduces: Reduces
        self.objects: dict[Key, Entry] = {}
        #: Locates for objects nobody has put yet, in arrival order.
        self.pending: dict[Key, Waiters] = {}
        #: node -> ids whose entry names it as a holder or in its relay
        self.holdings = Holdings()
        self._holding = self.holdings.holding
        #: ids whose entry this directory removed (deleted, lost, a reduce
        #: restarted or failed), most recent last, at most `_GONE_KEPT`: a
        #: completion announced for one crossed that removal and is stale.
        #: The value says whether it was lost (every holder died or dropped
        #: it): then a putter's own copy, announced again by a node that was
        #: declared dead and came back, brings the object back.
        self.gone: OrderedDict[Key, bool] = OrderedDict()

    def bind(self, senders: Senders, reduces: Reduces) -> None:
        """The parts this one asks (they ask this one too, so they come after)."""
        self._senders, self._reduces = senders, reduces

    # ------------------------------------------------------------ puts ---
    def put(self, ev: Put, out: list[Command]) -> None:
        entry = self.objects.get(ev.oid)
        refused = self._refused_put(ev, entry)
        if refused:
            out.append(Reply(ev.node, ev.request, error_body("ObjectExists", refused)))
            return
        if self._reduces.making(ev.oid):
            if entry is not None:
                out.append(Reply(ev.node, ev.request, error_body(
                    "ObjectExists", f"a reduce is making object {ev.oid.hex()}; objects are "
                    "immutable: use a new ObjectID")))
                return
            self._reduces.supersede(ev.oid, out)  # (a restarted directory: see there)
        if entry is None:
            entry = self.objects[ev.oid] = Entry(ev.size, ev.layout, ev.inline)
        if entry.fingerprint is None:
            entry.fingerprint = ev.fingerprint
        complete = ev.inline is not None or ev.size == 0
        holder = entry.holders.get(ev.node)
        if holder is None:
            self.new_holder(ev.oid, entry, ev.node, Holder(nbytes=ev.size if complete else 0,
                                                           complete=complete, origin=True))
        else:  # a re-put by a current holder keeps its links (slots it serves, its upstream)
            holder.origin = True
            if complete:
                holder.complete, holder.nbytes = True, ev.size
                entry.ranked(ev.node)
        if entry.stripes is not None:  # (it makes every stripe's bytes: it may send any)
            entry.stripes.add_root(ev.node)
        out.append(Reply(ev.node, ev.request, m.Done(ok=True)))
        waiters = self.pending.pop(ev.oid, ())
        entry.waiting.extend(waiters)
        self._senders.serve_waiting(ev.oid, entry, out)
        if complete:
            self._reduces.input_ready(ev.oid, ev.node, out)

    @staticmethod
    def _refused_put(ev: Put, entry: Entry | None) -> str | None:
        """Why a put of an id known already is refused (None: it is a copy)."""
        if entry is None:
            return None
        if entry.size != ev.size or entry.layout != ev.layout:
            return (f"object {ev.oid.hex()} already exists with {entry.size} bytes and layout "
                    f"{entry.layout}; this put has {ev.size} bytes and layout {ev.layout}. "
                    "Objects are immutable: use a new ObjectID.")
        if ((ev.inline is not None and entry.inline is not None and ev.inline != entry.inline)
                or (ev.fingerprint and entry.fingerprint and ev.fingerprint != entry.fingerprint)):
            # Another put of the id with other bytes (a retried task whose
            # output is not deterministic, two writers of one name). The same
            # bytes again are a further copy; other bytes would let a reader
            # that fails over between the two resume mid-object and return a
            # mix of both.
            first = next((n for n, h in entry.holders.items() if h.origin), None)
            return (f"object {ev.oid.hex()} was already put with other bytes"
                    + (f" (by node {first})" if first else "")
                    + "; objects are immutable: use a new ObjectID (or delete it first)")
        return None

    def progress(self, ev: Progress, out: list[Command]) -> None:
        holder = self.holder(ev.oid, ev.node)
        if holder is not None and not holder.complete:
            entry = self.objects[ev.oid]
            before = holder.nbytes
            holder.nbytes = max(holder.nbytes, min(ev.nbytes, entry.size))
            if holder.nbytes > before and entry.waiting:
                # it may now be ahead of a waiting receiver that refused it before
                self._senders.serve_waiting(ev.oid, entry, out)

    def completed(self, ev: Completed, out: list[Command]) -> None:
        entry = self.objects.get(ev.oid)
        if (entry is None and ev.size >= 0 and ev.layout is not None and ev.node in self._nodes
                and (ev.oid not in self.gone or self.gone[ev.oid])):
            entry = self._recovered(ev, out)
        if entry is not None and entry.fingerprint is None and ev.own and ev.fingerprint:
            entry.fingerprint = ev.fingerprint
        holder = self.holder(ev.oid, ev.node)
        if (holder is None and entry is not None and entry.recovered and ev.node in self._nodes
                and (ev.size, ev.layout) == (entry.size, entry.layout)
                and not self._reduces.knows(ev.oid)):
            # Another node's copy announced to a restarted directory. (Elsewhere
            # a complete from a non-holder is a pull's that crossed a delete:
            # it is ignored, or a stale copy would be served.)
            holder = self.new_holder(ev.oid, entry, ev.node, Holder(origin=ev.own))
        if entry is None or holder is None:
            self._stale_copy(ev, entry, out)
            return
        if self._reduces.stale_result(ev.oid, ev.tag):
            return  # the root of a tree since rebuilt, on this node too: not this tree's result
        holder.complete, holder.nbytes = True, entry.size
        entry.ranked(ev.node)
        entry.detach(ev.node)
        if entry.stripes is not None:
            entry.stripes.add_root(ev.node)
        self._senders.serve_waiting(ev.oid, entry, out)
        self._reduces.input_ready(ev.oid, ev.node, out)
        if holder.origin:
            self._reduces.result_complete(ev.oid, out)

    def _recovered(self, ev: Completed, out: list[Command]) -> Entry:
        """Unknown: announced to a restarted directory, whose other holders
        may announce theirs too (`recovered`). Lost: a complete copy brings
        it back (its putter's own, or a pull's whose `complete` crossed the
        loss: a holder that completed keeps its copy on a lost `drop`)."""
        recovered = self.gone.pop(ev.oid, None) is None
        entry = self.objects[ev.oid] = Entry(ev.size, ev.layout, None, recovered=recovered)
        self.new_holder(ev.oid, entry, ev.node, Holder(origin=ev.own))
        self._reduces.supersede(ev.oid, out)
        entry.waiting.extend(self.pending.pop(ev.oid, ()))
        return entry

    def _stale_copy(self, ev: Completed, entry: Entry | None, out: list[Command]) -> None:
        """A completion from a node that is no holder (a full announcement of
        a live object from a non-holder: a node declared dead that came back,
        whose copy the directory forgot)."""
        if (ev.oid in self.gone or (entry is not None and ev.size >= 0)) and ev.node in self._nodes:
            # A copy that crossed the removal (a pull completing as the id
            # was deleted, a node declared dead while it held it) must go,
            # or that node would keep serving it to its own gets. `retry`:
            # a get it started since asks again instead of failing.
            out.append(Drop(ev.node, ev.oid, f"object {ev.oid.hex()} was removed "
                            "while this copy was made", retry=True))

    # ------------------------------------------------------------ gets ---
    def locate(self, ev: Locate, out: list[Command]) -> None:
        entry = self.objects.get(ev.oid)
        if entry is None and (failure := self._reduces.failure(ev.oid)) is not None:
            out.append(Reply(ev.node, ev.request, error_body("ReduceFailed", failure)))
            return
        if entry is None and self.gone.get(ev.oid):
            # Lost, not deleted: a get asked after the loss is told so too,
            # at once, as the gets waiting then were, instead of waiting out
            # its deadline for a put (e.g. the put's process exited: a Ray
            # task's worker). A put of the id again makes it available.
            out.append(Reply(ev.node, ev.request, error_body("ObjectNotFound", _lost_reason(ev.oid))))
            return
        if ev.direct:
            if entry is not None and _held(entry, ev.node):
                out.append(Reply(ev.node, ev.request, _held_body(entry)))
                return
            self._requests.direct.add((ev.node, ev.request))
        self._requests.wait(ev.node, ev.request, "oid", ev.oid)
        if entry is None:
            self.pending.setdefault(ev.oid, Waiters()).append((ev.node, ev.request))
            return
        senders = self._senders
        if (entry.waiting and ev.node in entry.relay_at and entry.inline is None
                and senders.settings.max_receivers_per_sender > 0):
            senders.serve_relay_arrival(ev.oid, entry, ev.node, ev.request, out)
            return
        if not entry.waiting:  # (the common case: nobody else waits; queued only if it must)
            if not senders.serve_one(ev.oid, entry, ev.node, ev.request, out):
                entry.waiting.append((ev.node, ev.request))
            return
        entry.waiting.append((ev.node, ev.request))
        senders.serve_waiting(ev.oid, entry, out)

    def unqueue(self, request: tuple[NodeId, int], key: Any) -> None:
        """Take `request` out of the queues of id `key`: a get waits no more."""
        queue, entry = self.pending.get(key), self.objects.get(key)
        if queue is not None:
            queue.discard(request)
            if not queue:
                del self.pending[key]
        if entry is not None:
            entry.waiting.discard(request)

    def transfer_failed(self, ev: TransferFailed, out: list[Command]) -> None:
        entry = self.objects.get(ev.oid)
        holder = self.holder(ev.oid, ev.node)
        if entry is None or holder is None:
            return
        holder.nbytes = max(holder.nbytes, min(ev.have, entry.size))
        holder.failed_from.add(ev.sender)
        if entry.stripes is not None and ev.node in entry.stripes.up:
            entry.stripes.fail(ev.node, ev.sender)  # (its stripes from that sender move)
        elif holder.several:  # one of several senders: the pull goes on with the others
            entry.lose_source(ev.node, ev.sender)
        else:
            entry.detach(ev.node)
        self._senders.serve_waiting(ev.oid, entry, out)

    # ---------------------------------------------------- copies going ---
    def dropped(self, ev: Dropped, out: list[Command]) -> None:
        entry = self.objects.get(ev.oid)
        if entry is not None and ev.node in entry.holders:
            self.forget_holder(ev.oid, entry, ev.node)
            self.after_loss(ev.oid, entry, out)
            self._reduces.slot_lost(ev.oid, ev.node,
                                    f"node {ev.node} dropped input {ev.oid.hex()}", out)
        entry = self.objects.get(ev.oid)
        if entry is not None and ev.node in entry.relay_at:
            # It gave its copy up (its call ended, or it gave up on the
            # object): the next node of the relay, which waits for this one
            # alone, waits no more, as if this one had died.
            entry.set_relay(n for n in entry.relay if n != ev.node)
            if entry.waiting:
                self._senders.serve_waiting(ev.oid, entry, out)

    def evict(self, ev: Evict, out: list[Command]) -> None:
        chosen: list[tuple[Key, Entry]] = []
        room = 0
        for oid in dict.fromkeys(ev.oids):
            if ev.need and room >= ev.need:
                break
            entry = self.objects.get(oid)
            # (a copy this node no longer holds, evicted for another call,
            # makes no room)
            if (entry is not None and (ev.node in entry.holders or entry.inline is not None)
                    and self._may_evict(oid, entry, ev.node)):
                chosen.append((oid, entry))
                room += entry.size
        if room < ev.need:
            chosen = []  # not enough: keep them all
        for oid, entry in chosen:
            if ev.node in entry.holders:
                self.forget_holder(oid, entry, ev.node)
        out.append(Reply(ev.node, ev.request, m.Evicted(evicted=[oid for oid, _ in chosen])))

    def _may_evict(self, oid: Key, entry: Entry, node: NodeId) -> bool:
        holder = entry.holders.get(node)
        if holder is not None and (holder.origin or not holder.complete or holder.serving):
            return False
        if entry.relay_at.get(node, len(entry.relay)) < len(entry.relay) - 1:
            # the next node of a relay waits for this one alone while it lives
            after = entry.relay[entry.relay_at[node] + 1]
            if after in self._nodes and not (after in entry.holders
                                             and entry.holders[after].complete):
                return False
        if self._reduces.needs_input(oid):
            return False
        return entry.inline is not None or any(
            h.complete and n != node and n in self._nodes for n, h in entry.holders.items())

    def delete_many(self, ev: DeleteMany, out: list[Command], one: bool = False) -> None:
        at = len(out)  # (the answer goes first, before what the deletes tell others)
        existed = [self._delete(ev.node, oid, out) for oid in ev.oids]
        out.insert(at, Reply(ev.node, ev.request, m.Done(
            ok=True, existed=existed[0] if one else existed)))

    def _delete(self, by: NodeId, oid: Key, out: list[Command]) -> bool:
        """Remove `oid` for node `by`; whether it existed."""
        entry = self.remove_entry(oid)
        self._reduces.deleted(oid, out)
        if entry is None:
            return False
        reason = f"object {oid.hex()} was deleted"
        for node in list(entry.holders):  # (an input of a reduce under way: rebuilt without it)
            self._reduces.slot_lost(oid, node, reason, out)
        # A recovered object may have copies that were never announced (their
        # nodes' announcements are still on the way): every node hears.
        for node in (self._nodes if entry.recovered else entry.holders):
            # The deleting node drops its own copy when the reply comes; a drop
            # arriving after that reply could cancel a get it started since.
            if node != by:
                out.append(Drop(node, oid, reason))
        for node, request in entry.waiting:
            out.append(Reply(node, request, error_body("ObjectNotFound", reason)))
        return True

    def describe(self, oid: Key) -> m.Description | m.Failure:
        entry = self.objects.get(oid)
        if entry is None:
            return error_body("ObjectNotFound", f"object {oid.hex()} is not known to the directory")
        striping = self._senders.striping
        holders = [
            m.HolderInfo(node=n, address=self._nodes.get(n, ""), nbytes=h.nbytes,
                         complete=h.complete, origin=h.origin, upstream=h.upstream,
                         serving=sorted(h.serving),
                         stripes=[] if entry.stripes is None else striping.stripes_of(entry, n))
            for n, h in entry.holders.items()
        ]
        paths = [m.PathInfo(receiver=r, sender=s, address=a, local=here, path=p)
                 for r, s, a, here, p in entry.paths or ()]
        return m.Description(size=entry.size, layout=entry.layout,
                             inline=entry.inline is not None, holders=holders,
                             edges=[list(e) for e in entry.edges], waiting=len(entry.waiting),
                             paths=paths)

    def path_taken(self, ev: PathTaken, out: list[Command]) -> None:
        """A holder's pull runs a connection on a rail or path, or a pull of
        a step of the reduce making the object (a step's node): kept (the
        latest EDGES_KEPT of them) for `describe`."""
        entry = self.objects.get(ev.oid)
        if entry is None or not (ev.node in entry.holders
                                 or self._reduces.steps_on(ev.oid, ev.node)):
            return
        if entry.paths is None:
            entry.paths = deque(maxlen=EDGES_KEPT)
        entry.paths.append((ev.node, ev.sender, ev.address, ev.local, ev.path))

    def node_lost(self, node: NodeId, out: list[Command]) -> None:
        """`node` is gone (its requests were unqueued already): its copies go,
        and objects no live copy is left of are lost."""
        visited = self.holdings.take(node)
        for key in visited:
            entry = self.objects.get(key)
            if entry is None:
                continue  # (removed meanwhile, by what an earlier key set off)
            if node in entry.holders:
                self.forget_holder(key, entry, node)
                self.after_loss(key, entry, out)
            elif node in entry.relay_at and entry.waiting:
                # the next node of a relay waited for this one alone: it may
                # now pull from any holder
                self._senders.serve_waiting(key, entry, out)
        for key in visited:
            # Still in those relays: the node may come back (a lease missed)
            # and leave again, and its successor must hear of that too.
            entry = self.objects.get(key)
            if entry is not None and node in entry.relay_at:
                self.holdings.add(node, key)

    # ---------------------------------------------------- reduce results ---
    def known(self, oid: Key) -> bool:
        return oid in self.objects

    def removed(self, oid: Key) -> bool:
        """Whether this directory removed `oid` lately (see `gone`)."""
        return oid in self.gone

    def entry(self, oid: Key) -> Entry:
        return self.objects[oid]

    def ready_holder(self, oid: Key) -> NodeId | None:
        """A live node with a complete copy of `oid` ("" for inline bytes),
        its putter first; None if there is none yet."""
        entry = self.objects.get(oid)
        if entry is None:
            return None
        if entry.inline is not None:
            return ""
        complete = [n for n, h in entry.holders.items() if h.complete and n in self._nodes]
        origins = [n for n in complete if entry.holders[n].origin]
        return (origins or complete or [None])[0]

    def add_inline(self, oid: Key, size: int, layout: dict[str, Any], data: bytes) -> None:
        """An inline reduce's result exists (its waiters are served by `serve_pending`)."""
        self.objects[oid] = Entry(size, layout, data)

    def serve_pending(self, oid: Key, out: list[Command]) -> None:
        """Gets asked before `oid` existed wait on its entry now, and are served."""
        entry = self.objects[oid]
        entry.waiting.extend(self.pending.pop(oid, ()))
        self._senders.serve_waiting(oid, entry, out)

    def register_result(self, oid: Key, size: int, layout: dict[str, Any], node: NodeId,
                        relay: tuple[NodeId, ...] | None, out: list[Command]) -> None:
        """A reduce's root step on `node` makes `oid`: readable (pipelined)
        while it is reduced, relayed along `relay` if given."""
        old = self.objects.get(oid)  # (none: a put or announcement supersedes the task)
        entry = self.objects[oid] = Entry(size, layout, None)
        if old is not None:
            entry.waiting.extend(old.waiting)
            self.holdings.unhold(oid, old)
        if relay is not None:
            entry.set_relay(relay)
            for member in entry.relay:
                self.holdings.add(member, oid)
        self.new_holder(oid, entry, node, Holder(origin=True))
        self.serve_pending(oid, out)

    def withdraw(self, oid: Key, reason: str, out: list[Command]) -> None:
        """A reduce restarts: its result's copies go (told to retry), and its
        readers wait for the result of the new tree."""
        entry = self.remove_entry(oid)
        if entry is not None:
            for node in entry.holders:
                out.append(Drop(node, oid, reason, retry=True))
            if entry.waiting:
                self.pending.setdefault(oid, Waiters()).extend(entry.waiting)

    def fail_result(self, oid: Key, message: str, kind: str, out: list[Command]) -> None:
        """A reduce failed: its result's copies go, and its readers hear why."""
        for node, request in self.pending.pop(oid, ()):
            out.append(Reply(node, request, error_body(kind, message)))
        entry = self.remove_entry(oid)
        if entry is not None:
            for node in entry.holders:
                out.append(Drop(node, oid, message, kind=kind))
            for node, request in entry.waiting:
                out.append(Reply(node, request, error_body(kind, message)))

    # --------------------------------------------------------- holders ---
    def holder(self, oid: Key, node: NodeId) -> Holder | None:
        entry = self.objects.get(oid)
        return None if entry is None else entry.holders.get(node)

    def forget_holder(self, oid: Key, entry: Entry, node: NodeId) -> None:
        entry.detach(node)
        if entry.stripes is not None:  # (its receivers lack its stripes: `settle` mends)
            entry.stripes.remove(node)
        gone = entry.holders.pop(node)
        entry.close(node)
        entry.epoch += 1
        if node not in entry.relay_at:
            self.holdings.let_go(node, oid)
        for receiver in gone.serving:
            if receiver in entry.holders:
                entry.lose_source(receiver, node)
        if any(receiver == node for receiver, _ in entry.edges):  # (its pulls are history now)
            entry.edges = deque((e for e in entry.edges if e[0] != node), maxlen=EDGES_KEPT)
        if entry.paths and any(p[0] == node for p in entry.paths):
            entry.paths = deque((p for p in entry.paths if p[0] != node), maxlen=EDGES_KEPT)

    def after_loss(self, oid: Key, entry: Entry, out: list[Command]) -> None:
        """If no holder can ever complete any more, the object is lost: say so to everyone."""
        if entry.inline is not None:
            return
        if any(h.complete or h.origin for h in entry.holders.values()):
            self._senders.serve_waiting(oid, entry, out)
            return
        if self._reduces.making(oid):
            return  # the result of a reduce in flight: the reduce restarts and rebuilds it
        if self._reduces.remake(oid, out):
            return  # a finished reduce's result: made again from its inputs
        self.remove_entry(oid, lost=True)
        reason = _lost_reason(oid)
        for node in entry.holders:
            out.append(Drop(node, oid, reason, lost=True))
        for node, request in entry.waiting:
            out.append(Reply(node, request, error_body("ObjectNotFound", reason)))

    def remove_entry(self, oid: Key, lost: bool = False) -> Entry | None:
        self.gone[oid] = lost
        self.gone.move_to_end(oid)
        if len(self.gone) > _GONE_KEPT:
            self.gone.popitem(last=False)
        entry = self.objects.pop(oid, None)
        if entry is not None:
            self.holdings.unhold(oid, entry)
        return entry

    def new_holder(self, oid: Key, entry: Entry, node: NodeId, holder: Holder) -> Holder:
        entry.joined += 1
        holder.seq = entry.joined
        entry.holders[node] = holder
        entry.reopen(node)
        mine = self._holding.get(node)  # (`holdings.add`, inline: once per holder of every object)
        if mine is None:
            mine = self._holding[node] = {}
        mine[oid] = None
        return holder
