"""Striped broadcast: a large object's bytes in `k` contiguous ranges
(stripes), each sent down a tree of its own in which a receiver relays at
most one stripe, its home, to up to `k` children, and is a leaf of the
others (SplitStream; NCCL's double binary tree for k = 2). Every uplink then
carries about S, as in a chain, while each tree is about log_k N deep where
a chain is N deep.

The trees grow as receivers arrive. A receiver is placed in every stripe at
once, or waits:

- in the stripes it is a leaf of, at the deepest free slot (a home receiver
  of that stripe with room, else a complete copy), so that the slots high in
  a tree stay for the receivers that will relay that stripe;
- in its home stripe as high as it can: at a free slot, or in the place of a
  leaf higher up, which then moves below it (SplitStream's push-down; the
  leaf's node is told its new sender with a `Restripe` push).

Its home is the stripe with the least room left, so that every stripe keeps
room for the leaves to come. Complete copies and origins serve any stripe,
`k` receiver-stripes in all. A receiver that completes becomes one; one that
leaves, or fails a receiver, has that receiver placed anew in each stripe it
served it (its bytes kept), or, with no slot free, waiting for one.

`Trees` is one object's record and its tree operations (pure); `Striping`
(the directory part) decides which objects are striped and answers their
receivers.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from hoplite_gpu import messages as m

from .commands import Command, PushRestripe
from .entry import Entry, Holder
from .events import Key, NodeId
from .leases import Leases
from .reduce_plan import STRIPE_MARGIN, STRIPES, broadcast_stripes, stripe_piece
from .settings import Settings

if TYPE_CHECKING:
    from .objects import Objects

#: may `node` send stripe `j` to `receiver`? (alive, not failed by it, ...)
Usable = Callable[[NodeId, int, NodeId], bool]


class Trees:
    """One striped object: its stripes' bounds and the tree of each."""

    def __init__(self, k: int, size: int, holders: dict[NodeId, Holder], usable: Usable) -> None:
        self.k = k
        self.bounds = tuple(size * j // k for j in range(k + 1))
        self.holders, self.usable = holders, usable
        #: placed receiver -> its home stripe, the one it relays
        self.home: dict[NodeId, int] = {}
        #: placed receiver -> its sender of each stripe (None: none now)
        self.up: dict[NodeId, list[NodeId | None]] = {}
        #: node -> its receivers of each stripe
        self.kids: dict[NodeId, list[dict[NodeId, None]]] = {}
        #: placed receiver -> its depth in each stripe when placed (hops below
        #: a complete copy; only the choice of later slots reads it)
        self.depth: dict[NodeId, list[int]] = {}
        #: complete copies and origins: they serve any stripe, `k` in all
        self.roots: dict[NodeId, None] = {}
        #: placed receivers with no sender of these stripes now
        self.orphans: dict[NodeId, set[int]] = {}
        #: receivers that heard their senders: a change is pushed to them
        self.told: set[NodeId] = set()
        #: receivers whose senders changed since `take_moved` last read them
        self.moved: set[NodeId] = set()
        #: (receiver, sender) links made since `Striping.settle` recorded them
        self.linked: list[tuple[NodeId, NodeId]] = []
        #: numbers the assignments: moves on with every link made or undone
        self.seq = 0
        #: what a level of depth costs (a hop's fill), and a byte a moved
        #: leaf must get again: the choice of a relay's place weighs them
        self.hop_s, self.byte_s = 1.0, 0.0
        #: senders that failed a receiver may be chosen for it again (`mend`)
        self.lenient = False
        #: (receiver, stripe) -> times it was pushed down in that stripe
        #: (`_moving_cost`)
        self.pushed: dict[tuple[NodeId, int], int] = {}
        #: free room of the home receivers of each stripe, and of the roots
        self.room_in = [0] * k
        self.root_room = 0
        #: placed receivers whose home each stripe is
        self.homes = [0] * k
        #: per stripe, where a home receiver could go: (its depth there, a
        #: leaf's place?, rank, node): free slots and leaves to push down
        self._high: list[list[tuple[int, bool, int, NodeId]]] = [[] for _ in range(k)]
        #: per stripe, free slots of home receivers, deepest (then newest) first
        self._low: list[list[tuple[int, int, NodeId]]] = [[] for _ in range(k)]
        #: roots with room, earliest first
        self._free_roots: list[tuple[int, NodeId]] = []
        self._rank: dict[NodeId, int] = {}
        self._ranks = itertools.count()
        # (the heaps are lazy: an entry is checked when it comes up, and one
        # that no longer holds is dropped; a node is offered again whenever
        # its room or place changes)

    # ------------------------------------------------------------ reading ---
    def room(self, node: NodeId, j: int) -> int:
        """Receivers `node` may still take in stripe `j`."""
        if node in self.roots:
            return self.k - self.load(node)
        if self.home.get(node) == j:
            return self.k - len(self.kids[node][j])
        return 0

    def load(self, node: NodeId) -> int:
        return sum(map(len, self.kids.get(node, ())))

    def level(self, node: NodeId, j: int) -> int:
        return 0 if node in self.roots else self.depth[node][j]

    def is_leaf(self, node: NodeId, j: int) -> bool:
        """Does `node` hold a slot in stripe `j` as a leaf (a place a home
        receiver of `j` may take)?"""
        return (node in self.up and self.home[node] != j and self.up[node][j] is not None
                and not self.kids[node][j])

    def anchored(self, node: NodeId, j: int) -> bool:
        """Does stripe `j` reach `node` from a root (a complete copy)?"""
        for _ in range(len(self.up) + 1):
            if node in self.roots:
                return True
            parent = self.up[node][j] if node in self.up else None
            if parent is None:
                return False
            node = parent
        raise AssertionError(f"stripe {j} has a cycle")

    def below(self, node: NodeId, top: NodeId, j: int) -> bool:
        """Is `node` `top` or in its subtree of stripe `j`?"""
        if node != top and not (top in self.kids and self.kids[top][j]):
            return False
        for _ in range(len(self.up) + 1):
            if node == top:
                return True
            if node not in self.up or self.up[node][j] is None:
                return False
            node = self.up[node][j]  # type: ignore[assignment]
        raise AssertionError(f"stripe {j} has a cycle")

    def senders(self, node: NodeId) -> list[tuple[int, int, NodeId]]:
        """(start, end, sender) of each stripe `node` has a sender of now."""
        ups = self.up.get(node, ())
        return [(self.bounds[j], self.bounds[j + 1], p) for j, p in enumerate(ups) if p is not None]

    def take_moved(self) -> list[NodeId]:
        """Receivers told before whose senders changed, with every stripe's sender known."""
        moved = [n for n in self.moved if n in self.told and not self.orphans.get(n)]
        self.moved = {n for n in self.moved if n in self.told and self.orphans.get(n)}
        return sorted(moved, key=self._rank.__getitem__)

    # ------------------------------------------------------------ linking ---
    def link(self, child: NodeId, j: int, parent: NodeId) -> None:
        self.up[child][j] = parent
        self.kids[parent][j][child] = None
        self.depth[child][j] = self.level(parent, j) + 1
        if parent in self.roots:
            self.root_room -= 1
        else:
            self.room_in[j] -= 1
        holder = self.holders.get(parent)
        if holder is not None:  # (else a receiver being placed: its holder comes next)
            holder.serving.add(child)
        lacking = self.orphans.get(child)
        if lacking is not None:
            lacking.discard(j)
            if not lacking:
                del self.orphans[child]
        self.seq += 1
        self.moved.add(child)
        self.linked.append((child, parent))
        if self.home[child] == j:
            self._offer(child, j)
        else:
            self._leaf_entry(child, j)

    def unlink(self, child: NodeId, j: int) -> NodeId | None:
        """`child` no longer pulls stripe `j` from its sender (returned)."""
        parent = self.up[child][j]
        if parent is None:
            return None
        self.up[child][j] = None
        del self.kids[parent][j][child]
        if parent in self.roots:
            self.root_room += 1
        else:
            self.room_in[j] += 1
        holder = self.holders.get(parent)
        if holder is not None and not any(child in kids for kids in self.kids[parent]):
            holder.serving.discard(child)
        self.seq += 1
        self.moved.add(child)
        self._offer(parent, j)
        return parent

    def _offer(self, node: NodeId, j: int) -> None:
        """`node` may have room in stripe `j` (for any stripe, a root)."""
        for i in (range(self.k) if node in self.roots else (j,)):
            if self.room(node, i) > 0:
                level, rank = self.level(node, i), self._rank[node]
                heapq.heappush(self._high[i], (level + 1, False, rank, node))
                if node not in self.roots:
                    heapq.heappush(self._low[i], (-(level + 1), -rank, node))
        if node in self.roots and self.room(node, j) > 0:
            heapq.heappush(self._free_roots, (self._rank[node], node))
        present = len(self.up) + len(self.roots)
        if len(self._free_roots) + sum(map(len, self._high)) > 8 * present + 64:
            self._rebuild()

    def _leaf_entry(self, node: NodeId, j: int) -> None:
        heapq.heappush(self._high[j], (self.depth[node][j], True, self._rank[node], node))

    def _rebuild(self) -> None:
        """The heaps anew, of what holds now: stale entries of deep places
        are never reached by a choice that stops at the first good one, and
        a long-lived object read by receiver after receiver would otherwise
        grow them for ever."""
        self._high = [[] for _ in range(self.k)]
        self._low = [[] for _ in range(self.k)]
        self._free_roots = []
        self._rank = {n: r for n, r in self._rank.items() if n in self.roots or n in self.up}
        for node in self._rank:
            if node in self.roots:
                self._offer(node, 0)
                continue
            self._offer(node, self.home[node])
            for j in range(self.k):
                if self.is_leaf(node, j):
                    self._leaf_entry(node, j)

    # ---------------------------------------------------------- choosing ---
    def _pick_high(self, j: int, receiver: NodeId) -> tuple[NodeId, bool] | None:
        """Where `receiver` goes in its home stripe `j`: (the node with a
        free slot, or the leaf to take the place of; whether it is a leaf).
        The one that costs least: `hop_s` per level of depth, and for a
        leaf, `byte_s` per byte of the stripe it must then get again from
        its new sender, which starts with none. (Arriving together, leaves
        have none yet, so the receivers that relay a stripe fill its tree
        level by level; a leaf that has pulled for a while is left where
        it is.)"""
        heap, kept, found, least = self._high[j], [], None, float("inf")
        while heap and heap[0][0] * self.hop_s < least:
            item = heapq.heappop(heap)
            key, leaf, _, node = item
            if leaf:
                if not (self.is_leaf(node, j) and self.depth[node][j] == key):
                    continue  # (stale)
                parent = self.up[node][j]
            else:
                if not (self.room(node, j) > 0 and self.level(node, j) + 1 == key):
                    continue
                parent = node
            kept.append(item)
            if node != receiver and parent != receiver and self.usable(parent, j, receiver):
                cost = key * self.hop_s + (self._moving_cost(node, j) if leaf else 0.0)
                if cost < least:
                    found, least = (node, leaf), cost
        for item in kept:
            heapq.heappush(heap, item)
        return found

    def _moving_cost(self, leaf: NodeId, j: int) -> float:
        """What pushing `leaf` down in stripe `j` costs it: the bytes of the
        stripe it must get again behind its new sender, and, if it has any,
        a level for each time it was pushed down before (each put it behind
        a sender starting anew: a leaf pulling for a while is not pushed
        down over and over, for a few bytes each time)."""
        had = self.had(leaf, j)
        return had * self.byte_s + (self.pushed.get((leaf, j), 0) * self.hop_s if had else 0.0)

    def had(self, node: NodeId, j: int) -> int:
        """About how many bytes of stripe `j` `node` has: its reported
        prefix, read as stripe j's where it reaches into it, else as if
        every stripe went as far (in a stripe's tree they go at one rate)."""
        holder = self.holders.get(node)
        have = holder.nbytes if holder is not None else 0
        lo, hi = self.bounds[j], self.bounds[j + 1]
        return min(have - lo if have >= lo else have, hi - lo)

    def _pick_low(self, j: int, receiver: NodeId) -> NodeId | None:
        """Where a leaf of stripe `j` goes: the deepest free slot of a home
        receiver of `j`, else the earliest root with room."""
        found = None
        order = (self._low[j], self._free_roots)
        if self.root_room > 2 * self.k:  # (copies with room to spare: no lag behind them)
            order = order[::-1]
        for heap in order:
            kept = []
            while heap and found is None:
                item = heapq.heappop(heap)
                node = item[-1]
                if heap is self._low[j]:
                    if node in self.roots or not (self.room(node, j) > 0
                                                  and -(self.level(node, j) + 1) == item[0]):
                        continue
                elif not (node in self.roots and self.room(node, j) > 0):
                    continue
                kept.append(item)
                if node != receiver and self.usable(node, j, receiver):
                    found = node
            for item in kept:
                heapq.heappush(heap, item)
            if found is not None:
                return found
        return None

    # --------------------------------------------------------- receivers ---
    def add_root(self, node: NodeId) -> None:
        """`node` has every byte, or makes them (an origin): it serves any stripe."""
        if node in self.roots:
            return
        if node in self.up:
            for j in range(self.k):
                self.unlink(node, j)
            self.orphans.pop(node, None)
            self._leave(node)
            self.kids.setdefault(node, [{} for _ in range(self.k)])
        self._forget_pushes(node)
        self.told.discard(node)
        self.moved.discard(node)
        self.roots[node] = None
        self.kids.setdefault(node, [{} for _ in range(self.k)])
        self._rank.setdefault(node, next(self._ranks))
        self.root_room += self.k - self.load(node)
        self._offer(node, 0)

    def _enter(self, node: NodeId, home: int) -> None:
        self.home[node] = home
        self.up[node] = [None] * self.k
        self.depth[node] = [0] * self.k
        self.kids.setdefault(node, [{} for _ in range(self.k)])
        self._rank.setdefault(node, next(self._ranks))
        self.room_in[home] += self.k - len(self.kids[node][home])
        self.homes[home] += 1

    def _leave(self, node: NodeId) -> None:
        home = self.home.pop(node)
        self.room_in[home] -= self.k - len(self.kids[node][home])
        self.homes[home] -= 1
        del self.up[node], self.depth[node]
        if not any(self.kids[node]):
            del self.kids[node]

    def _homes(self) -> list[int]:
        """Home stripes to try for a new receiver: the least room first."""
        return sorted(range(self.k), key=lambda j: (self.room_in[j], self.homes[j], j))

    def place(self, node: NodeId) -> bool:
        """Place a new receiver in every stripe, or nowhere (False: it waits)."""
        for home in self._homes():
            self._enter(node, home)
            done = []
            for j in range(self.k):
                if j != home:
                    parent = self._pick_low(j, node)
                    if parent is None:
                        break
                    self.link(node, j, parent)
                    done.append(j)
            else:
                if self._climb(node, home):
                    return True
            for j in done:
                self.unlink(node, j)
            self._leave(node)
        self.moved.discard(node)
        return False

    def _climb(self, node: NodeId, j: int) -> bool:
        """Link `node` in its home stripe `j` as high as it can go (a leaf in
        its way moves below it)."""
        pick = self._pick_high(j, node)
        if pick is None:
            return False
        where, leaf = pick
        if not leaf:
            self.link(node, j, where)
            return True
        parent = self.unlink(where, j)
        self.link(node, j, parent)  # type: ignore[arg-type]
        self.pushed[where, j] = self.pushed.get((where, j), 0) + 1
        moved_to = self._pick_low(j, where)
        if moved_to is None:
            self.orphans.setdefault(where, set()).add(j)
        else:
            self.link(where, j, moved_to)
        return True

    def adopt(self, node: NodeId) -> None:
        """A receiver that could not be placed yet, but pulls (from a sender
        of before the object was striped): placed later, by `mend`."""
        self._enter(node, self._homes()[0])
        self.orphans[node] = set(range(self.k))

    def mend(self) -> None:
        """Give every receiver lacking a sender of some stripe one, where a
        slot is free: the ones that relay that stripe first. Where only
        senders that failed it have room, one of those (a stall may have
        passed; one that is dead leaves when its lease runs out): else it
        would wait for a complete copy."""
        for lenient in (False, True):
            self.lenient = lenient
            lacking = sorted(((node, j) for node, js in self.orphans.items() for j in js),
                             key=lambda nj: (self.home[nj[0]] != nj[1], self._rank[nj[0]], nj[1]))
            for node, j in lacking:
                if node not in self.up or j not in self.orphans.get(node, ()):
                    continue
                if self.home[node] == j:
                    self._climb(node, j)
                else:
                    parent = self._pick_low(j, node)
                    if parent is not None:
                        self.link(node, j, parent)
                holder, parent = self.holders.get(node), self.up[node][j]
                if lenient and holder is not None and parent is not None:
                    holder.failed_from.discard(parent)
        self.lenient = False

    def fail(self, node: NodeId, sender: NodeId) -> bool:
        """`node`'s pull from `sender` failed: each stripe it took from it
        lacks a sender now. Whether there was any."""
        hit = [j for j, p in enumerate(self.up.get(node, ())) if p == sender]
        for j in hit:
            self.unlink(node, j)
            self.orphans.setdefault(node, set()).add(j)
        return bool(hit)

    def remove(self, node: NodeId) -> None:
        """`node` holds the object no more: its receivers lack its stripes."""
        for j, kids in enumerate(self.kids.get(node, ())):
            for child in list(kids):
                self.unlink(child, j)
                self.orphans.setdefault(child, set()).add(j)
        if node in self.up:
            for j in range(self.k):
                self.unlink(node, j)
            self.orphans.pop(node, None)
            self._leave(node)
        if node in self.roots:
            del self.roots[node]
            self.root_room -= self.k
            self.kids.pop(node, None)
        self._forget_pushes(node)
        self.told.discard(node)
        self.moved.discard(node)

    def _forget_pushes(self, node: NodeId) -> None:
        for j in range(self.k):
            self.pushed.pop((node, j), None)


class Striping:
    """Which objects are striped, and their receivers' senders (`Trees`)."""

    def __init__(self, settings: Settings, leases: Leases, objects: Objects) -> None:
        self.settings = settings
        #: the live nodes (`Leases.nodes`, read here, written there only)
        self._nodes = leases.nodes
        #: the addresses of nodes with several (`Leases.rails_of`)
        self._rails_of = leases.rails_of
        self._objects = objects

    def wanted(self, entry: Entry, reducing: bool) -> int:
        """How many stripes to cut `entry`'s object into now (0: none)."""
        s = self.settings
        if (s.stripes == 1 or entry.inline is not None or entry.relay or reducing
                or entry.size < max(s.multi_source_bytes, STRIPES)):
            return 0
        if s.stripes == STRIPES:
            return STRIPES
        if s.max_receivers_per_sender > 1:
            return 0  # (a tree of that fan-out was asked for: it is kept)
        k = broadcast_stripes(entry.size, self.seen(entry), s.latency_s, s.bytes_per_s,
                              s.chunk_size, s.relay, s.max_receivers_per_sender)
        if k < 2 or len(entry.holders) < entry.unstriped_until:
            return 0
        # The model counts receivers that come together. A pull far along
        # already (they come apart: a chain then fills as fast as they come)
        # would lose time to the move: its new senders start behind it. (Then
        # the holders are looked at again only once an eighth more came: a
        # get does not pay a walk over every holder.)
        far = STRIPE_MARGIN * entry.size
        if any(h.nbytes > far for h in entry.holders.values()
               if h.upstream is not None and not (h.complete or h.origin)):
            entry.unstriped_until = len(entry.holders) + len(entry.holders) // 8 + 1
            return 0
        return k

    def seen(self, entry: Entry) -> int:
        """The receivers seen so far: holders and waiting gets (the origin included)."""
        return len(entry.holders) + len(entry.waiting)

    def piece(self, entry: Entry) -> int:
        """Bytes per message of a striped pull of `entry`'s object now."""
        return stripe_piece(entry.size, self.seen(entry), entry.stripes.k,
                            self.settings.chunk_size)

    def _weigh(self, entry: Entry) -> None:
        """Tell the trees what a level and a moved leaf's byte cost now."""
        s, trees = self.settings, entry.stripes
        unit = min(self.piece(entry), s.relay)
        trees.hop_s = s.latency_s + trees.k * unit / s.bytes_per_s
        trees.byte_s = trees.k / s.bytes_per_s

    def start(self, oid: Key, entry: Entry, k: int, out: list[Command]) -> None:
        """Stripe `entry`'s object from now on: its complete copies and
        origins are the roots, and the receivers pulling it already are
        placed in the trees in the order they came, and told."""
        trees = entry.stripes = Trees(k, entry.size, entry.holders, self._usable(entry))
        trees.seq = entry.moves  # (numbered after the moves of before: racks.py)
        self._weigh(entry)
        ranked = sorted(entry.holders.items(), key=lambda nh: nh[1].seq)
        pulling = [node for node, holder in ranked if holder.upstream is not None]
        for node in pulling:  # (no sender of before counts: each is placed anew, or a root)
            entry.detach(node)
        for node, holder in ranked:
            if holder.complete or holder.origin:
                trees.add_root(node)
        for node in pulling:
            holder = entry.holders[node]
            if holder.complete or holder.origin:
                continue  # (its own bytes come from its put: it sends any stripe)
            if not trees.place(node):
                trees.adopt(node)  # (it goes on from its sender until `mend` finds it slots)
            trees.told.add(node)
            trees.moved.add(node)
        self.settle(oid, entry, out)

    def _usable(self, entry: Entry) -> Usable:
        nodes, holders = self._nodes, entry.holders

        def usable(node: NodeId, j: int, receiver: NodeId) -> bool:
            trees = entry.stripes
            mine = holders.get(receiver)
            return (node in nodes
                    and not (mine is not None and node in mine.failed_from and not trees.lenient)
                    and trees.anchored(node, j) and not trees.below(node, receiver, j))
        return usable

    def assign(self, oid: Key, entry: Entry, receiver: NodeId, tag: bytes | None,
               out: list[Command]) -> m.Location | None:
        """The senders of a receiver of a striped object (None: it waits)."""
        trees = entry.stripes
        mine = entry.holders.get(receiver)
        if mine is not None and mine.upstream is not None:
            entry.detach(receiver)  # (a pull from one sender, from before the stripes)
        if receiver not in trees.up:
            self._weigh(entry)
            if not trees.place(receiver):
                return None
            if mine is None:
                mine = self._objects.new_holder(oid, entry, receiver, Holder())
                # (a leaf it pushed down may pull from it already)
                mine.serving.update(child for kids in trees.kids[receiver] for child in kids)
        elif trees.orphans.get(receiver):
            return None  # (`mend` gives it the senders it lacks, then it is answered)
        trees.told.add(receiver)
        trees.moved.discard(receiver)
        body = self.location(entry, receiver, tag)
        self.settle(oid, entry, out)
        return body

    def location(self, entry: Entry, receiver: NodeId, tag: bytes | None) -> m.Location:
        stripes = self.stripes_of(entry, receiver)
        return m.Location(size=entry.size, layout=entry.layout, reduce_tag=tag,
                          sender=stripes[0].sender, address=stripes[0].address,
                          stripes=stripes, seq=entry.stripes.seq, piece=self.piece(entry),
                          rails=self._rails_of(s.sender for s in stripes))

    def stripes_of(self, entry: Entry, node: NodeId) -> list[m.Stripe]:
        nodes = self._nodes
        return [m.Stripe(start=lo, end=hi, sender=p, address=nodes.get(p, ""))
                for lo, hi, p in entry.stripes.senders(node)]

    def settle(self, oid: Key, entry: Entry, out: list[Command]) -> None:
        """After the trees changed: receivers lacking a sender get one where
        a slot is free, the links made are recorded, and every receiver told
        before whose senders changed hears its new ones."""
        trees = entry.stripes
        if trees.orphans:
            self._weigh(entry)
            trees.mend()
        entry.edges.extend(trees.linked)
        trees.linked.clear()
        moved = trees.take_moved()
        if moved:
            piece = self.piece(entry)
            for node in moved:
                stripes = self.stripes_of(entry, node)
                out.append(PushRestripe(node, oid, m.Restripe(
                    oid=oid, stripes=stripes, seq=trees.seq, piece=piece,
                    rails=self._rails_of(s.sender for s in stripes))))
