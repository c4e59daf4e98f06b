"""`foundry certs`: a development CA and the certificates of every service, for TLS.

One CA signs a certificate per role; docs/guide/tls.md says which service mounts
which files. The files, in ``--out``:

| file | what | used by |
| --- | --- | --- |
| ``ca.pem``, ``ca-key.pem`` | the CA (keep its key off the servers) | ``--tls-ca`` |
| ``coordinator.pem`` / ``-key.pem`` | server | the coordinator's worker and admin links |
| ``tp-leader.pem`` / ``-key.pem`` | server | the leader's worker port and frontend link |
| ``gateway.pem`` / ``-key.pem`` | server and client | gRPC TLS; the gateway's backend links |
| ``worker.pem`` / ``-key.pem`` | client | training workers |
| ``tp-worker.pem`` / ``-key.pem`` | client and server | TP worker ranks (and each other's gates) |

A server certificate names its service (``coordinator``, ``tp-leader``, ``gateway``: the
Compose and Kubernetes service names), the service's Kubernetes DNS names in each
``--namespace``, and every entry of ``--hosts`` (by default ``localhost``, ``127.0.0.1`` and
``::1``): clients check that the host they dial is one of them. An existing CA in ``--out``
is reused, so certificates made later still chain to the CA already deployed.

Keys are ECDSA P-256, certificates SHA-256, made with the ``cryptography`` package.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import ipaddress
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from foundry.commands.common import positive_int

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

DEFAULT_HOSTS = "localhost,127.0.0.1,::1"
DEFAULT_NAMESPACES = ("foundry", "foundry-dev")  # the namespaces of k8s/overlays


@dataclass(frozen=True)
class Role:
    name: str
    server: bool
    client: bool


ROLES = (
    Role("coordinator", server=True, client=False),
    Role("tp-leader", server=True, client=False),
    Role("gateway", server=True, client=True),
    Role("worker", server=False, client=True),
    Role("tp-worker", server=True, client=True),  # a world's workers accept each other's gates
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "certs",
        help="make a development CA and a certificate per service for TLS",
        description="Write a CA (ca.pem, ca-key.pem) and a certificate and key per role "
        "(coordinator, tp-leader, gateway, worker, tp-worker) into --out, for mutual TLS on "
        "the native links (--tls-cert/--tls-key/--tls-ca) and for the gateway's gRPC TLS. "
        "A CA already in --out is reused. See docs/guide/tls.md.",
    )
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="where to write")
    p.add_argument(
        "--hosts",
        default=DEFAULT_HOSTS,
        metavar="H1,H2,...",
        help="DNS names and IP addresses added to every server certificate, besides "
        f"the service's own name (default {DEFAULT_HOSTS}); add the names or "
        "addresses clients dial on other machines",
    )
    p.add_argument(
        "--namespace",
        action="append",
        default=None,
        metavar="NS",
        help="Kubernetes namespace whose service DNS names (NAME.NS.svc, ...) go in "
        f"the server certificates; repeat for more (default: "
        f"{', '.join(DEFAULT_NAMESPACES)})",
    )
    p.add_argument(
        "--days",
        type=positive_int,
        default=365,
        help="validity of the certificates in days (default 365; the CA gets 10x)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("cryptography") is None:
        print(
            "error: `foundry certs` needs the `cryptography` package: pip install cryptography",
            file=sys.stderr,
        )
        return 2
    if args.days < 1:
        print("error: --days must be >= 1", file=sys.stderr)
        return 2
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    namespaces = args.namespace or list(DEFAULT_NAMESPACES)
    out: Path = args.out
    try:
        out.mkdir(parents=True, exist_ok=True)
        ca_key, ca_cert, reused = _ca(out, args.days * 10)
        for role in ROLES:
            names = _server_names(role.name, namespaces, hosts) if role.server else []
            key, cert = _leaf(role, names, ca_key, ca_cert, args.days)
            _write(out / f"{role.name}.pem", _pem_cert(cert), private=False)
            _write(out / f"{role.name}-key.pem", _pem_key(key), private=True)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"{'reused' if reused else 'made'} the CA {out / 'ca.pem'}; certificates for "
        f"{', '.join(r.name for r in ROLES)} in {out} (valid {args.days} days)"
    )
    print(
        f"server names: each service's own, its Kubernetes names in {', '.join(namespaces)}, "
        f"and {', '.join(hosts) or 'nothing else'}"
    )
    print(
        f"e.g. foundry coordinator --tls-cert {out}/coordinator.pem "
        f"--tls-key {out}/coordinator-key.pem --tls-ca {out}/ca.pem"
    )
    return 0


def _server_names(service: str, namespaces: list[str], hosts: list[str]) -> list[str]:
    names = [service]
    for ns in namespaces:
        names += [f"{service}.{ns}", f"{service}.{ns}.svc", f"{service}.{ns}.svc.cluster.local"]
    names += hosts
    return list(dict.fromkeys(names))  # in order, once each


def _ca(out: Path, days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate, bool]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    cert_path, key_path = out / "ca.pem", out / "ca-key.pem"
    if cert_path.exists() and key_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(
                f"{key_path} is not an ECDSA key; remove the old CA or use another --out"
            )
        return key, x509.load_pem_x509_certificate(cert_path.read_bytes()), True
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "foundry"),
            x509.NameAttribute(NameOID.COMMON_NAME, "foundry development CA"),
        ]
    )
    now = _now()
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(cert_path, _pem_cert(cert), private=False)
    _write(key_path, _pem_key(key), private=True)
    return key, cert, False


def _leaf(
    role: Role,
    names: list[str],
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    days: int,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if role.server else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if role.client else []
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "foundry"),
                    x509.NameAttribute(NameOID.COMMON_NAME, role.name),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=False,
                crl_sign=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if names:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([_general_name(n) for n in names]), critical=False
        )
    return key, builder.sign(ca_key, hashes.SHA256())


def _general_name(name: str) -> x509.GeneralName:
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _pem_cert(cert: x509.Certificate) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, *, private: bool) -> None:
    """Write atomically; keys readable by their owner only."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # a leftover keeps its mode through O_CREAT
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
