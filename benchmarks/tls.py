"""What TLS costs: loopback TCP point-to-point and broadcast, TLS off and on.

The same LocalCluster workload twice (same-host shared memory off, so every
byte crosses the TCP transport): a get from one worker by another, and a
broadcast from worker 0 to every other worker, `repeats` rounds of each
after an untimed warm-up (`hoplite_gpu.demo.measure_broadcast`), first in
plain TCP, then with every connection in TLS (a throwaway CA and
certificates made here, with the `cryptography` package). The medians and
the ratio TLS / plain are printed and saved; every copy is checksummed.

``python -m benchmarks tls`` (256 MiB, 8 workers, 5 repeats).
"""

from __future__ import annotations

import argparse
import datetime as dt
import secrets
import statistics
import tempfile
from pathlib import Path

from .args import at_least, size

MiB = 1 << 20


def make_certificates(folder: str | Path, names: tuple[str, ...] = ("node",),
                      ) -> dict[str, dict[str, str]]:
    """A CA of its own and, for each of `names`, a key and a certificate it
    signed (PEM files in `folder`); returns, per name, the settings that use
    them: ``{"tls_cert": ..., "tls_key": ..., "tls_ca": ...}``. Each call
    makes a new CA, under a name of its own: certificates of two calls do not
    verify against each other's. Needs the `cryptography` package."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)

    def build(subject: str, issuer: x509.Name | None, key, sign_key, ca: bool):
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        builder = (x509.CertificateBuilder().subject_name(name)
                   .issuer_name(issuer or name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5))
                   .not_valid_after(now + dt.timedelta(days=2))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ca:
            builder = builder.add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        return builder.sign(sign_key, hashes.SHA256())

    def write(path: Path, data: bytes) -> str:
        path.write_bytes(data)
        path.chmod(0o600)
        return str(path)

    ca_name = f"hoplite-test-ca-{secrets.token_hex(4)}"
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = build(ca_name, None, ca_key, ca_key, ca=True)
    ca_path = write(folder / f"{ca_name}.pem", ca_cert.public_bytes(serialization.Encoding.PEM))
    out = {}
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = build(name, ca_cert.subject, key, ca_key, ca=False)
        out[name] = {
            "tls_cert": write(folder / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM)),
            "tls_key": write(folder / f"{name}.key", key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption())),
            "tls_ca": ca_path}
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=at_least(2), default=8)
    parser.add_argument("--size", type=size, default=256 * MiB,
                        help="bytes of the object (units: 256M, 1GiB)")
    parser.add_argument("--repeats", type=at_least(1), default=5, help="transfers per cluster")
    parser.add_argument("--rounds", type=at_least(1), default=2,
                        help="clusters of each kind, TLS off and on in alternating order")


def measure(workers: int, nbytes: int, repeats: int, tls: dict[str, str] | None) -> dict:
    """One LocalCluster's point-to-point and broadcast times (TLS with `tls`)."""
    import hoplite_gpu as hg
    from hoplite_gpu.cluster import LocalCluster
    from hoplite_gpu.demo import measure_broadcast

    settings = {"shared_memory": False, **(tls or {})}
    with LocalCluster(workers, **settings) as cluster:
        hg.init(cluster.address, token=cluster.token, **settings)
        try:
            m = measure_broadcast(cluster, nbytes, repeats, tag="tls" if tls else "plain")
        finally:
            hg.shutdown()
    return {"tls": tls is not None, "p2p_s": m["p2p_s"], "broadcast_s": m["broadcast_s"],
            "p2p_median_s": statistics.median(m["p2p_s"]),
            "broadcast_median_s": statistics.median(m["broadcast_s"]),
            "byte_identical": m["ok"]}


def run(args: argparse.Namespace, console) -> dict:
    from rich.table import Table

    with tempfile.TemporaryDirectory(prefix="hoplite-tls-bench-") as folder:
        files = make_certificates(folder)["node"]
        launches = []
        for r in range(args.rounds):  # off, on; then on, off; ... (drift hits both alike)
            for tls in ((None, files) if r % 2 == 0 else (files, None)):
                row = measure(args.workers, args.size, args.repeats, tls)
                row.update(workers=args.workers, size_bytes=args.size, repeats=args.repeats,
                           round=r)
                launches.append(row)
                console.print(f"round {r + 1}, TLS {'on' if tls else 'off'}: p2p "
                              f"{row['p2p_median_s'] * 1e3:.1f} ms, broadcast "
                              f"{row['broadcast_median_s'] * 1e3:.1f} ms")
    rows = []
    for on in (False, True):  # every transfer of a kind pooled over its clusters
        mine = [row for row in launches if row["tls"] == on]
        p2p = [x for row in mine for x in row["p2p_s"]]
        bc = [x for row in mine for x in row["broadcast_s"]]
        rows.append({"tls": on, "p2p_s": p2p, "broadcast_s": bc,
                     "p2p_median_s": statistics.median(p2p),
                     "broadcast_median_s": statistics.median(bc),
                     "byte_identical": all(row["byte_identical"] for row in mine),
                     "workers": args.workers, "size_bytes": args.size})
    plain, secured = rows
    ratios = {"p2p": secured["p2p_median_s"] / plain["p2p_median_s"],
              "broadcast": secured["broadcast_median_s"] / plain["broadcast_median_s"]}
    table = Table(title=f"{args.size / MiB:g} MiB over loopback TCP, {args.workers - 1} "
                        f"receivers, medians of {args.repeats * args.rounds}")
    for col in ("transfer", "TLS off (ms)", "TLS on (ms)", "on / off", "TLS on (GB/s)"):
        table.add_column(col, justify="right")
    for what in ("p2p", "broadcast"):
        on = secured[f"{what}_median_s"]
        table.add_row(what, f"{plain[f'{what}_median_s'] * 1e3:.1f}", f"{on * 1e3:.1f}",
                      f"{ratios[what]:.2f} x", f"{args.size / on / 1e9:.2f}")
    console.print(table)
    return {"benchmark": "tls-loopback", "rows": rows, "launches": launches,
            "rounds": args.rounds, "ratio_tls_to_plain": ratios,
            "byte_identical": all(row["byte_identical"] for row in rows)}
