"""The directory's pure scheduling state machine, driven event by event.

Unit tests pin the broadcast shapes (chain, tree), waiting, failover, loss, delete
and queries; a hypothesis state machine then feeds random event sequences from a
well-behaved set of nodes and checks the scheduling invariants after every event.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hoplite_gpu import messages as m
from hoplite_gpu.directory.state import (
    CancelLocate,
    Command,
    Completed,
    Delete,
    DeleteMany,
    Directory,
    Disconnect,
    Drop,
    Dropped,
    Evict,
    Heartbeat,
    Locate,
    NodeJoined,
    NodeLost,
    Progress,
    Put,
    Query,
    Reply,
    Tick,
    TransferFailed,
)

K = bytes(range(20))
K2 = bytes(range(1, 21))
SIZE = 1000
LAYOUT = {"kind": "bytes", "nbytes": SIZE}


def make(max_receivers: int = 1, nodes: int = 10) -> Directory:
    d = Directory(max_receivers_per_sender=max_receivers)
    for i in range(nodes):
        assert d.handle(NodeJoined(f"n{i}", f"addr{i}")) == []
    return d


def put(d: Directory, node: str, request: int = 0, *, oid: bytes = K, size: int = SIZE,
        layout: dict[str, Any] | None = None, inline: bytes | None = None,
        complete: bool = False) -> list[Command]:
    out = d.handle(Put(node, request, oid, size, LAYOUT if layout is None else layout, inline))
    if complete:
        out += d.handle(Completed(node, oid))
    return out


def senders(out: list[Command]) -> dict[tuple[str, int], str]:
    """(receiver, request) -> sender, for every Reply that names a sender."""
    return {(c.node, c.request): c.body.sender for c in out
            if isinstance(c, Reply) and getattr(c.body, "sender", None) is not None}


def locate(d: Directory, node: str, request: int, oid: bytes = K) -> str | None:
    """The sender `node` is told to pull from at once, or None if it has to wait."""
    out = d.handle(Locate(node, request, oid))
    assert len(out) <= 1
    return senders(out).get((node, request))


def upstream(d: Directory, node: str, oid: bytes = K) -> str | None:
    return d.objects[oid].holders[node].upstream


def depth(d: Directory, node: str, oid: bytes = K) -> int:
    n = 0
    while (node := upstream(d, node, oid)) is not None:
        n += 1
    return n


def not_found(out: list[Command], node: str, request: int) -> bool:
    return any(isinstance(c, Reply) and (c.node, c.request) == (node, request)
               and getattr(c.body, "error", None) == "ObjectNotFound" for c in out)


def waiting_receiver(d: Directory) -> None:
    """max 1: n1 pulls from complete n0, n2 from n1; n2's pull fails and its new Locate
    waits (n0 is busy with n1, and n1 is ruled out for n2)."""
    put(d, "n0", complete=True)
    assert locate(d, "n1", 1) == "n0"
    assert locate(d, "n2", 2) == "n1"
    assert d.handle(TransferFailed("n2", K, "n1", 10)) == []
    assert locate(d, "n2", 3) is None
    assert list(d.objects[K].waiting) == [("n2", 3)]


# ------------------------------------------------------------ broadcast ---
@pytest.mark.parametrize("origin_complete", [True, False])
def test_one_receiver_per_sender_builds_a_chain(origin_complete):
    d = make(1)
    assert put(d, "n0", 7, complete=origin_complete)[0] == Reply("n0", 7, m.Done(ok=True))
    got = [locate(d, f"n{k}", 100 + k) for k in range(1, 9)]
    assert got == [f"n{k - 1}" for k in range(1, 9)]  # receiver k pulls from receiver k-1
    assert depth(d, "n8") == 8
    holders = d.objects[K].holders
    assert all(len(h.serving) <= 1 for h in holders.values())
    assert holders["n3"].serving == {"n4"} and holders["n8"].serving == set()
    assert not any(holders[f"n{k}"].complete for k in range(1, 9))
    assert list(d.objects[K].edges) == [(f"n{k}", f"n{k - 1}") for k in range(1, 9)]


def test_two_receivers_per_sender_builds_a_binary_tree():
    d = make(2)
    put(d, "n0", complete=True)
    got = {k: locate(d, f"n{k}", k) for k in range(1, 9)}
    assert got == {k: f"n{(k - 1) // 2}" for k in range(1, 9)}
    holders = d.objects[K].holders
    fan_out = {n: len(h.serving) for n, h in holders.items()}
    assert max(fan_out.values()) == 2 and fan_out["n0"] == fan_out["n1"] == 2
    assert max(depth(d, f"n{k}") for k in range(1, 9)) == 3  # a tree, not a star


def test_completed_frees_the_sender_for_a_waiting_receiver():
    d = make(1)
    waiting_receiver(d)
    assert d.objects[K].holders["n0"].serving == {"n1"}
    out = d.handle(Completed("n1", K))
    assert senders(out) == {("n2", 3): "n0"}  # n1 failed n2 before, so the freed n0 it is
    holders = d.objects[K].holders
    assert holders["n1"].complete and holders["n1"].nbytes == SIZE
    assert holders["n1"].upstream is None and holders["n0"].serving == {"n2"}
    assert upstream(d, "n2") == "n0" and not d.objects[K].waiting


def test_a_complete_copy_is_preferred_over_a_partial_one():
    d = make(2)
    put(d, "n0", complete=True)
    assert locate(d, "n1", 1) == "n0"
    assert locate(d, "n2", 2) == "n0"  # n1 has a free slot too, but it is partial
    # An origin still putting is partial as well: a complete re-put wins over it.
    d2 = make(2)
    put(d2, "n0")
    put(d2, "n1", complete=True)
    assert locate(d2, "n2", 1) == "n1"


def test_the_most_advanced_partial_copy_is_preferred():
    d = make(1)
    put(d, "n0")
    put(d, "n1")
    d.handle(Progress("n1", K, 300))
    d.handle(Progress("n0", K, 100))
    assert locate(d, "n2", 1) == "n1"
    d.handle(Progress("n0", K, 10 * SIZE))  # capped at the size
    assert d.objects[K].holders["n0"].nbytes == SIZE


# -------------------------------------------------------------- waiting ---
def test_locate_before_put_waits_then_is_served_in_arrival_order():
    d = make(1)
    assert d.handle(Locate("n1", 1, K)) == []
    assert d.handle(Locate("n2", 2, K)) == []
    assert list(d.pending[K]) == [("n1", 1), ("n2", 2)]
    assert K not in d.objects
    out = put(d, "n0", 9)
    assert [(c.node, c.request) for c in out] == [("n0", 9), ("n1", 1), ("n2", 2)]
    assert out[0].body == m.Done(ok=True)
    assert senders(out) == {("n1", 1): "n0", ("n2", 2): "n1"}
    assert out[1].body == m.Location(size=SIZE, layout=LAYOUT, sender="n0", address="addr0")
    assert K not in d.pending


def test_cancel_locate_removes_a_pending_request():
    d = make(1)
    d.handle(Locate("n1", 1, K))
    d.handle(Locate("n2", 2, K))
    assert d.handle(CancelLocate("n1", 1)) == []
    assert list(d.pending[K]) == [("n2", 2)]
    d.handle(CancelLocate("n2", 2))
    assert d.pending == {}  # no empty queues left behind
    out = put(d, "n0")
    assert out == [Reply("n0", 0, m.Done(ok=True))]
    d.handle(CancelLocate("n5", 99))  # unknown: ignored


def test_cancel_locate_removes_a_waiting_request():
    d = make(1)
    waiting_receiver(d)
    d.handle(CancelLocate("n2", 3))
    assert not d.objects[K].waiting
    assert d.handle(Completed("n1", K)) == []  # nobody to serve any more


# --------------------------------------------------------------- inline ---
def test_inline_object_is_answered_with_its_bytes():
    d = make(1)
    out = put(d, "n0", 1, size=3, layout={"l": 1}, inline=b"abc")
    assert out == [Reply("n0", 1, m.Done(ok=True))]
    assert d.objects[K].holders["n0"].complete
    for k in (1, 2, 3):  # no sender slots involved
        out = d.handle(Locate(f"n{k}", k, K))
        assert out == [Reply(f"n{k}", k, m.Location(size=3, layout={"l": 1}, inline=b"abc"))]
    assert d.objects[K].holders["n3"].complete
    assert d.describe(K).inline is True


def test_inline_object_survives_its_putter():
    d = make(1)
    put(d, "n0", size=3, inline=b"abc")
    assert d.handle(NodeLost("n0")) == []
    assert d.handle(Locate("n1", 1, K))[0].body.inline == b"abc"


def test_zero_size_object_replies_local():
    d = make(1)
    put(d, "n0", size=0, layout={"l": 0})
    assert d.objects[K].holders["n0"].complete
    out = d.handle(Locate("n1", 1, K))
    assert out == [Reply("n1", 1, m.Location(size=0, layout={"l": 0}, local=True))]
    assert d.objects[K].holders["n1"].complete
    assert d.objects[K].holders["n0"].serving == set()


def test_a_complete_holder_is_told_it_is_local():
    d = make(1)
    put(d, "n0", complete=True)
    assert d.handle(Locate("n0", 1, K)) == [
        Reply("n0", 1, m.Location(size=SIZE, layout=LAYOUT, local=True))]


# ---------------------------------------------------------------- reput ---
def test_reput_with_same_size_and_layout_adds_a_holder():
    d = make(2)
    put(d, "n0")
    out = put(d, "n1", 5)
    assert out == [Reply("n1", 5, m.Done(ok=True))]
    holders = d.objects[K].holders
    assert set(holders) == {"n0", "n1"} and holders["n1"].origin
    # n0 dying now loses nothing: n1 is still putting it.
    assert d.handle(NodeLost("n0")) == []
    assert set(d.objects[K].holders) == {"n1"}


def test_a_put_of_other_bytes_under_an_id_is_refused_and_the_same_bytes_add_a_copy():
    d = make(3)
    d.handle(Put("n0", 1, K, SIZE, LAYOUT, fingerprint=b"A" * 8))
    out = d.handle(Put("n1", 2, K, SIZE, LAYOUT, fingerprint=b"B" * 8))
    assert out[0].body.error == "ObjectExists" and "other bytes" in out[0].body.message
    assert set(d.objects[K].holders) == {"n0"}
    assert d.handle(Put("n2", 3, K, SIZE, LAYOUT, fingerprint=b"A" * 8)) == [Reply("n2", 3, m.Done(ok=True))]
    assert d.handle(Put("n1", 4, K, SIZE, LAYOUT)) == [Reply("n1", 4, m.Done(ok=True))]  # not told: taken
    small = {"kind": "bytes", "nbytes": 3}
    d.handle(Put("n0", 5, K2, 3, small, b"abc"))
    assert d.handle(Put("n1", 6, K2, 3, small, b"xyz"))[0].body.error == "ObjectExists"
    assert d.handle(Put("n2", 7, K2, 3, small, b"abc")) == [Reply("n2", 7, m.Done(ok=True))]


@pytest.mark.parametrize("size, layout", [(SIZE + 1, LAYOUT), (SIZE, {"other": True})])
def test_reput_with_a_different_size_or_layout_is_refused(size, layout):
    d = make(1)
    put(d, "n0")
    out = put(d, "n1", 5, size=size, layout=layout)
    assert len(out) == 1 and out[0].node == "n1" and out[0].request == 5
    assert out[0].body.error == "ObjectExists" and isinstance(out[0].body, m.Failure)
    entry = d.objects[K]
    assert set(entry.holders) == {"n0"} and (entry.size, entry.layout) == (SIZE, LAYOUT)


def test_reput_by_a_current_holder_keeps_its_links():
    d = make(1)
    put(d, "n0", complete=True)
    assert locate(d, "n1", 1) == "n0"
    assert locate(d, "n2", 2) == "n1"
    assert put(d, "n1", 3) == [Reply("n1", 3, m.Done(ok=True))]
    holders = d.objects[K].holders
    assert holders["n1"].origin and holders["n1"].upstream == "n0"
    assert holders["n1"].serving == {"n2"} and holders["n0"].serving == {"n1"}
    assert_consistent(d)
    assert locate(d, "n3", 4) == "n2"  # n1's one slot is still taken


# -------------------------------------------------------------- failure ---
def test_transfer_failed_avoids_that_sender_and_records_have():
    d = make(2)
    put(d, "n0", complete=True)
    assert [locate(d, f"n{k}", k) for k in (1, 2, 3)] == ["n0", "n0", "n1"]
    assert d.handle(TransferFailed("n3", K, "n1", 0)) == []
    h3 = d.objects[K].holders["n3"]
    assert h3.failed_from == {"n1"} and h3.upstream is None and h3.nbytes == 0
    assert d.objects[K].holders["n1"].serving == set()
    assert locate(d, "n3", 4) == "n2"  # n0 is full, n1 failed it


def test_transfer_failed_keeps_the_bytes_and_skips_copies_behind_them():
    d = make(2)
    put(d, "n0", complete=True)
    assert [locate(d, f"n{k}", k) for k in (1, 2, 3)] == ["n0", "n0", "n1"]
    d.handle(TransferFailed("n3", K, "n1", 400))
    d.handle(TransferFailed("n3", K, "n1", 10 * SIZE))  # capped; never goes down
    assert d.objects[K].holders["n3"].nbytes == SIZE
    d.handle(TransferFailed("n3", K, "n1", 5))
    assert d.objects[K].holders["n3"].nbytes == SIZE
    # n2 has fewer bytes than n3: pulling from it would not help yet.
    assert locate(d, "n3", 4) is None
    # Once n2 completes it frees its slot at n0: both are complete now, n0 comes first.
    out = d.handle(Completed("n2", K))
    assert senders(out) == {("n3", 4): "n0"}


def test_events_about_unknown_objects_or_holders_are_ignored():
    d = make(1)
    for ev in (Completed("n1", K), Progress("n1", K, 5), TransferFailed("n1", K, "n0", 3),
               Dropped("n1", K), NodeLost("n9")):
        assert d.handle(ev) == []
    put(d, "n0")
    for ev in (Completed("n1", K), Progress("n1", K, 5), TransferFailed("n1", K, "n0", 3),
               Dropped("n1", K)):
        assert d.handle(ev) == []
    assert set(d.objects[K].holders) == {"n0"}


def test_node_lost_mid_chain_clears_the_upstream_downstream():
    d = make(1)
    put(d, "n0", complete=True)
    assert [locate(d, f"n{k}", k) for k in (1, 2, 3)] == ["n0", "n1", "n2"]
    assert d.handle(NodeLost("n2")) == []  # a complete copy remains: nothing is lost
    holders = d.objects[K].holders
    assert "n2" not in holders and "n2" not in d.nodes
    assert holders["n3"].upstream is None and holders["n1"].serving == set()
    # n3 reports the failure and asks again: the chain tail n1 is free now.
    d.handle(TransferFailed("n3", K, "n2", 0))
    assert locate(d, "n3", 4) == "n1"


def test_losing_the_only_origin_loses_the_object():
    d = make(1)
    put(d, "n0")  # still putting: nobody has every byte
    assert [locate(d, f"n{k}", k) for k in (1, 2)] == ["n0", "n1"]
    d.handle(TransferFailed("n2", K, "n1", 0))
    # n1 is the only sender left: a stall may have been passing, so n2 tries it again
    assert locate(d, "n2", 3) == "n1"
    d.handle(Locate("n4", 4, K2))  # a pending locate of the node that dies
    out = d.handle(NodeLost("n0"))
    drops = {c.node for c in out if isinstance(c, Drop)}
    assert drops == {"n1", "n2"}
    assert all(c.oid == K and "lost" in c.reason for c in out if isinstance(c, Drop))
    assert len(out) == 2
    assert K not in d.objects
    # A locate after the loss is told so at once, not left waiting for a put
    [reply] = d.handle(Locate("n5", 5, K))
    assert reply.body.error == "ObjectNotFound" and "lost" in reply.body.message
    assert K not in d.pending
    assert d.handle(NodeLost("n4")) == []
    assert K2 not in d.pending
    # ... until it is put again
    put(d, "n6", complete=True)
    assert locate(d, "n5", 6) == "n6"


def test_dropping_the_last_complete_copy_loses_the_object():
    d = make(1)
    put(d, "n0", complete=True)
    assert locate(d, "n1", 1) == "n0"
    put(d, "n2", complete=True)
    assert d.handle(Dropped("n0", K)) == []  # n2 still has it
    assert upstream(d, "n1") is None
    out = d.handle(Dropped("n2", K))
    assert [(type(c), c.node) for c in out] == [(Drop, "n1")]
    assert K not in d.objects


def test_a_dropped_receiver_frees_its_slot():
    d = make(1)
    waiting_receiver(d)
    out = d.handle(Dropped("n1", K))  # n1 gives up its pull from n0
    assert senders(out) == {("n2", 3): "n0"}
    assert "n1" not in d.objects[K].holders


# --------------------------------------------------------------- delete ---
def test_delete_drops_every_holder_and_fails_waiters():
    d = make(1)
    waiting_receiver(d)
    out = d.handle(Delete("n1", 70, K))  # n1, a holder, deletes: it drops its own copy
    assert out[0] == Reply("n1", 70, m.Done(ok=True, existed=True))
    assert {c.node for c in out if isinstance(c, Drop)} == {"n0", "n2"}
    assert all("deleted" in c.reason for c in out if isinstance(c, Drop))
    assert not_found(out, "n2", 3) and len(out) == 4
    assert K not in d.objects
    # a pull that crossed the delete: its copy must go (its gets since ask again)
    assert [(type(c), c.node, c.retry) for c in d.handle(Completed("n1", K))] == [
        (Drop, "n1", True)]
    assert K not in d.objects
    assert locate(d, "n3", 4) is None and list(d.pending[K]) == [("n3", 4)]
    assert d.handle(Delete("n7", 71, K2)) == [Reply("n7", 71, m.Done(ok=True, existed=False))]
    # A new put serves the waiter again.
    assert senders(put(d, "n5")) == {("n3", 4): "n5"}


def test_a_delete_from_elsewhere_drops_every_holder():
    d = make(1)
    waiting_receiver(d)
    out = d.handle(Delete("n7", 70, K))
    assert {c.node for c in out if isinstance(c, Drop)} == {"n0", "n1", "n2"}
    assert not_found(out, "n2", 3)


def test_delete_many_is_each_delete_answered_once():
    d = make(1)
    waiting_receiver(d)
    out = d.handle(DeleteMany("n7", 70, (K2, K, K2)))
    assert out[0] == Reply("n7", 70, m.Done(ok=True, existed=[False, True, False]))
    assert {c.node for c in out if isinstance(c, Drop)} == {"n0", "n1", "n2"}
    assert not_found(out, "n2", 3)
    assert K not in d.objects
    assert d.handle(DeleteMany("n7", 71, ())) == [Reply("n7", 71, m.Done(ok=True, existed=[]))]


# ---------------------------------------------------------------- query ---
def test_query_describes_holders_edges_and_waiters():
    d = make(2)
    put(d, "n0", complete=True)
    locate(d, "n1", 1)
    d.handle(Progress("n1", K, 250))
    [reply] = d.handle(Query("n5", 9, K))
    assert (reply.node, reply.request) == ("n5", 9)
    assert reply.body == d.describe(K) and m.as_map(reply.body) == {
        "size": SIZE, "layout": LAYOUT, "inline": False,
        "holders": [
            {"node": "n0", "address": "addr0", "nbytes": SIZE, "complete": True,
             "origin": True, "upstream": None, "serving": ["n1"]},
            {"node": "n1", "address": "addr1", "nbytes": 250, "complete": False,
             "origin": False, "upstream": "n0", "serving": []},
        ],
        "edges": [["n1", "n0"]], "waiting": 0}
    [missing] = d.handle(Query("n5", 10, K2))
    assert missing.body.error == "ObjectNotFound" and K2.hex() in missing.body.message


def test_unknown_event_type_is_a_type_error():
    d = make(1)
    with pytest.raises(TypeError, match="not a directory event"):
        d.handle(Reply("n0", 1, {}))  # a command, not an event
    with pytest.raises(TypeError):
        d.handle(object())  # type: ignore[arg-type]


# ------------------------------------------------- regressions ---
def test_receiver_that_failed_pipelines_from_a_newer_partial_copy():
    d = make(1)
    put(d, "n0", complete=True)
    assert locate(d, "n1", 1) == "n0"
    d.handle(TransferFailed("n1", K, "n0", 0))
    assert locate(d, "n2", 3) == "n0"  # n0's slot was freed by the failure
    assert locate(d, "n1", 2) == "n2"  # n0 is busy and failed n1: pipeline from n2
    assert not d.objects[K].waiting


def test_failed_sender_is_retried_when_it_is_the_only_one():
    d = make(1)
    put(d, "n0", complete=True)
    assert locate(d, "n1", 1) == "n0"
    d.handle(TransferFailed("n1", K, "n0", 0))
    assert locate(d, "n1", 2) == "n0"  # a stall may pass; a dead n0 would lose its lease
    assert d.objects[K].holders["n1"].failed_from == set()


def test_progress_that_overtakes_a_waiter_serves_it():
    d = make(2)
    put(d, "n0", complete=True)
    assert [locate(d, f"n{k}", k) for k in (1, 2, 3)] == ["n0", "n0", "n1"]
    d.handle(TransferFailed("n3", K, "n1", 400))
    assert locate(d, "n3", 4) is None  # n2 (0 bytes) is behind n3 (400)
    out = d.handle(Progress("n2", K, 800))
    assert senders(out) == {("n3", 4): "n2"}


def test_relocate_while_pulling_releases_the_old_sender():
    d = make(2)
    put(d, "n0", complete=True)
    assert locate(d, "n1", 1) == "n0"
    assert locate(d, "n2", 2) == "n0"
    assert locate(d, "n1", 3) == "n0"  # its old slot at n0 was freed first
    assert d.objects[K].holders["n0"].serving == {"n1", "n2"}
    assert_consistent(d)


# ------------------------------------------------------------ invariants ---
def assert_consistent(d: Directory) -> None:
    """Invariants 1-3: acyclic upstream links, bounded fan-out, serving <-> upstream."""
    for oid, entry in d.objects.items():
        for node, holder in entry.holders.items():
            seen = [node]
            cur = holder.upstream
            while cur is not None and cur in entry.holders:
                assert cur not in seen, f"{oid.hex()}: upstream cycle {seen + [cur]}"
                seen.append(cur)
                cur = entry.holders[cur].upstream
            assert len(holder.serving) <= d.max_receivers_per_sender, (node, holder)
            for r in holder.serving:
                assert r in entry.holders and entry.holders[r].upstream == node, (node, r)
            if holder.upstream is not None:
                up = entry.holders.get(holder.upstream)
                assert up is not None and node in up.serving, (node, holder.upstream)
                assert not holder.complete


NODES = [f"n{i}" for i in range(6)]
OIDS = [bytes([i]) * 20 for i in range(3)]
# Per object: the spec its puts use almost always, and an occasional clashing one.
SPECS = {
    OIDS[0]: (300, {"v": 0}, None),
    OIDS[1]: (0, {"v": 1}, None),          # zero bytes: complete at once
    OIDS[2]: (4, {"v": 2}, b"\x01\x02\x03\x04"),  # inline
}
BIG = OIDS[0]
#: Most traffic goes to the one object that needs real transfers.
SOME_OID = st.sampled_from([BIG, BIG, BIG, BIG, OIDS[1], OIDS[2]])


class DirectoryMachine(RuleBasedStateMachine):
    """Random events from nodes that behave like hoplite_gpu.node: a node locates an
    object only while it is not already waiting for or pulling it, puts only what it
    does not hold, and reports Completed/TransferFailed only for pulls it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.d = Directory()
        self.alive: set[str] = set()
        self.next_request = 1
        #: (node, request) -> (op, oid) awaiting exactly one Reply.
        self.open: dict[tuple[str, int], tuple[str, bytes]] = {}
        self.replied: set[tuple[str, int]] = set()

    @initialize(max_receivers=st.integers(1, 3), joined=st.integers(2, len(NODES)),
                early=st.lists(st.integers(0, 5), max_size=3))
    def setup(self, max_receivers: int, joined: int, early: list[int]) -> None:
        self.d = Directory(max_receivers_per_sender=max_receivers)
        self.alive = set()
        for node in NODES[:joined]:
            self.apply(NodeJoined(node, "addr-" + node))
        self.locate(early, BIG)  # some before the put, waiting in `pending`
        size, layout, _ = SPECS[BIG]
        self.send("put", Put(NODES[0], self.rid(), BIG, size, layout))

    # ------------------------------------------------------------ driver ---
    def rid(self) -> int:
        self.next_request += 1
        return self.next_request

    def holder(self, node: str, oid: bytes):
        entry = self.d.objects.get(oid)
        return None if entry is None else entry.holders.get(node)

    def pulls(self) -> list[tuple[str, bytes]]:
        return sorted((n, oid) for oid, e in self.d.objects.items()
                      for n, h in e.holders.items() if h.upstream is not None)

    def apply(self, ev) -> list[Command]:
        before = {oid: set(e.holders) for oid, e in self.d.objects.items()}
        if isinstance(ev, NodeLost):
            self.alive.discard(ev.node)
            for key in [k for k in self.open if k[0] == ev.node]:
                del self.open[key]
        elif isinstance(ev, NodeJoined):
            self.alive.add(ev.node)
        out = self.d.handle(ev)
        for cmd in out:
            # 6: nothing goes to a node that is not (or no longer) connected.
            assert cmd.node in self.alive, (ev, cmd)
            if isinstance(cmd, Drop):
                event("lost" if "lost" in cmd.reason else "deleted")
                assert cmd.node in before.get(cmd.oid, ()), (ev, cmd)
                assert cmd.node not in self.holders_of(cmd.oid)
                continue
            key = (cmd.node, cmd.request)
            # 5: one Reply per request, and only to requests still open (not cancelled).
            assert key not in self.replied and key in self.open, (ev, cmd)
            self.replied.add(key)
            op, oid = self.open.pop(key)
            if op == "locate":
                self.check_locate_reply(cmd, oid)
            elif op == "evict":
                # what may go was complete, pulled and idle, and is held elsewhere
                for freed in cmd.body.evicted:
                    event("a copy evicted")
                    assert freed in ev.oids and cmd.node not in self.holders_of(freed)
                    # what is freed is held complete elsewhere, or inline here
                    entry = self.d.objects[freed]
                    assert entry.inline is not None or any(
                        h.complete and n in self.d.nodes for n, h in entry.holders.items())
        return out

    def holders_of(self, oid: bytes) -> set[str]:
        entry = self.d.objects.get(oid)
        return set() if entry is None else set(entry.holders)

    def check_locate_reply(self, cmd: Reply, oid: bytes) -> None:
        body = cmd.body
        if isinstance(body, m.Failure):
            assert body.error == "ObjectNotFound"
            return
        entry = self.d.objects[oid]
        assert (body.size, body.layout) == (entry.size, entry.layout)
        mine = entry.holders[cmd.node]
        if body.sender is not None:
            # 4: a live holder other than the receiver, now registered as its upstream.
            sender = body.sender
            event("pipelined from a partial copy" if not entry.holders[sender].complete
                  else "pulled from a complete copy")
            assert sender != cmd.node and sender in entry.holders and sender in self.d.nodes
            assert body.address == self.d.nodes[sender]
            assert mine.upstream == sender and cmd.node in entry.holders[sender].serving
            assert sender not in mine.failed_from
            assert self.d._can_complete(entry, sender)  # never a dead end
            assert entry.inline is None and entry.size > 0
        elif body.inline is not None:
            assert body.inline == entry.inline and mine.complete
        else:
            assert body.local is True and mine.complete

    def send(self, op: str, ev) -> None:
        self.open[(ev.node, ev.request)] = (op, getattr(ev, "oid", None))
        self.apply(ev)

    # ------------------------------------------------------------- rules ---
    def someone(self, i: int) -> str:
        return sorted(self.alive)[i % len(self.alive)]

    def holdings(self) -> list[tuple[str, bytes]]:
        return sorted((n, oid) for oid, e in self.d.objects.items() for n in e.holders)

    @rule(node=st.sampled_from(NODES))
    def join(self, node: str) -> None:
        if node not in self.alive:
            self.apply(NodeJoined(node, "addr-" + node))

    @precondition(lambda self: len(self.alive) > 1)  # keep someone around to send events
    @rule(i=st.integers(0, 5))
    def lose(self, i: int) -> None:
        self.apply(NodeLost(self.someone(i)))

    @rule(i=st.integers(0, 5), oid=SOME_OID, clash=st.integers(0, 9))
    def put(self, i: int, oid: bytes, clash: int) -> None:
        node = self.someone(i)  # (hoplite_gpu.node never re-puts what it holds; we may)
        size, layout, inline = SPECS[oid]
        if clash == 7:  # now and then, a clashing put
            layout = {"clash": True}
        self.send("put", Put(node, self.rid(), oid, size, layout, inline))

    @rule(who=st.lists(st.integers(0, 5), min_size=1, max_size=4), oid=SOME_OID)
    def locate(self, who: list[int], oid: bytes) -> None:
        for i in who:
            node = self.someone(i)
            h = self.holder(node, oid)
            if (h is not None and h.upstream is not None) or any(
                    key[0] == node and v == ("locate", oid) for key, v in self.open.items()):
                continue  # one pull per object at a time
            self.send("locate", Locate(node, self.rid(), oid))

    @precondition(lambda self: self.pulls())
    @rule(i=st.integers(0, 50))
    def complete_pull(self, i: int) -> None:
        node, oid = self.pulls()[i % len(self.pulls())]
        self.apply(Completed(node, oid))

    @rule(i=st.integers(0, 5))
    def complete_put(self, i: int) -> None:
        node = self.someone(i)
        h = self.holder(node, BIG)
        if h is not None and h.origin and h.upstream is None:
            self.apply(Completed(node, BIG))

    def receivers(self) -> list[tuple[str, bytes]]:
        """Unfinished pulls, including those whose sender is gone (upstream cleared)."""
        return sorted((n, oid) for oid, e in self.d.objects.items() for n, h in e.holders.items()
                      if not (h.complete or h.origin) and any(r == n for r, _ in e.edges))

    @precondition(lambda self: self.receivers())
    @rule(i=st.integers(0, 50), have=st.integers(0, 400))
    def fail_pull(self, i: int, have: int) -> None:
        node, oid = self.receivers()[i % len(self.receivers())]
        entry = self.d.objects[oid]
        sender = entry.holders[node].upstream or [s for r, s in entry.edges if r == node][-1]
        self.apply(TransferFailed(node, oid, sender, have))

    @precondition(lambda self: self.pulls())
    @rule(i=st.integers(0, 50), nbytes=st.integers(0, 400))
    def progress(self, i: int, nbytes: int) -> None:
        node, oid = self.pulls()[i % len(self.pulls())]
        self.apply(Progress(node, oid, nbytes))

    @precondition(lambda self: self.holdings())
    @rule(picks=st.lists(st.integers(0, 50), min_size=1, max_size=3))
    def evict(self, picks: list[int]) -> None:
        node, _ = self.holdings()[picks[0] % len(self.holdings())]
        oids = tuple(self.holdings()[i % len(self.holdings())][1] for i in picks)
        self.send("evict", Evict(node, self.rid(), oids))

    @precondition(lambda self: self.holdings())
    @rule(i=st.integers(0, 50))
    def drop(self, i: int) -> None:
        self.apply(Dropped(*self.holdings()[i % len(self.holdings())]))

    @rule(i=st.integers(0, 5), oid=SOME_OID, rarely=st.integers(0, 3))
    def delete(self, i: int, oid: bytes, rarely: int) -> None:
        if rarely == 2:  # hypothesis favours 0: keep deletes rare, or objects die young
            self.send("delete", Delete(self.someone(i), self.rid(), oid))

    @rule(i=st.integers(0, 5), oid=SOME_OID, rarely=st.integers(0, 3))
    def query(self, i: int, oid: bytes, rarely: int) -> None:
        if rarely == 2:
            self.send("query", Query(self.someone(i), self.rid(), oid))

    @precondition(lambda self: any(v[0] == "locate" for v in self.open.values()))
    @rule(i=st.integers(0, 50))
    def cancel(self, i: int) -> None:
        keys = sorted(k for k, v in self.open.items() if v[0] == "locate")
        node, request = keys[i % len(keys)]
        del self.open[(node, request)]
        self.apply(CancelLocate(node, request))

    # -------------------------------------------------------- invariants ---
    @invariant()
    def links_are_consistent(self) -> None:
        assert_consistent(self.d)
        if any(h.upstream is not None and e.holders[h.upstream].upstream is not None
               for e in self.d.objects.values() for h in e.holders.values()):
            event("a pull chain two or more deep")

    @invariant()
    def every_object_can_still_complete(self) -> None:
        for entry in self.d.objects.values():
            assert entry.inline is not None or any(
                h.complete or h.origin for h in entry.holders.values())
            assert set(entry.holders) <= self.alive

    @invariant()
    def queues_hold_only_live_open_requests(self) -> None:
        assert all(self.d.pending.values()), "empty pending queue left behind"
        assert not set(self.d.pending) & set(self.d.objects)
        queued = [item for q in self.d.pending.values() for item in q]
        queued += [item for e in self.d.objects.values() for item in e.waiting]
        assert len(queued) == len(set(queued))
        assert set(queued) == {k for k, v in self.open.items() if v[0] == "locate"}
        assert all(node in self.alive for node, _ in queued)

    @invariant()
    def every_holder_is_indexed_and_the_index_only_names_live_nodes(self) -> None:
        # `holding` is what a node's loss visits: missing one would leave a
        # dead node holding (and serving) an object
        for key, entry in self.d.objects.items():
            for node in (*entry.holders, *(n for n in entry.relay if n in self.alive)):
                assert key in self.d.holding.get(node, {}), (node, key)
        assert set(self.d.holding) <= self.alive

    @invariant()
    def no_waiter_is_left_while_a_complete_copy_is_free(self) -> None:
        # 7, as far as state.py guarantees it: a free complete copy is always handed out
        for entry in self.d.objects.values():
            for node, _ in entry.waiting:
                event("a receiver waits")
                assert entry.inline is None and entry.size > 0
                mine = entry.holders.get(node)
                assert mine is None or not mine.complete
                assert mine is None or mine.upstream is None
                choice = self.d._pick_sender(entry, node)
                assert choice is None or not entry.holders[choice].complete, (node, choice)


DirectoryMachine.TestCase.settings = settings(max_examples=200, deadline=None,
                                              stateful_step_count=50)
TestDirectoryMachine = DirectoryMachine.TestCase



# ------------------------------------------------------------- eviction ---
def evicted(d: Directory, node: str, *oids: bytes, request: int = 99, need: int = 0) -> list[bytes]:
    (reply,) = d.handle(Evict(node, request, oids, need))
    assert isinstance(reply, Reply) and (reply.node, reply.request) == (node, request)
    return reply.body.evicted


def test_a_pulled_idle_copy_held_elsewhere_may_be_evicted_and_is_forgotten():
    d = make()
    put(d, "n0", complete=True)
    assert senders(d.handle(Locate("n1", 1, K))) == {("n1", 1): "n0"}
    assert evicted(d, "n1", K) == []  # still pulling: not complete
    d.handle(Completed("n1", K))
    assert evicted(d, "n1", K) == [K]
    assert set(d.objects[K].holders) == {"n0"}
    # the next receiver is sent to the origin, never to the evicted copy
    assert senders(d.handle(Locate("n2", 2, K))) == {("n2", 2): "n0"}


def test_an_eviction_with_a_need_frees_enough_or_nothing():
    """A call that cannot get room changes nothing: with `need`, the directory
    frees the first copies that may go until they make room, or none."""
    d = make()
    for origin, oid in (("n0", K), ("n3", K2)):
        put(d, origin, oid=oid, complete=True)
        d.handle(Locate("n1", 1, oid))
        d.handle(Completed("n1", oid))
    d.handle(NodeLost("n3"))  # n1's copy of K2 is the last one: it may not go
    assert evicted(d, "n1", K, K2, need=SIZE + 1) == []  # K alone is not enough
    assert set(d.objects[K].holders) == {"n0", "n1"}  # ... and stays counted
    assert evicted(d, "n1", K2, K, need=SIZE) == [K]  # enough: K goes
    assert set(d.objects[K].holders) == {"n0"}


def test_the_last_complete_copy_a_put_and_a_busy_sender_are_never_evicted():
    d = make()
    put(d, "n0", complete=True)
    d.handle(Locate("n1", 1, K))
    d.handle(Completed("n1", K))
    assert evicted(d, "n0", K) == []  # the origin: the put's own copy stays
    d.handle(NodeLost("n0"))
    assert evicted(d, "n1", K) == []  # now the only complete copy
    d.handle(Locate("n2", 2, K))  # n1 serves n2
    d.handle(NodeJoined("n0", "addr0"))
    d.handle(Locate("n0", 3, K))
    d.handle(Completed("n2", K))
    d.handle(Completed("n0", K))
    assert d.objects[K].holders["n1"].serving == set()
    assert evicted(d, "n1", K) == [K]  # n0 and n2 hold it now
    assert evicted(d, "n2", K) == [K]
    assert evicted(d, "n0", K) == []  # the last one


def test_inline_copies_go_unknown_ids_stay_and_reduce_inputs_stay():
    from hoplite_gpu.directory.state import ReduceRequested

    d = make()
    put(d, "n0", oid=K2, size=4, inline=b"abcd")
    d.handle(Locate("n1", 1, K2))
    assert evicted(d, "n1", K2, bytes(20)) == [K2]  # the directory has the bytes
    floats = {"kind": "numpy", "dtype": "<f4", "shape": [1 << 20], "nbytes": 4 << 20}
    put(d, "n0", size=4 << 20, layout=floats, complete=True)
    d.handle(Locate("n1", 2, K))
    d.handle(Completed("n1", K))
    d.handle(ReduceRequested("n2", 3, bytes([9] * 20), (K, bytes([8] * 20)), "sum", 2))
    assert not d.reduces[bytes([9] * 20)].failed
    assert evicted(d, "n1", K) == []  # an unfinished reduce may read this copy


def test_a_relay_node_keeps_its_copy_until_the_next_one_has_it():
    d = make()
    put(d, "n0", complete=True)
    d.objects[K].set_relay(("n1", "n2"))
    d.handle(Locate("n1", 1, K))
    d.handle(Completed("n1", K))
    assert evicted(d, "n1", K) == []  # n2 will pull from n1 and from n1 alone
    d.handle(Locate("n2", 2, K))
    d.handle(Completed("n2", K))
    assert evicted(d, "n1", K) == [K]


def test_a_restarted_directory_takes_an_announced_pulled_copy_for_what_it_is():
    d = make()
    d.handle(Completed("n1", K, SIZE, LAYOUT))  # re-announced: n1 had pulled it
    assert not d.objects[K].holders["n1"].origin
    d.handle(Locate("n2", 1, K))
    d.handle(Completed("n2", K))
    assert evicted(d, "n1", K) == [K]
    d.handle(Completed("n3", K2, SIZE, LAYOUT, own=True))  # n3 had put it
    assert d.objects[K2].holders["n3"].origin


def test_a_restarted_directory_counts_every_announced_copy_and_a_delete_reaches_every_node():
    d = make(nodes=4)
    d.handle(Completed("n1", K, SIZE, LAYOUT, own=True))  # announced by each holder in turn
    d.handle(Completed("n2", K, SIZE, LAYOUT))
    d.handle(Completed("n3", K, SIZE + 1, LAYOUT))  # not the same object: not counted
    assert {n: h.complete for n, h in d.objects[K].holders.items()} == {"n1": True, "n2": True}
    out = d.handle(Delete("n0", 5, K))
    # n3's copy, and any whose announcement is still on its way, must go too
    assert sorted(c.node for c in out if isinstance(c, Drop)) == ["n1", "n2", "n3"]


def test_a_pull_completion_that_crossed_a_delete_is_not_taken_for_a_copy_of_the_new_object():
    d = make()
    put(d, "n0", complete=True)
    d.handle(Locate("n1", 1, K))
    d.handle(Delete("n0", 2, K))
    put(d, "n0", request=3, complete=True)  # the same id again, new bytes
    d.handle(Completed("n1", K, SIZE, LAYOUT))  # n1's pull of the old one, sent before its drop
    assert set(d.objects[K].holders) == {"n0"}


def test_a_pull_completion_that_crossed_a_delete_makes_no_phantom_object():
    d = make()
    put(d, "n0", complete=True)
    d.handle(Locate("n1", 1, K))
    d.handle(Delete("n0", 2, K))
    d.handle(Completed("n1", K, SIZE, LAYOUT))  # sent before n1 heard of the delete
    assert K not in d.objects
    # so a get before the next put waits for it instead of being sent to n1
    assert d.handle(Locate("n2", 3, K)) == [] and K in d.pending
    # a restarted directory has no such memory: an announcement registers
    fresh = make()
    fresh.handle(Completed("n1", K, SIZE, LAYOUT))
    assert set(fresh.objects[K].holders) == {"n1"}


def test_delete_many_refuses_ids_of_the_wrong_shape_on_the_wire():
    from hoplite_gpu.directory.wire import to_event
    from hoplite_gpu.errors import ProtocolError

    assert to_event("n0", {"op": "delete_many", "rid": 1, "oids": [K, K2]}).oids == (K, K2)
    for oids in ([K, b"short"], [K, "text" * 5], K):
        with pytest.raises(ProtocolError):
            to_event("n0", {"op": "delete_many", "rid": 1, "oids": oids})


def test_a_directory_pause_is_not_counted_against_the_nodes_leases():
    """A directory stopped for longer than a lease (SIGSTOP, Ctrl-Z, a
    debugger) found every node's last ping too old when it resumed, its first
    Tick running before the pings queued in its sockets were read: it
    declared every live node dead. A gap between Ticks of many tick periods
    is the directory's own pause and is not counted; a node that stays
    silent after it still dies a lease later."""
    d = Directory(lease_s=1.5, tick_s=0.25)
    d.handle(NodeJoined("n0", "addr0", now=0.0))
    d.handle(NodeJoined("n1", "addr1", now=0.0))
    for t in (0.25, 0.5):
        d.handle(Heartbeat("n0", now=t))
        d.handle(Heartbeat("n1", now=t))
        assert d.handle(Tick(now=t)) == []
    assert d.handle(Tick(now=3.0)) == []  # the directory was stopped from 0.5 to 3.0
    lost = []
    for i in range(1, 9):  # n0's queued pings are read and it goes on; n1 stays silent
        t = 3.0 + 0.25 * i
        d.handle(Heartbeat("n0", now=t))
        lost += [(t, c.node) for c in d.handle(Tick(now=t)) if isinstance(c, Disconnect)]
    assert lost == [(4.75, "n1")]
