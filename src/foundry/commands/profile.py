"""`foundry profile`: the hardware profile this machine would register with, and its batch."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from foundry.hardware import detect_profile


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "profile",
        help="show this machine's hardware profile, cores, memory and training batch",
        description="Detect the hardware profile a worker on this machine registers with "
        "(Raspberry Pi model from the device tree, otherwise cores and memory, capped by "
        "cgroup limits) and the micro-batch and accumulation steps it starts with.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--root",
        type=Path,
        default=Path("/"),
        metavar="DIR",
        help="read proc/ and sys/ under DIR instead of / (an image mounted elsewhere)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    info = detect_profile(args.root)
    fields = {
        "profile": info.profile.name,
        "profile_code": int(info.profile),
        "description": info.description,
        "cores": info.cores,
        "memory_mb": info.memory_mb,
        "batch_size": info.batch_size,
        "accumulation_steps": info.accumulation_steps,
    }
    if args.json:
        print(json.dumps(fields))
        return 0
    print(f"profile             {info.profile.name} ({int(info.profile)})")
    print(f"description         {info.description}")
    print(f"cores               {info.cores}")
    print(f"memory              {info.memory_mb} MiB")
    print(f"batch size          {info.batch_size}")
    print(f"accumulation steps  {info.accumulation_steps}")
    return 0
