"""TLS under the native links: every ``ssl.SSLContext`` of the project is built here.

Security is a layer under the protocols, not a change to them: the FDTC worker and admin
links, the TP control and gate connections and the TP frontend link carry exactly the same
bytes inside TLS as without it. What this module decides, once for all of them:

- **TLS 1.2 at least**, with Python's default cipher list (forward-secret suites only).
- **Server**: presents ``cert`` + ``key``. With ``ca`` it asks every client for a certificate
  and refuses one that is missing or not signed by that CA (mutual TLS); without ``ca`` the
  link is encrypted and the server authenticated, clients are not.
- **Client**: verifies the server's certificate against ``ca`` (the system's trust store when
  no ``ca`` is given) **and its name**: the host the client dials (``--coordinator``,
  ``--leader``, ``--coordinator-admin``, ``--tp-frontend``) must be a DNS or IP subject
  alternative name of the server's certificate. ``foundry certs`` puts the Compose and
  Kubernetes service names, ``localhost``, ``127.0.0.1`` and ``::1`` there. With ``cert`` and
  ``key`` the client presents its own certificate.
- Client certificates are checked for the CA's signature and the clientAuth purpose, not for
  a name: every certificate of the deployment's CA is trusted, so a CA per deployment is the
  trust boundary.
- **Links between equals** (the gate links between the workers of a world of N > 2 ranks,
  :class:`PeerContexts`): both ends present their certificate and require the other's, signed
  by ``ca``; the dialer checks the acceptor's serverAuth purpose and the acceptor the dialer's
  clientAuth, but no name: a peer is known only by the address the leader saw it at
  (docs/guide/tls.md, "Gates between workers", says why).

A refusal happens in the TLS handshake, before any byte of the protocol above it is read;
:func:`refusal_reason` turns the ``ssl`` error into the reason the server logs.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import time
from dataclasses import dataclass
from pathlib import Path

# A client must finish its TLS handshake within this time, or the server closes the
# connection: a handshake is a few kilobytes, so ten seconds covers a slow Wi-Fi link.
HANDSHAKE_TIMEOUT_S = 10.0
MINIMUM_VERSION = ssl.TLSVersion.TLSv1_2
X509_V_ERR_INVALID_PURPOSE = 26  # OpenSSL's verify code: a certificate used against its EKU

# Environment variables read when the matching flag is not given (every native-link command).
ENV_CERT = "FOUNDRY_TLS_CERT"
ENV_KEY = "FOUNDRY_TLS_KEY"
ENV_CA = "FOUNDRY_TLS_CA"

# OpenSSL reasons -> what they mean for an operator reading the server's log.
_HINTS = {
    "WRONG_VERSION_NUMBER": "the peer does not speak TLS (a plaintext client?)",
    "HTTP_REQUEST": "the peer does not speak TLS (a plaintext client?)",
    "UNKNOWN_PROTOCOL": "the peer does not speak TLS (a plaintext client?)",
    "UNSUPPORTED_PROTOCOL": "the peer offers no TLS version of 1.2 or later",
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "the peer sent no client certificate "
    "(give it --tls-cert and --tls-key)",
    "CERTIFICATE_VERIFY_FAILED": "the peer's certificate is not signed by this side's --tls-ca",
    "TLSV1_ALERT_UNKNOWN_CA": "the peer does not trust this side's certificate "
    "(check the peer's --tls-ca)",
    "SSLV3_ALERT_BAD_CERTIFICATE": "the peer rejected this side's certificate "
    "(check the names in it and the peer's --tls-ca)",
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "the server asked for a client certificate and got "
    "none (give this process --tls-cert and --tls-key)",
}


class TlsConfigError(ValueError):
    """The TLS flags or files cannot make a context (names the flag and what to fix)."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of one side of the native links; all None means no TLS."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    @property
    def enabled(self) -> bool:
        return any(p is not None for p in (self.cert, self.key, self.ca))

    @classmethod
    def resolve(
        cls, cert: Path | None, key: Path | None, ca: Path | None, *, env: bool = True
    ) -> TlsFiles:
        """The flags' values, each falling back to its ``FOUNDRY_TLS_*`` variable (an empty
        variable counts as unset) when ``env``."""

        def pick(value: Path | None, name: str) -> Path | None:
            if value is not None or not env:
                return value
            text = os.environ.get(name, "")
            return Path(text) if text else None

        return cls(pick(cert, ENV_CERT), pick(key, ENV_KEY), pick(ca, ENV_CA))


def server_context(cert: Path, key: Path, ca: Path | None = None) -> ssl.SSLContext:
    """A listener's context: present ``cert``; with ``ca``, require client certificates it
    signed (mutual TLS)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = MINIMUM_VERSION
    _load_chain(ctx, cert, key)
    if ca is not None:
        _load_ca(ctx, ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(
    cert: Path | None = None, key: Path | None = None, ca: Path | None = None
) -> ssl.SSLContext:
    """A dialer's context: verify the server (certificate and name) against ``ca`` or the
    system's trust store; present ``cert`` when given."""
    if (cert is None) != (key is None):
        raise TlsConfigError("a client certificate needs its key: give --tls-cert and --tls-key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname
    ctx.minimum_version = MINIMUM_VERSION
    if ca is not None:
        _load_ca(ctx, ca)
    else:
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    if cert is not None and key is not None:
        _load_chain(ctx, cert, key)
    return ctx


@dataclass(frozen=True)
class PeerContexts:
    """Both ends of a link between equals: ``dial`` for the side that connects, ``accept`` for
    the side that listens. Each presents this process's certificate and requires the peer's,
    signed by the CA (mutual TLS), with no name check."""

    dial: ssl.SSLContext
    accept: ssl.SSLContext


def peer_contexts_for(files: TlsFiles) -> PeerContexts | None:
    """The contexts of ``files`` for links between equals; None unless all three of cert, key
    and CA are given (a link between equals needs each side's certificate and the CA)."""
    if files.cert is None or files.key is None or files.ca is None:
        return None
    dial = client_context(files.cert, files.key, files.ca)
    dial.check_hostname = False  # still CERT_REQUIRED: the CA's signature and serverAuth
    return PeerContexts(dial=dial, accept=server_context(files.cert, files.key, files.ca))


def server_context_for(files: TlsFiles) -> ssl.SSLContext | None:
    """The listener context of ``files`` (None when TLS is off)."""
    if not files.enabled:
        return None
    if files.cert is None or files.key is None:
        raise TlsConfigError(
            "a TLS listener needs its certificate and key: give --tls-cert and --tls-key "
            f"(or {ENV_CERT} and {ENV_KEY}); --tls-ca alone only configures clients"
        )
    return server_context(files.cert, files.key, files.ca)


def client_context_for(files: TlsFiles) -> ssl.SSLContext | None:
    """The dialer context of ``files`` (None when TLS is off)."""
    if not files.enabled:
        return None
    return client_context(files.cert, files.key, files.ca)


def _need_file(path: Path, what: str) -> None:
    if not Path(path).is_file():
        raise TlsConfigError(f"cannot read the {what} {path}: no such file")


def _load_chain(ctx: ssl.SSLContext, cert: Path, key: Path) -> None:
    _need_file(cert, "certificate")
    _need_file(key, "key")
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(
            f"cannot load the certificate {cert} with the key {key}: {exc}; both must be PEM "
            "and belong together"
        ) from None


def _load_ca(ctx: ssl.SSLContext, ca: Path) -> None:
    _need_file(ca, "CA file")
    try:
        ctx.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(f"cannot load the CA file {ca}: {exc}; it must be PEM") from None


def refusal_reason(exc: BaseException) -> str:
    """Why a TLS handshake failed, in words for the server's log."""
    if isinstance(exc, TimeoutError):
        return str(exc) or "no complete TLS handshake in time"
    if isinstance(exc, ssl.SSLCertVerificationError):
        hint = _HINTS["CERTIFICATE_VERIFY_FAILED"]
        if exc.verify_code == X509_V_ERR_INVALID_PURPOSE:
            hint = (
                "the peer's certificate is not made for this end of the link (a client "
                "certificate where a server's is due, or the other way round: make it "
                "again with `foundry certs`)"
            )
        return f"CERTIFICATE_VERIFY_FAILED, {hint}: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        reason: str = exc.reason or type(exc).__name__
        known = _HINTS.get(reason)
        return f"{reason}, {known}" if known else f"{reason}: {exc}"
    return f"{type(exc).__name__}: {exc}"


def closed_early(exc: BaseException) -> bool:
    """The peer hung up in the handshake without a TLS alert: a port probe (a TCP connect and
    close, as `foundry probe` does), not a refusal worth a warning."""
    return isinstance(exc, ssl.SSLEOFError | ConnectionResetError | BrokenPipeError) or (
        isinstance(exc, ssl.SSLError) and exc.reason == "UNEXPECTED_EOF_WHILE_READING"
    )


def wrap_blocking(
    ctx: ssl.SSLContext,
    sock: socket.socket,
    *,
    server_side: bool,
    server_hostname: str | None = None,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> ssl.SSLSocket:
    """TLS over a connected blocking socket, the handshake done within ``timeout_s`` in all
    (a per-read timeout alone would let a peer drip a byte at a time). The returned socket
    has the timeout ``sock`` had. Raises ``ssl.SSLError``, ``OSError`` or ``TimeoutError``;
    ``sock`` is closed then."""
    timeout = sock.gettimeout()
    deadline = time.monotonic() + timeout_s
    try:
        tls = ctx.wrap_socket(
            sock, server_side=server_side, server_hostname=server_hostname,
            do_handshake_on_connect=False,
        )  # fmt: skip
    except BaseException:
        sock.close()
        raise
    try:
        tls.setblocking(False)
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                events = select.POLLIN
            except ssl.SSLWantWriteError:
                events = select.POLLOUT
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no complete TLS handshake within {timeout_s:g} s")
            poller = select.poll()
            poller.register(tls, events)
            poller.poll(max(1, int(left * 1000) + 1))
        tls.settimeout(timeout)
    except BaseException:
        tls.close()
        raise
    return tls
