"""Optional TLS (hoplite_gpu/tls.py, transports/tls.py): its settings checked
before anything connects; every TCP connection between processes in TLS
(the directory's, the data server's, direct calls); the transport
conformance suite over it; byte-identical gets, broadcasts and allreduces
on a cluster in TLS; and a peer without a valid certificate, or without
TLS, refused with an error naming the address and the cause, within a
deadline."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import subprocess
import sys
import time

import cluster_tasks as t
import numpy as np
import pytest
import transport_checks as tc

import hoplite_gpu as hg
from benchmarks.tls import make_certificates
from hoplite_gpu import api, transports
from hoplite_gpu import tls as tls_settings
from hoplite_gpu.auth import client_handshake
from hoplite_gpu.cluster import LocalCluster
from hoplite_gpu.config import Config
from hoplite_gpu.direct import DirectLink
from hoplite_gpu.directory.client import DirectoryClient
from hoplite_gpu.directory.server import DirectoryServer
from hoplite_gpu.errors import (
    AuthenticationFailed,
    ConfigError,
    HopliteError,
    Timeout,
    TransportClosed,
)
from hoplite_gpu.protocol import pack, read_messages
from hoplite_gpu.transports.base import HEAD, HEAD_END
from hoplite_gpu.transports.tcp import TCPBackend
from hoplite_gpu.transports.tls import TLS

pytest.importorskip("cryptography")  # (the certificates are made in the tests)

TOKEN = "tls-tests"


class _Enough(Exception):
    """Ends a read loop once what it waited for came."""


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, dict[str, str]]:
    """Two certificates of the cluster's CA ("a", "b") and one of another CA ("x")."""
    folder = tmp_path_factory.mktemp("tls")
    files = make_certificates(folder / "cluster", ("a", "b"))
    files.update(make_certificates(folder / "other", ("x",)))
    return files


def run(coro, seconds: float = 20) -> object:
    async def bounded():
        async with asyncio.timeout(seconds):
            return await coro

    return asyncio.run(bounded())


def _client_tls(certs: dict, cert: str, ca: str = "a") -> TLS:
    """TLS whose client shows `cert`'s certificate and trusts `ca`'s CA: a
    peer `hoplite_gpu.tls.load` would not build (its certificate is not of
    the CA it trusts)."""
    ctx = tls_settings._context(ssl.PROTOCOL_TLS_CLIENT, certs[cert]["tls_cert"],
                                certs[cert]["tls_key"], certs[ca]["tls_ca"])
    return TLS(server=ctx, client=ctx)


# ------------------------------------------------------------- settings ---
def test_tls_settings_come_all_three_or_none(certs):
    a = certs["a"]
    with pytest.raises(ConfigError, match="all three.*tls_cert, tls_key given, tls_ca not"):
        Config(tls_cert=a["tls_cert"], tls_key=a["tls_key"])
    with pytest.raises(ConfigError, match="HOPLITE_TLS_CA"):
        Config.from_env({"HOPLITE_TLS_CERT": a["tls_cert"]})
    assert Config.from_env({"HOPLITE_TLS_CERT": "", "HOPLITE_TLS_KEY": "",
                            "HOPLITE_TLS_CA": ""}).tls_cert is None
    assert tls_settings.load(Config()) is None


def test_an_unreadable_file_names_its_setting_and_path(certs, tmp_path):
    missing = str(tmp_path / "nowhere.key")
    with pytest.raises(ConfigError) as info:
        tls_settings.load(Config(**{**certs["a"], "tls_key": missing}))
    assert "HOPLITE_TLS_KEY" in str(info.value) and missing in str(info.value)


def test_a_key_of_another_certificate_is_refused(certs):
    with pytest.raises(ConfigError) as info:
        tls_settings.load(Config(**{**certs["a"], "tls_key": certs["b"]["tls_key"]}))
    text = str(info.value)
    assert "HOPLITE_TLS_CERT" in text and certs["b"]["tls_key"] in text


def test_a_ca_file_without_a_certificate_is_refused(certs):
    with pytest.raises(ConfigError) as info:
        tls_settings.load(Config(**{**certs["a"], "tls_ca": certs["a"]["tls_key"]}))
    assert "HOPLITE_TLS_CA" in str(info.value) and certs["a"]["tls_key"] in str(info.value)


def test_a_certificate_the_ca_did_not_sign_is_refused_before_it_connects(certs):
    """Every peer would refuse it: said at init, not at each connection."""
    with pytest.raises(ConfigError) as info:
        tls_settings.load(Config(**{**certs["a"], "tls_ca": certs["x"]["tls_ca"]}))
    assert "does not verify" in str(info.value) and certs["x"]["tls_ca"] in str(info.value)


def test_an_encrypted_key_is_refused_without_asking_for_a_password(certs, tmp_path):
    from cryptography.hazmat.primitives import serialization

    with open(certs["a"]["tls_key"], "rb") as f:
        key = serialization.load_pem_private_key(f.read(), None)
    locked = tmp_path / "locked.key"
    locked.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                         serialization.PrivateFormat.PKCS8,
                                         serialization.BestAvailableEncryption(b"secret")))
    with pytest.raises(ConfigError, match="encrypted") as info:
        tls_settings.load(Config(**{**certs["a"], "tls_key": str(locked)}))
    assert "HOPLITE_TLS_KEY" in str(info.value)


def test_init_refuses_bad_tls_files_before_it_connects(certs, tmp_path):
    """A ConfigError, not a DirectoryUnavailable: nothing listens on port 1."""
    with pytest.raises(ConfigError, match="HOPLITE_TLS_CERT"):
        hg.init("127.0.0.1:1", token=TOKEN,
                **{**certs["a"], "tls_cert": str(tmp_path / "none.crt")})


def test_the_directory_command_refuses_a_partial_tls_setting(certs):
    env = {**os.environ, "HOPLITE_TLS_CERT": certs["a"]["tls_cert"]}
    proc = subprocess.run([sys.executable, "-m", "hoplite_gpu", "directory", "--port", "0"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "HOPLITE_TLS_KEY" in proc.stderr + proc.stdout


def test_tls_with_ucx_warns_once_that_ucx_is_not_encrypted(certs, caplog, monkeypatch):
    monkeypatch.setattr(tls_settings, "_warned_ucx", False)
    with caplog.at_level(logging.WARNING, logger="hoplite_gpu.tls"):
        for _ in range(2):
            tls_settings.load(Config(transport="ucx", **certs["a"]))
    warnings = [r for r in caplog.records if "not encrypted" in r.getMessage()]
    assert len(warnings) == 1 and "HOPLITE_TRANSPORT=ucx" in warnings[0].getMessage()


# ----------------------------------------------- the transport in TLS ---
@pytest.fixture
def tcp_in_tls(certs, monkeypatch):
    """The `tcp` backend, for this test, one whose every connection is TLS."""
    monkeypatch.setitem(transports._loaded, "tcp",
                        TCPBackend(tls_settings.load(Config(**certs["a"]))))


_CHECK_ARGS = {"check_round_trip": (5 * tc.MiB + 3,), "check_send_window_keeps_order": (4,),
               "check_bulk_transfer": (64 * tc.MiB,), "check_mixed_traffic": (7,)}
#: Checks of what TCP in TLS does not do: device memory, passing descriptors.
_NOT_TCP = {"check_device_messages", "check_descriptors"}
_CHECKS = sorted(n for n in dir(tc) if n.startswith("check_") and n not in _NOT_TCP)


@pytest.mark.parametrize("check", _CHECKS)
def test_the_transport_conformance_suite_passes_in_tls(check, tcp_in_tls):
    asyncio.run(getattr(tc, check)("tcp", *_CHECK_ARGS.get(check, ())))


def test_both_ends_of_a_tls_connection_say_so(tcp_in_tls):
    async def check():
        async with tc.connected_pair("tcp") as (client, server):
            assert client.tls and server.tls

    run(check())


def test_a_receive_after_part_of_a_tls_record_takes_the_rest_without_waiting(tcp_in_tls):
    """Regression: a receive that took part of a TLS record left the rest
    decrypted in the TLS layer, where the socket never signals it; the next
    receive (a message through the lane, or the framer of a control
    connection) waited on the socket for bytes already here, and hung."""
    async def check():
        async with tc.connected_pair("tcp") as (client, server):
            # one send: one TLS record, of which a 4-byte receive takes part
            await client.send(b"abcd" + HEAD.pack(HEAD_END, 5) + b"hello")
            assert await server.recv_exactly(4) == b"abcd"
            out = bytearray(5)
            async with asyncio.timeout(2):
                await server.recv_message(memoryview(out))
            assert out == b"hello"
            await client.send(b"wxyz" + pack({"op": "one"}) + pack({"op": "two"}))
            assert await server.recv_exactly(4) == b"wxyz"
            got: list = []

            def take(msg):
                got.append(msg["op"])
                if len(got) == 2:
                    raise _Enough  # (ends read_messages)

            with pytest.raises(_Enough):
                async with asyncio.timeout(2):
                    await read_messages(server, take)
            assert got == ["one", "two"]
            # a reader taking 7 bytes at a time, the record 100 long
            await client.send(bytes(range(100)))
            into, have = bytearray(100), [0]

            def space() -> memoryview:
                return memoryview(into)[have[0]:have[0] + 7]

            def received(n: int) -> None:
                have[0] += n
                if have[0] == 100:
                    raise _Enough

            with pytest.raises(_Enough):
                async with asyncio.timeout(2):
                    await server.receive_continuously(space, received)
            assert into == bytes(range(100))

    run(check())


# ------------------------------- refusals: certificates, TLS or none ---
async def _tls_directory(certs, handshake_timeout: float = 5.0) -> DirectoryServer:
    server = DirectoryServer(TOKEN, handshake_timeout=handshake_timeout,
                             tls=tls_settings.load(Config(**certs["a"])))
    await server.start()
    return server


async def _register(address: str, tls: TLS | None, timeout: float = 5.0) -> DirectoryClient:
    return await DirectoryClient.connect(address, token=TOKEN, node="n",
                                         data_address="tcp://127.0.0.1:1", timeout=timeout,
                                         on_push=lambda msg: None, tls=tls)


@pytest.mark.parametrize(("who", "cause"), [
    ("x", "TLSV1_ALERT_UNKNOWN_CA"),  # a certificate of another CA
    (None, "CERTIFICATE_REQUIRED"),   # no certificate at all
])
def test_a_peer_without_a_valid_certificate_is_refused_at_once(certs, who, cause, caplog):
    """The directory refuses it in the TLS handshake and says why in its log;
    the peer hears the refusal on its first receive (TLS 1.3 tells a client
    of its certificate's refusal only then), well before any deadline."""
    if who is None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.load_verify_locations(certs["a"]["tls_ca"])
        peer = TLS(server=ctx, client=ctx)
    else:
        peer = _client_tls(certs, who)

    async def check():
        server = await _tls_directory(certs)
        try:
            started = time.monotonic()
            with pytest.raises(HopliteError) as info:
                await _register(server.address, peer)
            assert time.monotonic() - started < 2.0
            return str(info.value), server.address
        finally:
            await server.close()

    with caplog.at_level(logging.WARNING, logger="hoplite_gpu.transports.tls"):
        text, address = run(check())
    assert address.rpartition("//")[2] in text and "TLS" in text and cause in text
    refusals = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert refusals and "certificate" in refusals[0]


def test_a_tls_client_meets_a_plain_directory_with_a_clear_error(certs):
    async def check():
        server = DirectoryServer(TOKEN)
        await server.start()
        try:
            with pytest.raises(AuthenticationFailed, match="does not speak TLS") as info:
                await _register(server.address, tls_settings.load(Config(**certs["a"])))
            assert server.address.rpartition("//")[2] in str(info.value)
        finally:
            await server.close()

    run(check())


def test_a_plain_client_is_refused_by_a_tls_directory_within_its_handshake_deadline(certs):
    """A plain client waits for the token's challenge, a TLS server for a
    TLS hello: the server's handshake deadline ends it, and the client's
    error says what to check."""
    async def check():
        server = await _tls_directory(certs, handshake_timeout=0.5)
        try:
            started = time.monotonic()
            with pytest.raises(TransportClosed, match="HOPLITE_TLS_") as info:
                await _register(server.address, None, timeout=10)
            assert time.monotonic() - started < 3.0
            assert server.address.rpartition("//")[2] in str(info.value)
        finally:
            await server.close()

    run(check())


def test_a_plain_direct_link_is_refused_by_a_tls_directory(certs):
    async def check():
        server = await _tls_directory(certs, handshake_timeout=0.5)
        try:
            _, _, port = server.address.rpartition(":")
            started = time.monotonic()
            with pytest.raises(HopliteError):
                await asyncio.to_thread(DirectLink, "127.0.0.1", int(port), TOKEN, "n", 10.0)
            assert time.monotonic() - started < 3.0
        finally:
            await server.close()

    run(check())


# ------------------------------------------- a runtime and a cluster in TLS ---
def test_local_mode_in_tls_serves_nothing_without_it(certs):
    """Gets and direct calls work in TLS; its directory and its data server
    both refuse a connection without TLS (within their handshake deadline)
    and one whose certificate is of another CA (at once)."""
    hg.init(connect_timeout_s=1.0, shared_memory=False, **certs["a"])
    try:
        rt = api.runtime()
        small = np.arange(100, dtype=np.int64)
        assert np.array_equal(hg.get(hg.put(small)), small)
        assert hg.node_stats()["direct_puts"] >= 1  # (over the direct link, in TLS)

        async def plain(address: str) -> str:
            stream = await transports.get_backend("tcp").connect(address, 5)
            try:
                with pytest.raises(TransportClosed) as info:
                    await client_handshake(stream, rt.token, 5)
                return str(info.value)
            finally:
                await stream.close()

        async def intruder(address: str, tls: TLS) -> str:
            with pytest.raises(HopliteError) as info:
                stream = await transports.get_backend("tcp", tls).connect(address, 5)
                try:
                    await client_handshake(stream, rt.token, 5)
                finally:
                    await stream.close()
            return str(info.value)

        other_ca = tls_settings.load(Config(**certs["x"]))
        for address in (rt.address, rt.node.server.address):
            started = time.monotonic()
            assert "before the handshake began" in run(plain(address))
            assert time.monotonic() - started < 3.0
            # (it refuses our certificate; we refuse its own)
            assert "certificate was refused" in run(intruder(address, other_ca))
            assert "UNKNOWN_CA" in run(intruder(address, _client_tls(certs, "x")))
    finally:
        hg.shutdown()


@pytest.fixture(scope="module")
def tls_cluster(certs):
    # (shared memory off: every byte between the workers crosses TCP, in TLS)
    with LocalCluster(3, shared_memory=False, **certs["a"]) as cluster:
        yield cluster


def test_gets_and_a_broadcast_in_tls_are_byte_identical(tls_cluster, certs):
    crc = tls_cluster.run(0, t.put_pattern, "tls-bcast", 6 << 20 | 5, 3)
    sums = tls_cluster.map(t.get_summary, [("tls-bcast", 30)] * 2, workers=[1, 2])
    assert [s[0] for s in sums] == [crc, crc]
    hg.init(tls_cluster.address, token=tls_cluster.token, shared_memory=False, **certs["b"])
    try:
        assert t.get_summary("tls-bcast", 30)[0] == crc
    finally:
        hg.shutdown()


def test_an_allreduce_in_tls_is_exact(tls_cluster):
    n = 300_001
    out = tls_cluster.map(t.allreduce_worker, [("tls-ar", r, 3, n, 0.0) for r in range(3)],
                          workers=range(3))
    assert len({crc for crc, _ in out}) == 1
    expected = sum(np.random.default_rng(r).standard_normal(n).astype(np.float32)
                   for r in range(3))
    assert out[0][1] == pytest.approx(float(expected[:1000].astype(np.float64).sum()), abs=1e-3)


def test_a_node_with_a_certificate_of_another_ca_cannot_join(tls_cluster, certs):
    started = time.monotonic()
    with pytest.raises(AuthenticationFailed) as info:
        hg.init(tls_cluster.address, token=tls_cluster.token, connect_timeout_s=5, **certs["x"])
    assert time.monotonic() - started < 3.0
    assert tls_cluster.address.rpartition("//")[2] in str(info.value)
    assert "certificate" in str(info.value)


def test_a_node_without_tls_cannot_join_and_is_told_why(tls_cluster):
    started = time.monotonic()
    with pytest.raises(Timeout, match="HOPLITE_TLS_"):
        hg.init(tls_cluster.address, token=tls_cluster.token, connect_timeout_s=1.5)
    assert time.monotonic() - started < 5.0
