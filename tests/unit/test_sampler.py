"""Sampler: penalties, greedy, top_k / top_p / min_p draws, per-sequence seeds, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from localllm.engine.request import SamplingParams, Sequence
from localllm.engine.sampler import Sampler, _search, apply_penalties
from localllm.errors import ParameterError, UsageError


def make_seq(prompt: list[int] | None = None, output: list[int] | None = None, **params) -> Sequence:
    seq = Sequence(prompt_token_ids=prompt or [0], params=SamplingParams(**params))
    seq.output_token_ids = list(output or [])
    return seq


def random_logits(vocab: int, seed: int, scale: float = 3.0, shift: float = 0.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(vocab) * scale + shift).astype(np.float32)  # (vocab,)


def draw(sampler: Sampler, seq: Sequence, logits: np.ndarray, n: int) -> list[int]:
    return [sampler.sample(seq, logits)[0] for _ in range(n)]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)  # (vocab,)
    return x - x.max() - math.log(np.exp(x - x.max()).sum())


def assert_frequencies(tokens: list[int], expected: dict[int, float]) -> None:
    """Exactly the expected tokens were drawn, each within 5 sigma of its probability."""
    counts = np.bincount(tokens)  # (max token + 1,)
    assert sorted(np.flatnonzero(counts).tolist()) == sorted(expected)
    n = len(tokens)
    for token, p in expected.items():
        assert abs(counts[token] / n - p) < 5 * math.sqrt(p * (1 - p) / n), (token, counts[token] / n, p)


# --- greedy ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_is_argmax_and_has_no_logprob_by_default(seed):
    logits = random_logits(50_000, seed)
    assert Sampler().sample(make_seq(temperature=0.0), logits) == (int(np.argmax(logits)), None)


def test_greedy_ties_go_to_the_lowest_id():
    logits = np.array([0.0, 5.0, 1.0, 5.0, 5.0], dtype=np.float32)
    assert Sampler().sample(make_seq(temperature=0.0), logits)[0] == 1


# --- penalties ------------------------------------------------------------------------


def test_neutral_penalties_return_the_input_itself():
    logits = random_logits(100, 0)
    assert apply_penalties(make_seq(output=[1, 2]), logits) is logits
    # frequency and presence act on the output only: nothing to do before the first token
    assert apply_penalties(make_seq(prompt=[1, 2], frequency_penalty=1.0, presence_penalty=1.0), logits) is logits


def test_repetition_penalty_divides_positive_multiplies_negative_once_per_distinct_token():
    logits = np.array([3.0, -1.0, 2.5, -2.0, 0.5], dtype=np.float32)
    seq = make_seq(prompt=[0, 1, 0], output=[0], repetition_penalty=1.5)
    expected = np.array([2.0, -1.5, 2.5, -2.0, 0.5], dtype=np.float32)
    np.testing.assert_array_equal(apply_penalties(seq, logits), expected)


@pytest.mark.parametrize("logits, prompt, output, penalty, before, after", [
    ([3.0, 2.5], [0], [], 1.5, 0, 1),  # positive: 3.0 / 1.5 = 2.0 < 2.5
    ([-1.0, -1.2], [5], [0], 1.5, 0, 1),  # negative: -1.0 * 1.5 = -1.5 < -1.2 (dividing would keep 0)
    ([2.0, 2.5], [0], [], 0.5, 1, 0),  # below 1 it rewards: 2.0 / 0.5 = 4.0 > 2.5
    ([3.0, 2.0], [0], [], 1.5, 0, 0),  # 3.0 / 1.5 = 2.0 ties 2.0: the lowest id wins
])
def test_repetition_penalty_moves_the_argmax(logits, prompt, output, penalty, before, after):
    logits = np.array(logits + [-9.0] * 4, dtype=np.float32)
    plain = make_seq(prompt=prompt, output=output, temperature=0.0)
    penalized = make_seq(prompt=prompt, output=output, temperature=0.0, repetition_penalty=penalty)
    assert Sampler().sample(plain, logits)[0] == before
    assert Sampler().sample(penalized, logits)[0] == after


def test_frequency_and_presence_penalties_are_exact_and_skip_the_prompt():
    logits = np.arange(8, dtype=np.float32)
    seq = make_seq(prompt=[7, 7], output=[2, 2, 5], frequency_penalty=0.5, presence_penalty=0.25)
    expected = np.array([0, 1, 2 - 1.25, 3, 4, 5 - 0.75, 6, 7], dtype=np.float32)
    np.testing.assert_array_equal(apply_penalties(seq, logits), expected)
    rewarded = make_seq(output=[2, 2, 5], frequency_penalty=-0.5, presence_penalty=-0.25)
    expected = np.array([0, 1, 2 + 1.25, 3, 4, 5 + 0.75, 6, 7], dtype=np.float32)
    np.testing.assert_array_equal(apply_penalties(rewarded, logits), expected)


@pytest.mark.parametrize("presence, token", [(1.0, 0), (0.99, 1)])
def test_presence_penalty_moves_the_argmax_at_the_exact_margin(presence, token):
    logits = np.array([1.0, 2.0, -5.0], dtype=np.float32)
    seq = make_seq(output=[1], temperature=0.0, presence_penalty=presence)
    assert Sampler().sample(seq, logits)[0] == token  # 2.0 - 1.0 ties 1.0: the lowest id wins


# --- logit bias -----------------------------------------------------------------------


def test_logit_bias_adds_its_values_before_the_penalties():
    logits = np.array([3.0, -1.0, 2.5, -2.0, 0.5], dtype=np.float32)
    seq = make_seq(prompt=[0], output=[4], logit_bias={"1": 2.0, 3: -100}, repetition_penalty=2.0,
                   presence_penalty=0.5)
    # 1: -1 + 2 = 1 (not repeated); 0: 3 / 2 (repeated); 4: (0.5 / 2) - 0.5 (repeated, in the output)
    expected = np.array([1.5, 1.0, 2.5, -102.0, -0.25], dtype=np.float32)
    np.testing.assert_array_equal(apply_penalties(seq, logits), expected)
    assert seq.params.logit_bias == ((1, 2.0), (3, -100.0))


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=1.0, seed=3),
                                    dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=4)])
def test_logit_bias_of_minus_100_bans_and_plus_100_forces_a_token(params):
    logits = random_logits(5000, 0, scale=5.0)  # (vocab,) a spread as wide as a real model's
    best = int(np.argmax(logits))
    banned, sampler = make_seq(logit_bias={str(best): -100}, **params), Sampler()
    assert best not in draw(sampler, banned, logits, 200)
    forced = make_seq(logit_bias={"17": 100}, **params)
    assert set(draw(sampler, forced, logits, 50)) == {17}
    # the logprob stays the model's own, before the bias
    with_logprobs = make_seq(logit_bias={"17": 100}, logprobs=True, **params)
    assert sampler.sample(with_logprobs, logits)[1] == pytest.approx(log_softmax(logits)[17], abs=1e-5)


def test_logit_bias_composes_with_a_grammar_mask():
    """A token the grammar masked (-inf) stays masked whatever its bias; among the allowed
    ones the bias moves the pick."""
    logits = np.array([5.0, -np.inf, 1.0, -np.inf], dtype=np.float32)
    seq = make_seq(temperature=0.0, logit_bias={"1": 100, "2": 10})
    assert Sampler().sample(seq, logits)[0] == 2


def test_verify_applies_the_logit_bias_to_every_row_as_plain_sampling_does():
    rows = np.stack([random_logits(30, seed=s, scale=1.0) for s in range(4)])  # (4, 30)
    params = dict(temperature=0.0, logit_bias={str(int(np.argmax(rows[1]))): -100, "29": 3.0})
    plain = [Sampler().sample(make_seq(**params), row)[0] for row in rows]
    assert Sampler().verify(make_seq(**params), plain[:3], rows) == (plain, 3)


@pytest.mark.parametrize("bias, message", [
    ({"abc": 1}, "key 'abc' is not a token id"), ({"-5": 1}, "key '-5' is not a token id"),
    ({" 5": 1}, "not a token id"), ({True: 1}, "not a token id"),
    ({"5": 101}, r"value 101 for token 5 is invalid: use a number in \[-100, 100\]"),
    ({"5": -100.5}, "invalid"), ({"5": float("nan")}, "invalid"), ({"5": "1"}, "invalid"),
    ([("5", 1)], "give an object of token ids"),
])
def test_logit_bias_keys_and_values_are_validated(bias, message):
    with pytest.raises(ParameterError, match=message) as e:
        SamplingParams(logit_bias=bias)
    assert e.value.param == "logit_bias"


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    params = SamplingParams(logit_bias={"99": 1.0})
    params.check_vocab(100)
    with pytest.raises(ParameterError, match="token id 100, outside the vocabulary of 100") as e:
        SamplingParams(logit_bias={"100": 1.0}).check_vocab(100)
    assert e.value.param == "logit_bias"


# --- top_k / top_p / min_p ------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.05, 1.0, 7.0, 100.0])
def test_top_k_1_is_greedy_at_any_temperature(temperature):
    sampler = Sampler()
    for seed in range(5):
        logits = random_logits(20_000, seed)
        seq = make_seq(temperature=temperature, top_k=1, seed=seed)
        assert draw(sampler, seq, logits, 3) == [int(np.argmax(logits))] * 3
    tied = np.array([1.0, 3.0, 3.0, 0.0], dtype=np.float32)
    assert draw(sampler, make_seq(temperature=temperature, top_k=1, seed=0), tied, 3) == [1, 1, 1]


def test_top_k_keeps_the_k_largest():
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3], dtype=np.float32))
    tokens = draw(Sampler(), make_seq(temperature=1.0, top_k=2, seed=11), logits, 20_000)
    assert_frequencies(tokens, {1: 0.4 / 0.7, 3: 0.3 / 0.7})


def test_top_p_draws_only_the_nucleus_in_renormalised_proportions():
    logits = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15], dtype=np.float32))
    # 0.4 + 0.3 = 0.7 < 0.8 <= 0.4 + 0.3 + 0.15
    tokens = draw(Sampler(), make_seq(temperature=1.0, top_p=0.8, seed=12), logits, 20_000)
    assert_frequencies(tokens, {1: 0.4 / 0.85, 3: 0.3 / 0.85, 4: 0.15 / 0.85})


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32))
    # after top_k=3: 0.44, 0.33, 0.22, so top_p=0.75 keeps two (over the raw probs it would keep three)
    tokens = draw(Sampler(), make_seq(temperature=1.0, top_k=3, top_p=0.75, seed=13), logits, 20_000)
    assert_frequencies(tokens, {0: 0.4 / 0.7, 1: 0.3 / 0.7})


def test_min_p_drops_tokens_below_its_share_of_the_best():
    logits = np.log(np.array([0.06, 0.5, 0.04, 0.1, 0.3], dtype=np.float32))
    # threshold 0.15 * 0.5 = 0.075
    tokens = draw(Sampler(), make_seq(temperature=1.0, min_p=0.15, seed=14), logits, 20_000)
    assert_frequencies(tokens, {1: 0.5 / 0.9, 3: 0.1 / 0.9, 4: 0.3 / 0.9})


def test_temperature_sharpens_the_distribution():
    logits = np.log(np.array([0.6, 0.4], dtype=np.float32))
    # at T = 0.5 the weights square: 0.36 : 0.16
    tokens = draw(Sampler(), make_seq(temperature=0.5, seed=15), logits, 20_000)
    assert_frequencies(tokens, {0: 0.36 / 0.52, 1: 0.16 / 0.52})


def test_draws_span_blocks_and_the_partial_last_block():
    # 3,000 tokens: blocks of 1,024 end at 1023 and 2047, the last holds 952; the rest weigh exp(-200) = 0
    probs = {5: 0.3, 1023: 0.1, 1024: 0.15, 1500: 0.15, 2100: 0.1, 2999: 0.2}
    logits = np.full(3000, -200.0, dtype=np.float32)
    logits[list(probs)] = np.log(np.array(list(probs.values()), dtype=np.float32))
    assert_frequencies(draw(Sampler(), make_seq(temperature=1.0, seed=18), logits, 20_000), probs)


def test_a_draw_that_rounds_up_to_the_total_takes_the_last_token_with_weight():
    assert _search(np.array([0.5, 1.0, 1.0]), 1.0) == 1
    assert _search(np.array([0.0, 0.5, 1.0]), 0.0) == 1  # a step of no width is never taken


# --- the candidate fast path against the full sort --------------------------------------


@pytest.mark.parametrize("top_p, min_p, num_full_sorts", [(0.02, 0.0, 0), (0.5, 0.0, 300), (0.5, 0.9, 300)])
def test_candidates_and_full_sort_draw_the_same_tokens(top_p, min_p, num_full_sorts):
    # 1,000 descending weights in shuffled ids: top_p 0.02 keeps 7, top_p 0.5 keeps 215 (> 32 candidates)
    logits = np.random.default_rng(0).permutation(np.linspace(0.0, -3.0, 1000)).astype(np.float32)
    fast, full = Sampler(num_candidates=32), Sampler(num_candidates=1000)
    params = dict(temperature=1.0, top_p=top_p, min_p=min_p, seed=16)
    fast_tokens = draw(fast, make_seq(**params), logits, 300)
    assert fast_tokens == draw(full, make_seq(**params), logits, 300)
    assert (fast.num_full_sorts, full.num_full_sorts) == (num_full_sorts, 300)


def test_flat_nucleus_wider_than_the_candidates_takes_the_lowest_ids():
    logits = np.zeros(100, dtype=np.float32)
    sampler = Sampler(num_candidates=8)
    # 46 / 100 >= 0.455 > 45 / 100: ties rank by id, so the nucleus is ids 0..45
    tokens = draw(sampler, make_seq(temperature=1.0, top_p=0.455, seed=17), logits, 5_000)
    assert sorted(set(tokens)) == list(range(46))
    assert sampler.num_full_sorts == 5_000
    assert tokens == draw(Sampler(num_candidates=100), make_seq(temperature=1.0, top_p=0.455, seed=17), logits, 5_000)


# --- seeds ------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [dict(), dict(top_p=0.9), dict(top_k=40, min_p=0.01)])
def test_same_seed_same_tokens_different_seed_different_tokens(params):
    logits = random_logits(5_000, 0, scale=1.0)
    first = draw(Sampler(), make_seq(seed=5, **params), logits, 50)
    assert draw(Sampler(), make_seq(seed=5, **params), logits, 50) == first
    assert draw(Sampler(), make_seq(seed=6, **params), logits, 50) != first


def test_unseeded_sequences_draw_differently():
    logits = random_logits(5_000, 0, scale=1.0)
    sampler = Sampler()
    assert draw(sampler, make_seq(), logits, 50) != draw(sampler, make_seq(), logits, 50)


def test_interleaved_sequences_with_one_seed_match_each_alone():
    logits = random_logits(5_000, 0, scale=1.0)
    alone = draw(Sampler(), make_seq(seed=3), logits, 30)
    sampler = Sampler()
    a, b, other = make_seq(seed=3), make_seq(seed=3), make_seq(seed=4)
    tokens_a, tokens_b, tokens_other = [], [], []
    for _ in range(30):
        tokens_a.append(sampler.sample(a, logits)[0])
        tokens_other.append(sampler.sample(other, logits)[0])
        sampler.sample(make_seq(temperature=0.0), logits)  # a greedy neighbour
        tokens_b.append(sampler.sample(b, logits)[0])
    assert tokens_a == tokens_b == alone
    assert tokens_other != alone


def test_free_forgets_the_rng_so_a_seed_restarts():
    logits = random_logits(5_000, 0, scale=1.0)
    sampler, seq = Sampler(), make_seq(seed=8)
    first = draw(sampler, seq, logits, 20)
    assert draw(sampler, seq, logits, 20) != first
    sampler.free(seq.seq_id)
    assert draw(sampler, seq, logits, 20) == first


# --- logprobs and the input array --------------------------------------------------------


@pytest.mark.parametrize("params", [
    dict(temperature=0.0),
    dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5),
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=50, top_p=0.9, min_p=0.05),
    dict(temperature=0.5, top_p=0.8, repetition_penalty=1.2, presence_penalty=0.4),
])
def test_logprob_is_the_raw_log_softmax_at_the_token(params):
    # around 100: a float32 exp without the max subtracted would overflow
    logits = random_logits(50_000, 1, scale=4.0, shift=100.0)
    expected = log_softmax(logits)
    sampler = Sampler()
    seq = make_seq(prompt=[int(np.argmax(logits)), 3], output=[3, 9], seed=21, logprobs=True, **params)
    for _ in range(5):
        token, logprob = sampler.sample(seq, logits)
        assert logprob == pytest.approx(expected[token], abs=1e-5)
    assert sampler.sample(make_seq(seed=21, **params), logits)[1] is None


@pytest.mark.parametrize("params", [
    dict(temperature=0.0),
    dict(temperature=0.0, repetition_penalty=1.3),
    dict(temperature=1.0),
    dict(temperature=0.7, min_p=0.1),
    dict(temperature=0.7, top_k=20, top_p=0.5, frequency_penalty=1.0, presence_penalty=0.5),
])
def test_read_only_logits_are_left_unmodified(params):
    logits = random_logits(50_000, 2)
    before = logits.copy()
    logits.flags.writeable = False
    seq = make_seq(prompt=[1, 2, 3], output=[4, 4], seed=0, logprobs=True, **params)
    for _ in range(3):
        Sampler(num_candidates=64).sample(seq, logits)
    np.testing.assert_array_equal(logits, before)


def test_top_logprobs_are_the_k_best_log_softmax_values_best_first():
    from localllm.engine.sampler import top_logprobs

    logits = np.array([1.0, 3.0, 2.0, 3.0, -1.0], dtype=np.float32)
    expected = logits - np.log(np.exp(logits.astype(np.float64)).sum())
    top = top_logprobs(logits, 3)
    assert [i for i, _ in top] == [1, 3, 2]  # the tie between 1 and 3 goes to the lower id
    for i, lp in top:
        assert lp == pytest.approx(expected[i], abs=1e-6)
    assert [i for i, _ in top_logprobs(logits, 10)] == [1, 3, 2, 0, 4]


def test_top_logprobs_is_validated():
    with pytest.raises(UsageError, match="top_logprobs"):
        SamplingParams(top_logprobs=21)


# --- the distribution a draw follows, and drafts ------------------------------------


def test_verify_greedy_keeps_the_drafts_the_argmax_agrees_with():
    rows = np.full((4, 10), -1.0, dtype=np.float32)
    for i, best in enumerate([3, 5, 9, 2]):
        rows[i, best] = 1.0
    seq = make_seq(temperature=0.0)
    assert Sampler().verify(seq, [3, 5, 1], rows) == ([3, 5, 9], 2)
    assert Sampler().verify(seq, [3, 5, 9], rows) == ([3, 5, 9, 2], 3)


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.8, top_k=5, top_p=0.9)])
def test_verify_emits_exactly_what_plain_sampling_draws_with_the_same_seed(params):
    rows = np.stack([random_logits(30, seed=s, scale=1.0) for s in range(6)])  # (6, 30)
    for seed in range(200):
        plain_seq, drafted_seq = make_seq(seed=seed, **params), make_seq(seed=seed, **params)
        plain_sampler, sampler = Sampler(), Sampler()
        plain = [plain_sampler.sample(plain_seq, row)[0] for row in rows]
        draft = [plain[0], plain[1], (plain[2] + 1) % 30, 7, 7]  # two right, then a wrong one
        emitted, accepted = sampler.verify(drafted_seq, draft, rows)
        assert (emitted, accepted) == (plain[:3], 2)
        # the RNG moved on by exactly the draws it took: the next draw is plain sampling's 4th
        assert sampler.sample(drafted_seq, rows[3])[0] == plain[3]
