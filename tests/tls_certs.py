"""Certificates for the TLS tests, made by `foundry certs` as a user makes them."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from foundry.cli import main as cli_main
from foundry.transport import tls


@dataclass(frozen=True)
class Certs:
    dir: Path
    other: Path  # the same roles, signed by another CA

    def flags(self, role: str, *, prefix: str = "tls") -> list[str]:
        d = self.dir
        return [
            f"--{prefix}-cert",
            str(d / f"{role}.pem"),
            f"--{prefix}-key",
            str(d / f"{role}-key.pem"),
            f"--{prefix}-ca",
            str(d / "ca.pem"),
        ]

    def client(self, role: str = "gateway") -> ssl.SSLContext:
        d = self.dir
        return tls.client_context(d / f"{role}.pem", d / f"{role}-key.pem", d / "ca.pem")


def make_certs(out: Path) -> None:
    """`foundry certs --out OUT`, in this process (the command's own code, without a second
    interpreter's start)."""
    assert cli_main(["certs", "--out", str(out)]) == 0


def two_cas(base: Path) -> Certs:
    """A deployment's CA and its certificates in ``base/ca``, another CA's in ``base/other``."""
    make_certs(base / "ca")
    make_certs(base / "other")
    return Certs(base / "ca", base / "other")
