"""Racks: a broadcast's chain crosses a fabric's uplinks once per rack.

A node may say where it sits (`Config.rack`: the nodes under one switch, a
leaf of a leaf-spine fabric, share a label). Between racks the links are
fewer than the hosts' (an oversubscribed tier), so a chain of receivers
that crosses from rack to rack at every arrival loads them with one flow
per crossing, where one per rack would do. With racks told, a receiver's
sender is chosen:

- among the holders that may serve it (the usual rules: no cycle, the
  per-sender limit, not one it failed on), one in its own rack first
  (`Senders.best_sender` ranks them so);
- where the choice is in another rack (or there is none), in the place of
  a receiver of another rack that a holder of its own rack serves and that
  has only begun (at most `Settings.relay` bytes in): that holder serves
  the newcomer instead, and the newcomer serves the displaced receiver,
  which is told its new sender with a `restripe` push (one stripe, the
  whole object). The holder serves as many as before, the newcomer one,
  and the newcomer, which serves and pulls from nobody yet, cannot close a
  cycle. Receivers of one rack so join their rack's part of the chain, and
  the crossing moves to its end: a chain over two racks that receivers join
  alternately crosses once.

No rack told (the default): nothing here runs, every choice is as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from hoplite_gpu import messages as m

from .commands import Command, PushRestripe
from .entry import Entry, Holder
from .events import Key, NodeId
from .leases import Leases
from .settings import Settings

if TYPE_CHECKING:
    from .objects import Objects


class Racks:
    """The racks nodes said they are in (`Leases.racks`), and receivers
    moved to keep a chain within a rack."""

    def __init__(self, settings: Settings, leases: Leases, objects: Objects) -> None:
        self.settings = settings
        #: node -> its rack (`Leases.racks`, read here, written there only)
        self.racks = leases.racks
        self._nodes = leases.nodes
        self._rails_of = leases.rails_of
        self._objects = objects

    def of(self, node: NodeId) -> str | None:
        """`node`'s rack (None: it said none)."""
        return self.racks.get(node) if self.racks else None

    def displaced(self, entry: Entry, receiver: NodeId,
                  fits: Callable[[NodeId], bool]) -> tuple[NodeId, NodeId] | None:
        """(holder, its receiver) whose place `receiver` may take: a holder
        in `receiver`'s rack that `fits` (may serve it), serving a receiver
        of another rack that pulls from it alone, is no complete copy or
        origin, has at most `Settings.relay` bytes and never failed on
        `receiver`; the one with the fewest bytes, then the earliest. None
        where `receiver` has no rack or none is found."""
        racks, rack = self.racks, self.of(receiver)
        if rack is None:
            return None
        most, best = self.settings.relay, None
        for node, holder in entry.holders.items():
            if racks.get(node) != rack or not holder.serving or not fits(node):
                continue
            for child in holder.serving:
                theirs = entry.holders.get(child)
                if (theirs is None or theirs.upstream != node or theirs.several
                        or theirs.complete or theirs.origin or theirs.nbytes > most
                        or racks.get(child, rack) == rack or receiver in theirs.failed_from):
                    continue
                key = (theirs.nbytes, theirs.seq)
                if best is None or key < best[0]:
                    best = (key, node, child)
        return None if best is None else (best[1], best[2])

    def take_place(self, oid: Key, entry: Entry, receiver: NodeId, sender: NodeId,
                   moved: NodeId, tag: bytes | None, out: list[Command]) -> m.Location:
        """`receiver` pulls from `sender` in the place of `moved`, which
        pulls from `receiver` from now on (told with a push): the answer
        to `receiver`'s locate."""
        mine = entry.holders.get(receiver)
        if mine is None:
            mine = self._objects.new_holder(oid, entry, receiver, Holder())
        theirs = entry.holders[moved]
        served = entry.holders[sender].serving
        served.discard(moved)
        served.add(receiver)
        mine.upstream, mine.also, mine.several = sender, (), False
        mine.serving.add(moved)
        theirs.upstream = receiver
        entry.epoch += 1  # (a link broke: chains through it are anchored anew)
        entry.edges.append((receiver, sender))
        entry.edges.append((moved, receiver))
        entry.moves += 1
        address = self._nodes[receiver]
        out.append(PushRestripe(moved, oid, m.Restripe(
            oid=oid, stripes=[m.Stripe(start=0, end=entry.size, sender=receiver,
                                       address=address)],
            seq=entry.moves, rails=self._rails_of((receiver,)))))
        return m.Location(size=entry.size, layout=entry.layout, reduce_tag=tag, sender=sender,
                          address=self._nodes[sender], seq=entry.moves,
                          rails=self._rails_of((sender,)))
