"""The OpenAI-compatible HTTP API over HTTPS with the gateway's certificate.

A real gateway process in front of a real tensor-parallel pair (both ranks processes,
tests/gateway_pair.py's ``running_pair``; the ``server`` fixture, tests/openai_server.py), on
loopback.
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from gateway_pair import free_port
from openai_server import HTTP_LINE, Server
from procs import Service


def test_https_with_the_gateways_certificate(server: Server, tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    made = subprocess.run(
        [sys.executable, "-m", "foundry", "certs", "--out", str(certs)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    with Service(
        [
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
            "--tls-cert",
            str(certs / "gateway.pem"),
            "--tls-key",
            str(certs / "gateway-key.pem"),
            "--coordinator-admin",
            f"127.0.0.1:{free_port()}",
            "--tp-frontend",
            f"127.0.0.1:{server.pair.frontend}",
        ],
        tmp_path / "gateway.log",
    ) as gateway:
        port = int(gateway.wait_for(HTTP_LINE).group(1))
        with openai.OpenAI(
            base_url=f"https://127.0.0.1:{port}/v1",
            api_key="none",
            max_retries=0,
            http_client=openai.DefaultHttpxClient(
                verify=ssl.create_default_context(cafile=str(certs / "ca.pem"))
            ),
        ) as trusted:
            r = trusted.completions.create(
                model="foundry", prompt="secure", max_tokens=4, temperature=0
            )
        want = server.client().completions.create(
            model="foundry", prompt="secure", max_tokens=4, temperature=0
        )
        assert r.choices[0].text == want.choices[0].text
        with pytest.raises(openai.APIConnectionError):  # plain HTTP on the TLS port
            openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0
            ).models.list()
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        with (
            ssl.create_default_context().wrap_socket(  # a client that does not trust the CA
                raw, server_hostname="127.0.0.1", do_handshake_on_connect=False
            ) as untrusting,
            pytest.raises(ssl.SSLCertVerificationError),
        ):
            untrusting.do_handshake()
