"""Speculative decoding on the pair: every commit mode gives exactly the plain greedy text.

Greedy requests are decoded in verify blocks (the token to evaluate plus up to 7 tokens drafted
by prompt lookup) and committed as COMMIT_FULL, COMMIT_PREFIX or ROLLBACK_REPLAY. The prompts
repeat themselves, and a small random model falls into loops, so drafts are accepted; the test
asserts that they were (and that each commit mode ran), so it cannot pass without speculating.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tp_harness import (
    Client,
    LeaderProc,
    Proc,
    make_model,
    metric,
    reference_greedy,
    start_leader,
    start_worker,
    wait_paired,
)

from foundry.wire import frontend as fw

PROMPTS = [
    "one two three, one two three, one two three, one two",
    "def f(x):\n    return x\n\ndef g(x):\n    return x\n\ndef h(x):\n",
    "abcabcabcabcab",
]
N_TOKENS = 96
CHUNK = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("spec") / "model.gguf")


@pytest.fixture(scope="module")
def references(model: Path) -> list[list[int]]:
    return [reference_greedy(model, p, N_TOKENS, CHUNK).tokens for p in PROMPTS]


@pytest.fixture
def pair(
    model: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[LeaderProc, str]]:
    mode: str = request.param
    leader = start_leader(
        model,
        tmp_path / "leader.log",
        "--spec-mode",
        mode,
        "--hash-check",
        "--prefill-chunk",
        str(CHUNK),
    )
    worker: Proc = start_worker(model, leader.port, tmp_path / "worker.log")
    try:
        wait_paired(leader.frontend)
        yield leader, mode
    finally:
        leader.proc.stop()
        worker.exit_code()


def commits(leader: LeaderProc, mode: str) -> float:
    assert leader.metrics is not None
    return metric(leader.metrics, f'foundry_tp_spec_commits_total{{mode="{mode}"}}')


@pytest.mark.parametrize("pair", ["off", "full-prefix", "rollback"], indirect=True)
def test_speculative_output_equals_plain_greedy(
    pair: tuple[LeaderProc, str], references: list[list[int]]
) -> None:
    leader, mode = pair
    with Client(leader.frontend) as c:
        for i, (prompt, want) in enumerate(zip(PROMPTS, references, strict=True)):
            got = c.generate(prompt, N_TOKENS, request_id=i + 1)
            assert isinstance(got.end, fw.Done), got.end
            assert got.tokens == want, f"prompt {i} diverged"
        st = c.status()
    assert leader.metrics is not None
    accepted = metric(leader.metrics, "foundry_tp_spec_accepted_tokens_total")
    drafted = metric(leader.metrics, "foundry_tp_spec_drafted_tokens_total")
    if mode == "off":
        assert drafted == 0
        return
    assert accepted > 0 and st.spec_acceptance == pytest.approx(accepted / drafted, rel=1e-3)
    assert commits(leader, "commit_full") > 0
    partial = "commit_prefix" if mode == "full-prefix" else "rollback_replay"
    other = "rollback_replay" if mode == "full-prefix" else "commit_prefix"
    assert commits(leader, partial) > 0 and commits(leader, other) == 0
    assert metric(leader.metrics, 'foundry_tp_hash_checks_total{result="mismatch"}') == 0
    print(f"{mode}: {accepted:.0f} of {drafted:.0f} drafts accepted")
