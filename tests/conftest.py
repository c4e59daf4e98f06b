"""Suite-wide settings, and the fixtures that tests in more than one file share.

Hypothesis judges its own speed by the clock: on a loaded two-core runner a slow draw fails the
"too_slow" health check and a slow example the per-example deadline, though nothing is wrong
with the code. Both are off for every property test; pytest-timeout still bounds a hang.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from tp_harness import make_model

settings.register_profile("foundry", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("foundry")


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("plain") / "model.gguf")
