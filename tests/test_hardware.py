"""Hardware profile detection on fake /proc and /sys trees, the profile table, the command."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from foundry.cli import command_modules
from foundry.commands import profile as profile_command
from foundry.hardware import (
    HardwareInfo,
    classify,
    detect_profile,
    profile_accumulation_steps,
    profile_batch_size,
    profile_name,
)
from foundry.wire import fdtc
from foundry.wire.fdtc import HardwareProfile as P

GIB_KB = 1024 * 1024


def fake_root(
    tmp_path: Path,
    *,
    model: str | None = None,
    mem_kb: int | None = None,
    cpu: str | None = None,
    files: dict[str, str] | None = None,
) -> Path:
    root = tmp_path / "root"
    root.mkdir()
    if model is not None:  # the firmware writes a NUL-terminated string
        (root / "proc/device-tree").mkdir(parents=True)
        (root / "proc/device-tree/model").write_bytes(model.encode() + b"\0")
    if mem_kb is not None:
        (root / "proc").mkdir(exist_ok=True)
        (root / "proc/meminfo").write_text(
            f"MemTotal:       {mem_kb} kB\nMemFree:        1024 kB\nMemAvailable:   2048 kB\n"
        )
    if cpu is not None:
        (root / "proc").mkdir(exist_ok=True)
        (root / "proc/cpuinfo").write_text(f"processor\t: 0\nmodel name\t: {cpu}\n")
    for rel, text in (files or {}).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize(
    ("model", "mem_kb", "expected"),
    [
        ("Raspberry Pi 4 Model B Rev 1.4", 3_884_376, P.RPI4_4G),  # a real 4 GB board
        ("Raspberry Pi 4 Model B Rev 1.2", 1_891_992, P.RPI4_2G),
        ("Raspberry Pi 4 Model B Rev 1.1", 944_180, P.RPI4_2G),  # the 1 GB board
        ("Raspberry Pi 4 Model B Rev 1.4", 7_998_532, P.RPI4_8G),
        ("Raspberry Pi 400 Rev 1.0", 3_884_376, P.RPI4_4G),
        ("Raspberry Pi Compute Module 4 Rev 1.0", 1_891_992, P.RPI4_2G),
        ("Raspberry Pi 5 Model B Rev 1.0", 8_245_296, P.RPI4_8G),  # nearest profile we have
        ("Raspberry Pi 3 Model B Plus Rev 1.3", 948_304, P.RPI3),
        ("Raspberry Pi Zero 2 W Rev 1.0", 439_100, P.RPI3),
        ("Raspberry Pi Model B Rev 2", 443_000, P.RPI3),  # the first Pi
    ],
)
def test_raspberry_pi_by_model_and_memory(
    tmp_path: Path, model: str, mem_kb: int, expected: P
) -> None:
    info = detect_profile(fake_root(tmp_path, model=model, mem_kb=mem_kb), cpu_count=4)
    assert info == HardwareInfo(expected, 4, mem_kb // 1024, model)


GIB = 1024


@pytest.mark.parametrize(
    ("cores", "memory_mb", "expected"),
    [
        (64, 256 * GIB, P.SERVER),
        (24, 62 * GIB, P.SERVER),  # a "64 GB" machine reports a bit less
        (16, 64 * GIB, P.DESKTOP_HEAVY),  # memory of a server, not the cores
        (12, 31 * GIB, P.DESKTOP_HEAVY),
        (8, 15 * GIB + 512, P.DESKTOP_MID),  # a "16 GB" desktop
        (8, 7 * GIB + 600, P.LAPTOP_MID),
        (4, 7 * GIB + 600, P.LAPTOP_MID),
        (2, 24 * GIB, P.LAPTOP_LIGHT),
        (4, 3 * GIB + 700, P.LAPTOP_LIGHT),  # a "4 GB" laptop
        (1, 8 * GIB, P.UNKNOWN),
        (4, 2 * GIB, P.UNKNOWN),
        (0, 0, P.UNKNOWN),
    ],
)
def test_other_machines_by_cores_and_memory(cores: int, memory_mb: int, expected: P) -> None:
    assert classify(None, cores, memory_mb) is expected
    assert classify("Pine64 RockPro64 v2.1", cores, memory_mb) is expected  # not a Pi


def test_cgroup_v2_limits_make_a_container_small(tmp_path: Path) -> None:
    root = fake_root(
        tmp_path,
        mem_kb=64 * GIB_KB,
        cpu="AMD EPYC 7763 64-Core Processor",
        files={
            "sys/fs/cgroup/memory.max": "4294967296\n",  # 4 GiB
            "sys/fs/cgroup/cpu.max": "150000 100000\n",  # 1.5 CPUs -> 2
        },
    )
    info = detect_profile(root, cpu_count=64)
    assert (info.profile, info.cores, info.memory_mb) == (P.LAPTOP_LIGHT, 2, 4096)
    assert info.description.startswith("AMD EPYC 7763 64-Core Processor (")


def test_cgroup_without_limits_and_v1(tmp_path: Path) -> None:
    unlimited = fake_root(
        tmp_path,
        mem_kb=32 * GIB_KB,
        files={"sys/fs/cgroup/memory.max": "max\n", "sys/fs/cgroup/cpu.max": "max 100000\n"},
    )
    assert detect_profile(unlimited, cpu_count=16).profile is P.DESKTOP_HEAVY
    v1 = tmp_path / "v1"
    v1.mkdir()
    root = fake_root(
        v1,
        mem_kb=32 * GIB_KB,
        files={
            "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",  # none
            "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "400000\n",
            "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
        },
    )
    info = detect_profile(root, cpu_count=16)
    assert (info.cores, info.memory_mb, info.profile) == (4, 32 * GIB, P.LAPTOP_MID)
    no_quota = tmp_path / "noquota"
    no_quota.mkdir()
    root = fake_root(
        no_quota,
        files={
            "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
        },
    )
    assert detect_profile(root, cpu_count=16).cores == 16


def test_nothing_readable_is_unknown(tmp_path: Path) -> None:
    info = detect_profile(fake_root(tmp_path), cpu_count=8)
    assert (info.profile, info.cores, info.memory_mb) == (P.UNKNOWN, 8, 0)
    pi_without_meminfo = tmp_path / "pi"
    pi_without_meminfo.mkdir()
    root = fake_root(pi_without_meminfo, model="Raspberry Pi 4 Model B Rev 1.4")
    assert detect_profile(root, cpu_count=4).profile is P.RPI4_2G  # smallest Pi 4: careful


def test_this_machine() -> None:
    info = detect_profile()
    assert info.cores >= 1 and info.memory_mb > 0
    assert info.profile in set(P)


def test_profile_table() -> None:
    for p in P:
        assert profile_batch_size(p) >= 1 and profile_accumulation_steps(p) >= 1
        assert profile_name(p) == p.name
    assert profile_name(99) == "UNKNOWN"
    assert profile_batch_size(99) == profile_batch_size(P.UNKNOWN)
    # Small devices: small micro-batches, more accumulation; samples per round grow with
    # the class of machine.
    pis = [P.RPI3, P.RPI4_2G, P.RPI4_4G, P.RPI4_8G]
    pcs = [P.LAPTOP_LIGHT, P.LAPTOP_MID, P.DESKTOP_MID, P.DESKTOP_HEAVY, P.SERVER]
    for order in (pis, pcs):
        batches = [profile_batch_size(p) for p in order]
        assert batches == sorted(batches)
    assert max(profile_accumulation_steps(p) for p in pis) > profile_accumulation_steps(P.SERVER)
    rounds = [profile_batch_size(p) * profile_accumulation_steps(p) for p in [P.RPI3, *pcs]]
    assert rounds == sorted(rounds)
    info = HardwareInfo(P.RPI4_4G, 4, 3800, "pi")
    assert (info.batch_size, info.accumulation_steps) == (4, 4)
    assert not hasattr(fdtc, "profile_batch_size")  # one table: policy, here


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="foundry")
    profile_command.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


def test_profile_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "foundry.commands.profile" in command_modules()
    root = fake_root(tmp_path, model="Raspberry Pi 4 Model B Rev 1.4", mem_kb=3_884_376)
    assert _run(["profile", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "RPI4_4G (2)" in out and "Raspberry Pi 4 Model B Rev 1.4" in out
    assert "3793 MiB" in out and "batch size          4" in out
    assert _run(["profile", "--root", str(root), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["profile"] == "RPI4_4G" and data["profile_code"] == 2
    assert (data["memory_mb"], data["batch_size"], data["accumulation_steps"]) == (3793, 4, 4)
