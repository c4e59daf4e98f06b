"""The `foundry` command: help works and every registered subcommand has help too."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tree import project_files

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


def test_ctl_says_why_a_run_waits_or_failed() -> None:
    from foundry.api.v1 import training_pb2 as pb
    from foundry.commands.ctl_format import format_state, format_training

    one = [pb.Worker(worker_id="w0")]
    assert (
        format_state(pb.TrainingStatus(state=pb.TRAINING_STATE_WAITING, min_workers=2, workers=one))
        == "WAITING: 1 of 2 workers (min-workers 2)"
    )
    assert (
        format_state(pb.TrainingStatus(state=pb.TRAINING_STATE_WAITING, min_workers=1, workers=one))
        == "WAITING for START (foundry ctl start)"
    )
    assert (
        format_state(pb.TrainingStatus(state=pb.TRAINING_STATE_TRAINING, seconds_since_step=2.5))
        == "TRAINING (last step 2.5 s ago)"
    )
    failed = pb.TrainingStatus(state=pb.TRAINING_STATE_FAILED, note="round loop failed: X")
    assert format_state(failed) == "FAILED: round loop failed: X"
    assert "warning" not in format_training(failed)
    warned = pb.TrainingStatus(state=pb.TRAINING_STATE_TRAINING, note="checkpoints failing")
    assert "\nwarning: checkpoints failing\n" in format_training(warned)
    assert format_state(pb.TrainingStatus(state=pb.TRAINING_STATE_PAUSED)) == "PAUSED"


def test_ctl_status_lists_each_ranks_threads() -> None:
    """The leader's STATUS, as the gateway turns it into GetPairStatus and ``foundry ctl
    status`` prints it: every rank's threads, none where a rank did not report them."""
    from foundry.commands.ctl_format import format_pair
    from foundry.gateway.servicers import pair_status_pb
    from foundry.wire import frontend as fw

    ranks = (
        fw.RankStatus(0, 1, True, 0, 2),
        fw.RankStatus(1, 1, True, 153, 4),
        fw.RankStatus(2, 1, False, 0, 0),  # out of the world: not reported
    )
    status = fw.Status(0, False, False, 0, 0, 2, 64, 259, 256, 1000, 7, 0.0, 0, 2, ranks)
    pb = pair_status_pb(status)
    assert [r.threads for r in pb.ranks] == [2, 4, 0]
    assert format_pair(pb).splitlines()[2:] == [
        "      rank 0 (leader)  share 1/3  threads 2",
        "      rank 1 (worker)  share 1/3  threads 4  gate wait 153 us",
        "      rank 2 (worker)  share 1/3  gate wait 0 us  DISCONNECTED",
    ]


def _parsers(
    parser: argparse.ArgumentParser, path: str = "foundry"
) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _parsers(sub, f"{path} {name}")
    return found


def test_every_flag_with_a_default_shows_it(capsys: pytest.CaptureFixture[str]) -> None:
    parsers = _parsers(build_parser())
    assert len(parsers) > 20  # the nested ones (ctl's actions, model's) included
    missing = []
    for path, parser in parsers:
        for action in parser._actions:
            if (
                not action.option_strings
                or action.nargs == 0
                or action.default is None
                or action.default is argparse.SUPPRESS
                or action.help == argparse.SUPPRESS
            ):
                continue
            # The flag's row as --help prints it (argparse wraps lines).
            row = " ".join(parser._get_formatter()._format_action(action).split())
            if "default" not in row.lower():
                missing.append(f"{path} {action.option_strings[-1]}: {row}")
    assert missing == []
    init = next(p for path, p in parsers if path == "foundry model init").format_help()
    assert "model size (default: tiny)" in " ".join(init.split())


def test_no_parser_takes_a_prefix_of_a_flag() -> None:
    """`--step 5` once ran `--steps 5`: argparse's abbreviations are off in every parser."""
    parsers = _parsers(build_parser())
    assert [path for path, p in parsers if p.allow_abbrev] == []
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["train", "--step", "5"])
    assert exc.value.code == 2


def test_every_argument_parser_in_the_tree_refuses_abbreviations() -> None:
    """Scripts (bench/, tools/, services/, proto/) make their own parsers: each says so."""
    root = Path(__file__).resolve().parent.parent
    bare = []
    for path in project_files(".py"):
        text = path.read_text(errors="replace")
        for n, line in enumerate(text.splitlines(), start=1):
            if (
                "ArgumentParser(" in line
                and "class " not in line
                and "allow_abbrev=False" not in " ".join(text.splitlines()[n - 1 : n + 2])
            ):
                bare.append(f"{path.relative_to(root)}:{n}")
    assert bare == []


def test_an_unknown_flag_prints_the_usage_of_its_subcommand() -> None:
    """`foundry up --gpu`: the usage of `foundry up` (whose flags the user is after), not the
    top-level one."""
    res = subprocess.run(
        [sys.executable, "-m", "foundry", "up", "--gpu"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2
    assert res.stderr.startswith("usage: foundry up "), res.stderr
    assert "foundry up: error: unrecognized arguments: --gpu" in res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "foundry", "ctl", "status", "--nosuch"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert res.stderr.startswith("usage: foundry ctl status "), res.stderr


def test_up_with_a_missing_model_file_leaves_no_run_folder(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "foundry",
            "up",
            "--model",
            str(tmp_path / "nosuch.gguf"),
            "--run-dir",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert res.stderr.strip() == f"error: --model {tmp_path / 'nosuch.gguf'}: no such file"
    assert not run_dir.exists()


def test_generate_stats_give_tokens_per_second(tmp_path: Path) -> None:
    from tp_harness import make_model

    model = make_model(tmp_path / "model.gguf")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "foundry",
            "generate",
            "--model",
            str(model),
            "--prompt",
            "The ",
            "--max-tokens",
            "8",
            "--stats",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    m = re.fullmatch(
        r"8 tokens after a 5-token prompt in ([\d.]+) s \(([\d.]+) tokens/s; "
        r"first token ([\d.]+) s, then ([\d.]+) tokens/s\), finished: length\n",
        res.stderr,
    )
    assert m is not None, res.stderr
    total, rate, first, decode = map(float, m.groups())
    assert 0 < first < total and rate == pytest.approx(8 / total, rel=0.2) and decode > 0
