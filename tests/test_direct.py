"""Direct calls: blocking puts and gets of inline objects made on the caller's
thread over its own directory connection (hoplite_gpu.direct), and the
directory's side of them (attach, direct locates, the located push)."""

from __future__ import annotations

import os
import socket
import threading
import time
import warnings

import msgpack
import numpy as np
import pytest
from in_process import holders_after_direct_calls, swallow_first_ok

import hoplite_gpu as hg
from hoplite_gpu import collectives
from hoplite_gpu import direct as direct_module
from hoplite_gpu import messages as m
from hoplite_gpu.config import Config
from hoplite_gpu.direct import MISS, DirectLink
from hoplite_gpu.directory import state
from hoplite_gpu.errors import ProtocolError
from hoplite_gpu.runtime import Runtime
from hoplite_gpu.transports import split_address

OID = b"o" * 20


# ------------------------------------------------------ the state machine ---
def _directory() -> state.Directory:
    d = state.Directory()
    for n in ("a", "b", "c"):
        d.handle(state.NodeJoined(n, f"tcp://{n}:1", 0.0))
    return d


def _replies(out):
    return [(c.node, c.request, c.body) for c in out if isinstance(c, state.Reply)]


def test_a_direct_locate_sends_the_sender_to_the_node_and_bytes_to_the_thread():
    d = _directory()
    d.handle(state.Put("a", 1, OID, 1 << 20, {"kind": "bytes"}))
    out = d.handle(state.Locate("b", -7, OID, direct=True))
    [push] = [c for c in out if isinstance(c, state.PushLocated)]
    assert (push.node, push.oid, push.body.sender) == ("b", OID, "a")
    [(node, rid, body)] = _replies(out)
    assert (node, rid, body.pushed, body.size) == ("b", -7, True, 1 << 20)
    assert out.index(push) < out.index(next(c for c in out if isinstance(c, state.Reply)))
    assert list(d.objects[OID].edges) == [("b", "a")] and not d.direct

    small = b"s" * 20
    assert d.handle(state.Locate("b", -2, small, direct=True)) == []  # waits for the put
    out = d.handle(state.Put("a", 2, small, 3, {"kind": "bytes"}, b"xyz"))
    assert [body.inline for node, _, body in _replies(out) if node == "b"] == [b"xyz"]
    assert not [c for c in out if isinstance(c, state.PushLocated)] and not d.direct


def test_a_direct_locate_never_disturbs_the_nodes_own_pull():
    d = _directory()
    d.handle(state.Put("a", 1, OID, 1 << 20, {"kind": "bytes"}))
    d.handle(state.Locate("b", 5, OID))  # b's loop pulls from a
    [(_, _, body)] = _replies(d.handle(state.Locate("b", -1, OID, direct=True)))
    assert body.held is True and body.sender is None
    assert d.objects[OID].holders["b"].upstream == "a" and list(d.objects[OID].edges) == [("b", "a")]

    # both waiting before the put: the first is served, the second sees b pulling
    other = b"q" * 20
    d.handle(state.Locate("c", 6, other))
    d.handle(state.Locate("c", -2, other, direct=True))
    out = d.handle(state.Put("a", 2, other, 1 << 20, {"kind": "bytes"}))
    by_rid = {rid: body for node, rid, body in _replies(out) if node == "c"}
    assert by_rid[6].sender == "a" and by_rid[-2].held is True
    assert not d.direct


def test_withdrawn_or_orphaned_direct_locates_leave_nothing_behind():
    d = _directory()
    d.handle(state.Locate("b", -1, OID, direct=True))
    d.handle(state.Locate("c", -2, b"p" * 20, direct=True))
    d.handle(state.CancelLocate("b", -1))
    d.handle(state.NodeLost("c"))
    assert not d.direct and not d.pending


# ------------------------------------------------------------- end to end ---


@pytest.fixture
def other(local):
    """A second node of the same cluster in this process."""
    rt = Runtime(Config.from_env(token=local.token, timeout_s=20), local.address)
    yield rt
    rt.close()


def _directory_idle(rt) -> bool:
    async def peek():
        s = rt.directory.state
        return not s.direct and not s.pending and not rt.directory._direct_requests
    return rt.call(peek(), 5)


def test_small_put_and_get_go_direct_and_come_back_the_same(local, other):
    a = np.arange(100, dtype=np.float32).reshape(10, 10)
    oid = hg.put(a)
    got = other.direct.get(oid, 5, "numpy")
    assert got.dtype == a.dtype and np.array_equal(got, a) and not got.flags.writeable
    stats = hg.node_stats()
    assert stats["direct_puts"] == 1
    assert other.direct.gets == 1
    # the putting node holds it, as after a put through the loop
    assert stats["objects"] == 1 and hg.object_info(oid)["size"] == a.nbytes
    assert hg.get(hg.put(b"tiny")) == b"tiny"


def test_direct_get_waits_for_a_later_put_and_times_out_cleanly(local, other):
    oid = hg.ObjectID.from_name("later")
    result = {}

    def getter():
        result["v"] = other.direct.get(oid, 10, "numpy")
    th = threading.Thread(target=getter)
    th.start()
    time.sleep(0.2)
    hg.put(np.full(3, 7, dtype=np.int16), oid)
    th.join(10)
    assert result["v"].tolist() == [7, 7, 7]

    started = time.monotonic()
    with pytest.raises(hg.Timeout, match="not available within"):
        other.direct.get(hg.ObjectID.from_name("never"), 0.3, "numpy")
    assert time.monotonic() - started < 2
    assert _directory_idle(local)  # the withdrawn locate left nothing waiting
    # the link survived its timeout: the next call uses it
    assert other.direct.get(oid, 5, "numpy").tolist() == [7, 7, 7]


def test_a_large_object_is_pulled_by_the_node_the_directory_told(local, other):
    oid = hg.ObjectID.from_name("large")
    result = {}
    th = threading.Thread(target=lambda: result.setdefault("v", other.direct.get(oid, 10, "numpy")))
    th.start()
    time.sleep(0.2)
    big = np.arange(1 << 18, dtype=np.float64)  # 2 MiB, above inline_threshold
    hg.put(big, oid)
    th.join(10)
    assert result["v"] is MISS  # the rest is the loop's: it was told where to pull from
    deadline = time.monotonic() + 5
    while not other.call(other.node.stats(), 5)["objects"] and time.monotonic() < deadline:
        time.sleep(0.01)  # the node pulls without being asked by a get
    got = other.call(other.node.get(oid, 10, "numpy"), 10)
    assert np.array_equal(got, big)
    # one locate, one edge: the get joined the pull the directory started
    assert hg.object_info(oid)["edges"] == [[other.node.node_id, local.node.node_id]]
    assert other.direct.gets == 0
    # asked again, now that this node holds it: the loop's get, from the store
    assert other.direct.get(oid, 5, "numpy") is MISS


def test_a_thread_that_gives_up_leaves_the_pull_to_the_node(local, other):
    oid = hg.put(np.ones(1 << 18))
    assert other.direct.get(oid, 5, "numpy") is MISS  # and nobody asks the loop for it
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        holders = {h["node"]: h for h in hg.object_info(oid)["holders"]}
        if holders.get(other.node.node_id, {}).get("complete"):
            break
        time.sleep(0.02)
    assert holders[other.node.node_id]["complete"]  # no sender's slot stays taken


def test_through_the_api_a_large_get_still_works(local):
    big = np.ones(1 << 18)
    assert hg.get(hg.put(big)).sum() == big.size
    assert hg.node_stats()["direct_puts"] == 0


def test_a_broken_link_falls_back_to_the_loop(local, other):
    oid = hg.put(b"abc")
    assert other.direct.get(oid, 5, "numpy") == b"abc"

    async def cut():  # the directory drops every direct connection
        for peer in local.directory.peers.values():
            for direct in list(peer.directs):
                await direct.stream.close()
    local.call(cut(), 5)
    time.sleep(0.1)
    before = other.direct.gets
    assert other.direct.get(oid, 5, "numpy") is MISS
    assert other.call(other.node.get(oid, 5, "numpy"), 5) == b"abc"
    # and a new link is made for the call after (of an object not held there yet)
    assert other.direct.get(hg.put(b"def"), 5, "numpy") == b"def"
    assert other.direct.gets == before + 1


def test_direct_calls_can_be_turned_off(local):
    hg.shutdown()
    hg.init(timeout_s=20, direct_calls=False)
    assert hg.get(hg.put(b"x")) == b"x"
    stats = hg.node_stats()
    assert stats["direct_puts"] == stats["direct_gets"] == 0


def test_the_directory_refuses_what_a_direct_connection_may_not_ask(local):
    _, host, port = split_address(local.address)
    link = DirectLink(host, port, local.token, local.node.node_id, 5)
    try:
        [reply] = link.requests([m.Query(rid=0, oid=OID)], time.monotonic() + 5)
        assert isinstance(reply, m.Failure) and reply.error == "ProtocolError"
        [reply] = link.requests([m.Put(rid=0, oid=OID, size=1 << 20,
                                       layout={"kind": "bytes"})], time.monotonic() + 5)
        assert reply.error == "ProtocolError"  # a put without its bytes
    finally:
        link.close()
    with pytest.raises(ProtocolError, match="not registered"):
        DirectLink(host, port, local.token, "nobody-1-abc", 5)
    with pytest.raises(hg.AuthenticationFailed):
        DirectLink(host, port, "wrong-token", local.node.node_id, 5)


def test_small_collectives_run_from_the_callers_thread(local):
    for r in (1, 2):
        hg.put(np.full(4, r, dtype=np.float32), collectives.input_id("ar", r))
    out = collectives.allreduce(np.full(4, 10, dtype=np.float32), name="ar", rank=0, size=3,
                                timeout=10)
    assert out.tolist() == [13.0] * 4
    stats = hg.node_stats()
    assert (stats["direct_puts"], stats["direct_gets"]) == (3, 1)
    # the result is in hand: nothing to ask a restarted directory again (as on
    # the loop's path once a get has the result)
    assert collectives._reduce_ids("ar", 3, "sum", None)[1] not in local.node._my_reduces
    # a rank that waited for the reduce to be done asks nothing again either:
    # the result's holder announces it to a restarted directory
    hg.put(np.ones(2), collectives.input_id("w1", 0))
    assert collectives.reduce(np.ones(2), name="w1", rank=1, size=2, wait=True) is None
    hg.node_stats()  # (a call through the loop: what the direct call handed it is done)
    assert collectives._reduce_ids("w1", 2, "sum", None)[1] not in local.node._my_reduces

    got = collectives.allgather(b"r0", name="ag", rank=0, size=1, timeout=10)
    assert got == [b"r0"] and hg.node_stats()["direct_gets"] == 2
    assert collectives.reduce(np.ones(2), name="w", rank=0, size=1, wait=True) is not None


def test_a_direct_reduce_given_up_at_its_deadline_is_still_remembered(local):
    with pytest.raises(hg.Timeout, match="did not finish within"):
        collectives.reduce(np.ones(2), name="late", rank=1, size=2, wait=True, timeout=0.3)
    hg.node_stats()  # (a call through the loop: what the direct call handed it is done)
    assert collectives._reduce_ids("late", 2, "sum", None)[1] in local.node._my_reduces


def test_a_gather_of_small_and_large_objects_takes_each_its_way(local, other):
    # ranks 1 and 2 on the other node; rank 1's is 1 MiB: pulled, not inline
    other.call(other.node.put(np.ones(1 << 17), collectives.input_id("mix", 1)), 10)
    other.call(other.node.put(np.full(3, 2.0), collectives.input_id("mix", 2)), 10)
    out = collectives.gather(np.zeros(4), name="mix", rank=0, size=3, timeout=10)
    assert [float(x.sum()) for x in out] == [0.0, float(1 << 17), 6.0]
    assert hg.node_stats()["direct_gets"] == 2  # ranks 0 and 2 came inline


def test_a_drop_that_overtakes_a_direct_put_leaves_no_stale_copy(local):
    """A delete elsewhere can reach the node between the directory's ok to a
    direct put and the loop keeping the bytes: the loop must not keep them
    (a later put of the id would take that copy for its own, unregistered)."""
    oid = hg.ObjectID.from_name("raced")
    node = local.node
    since = node.forgets

    async def race():
        node._forget(oid, hg.ObjectNotFound("deleted elsewhere"))  # the drop came first
        node.keep_inline(oid, *hg.values.to_buffer(b"old")[1:], b"old", since)
        return node.store.get(oid)
    assert local.call(race(), 5) is None
    hg.put(b"new", oid)  # registered again, and kept
    assert hg.get(oid) == b"new" and hg.object_info(oid)["holders"]


def test_a_direct_put_given_up_at_its_deadline_is_withdrawn():
    """A direct put whose answer never came raised Timeout but left the
    object registered with this node as its holder, a node that holds
    nothing: the put must be undone, as the loop's put given up is."""
    hg.init(timeout_s=0.5)
    try:
        rt = hg.runtime()
        server = rt.directory
        swallowed = swallow_first_ok(server)
        oid = hg.ObjectID.from_name("never-answered")
        with pytest.raises(hg.Timeout):
            hg.put(b"lost", oid)
        assert swallowed, "the put did not go direct"
        assert holders_after_direct_calls(rt, oid) == []
    finally:
        hg.shutdown()


def test_a_forked_child_does_not_use_its_parents_connections(local):
    assert local.direct._usable()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (forking a threaded process)
        pid = os.fork()
    if pid == 0:  # the child: its copies of the links must not be used
        os._exit(0 if not local.direct._usable() else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert local.direct._usable()  # the parent's still are


def test_after_a_fork_calls_take_the_loops_path(local):
    direct_module._forked()  # what the at-fork hook does in a child
    assert hg.get(hg.put(b"x")) == b"x"
    stats = hg.node_stats()
    assert stats["direct_puts"] == stats["direct_gets"] == 0


def test_the_nodes_own_connection_cannot_pass_for_a_direct_one(local):
    async def ask():
        node = local.node
        node.client.start(m.Locate(rid=0, oid=OID, direct=True))
        node.client.start(m.Put(rid=0, oid=OID, size=1, layout={"kind": "bytes"},
                                inline=b"z"), -5)
        await node.client.request(m.Nodes(), 5)  # (after the two, on one connection)
    local.call(ask(), 5)
    assert _directory_idle(local) and OID not in local.directory.state.objects


# ------------------------------------------------- a link's own framing ---
def _bare_link() -> tuple[DirectLink, socket.socket]:
    """A DirectLink on one end of a socket pair (no directory, no handshake),
    and the other end, which plays the directory."""
    ours, theirs = socket.socketpair()
    link = object.__new__(DirectLink)
    link.peer, link.last_used, link._next_rid, link._buf, link._sock = "pair", 0.0, 1, bytearray(), ours
    return link, theirs


def _framed(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


def test_a_link_matches_replies_by_id_across_split_receives_and_skips_late_ones():
    link, peer = _bare_link()
    try:
        late = _framed(msgpack.packb({"rid": 0, "ok": "withdrawn earlier"}))
        second = _framed(msgpack.packb({"rid": 2, "size": 2, "layout": {}}))
        first = _framed(msgpack.packb({"rid": 1, "size": 3000, "layout": {},
                                       "inline": b"x" * 3000}))
        stream = late + second + first

        def answer():
            time.sleep(0.05)
            for i in range(0, len(stream), 7):  # in small pieces: messages span receives
                peer.sendall(stream[i:i + 7])

        t = threading.Thread(target=answer)
        t.start()
        replies = link.requests([m.Locate(rid=0, oid=OID), m.Locate(rid=0, oid=OID)],
                                time.monotonic() + 5)
        t.join()
        assert [r.size for r in replies] == [3000, 2] and replies[0].inline == b"x" * 3000
        assert [r.rid for r in replies] == [1, 2]
        sent = [msgpack.unpackb(b) for b in _split_frames(peer.recv(1 << 16))]
        assert sent == [{"op": "locate", "rid": 1, "oid": OID},
                        {"op": "locate", "rid": 2, "oid": OID}]
    finally:
        link.close()
        peer.close()


def _split_frames(data: bytes) -> list[bytes]:
    out = []
    while data:
        n = int.from_bytes(data[:4], "big")
        out.append(data[4:4 + n])
        data = data[4 + n:]
    return out


@pytest.mark.parametrize("frame, says", [
    (_framed(b"\xc1"), "undecodable"),                     # a byte msgpack never uses
    (_framed(msgpack.packb([1, 2])), "expected a map"),
    ((65 * 1024 * 1024).to_bytes(4, "big"), "exceeds"),
])
def test_a_link_refuses_a_bad_reply_with_a_protocol_error(frame, says):
    link, peer = _bare_link()
    try:
        peer.sendall(frame)
        with pytest.raises(ProtocolError, match=says):
            link.requests([m.Locate(rid=0, oid=OID)], time.monotonic() + 5)
    finally:
        link.close()
        peer.close()


def test_a_link_withdraws_what_is_unanswered_at_its_deadline():
    link, peer = _bare_link()
    try:
        with pytest.raises(direct_module._Expired):
            link.requests([m.Locate(rid=0, oid=OID)], time.monotonic() + 0.1)
        msgs = [msgpack.unpackb(b) for b in _split_frames(peer.recv(1 << 16))]
        assert msgs == [{"op": "locate", "rid": 1, "oid": OID}, {"op": "cancel", "request": 1}]
    finally:
        link.close()
        peer.close()
