"""How closely one runner's next-token distributions follow another's on a text.

Every position's logits come through the runner interface itself: a chunk of the text is
sent as one known token followed by the rest of the chunk as "draft" tokens, so the runner
returns a row for each position. Chunks run in lockstep on both runners and are scored as they
come, so a whole text's logits (tokens x vocabulary, 3,000 x 152k floats is 1.8 GB) are never
held at once. Reported per runner: perplexity on the text; for the candidate against the
reference: top-1 agreement (the same most likely next token) and the mean
KL(reference || candidate).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from localllm.engine.request import SamplingParams, Sequence
from localllm.engine.scheduler import ScheduledSeq, SchedulerOutput
from localllm.errors import EngineError

CHUNK = 256  # positions a runner computes per call; the step token budget must allow it
ROWS = 32  # logits rows scored at once: 32 x 152k vocabulary x 8 bytes is 39 MB per array


def log_softmax(x: np.ndarray) -> np.ndarray:
    """log softmax over the last axis, in float64."""
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def all_logits(runner, token_ids: list[int], chunk: int = CHUNK) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (first position, rows) chunk by chunk; rows (k, vocab) are the logits after each of
    positions first..first+k-1, so rows[i] predicts token_ids[first + i + 1]. The rows may be
    a view into the runner's memory, valid until the next chunk is asked for.

    With chunk 4 and 10 tokens t0..t9, the steps are: t0 known + t1..t3 drafts (positions
    0-3), t4 known + t5..t7 (4-7), t8 known + nothing (8); the KV of one sequence is kept
    across them, so each chunk attends to everything before it."""
    if len(token_ids) < 2:
        raise ValueError("scoring a text needs at least 2 tokens")
    seq = Sequence(prompt_token_ids=token_ids[:1], params=SamplingParams())
    seq.block_table = list(range(-(-len(token_ids) // runner.block_size)))
    runner.attach(seq, 0)
    try:
        for first in range(0, len(token_ids) - 1, chunk):
            k = min(chunk, len(token_ids) - 1 - first)
            seq.prompt_token_ids = token_ids[:first + 1]
            seq.num_computed_tokens = first
            seq.draft_token_ids = token_ids[first + 1:first + k]
            yield first, runner.execute(SchedulerOutput([ScheduledSeq(seq, k, k - 1)]))
    finally:
        runner.release(seq, [])


@dataclass
class Tally:
    """Running sums over the scored positions; ``add`` takes them a chunk at a time."""

    num_predictions: int = 0
    num_agreeing: int = 0  # positions where both runners' most likely next token is the same
    nll_reference: float = 0.0  # summed negative log-likelihood of the text's next tokens
    nll_candidate: float = 0.0
    kl_sum: float = 0.0  # summed KL(reference || candidate), in nats

    def add(self, reference: np.ndarray, candidate: np.ndarray, target_ids: np.ndarray) -> None:
        """Score rows of logits (k, vocab) that predict target_ids (k,). ``candidate`` may be
        ``reference`` itself: then agreement is 100 % and KL 0, exactly."""
        if reference.shape != candidate.shape:
            raise EngineError(f"the runners disagree on the logits' shape: {reference.shape} "
                              f"and {candidate.shape} (another vocabulary?)")
        is_same = candidate is reference
        for i in range(0, len(target_ids), ROWS):
            la = log_softmax(reference[i:i + ROWS])  # (r, vocab)
            lb = la if is_same else log_softmax(candidate[i:i + ROWS])
            rows = np.arange(len(la))
            targets = target_ids[i:i + ROWS]
            self.nll_reference -= float(la[rows, targets].sum())
            self.nll_candidate -= float(lb[rows, targets].sum())
            self.num_agreeing += int((la.argmax(-1) == lb.argmax(-1)).sum())
            if not is_same:
                # Rounding can leave a row of (nearly) equal distributions at -1e-17.
                self.kl_sum += float(np.maximum((np.exp(la) * (la - lb)).sum(-1), 0.0).sum())
            self.num_predictions += len(la)

    @property
    def perplexity_reference(self) -> float:
        return math.exp(self.nll_reference / self.num_predictions)

    @property
    def perplexity_candidate(self) -> float:
        return math.exp(self.nll_candidate / self.num_predictions)

    @property
    def top1_agreement(self) -> float:
        """In percent."""
        return 100.0 * self.num_agreeing / self.num_predictions

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / self.num_predictions


def compare(reference, candidate, token_ids: list[int], chunk: int = CHUNK) -> Tally:
    """Score token_ids on both runners in lockstep. ``candidate`` may be ``reference`` (the
    same configuration): the text is then computed once."""
    targets = np.asarray(token_ids, dtype=np.intp)
    tally = Tally()
    if candidate is reference:
        for first, rows in all_logits(reference, token_ids, chunk):
            tally.add(rows, rows, targets[first + 1:first + 1 + len(rows)])
        return tally
    chunks_a = all_logits(reference, token_ids, chunk)
    chunks_b = all_logits(candidate, token_ids, chunk)
    try:
        for (first, a), (_, b) in zip(chunks_a, chunks_b):
            tally.add(a, b, targets[first + 1:first + 1 + len(a)])
    finally:  # each runner gives its sequence back, also when the other one failed
        chunks_a.close()
        chunks_b.close()
    return tally
