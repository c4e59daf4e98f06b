"""Every benchmark script starts: its imports resolve and ``--help`` prints its usage; the
scripts share one harness (bench/harness.py) and one JSON row; bench/README.md lists them all.

The benchmarks run on demand (and on the borrowed machine), never in the suite; this keeps a
refactor of the package from breaking one of them unnoticed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
PURPOSES = ("performance", "quality", "determinism", "robustness", "mutation")
# The modules the scripts share, at the top of bench/; every script is in a purpose's folder.
SHARED = ("harness.py", "live.py")
# Scripts, not modules they share: those that run as __main__.
SCRIPTS = sorted(
    str(p.relative_to(BENCH))
    for p in BENCH.glob("*/*.py")
    if '__name__ == "__main__"' in p.read_text()
)


def test_there_are_benchmarks_each_in_its_purposes_folder() -> None:
    assert "performance/lan.py" in SCRIPTS and "quality/local_steps.py" in SCRIPTS
    assert {p.split("/")[0] for p in SCRIPTS} == set(PURPOSES)
    assert sorted(p.name for p in BENCH.glob("*.py")) == sorted(SHARED)


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_prints_its_help(script: str) -> None:
    res = subprocess.run(
        [sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "usage:" in res.stdout


def test_the_scripts_share_the_harness_statistics_and_json_flag() -> None:
    """One median, one ratio, one ``--json PATH``: no script writes its own."""
    own = []
    for script in SCRIPTS:
        text = (BENCH / script).read_text()
        if re.search(r"statistics\.median|def (best_of|median)\b", text):
            own.append(f"{script}: its own median or best_of")
        if '"--json"' in text:
            own.append(f"{script}: its own --json flag")
        if "add_json_flag" in text and "harness.emit(" not in text:
            own.append(f"{script}: --json without harness.emit")
    assert own == []


def test_json_path_writes_the_one_row_schema(tmp_path: Path) -> None:
    out = tmp_path / "row.json"
    res = subprocess.run(
        [
            sys.executable,
            str(BENCH / "performance" / "codec.py"),
            "--numel",
            "20000",
            "--repeats",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    row = json.loads(out.read_text())
    assert set(row) == {"bench", "schema", "when", "argv", "machine", "results", "pass"}
    assert row["bench"] == "codec" and row["schema"] == 1
    assert row["argv"] == ["--numel", "20000", "--repeats", "1", "--json", str(out)]
    assert row["machine"]["usable_cores"] >= 1 and row["machine"]["python"]
    assert row["results"]["numel"] == 20000 and set(row["results"]["codecs"]) >= {"NONE", "QSGD"}
    assert row["pass"] is (res.returncode == 0)
    # The same row is the last line of the output.
    assert json.loads(res.stdout.splitlines()[-1]) == row


def test_the_harness_statistics() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import harness
    finally:
        sys.path.remove(str(BENCH))
    assert harness.median([3.0, 1.0, 2.0, 10.0]) == 2.5
    assert harness.ratio(3.0, 2.0) == 1.5 and harness.ratio(1.0, 0.0) != harness.ratio(1.0, 0.0)
    # Per-round ratios: a slow round slows both sides and leaves its ratio alone.
    assert harness.median_ratio([2.0, 20.0, 2.2], [1.0, 10.0, 1.0]) == 2.0
    assert harness.spread([1.0, 2.0, 3.0]) == 1.0
    assert harness.best_of(3, lambda: None) >= 0.0
    ap = harness.parser("x")
    harness.add_json_flag(ap)
    assert ap.parse_args(["--json", "p"]).json == Path("p")
    with pytest.raises(SystemExit):
        ap.parse_args(["--jso", "p"])  # no prefix of a flag


def test_the_readme_lists_every_script_and_each_claim_names_its_script() -> None:
    readme = (BENCH / "README.md").read_text()
    for script in SCRIPTS:
        assert f"`{script}`" in readme, script
    # The JSON section names every script that takes --json PATH.
    section = readme.split("## The JSON row")[1].split("\n## ")[0]
    for script in SCRIPTS:
        if "harness.add_json_flag" in (BENCH / script).read_text():
            assert Path(script).name in section, script
    purposes = "|".join(PURPOSES)
    named = set(re.findall(rf"`((?:{purposes})/\w+\.py)`", readme))
    assert named <= set(SCRIPTS), named - set(SCRIPTS)
