"""The public API in local mode (embedded directory), one process."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import numpy as np
import pytest
import transport_checks as tc

import hoplite_gpu as hg
from hoplite_gpu import messages as m


@pytest.fixture
def runtime_settings() -> dict:
    """The `local` runtime's settings here."""
    return {"chunk_size": 64 * 1024, "timeout_s": 20}


@pytest.mark.skipif(os.environ.get("TEST_IN_TLS") != "1",
                    reason="only in the TLS pass of make test (TEST_IN_TLS=1)")
def test_in_the_tls_pass_the_runtime_speaks_tls(local):
    """The TLS pass (tests/conftest.py) really runs the runtime in TLS."""
    assert local.tls is not None and local.node.link.client._stream.tls


def test_put_get_roundtrip(local):
    a = np.random.default_rng(0).standard_normal((300, 500)).astype(np.float32)
    oid = hg.put(a)
    b = hg.get(oid)
    assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)
    assert hg.get(hg.put(b"tiny")) == b"tiny"


def test_put_copies_and_get_is_read_only(local):
    a = np.arange(1_000_000, dtype=np.int64)
    oid = hg.put(a)
    a[:] = -1  # the stored copy must not change
    b = hg.get(oid)
    assert b[10] == 10
    with pytest.raises(ValueError):
        b[0] = 5


def test_named_ids_are_deterministic():
    assert hg.ObjectID.from_name("w") == hg.ObjectID.from_name("w")
    assert hg.ObjectID.from_name("w") != hg.ObjectID.from_name("v")
    assert len(hg.ObjectID.random().binary) == 20
    assert hg.ObjectID.random() != hg.ObjectID.random()
    with pytest.raises(hg.InvalidArgument):
        hg.ObjectID(b"short")


def test_get_before_put_in_another_thread(local):
    oid = hg.ObjectID.from_name("later")
    result = {}
    th = threading.Thread(target=lambda: result.setdefault("v", hg.get(oid, timeout=10)))
    th.start()
    time.sleep(0.2)
    hg.put(np.ones(200_000, dtype=np.uint8), oid)
    th.join(10)
    assert result["v"].sum() == 200_000


def test_async_twins(local):
    async def main():
        oid = await hg.put_async(np.full(100_000, 3, dtype=np.int16))
        v = await hg.get_async(oid, timeout=5)
        info = await hg.object_info_async(oid)
        await hg.delete_async(oid)
        return v, info

    v, info = asyncio.run(main())
    assert int(v.sum()) == 300_000 and info["size"] == 200_000


def test_gets_of_one_object_share_a_pull_that_outlives_each_of_them(local):
    """Several gets of one object wait on one pull. A get that is cancelled or
    reaches its deadline leaves the pull running for the others; a pull cut
    short (here before it even ran) wakes every waiter with the reason."""
    rt = hg.api.runtime()
    node = rt.node
    oid = hg.ObjectID.from_name("shared-pull")

    async def waiters():
        short = asyncio.ensure_future(node.get(oid, 0.3, "numpy"))
        cancelled = asyncio.ensure_future(node.get(oid, 20, "numpy"))
        patient = asyncio.ensure_future(node.get(oid, 20, "numpy"))
        await asyncio.sleep(0.05)
        assert len(node._pulls) == 1 and len(node._pull_waiters[oid]) == 3
        cancelled.cancel()
        with pytest.raises(hg.Timeout):
            await short
        assert not patient.done() and oid in node._pulls
        return patient, cancelled

    patient, cancelled = rt.call(waiters(), 10)
    hg.put(np.arange(10, dtype=np.int32), oid)
    got = rt.call(_result(patient), 10)
    assert got.tolist() == list(range(10)) and cancelled.cancelled()
    assert not node._pulls and not node._pull_waiters

    other = hg.ObjectID.from_name("cut-short")

    async def cut_short():
        gets = [asyncio.ensure_future(node.get(other, 20, "numpy")) for _ in range(2)]
        await asyncio.sleep(0)  # the gets joined a pull that has not run yet
        node.pulls.cancel(other, hg.PeerLost("the test cut it short"))
        return await asyncio.gather(*gets, return_exceptions=True)

    outcomes = rt.call(cut_short(), 10)
    assert [type(e) for e in outcomes] == [hg.PeerLost, hg.PeerLost]
    assert not node._pulls and not node._pull_waiters


async def _result(fut):
    return await fut


def test_bad_input_gives_clear_errors(local):
    with pytest.raises(hg.UnsupportedValue, match="list"):
        hg.put([1, 2, 3])
    with pytest.raises(hg.InvalidArgument, match="ObjectID"):
        hg.get("not-an-id")
    with pytest.raises(hg.InvalidArgument, match="timeout"):
        hg.get(hg.ObjectID.random(), timeout=0)
    t0 = time.monotonic()
    with pytest.raises(hg.Timeout, match="not available"):
        hg.get(hg.ObjectID.random(), timeout=0.3)
    assert time.monotonic() - t0 < 3
    with pytest.raises(hg.InvalidArgument, match="already"):
        hg.init()


def test_reput_with_other_layout_is_refused(local):
    oid = hg.put(np.zeros(100_000, dtype=np.uint8))
    hg.put(np.zeros(100_000, dtype=np.uint8), oid)  # same layout: accepted
    with pytest.raises(hg.ObjectExists):
        hg.put(np.zeros(10, dtype=np.float64), oid)


def test_delete_then_get_times_out(local):
    oid = hg.put(np.ones(300_000, dtype=np.uint8))
    hg.delete(oid)
    with pytest.raises(hg.Timeout):
        hg.get(oid, timeout=0.3)


def test_closed_runtime():
    hg.init()
    hg.shutdown()
    hg.shutdown()  # idempotent
    with pytest.raises(hg.NotInitialized, match="init"):
        hg.put(b"x")


def test_blocking_call_outcomes(local, monkeypatch):
    """Runtime.call passes the operation's own errors through, turns a silent
    runtime into Timeout and a shutdown mid-call into RuntimeClosed."""
    import importlib

    # the module, not the `hoplite_gpu.runtime()` function that shadows its name
    rt_mod = importlib.import_module("hoplite_gpu.runtime")

    rt = hg.api.runtime()

    async def fails():
        raise hg.Timeout("the operation's own deadline")

    with pytest.raises(hg.Timeout, match="own deadline"):
        rt.call(fails(), 5)
    monkeypatch.setattr(rt_mod, "_GRACE_S", 0.0)
    with pytest.raises(hg.Timeout, match="did not answer"):
        rt.call(asyncio.sleep(5), 0.2)

    assert isinstance(_ended_by_shutdown(lambda: rt.call(asyncio.sleep(30), 60)),
                      hg.RuntimeClosed)


def test_shutdown_ends_a_get_waiting_on_its_own_directory_connection():
    hg.init(timeout_s=60)  # (a get of a missing object waits on the caller's thread)
    assert isinstance(_ended_by_shutdown(lambda: hg.get(hg.ObjectID.from_name("never"))),
                      (hg.RuntimeClosed, hg.NotInitialized))


def _ended_by_shutdown(call) -> BaseException:
    """Run `call` in a thread, shut down while it waits, and return what it
    raised: it must end at once, not at its deadline."""
    got = []

    def blocked():
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            got.append(exc)

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.3)
    start = time.monotonic()
    hg.shutdown()
    t.join(20)
    assert not t.is_alive() and time.monotonic() - start < 10
    assert len(got) == 1, got
    return got[0]


def test_remote_init_needs_token(monkeypatch):
    monkeypatch.delenv("HOPLITE_TOKEN", raising=False)
    with pytest.raises(hg.ConfigError, match="token"):
        hg.init("127.0.0.1:9")


@pytest.mark.parametrize("scheme", tc.scheme_params())
def test_unreachable_directory_fails_fast(scheme):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: refused
    t0 = time.monotonic()
    with pytest.raises(hg.DirectoryUnavailable, match="directory"):
        hg.init(f"{scheme}://127.0.0.1:{port}", token="x", connect_timeout_s=2)
    assert time.monotonic() - t0 < 10


def test_a_silent_directory_address_is_unavailable_not_a_bare_timeout(monkeypatch):
    """A connect that runs to its deadline (UCX does that to a closed port now
    and then) is reported like a refusal: the directory is unreachable."""
    from hoplite_gpu.transports.tcp import TCPBackend

    async def silent(self, address, timeout):
        raise hg.Timeout(f"connecting to {address} took longer than {timeout:g}s")

    monkeypatch.setattr(TCPBackend, "connect", silent)
    with pytest.raises(hg.DirectoryUnavailable, match="cannot reach the directory"):
        hg.init("tcp://127.0.0.1:9", token="x", connect_timeout_s=1)


def test_config_rejects_unknown_env(monkeypatch):
    monkeypatch.setenv("HOPLITE_CHUNKSIZE", "1")
    with pytest.raises(hg.ConfigError, match="HOPLITE_CHUNK_SIZE"):
        hg.Config.from_env()
    monkeypatch.delenv("HOPLITE_CHUNKSIZE")
    monkeypatch.setenv("HOPLITE_CHUNK_SIZE", "lots")
    with pytest.raises(hg.ConfigError, match="HOPLITE_CHUNK_SIZE='lots': not a size in whole"):
        hg.Config.from_env()
    monkeypatch.delenv("HOPLITE_CHUNK_SIZE")
    monkeypatch.setenv("HOPLITE_MAX_RECEIVERS_PER_SENDER", "two")
    with pytest.raises(hg.ConfigError, match="not a valid int"):
        hg.Config.from_env()
    monkeypatch.delenv("HOPLITE_MAX_RECEIVERS_PER_SENDER")


@pytest.mark.parametrize("text, size", [("4096", 4096), ("0x1000", 4096), ("64KiB", 64 << 10),
                                        ("4M", 4 << 20), ("1.5GiB", 3 << 29), ("8 gb", 8 << 30)])
def test_byte_settings_take_binary_units(monkeypatch, text, size):
    monkeypatch.setenv("HOPLITE_STORE_BYTES", text)
    assert hg.Config.from_env().store_bytes == size


@pytest.mark.parametrize("text", ["1.9", "inf", "nan", "-4K", "lots", "1e30"])
def test_byte_settings_refuse_what_is_not_a_whole_number_of_bytes(monkeypatch, text):
    monkeypatch.setenv("HOPLITE_STORE_BYTES", text)
    with pytest.raises(hg.ConfigError, match="not a size in whole bytes"):
        hg.Config.from_env()


def test_keyword_settings_take_what_the_variables_take_and_refuse_wrong_types():
    config = hg.Config.from_env({}, store_bytes="8GiB", chunk_size="4M", timeout_s="30",
                                shared_memory="off", log_level="debug")
    assert (config.store_bytes, config.chunk_size, config.timeout_s, config.shared_memory) == \
        (8 << 30, 4 << 20, 30.0, False)
    for bad, match in [({"store_bytes": 1.5}, "store_bytes must be int; got 1.5"),
                       ({"timeout_s": True}, "timeout_s must be float"),
                       ({"store_bytes": "lots"}, "store_bytes='lots': not a size"),
                       ({"token": 5}, "token must be str"),
                       ({"log_level": "loud"}, "log_level must be one of DEBUG")]:
        with pytest.raises(hg.ConfigError, match=match):
            hg.Config.from_env({}, **bad)
    with pytest.raises(hg.ConfigError, match="log_level must be one of"):
        hg.Config.from_env({"HOPLITE_LOG_LEVEL": "loud"})


def test_device_chunks_only_where_the_transport_moves_device_memory():
    tcp = hg.Config(chunk_size=4096, device_chunk_size=65536)
    ucx = tcp.replace(transport="ucx")
    assert (tcp.chunk_bytes(False), tcp.chunk_bytes(True)) == (4096, 4096)  # staged on the host
    assert (ucx.chunk_bytes(False), ucx.chunk_bytes(True)) == (4096, 65536)


@pytest.mark.parametrize("name", ["chunk_size", "device_chunk_size"])
def test_config_refuses_tiny_chunks(monkeypatch, name):
    monkeypatch.setenv(f"HOPLITE_{name.upper()}", "1024")
    with pytest.raises(hg.ConfigError, match=f"{name} must be at least 4096"):
        hg.Config.from_env()
    monkeypatch.setenv(f"HOPLITE_{name.upper()}", "0x10000")
    assert getattr(hg.Config.from_env(), name) == 0x10000


def test_a_copy_dropped_for_a_rebuild_while_a_get_returns_it_is_pulled_again(local):
    """A drop with retry (a reduce restarted) can land between a get's fetch and
    its return; the get asks again instead of failing, while a plain drop
    (deleted) still fails it."""
    from hoplite_gpu.node.node import Node

    rt = hg.api.runtime()
    node = rt.node

    async def start_other():
        other = Node(rt.config, rt.token, rt.address)
        await other.start()
        return other

    # Put by another node: this node's dropped copy is not the last one (a
    # dropped last copy is lost, and a get then learns so at once).
    other = rt.call(start_other(), 10)
    oid = rt.call(other.put(np.arange(300_000, dtype=np.int32), hg.ObjectID.random()), 10)
    real_fetch = node.fetch
    calls = []

    async def fetch_then_drop(o, timeout, asked=None):
        obj = await real_fetch(o, timeout, asked)
        calls.append(obj)
        if len(calls) == 1:  # the first time: the copy is dropped for a rebuild
            node._on_push(m.Drop(oid=o.binary, reason="rebuilt", retry=True))
            hg_put_again.append(True)
        return obj

    hg_put_again = []
    node.fetch = fetch_then_drop
    try:
        got = hg.get(oid, timeout=10)
        assert len(calls) == 2 and got[-1] == 299_999
        calls.clear()
        calls.append("skip the retry drop")
        oid2 = hg.put(np.ones(300_000, dtype=np.uint8))

        async def fetch_then_delete(o, timeout, asked=None):
            obj = await real_fetch(o, timeout, asked)
            node._on_push(m.Drop(oid=o.binary, reason="deleted", retry=False))
            return obj
        node.fetch = fetch_then_delete
        with pytest.raises(hg.ObjectNotFound, match="deleted while this get"):
            hg.get(oid2, timeout=5)
    finally:
        node.fetch = real_fetch
        rt.call(other.close(), 10)


def test_a_complete_copy_declared_lost_while_a_get_returns_it_is_kept(local):
    """Regression (the chaos test's reduce with a kill, worker 7 raising
    "deleted while this get returned it"): the node holding a reduce's result
    died as another node's pull of it completed; the directory, hearing of the
    death before that node's `complete`, declared the result lost and dropped
    the finished copy under the get returning it. A lost drop now leaves a
    complete copy alone (its `complete` brings the object back), and the get
    returns it."""
    rt = hg.api.runtime()
    node = rt.node
    oid = hg.put(np.arange(300_000, dtype=np.int32))
    real_fetch = node.fetch

    async def fetch_then_lose(o, timeout, asked=None):
        obj = await real_fetch(o, timeout, asked)
        node._on_push(m.Drop(oid=o.binary, reason="lost", retry=False, lost=True))
        return obj

    node.fetch = fetch_then_lose
    try:
        assert hg.get(oid, timeout=10)[-1] == 299_999
        assert node.store.get(oid) is not None
    finally:
        node.fetch = real_fetch


def test_config_names_the_allreduce_slicing_choices(monkeypatch):
    monkeypatch.setenv("HOPLITE_ALLREDUCE_SLICING", "on")
    with pytest.raises(hg.ConfigError,
                       match="allreduce_slicing must be 'off', 'auto' or 'adaptive'"):
        hg.Config.from_env()
    monkeypatch.setenv("HOPLITE_ALLREDUCE_SLICING", "adaptive")
    monkeypatch.setenv("HOPLITE_ALLREDUCE_SLICING_WINDOW_S", "0.2")
    config = hg.Config.from_env()
    assert (config.allreduce_slicing, config.allreduce_slicing_window_s) == ("adaptive", 0.2)
    monkeypatch.setenv("HOPLITE_ALLREDUCE_SLICING_WINDOW_S", "0")
    with pytest.raises(hg.ConfigError, match="allreduce_slicing_window_s must be > 0"):
        hg.Config.from_env()


def test_node_stats_counts_what_this_node_holds(local):
    before = hg.node_stats()
    assert set(before) == {"objects", "shared_memory", "kept_mappings", "copied_from_mappings",
                           "bytes_copied_from_mappings", "pool_hits", "pooled_bytes",
                           "pool_reclaimed", "failovers", "held_bytes", "store_bytes", "evicted",
                           "direct_puts", "direct_gets", "bytes_sent_by_address"}
    oid = hg.put(np.zeros(2 << 20, dtype=np.uint8))
    assert hg.node_stats()["objects"] == before["objects"] + 1
    hg.delete(oid)
    after = hg.node_stats()
    assert after["objects"] == before["objects"]
    assert after["pooled_bytes"] >= before["pooled_bytes"]  # its buffer kept for reuse


def test_a_directory_address_without_a_scheme_means_the_control_transport():
    """Data over UCX does not change how a bare `host:port` directory is dialled:
    the directory serves the control transport (TCP unless set otherwise)."""
    from hoplite_gpu.node.node import Node

    ucx_data = Node(hg.Config(transport="ucx"), "token", "10.0.0.1:7777")
    assert ucx_data.directory_address == "tcp://10.0.0.1:7777"
    ucx_control = Node(hg.Config(control_transport="ucx"), "token", "10.0.0.1:7777")
    assert ucx_control.directory_address == "ucx://10.0.0.1:7777"


def test_a_put_cancelled_while_copying_leaves_nothing_behind(local):
    """A put given up half-way through copying its value (a cancelled async
    put, a blocking put past its deadline) takes its partial copy back: a
    later put of the id stores the new bytes, and nobody waits on a copy
    that never completes."""
    rt = hg.api.runtime()
    node = rt.node
    oid = hg.ObjectID.from_name("half-put")

    async def cancel_half_way():
        put = asyncio.ensure_future(node.put(np.ones(8 << 20, np.uint8), oid))
        while (obj := node.store.get(oid)) is None or not 0 < obj.ready < obj.size:
            await asyncio.sleep(0)
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        assert node.store.get(oid) is None

    rt.call(cancel_half_way(), 10)
    hg.put(np.full(8 << 20, 2, np.uint8), oid)
    got = hg.get(oid, timeout=5)
    assert got.min() == got.max() == 2


def test_a_failed_reduce_asked_again_says_so_at_once_and_how_to_ask_anew(local):
    """The same reduce asked again after it failed used to be accepted and
    fail only at the get, with the first failure's words and no way out
    named. Now the second ask fails at once (a late rank of a collective
    fails fast) and says to delete the target; after that the id is free."""
    a = hg.put(np.ones(4, np.float32))
    b = hg.put(np.ones(5, np.float32))
    target = hg.reduce([a, b], op="sum", num_objects=2)
    with pytest.raises(hg.ReduceFailed, match="same dtype and shape"):
        hg.get(target, timeout=5)
    with pytest.raises(hg.ReduceFailed, match="delete the target id to ask for it again"):
        hg.reduce([b, a], op="sum", num_objects=2, object_id=target)
    hg.delete(target)
    c = hg.put(np.full(4, 2, np.float32))
    again = hg.reduce([a, c], op="sum", num_objects=2, object_id=target)
    np.testing.assert_array_equal(hg.get(again, timeout=5), np.full(4, 3, np.float32))


def test_reduced_inputs_of_an_id_no_reduce_makes_says_no_such_reduce(local):
    """`reduced_inputs(unknown_id, timeout=1)` said the directory "did not
    answer 'reduced_inputs' within 0.999999s" while it was healthy: the
    timeout now says that no reduce produces the id."""
    with pytest.raises(hg.Timeout, match="no such reduce") as err:
        hg.reduced_inputs(hg.ObjectID.from_name("no reduce makes this"), timeout=1)
    assert "did not answer" not in str(err.value) and "timeout=1)" in str(err.value)


def test_reduced_inputs_of_an_unfinished_reduce_says_how_many_inputs_came(local):
    one = hg.put(np.ones(4))
    rid = hg.reduce([one, hg.ObjectID.from_name("never put")], "sum")
    with pytest.raises(hg.Timeout, match="not done: 1 of its 2 inputs have come"):
        hg.reduced_inputs(rid, timeout=0.5)
    hg.put(np.ones(4), hg.ObjectID.from_name("never put"))
    assert set(hg.reduced_inputs(rid, timeout=10)) == {one, hg.ObjectID.from_name("never put")}
