"""A broadcast over packed spanning trees (Blink): the object is split across
the trees `trees.pack` finds over a topology, in proportion to their rates,
and every member pulls each tree's range from its parent in that tree, all
at once, relaying each range to its own children as it lands.

    value = multitree_broadcast(x if rank == 0 else None, name="w-7", rank=rank,
                                size=8, topology=fixture("dgx1v"))

Rank r sits on the topology's node `members[r]` (default: its r-th node).
Every rank computes the same plan (a pure function of the topology, the root
and the members). The ranks learn each other's node and data address from
small inline objects under the call's name; the root puts the object; every
other rank registers as a holder of the object it is about to fill (so
gets of it by anyone may pipeline from it) and pulls a pinned plan
(`engine.run_plan`): one sub-flow per tree, from that tree's parent. What a
parent that fails left comes from the root once the other parents'
ranges are in (not from another parent: it may be below the failed one in
that tree, waiting on the same bytes); if the root fails too, the receiver
asks the directory, which finishes the copy on the dynamic path (the bytes
in hand are kept).

Which of the ranges a relay serves first does not matter: a data server
serves a range as soon as its bytes are written (`StoredObject.ready_from`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from . import api
from . import messages as m
from .errors import InvalidArgument, Timeout
from .ids import ObjectID
from .node.flows import PEER_FAILURES
from .node.holdings import complete_msg
from .node.plan import Plan, SubFlow
from .values import Layout, from_buffer, to_buffer


def _ids(name: str, rank: int) -> tuple[ObjectID, ObjectID]:
    """The call's object, and rank `rank`'s card (`messages.TreeMember`)."""
    return ObjectID.from_name(f"{name}/mt"), ObjectID.from_name(f"{name}/mt/who/{rank}")


def call_ids(name: str, size: int) -> list[ObjectID]:
    """Every object a broadcast of `size` ranks under `name` makes."""
    return [_ids(name, 0)[0], *(_ids(name, r)[1] for r in range(size))]


def members_of(topology: Any, size: int, members: Sequence[Any] | None,
               call: str = "multitree_broadcast") -> tuple[Any, ...]:
    """The topology node of each rank, checked (errors name `call`)."""
    chosen = tuple(topology.nodes[:size]) if members is None else tuple(members)
    if len(chosen) != size:
        raise InvalidArgument(f"{call}: {size} ranks need {size} members of the "
                              f"topology; got {len(chosen)} ({list(chosen)})")
    if len(set(chosen)) != size:
        raise InvalidArgument(f"{call}: members must be distinct; got {list(chosen)}")
    unknown = [n for n in chosen if n not in topology.nodes]
    if unknown:
        raise InvalidArgument(f"{call}: {unknown} are not nodes of topology "
                              f"{topology.name!r} ({list(topology.nodes)})")
    return chosen


def flows_for(plan: Any, size: int, me: Any, cards: dict[Any, m.TreeMember],
              ranges: Sequence[tuple[int, int]] | None = None) -> list[SubFlow]:
    """`me`'s sub-flows: each tree's range of the object (`ranges`, one per
    tree; by default `plan.split(size)`), from `me`'s parent in it."""
    flows = []
    ranges = plan.split(size) if ranges is None else ranges
    for tree, (start, end) in zip(plan.trees, ranges, strict=True):
        if start == end:
            continue
        [parent] = [p for p, child in tree.edges if child == me]
        card = cards[parent]
        flows.append(SubFlow(start, end, card.node, card.address))
    return flows


def multitree_broadcast(value: Any, *, name: str, rank: int, size: int, topology: Any,
                        root: int = 0, members: Sequence[Any] | None = None,
                        timeout: float | None = None, array_type: str = "numpy") -> Any:
    """Broadcast the root's `value` to every rank over packed spanning trees
    of `topology`; every rank returns the value (see the module's doc)."""
    if not (isinstance(size, int) and size >= 1 and isinstance(rank, int) and 0 <= rank < size
            and isinstance(root, int) and 0 <= root < size):
        raise InvalidArgument(f"multitree_broadcast: rank {rank!r} and root {root!r} must be "
                              f"ints in [0, {size!r})")
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"multitree_broadcast: name must be a non-empty str; got {name!r}")
    chosen = members_of(topology, size, members)
    from .trees import pack

    plan = pack(topology, chosen[root], chosen)
    rt = api.runtime()
    limit = api._timeout(rt, timeout)
    return rt.call(_broadcast(rt.node, value if rank == root else None, name, rank, root,
                              chosen, plan, limit, array_type), limit)


async def _broadcast(node: Any, value: Any, name: str, rank: int, root: int,
                     chosen: tuple[Any, ...], plan: Any, limit: float, array_type: str) -> Any:
    deadline = time.monotonic() + limit
    oid, mine = _ids(name, rank)
    card = m.TreeMember(node=node.node_id, address=node.server.address)
    if rank == root:
        buf, layout = to_buffer(value)
        card.size, card.layout = layout.nbytes, layout.to_wire()
        await node.put(value, oid)
        await node.put(m.encode(card), mine)
        return value
    await node.put(m.encode(card), mine)
    cards = await _cards(node, name, chosen, plan, rank, deadline)
    info = cards[chosen[root]]
    layout = Layout.from_wire(info.layout)
    obj = await _fill(node, oid, layout, flows_for(plan, info.size, chosen[rank], cards),
                      deadline, info)
    return from_buffer(obj.buffer, layout, array_type)


async def _cards(node: Any, name: str, chosen: tuple[Any, ...], plan: Any, rank: int,
                 deadline: float) -> dict[Any, m.TreeMember]:
    """The cards of the root and of `rank`'s parents."""
    me = chosen[rank]
    wanted = {plan.root} | {p for tree in plan.trees for p, child in tree.edges if child == me}
    cards = {}
    for member in wanted:
        raw = await node.get(_ids(name, chosen.index(member))[1],
                             max(0.001, deadline - time.monotonic()), "numpy")
        cards[member] = m.decode_tree_member(f"the card of member {member!r}", bytes(raw))
    return cards


async def _fill(node: Any, oid: ObjectID, layout: Layout, flows: list[SubFlow],
                deadline: float, root: m.TreeMember) -> Any:
    """Register as a holder of `oid` to be, fill it as `flows` say, and
    announce it complete. What a failed parent left comes from the root
    (`root`'s card), at once; if the root fails too, from the directory's choice
    (the bytes in hand are kept)."""
    existing = node.store.get(oid)
    if existing is not None and existing.complete:
        return existing
    obj = node.store.create(oid, layout)
    # A holder from now on: a put of the same size and layout is a copy (its
    # bytes are the root's), so others' gets may pipeline from this one.
    await node._request(m.Put(rid=0, oid=oid.binary, size=layout.nbytes,
                              layout=layout.to_wire()), max(0.001, deadline - time.monotonic()))
    senders = tuple(dict.fromkeys((f.sender, f.address) for f in flows))
    # Not from another parent (it may be below the failed one in that tree,
    # waiting on the same bytes from us): from the root, at once.
    plan = Plan(oid, obj.size, tuple(flows), senders, pinned=True, spares=False,
                backups=((root.node, root.address),))
    try:
        async with asyncio.timeout(max(0.001, deadline - time.monotonic())):
            await node.pull_plan(obj, plan)
    except PEER_FAILURES as exc:
        if time.monotonic() >= deadline:
            raise Timeout(f"multitree broadcast of {oid.hex()}: not complete in time") from exc
        # The root failed too: what is missing comes the directory's way.
        return await node.fetch(oid, max(0.001, deadline - time.monotonic()))
    except TimeoutError:
        raise Timeout(f"multitree broadcast of {oid.hex()}: not complete in time") from None
    obj.own = True  # (a copy of the put: a restarted directory counts it as one)
    node._post(complete_msg(obj))
    return obj


__all__ = ["call_ids", "flows_for", "members_of", "multitree_broadcast"]
