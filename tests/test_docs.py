"""The docs stay true: no dead link or anchor in docs/ and the README, the command-line
reference is the parsers' current help, every command the README and the guide's quickstart
and several-machines pages show parses as written, and the one-machine swarm they show trains.

Commands that cannot run in a test are listed in ``NOT_RUN`` with the reason; the rest of the
pasteable commands are parsed by the real parser, and the one-machine swarm of
docs/guide/train.md runs as written, in processes, on 127.0.0.1.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import pytest
from procs import ENV
from tree import project_files

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "bench" / "README.md",
        *DOCS.rglob("*.md"),
    ]
)
PASTED = [ROOT / "README.md", DOCS / "guide" / "quickstart.md", DOCS / "guide" / "train.md"]
GUIDE_MAX_LINES = 500

# Lines of those blocks that a test does not run, and why.
NOT_RUN = {
    "python3 -m venv .venv && .venv/bin/pip install -e . && . .venv/bin/activate": (
        "step 1 itself: installs the package (CI's own setup does the same in .ci/run)"
    ),
    ". .venv/bin/activate": "step 1's activation",
}

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6}) +(.+?) *#*$", re.M)


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code (links there are not links)."""
    text = FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's label only
    text = text.strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_slugs_are_githubs() -> None:
    assert (
        slug("Decoding with the C kernels (`bench/performance/engine.py`)")
        == "decoding-with-the-c-kernels-benchperformanceenginepy"
    )
    assert slug("TLS, tokens and limits") == "tls-tokens-and-limits"
    assert slug("What `foundry up` does") == "what-foundry-up-does"


def test_no_dead_links_nor_anchors() -> None:
    dead = []
    for page in PAGES:
        for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not dest.exists():
                dead.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                dead.append(f"{where} (no such section)")
    assert not dead, "\n".join(dead)


def test_the_link_check_finds_a_dead_link_and_a_missing_section(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A\n\n## Here\n")
    page = tmp_path / "b.md"
    page.write_text("[x](a.md#here) [y](a.md#there) [z](c.md) `[w](d.md)`\n")
    found = LINK.findall(prose(page.read_text()))
    assert found == ["a.md#here", "a.md#there", "c.md"]
    assert "here" in anchors(tmp_path / "a.md") and "there" not in anchors(tmp_path / "a.md")


def test_guide_pages_are_short() -> None:
    long = {
        p.name: n
        for p in (DOCS / "guide").glob("*.md")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > GUIDE_MAX_LINES
    }
    assert not long, f"guide pages over {GUIDE_MAX_LINES} lines: {long}"


def test_the_cli_reference_is_current() -> None:
    got = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "cli_reference.py"), "--check"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert got.returncode == 0, got.stderr


def pasted_commands(page: Path) -> list[str]:
    """The command lines of a page's bash blocks: continuations joined, comments dropped."""
    lines = []
    for lang, body in FENCE.findall(page.read_text(encoding="utf-8")):
        if lang != "bash":
            continue
        body = re.sub(r"\\\n\s*", " ", body)
        for line in body.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


@pytest.mark.parametrize("page", PASTED, ids=lambda p: p.name)
def test_every_pasted_command_parses_as_written(page: Path) -> None:
    from foundry.cli import build_parser

    commands = pasted_commands(page)
    assert commands, f"{page} shows no bash block"
    for line in commands:
        if line in NOT_RUN:
            continue
        argv = shlex.split(line)
        assert argv[0] == "foundry", f"{page.name}: {line!r} is neither foundry nor in NOT_RUN"
        try:
            build_parser().parse_args(argv[1:])
        except SystemExit as exc:
            raise AssertionError(f"{page.name}: {line!r} does not parse") from exc


def test_the_one_machine_swarm_of_the_guide_trains_as_written(tmp_path: Path) -> None:
    block = next(
        body
        for lang, body in FENCE.findall((DOCS / "guide" / "train.md").read_text())
        if lang == "bash" and "127.0.0.1:17070" in body
    )
    lines = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert [argv[:2] for argv in lines] == [
        ["foundry", "coordinator"],
        ["foundry", "worker"],
        ["foundry", "worker"],
    ]
    procs = []
    try:
        for i, argv in enumerate(lines):
            with (tmp_path / f"{i}.log").open("wb") as log:  # the child keeps its own copy
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "foundry", *argv[1:]],
                        cwd=tmp_path,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=ENV,
                    )
                )
        for worker in procs[1:]:
            assert worker.wait(timeout=240) == 0  # a worker ends when training is done
        coordinator = (tmp_path / "0.log").read_text()
        assert "training done" in coordinator or "step 20" in coordinator, coordinator[-2000:]
        assert "too few for words" in coordinator  # 20 steps: it says what to change
        assert any((tmp_path / "runs" / "try" / "checkpoints").iterdir())
        # The page's export into the same run, through a gateway, as written.
        block = next(
            body
            for lang, body in FENCE.findall((DOCS / "guide" / "train.md").read_text())
            if lang == "bash" and "--coordinator-admin 127.0.0.1:17071" in body
        )
        gateway, export = [shlex.split(line) for line in block.splitlines() if line.strip()]
        assert gateway[:2] == ["foundry", "gateway"] and export[:2] == ["foundry", "ctl"]
        with (tmp_path / "gateway.log").open("wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "foundry", *gateway[1:]],
                    cwd=tmp_path,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=ENV,
                )
            )
        for _ in range(60):  # the gateway takes a few seconds to listen
            got = subprocess.run(
                [sys.executable, "-m", "foundry", *export[1:]],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                env=ENV,
                timeout=120,
            )
            if got.returncode == 0 or "unavailable" not in got.stderr.lower():
                break
            time.sleep(1)
        assert got.returncode == 0, got.stderr
        path = export[export.index("--path") + 1]
        assert (tmp_path / path).read_bytes()[:4] == b"GGUF"
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)


def test_every_python_snippet_of_the_docs_names_only_what_it_defines(tmp_path: Path) -> None:
    """A reader pastes these: each one compiles, and ruff finds no undefined name in it."""
    snippets = [
        (page, body)
        for page in PAGES
        for lang, body in FENCE.findall(page.read_text(encoding="utf-8"))
        if lang == "python"
    ]
    assert snippets
    for n, (page, body) in enumerate(snippets):
        compile(body, f"{page.name} snippet", "exec")
        (tmp_path / f"snippet_{n}.py").write_text(body)
    got = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--no-cache",
            "--isolated",
            "--select",
            "F821,F822,F823",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert got.returncode == 0, got.stdout + got.stderr


def test_the_readme_names_what_the_ci_script_installs() -> None:
    """`bash .ci/run` is the README's test command: every package it installs (apt, npm, the
    PyPI downloads beyond the test extras) is named there, and so is the demo model's size."""
    script = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    apt = [
        w
        for line in re.findall(r"apt-get install [^\n]*", script)
        for w in line.split()[2:]
        if not w.startswith("-")
    ]
    npm = re.findall(r"npm install [^\n]*?(@[\w/-]+)@", script)
    pypi = re.findall(r"^(\w[\w-]*)==", script.split("LLAMA_SDIST=")[1], re.M) + re.findall(
        r"pip install --quiet ([\w-]+)$", script, re.M
    )
    assert set(apt) == {"prometheus", "iproute2", "openssl"} and npm and pypi
    for name in [*apt, *npm, "llama-cpp-python", *pypi]:
        assert f"`{name}`" in readme, name
    from foundry.model.spec.config import preset

    assert f"{preset('tiny').n_params():,} parameters" in readme


def test_every_design_record_cited_in_the_tree_is_on_the_records_page() -> None:
    """Code and docs cite a decision as ``docs/decisions.md, D3`` (or link to its heading);
    each names a record there, and nothing cites the brief the records replaced."""
    page = (DOCS / "decisions.md").read_text(encoding="utf-8")
    records = set(re.findall(r"^## (D\d+)\. ", page, re.M))
    assert records
    files = project_files(".py", ".md", ".c", ".h", ".proto", ".toml", ".yml", ".yaml")
    cited, stale = set(), []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        cited |= set(re.findall(r"decisions\.md,\s*(?:#\s*)?(D\d+)", text))
        for anchor in re.findall(r"decisions\.md#(d\d+)-", text):
            cited.add(anchor.upper())
        if re.search(r"DESIGN(?: §|'s )", text):
            stale.append(str(path.relative_to(ROOT)))
    assert stale == []
    assert cited and cited <= records, cited - records


def test_the_pre_commit_hooks_run_what_the_ci_script_lints() -> None:
    import yaml

    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = [h["entry"] for repo in config["repos"] for h in repo["hooks"]]
    script = (ROOT / ".ci" / "run").read_text()
    lints = script.split('log "lint (ruff) and types (mypy)"')[1].split("log ")[0]
    ci = [
        re.sub(r'"\$VENV(/bin/\w+)"', r".venv\1", line.strip())
        for line in lints.splitlines()
        if line.strip()
    ]
    assert hooks == ci and len(ci) == 4, (hooks, ci)


def test_compose_md_names_every_variable_the_compose_files_read() -> None:
    page = (DOCS / "guide" / "compose.md").read_text(encoding="utf-8")
    tls = (DOCS / "guide" / "tls.md").read_text(encoding="utf-8")
    for name in ("docker-compose.yml", "docker-compose.tls.yml"):
        for var in set(re.findall(r"\$\{(\w+)", (ROOT / name).read_text())):
            where = page if name == "docker-compose.yml" else page + tls
            assert f"`{var}`" in where, f"{name}: {var}"
    assert "8080" in page


def test_serve_md_quotes_the_lines_the_ranks_print() -> None:
    """The guide's start and pairing lines are the code's (a reader waits for them)."""
    page = (DOCS / "guide" / "serve.md").read_text(encoding="utf-8")
    src = "".join(p.read_text() for p in (ROOT / "src" / "foundry").rglob("*.py"))
    lines = re.findall(
        r"`((?:tp-leader listening|tp-worker ready|worker HOST:PORT "
        r"paired|paired with the leader)[^`]*)`",
        page,
    )
    assert len(lines) == 4, lines
    for quoted in lines:
        head = re.split(r"HOST|model\.gguf|tcp", quoted.replace("worker HOST:PORT ", ""))[0]
        assert head.strip() and head.strip() in src.replace("%s", "HOST"), quoted
    assert "exits too" in page  # a clean leader stop ends the worker (docs/tp.md: STOP)
