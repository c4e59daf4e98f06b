"""Write docs/reference/cli.md: the help of `foundry` and of every subcommand, from the parsers.

    python tools/cli_reference.py            # rewrite docs/reference/cli.md
    python tools/cli_reference.py --check    # exit 1 if the committed page is not current

tests/test_docs.py runs the check, so a flag added without regenerating the page fails CI.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "cli.md"
WIDTH = "100"  # argparse wraps help to $COLUMNS: fixed, so the page is the same everywhere


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> list[str]:
    out = [
        f"{'#' * min(len(path) + 1, 4)} `{' '.join(path)}`\n",
        "```text",
        parser.format_help().rstrip(),
        "```\n",
    ]
    for name, sub in _subparsers(parser).items():
        out += _walk(sub, (*path, name))
    return out


def render() -> str:
    os.environ["COLUMNS"] = WIDTH
    from foundry.cli import build_parser

    parser = build_parser()
    parser.prog = "foundry"
    lines = [
        "# Command line reference\n",
        "Every command and flag, as `--help` prints it. Generated from the parsers by",
        "`python tools/cli_reference.py`; `tests/test_docs.py` fails when this page is not",
        "current. The guide explains when to use what: [docs/README.md](../README.md).\n",
        *_walk(parser, ("foundry",)),
    ]
    return "\n".join(lines)


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not PAGE.exists() or PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE} is not current: run python tools/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
