"""Mutation testing of the code whose mistakes no review catches: wire formats, codecs, checkpoints,
the round policy, the TP split rules and the served path (chat templates, tokenizers, the
gateway's OpenAI layer, the leader's front end), each against its own tests.

    python bench/mutation/mutate.py                      # every target, 20 minutes each at most
    python bench/mutation/mutate.py wire checkpoint      # some of them
    python bench/mutation/mutate.py policy --time-limit 300 --jobs 1

Each target runs mutmut 3 (``pip install -e '.[mutation]'``) in a fresh copy of the tree under
``runs/mutation/<target>`` with only that target's files mutated and only its own unit tests
selected. A mutant the tests do not kill is a *survivor*; each must be listed with a
one-line reason in bench/mutation/survivors.txt (``<mutant name>  <reason>``), and the script
exits 1 when one is not (or when a listed one is now killed or, after a full run, no longer
generated: the list stays true). A target that hits its time limit is reported with how many
mutants were checked; its unchecked ones count as neither. ``mutmut show <name>`` in the
target's folder prints a mutant's diff.

Not part of the default CI: the five targets take about an hour on two cores. docs/testing.md gives
the last result.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SURVIVORS = Path(__file__).resolve().parent / "survivors.txt"


@dataclass(frozen=True)
class Target:
    name: str
    mutate: tuple[str, ...]  # globs under src/, as mutmut's only_mutate takes them
    tests: tuple[str, ...]  # the target's own unit tests (in-process: mutmut forks, never spawns)
    # Regular expressions of source lines left unmutated, each for a reason given where it is set.
    keep_lines: tuple[str, ...] = ()
    # mutmut forks each mutant from a process that has run the tests once (to learn which test
    # reaches which function): what those tests cached, built by the unmutated code, is then
    # inherited. "forkserver" forks from one that has only collected the tests instead.
    isolation: str = "fork"


TARGETS = (
    Target(
        "wire",
        ("src/foundry/wire/*",),
        (
            "tests/test_fdtc_golden.py",
            "tests/test_fdtc_decoder.py",
            "tests/test_fdtc_encoding.py",
            "tests/test_fdtc_lifecycle.py",
            "tests/test_fdtc_bounds.py",
            "tests/test_fdtc_connection.py",
            "tests/test_frontend_wire.py",
            "tests/test_tp_wire_hello.py",
            "tests/test_tp_wire_frames.py",
            "tests/test_tp_wire_gates.py",
            "tests/test_tp_wire_bounds.py",
        ),
    ),
    Target(
        "compression",
        ("src/foundry/compression/*",),
        (
            "tests/test_compression_sections.py",
            "tests/test_compression_fp16.py",
            "tests/test_compression_topk.py",
            "tests/test_compression_qsgd.py",
            "tests/test_compression_error_feedback.py",
        ),
    ),
    # os.kill(pid, 0) probes whether a temp file's writer lives; a mutated signal or pid sends a
    # real signal to the test process or its group, which ends the mutation run itself.
    Target(
        "checkpoint",
        ("src/foundry/model/formats/checkpoint*.py",),
        (
            "tests/test_checkpoint_file.py",
            "tests/test_checkpoint_writes.py",
            "tests/test_checkpoint_metadata.py",
            "tests/test_checkpoint_retention.py",
            "tests/test_checkpoint_resume.py",
            "tests/test_checkpoint_lock.py",
        ),
        keep_lines=(r"os\.kill\(",),
    ),
    Target("policy", ("src/foundry/swarm/policy.py",), ("tests/test_swarm_policy.py",)),
    Target("tp_split", ("src/foundry/model/shard/*",), ("tests/test_tp_split.py",)),
    # The served path. mutmut sees the code that tests run in their own process: the
    # templates' and tokenizers' own tests (llama.cpp's references), and of the gateway the
    # request models, the fair queue, the renderer and the event stream. The pair and the
    # gateway run as processes in tests/test_openai_semantics.py and test_served_matrix.py,
    # which import the unmutated tree: mutants reached only there are listed as such, and
    # bench/mutation/mutate_served.py applies mutations to the code those processes run.
    Target(
        "chat",
        ("src/foundry/model/text/chat*.py",),
        ("tests/test_chat.py", "tests/test_served_units.py"),
    ),
    # The tokenizer tests keep each file's tokenizer (and the BPE model its words' ids): a
    # mutant of the code that builds them, or of a word already seen, would run no code. The
    # byte vocabulary's encode / decode have their own tests in test_data.py.
    Target(
        "vocab",
        ("src/foundry/model/text/vocab/*",),
        (
            "tests/test_vocab_pipeline.py",
            "tests/test_vocab_own.py",
            "tests/test_vocab_metadata.py",
            "tests/test_vocab_llama_cpp.py",
            "tests/test_served_units.py",
            *(
                f"tests/test_data.py::{t}"
                for t in (
                    "test_encode_is_bytes_plus_three_with_bos",
                    "test_round_trip",
                    "test_round_trip_non_ascii",
                    "test_decode_replaces_invalid_bytes_and_rejects_unknown_ids",
                )
            ),
        ),
        isolation="forkserver",
    ),
    Target(
        "gateway",
        ("src/foundry/gateway/openai/*", "src/foundry/gateway/admission.py"),
        (
            "tests/test_openai_render.py",
            "tests/test_openai_http_client.py",
            "tests/test_openai_http_raw.py",
            "tests/test_openai_http_tls.py",
            "tests/test_openai_http_units.py",
            "tests/test_openai_semantics.py",
        ),
    ),
    # The leader's front end: the pair's processes run the installed tree, so mutmut sees what
    # runs in the test process; test_frontend_refusals.py runs the leader there.
    Target(
        "frontend",
        ("src/foundry/tp/frontend_server.py",),
        (
            "tests/test_tp_service_pair.py",
            "tests/test_tp_service_failures.py",
            "tests/test_tp_service_sessions.py",
            "tests/test_openai_semantics.py",
            "tests/test_frontend_refusals.py",
        ),
    ),
)
BY_NAME = {t.name: t for t in TARGETS}

# mutmut's `results` lines: "    foundry.wire.tp.x_encode__mutmut_3: survived"
RESULT = re.compile(r"^\s*(\S+__mutmut_\d+): (\w[\w ]*)$")


def pyproject_for(target: Target) -> str:
    """The tree's pyproject.toml with a [tool.mutmut] table for ``target``."""

    def toml_list(items: tuple[str, ...]) -> str:
        return "[" + ", ".join("'" + i + "'" for i in items) + "]"  # TOML literal strings

    return (ROOT / "pyproject.toml").read_text() + (
        "\n[tool.mutmut]\n"
        'source_paths = ["src"]\n'
        f"only_mutate = {toml_list(target.mutate)}\n"
        f"pytest_add_cli_args_test_selection = {toml_list(target.tests)}\n"
        f"do_not_mutate_patterns = {toml_list(target.keep_lines)}\n"
        f"process_isolation = '{target.isolation}'\n"
        # The suite's own 300 s per-test limit would let a mutant that hangs a loop cost minutes.
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-o", "timeout=60"]\n'
    )


def prepare(target: Target, workdir: Path) -> None:
    """A fresh copy of src/ (with the built C extensions), tests/ and pyproject.toml."""
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "src", workdir / "src", ignore=ignore)
    shutil.copytree(ROOT / "tests", workdir / "tests", ignore=ignore)
    (workdir / "pyproject.toml").write_text(pyproject_for(target))


def run_target(target: Target, workdir: Path, time_limit_s: float, jobs: int) -> bool:
    """Run mutmut; True when it finished within the limit."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OPENBLAS_NUM_THREADS"] = "1"
    mutmut = Path(sys.executable).with_name("mutmut")
    proc = subprocess.Popen(
        [str(mutmut), "run", "--max-children", str(jobs)],
        cwd=workdir,
        env=env,
        stdout=(workdir / "run.log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        proc.wait(timeout=time_limit_s)
        return True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return False


def results(workdir: Path) -> dict[str, str]:
    """Mutant name -> status (killed, survived, timeout, not checked, no tests, ...)."""
    mutmut = Path(sys.executable).with_name("mutmut")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [str(mutmut), "results", "--all", "true"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    found: dict[str, str] = {}
    for line in out.splitlines():
        m = RESULT.match(line)
        if m:
            found[m.group(1)] = m.group(2).strip()
    return found


def listed_survivors() -> dict[str, str]:
    listed: dict[str, str] = {}
    for line in SURVIVORS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, reason = line.partition(" ")
            listed[name] = reason.strip()
    return listed


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "targets",
        nargs="*",
        default=[],
        help="targets to run (default: all): " + ", ".join(BY_NAME),
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=1200.0,
        help="seconds per target; unchecked mutants are reported (default 1200)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="mutants checked at once (default 1)")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "mutation")
    args = parser.parse_args()
    unknown = [t for t in args.targets if t not in BY_NAME]
    if unknown:
        parser.error(f"unknown target {', '.join(unknown)}; the targets: {', '.join(BY_NAME)}")

    listed = listed_survivors()
    failed = False
    for target in [BY_NAME[n] for n in args.targets] or list(TARGETS):
        workdir = args.workdir / target.name
        prepare(target, workdir)
        t0 = time.monotonic()
        finished = run_target(target, workdir, args.time_limit, args.jobs)
        took = time.monotonic() - t0
        status = results(workdir)
        counts: dict[str, int] = {}
        for s in status.values():
            counts[s] = counts.get(s, 0) + 1
        ours = {
            n: s for n, s in status.items() if any(n.startswith(p) for p in module_prefixes(target))
        }
        survivors = sorted(n for n, s in ours.items() if s == "survived")
        unlisted = [n for n in survivors if n not in listed]
        # A listed survivor that is now killed (or, after a full run, no longer generated).
        stale = sorted(
            n
            for n in listed
            if any(n.startswith(p) for p in module_prefixes(target))
            and (ours.get(n) == "killed" or (finished and n not in ours))
        )
        print(
            f"{target.name}: {len(ours)} mutants in {took:.0f} s"
            f"{'' if finished else ' (time limit: stopped)'}; "
            + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        )
        for n in unlisted:
            print(f"  survived, not in {SURVIVORS.name}: {n}")
        for n in stale:
            print(f"  listed in {SURVIVORS.name} but {ours.get(n, 'not generated')}: {n}")
        failed |= bool(unlisted or stale)
    return 1 if failed else 0


def module_prefixes(target: Target) -> list[str]:
    """The dotted prefixes of mutant names that belong to ``target``'s files."""
    prefixes = []
    for glob in target.mutate:
        dotted = glob.removeprefix("src/").removesuffix(".py").removesuffix("*").replace("/", ".")
        prefixes.append(dotted)
    return prefixes


if __name__ == "__main__":
    sys.exit(main())
