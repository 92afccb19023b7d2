"""localllm/evaluation.py without a model: the math on hand-made logits, and the chunks a
runner is asked for."""

from __future__ import annotations

import math

import numpy as np
import pytest

from localllm import evaluation
from localllm.evaluation import Tally, all_logits, compare, log_softmax

P = np.log([0.5, 0.25, 0.25])  # a reference row: most likely token 0
Q = np.log([0.25, 0.5, 0.25])  # a candidate row: most likely token 1


def test_log_softmax_is_float64_and_shift_free():
    x = np.array([[1.0, 2.0, 3.0], [1001.0, 1002.0, 1003.0]], dtype=np.float32)
    out = log_softmax(x)
    assert out.dtype == np.float64
    expected = np.array([1.0, 2.0, 3.0]) - math.log(math.e + math.e**2 + math.e**3)
    np.testing.assert_allclose(out, [expected, expected], rtol=0, atol=1e-12)


def test_tally_by_hand():
    tally = Tally()
    # Row 0: p against q (they disagree); row 1: p against p. Targets 0 then 2.
    tally.add(np.array([P, P]), np.array([Q, P]), np.array([0, 2]))
    assert tally.num_predictions == 2
    assert tally.num_agreeing == 1
    assert tally.top1_agreement == 50.0
    # KL(p || q) = 0.5 log(0.5 / 0.25) + 0.25 log(0.25 / 0.5) + 0 = 0.25 log 2; KL(p || p) = 0.
    assert tally.mean_kl == pytest.approx(0.25 * math.log(2) / 2, abs=1e-12)
    # Reference: -log 0.5 - log 0.25; candidate: -log 0.25 - log 0.25.
    assert tally.perplexity_reference == pytest.approx(math.sqrt(1 / (0.5 * 0.25)), rel=1e-12)
    assert tally.perplexity_candidate == pytest.approx(math.sqrt(1 / (0.25 * 0.25)), rel=1e-12)


def test_tally_of_a_runner_against_itself_is_exact():
    rows = np.random.default_rng(0).normal(size=(5, 7)).astype(np.float32)
    tally = Tally()
    tally.add(rows, rows, np.array([0, 1, 2, 3, 4]))
    assert tally.top1_agreement == 100.0
    assert tally.mean_kl == 0.0
    assert tally.perplexity_reference == tally.perplexity_candidate


def test_tally_sums_do_not_depend_on_how_rows_are_split(monkeypatch):
    rng = np.random.default_rng(1)
    a = rng.normal(size=(70, 11))
    b = a + rng.normal(scale=0.5, size=(70, 11))
    targets = rng.integers(0, 11, size=70)
    whole = Tally()
    whole.add(a, b, targets)
    monkeypatch.setattr(evaluation, "ROWS", 3)
    pieces = Tally()
    pieces.add(a[:40], b[:40], targets[:40])
    pieces.add(a[40:], b[40:], targets[40:])
    assert pieces.num_predictions == whole.num_predictions == 70
    assert pieces.num_agreeing == whole.num_agreeing
    assert pieces.kl_sum == pytest.approx(whole.kl_sum, rel=1e-12)
    assert pieces.nll_candidate == pytest.approx(whole.nll_candidate, rel=1e-12)
    assert 0 < whole.mean_kl


class _EchoRunner:
    """A runner whose logits at each position put `confidence` on the text's next token (it
    reads it from its table) and record every chunk it is asked for."""

    name = "echo"
    block_size = 4

    def __init__(self, token_ids: list[int], vocab: int = 10, confidence: float = 5.0):
        self.token_ids, self.vocab, self.confidence = token_ids, vocab, confidence
        self.calls: list[tuple[int, int, list[int]]] = []  # (first position, tokens, drafts)
        self.attached: list[int] = []
        self.released: list[int] = []

    def attach(self, seq, num_hit_blocks):
        assert num_hit_blocks == 0
        self.attached.append(seq.seq_id)
        return 0

    def release(self, seq, kept_block_ids):
        self.released.append(seq.seq_id)
        return []

    def execute(self, out):
        (sched,) = out.scheduled
        seq = sched.seq
        first, k = seq.num_computed_tokens, sched.num_new_tokens
        assert len(seq.block_table) * self.block_size >= len(self.token_ids)
        assert seq.token_at(first) == self.token_ids[first]
        self.calls.append((first, k, list(seq.draft_token_ids)))
        rows = np.zeros((sched.num_logits, self.vocab), dtype=np.float32)
        rows[np.arange(k), self.token_ids[first + 1:first + 1 + k]] = self.confidence
        return rows


def test_all_logits_asks_for_chunks_of_one_known_token_and_drafts():
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]
    runner = _EchoRunner(text)
    chunks = list(all_logits(runner, text, chunk=4))
    assert [(first, rows.shape) for first, rows in chunks] == [(0, (4, 10)), (4, (4, 10)), (8, (1, 10))]
    assert runner.calls == [(0, 4, [2, 3, 4]), (4, 4, [6, 7, 8]), (8, 1, [])]
    assert runner.attached == runner.released and len(runner.attached) == 1


def test_compare_in_lockstep():
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2]
    sure, unsure = _EchoRunner(text, confidence=30.0), _EchoRunner(text, confidence=1.0)
    tally = compare(sure, unsure, text, chunk=5)
    assert tally.num_predictions == 11
    assert tally.top1_agreement == 100.0  # both put their most on the true next token
    assert tally.perplexity_reference == pytest.approx(1.0, abs=1e-9)
    # unsure: p(next) = e / (e + 9) at every position.
    assert tally.perplexity_candidate == pytest.approx((math.e + 9) / math.e, rel=1e-9)
    assert tally.mean_kl > 0
    assert sure.calls == unsure.calls == [(0, 5, [2, 3, 4, 5]), (5, 5, [7, 8, 9, 0]), (10, 1, [])]
    assert len(sure.released) == len(unsure.released) == 1


def test_compare_a_runner_with_itself_computes_once():
    text = [3, 1, 4, 1, 5, 9, 2, 6]
    runner = _EchoRunner(text, confidence=2.0)
    tally = compare(runner, runner, text, chunk=3)
    assert runner.calls == [(0, 3, [1, 4]), (3, 3, [5, 9]), (6, 1, [])]
    assert tally.top1_agreement == 100.0 and tally.mean_kl == 0.0
    assert tally.perplexity_reference == tally.perplexity_candidate


def test_different_vocabularies_are_an_error():
    from localllm.errors import EngineError

    with pytest.raises(EngineError, match="another vocabulary"):
        Tally().add(np.zeros((2, 5)), np.zeros((2, 6)), np.array([0, 1]))
