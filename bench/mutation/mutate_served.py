"""One-line mutations of the served path, each applied to a copy of the tree and run against the
tests that must fail on it: the code that runs inside the pair's and the gateway's processes.

    python bench/mutation/mutate_served.py                    # every mutation (about 5 minutes)
    python bench/mutation/mutate_served.py eos-only no-done   # some of them

mutmut (bench/mutation/mutate.py) sees only code that a test runs in its own process. The
served-path tests (tests/test_openai_semantics.py, tests/test_served_matrix.py) start
`foundry tp-leader`, `tp-worker` and `gateway` as processes, so a mutant of the leader's front
end, the engine's end-of-generation rule or the HTTP layer is invisible to mutmut there. Here
the copy's src/ comes first on PYTHONPATH, which the processes the tests start inherit: they
run the mutant.

The unmutated copy runs the same tests first and must pass. A mutation whose tests pass is a
survivor; one whose line is no longer in the file is stale (the table below must follow the
code). Either exits 1. The table starts with the audit's survivors (issue 44).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEMANTICS = "tests/test_openai_semantics.py"
UNITS = "tests/test_served_units.py"
CHAT = "tests/test_chat.py"


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # under the tree
    old: str  # exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest arguments that must fail on it


MUTATIONS = (
    Mutation(
        "begin-keeps-its-place",
        "src/foundry/gateway/openai/routes.py",
        "            generation.close()\n            self.queue.release()\n            raise",
        "            generation.close()\n            raise",
        (SEMANTICS, "-k", "every_place"),
    ),
    Mutation(
        "no-on-close",
        "src/foundry/gateway/openai/routes.py",
        "            self.on_close()",
        "            pass",
        (SEMANTICS, "-k", "never_began"),
    ),
    Mutation(
        "eos-only",
        "src/foundry/tp/engine_tokens.py",
        "if token in req.tokenizer.eog_ids:",
        "if token == req.tokenizer.eos_id:",
        (SEMANTICS, "-k", "end_of_turn"),
    ),
    Mutation(
        "markers-as-text",
        "src/foundry/model/text/chat.py",
        "return tokenizer.encode(text, parse_special=True, plain_map=back or None)",
        "return tokenizer.encode(text, parse_special=False, plain_map=back or None)",
        (SEMANTICS, "-k", "turn_markers"),
    ),
    Mutation(
        "max-tokens-wins",
        "src/foundry/gateway/openai/protocol.py",
        "        if self.max_completion_tokens is not None:\n"
        "            return self.max_completion_tokens\n"
        "        return self.max_tokens",
        "        if self.max_tokens is not None:\n"
        "            return self.max_tokens\n"
        "        return self.max_completion_tokens",
        (SEMANTICS, "-k", "max_completion"),
    ),
    Mutation(
        "no-done",
        "src/foundry/gateway/openai/routes.py",
        "            yield SSE_DONE\n",
        "",
        (SEMANTICS, "-k", "sse_framing"),
    ),
    Mutation(
        "add-bos-key",
        "src/foundry/model/text/vocab/tokens.py",
        '_flag(meta, "add_bos_token", add_bos)',
        '_flag(meta, "add_bos", add_bos)',
        (UNITS, "-k", "add_bos"),
    ),
    Mutation(
        "smollm-swapped",
        "src/foundry/model/text/vocab/pretokenizers.py",
        '("\\\\p{N}", _GPT2)',
        '(_GPT2, "\\\\p{N}")',
        (UNITS, "-k", "smollm"),
    ),
    Mutation(
        "no-lstrip-blocks",
        "src/foundry/model/text/chat_sandbox.py",
        "        trim_blocks=True,\n        lstrip_blocks=True,",
        "        trim_blocks=True,\n        lstrip_blocks=False,",
        (UNITS, "-k", "lstrip"),
    ),
    # The chat sandbox's template environment is built at import, before mutmut picks a mutant
    # (bench/mutation/survivors.txt): its settings are mutated here instead.
    Mutation(
        "no-trim-blocks",
        "src/foundry/model/text/chat_sandbox.py",
        "        trim_blocks=True,\n        lstrip_blocks=True,",
        "        trim_blocks=False,\n        lstrip_blocks=True,",
        (UNITS, "-k", "lstrip"),
    ),
    Mutation(
        "trailing-newline-kept",
        "src/foundry/model/text/chat_sandbox.py",
        "keep_trailing_newline=False",
        "keep_trailing_newline=True",
        (UNITS, "-k", "lstrip"),
    ),
    Mutation(
        "no-tojson",
        "src/foundry/model/text/chat_sandbox.py",
        'env.filters["tojson"] = _tojson',
        'env.filters["XXtojsonXX"] = _tojson',
        (UNITS,),
    ),
    Mutation(
        "no-raise-exception",
        "src/foundry/model/text/chat_sandbox.py",
        'env.globals["raise_exception"] = _raise_exception',
        'env.globals["XXraise_exceptionXX"] = _raise_exception',
        (CHAT,),
    ),
    Mutation(
        "no-strftime-now",
        "src/foundry/model/text/chat_sandbox.py",
        'env.globals["strftime_now"] = _strftime_now',
        'env.globals["XXstrftime_nowXX"] = _strftime_now',
        (CHAT,),
    ),
    Mutation(
        "no-loopcontrols",
        "src/foundry/model/text/chat_sandbox.py",
        "extensions=[jinja2.ext.loopcontrols, _GenerationBlock]",
        "extensions=[_GenerationBlock]",
        (CHAT,),
    ),
    Mutation(
        "no-generation-block",
        "src/foundry/model/text/chat_sandbox.py",
        "extensions=[jinja2.ext.loopcontrols, _GenerationBlock]",
        "extensions=[jinja2.ext.loopcontrols]",
        (CHAT,),
    ),
    Mutation(
        "fragment-limit",
        "src/foundry/wire/fdtc/codec.py",
        "            if total > self._max_message:",
        "            if total >= self._max_message:",
        (UNITS, "-k", "fragmented"),
    ),
    Mutation(
        "no-template-stop",
        "src/foundry/tp/frontend_server.py",
        "self.template.stop if g.messages else ()",
        "()",
        (SEMANTICS, "-k", "plain_transcript"),
    ),
    Mutation(
        "any-model",
        "src/foundry/gateway/openai/routes.py",
        "        if model is not None and model != self.opt.model_name:",
        "        if False:",
        (SEMANTICS, "-k", "unknown_model"),
    ),
    Mutation(
        "prompt-limit",
        "src/foundry/tp/frontend_server.py",
        "if len(prompt) > self.ctx_size:",
        "if len(prompt) >= self.ctx_size:",
        (SEMANTICS, "-k", "whole_context"),
    ),
    Mutation(
        "prompt-limit-plus-one",
        "src/foundry/tp/frontend_server.py",
        "if len(prompt) > self.ctx_size:",
        "if len(prompt) > self.ctx_size + 1:",
        (SEMANTICS, "-k", "whole_context"),
    ),
    Mutation(
        "context-full-late",
        "src/foundry/tp/engine_tokens.py",
        "elif pos >= req.session.ctx_size:",
        "elif pos > req.session.ctx_size:",
        (SEMANTICS, "-k", "full_context"),
    ),
    Mutation(
        "usage-in-every-chunk",
        "src/foundry/gateway/openai/render.py",
        "        if self.include_usage:\n            tail = self._envelope([], True)",
        "        if True:\n            tail = self._envelope([], True)",
        (SEMANTICS, "-k", "sse_framing"),
    ),
    Mutation(
        "offset-from-zero",
        "src/foundry/gateway/openai/render.py",
        "        logprobs = self._logprobs(lps, self._offset)",
        "        logprobs = self._logprobs(lps, 0)",
        (SEMANTICS, "-k", "text_offset"),
    ),
    Mutation(
        "legacy-logprobs-0-dropped",
        "src/foundry/gateway/openai/routes.py",
        "            req.stop_strings(),\n            logprobs=req.logprobs is not None,",
        "            req.stop_strings(),\n            logprobs=bool(req.logprobs),",
        (SEMANTICS, "-k", "logprobs"),
    ),
)
BY_NAME = {m.name: m for m in MUTATIONS}


def prepare(workdir: Path) -> None:
    """A fresh copy of src/ (with the built C extensions), tests/ and pyproject.toml."""
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "src", workdir / "src", ignore=ignore)
    shutil.copytree(ROOT / "tests", workdir / "tests", ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", workdir / "pyproject.toml")


def run_tests(workdir: Path, tests: tuple[str, ...], timeout_s: float) -> tuple[bool, str]:
    """(passed, pytest's last line)."""
    env = {**os.environ, "PYTHONPATH": str(workdir / "src"), "OPENBLAS_NUM_THREADS": "1"}
    try:
        res = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout_s:.0f} s"
    lines = res.stdout.strip().splitlines()
    return res.returncode == 0, lines[-1] if lines else res.stderr[-300:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument(
        "mutations",
        nargs="*",
        default=[],
        help="mutations to apply (default: all): " + ", ".join(BY_NAME),
    )
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "mutation-served")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per test run at most (default 600)"
    )
    args = parser.parse_args()
    unknown = [n for n in args.mutations if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown mutation {', '.join(unknown)}; the mutations: {', '.join(BY_NAME)}")
    chosen = [BY_NAME[n] for n in args.mutations] or list(MUTATIONS)
    prepare(args.workdir)
    tests = sorted({t for m in chosen for t in m.tests if t.startswith("tests/")})
    ok, last = run_tests(args.workdir, tuple(tests), args.timeout)
    print(f"unmutated: {'passed' if ok else 'FAILED'} ({last})", flush=True)
    if not ok:
        return 1
    bad = 0
    for m in chosen:
        path = args.workdir / m.path
        source = path.read_text()
        if source.count(m.old) != 1:
            print(f"{m.name:28s} STALE: the line is not in {m.path} exactly once", flush=True)
            bad += 1
            continue
        path.write_text(source.replace(m.old, m.new))
        t0 = time.monotonic()
        try:
            passed, last = run_tests(args.workdir, m.tests, args.timeout)
        finally:
            path.write_text(source)
        print(
            f"{m.name:28s} {'SURVIVED' if passed else 'killed'} in "
            f"{time.monotonic() - t0:.0f} s ({last})",
            flush=True,
        )
        bad += passed
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
