"""Every benchmark script starts: its imports resolve and ``--help`` prints its usage.

The benchmarks run on demand (and on the borrowed machine), never in the suite; this keeps a
refactor of the package from breaking one of them unnoticed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
# Scripts, not the modules they share (bench/live.py): those that run as __main__.
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if '__name__ == "__main__"' in p.read_text())


def test_there_are_benchmarks() -> None:
    assert "lan.py" in SCRIPTS and "local_steps.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_prints_its_help(script: str) -> None:
    res = subprocess.run([sys.executable, str(BENCH / script), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "usage:" in res.stdout
