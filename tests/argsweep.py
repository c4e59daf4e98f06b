"""Run every `foundry` command with every flag set to a hostile value; print what each did.

``python tests/argsweep.py WORKDIR`` prints one JSON object per line: the argv, how it ended
(``exit`` with the code, or ``running`` when it was still going after ``RUN_S``: it took the
value and started serving) and its output. Each case is a real process: forked from this one
after the imports (so 700 cases cost seconds, not minutes), it runs ``foundry.cli.main`` as
``python -m foundry`` would, an uncaught exception printed by the interpreter's own hook.

Commands that would start something long get base flags that end them early (one training
step, a dead port to dial); `foundry up` gets run dirs whose lock this process holds, so it
stops at "in use" after checking its options and starts nothing.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

from foundry.cli import build_parser, main

# Hostile values: negative, out of range for a u32, empty, and bytes that are not UTF-8 (as
# Python hands them over from argv).
VALUES = ("-1", "4294967296", "", b"\xff".decode("utf-8", "surrogateescape"))
# A case still running after this long took its values and is serving.
RUN_S = 3.0
PARALLEL = 4
DEAD = "127.0.0.1:1"  # nothing listens on port 1


def base_args(command: tuple[str, ...], work: Path) -> list[str]:
    model = str(work / "model.gguf")
    ckpt = str(work / "ckpt")
    table: dict[tuple[str, ...], list[str]] = {
        ("model", "init"): ["--out", str(work / "init.gguf")],
        ("train",): ["--steps", "1", "--no-progress"],
        ("generate",): ["--model", model, "--prompt", "a", "--max-tokens", "1"],
        ("coordinator",): [
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--checkpoint-dir",
            ckpt,
            "--max-steps",
            "1",
        ],
        ("worker",): ["--coordinator", DEAD],
        ("export",): ["--checkpoint", ckpt, "--out", str(work / "export.gguf")],
        ("tp-leader",): [
            "--model",
            model,
            "--listen",
            "127.0.0.1:0",
            "--frontend-listen",
            "127.0.0.1:0",
        ],
        ("tp-worker",): ["--model", model, "--leader", DEAD],
        ("gateway",): [
            "--listen",
            "127.0.0.1:0",
            "--coordinator-admin",
            DEAD,
            "--tp-frontend",
            DEAD,
        ],
        ("up",): ["--run-dir", str(work / "held"), "--no-prometheus"],
        ("certs",): ["--out", str(work / "certs")],
        ("probe",): [DEAD],
        ("timeline", "merge"): [str(work / "trace.json"), "--out", str(work / "merged.json")],
    }
    if command[0] == "ctl":
        extra = ["--prompt", "a"] if command[1:] == ("generate",) else []
        return ["--gateway", DEAD, *extra]
    return table.get(command, [])


def commands(
    parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield prefix, parser
    for sub in subs:
        for name, child in sub.choices.items():
            yield from commands(child, (*prefix, name))


def cases(work: Path) -> Iterator[list[str]]:
    for command, parser in commands(build_parser()):
        base = base_args(command, work)
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0 or action.help == "==SUPPRESS==":
                continue
            for value in VALUES:
                yield [*command, *base, action.option_strings[-1], value]
    for value in VALUES:  # the positional arguments
        yield ["probe", value]
        yield ["timeline", "merge", value, "--out", str(work / "merged.json")]


def child(argv: list[str], out: Path, work: Path) -> None:
    os.setsid()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(work)
    sys.argv = ["foundry", *argv]
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def hold_locks(work: Path) -> list[int]:
    """`foundry up` run dirs this process holds: the base one and those the values name."""
    fds = []
    for d in (work / "held", work, work / "-1", work / "4294967296"):
        d.mkdir(exist_ok=True)
        fd = os.open(d / "up.lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        fds.append(fd)
    return fds


def run_all(work: Path) -> None:
    locks = hold_locks(work)
    main(["model", "init", "--out", str(work / "model.gguf")])
    (work / "trace.json").write_text('{"traceEvents": []}\n')
    outs = work / "out"
    outs.mkdir(exist_ok=True)
    todo = list(enumerate(cases(work)))
    running: dict[int, tuple[int, list[str], float]] = {}
    while todo or running:
        while todo and len(running) < PARALLEL:
            n, argv = todo.pop(0)
            pid = os.fork()
            if pid == 0:
                for fd in locks:
                    os.close(fd)
                child(argv, outs / f"{n}.txt", work)
            running[pid] = (n, argv, time.monotonic())
        time.sleep(0.01)
        for pid, (n, argv, t0) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == 0 and time.monotonic() - t0 < RUN_S:
                continue
            if done == 0:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                end: dict[str, object] = {"running": True}
            else:
                end = {"exit": os.waitstatus_to_exitcode(status)}
            text = (outs / f"{n}.txt").read_text(errors="replace")
            print(
                json.dumps(
                    {
                        "argv": [
                            a.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
                            for a in argv
                        ],
                        **end,
                        "output": text,
                    }
                ),
                flush=True,
            )
            del running[pid]


if __name__ == "__main__":
    run_all(Path(sys.argv[1]).resolve())
