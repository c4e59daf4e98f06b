"""Format the tree's C with clang-format (.clang-format), or check that it is formatted.

    python tools/clang_format.py            # rewrite the C files in place
    python tools/clang_format.py --check    # exit 1, naming each file, where one is not formatted

The files are git's C files (``*.c``, ``*.h``); clang-format is the one of this Python's
environment (the ``clang-format`` wheel of the test extras, so CI and every developer run the
same version), else the one on PATH. .ci/run and the pre-commit hook run the check.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def c_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "*.c", "*.h"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return [line for line in out.stdout.splitlines() if line]


def clang_format() -> str:
    beside = Path(sys.executable).parent / "clang-format"
    found = str(beside) if beside.exists() else shutil.which("clang-format")
    if found is None:
        raise SystemExit("clang-format not found: pip install -e '.[test]' installs it")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if a file is not formatted"
    )
    args = ap.parse_args()
    files = c_files()
    mode = ["--dry-run", "--Werror"] if args.check else ["-i"]
    run = subprocess.run([clang_format(), *mode, *files], cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        bad = sorted({line.split(":")[0] for line in run.stderr.splitlines() if ": error:" in line})
        print(
            f"not formatted (python tools/clang_format.py rewrites them): {', '.join(bad)}"
            if bad
            else run.stderr[-2000:],
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
