"""Suite-wide settings, and the fixtures that tests in more than one file share.

Hypothesis judges its own speed by the clock: on a loaded two-core runner a slow draw fails the
"too_slow" health check and a slow example the per-example deadline, though nothing is wrong
with the code. Both are off for every property test; pytest-timeout still bounds a hang.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_pair import MODEL_CFG, PAIR_FLAGS, Pair, free_port, running_pair
from hypothesis import HealthCheck, settings
from openai_server import HTTP_LINE, MAX_ACTIVE, METRICS_LINE, QUEUE, TOKEN, Server
from procs import Service
from tp_harness import make_model

settings.register_profile("foundry", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("foundry")


# A tiny model of the default shape, for tests of hostile files and requests
# (test_hostile_models.py, test_hostile_peers.py) and of the pair (test_tp_service_*.py).
@pytest.fixture(scope="module")
def plain_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("plain") / "model.gguf")


# The gateway's tests (test_gateway_*.py, test_openai_http_*.py): a model for the pair, and a
# running pair (a file that defines its own ``model`` or ``pair`` fixture uses that one).
@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "model.gguf", MODEL_CFG)


@pytest.fixture(scope="module")
def pair(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    with running_pair(model, tmp_path_factory.mktemp("pair")) as p:
        yield p


# The HTTP API's tests (test_openai_http_*.py): the gateway process with its HTTP API in front
# of a pair of the ``model`` above (tests/openai_server.py).
@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("http")
    (logs / "token").write_text(TOKEN + "\n")
    with (
        running_pair(model, logs, (*PAIR_FLAGS, "--chat-template", "gemma")) as pair,
        Service(
            [
                "gateway",
                "--listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
                "--http-max-active",
                str(MAX_ACTIVE),
                "--http-queue",
                str(QUEUE),
                "--token-file",
                str(logs / "token"),
                "--metrics-port",
                "0",
                "--coordinator-admin",
                f"127.0.0.1:{free_port()}",
                "--tp-frontend",
                f"127.0.0.1:{pair.frontend}",
            ],
            logs / "gateway.log",
        ) as gateway,
    ):
        port = int(gateway.wait_for(HTTP_LINE).group(1))
        metrics = int(gateway.wait_for(METRICS_LINE).group(1))
        server = Server(pair, gateway, port, metrics)
        try:
            yield server
        finally:
            for c in server.clients:
                c.close()
        assert "Traceback" not in gateway.text(), gateway.text()[-3000:]
