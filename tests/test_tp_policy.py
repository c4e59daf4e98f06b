"""The leader's pure decisions: n-gram drafting, greedy acceptance, commit plans, stop strings,
the scheduler's kept sessions and remembered histories."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foundry.model.text.vocab.byte import decode, encode
from foundry.tp.policy import Pass, TextStream, common_prefix, pick_kept_session, plan_pass
from foundry.tp.scheduler import Scheduler
from foundry.tp.speculative import MAX_DRAFT, SpecMode, accepted_drafts, commit_plan, propose_drafts
from foundry.wire.tp import VerifyCommitMode


def test_drafts_follow_the_most_recent_match_of_the_longest_suffix() -> None:
    #          0  1  2  3  4  5  6  7  8  9
    history = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    # Suffix (8, 5, 6)? no. (5, 6) occurs at 0 and 4: the most recent (4) is followed by 8, 2.
    assert propose_drafts(history, 3) == [8, 2, 5]
    assert propose_drafts(history, 1) == [8]
    # A trigram match wins over a more recent bigram match.
    history = [1, 2, 3, 9, 9, 7, 2, 3, 4, 4, 1, 2, 3]
    assert propose_drafts(history, 2) == [9, 9]
    # Only a unigram matches.
    assert propose_drafts([4, 8, 1, 2, 4], 5) == [8, 1, 2, 4, 8]  # the loop continues


def test_no_drafts_without_a_match_or_room() -> None:
    assert propose_drafts([1, 2, 3, 4], 7) == []
    assert propose_drafts([1], 7) == []
    assert propose_drafts([1, 1, 1], 0) == []
    assert len(propose_drafts([3] * 40, MAX_DRAFT)) == MAX_DRAFT


def test_acceptance_counts_the_agreeing_prefix() -> None:
    assert accepted_drafts([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted_drafts([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accepted_drafts([4, 5, 6], [1, 5, 6, 7]) == 0


@pytest.mark.parametrize(
    ("spec", "accepted", "mode"),
    [
        (SpecMode.FULL_PREFIX, 3, VerifyCommitMode.COMMIT_FULL),
        (SpecMode.ROLLBACK, 3, VerifyCommitMode.COMMIT_FULL),
        (SpecMode.FULL_PREFIX, 1, VerifyCommitMode.COMMIT_PREFIX),
        (SpecMode.ROLLBACK, 1, VerifyCommitMode.ROLLBACK_REPLAY),
        (SpecMode.ROLLBACK, 0, VerifyCommitMode.ROLLBACK_REPLAY),
    ],
)
def test_commit_plans(spec: SpecMode, accepted: int, mode: VerifyCommitMode) -> None:
    plan = commit_plan(spec, 3, accepted)
    assert plan.mode is mode and plan.token_count == 1 + accepted


def test_commit_plan_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="off"):
        commit_plan(SpecMode.OFF, 3, 1)
    with pytest.raises(ValueError, match="accepted 4"):
        commit_plan(SpecMode.ROLLBACK, 3, 4)


def stream_all(text: str, stop: tuple[str, ...]) -> tuple[list[str], bool]:
    ids = [int(t) for t in encode(text, bos=False)]
    s = TextStream(stop)
    pieces = []
    for i, t in enumerate(ids):
        piece, hit = s.push(t, final=i == len(ids) - 1)
        pieces.append(piece)
        if hit:
            return pieces, True
    return pieces, False


def test_stop_string_is_cut_and_never_sent() -> None:
    pieces, hit = stream_all("Hello world. Bye", ("world",))
    assert hit and "".join(pieces) == "Hello "
    # Held back while it could still become the stop string, then released.
    pieces, hit = stream_all("wor wonder", ("world",))
    assert not hit and "".join(pieces) == "wor wonder"
    assert pieces[:3] == ["", "", ""]  # "w", "wo", "wor" may begin "world"
    # The earliest of several stop strings wins.
    pieces, hit = stream_all("abc END xyz STOP", ("STOP", "END"))
    assert hit and "".join(pieces) == "abc "


def test_multibyte_characters_stay_whole() -> None:
    pieces, hit = stream_all("naïve café ☕ done", ("☕",))
    assert hit and "".join(pieces) == "naïve café "


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abcé☕ .", max_size=40),
    stop=st.lists(st.text(alphabet="abcé☕ .", min_size=1, max_size=4), max_size=3),
)
def test_stream_equals_cutting_the_whole_text(text: str, stop: list[str]) -> None:
    """Sent text == the whole text up to the first stop string to appear (or all of it)."""
    ids = [int(t) for t in encode(text, bos=False)]
    s = TextStream(tuple(stop))
    sent, hit = "", False
    for i, t in enumerate(ids):
        piece, hit = s.push(t, final=i == len(ids) - 1)
        sent += piece
        if hit:
            break
    whole = decode(ids)
    # Oracle: characters arrive one at a time; the first time any stop string is present,
    # the text is cut where the earliest present one begins.
    expected, stopped = whole, False
    for k in range(1, len(whole) + 1):
        found = [whole[:k].find(x) for x in stop if x in whole[:k]]
        if found:
            expected, stopped = whole[: min(found)], True
            break
    assert (hit, sent) == (stopped, expected)


def test_a_prompt_continues_the_kept_session_it_shares_most_with() -> None:
    assert common_prefix([1, 5, 6, 7], [1, 5, 6, 8, 9]) == 3
    assert common_prefix([], [1]) == common_prefix([2], [1]) == 0
    kept = [(10, [1, 5, 6]), (11, [1, 5, 6, 7, 8]), (12, [1, 9])]
    # Session 11 holds the longest shared prefix; all of it is reused.
    assert pick_kept_session([1, 5, 6, 7, 8, 2, 3], kept) == (11, 5)
    # The whole prompt is held: the last token is evaluated again for its logits.
    assert pick_kept_session([1, 5, 6, 7], kept) == (11, 3)
    # A tie goes to the most recently kept session (the last one).
    assert pick_kept_session([1, 5, 6, 2], [(10, [1, 5, 6]), (11, [1, 5, 6, 7])]) == (11, 3)
    # Only the beginning-of-sequence token in common: nothing worth reusing.
    assert pick_kept_session([1, 4, 4], kept) is None
    assert pick_kept_session([1, 5], []) is None


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=12),
    st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=5),
)
def test_the_kept_session_picked_holds_the_prompt_prefix_it_reuses(
    prompt: list[int], histories: list[list[int]]
) -> None:
    kept = list(enumerate(histories, start=1))
    pick = pick_kept_session(prompt, kept)
    best = max((common_prefix(h, prompt) for h in histories), default=0)
    if best <= 1:
        assert pick is None
        return
    assert pick is not None
    sid, reused = pick
    assert reused == min(best, len(prompt) - 1) < len(prompt)
    assert histories[sid - 1][:reused] == prompt[:reused]


def test_plan_pass() -> None:
    assert plan_pass(0, 0, 0) is Pass.IDLE
    assert plan_pass(1, 0, 0) is Pass.PREFILL
    assert plan_pass(3, 0, 0) is Pass.MIXED  # prompts that arrive together: one pass
    assert plan_pass(2, 3, 0) is Pass.MIXED  # decoding never stalls behind a prompt
    assert plan_pass(0, 1, 0) is Pass.EVAL
    assert plan_pass(0, 1, 4) is Pass.VERIFY
    assert plan_pass(0, 2, 0) is Pass.EVAL_BATCH
    assert plan_pass(1, 1, 4) is Pass.MIXED  # a waiting prompt goes before speculation


def test_the_scheduler_keeps_finished_sessions_and_evicts_the_least_recently_used() -> None:
    s = Scheduler(max_sessions=4, keep_sessions=2)
    assert s.keep(1, [1]) == [1]  # the BOS alone is not worth keeping: destroyed
    assert s.keep(2, [1, 5]) == [] and s.keep(3, [1, 6]) == []
    assert s.keep(4, [1, 7]) == [2]  # one too many: the least recently used goes
    s.continue_kept(3)  # a prompt continues it: no longer kept
    assert list(s.kept) == [4]
    assert Scheduler(max_sessions=4, keep_sessions=0).keep(5, [1, 2]) == [5]


def test_the_scheduler_remembers_kept_histories_most_recent_first_without_repeats() -> None:
    s = Scheduler(max_sessions=4, keep_sessions=2)
    s.keep(2, [1, 5])
    s.keep(3, [1, 6])
    s.keep(4, [1, 5])
    s.remember({2: [1, 5], 3: [1, 6], 4: [1, 5]})
    assert [h.tokens for h in s.resync] == [[1, 5], [1, 6]]
    assert all(h.sid == 0 for h in s.resync)  # opened again only on the next pair
    assert not s.has_work() and s.running == 0 and s.next_pass(0) is Pass.IDLE
