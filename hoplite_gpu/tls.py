"""Optional TLS: the contexts a process's TCP connections run in, built once
from its settings (`tls_cert`, `tls_key`, `tls_ca`; docs/security.md).

Both sides of every connection show a certificate and check the other's
against the cluster's CA (TLS 1.2 at least). Host names are not checked:
nodes reach each other by IP and are given their peers' addresses by the
directory, so a peer is whoever holds a key whose certificate the cluster's
CA signed. The CA is the cluster's membership; keep it the cluster's own.
The token's handshake still runs inside TLS.

Everything that can be wrong with the files is found here, at `init` or
when a directory starts, before anything connects: a file that cannot be
read, a key that does not match its certificate, a certificate that the
CA did not sign or that is not valid now (a handshake in memory between
the two contexts checks the last two).
"""

from __future__ import annotations

import logging
import ssl

from .config import Config
from .errors import ConfigError
from .transports.tls import TLS

log = logging.getLogger("hoplite_gpu.tls")

#: Set once the warning that UCX carries no TLS has been logged.
_warned_ucx = False


def load(config: Config) -> TLS | None:
    """The TLS contexts `config` asks for (None: no TLS settings). Raises
    ConfigError naming the setting and the file at fault."""
    if config.tls_cert is None:
        return None
    cert, key, ca = config.tls_cert, config.tls_key, config.tls_ca
    assert key is not None and ca is not None  # (Config: all three or none)
    for setting, path in (("tls_cert", cert), ("tls_key", key), ("tls_ca", ca)):
        _check_readable(setting, path)
    server = _context(ssl.PROTOCOL_TLS_SERVER, cert, key, ca)
    client = _context(ssl.PROTOCOL_TLS_CLIENT, cert, key, ca)
    _check_pair(server, client, cert, ca)
    _warn_about_ucx(config)
    return TLS(server=server, client=client, handshake_s=config.connect_timeout_s)


def _name(setting: str, path: str) -> str:
    return f"{setting} (HOPLITE_{setting.upper()}) = {path!r}"


def _check_readable(setting: str, path: str) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        raise ConfigError(f"{_name(setting, path)} cannot be read: "
                          f"{exc.strerror or exc}") from None


def _no_password() -> bytes:
    raise ConfigError("the key is encrypted; hoplite-gpu reads unencrypted keys (keep the "
                      "file readable by its owner only)")


def _context(protocol: int, cert: str, key: str, ca: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_RENEGOTIATION
    if protocol == ssl.PROTOCOL_TLS_CLIENT:
        ctx.check_hostname = False  # (see the module doc: the chain is checked, not names)
    else:
        # No session tickets: nothing is resumed, and a ticket arriving on an
        # idle pooled connection would read as the peer closing it.
        ctx.num_tickets = 0
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_verify_locations(cafile=ca)
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"{_name('tls_ca', ca)} holds no usable CA certificate (PEM): "
                          f"{exc}") from None
    try:
        ctx.load_cert_chain(cert, key, password=_no_password)
    except ConfigError as exc:
        raise ConfigError(f"{_name('tls_key', key)}: {exc}") from None
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"{_name('tls_cert', cert)} and {_name('tls_key', key)} are not "
                          f"a certificate (PEM) and its private key: {exc}") from None
    return ctx


def _check_pair(server: ssl.SSLContext, client: ssl.SSLContext, cert: str, ca: str) -> None:
    """A handshake in memory between the two contexts: each side's
    certificate is the one a peer will check against its CA."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    s = server.wrap_bio(to_server, to_client, server_side=True)
    c = client.wrap_bio(to_client, to_server, server_side=False)
    done = {s: False, c: False}
    try:
        for _ in range(16):  # (a handshake is a few flights each way)
            for side in (c, s):
                if not done[side]:
                    try:
                        side.do_handshake()
                        done[side] = True
                    except ssl.SSLWantReadError:
                        pass
            if all(done.values()):
                return
    except ssl.SSLError as exc:
        reason = getattr(exc, "verify_message", None) or exc
        raise ConfigError(f"{_name('tls_cert', cert)} does not verify against "
                          f"{_name('tls_ca', ca)}: {reason}; every peer would refuse this "
                          "process") from None
    raise ConfigError(f"{_name('tls_cert', cert)}: a TLS handshake with itself did not end")


def _warn_about_ucx(config: Config) -> None:
    global _warned_ucx
    over_ucx = [name for name, scheme in (("HOPLITE_TRANSPORT", config.transport),
                                          ("HOPLITE_CONTROL_TRANSPORT", config.control_transport))
                if scheme == "ucx"]
    if over_ucx and not _warned_ucx:
        _warned_ucx = True
        log.warning("TLS is configured, but %s=ucx: what goes over UCX is not encrypted "
                    "(TLS covers TCP connections only; docs/security.md)", " and ".join(over_ucx))
