"""The project's own files: what git tracks or would track (ignored paths such as .venv/,
build outputs and local scratch folders left out), for tests that read the whole tree."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def project_files(*suffixes: str) -> list[Path]:
    """Tracked files and untracked ones that .gitignore does not exclude, with these suffixes."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    paths = (ROOT / name for name in out.split("\0") if name)
    return sorted(p for p in paths if p.suffix in suffixes and p.is_file())
