"""The Sampler: picks each sequence's next token from the model's logits.

The logit bias and the penalties first, then greedy argmax at temperature 0, else a draw after
temperature, top_k, top_p and min_p, from one seeded RNG per sequence. The whole vocabulary is never sorted on
the common path: ranking uses a partition of the best ``num_candidates`` tokens, and falls
back to a full sort only when those hold less than top_p of the probability.
"""

from __future__ import annotations

import numpy as np

from localllm.engine.request import SamplingParams, Sequence
from localllm.engine.spec_decode import verify

# Enough for the top_p nucleus of almost any real next-token distribution, and still
# sorted in well under a millisecond.
NUM_CANDIDATES = 4096
_BLOCK = 1024  # tokens per block of the two-level inverse CDF in _pick


def apply_penalties(seq: Sequence, logits: np.ndarray) -> np.ndarray:
    """seq's logit bias, then its penalties, applied to logits (vocab,): a float32 copy, or
    logits itself when none is set.

    logit_bias (OpenAI) adds its value to its tokens' logits, before the penalties as llama.cpp
    and vLLM apply it (a token the grammar masked stays -inf). repetition_penalty (llama.cpp /
    HF) acts once per distinct token of prompt + output: a positive logit is divided by it, a
    negative one multiplied. frequency_penalty and presence_penalty (OpenAI) act on the output
    only: logit -= count * frequency + presence.
    """
    params = seq.params
    bias = params.bias_arrays
    use_repetition = params.repetition_penalty != 1.0
    use_frequency = bool(seq.output_token_ids) and (
        params.frequency_penalty != 0.0 or params.presence_penalty != 0.0)
    if not (bias is not None or use_repetition or use_frequency):
        return logits
    scores = np.array(logits, dtype=np.float32)  # (vocab,) a copy: logits may be read-only C memory
    if bias is not None:
        ids, values = bias  # (k,) distinct ids, (k,)
        scores[ids] += values
    if use_repetition:
        # Repeated ids need no np.unique: every copy reads the unpenalized logit and writes
        # the same value, so each distinct token is penalized exactly once.
        ids = np.array(seq.prompt_token_ids + seq.output_token_ids, dtype=np.intp)  # (len(seq),)
        seen = scores[ids]
        penalty = params.repetition_penalty
        scores[ids] = np.where(seen > 0, seen / penalty, seen * penalty)
    if use_frequency:
        ids, counts = np.unique(np.array(seq.output_token_ids, dtype=np.intp), return_counts=True)
        scores[ids] -= counts * params.frequency_penalty + params.presence_penalty
    return scores


class Sampler:
    """Picks next tokens; holds one RNG per sampling sequence until ``free``."""

    def __init__(self, num_candidates: int = NUM_CANDIDATES) -> None:
        self.num_candidates = num_candidates
        self.num_full_sorts = 0  # draws that sorted the whole vocabulary: a performance signal
        self._rngs: dict[int, np.random.Generator] = {}

    def sample(self, seq: Sequence, logits: np.ndarray) -> tuple[int, float | None]:
        """(token_id, logprob) for seq's next token, from logits (vocab,) float32, left unmodified.

        logprob is log_softmax of the raw logits at the token (the model's own, before the
        logit bias, penalties and temperature) when seq.params.logprobs is set, else None.
        """
        params = seq.params
        scores = apply_penalties(seq, logits)  # (vocab,)
        if params.is_greedy:
            token = int(np.argmax(scores))
        else:
            # In place when scores is our penalized copy: each fresh vocabulary-sized array
            # costs page faults that can outweigh the arithmetic.
            scaled = scores if params.temperature == 1.0 else np.divide(
                scores, params.temperature, out=None if scores is logits else scores,
                dtype=np.float32)  # (vocab,)
            token = self._draw(scaled, params, self._rng(seq))
        return token, (_logprob(logits, token) if params.logprobs else None)

    def verify(self, seq: Sequence, draft: list[int], rows: np.ndarray) -> tuple[list[int], int]:
        """(tokens to emit, draft tokens accepted) for seq's draft, from rows (len(draft) + 1,
        vocab): row i is the model's logits after the draft's first i tokens. Each row gives
        the token ``sample`` would (spec_decode.verify): the same argmax, or the same draw from
        seq's own RNG. seq has no penalties (the engine drafts for none), so a row's
        distribution does not depend on the drafts before it; its logit bias is the same at
        every position, and ``sample`` applies it to each row as to an undrafted step."""
        return verify(draft, lambda i: self.sample(seq, rows[i])[0])

    def free(self, seq_id: int) -> None:
        """Forget the RNG of a finished sequence."""
        self._rngs.pop(seq_id, None)

    def _rng(self, seq: Sequence) -> np.random.Generator:
        rng = self._rngs.get(seq.seq_id)
        if rng is None:
            # seed None: fresh OS entropy
            rng = self._rngs[seq.seq_id] = np.random.default_rng(seq.params.seed)
        return rng

    def _draw(self, x: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
        """One token from scaled logits x (vocab,), after top_k, then top_p, then min_p."""
        ids, weights = self._support(x, params)
        i = _pick(rng, weights)
        return i if ids is None else int(ids[i])

    def _support(self, x: np.ndarray, params: SamplingParams) -> tuple[np.ndarray | None, np.ndarray]:
        """(ids, weights): the tokens a draw from scaled logits x (vocab,) can pick, after
        top_k, then top_p, then min_p, and their weights (prob / max prob); ids None means the
        whole vocabulary in id order."""
        vocab = x.size
        top_k = params.top_k if params.top_k < vocab else 0
        if not top_k and params.top_p >= 1.0:
            # No rank cut, so no sort: draw over the whole vocabulary in id order.
            weights = _exp_shifted(x, x.max())  # (vocab,) prob / max prob
            if params.min_p <= 0.0:
                return None, weights
            ids = np.flatnonzero(weights >= params.min_p)  # (n,)
            return ids, weights[ids]

        ids = self._best_ids(x, top_k or self.num_candidates)  # (n,) best first
        if top_k:
            ids = ids[:top_k]
        top = x[ids[0]]
        weights = np.exp(x[ids] - top)  # (n,) prob / max prob, descending
        if params.top_p < 1.0:
            # The same total for candidates and full sort, so both cut at the same token.
            total = weights.sum(dtype=np.float64) if top_k else _exp_shifted(x, top).sum(dtype=np.float64)
            cumulative = np.cumsum(weights.astype(np.float64)) / total  # (n,)
            num_kept = int(np.searchsorted(cumulative, params.top_p)) + 1
            if num_kept > ids.size and not top_k and ids.size < vocab:
                ids = self._best_ids(x, vocab)  # the nucleus is wider than the candidates
                weights = np.exp(x[ids] - top)
                cumulative = np.cumsum(weights.astype(np.float64)) / total
                num_kept = int(np.searchsorted(cumulative, params.top_p)) + 1
            ids, weights = ids[:num_kept], weights[:num_kept]
        if params.min_p > 0.0:
            num_kept = int(np.count_nonzero(weights >= params.min_p))  # a prefix: weights descend
            ids, weights = ids[:num_kept], weights[:num_kept]
        return ids, weights

    def _best_ids(self, x: np.ndarray, n: int) -> np.ndarray:
        """A prefix of x's (vocab,) stable descending sort, best first with ties to the lowest id:
        its first n ids, and more when the n-th value is tied."""
        if n < x.size:
            cut = np.partition(x, x.size - n)[x.size - n]  # the n-th largest value
            ids = np.flatnonzero(x >= cut)  # (>= n,) ascending: more than n when the cut value is tied
            if ids.size < x.size:
                return ids[np.argsort(-x[ids], kind="stable")]
        self.num_full_sorts += 1
        return np.argsort(-x, kind="stable")


def _pick(rng: np.random.Generator, weights: np.ndarray) -> int:
    """An index into weights (n,), drawn with probability proportional to its weight.

    Inverse CDF in two levels, block sums and then one block, because a float64 cumsum
    over a whole vocabulary costs more than all the rest of a draw.
    """
    num_whole = weights.size - weights.size % _BLOCK
    block_sums = np.append(  # (num_blocks + 1,) the last is the partial block, maybe empty
        weights[:num_whole].reshape(-1, _BLOCK).sum(axis=1, dtype=np.float64),
        weights[num_whole:].sum(dtype=np.float64))
    block_cdf = np.cumsum(block_sums)
    u = rng.random() * block_cdf[-1]
    b = _search(block_cdf, u)  # never an empty block: its CDF step has no width
    block = weights[b * _BLOCK:(b + 1) * _BLOCK].astype(np.float64)  # (<= _BLOCK,)
    return b * _BLOCK + _search(np.cumsum(block), u - (block_cdf[b - 1] if b else 0.0))


def _search(cdf: np.ndarray, u: float) -> int:
    """The index whose CDF step holds u; u can round up to cdf[-1]: then the last with weight."""
    return min(int(np.searchsorted(cdf, u, side="right")), int(np.searchsorted(cdf, cdf[-1])))


def _exp_shifted(x: np.ndarray, top: float) -> np.ndarray:
    """exp(x - top) (vocab,) float32 in one new array; top >= max(x) keeps it from overflowing."""
    weights = np.subtract(x, top, dtype=np.float32)
    return np.exp(weights, out=weights)


def _logprob(logits: np.ndarray, token: int) -> float:
    """log_softmax(logits)[token]: exp in float32 after subtracting the max, summed in float64."""
    top = logits.max()
    log_total = np.log(_exp_shifted(logits, top).sum(dtype=np.float64))
    return float(logits[token]) - float(top) - float(log_total)


def top_logprobs(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of logits (vocab,) with their log_softmax, most likely first
    (ties: lowest id)."""
    k = min(k, logits.shape[0])
    top = logits.max()
    log_total = float(top) + float(np.log(_exp_shifted(logits, top).sum(dtype=np.float64)))
    ids = np.argpartition(-logits, k - 1)[:k]
    ids = ids[np.lexsort((ids, -logits[ids]))]
    return [(int(i), float(logits[i]) - log_total) for i in ids]
