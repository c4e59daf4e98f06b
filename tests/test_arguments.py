"""Hostile values on every flag of every command: a one-line error and exit 2, never a
traceback. The sweep runs each command as a real process (``tests/argsweep.py``); the cases
named in the issue that found them are checked one by one too."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from procs import IS_ROOT, NEEDS_ROOT, full_dir, needs, read_only_dir

ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
HERE = Path(__file__).parent
# argparse's own last line, or ours.
ERROR_LINE = re.compile(r"^(foundry[\w -]*: error: |error: )")


def foundry(*args: str | bytes, cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "foundry", *args],
        capture_output=True,
        timeout=120,
        env=ENV,
        cwd=cwd,
    )


def last_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else ""


@pytest.mark.slow
def test_every_flag_of_every_command_refuses_hostile_values_without_a_traceback(
    tmp_path: Path,
) -> None:
    got = subprocess.run(
        [sys.executable, str(HERE / "argsweep.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    rows = [json.loads(line) for line in got.stdout.splitlines() if line.startswith("{")]
    # Every command is there, with its flags (about 190 flags, 4 values each).
    assert len(rows) > 600
    assert {r["argv"][0] for r in rows} >= {
        "model",
        "train",
        "generate",
        "coordinator",
        "worker",
        "export",
        "tp-leader",
        "tp-worker",
        "gateway",
        "ctl",
        "up",
        "profile",
        "certs",
        "probe",
        "timeline",
    }
    bad = []
    for r in rows:
        out = r["output"]
        if "Traceback" in out:
            bad.append((r["argv"], "traceback", out[-1500:]))
        elif r.get("running"):
            continue  # took the value and serves: a legal value (an empty host, a long deadline)
        elif r["exit"] not in (0, 1, 2):
            bad.append((r["argv"], f"exit {r['exit']}", out[-500:]))
        elif r["exit"] == 2 and not ERROR_LINE.match(last_line(out)):
            bad.append((r["argv"], "exit 2 without an error line", out[-500:]))
    assert not bad, "\n\n".join(f"{argv}: {why}\n{out}" for argv, why, out in bad[:10])
    # Usage errors are usage errors: every non-UTF-8 value and every negative count.
    non_utf8 = [r for r in rows if r["argv"][-1] == "\\xff"]
    assert non_utf8 and all(r.get("exit") == 2 for r in non_utf8)
    assert all("is not valid UTF-8" in last_line(r["output"]) for r in non_utf8)


@pytest.mark.parametrize(
    "args",
    [
        ("--max-tokens", "-1"),
        ("--max-tokens", "4294967296"),
        ("--seed", "-1"),
        ("--top-p", "0"),
        ("--temperature", "nan"),
    ],
    ids=lambda a: " ".join(a),
)
def test_ctl_generate_numbers_out_of_range_are_usage_errors(args: tuple[str, str]) -> None:
    got = foundry("ctl", "--gateway", "127.0.0.1:1", "generate", "--prompt", "a", *args)
    err = got.stderr.decode()
    assert got.returncode == 2, err
    assert "Traceback" not in err
    assert re.search(rf"argument {args[0]}: .*({re.escape(args[1])}|finite)", last_line(err))


def test_a_prompt_that_is_not_utf8_is_a_usage_error() -> None:
    got = foundry("ctl", "generate", "--prompt", b"caf\xe9")
    err = got.stderr.decode()
    assert got.returncode == 2 and "Traceback" not in err
    assert last_line(err).endswith("(b'caf\\xe9') is not valid UTF-8; foundry takes UTF-8 text")


def test_train_on_a_two_byte_corpus_says_so(tmp_path: Path) -> None:
    corpus = tmp_path / "tiny.txt"
    corpus.write_bytes(b"ab")
    got = foundry("train", "--data", str(corpus), "--steps", "2", "--no-progress")
    err = got.stderr.decode()
    assert got.returncode == 2 and "Traceback" not in err
    assert re.match(r"error: corpus .*tiny.txt has \d+ tokens, too few", last_line(err))


@needs(IS_ROOT, NEEDS_ROOT)
@pytest.mark.parametrize("disk", ["read-only", "full"])
def test_train_with_a_checkpoint_dir_it_cannot_write_says_so(tmp_path: Path, disk: str) -> None:
    mount = read_only_dir if disk == "read-only" else full_dir
    with mount(tmp_path / "ckpt") as ckpt:
        got = foundry(
            "train",
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            "1",
            "--steps",
            "1",
            "--no-progress",
        )
    err = got.stderr.decode()
    assert got.returncode == 1 and "Traceback" not in err
    assert re.match(
        r"error: could not write checkpoint .*step-000001\.ckpt: .*"
        r"(Read-only file system|No space left on device)",
        last_line(err),
    )
