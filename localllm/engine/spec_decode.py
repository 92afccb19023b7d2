"""Prompt-lookup speculative decoding: the n-gram proposer, the adaptive draft length and the
acceptance rules. Pure Python and numpy; the engine feeds it tokens and the model's rows.

One decode step with a draft, for a sequence whose tokens end in ``... a b c``::

    index.propose(k)          -> draft [d0, d1, d2]     (what followed ``a b c`` earlier)
    the model computes c, d0, d1, d2 in one pass      -> rows 0..3, row i = next after draft[:i]
    verify_greedy / verify_sampled                    -> emitted [d0, d1, y]: 2 drafts kept
    the KV of the rejected d2 is rolled back; y is the next step's input token
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence

import numpy as np


class NgramIndex:
    """One sequence's tokens (prompt + output) and, for each n-gram of length min_ngram to
    max_ngram, the start of its latest occurrence that has a follower.

    An n-gram is indexed only once the token after it exists, so the sequence's own current
    suffix never matches itself. Each appended token adds (max_ngram - min_ngram + 1) entries
    and ``propose`` does as many lookups: both O(1) in the length of the sequence.

    >>> index = NgramIndex([1, 2, 3, 4, 1, 2, 9, 1, 2], max_ngram=3)
    >>> index.propose(2)  # the suffix 3-gram [9, 1, 2] never occurred before; [1, 2] at 4 did
    [9, 1]
    """

    def __init__(self, token_ids: Iterable[int] = (), *, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._token_ids: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram -> start of its latest occurrence
        self.extend(token_ids)

    def __len__(self) -> int:
        return len(self._token_ids)

    @property
    def num_entries(self) -> int:
        """Distinct n-grams indexed: at most len(self) * (max_ngram - min_ngram + 1)."""
        return len(self._latest)

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append tokens; the n-grams ending just before each one now have a follower."""
        tokens, latest = self._token_ids, self._latest
        for token_id in token_ids:
            end = len(tokens)  # n-grams tokens[end - n:end] are followed by token_id
            tokens.append(int(token_id))
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                latest[tuple(tokens[end - n:end])] = end - n  # later occurrences overwrite

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        n-gram that occurred before (n from max_ngram down to min_ngram); [] when none did.
        Fewer than k when that occurrence is close to the end of the sequence."""
        tokens = self._token_ids
        if k <= 0:
            return []
        # n <= len(tokens): a shorter slice would look up a shorter n-gram under the wrong n
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            start = self._latest.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n:start + n + k]
        return []


class AdaptiveDraftLength:
    """One request's draft length k, following its acceptance, and its off switch.

    Call ``next_k()`` once per decode step (0: do not draft this step) and, after a draft
    was verified, ``record(num_proposed, num_accepted)``. The rule, per recorded draft:

    - ``ema += alpha * (num_accepted / num_proposed - ema)``; then k grows by one (up to
      k_max) when ema >= grow_at, shrinks by one (down to k_min) when ema < shrink_at.
    - The last ``window`` drafts are kept. Once there are that many, if they accepted less
      than ``off_below`` of the tokens they proposed, drafting switches off: ``next_k()``
      returns 0 for ``backoff`` steps, then drafting probes again with a fresh window; each
      switch-off doubles the next back-off (up to max_backoff), a passing window resets it.

    Worked example, defaults (k 4, ema 0.5, alpha 0.5, grow_at 0.75, shrink_at 0.4)::

        record(4, 4)  rate 1.0   ema 0.75    k 4 -> 5
        record(5, 5)  rate 1.0   ema 0.875   k 5 -> 6
        record(6, 1)  rate 0.17  ema 0.521   k 6
        record(6, 0)  rate 0.0   ema 0.260   k 6 -> 5

    and with window 3, off_below 0.3, backoff 2: after record(4, 0), record(4, 1),
    record(3, 0) the window accepted 1 of 11 tokens (0.09 < 0.3), so the next two
    ``next_k()`` return 0, the third returns k again (a probe); should the next three
    drafts fail as well, drafting stays off for 4 steps.
    """

    def __init__(self, *, k_init: int = 4, k_min: int = 1, k_max: int = 8, alpha: float = 0.5,
                 grow_at: float = 0.75, shrink_at: float = 0.4, window: int = 8,
                 off_below: float = 0.3, backoff: int = 16, max_backoff: int = 256):
        if not 1 <= k_min <= k_init <= k_max:
            raise ValueError(f"need 1 <= k_min <= k_init <= k_max, got {k_min}, {k_init}, {k_max}")
        self.k, self.k_min, self.k_max = k_init, k_min, k_max
        self.alpha, self.grow_at, self.shrink_at = alpha, grow_at, shrink_at
        self.ema = 0.5  # neutral start: the first draft alone decides the first move
        self.off_below, self.base_backoff, self.max_backoff = off_below, backoff, max_backoff
        self._backoff = backoff
        self._window: deque[tuple[int, int]] = deque(maxlen=window)  # (proposed, accepted)
        self.num_off_steps_left = 0
        self.num_proposed = 0  # draft tokens verified
        self.num_accepted = 0  # of them, accepted
        self.num_draft_steps = 0  # steps that verified a draft

    @property
    def is_off(self) -> bool:
        return self.num_off_steps_left > 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted / self.num_proposed if self.num_proposed else None

    def next_k(self) -> int:
        """The draft length for this step; 0 while switched off (each call spends one step)."""
        if self.num_off_steps_left:
            self.num_off_steps_left -= 1
            return 0
        return self.k

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"accepted {num_accepted} of {num_proposed} proposed draft tokens")
        if num_proposed == 0:
            return  # nothing was verified: no evidence either way
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        self.num_draft_steps += 1
        self.ema += self.alpha * (num_accepted / num_proposed - self.ema)
        if self.ema >= self.grow_at:
            self.k = min(self.k + 1, self.k_max)
        elif self.ema < self.shrink_at:
            self.k = max(self.k - 1, self.k_min)
        self._window.append((num_proposed, num_accepted))
        if len(self._window) < self._window.maxlen:
            return
        proposed = sum(p for p, _ in self._window)
        if sum(a for _, a in self._window) < self.off_below * proposed:
            self.num_off_steps_left = self._backoff
            self._backoff = min(2 * self._backoff, self.max_backoff)
            self._window.clear()
        else:
            self._backoff = self.base_backoff


def verify_greedy(draft: Sequence[int], target_argmax: Sequence[int]) -> tuple[int, int]:
    """(number of draft tokens accepted, the next token) for a greedy request.

    target_argmax has len(draft) + 1 entries: entry i is the model's token after the prefix
    and draft[:i]. The drafts are kept while they equal the model's own tokens; the next token
    is the model's at the first mismatch, or after the last draft when all were kept.

    >>> verify_greedy([5, 6, 7], [5, 6, 9, 2])
    (2, 9)
    """
    if len(target_argmax) != len(draft) + 1:
        raise ValueError(f"{len(draft)} draft tokens need {len(draft) + 1} target tokens, "
                         f"got {len(target_argmax)}")
    n = 0
    while n < len(draft) and int(draft[n]) == int(target_argmax[n]):
        n += 1
    return n, int(target_argmax[n])


def verify_sampled(draft: Sequence[int], target_probs: np.ndarray,
                   rng: np.random.Generator) -> tuple[list[int], int]:
    """(emitted tokens, number of draft tokens accepted) for a sampling request.

    target_probs (len(draft) + 1, vocab): row i is the model's final sampling distribution
    (after penalties, temperature, top-k/p, min-p) after the prefix and draft[:i]. This is
    speculative sampling (Leviathan et al. 2023, Chen et al. 2023) with a one-hot draft
    distribution q_i = [x_i]: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)) =
    p_i(x_i); on the first rejection draw from normalize(max(p_i - q_i, 0)), which is p_i
    with x_i zeroed, and stop; when all are accepted draw one more token from the last row.

    Why the output is distributed as p: at a position with draft x, for y != x,
    P(emit y) = (1 - p(x)) * p(y) / (1 - p(x)) = p(y), and P(emit x) = p(x). Example:
    p = (0.5, 0.3, 0.2), draft 1: token 1 comes out with 0.3; else (0.7) the residual
    (0.5, 0, 0.2) / 0.7 gives 0 with 0.7 * 5/7 = 0.5 and 2 with 0.7 * 2/7 = 0.2. The next
    position is reached only when x was emitted, and its row is conditioned on x, so the
    first two tokens come out as p1(x) * p2(y | x), and so on by induction.
    """
    target_probs = np.asarray(target_probs)
    if target_probs.ndim != 2 or target_probs.shape[0] != len(draft) + 1:
        raise ValueError(f"{len(draft)} draft tokens need {len(draft) + 1} rows of "
                         f"probabilities, got shape {target_probs.shape}")
    emitted: list[int] = []
    for i, x in enumerate(draft):
        p = target_probs[i].astype(np.float64)  # (vocab,) a copy: x is zeroed on rejection
        total = p.sum()
        if rng.random() * total >= p[x]:
            p[x] = 0.0
            if p.sum() > 0.0:  # else p was one-hot on x up to rounding: x stands
                return emitted + [_draw(rng, p)], i
        emitted.append(int(x))
    return emitted + [_draw(rng, target_probs[-1].astype(np.float64))], len(draft)


def _draw(rng: np.random.Generator, weights: np.ndarray) -> int:
    """An index into weights (vocab,) float64, drawn with probability proportional to it."""
    cdf = np.cumsum(weights)  # (vocab,)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    # u can round up to cdf[-1]: then the last token that has weight
    return min(i, int(np.searchsorted(cdf, cdf[-1])))


def num_to_emit(token_ids: Sequence[int], is_stop: Callable[[int], bool], max_num: int) -> int:
    """How many of one step's emitted tokens the sequence takes: up to and including the
    first for which is_stop holds (EOS or a stop token id, kept as a plain step keeps it),
    and at most max_num (the tokens left before max_tokens or a full context).

    >>> num_to_emit([4, 2, 0, 7], lambda t: t == 0, max_num=10)
    3
    """
    for i, token_id in enumerate(token_ids[:max(max_num, 0)]):
        if is_stop(token_id):
            return i + 1
    return min(len(token_ids), max(max_num, 0))
