"""Rails and paths: a node on several addresses (rails), pulls spread over
the rails a receiver shares with its sender, and ECMP path pinning by source
port (docs/fabric.md, "Rails and paths").

Loopback stands for the fabric: every 127.x.y.z is this host's, and
127.0.1.0/24 and 127.0.2.0/24 are two subnets, so 127.0.1.1 and 127.0.2.1
are two rails of one node. Shared memory is off wherever bytes must cross
the transport."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import socket

import numpy as np
import pytest
from in_process import count_writes, cut_halfway, free_ports, run_nodes

import hoplite_gpu as hg
from hoplite_gpu import messages as m
from hoplite_gpu.balance import least_loaded
from hoplite_gpu.config import Config
from hoplite_gpu.directory import state as s
from hoplite_gpu.errors import ConfigError, ConnectionRefused
from hoplite_gpu.node.engine import plan_for
from hoplite_gpu.node.paths import MapFile, PathTable, parse_map
from hoplite_gpu.node.rails import pairs, rails_of
from hoplite_gpu.node.store import ChunkStore
from hoplite_gpu.transports import Bind, get_backend
from hoplite_gpu.values import Layout

MiB = 1 << 20
OID = b"r" * 20


# -- settings -----------------------------------------------------------------


def test_node_host_lists_rails_with_their_prefixes():
    config = Config(node_host=" 10.0.0.5/24 ,10.1.0.5, [fe80::1]/64,host-b")
    assert config.node_hosts() == [("10.0.0.5", 24), ("10.1.0.5", None), ("fe80::1", 64),
                                   ("host-b", None)]
    assert Config().node_hosts() == [("127.0.0.1", None)]  # (today's: one address)
    assert Config(node_host="0.0.0.0").node_hosts() == [("0.0.0.0", None)]


@pytest.mark.parametrize("settings, named", [
    ({"HOPLITE_NODE_HOST": "10.0.0.1,,10.0.0.2"}, "HOPLITE_NODE_HOST"),
    ({"HOPLITE_NODE_HOST": "0.0.0.0,10.0.0.2"}, "HOPLITE_NODE_HOST"),
    ({"HOPLITE_NODE_HOST": "10.0.0.1/33"}, "HOPLITE_NODE_HOST"),
    ({"HOPLITE_NODE_HOST": "host-a/24"}, "HOPLITE_NODE_HOST"),
    ({"HOPLITE_NODE_HOST": "10.0.0.1,10.0.0.1"}, "HOPLITE_NODE_HOST"),
    ({"HOPLITE_NODE_HOST": ",".join(f"10.0.0.{i}" for i in range(17))}, "HOPLITE_NODE_HOST"),
    ({"HOPLITE_PATHS": "0"}, "HOPLITE_PATHS"),
    ({"HOPLITE_PATHS": "65"}, "HOPLITE_PATHS"),
    ({"HOPLITE_PATHS": "2", "HOPLITE_TRANSPORT": "ucx"}, "HOPLITE_PATHS"),
    ({"HOPLITE_PATH_PORTS": "62000"}, "HOPLITE_PATH_PORTS"),
    ({"HOPLITE_PATH_PORTS": "80-90"}, "HOPLITE_PATH_PORTS"),
    ({"HOPLITE_PATH_PORTS": "62010-62000"}, "HOPLITE_PATH_PORTS"),
    ({"HOPLITE_PATHS": "4", "HOPLITE_PATH_PORTS": "62000-62002"}, "HOPLITE_PATH_PORTS"),
    ({"HOPLITE_PATH_MAP": "/tmp/map.json"}, "HOPLITE_PATH_MAP"),
])
def test_bad_rail_and_path_settings_are_refused_naming_the_setting(settings, named):
    with pytest.raises(ConfigError, match=named):
        Config.from_env(settings)


def test_a_bad_port_map_is_refused_naming_the_file_and_the_entry(tmp_path):
    ports = range(62000, 62010)
    with pytest.raises(ConfigError, match="port '61999' is not in path_ports"):
        parse_map({"*": {"61999": 0}}, 2, ports, "map")
    with pytest.raises(ConfigError, match="maps to path 2; paths are 0 to 1"):
        parse_map({"*": {"62000": 2}}, 2, ports, "map")
    with pytest.raises(ConfigError, match=re.escape("not {port: path}")):
        parse_map({"*": [62000]}, 2, ports, "map")
    bad = tmp_path / "map.json"
    bad.write_text("{not json")
    table = PathTable(2, ports)
    with pytest.raises(ConfigError, match=r"HOPLITE_PATH_MAP=.*map\.json.*cannot read"):
        MapFile(str(bad), table).refresh()
    with pytest.raises(ConfigError, match="cannot read"):
        MapFile(str(tmp_path / "absent.json"), table).refresh()


def test_a_node_refuses_to_start_with_an_unreadable_port_map(tmp_path):
    """The map is read at start: a node with a bad one does not join."""
    config = Config(paths=2, path_map=str(tmp_path / "absent.json"), shared_memory=False)

    async def body(directory):
        raise AssertionError("not reached")

    with pytest.raises(ConfigError, match="HOPLITE_PATH_MAP"):
        run_nodes([config], body, bound=10)


# -- pure parts -----------------------------------------------------------------


def test_least_loaded_ties_go_to_the_least_carried_then_the_first():
    assert least_loaded([3.0, 1.0, 2.0], lambda i: 0.0) == 1
    assert least_loaded([1.0, 1.0, 1.0], [5.0, 2.0, 2.0].__getitem__) == 1
    assert least_loaded([1.0, 1.05, 0.0], [0.0, 0.0, 9.0].__getitem__, tol=0.1) == 2
    assert least_loaded([1.0, 1.05], [3.0, 0.0].__getitem__, tol=0.1) == 1
    with pytest.raises(ValueError):
        least_loaded([], lambda i: 0.0)


def test_rails_pair_the_addresses_that_share_a_subnet():
    mine = rails_of(["tcp://127.0.1.2:5", "tcp://127.0.2.2:6"], [None, 24])
    assert [str(r.network) for r in mine] == ["127.0.1.0/24", "127.0.2.0/24"]
    theirs = ["tcp://127.0.2.1:7", "tcp://127.0.1.1:8"]
    assert pairs(mine, theirs) == [("127.0.2.2", "tcp://127.0.2.1:7"),
                                   ("127.0.1.2", "tcp://127.0.1.1:8")]
    # (a sender on a subnet none of ours reaches: no pair, the pull is routed as today)
    assert pairs(mine, ["tcp://10.9.9.9:1", "tcp://peer-host:2"]) == []
    # one NIC of ours against two of theirs on its subnet: both pairs
    wide = rails_of(["tcp://127.0.0.9:5"], [16])
    assert pairs(wide, ["tcp://127.0.1.1:7", "tcp://127.0.2.1:8"]) == [
        ("127.0.0.9", "tcp://127.0.1.1:7"), ("127.0.0.9", "tcp://127.0.2.1:8")]
    assert [str(r.network) for r in rails_of(["tcp://[fe80::1]:5"], [None])] == ["fe80::/64"]


def test_paths_are_assigned_least_loaded_first_and_distinct_within_a_pull():
    table = PathTable(4, range(62000, 62100))
    assert table.assign("a", 4, 10.0) == [0, 1, 2, 3]  # one pull: a sub-flow on each
    assert table.assign("a", 2, 5.0) == [0, 1]  # all equal: the lowest, then the next
    assert table.assign("a", 2, 5.0) == [2, 3]  # the least loaded now
    table.ended("a", 1, 10.0)
    table.ended("a", 1, 5.0)
    # path 1 is idle now; 0, 2 and 3 tie, now and in all: the first of them
    assert table.assign("a", 2, 1.0) == [1, 0]
    # ties now go to the path that carried least in all
    table.ended("a", 0, 16.0)
    table.ended("a", 1, 1.0)
    assert table.active["a"] == [0.0, 0.0, 15.0, 15.0]
    assert table.total["a"] == [16.0, 16.0, 15.0, 15.0]
    table.ended("a", 2, 15.0)
    assert table.assign("a", 1, 1.0) == [2]
    # a pull of more sub-flows than paths: each path once, then again
    other = PathTable(2, range(62000, 62010))
    assert other.assign("b", 5, 1.0) == [0, 1, 0, 1, 0]
    # rails keep loads of their own; the same loads give the same answer
    assert PathTable(4, range(62000, 62100)).assign("c", 3, 2.0) == [0, 1, 2]


def test_ports_of_a_path_come_from_its_class_or_the_map():
    table = PathTable(3, range(62000, 62010))
    assert table.ports(0, "tcp://127.0.0.1:9") == (62000, 62003, 62006, 62009)
    assert table.ports(2, "tcp://127.0.0.1:9") == (62002, 62005, 62008)
    table.port_map = {"10.0.0.2:4000": {62007: 1, 62001: 1, 62004: 0},
                      "10.0.0.3": {62009: 2}, "*": {62008: 0}}
    assert table.ports(1, "tcp://10.0.0.2:4000") == (62001, 62007)  # host:port, lowest first
    assert table.ports(2, "tcp://10.0.0.3:1") == (62009,)  # host
    assert table.ports(0, "tcp://10.0.0.4:1") == (62008,)  # anything else
    assert table.ports(2, "tcp://10.0.0.2:4000") == (62002, 62005, 62008)  # not mapped: class
    with pytest.raises(ValueError):
        table.ports(3, "tcp://10.0.0.2:4000")


def test_a_port_map_file_is_read_again_when_it_changes(tmp_path):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"*": {"62001": 0}}))
    table = PathTable(2, range(62000, 62010))
    maps = MapFile(str(path), table)
    maps.refresh()
    assert table.ports(0, "tcp://h:1") == (62001,)
    path.write_text(json.dumps({"*": {"62003": 0, "62005": 0}}))
    os.utime(path, ns=(1, 10**18))  # (a new mtime even on a coarse clock)
    maps.refresh()
    assert table.ports(0, "tcp://h:1") == (62003, 62005)


def _stored(size: int):
    store = ChunkStore(0)
    return store.create(hg.ObjectID(OID), Layout("bytes", "uint8", (size,), size))


def test_one_senders_routes_share_the_pull_equally_pieces_dealt_in_turn():
    """Ethereal's split: pieces dealt to the routes in turn (each pulls its
    own one after another), an equal share each; a small pull is one piece
    per route."""
    obj = _stored(8 * MiB)
    routes = [("a", "tcp://127.0.1.1:1", "127.0.1.2", 0), ("a", "tcp://127.0.2.1:2", "127.0.2.2", 1)]
    plan = plan_for(obj, "a", "tcp://127.0.1.1:1", routes=routes)
    assert plan.pinned and plan.serial
    assert [(f.start, f.end, f.route) for f in plan.flows] == [
        (i * MiB, (i + 1) * MiB, routes[i % 2]) for i in range(8)]
    assert plan.routes == routes and plan.senders == [("a", "tcp://127.0.1.1:1"),
                                                      ("a", "tcp://127.0.2.1:2")]
    small = plan_for(_stored(100), "a", "tcp://127.0.1.1:1", routes=routes)
    assert [(f.start, f.end, f.route) for f in small.flows] == [(0, 50, routes[0]),
                                                                (50, 100, routes[1])]
    # several senders: pieces in turn over every route (a queue)
    also = plan_for(obj, "a", "tcp://127.0.1.1:1", also=[("b", "tcp://b:1")],
                    routes=[*routes, ("b", "tcp://b:1", "", -1)])
    assert not also.pinned and len(also.routes) == 3
    # without routes: today's single sub-flow
    single = plan_for(obj, "a", "tcp://127.0.1.1:1")
    assert [(f.start, f.end, f.local, f.path) for f in single.flows] == [(0, 8 * MiB, "", -1)]


# -- the transport: a connection from a chosen port -------------------------------


def test_a_connection_starts_from_the_chosen_host_and_port_and_skips_one_in_use():
    low = int(free_ports(3).split("-")[0])

    async def main() -> None:
        seen: list[str] = []
        done = asyncio.Event()

        async def handler(stream):
            seen.append(stream.peer)
            done.set()
            await stream.recv_into(memoryview(bytearray(1)))

        backend = get_backend("tcp")
        listener = await backend.listen("127.0.1.1", 0, handler)
        taken = socket.socket()  # another's socket on the first port
        taken.bind(("127.0.1.2", low))
        try:
            stream = await backend.connect(listener.address, 5, Bind("127.0.1.2", (low, low + 2)))
            await asyncio.wait_for(done.wait(), 5)
            assert stream.local == f"127.0.1.2:{low + 2}" and seen == [stream.local]
            # that port's connection to this peer exists: a second one takes none of it
            with pytest.raises(ConnectionRefused, match="every source port asked"):
                await backend.connect(listener.address, 5, Bind("127.0.1.2", (low + 2,)))
            await stream.close()
            # a host that is not this one's is refused, naming it
            with pytest.raises(ConnectionRefused, match="from 192.0.2.1"):
                await backend.connect(listener.address, 5, Bind("192.0.2.1", (low,)))
        finally:
            taken.close()
            await listener.close()

    asyncio.run(main())


# -- the directory: rails and paths, pure ------------------------------------------


def test_the_directory_names_a_senders_rails_and_keeps_the_paths_of_pulls():
    d = s.Directory()
    rails = ("tcp://127.0.1.1:5", "tcp://127.0.2.1:6")
    d.handle(s.NodeJoined("n0", rails[0], rails=rails))
    d.handle(s.NodeJoined("n1", "tcp://127.0.1.2:7"))
    assert d.rails == {"n0": rails}
    layout = {"kind": "bytes", "dtype": "|u1", "shape": [1 << 20], "nbytes": 1 << 20}
    d.handle(s.Put("n0", 1, OID, 1 << 20, layout))
    d.handle(s.Completed("n0", OID))
    [reply] = d.handle(s.Locate("n1", 2, OID))
    assert reply.body.sender == "n0" and reply.body.rails == {"n0": list(rails)}
    d.handle(s.PathTaken("n1", OID, "n0", rails[1], "127.0.2.2:62001", 1))
    d.handle(s.PathTaken("n9", OID, "n0", rails[1], "127.0.2.2:62002", 1))  # (no holder: not kept)
    [query] = d.handle(s.Query("n1", 3, OID))
    assert query.body.paths == [m.PathInfo(receiver="n1", sender="n0", address=rails[1],
                                           local="127.0.2.2:62001", path=1)]
    assert query.body.edges == [["n1", "n0"]]  # (edges stay pairs)
    d.handle(s.Dropped("n1", OID))
    [query] = d.handle(s.Query("n0", 4, OID))
    assert query.body.paths == []
    d.handle(s.NodeLost("n0"))
    assert d.rails == {}


# -- real pulls -------------------------------------------------------------------


_BASE = dict(shared_memory=False, chunk_size=MiB, timeout_s=20, stall_timeout_s=5.0,
             multi_source_bytes=4 * MiB)


def _value(size: int) -> np.ndarray:
    return (np.arange(size) % 251).astype(np.uint8)


def test_a_node_with_two_hosts_listens_on_and_registers_both():
    config = Config(node_host="127.0.1.1,127.0.2.1", **_BASE)

    async def body(directory, a):
        assert [addr.rsplit(":", 1)[0] for addr in a.data_addresses] == [
            "tcp://127.0.1.1", "tcp://127.0.2.1"]
        assert directory.state.nodes[a.node_id] == a.data_addresses[0]
        assert directory.state.rails[a.node_id] == tuple(a.data_addresses)
        for address in a.data_addresses:  # (each answers the handshake)
            stream = await a.pool.acquire(address, local=False)
            await stream.close()

    run_nodes([config], body, bound=30)


def test_a_pull_from_a_two_rail_sender_carries_half_on_each_rail():
    """The receiver shares both rails with the sender: one sub-flow on each,
    an equal share of the bytes, each from its own rail's address."""
    size = 8 * MiB
    value = _value(size)
    sender = Config(node_host="127.0.1.1,127.0.2.1", **_BASE)
    receiver = Config(node_host="127.0.1.2,127.0.2.2", **_BASE)

    async def body(directory, a, b):
        oid = hg.ObjectID.from_name("two-rails")
        await a.put(value, oid)
        got = await b.fetch(oid, 15)
        np.testing.assert_array_equal(np.asarray(got.buffer), value)
        sent = (await a.stats())["bytes_sent_by_address"]
        on = {address.split("//")[1]: 0 for address in a.data_addresses}
        on.update(sent)
        assert sorted(on.values()) == [size // 2, size // 2], sent
        info = await b.query(oid)
        assert sorted((p["address"], p["local"].rsplit(":", 1)[0], p["path"])
                      for p in info["paths"]) == [
            (a.data_addresses[0], "127.0.1.2", -1), (a.data_addresses[1], "127.0.2.2", -1)]

    run_nodes([sender, receiver], body, bound=30)


def test_a_pull_below_the_threshold_stays_a_single_flow():
    """A small pull between two-rail nodes is today's pull: one connection to
    the sender's first address, nothing told of paths."""
    size = 2 * MiB
    value = _value(size)
    sender = Config(node_host="127.0.1.1,127.0.2.1", **_BASE)
    receiver = Config(node_host="127.0.1.2,127.0.2.2", paths=2, path_ports=free_ports(4),
                      **_BASE)

    async def body(directory, a, b):
        oid = hg.ObjectID.from_name("one-flow")
        await a.put(value, oid)
        got = await b.fetch(oid, 15)
        np.testing.assert_array_equal(np.asarray(got.buffer), value)
        assert (await a.stats())["bytes_sent_by_address"] == {
            a.data_addresses[0].split("//")[1]: size}
        assert (await b.query(oid)).get("paths", []) == []

    run_nodes([sender, receiver], body, bound=30)


def _peers_of(node) -> list[str]:
    """The peer ("host:port") of every pull `node`'s data server serves from now on."""
    peers: list[str] = []
    real = node.server._serve_pull

    async def serve_pull(stream, req):
        peers.append(stream.peer)
        return await real(stream, req)

    node.server._serve_pull = serve_pull
    return peers


def test_pinned_source_ports_are_the_ones_chosen_and_shown_in_object_info():
    """With two paths a pull from one sender goes as two sub-flows whose
    connections start from the first port of path 0 and of path 1: the
    sender sees those ports, and object_info names each with its path."""
    size = 8 * MiB
    value = _value(size)
    ports = free_ports(6)
    low = int(ports.split("-")[0])
    sender = Config(**_BASE)
    receiver = Config(paths=2, path_ports=ports, **_BASE)

    async def body(directory, a, b):
        peers = _peers_of(a)
        oid = hg.ObjectID.from_name("pinned")
        await a.put(value, oid)
        got = await b.fetch(oid, 15)
        np.testing.assert_array_equal(np.asarray(got.buffer), value)
        # (four pieces of a MiB each, one after another on its connection)
        assert sorted(peers) == [f"127.0.0.1:{low}"] * 4 + [f"127.0.0.1:{low + 1}"] * 4
        info = await b.query(oid)
        assert sorted((p["local"], p["path"]) for p in info["paths"]) == [
            (f"127.0.0.1:{low}", 0), (f"127.0.0.1:{low + 1}", 1)]
        assert all(p["sender"] == a.node_id and p["receiver"] == b.node_id
                   for p in info["paths"])
        assert b.pulls.ways.paths.active[""] == [0.0, 0.0]  # (the pull's load released)

    run_nodes([sender, receiver], body, bound=30)


def test_a_source_port_in_use_is_skipped_for_the_next_of_its_path():
    size = 8 * MiB
    value = _value(size)
    ports = free_ports(6)
    low = int(ports.split("-")[0])
    receiver = Config(paths=2, path_ports=ports, **_BASE)

    async def body(directory, a, b):
        peers = _peers_of(a)
        taken = socket.socket()  # another program's, on path 0's first port
        try:
            taken.bind(("127.0.0.1", low))
        except OSError as exc:
            assert exc.errno == errno.EADDRINUSE  # (someone's already: skipped all the same)
        try:
            oid = hg.ObjectID.from_name("port-in-use")
            await a.put(value, oid)
            got = await b.fetch(oid, 15)
            np.testing.assert_array_equal(np.asarray(got.buffer), value)
        finally:
            taken.close()
        assert sorted(set(peers)) == [f"127.0.0.1:{low + 1}", f"127.0.0.1:{low + 2}"]
        info = await b.query(oid)
        assert sorted((p["local"], p["path"]) for p in info["paths"]) == [
            (f"127.0.0.1:{low + 1}", 1), (f"127.0.0.1:{low + 2}", 0)]

    run_nodes([Config(**_BASE), receiver], body, bound=30)


def test_rails_and_paths_together_pin_each_rails_sub_flows_and_keep_the_bytes_whole():
    """Two rails and two paths: four sub-flows, a quarter each; every byte
    written once (the object's bytes compared whole)."""
    size = 8 * MiB
    value = _value(size)
    ports = free_ports(4)
    low = int(ports.split("-")[0])
    sender = Config(node_host="127.0.1.1,127.0.2.1", **_BASE)
    receiver = Config(node_host="127.0.1.2,127.0.2.2", paths=2, path_ports=ports, **_BASE)

    async def body(directory, a, b):
        oid = hg.ObjectID.from_name("rails-and-paths")
        await a.put(value, oid)
        got = await b.fetch(oid, 15)
        np.testing.assert_array_equal(np.asarray(got.buffer), value)
        assert sorted((await a.stats())["bytes_sent_by_address"].values()) == [size // 2] * 2
        info = await b.query(oid)
        assert sorted((p["local"], p["path"]) for p in info["paths"]) == [
            (f"127.0.1.2:{low}", 0), (f"127.0.1.2:{low + 1}", 1),
            (f"127.0.2.2:{low}", 0), (f"127.0.2.2:{low + 1}", 1)]

    run_nodes([sender, receiver], body, bound=30)


def test_a_rail_that_fails_midway_leaves_its_bytes_to_the_other_rail():
    """The sender's second rail cuts its first piece halfway (a NIC going
    down): the pull goes on over the first rail alone, every byte written
    exactly once, and the directory heard of the failure. (What is left is
    still worth spreading: the next plan must leave the failed rail out,
    not meet its failure again.)"""
    size = 16 * MiB
    value = _value(size)
    sender = Config(node_host="127.0.1.1,127.0.2.1", **_BASE)
    receiver = Config(node_host="127.0.1.2,127.0.2.2", **_BASE)

    async def body(directory, a, b):
        rail2 = a.data_addresses[1].split("//")[1]
        cut = cut_halfway(a.server, lambda stream, _asked: stream.local == rail2)
        counts = np.zeros(size, np.int64)
        count_writes(b, counts)
        failed = []
        real_failed = b.pulls._flow_failed
        b.pulls._flow_failed = lambda o, f, e: (failed.append(f.address), real_failed(o, f, e))
        oid = hg.ObjectID.from_name("rail-fails")
        await a.put(value, oid)
        got = await b.fetch(oid, 15)
        np.testing.assert_array_equal(np.asarray(got.buffer), value)
        assert (counts == 1).all(), "a byte was written twice, or never"
        # (16 MiB in pieces of 2 MiB, dealt: the second rail's first is the second)
        assert cut == [(2 * MiB, 4 * MiB)] and failed == [a.data_addresses[1]]
        assert not b.pulls.ways.failed_ways  # (the pull's record ended with it)

    run_nodes([sender, receiver], body, bound=30)
