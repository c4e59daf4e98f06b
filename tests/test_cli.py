"""The `foundry` command: help works and every registered subcommand has help too."""

from __future__ import annotations

import subprocess
import sys

import pytest

from foundry.cli import build_parser, main


def test_help_exits_zero_and_names_the_program() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "foundry", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "foundry" in out.stdout


def test_no_subcommand_prints_help_and_fails() -> None:
    assert main([]) == 2


def test_every_subcommand_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    names = [a for a in parser._subparsers._group_actions[0].choices]  # type: ignore[union-attr]
    for name in names:
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([name, "--help"])
        assert exc.value.code == 0
        assert name in capsys.readouterr().out
