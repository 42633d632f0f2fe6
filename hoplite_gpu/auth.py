"""Mutual challenge-response on every connection: both sides prove they know the
cluster token with an HMAC over fresh nonces; the token itself never travels."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets

from . import messages as m
from .errors import AuthenticationFailed, ProtocolError, Timeout, TransportClosed
from .ids import encode_text
from .protocol import SMALL_MESSAGE, recv_msg, send_msg
from .transports import Stream

PROTOCOL_VERSION = 17  # 2: reduce_confirm, reduce_tag in locate replies, tag in reduce_step;
#                       3: a reduce's fanout, same-host pulls (shm, map, copied, kept);
#                       4: answers in bare messages (a pull's "bare")
#                       5: direct connections ("attach"), the push "located"
#                       6: a reduce's "relay"
#                       7: "evict" (a node with a store limit frees pulled copies),
#                          a reduce's "fanout" removed
#                       8: "delete_many"
#                       9: an evict's "need" (all or nothing), a pull's "stall",
#                          "dropped" on a direct connection
#                      10: a put's and an own complete's "print" (a second put of
#                          other bytes is refused)
#                      11: a reduce_step's "early" (its input is the position's early step's output)
#                      12: every pull answered in messages of its "bare" size (message
#                          heads on a byte stream), ended by a data frame header
#                      13: striped pulls: a locate's (and a located push's) "stripes"
#                          and "seq", the push "restripe", a holder's "stripes"
#                      14: a register's answer's "nodes" (the others registered there)
#                      15: rails and paths: a register's "addresses", a locate's (and a
#                          located push's) "rails", the notice "path", a query's "paths"
#                      16: a reduce_step child's "node" and "rails", a restripe's "rails", a register's
#                          "rack", a restripe of a pull not striped, its later locates' "seq"
#                      17: a drop's "lost"
_NONCE = 32


def new_token() -> str:
    return secrets.token_urlsafe(24)


def _mac(token: str, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(encode_text(token), role + a + b, hashlib.sha256).digest()


async def server_handshake(stream: Stream, token: str, timeout: float) -> None:
    """Run on the accepting side. Raises AuthenticationFailed after telling the peer why."""
    try:
        async with asyncio.timeout(timeout):
            s_nonce = os.urandom(_NONCE)
            await send_msg(stream, m.Challenge(hello="hoplite-gpu", version=PROTOCOL_VERSION,
                                               nonce=s_nonce))
            msg = await recv_msg(stream, SMALL_MESSAGE)
            c_nonce, mac = msg.get("nonce"), msg.get("mac")
            if not isinstance(c_nonce, bytes) or not isinstance(mac, bytes):
                raise ProtocolError(f"bad handshake from {stream.peer}")
            if not hmac.compare_digest(mac, _mac(token, b"client", s_nonce, c_nonce)):
                await send_msg(stream, m.Verdict(ok=False, error="wrong cluster token"))
                raise AuthenticationFailed(f"peer {stream.peer} presented a wrong cluster token")
            await send_msg(stream, m.Verdict(ok=True, mac=_mac(token, b"server", c_nonce, s_nonce)))
            stream.authenticated()
    except TimeoutError as exc:
        raise Timeout(f"handshake with {stream.peer} took longer than {timeout:g}s") from exc


async def client_handshake(stream: Stream, token: str, timeout: float) -> None:
    """Run on the connecting side. Raises AuthenticationFailed on a token mismatch."""
    try:
        async with asyncio.timeout(timeout):
            try:
                hello = await recv_msg(stream, SMALL_MESSAGE)
            except TransportClosed as exc:
                if stream.tls:
                    raise
                raise TransportClosed(
                    f"{exc}: {stream.peer} closed the connection before the handshake began "
                    "(a peer that runs TLS closes one without it so: if it does, set "
                    "HOPLITE_TLS_* here too)") from exc
            s_nonce, c_nonce, answer = client_answer(hello, token, stream.peer)
            await send_msg(stream, answer)
            try:
                verdict = await recv_msg(stream, SMALL_MESSAGE)
            except TransportClosed as exc:
                # A refusal comes as a verdict before the close; a bare close means the
                # peer died or went away, which callers treat as a lost peer.
                raise TransportClosed(
                    f"{stream.peer} closed the connection during the handshake") from exc
            check_verdict(verdict, token, s_nonce, c_nonce, stream.peer)
            stream.authenticated()
    except TimeoutError as exc:
        raise Timeout(f"handshake with {stream.peer} took longer than {timeout:g}s") from exc


def client_answer(hello: dict, token: str, peer: str) -> tuple[bytes, bytes, m.Proof]:
    """The client's side of the handshake, free of I/O: check the server's
    hello, return its nonce, ours and the message that answers it."""
    if hello.get("hello") != "hoplite-gpu":
        raise ProtocolError(f"{peer} is not a hoplite-gpu endpoint")
    if hello.get("version") != PROTOCOL_VERSION:
        raise ProtocolError(f"{peer} speaks protocol {hello.get('version')}, we speak {PROTOCOL_VERSION}")
    s_nonce, c_nonce = hello.get("nonce"), os.urandom(_NONCE)
    if not isinstance(s_nonce, bytes) or len(s_nonce) < 16:
        raise ProtocolError(f"{peer} sent a malformed handshake (no usable nonce)")
    return s_nonce, c_nonce, m.Proof(nonce=c_nonce, mac=_mac(token, b"client", s_nonce, c_nonce))


def check_verdict(verdict: dict, token: str, s_nonce: bytes, c_nonce: bytes, peer: str) -> None:
    """The server's verdict: accepted, and proving it knows the token too."""
    if not verdict.get("ok"):
        raise AuthenticationFailed(
            f"{peer} refused us: {verdict.get('error', 'no reason given')}. "
            "Check that this process uses the same cluster token (HOPLITE_TOKEN) as the directory."
        )
    mac = verdict.get("mac")
    if not isinstance(mac, bytes) or not hmac.compare_digest(mac, _mac(token, b"server", c_nonce, s_nonce)):
        raise AuthenticationFailed(f"{peer} could not prove it knows the cluster token")
