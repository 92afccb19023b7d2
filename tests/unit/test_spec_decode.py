"""Speculative decoding core: n-gram index, adaptive draft length, greedy and sampled acceptance."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localllm.engine.spec_decode import (
    AdaptiveDraftLength,
    NgramIndex,
    num_to_emit,
    verify_greedy,
    verify_sampled,
)


def brute_force_propose(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The specification: scan backwards for the longest suffix n-gram seen before."""
    for n in range(min(max_ngram, len(tokens)), min_ngram - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


# --- NgramIndex ----------------------------------------------------------------------


def test_proposes_what_followed_the_suffix():
    assert NgramIndex([10, 11, 12, 13, 14, 99, 11, 12]).propose(3) == [13, 14, 99]


def test_most_recent_occurrence_wins():
    # [1, 2] occurs at 0 (then 3) and at 3 (then 4); the later one is proposed
    assert NgramIndex([1, 2, 3, 1, 2, 4, 0, 1, 2]).propose(2) == [4, 0]


def test_longest_ngram_is_preferred_over_a_more_recent_shorter_one():
    # the 3-gram [7, 1, 2] occurs at 0 (then 5); the 2-gram [1, 2] more recently at 5 (then 6)
    index = NgramIndex([7, 1, 2, 5, 8, 1, 2, 6, 9, 7, 1, 2], max_ngram=3)
    assert index.propose(1) == [5]
    assert NgramIndex([7, 1, 2, 5, 8, 1, 2, 6, 9, 7, 1, 2], max_ngram=2).propose(1) == [6]


def test_the_current_suffix_never_matches_itself():
    assert NgramIndex([1, 2, 3, 4]).propose(4) == []
    assert NgramIndex([]).propose(4) == []
    assert NgramIndex([5]).propose(4) == []
    # [5, 5]: the 1-gram [5] at 0 is followed by the 5 at 1; the suffix 2-gram has no earlier copy
    assert NgramIndex([5, 5]).propose(4) == [5]


def test_proposal_is_truncated_at_the_end_of_the_sequence():
    index = NgramIndex([1, 2, 3, 1, 2])
    assert index.propose(10) == [3, 1, 2]
    assert index.propose(2) == [3, 1]
    assert index.propose(0) == []


def test_min_ngram_ignores_shorter_matches():
    assert NgramIndex([4, 9, 5, 4], min_ngram=2).propose(2) == []
    assert NgramIndex([4, 9, 5, 4], min_ngram=1).propose(2) == [9, 5]


def test_extend_updates_matches_incrementally():
    index = NgramIndex([1, 2, 3], max_ngram=2)
    assert index.propose(2) == []
    index.extend([1, 2])
    assert index.propose(2) == [3, 1]
    index.extend([8])
    assert index.propose(2) == []
    index.extend([1])  # [8, 1] is new; [1] last followed by 2 at 3
    assert index.propose(3) == [2, 8, 1]
    assert len(index) == 7


def test_invalid_ngram_bounds_raise():
    with pytest.raises(ValueError):
        NgramIndex(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError):
        NgramIndex(min_ngram=0)


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), max_size=40), cut=st.integers(0, 40),
       k=st.integers(0, 6), max_ngram=st.integers(1, 4), min_ngram=st.integers(1, 4))
def test_incremental_index_equals_scratch_and_brute_force(tokens, cut, k, max_ngram, min_ngram):
    min_ngram = min(min_ngram, max_ngram)
    incremental = NgramIndex(tokens[:cut], max_ngram=max_ngram, min_ngram=min_ngram)
    for t in tokens[cut:]:  # one token at a time, as decoding appends them
        incremental.extend([t])
    scratch = NgramIndex(tokens, max_ngram=max_ngram, min_ngram=min_ngram)
    assert incremental._latest == scratch._latest
    assert incremental.propose(k) == scratch.propose(k) == brute_force_propose(tokens, k, max_ngram, min_ngram)


def test_32k_context_memory_and_append_cost():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 2000, size=32_768).tolist()
    start = time.perf_counter()
    index = NgramIndex(tokens, max_ngram=4)
    built = time.perf_counter() - start
    assert len(index) == 32_768
    assert index.num_entries <= 4 * len(index)  # O(n * max_ngram) entries, never more
    appended = rng.integers(0, 2000, size=1000).tolist()
    start = time.perf_counter()
    for t in appended:
        index.extend([t])
        index.propose(8)
    per_step = (time.perf_counter() - start) / 1000
    assert index.num_entries <= 4 * len(index)
    print(f"\nbuild 32k: {built * 1e3:.1f} ms; append + propose: {per_step * 1e6:.1f} us")


# --- AdaptiveDraftLength -------------------------------------------------------------


def test_the_docstring_worked_example():
    ctl = AdaptiveDraftLength()
    ks = []
    for proposed, accepted in [(4, 4), (5, 5), (6, 1), (6, 0)]:
        assert ctl.next_k() == proposed
        ctl.record(proposed, accepted)
        ks.append((ctl.k, round(ctl.ema, 3)))
    assert ks == [(5, 0.75), (6, 0.875), (6, 0.521), (5, 0.26)]


def test_draft_length_follows_acceptance_exactly():
    ctl = AdaptiveDraftLength(k_init=4, k_max=6)
    ks = []
    for proposed_accepted in [(4, 4), (5, 5), (6, 6), (6, 6), (6, 1), (6, 0), (5, 0), (4, 4)]:
        assert ctl.next_k() == proposed_accepted[0]
        ctl.record(*proposed_accepted)
        ks.append(ctl.k)
    # ema: .75 .875 .9375 .96875 .5677 .2839 .1419 .5710
    assert ks == [5, 6, 6, 6, 6, 5, 4, 4]
    assert math.isclose(ctl.ema, 0.5709635416666666)
    assert (ctl.num_proposed, ctl.num_accepted, ctl.num_draft_steps) == (42, 26, 8)
    assert ctl.acceptance_rate == 26 / 42


def test_k_stays_within_its_bounds():
    ctl = AdaptiveDraftLength(k_init=2, k_min=2, k_max=3, window=100)
    for _ in range(5):
        ctl.record(ctl.next_k(), 0)
    assert ctl.k == 2
    for _ in range(5):
        ctl.record(ctl.next_k(), ctl.k)
    assert ctl.k == 3


def test_switches_off_after_a_bad_window_then_probes_with_doubling_backoff():
    ctl = AdaptiveDraftLength(window=3, off_below=0.3, backoff=2, max_backoff=4)
    ctl.record(4, 0)
    ctl.record(4, 1)
    assert not ctl.is_off
    ctl.record(3, 0)  # 1 of 11 accepted
    assert ctl.is_off
    assert [ctl.next_k() for _ in range(3)] == [0, 0, ctl.k]  # two steps off, then a probe
    for _ in range(3):
        ctl.record(ctl.k, 0)
    assert [ctl.next_k() > 0 for _ in range(5)] == [False] * 4 + [True]  # back-off doubled
    for _ in range(3):
        ctl.record(ctl.k, 0)
    assert [ctl.next_k() > 0 for _ in range(5)] == [False] * 4 + [True]  # capped at 4
    # a passing window resets the back-off
    for _ in range(3):
        ctl.record(2, 2)
    for _ in range(3):
        ctl.record(ctl.k, 0)
    assert [ctl.next_k() > 0 for _ in range(3)] == [False, False, True]
    assert ctl.num_draft_steps == 15


def test_window_at_the_threshold_stays_on_and_empty_drafts_are_ignored():
    ctl = AdaptiveDraftLength(window=2, off_below=0.5)
    ctl.record(4, 2)
    ctl.record(0, 0)  # nothing verified: no draft step
    ctl.record(4, 2)  # exactly half accepted: not below
    assert not ctl.is_off and ctl.num_draft_steps == 2
    with pytest.raises(ValueError):
        ctl.record(2, 3)


# --- verify_greedy -------------------------------------------------------------------


@pytest.mark.parametrize("draft, target, expected", [
    ([5, 6, 7], [5, 6, 7, 8], (3, 8)),  # all accepted, plus the model's next token
    ([5, 6, 7], [5, 6, 9, 8], (2, 9)),  # first mismatch at 2: the model's token there
    ([5, 6, 7], [1, 6, 7, 8], (0, 1)),  # the first draft is wrong: nothing accepted
    ([5, 6, 7], [5, 1, 7, 8], (1, 1)),  # a later agreement after a mismatch does not count
    ([], [4], (0, 4)),  # no draft: a plain decode step
])
def test_verify_greedy(draft, target, expected):
    assert verify_greedy(draft, target) == expected
    assert verify_greedy(np.array(draft, dtype=np.int64), np.array(target)) == expected


def test_verify_greedy_needs_one_more_target_than_drafts():
    with pytest.raises(ValueError):
        verify_greedy([1, 2], [1, 2])


# --- verify_sampled ------------------------------------------------------------------

P1 = np.array([0.5, 0.3, 0.1, 0.1, 0.0])
P2 = np.array([0.05, 0.15, 0.2, 0.25, 0.35])  # the row after token 1
P3 = np.array([0.2, 0.2, 0.2, 0.2, 0.2])
N = 40_000  # trials per draft choice; 200k in all over five first drafts


def assert_distribution(counts: np.ndarray, n: int, expected: np.ndarray) -> None:
    """Every cell within 5 binomial sigmas of n * expected; a cell of probability 0 is empty."""
    for i, p in enumerate(expected):
        tolerance = 5 * math.sqrt(n * p * (1 - p))
        assert abs(counts[i] - n * p) <= tolerance, (i, counts[i] / n, p)


@pytest.mark.parametrize("first_draft", [0, 1, 2, 3, 4])
def test_first_emitted_token_follows_p_exactly(first_draft):
    rng = np.random.default_rng(first_draft)
    rows = np.stack([P1, P2, P3])
    first = np.zeros(5, dtype=np.int64)
    num_accepted = 0
    for _ in range(N):
        emitted, accepted = verify_sampled([first_draft, 3], rows, rng)
        first[emitted[0]] += 1
        num_accepted += accepted > 0
        assert len(emitted) == accepted + 1
    assert_distribution(first, N, P1)
    # the draft is accepted with exactly its probability (never, for a zero-probability token)
    assert abs(num_accepted - N * P1[first_draft]) <= 5 * math.sqrt(N * P1[first_draft] * (1 - P1[first_draft]))


@pytest.mark.parametrize("draft", [[1], [1, 4], [1, 0]])
def test_first_two_tokens_follow_p1_times_p2_when_the_draft_is_accepted(draft):
    """With drafts 1 then 4 or 0 (or a single draft 1: the second token is the bonus draw),
    the pair (1, y) comes out with probability P1[1] * P2[y]."""
    rng = np.random.default_rng(7)
    rows = np.stack([P1, P2, P3][:len(draft) + 1])
    pairs = np.zeros(5, dtype=np.int64)
    for _ in range(N):
        emitted, _ = verify_sampled(draft, rows, rng)
        if emitted[0] == 1:
            pairs[emitted[1]] += 1
    assert_distribution(pairs, N, P1[1] * P2)


def test_all_drafts_accepted_emit_one_more_from_the_last_row():
    one_hot = np.eye(5)  # (5, 5): row i puts all its mass on token i
    emitted, accepted = verify_sampled([0, 1, 2], one_hot[[0, 1, 2, 3]], np.random.default_rng(0))
    assert (emitted, accepted) == ([0, 1, 2, 3], 3)


def test_a_zero_probability_draft_is_always_rejected_into_the_residual():
    rows = np.array([[0.0, 0.0, 1.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    assert verify_sampled([1], rows, np.random.default_rng(0)) == ([2], 0)


class RoundsUp:
    """An RNG stub whose uniform draws sit at the very top, where u * total can round to total."""

    def random(self) -> float:
        return 1.0


def test_a_draft_holding_all_the_probability_is_accepted_even_when_u_rounds_up():
    rows = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert verify_sampled([1], rows, RoundsUp()) == ([1, 2], 1)


def test_verify_sampled_needs_one_row_per_position():
    with pytest.raises(ValueError):
        verify_sampled([1, 2], np.stack([P1, P2]), np.random.default_rng(0))


# --- num_to_emit ---------------------------------------------------------------------


@pytest.mark.parametrize("tokens, max_num, expected", [
    ([4, 2, 0, 7], 10, 3),  # through the stop token, which is kept
    ([0, 4], 10, 1),  # the stop token first
    ([4, 2, 7], 10, 3),  # no stop: all
    ([4, 2, 0, 7], 2, 2),  # max_tokens comes before the stop token
    ([4, 2, 0, 7], 3, 3),  # both at once
    ([4, 2], 0, 0),
])
def test_num_to_emit(tokens, max_num, expected):
    assert num_to_emit(tokens, lambda t: t == 0, max_num) == expected
