"""Direct calls: blocking puts and gets of inline objects made on the caller's
thread over its own directory connection (hoplite_gpu.direct), and the
directory's side of them (attach, inline-only locates)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu import collectives
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


def test_inline_only_locate_of_a_pulled_object_answers_at_once_without_an_edge():
    d = _directory()
    d.handle(state.Put("a", 1, OID, 1 << 20, {"kind": "bytes"}))
    out = d.handle(state.Locate("b", -7, OID, inline_only=True))
    [(node, rid, body)] = _replies(out)
    assert (node, rid, body["not_inline"], body["size"]) == ("b", -7, True, 1 << 20)
    entry = d.objects[OID]
    assert entry.edges == [] and "b" not in entry.holders and not entry.waiting
    assert not d.inline_only


def test_waiting_inline_only_locate_gets_bytes_or_not_inline_when_the_put_comes():
    d = _directory()
    assert d.handle(state.Locate("b", -1, OID, inline_only=True)) == []
    assert d.handle(state.Locate("c", 5, OID)) == []  # a node's own locate, beside it
    out = d.handle(state.Put("a", 1, OID, 1 << 20, {"kind": "bytes"}))
    by_node = {node: body for node, _, body in _replies(out) if node != "a"}
    assert by_node["b"].get("not_inline") is True
    assert by_node["c"]["sender"] == "a"  # the plain locate still gets its sender
    assert [r for r, _ in d.objects[OID].edges] == ["c"] and not d.inline_only

    small = b"s" * 20
    d.handle(state.Locate("b", -2, small, inline_only=True))
    out = d.handle(state.Put("a", 2, small, 3, {"kind": "bytes"}, b"xyz"))
    assert [body["inline"] for node, _, body in _replies(out) if node == "b"] == [b"xyz"]
    assert not d.inline_only


def test_withdrawn_or_orphaned_inline_only_locates_leave_nothing_behind():
    d = _directory()
    d.handle(state.Locate("b", -1, OID, inline_only=True))
    d.handle(state.Locate("c", -2, b"p" * 20, inline_only=True))
    d.handle(state.CancelLocate("b", -1))
    d.handle(state.NodeLost("c"))
    assert not d.inline_only and not d.pending


# ------------------------------------------------------------- end to end ---
@pytest.fixture
def local():
    hg.init(timeout_s=20)
    yield hg.runtime()
    hg.shutdown()


@pytest.fixture
def other(local):
    """A second node of the same cluster in this process."""
    rt = Runtime(Config.from_env(token=local.token, timeout_s=20), local.address)
    yield rt
    rt.close()


def _directory_idle(rt) -> bool:
    async def peek():
        s = rt.directory.state
        return not s.inline_only and not s.pending and not rt.directory._direct_requests
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


def test_a_large_object_falls_back_to_the_loop_without_a_stray_edge(local, other):
    oid = hg.ObjectID.from_name("large")
    result = {}
    th = threading.Thread(target=lambda: result.setdefault("v", other.direct.get(oid, 10, "numpy")))
    th.start()
    time.sleep(0.2)
    big = np.arange(1 << 18, dtype=np.float64)  # 2 MiB, above inline_threshold
    hg.put(big, oid)
    th.join(10)
    assert result["v"] is MISS
    assert hg.object_info(oid)["edges"] == []  # the direct locate assigned no sender
    got = other.call(other.node.get(oid, 10, "numpy"), 10)
    assert np.array_equal(got, big)
    assert other.direct.gets == 0


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
        reply = link.request({"op": "query", "oid": OID}, time.monotonic() + 5)
        assert reply["error"] == "ProtocolError"
        reply = link.request({"op": "put", "oid": OID, "size": 1 << 20,
                              "layout": {"kind": "bytes"}}, time.monotonic() + 5)
        assert reply["error"] == "ProtocolError"  # a put without its bytes
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
    # the reduce is remembered for a restarted directory, as a node's own
    assert collectives._reduce_ids("ar", 3, "sum", None)[1] in local.node._my_reduces

    got = collectives.allgather(b"r0", name="ag", rank=0, size=1, timeout=10)
    assert got == [b"r0"] and hg.node_stats()["direct_gets"] == 2
    assert collectives.reduce(np.ones(2), name="w", rank=0, size=1, wait=True) is not None


def test_a_small_collective_with_a_large_input_takes_the_loops_path(local):
    hg.put(np.ones(1 << 17), collectives.input_id("big", 1))  # 1 MiB: pulled, not inline
    out = collectives.allgather(np.zeros(1 << 17), name="big", rank=0, size=2, timeout=10)
    assert out[1].sum() == 1 << 17
    assert hg.node_stats()["direct_gets"] == 0
