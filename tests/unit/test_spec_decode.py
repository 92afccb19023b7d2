"""Speculative decoding core: n-gram index, step costs, acceptance estimate, the drafting plan,
greedy and sampled acceptance."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localllm.engine.spec_decode import (
    Acceptance,
    Drafter,
    NgramIndex,
    StepCost,
    verify,
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


def test_a_long_ngram_finds_the_place_being_copied():
    # "1 2 3 4" occurs twice; only the 8-gram ending in it says which one is being copied
    tokens = [7, 7, 7, 7, 1, 2, 3, 4, 50, 51, 9, 9, 9, 9, 1, 2, 3, 4, 60, 61, 7, 7, 7, 7, 1, 2, 3, 4]
    assert NgramIndex(tokens, max_ngram=4).propose(2) == [60, 61]  # the latest 4-gram: wrong place
    assert NgramIndex(tokens, max_ngram=8).propose(2) == [50, 51]
    assert NgramIndex(tokens, max_ngram=12).lengths == [1, 2, 3, 4, 6, 8, 12]
    assert NgramIndex(tokens, max_ngram=5).lengths == [1, 2, 3, 4, 5]


def test_32k_context_memory_and_append_cost():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 2000, size=32_768).tolist()
    start = time.perf_counter()
    index = NgramIndex(tokens, max_ngram=12)
    built = time.perf_counter() - start
    assert len(index) == 32_768
    assert index.num_entries <= 7 * len(index)  # one entry per token per length, never more
    appended = rng.integers(0, 2000, size=1000).tolist()
    start = time.perf_counter()
    for t in appended:
        index.extend([t])
        index.propose(8)
    per_step = (time.perf_counter() - start) / 1000
    assert index.num_entries <= 7 * len(index)
    print(f"\nbuild 32k: {built * 1e3:.1f} ms; append + propose: {per_step * 1e6:.1f} us")


# --- StepCost ----------------------------------------------------------------------


def test_step_cost_interpolates_between_buckets_and_extrapolates_optimistically():
    cost = StepCost()
    assert cost.seconds(1) is None  # nothing seen: no estimate, so no draft
    cost.record(256, 0.768, decode_only=False)  # a prefill chunk: 3 ms per token, the floor
    assert cost.seconds(1) is None  # prefill steps alone give no decode estimate
    cost.record(1, 0.020, decode_only=True)
    assert cost.seconds(1) == pytest.approx(0.020)
    # past the largest point: plus the floor per extra token
    assert cost.seconds(2) == pytest.approx(0.020 + 0.003)
    assert cost.seconds(33) == pytest.approx(0.020 + 32 * 0.003)
    cost.record(33, 0.280, decode_only=True)
    assert cost.seconds(17) == pytest.approx(0.020 + 0.260 * 16 / 32)  # between the points
    cost.record(40, 0.300, decode_only=True)  # the same bucket: medians of (tokens, seconds)
    assert cost.seconds(36.5) == pytest.approx(0.290)
    assert cost.seconds(100) == pytest.approx(0.290 + 63.5 * 0.003)
    only_batches = StepCost()
    only_batches.record(8, 0.050, decode_only=True)
    assert only_batches.seconds(1) == pytest.approx(0.050)  # below the first point: its time
    assert [StepCost.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 256)] == [0, 1, 2, 2, 3, 3, 4, 8]


def test_step_cost_holds_through_one_slow_step_and_follows_a_lasting_change():
    cost = StepCost(window=5)
    for _ in range(5):
        cost.record(1, 0.020, decode_only=True)
        cost.record(2, 0.024, decode_only=True)
    cost.record(2, 0.040, decode_only=True)  # another program took the core for one step
    assert cost.seconds(2) == pytest.approx(0.024)  # an average would have moved by a third of it
    assert cost.seconds(2) / cost.seconds(1) == pytest.approx(1.2)
    cost.record(2, 0.040, decode_only=True)
    assert cost.seconds(2) == pytest.approx(0.024)
    cost.record(2, 0.040, decode_only=True)  # three of the last five: the load stays
    assert cost.seconds(2) == pytest.approx(0.040)
    assert cost.points() == [(1, 0.020), (2, 0.040)]


def test_step_cost_ignores_empty_steps():
    cost = StepCost()
    cost.record(0, 0.01, decode_only=True)
    cost.record(4, 0.0, decode_only=True)
    assert cost.seconds(4) is None


# --- Acceptance ----------------------------------------------------------------------


def test_acceptance_is_the_decayed_geometric_estimate():
    a = Acceptance(prior_accepted=0.5, prior_missed=1.0, decay=0.5)
    assert a.p == pytest.approx(1 / 3)
    a.record(10, missed=True)  # accepted 0.25 + 10, missed 0.5 + 1
    assert a.p == pytest.approx(10.25 / 11.75)
    a.record(4, missed=False)  # a run that ended without a miss
    assert (a.accepted, a.missed) == pytest.approx((9.125, 0.75))
    for _ in range(20):
        a.record(0, missed=True)
    assert a.p < 0.01


def test_expected_accepted_is_the_geometric_sum():
    a = Acceptance(prior_accepted=3.0, prior_missed=1.0)  # p = 0.75
    assert a.expected_accepted(1) == pytest.approx(0.75)
    assert a.expected_accepted(3) == pytest.approx(0.75 + 0.75 ** 2 + 0.75 ** 3)
    assert Acceptance(prior_accepted=1.0, prior_missed=0.0).expected_accepted(5) == 5


# --- Drafter -------------------------------------------------------------------------

CODE = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19] * 4  # a text that repeats: drafts match


def cpu_like_costs(drafter: Drafter) -> None:
    """Step costs measured on this 2-core CPU (llama.cpp, Qwen2.5-Coder-0.5B, every row's
    logits): 19 ms for one token, 37 for two, 93 for 8, 131 for 16, 278 for 33, 384 for 64."""
    drafter.cost.record(256, 0.85, decode_only=False)
    for n, ms in ((1, 19), (2, 37), (4, 60), (8, 93), (16, 131), (33, 278), (64, 384), (128, 700)):
        drafter.cost.record(n, ms / 1000, decode_only=True)


def gpu_like_costs(drafter: Drafter) -> None:
    """Costs like a GPU's: any step up to 256 tokens costs about one token's time."""
    for n in (1, 2, 4, 8, 16, 33, 64, 128, 256):
        drafter.cost.record(n, 0.010 + 0.00001 * n, decode_only=True)


def in_a_run(drafter: Drafter, seq_id: int, tokens: list[int], accepted: float, missed: float) -> None:
    """Give a sequence an acceptance estimate and a streak of right proposals."""
    state = drafter._state(seq_id, tokens)
    state.acceptance = Acceptance(prior_accepted=accepted, prior_missed=missed)
    state.streak = drafter.min_streak


def test_no_draft_before_any_decode_step_was_timed():
    drafter = Drafter()
    assert drafter.plan([(1, CODE, 50, False)], 1, 1, 255) == {}


def test_no_draft_where_acceptance_is_unknown_and_steps_are_dear():
    drafter = Drafter()
    cpu_like_costs(drafter)  # p = 1/3 a priori: 1.33 tokens for 40 ms is worse than 1 for 20
    assert drafter.plan([(1, CODE, 50, False)], 1, 1, 255) == {}


def test_shadow_proposals_turn_drafting_on_where_the_text_repeats():
    drafter = Drafter(k_shadow=8)
    cpu_like_costs(drafter)
    tokens = list(CODE)
    assert drafter.plan([(1, tokens, 50, False)], 1, 1, 255) == {}  # no draft; a shadow instead
    for _ in range(8):  # the sequence goes on repeating: the shadow proposal was right
        tokens.append(tokens[-10])
        drafter.on_tokens(1, [tokens[-1]])
    assert drafter.acceptance(1).p == pytest.approx(8.35 / 9.05)  # 0.7 * 0.5 + 8 accepted, 0.7 * 1 missed
    assert drafter._seqs[1].streak == 8
    drafts = drafter.plan([(1, tokens, 50, False)], 1, 1, 255)
    assert drafts[1] == (tokens[-10:] * 5)[:len(drafts[1])] and len(drafts[1]) >= 8


def test_shadow_misses_keep_drafting_off():
    drafter = Drafter(k_shadow=4)
    cpu_like_costs(drafter)
    tokens = list(CODE)
    for _ in range(6):
        assert drafter.plan([(1, tokens, 50, False)], 1, 1, 255) == {}
        guess = drafter._seqs[1].shadow[0]
        tokens.append(10 + (guess + 5) % 10)  # a token of the text, but not the one proposed
        drafter.on_tokens(1, [tokens[-1]])
    assert drafter.acceptance(1).p < 0.05


def test_a_run_of_two_right_proposals_starts_drafting_and_a_miss_stops_it():
    drafter = Drafter()
    gpu_like_costs(drafter)
    tokens = list(CODE)
    assert drafter.plan([(1, tokens, 50, False)], 1, 1, 255) == {}  # no streak yet: a shadow
    for _ in range(2):
        tokens.append(tokens[-10])
        drafter.on_tokens(1, [tokens[-1]])
    assert drafter._seqs[1].streak == 2
    assert drafter.plan([(1, tokens, 50, False)], 1, 1, 255)  # drafts are nearly free here
    drafter.on_verified(1, 4, 0)
    assert drafter._seqs[1].streak == 0
    assert drafter.plan([(1, tokens, 50, False)], 1, 1, 255) == {}  # a miss ends the run


def test_cheap_steps_draft_long_and_dear_steps_draft_short():
    cheap, dear = Drafter(), Drafter()
    gpu_like_costs(cheap)
    cpu_like_costs(dear)
    for d in (cheap, dear):
        in_a_run(d, 1, list(range(100, 200)) * 2, 9.0, 1.0)  # p = 0.9
    text = list(range(100, 200)) * 2  # a 100-token passage, repeated: proposals of 100 tokens
    k_cheap = len(cheap.plan([(1, text, 200, False)], 1, 1, 255)[1])
    k_dear = len(dear.plan([(1, text, 200, False)], 1, 1, 255)[1])
    assert k_cheap > k_dear >= 8


def test_drafts_respect_room_budget_and_force():
    drafter = Drafter(k_force=6)
    gpu_like_costs(drafter)
    in_a_run(drafter, 1, CODE, 99.0, 1.0)
    assert len(drafter.plan([(1, CODE, 3, False)], 1, 1, 255)[1]) == 3  # room: context, max_tokens
    assert len(drafter.plan([(1, CODE, 50, False)], 1, 1, 5)[1]) == 5  # the step's budget
    # forced: whatever the index proposes, up to k_force, even with no timing and no evidence
    assert Drafter(k_force=6).plan([(2, CODE, 50, True)], 1, 1, 255) == {2: CODE[:6]}


def test_the_budget_goes_to_the_likeliest_sequences_first():
    drafter = Drafter()
    gpu_like_costs(drafter)
    text = list(range(100, 200)) * 2
    in_a_run(drafter, 1, text, 1.0, 1.0)  # p = 0.5
    in_a_run(drafter, 2, text, 99.0, 1.0)  # p = 0.99
    drafts = drafter.plan([(1, text, 50, False), (2, text, 50, False)], 2, 2, 20)
    assert len(drafts[2]) == 20 and 1 not in drafts


def test_verified_drafts_update_acceptance_and_forget_drops_the_state():
    drafter = Drafter()
    drafter._state(1, CODE)
    drafter.on_verified(1, 8, 8)
    drafter.on_verified(1, 8, 3)
    a = drafter.acceptance(1)
    assert (a.accepted, a.missed) == pytest.approx((0.5 * 0.49 + 8 * 0.7 + 3, 0.49 + 1))
    drafter.forget(1)
    assert drafter.acceptance(1) is None


# --- verify --------------------------------------------------------------------------


@pytest.mark.parametrize("draft, picks, expected", [
    ([5, 6, 7], [5, 6, 7, 8], ([5, 6, 7, 8], 3)),  # all accepted, plus the model's next token
    ([5, 6, 7], [5, 6, 9, 8], ([5, 6, 9], 2)),  # first mismatch at 2: the model's token there
    ([5, 6, 7], [1, 6, 7, 8], ([1], 0)),  # the first draft is wrong: nothing accepted
    ([5, 6, 7], [5, 1, 7, 8], ([5, 1], 1)),  # a later agreement after a mismatch does not count
    ([], [4], ([4], 0)),  # no draft: a plain decode step
])
def test_verify_keeps_drafts_while_the_picks_agree(draft, picks, expected):
    asked = []

    def pick(i: int) -> int:
        asked.append(i)
        return picks[i]

    assert verify(draft, pick) == expected
    assert asked == list(range(len(expected[0])))  # rows are picked in order, and no further


P = np.array([0.5, 0.3, 0.2])


def test_a_sampled_draft_is_kept_with_the_models_probability():
    rng = np.random.default_rng(0)
    n = 40_000
    kept = sum(verify([1], lambda i: int(rng.choice(3, p=P)))[1] for _ in range(n))
    assert abs(kept / n - P[1]) < 5 * math.sqrt(P[1] * (1 - P[1]) / n)


def test_where_checking_is_cheap_one_right_proposal_starts_a_run():
    """GPU-like costs (a step of 2 about a step of 1): one right shadow token is streak enough.
    CPU-like costs (2 tokens cost 37 ms against 19): it takes two, as before."""
    for costs, cheap in ((gpu_like_costs, True), (cpu_like_costs, False)):
        drafter = Drafter()
        costs(drafter)
        assert drafter.verifying_is_cheap() == cheap
        tokens = list(CODE)
        drafter._state(1, tokens).acceptance = Acceptance(prior_accepted=9.0, prior_missed=1.0)
        assert drafter.plan([(1, tokens, 50, False)], 1, 1, 255) == {}  # a shadow first
        tokens.append(tokens[-10])
        drafter.on_tokens(1, [tokens[-1]])
        assert drafter._seqs[1].streak == 1
        assert bool(drafter.plan([(1, tokens, 50, False)], 1, 1, 255)) == cheap
    assert not Drafter().verifying_is_cheap()  # no step timed yet: the strict rule
