"""Prompt-lookup speculative decoding: the n-gram proposer, the plan of each step's drafts
(what they are expected to earn against what this machine's steps cost) and the acceptance
rules. Pure Python and numpy; the engine feeds it tokens, step times and the model's rows.

One decode step with a draft, for a sequence whose tokens end in ``... a b c``::

    index.propose(k)          -> draft [d0, d1, d2]     (what followed ``a b c`` earlier)
    the model computes c, d0, d1, d2 in one pass      -> rows 0..3, row i = next after draft[:i]
    verify(draft, pick)                              -> emitted [d0, d1, y]: 2 drafts kept
    the KV of the rejected d2 is rolled back; y is the next step's input token
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from statistics import median



class NgramIndex:
    """One sequence's tokens (prompt + output) and, for each n-gram length n (every length
    from min_ngram to 4, then 6, 8, 12, 16, 24 and 32, up to max_ngram), the start of each
    n-gram's latest occurrence that has a follower.

    An n-gram is indexed only once the token after it exists, so the sequence's own current
    suffix never matches itself. Each appended token adds one entry per length and
    ``propose`` does one lookup per length: both O(1) in the length of the sequence. Entries
    are keyed by the n-gram's hash (an int, not the tuple: 12 tuples per token of a 32k-token
    prompt would take about 70 MB), and a lookup checks the tokens, so a collision costs a
    match, never a wrong one.

    >>> index = NgramIndex([1, 2, 3, 4, 1, 2, 9, 1, 2], max_ngram=3)
    >>> index.propose(2)  # the suffix 3-gram [9, 1, 2] never occurred before; [1, 2] at 4 did
    [9, 1]
    """

    def __init__(self, token_ids: Iterable[int] = (), *, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.lengths = [n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if min_ngram <= n <= max_ngram]
        if max_ngram not in self.lengths:
            self.lengths.append(max_ngram)
        self._token_ids: list[int] = []
        self._latest: dict[int, int] = {}  # hash of an n-gram -> start of its latest occurrence
        self.extend(token_ids)

    def __len__(self) -> int:
        return len(self._token_ids)

    @property
    def num_entries(self) -> int:
        """Distinct n-grams indexed: at most len(self) * len(self.lengths)."""
        return len(self._latest)

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append tokens; the n-grams ending just before each one now have a follower."""
        tokens, latest, lengths = self._token_ids, self._latest, self.lengths
        for token_id in token_ids:
            end = len(tokens)  # n-grams tokens[end - n:end] are followed by token_id
            tokens.append(int(token_id))
            for n in lengths:
                if n > end:
                    break
                latest[hash(tuple(tokens[end - n:end]))] = end - n  # later occurrences overwrite

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        n-gram that occurred before; [] when none did. Fewer than k when that occurrence is
        close to the end of the sequence."""
        tokens = self._token_ids
        if k <= 0:
            return []
        for n in reversed(self.lengths):
            if n > len(tokens):  # a shorter slice would look up a shorter n-gram
                continue
            suffix = tokens[-n:]
            start = self._latest.get(hash(tuple(suffix)))
            if start is not None and tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
        return []


class StepCost:
    """Seconds a step of n tokens takes on this runner and machine, learned from the engine's
    own steps: drafting pays only where checking k more tokens costs less than the tokens it
    saves, and that depends on the machine (on a GPU a 33-token step costs about what a
    1-token step does; on a 2-core CPU it costs 14 times as much).

    Decode steps (every sequence computing its next token, with or without drafts) are kept
    per power-of-two bucket of n, the last ``window`` of each; a bucket's point is their
    median tokens and median seconds, and a step's time is interpolated linearly between the
    points. A laptop is shared: one step that another program delayed by half moves no
    median, where it moved the average kept before (weight 0.3) by 15 %, enough to tip
    ``Drafter``'s judgement of drafts as cheap or dear, which sits near its threshold on the
    CPU (docs/benchmarks.md). A lasting change is followed once it holds a majority of the
    window. Past the largest point it is estimated optimistically, adding the
    cheapest per-token time seen in any step (prefill chunks included), so that longer drafts
    get tried, and measured.
    """

    def __init__(self, window: int = 9):
        self.window = window
        self._recent: dict[int, deque[tuple[int, float]]] = {}  # bucket -> its last (tokens, seconds)
        self._points: list[tuple[float, float]] | None = []  # the curve, None until recomputed
        self._floor: float | None = None  # the lowest seconds per token of any step seen

    @staticmethod
    def bucket(num_tokens: int) -> int:
        """0 for 1 token, 1 for 2, 2 for 3-4, 3 for 5-8, ...: ceil(log2(num_tokens))."""
        return (num_tokens - 1).bit_length()

    def record(self, num_tokens: int, seconds: float, *, decode_only: bool) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        if decode_only:
            recent = self._recent.setdefault(self.bucket(num_tokens), deque(maxlen=self.window))
            recent.append((num_tokens, seconds))
            self._points = None
        rate = seconds / num_tokens
        self._floor = rate if self._floor is None else min(self._floor, rate)

    def points(self) -> list[tuple[float, float]]:
        """The learned curve: (tokens, seconds) per bucket, by tokens."""
        if self._points is None:
            self._points = sorted((median(n for n, _ in r), median(t for _, t in r)) for r in self._recent.values())
        return self._points

    def seconds(self, num_tokens: int) -> float | None:
        """The expected time of a step of num_tokens; None before any decode step was timed."""
        points = self.points()
        if not points:
            return None
        n0, t0 = points[0]
        if num_tokens <= n0:
            return t0
        for n1, t1 in points[1:]:
            if num_tokens <= n1:
                return t0 + (t1 - t0) * (num_tokens - n0) / (n1 - n0)
            n0, t0 = n1, t1
        return t0 + (num_tokens - n0) * self._floor


class Acceptance:
    """A sequence's chance p that a proposed token is the one it would produce, from runs of
    accepted tokens and the misses that ended them (the geometric model's estimate
    accepted / (accepted + misses)), both decaying per observation so p follows the text.

    Observations come from real drafts and from *shadow* proposals: while a sequence does not
    draft, what the index would have proposed is compared with the tokens it then produces,
    which costs no model time. So drafting turns on where the text starts to repeat, and stays
    off where it does not, without paying to find out.

    >>> a = Acceptance(); a.record(30, missed=True); round(a.p, 3)
    0.947
    """

    def __init__(self, *, prior_accepted: float = 0.5, prior_missed: float = 1.0, decay: float = 0.7):
        self.accepted, self.missed, self.decay = prior_accepted, prior_missed, decay

    @property
    def p(self) -> float:
        return self.accepted / (self.accepted + self.missed)

    def record(self, num_accepted: int, *, missed: bool) -> None:
        self.accepted = self.decay * self.accepted + num_accepted
        self.missed = self.decay * self.missed + missed

    def expected_accepted(self, k: int) -> float:
        """Expected accepted tokens of a k-token draft: p + p^2 + ... + p^k."""
        p = self.p
        return k * p if p >= 1.0 else p * (1.0 - p ** k) / (1.0 - p)


# Draft lengths a plan considers (and the proposal's own length): step costs change by bucket.
_DRAFT_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192)


@dataclass
class _SeqDrafts:
    index: NgramIndex
    acceptance: Acceptance = field(default_factory=Acceptance)
    shadow: list[int] = field(default_factory=list)  # a proposal not drafted, checked as tokens come
    num_shadow_matched: int = 0
    streak: int = 0  # proposed tokens that came true in a row, up to now (shadow or drafted)


class Drafter:
    """Prompt-lookup drafting for the engine: one NgramIndex and Acceptance per sequence, one
    StepCost for the machine, and the plan of each step's drafts.

    ``plan`` gives each candidate sequence the draft length that maximizes the step's expected
    tokens per second, in order of acceptance, while that beats the step without it by
    ``margin``; sequences given no draft get a shadow proposal instead. A sequence drafts only
    while its last ``min_streak`` proposed tokens came true: copied text comes in runs (a
    quoted sentence, the unchanged lines of a file), and the token after a miss is seldom the
    start of the next one. ``force`` sequences (a request's ``speculative: true``) draft
    whatever the index proposes, up to ``k_force``.

    The n-grams are long (up to 12 tokens): code repeats short sequences everywhere, and the
    longest match is the one that finds the place being copied.

    Where checking drafts is cheap (a step of 2 tokens costs under ``cheap_ratio`` times a
    step of 1: a GPU, or the torch runner's batched CPU kernels), one right proposal is
    streak enough and a draft need only break even: a wasted draft costs little there. On
    llama.cpp's CPU kernels (2.2-2.4x) the stricter rule holds.
    """

    def __init__(self, *, k_max: int = 128, k_force: int = 16, k_shadow: int = 32, margin: float = 0.05,
                 min_streak: int = 2, max_ngram: int = 12, cheap_ratio: float = 1.5):
        self.k_max, self.k_force, self.k_shadow, self.margin = k_max, k_force, k_shadow, margin
        self.min_streak = min_streak
        self.cheap_ratio = cheap_ratio
        self.max_ngram = max_ngram
        self.cost = StepCost()
        self._seqs: dict[int, _SeqDrafts] = {}

    def _state(self, seq_id: int, token_ids: list[int]) -> _SeqDrafts:
        state = self._seqs.get(seq_id)
        if state is None:
            state = self._seqs[seq_id] = _SeqDrafts(NgramIndex(token_ids, max_ngram=self.max_ngram))
        elif len(state.index) < len(token_ids):
            state.index.extend(token_ids[len(state.index):])
        return state

    def acceptance(self, seq_id: int) -> Acceptance | None:
        state = self._seqs.get(seq_id)
        return state.acceptance if state is not None else None

    def plan(self, candidates: list[tuple[int, list[int], int, bool]], num_tokens: int,
             num_outputs: int, budget: int) -> dict[int, list[int]]:
        """Drafts for this step: {seq id: draft tokens}.

        candidates: (seq id, its token ids, most draft tokens it may take, forced) for each
        sequence that decodes this step and may draft; num_tokens and num_outputs: the step's
        tokens and the tokens it yields so far; budget: tokens the step may still take.
        """
        drafts: dict[int, list[int]] = {}
        states = [(self._state(seq_id, token_ids), seq_id, room, force)
                  for seq_id, token_ids, room, force in candidates]
        states.sort(key=lambda c: (not c[3], -c[0].acceptance.p))
        base = self.cost.seconds(num_tokens)
        expected = float(num_outputs)
        min_streak, margin = (1, 0.0) if self.verifying_is_cheap() else (self.min_streak, self.margin)
        for state, seq_id, room, force in states:
            room = min(room, budget, self.k_force if force else self.k_max)
            proposal = state.index.propose(room) if room > 0 else []
            if force:
                k = len(proposal)
            elif state.streak < min_streak:
                k = 0
            else:
                k = self._best_length(state.acceptance, len(proposal), num_tokens, expected, base, margin)
            if k:
                drafts[seq_id] = proposal[:k]
                if state.shadow:  # the run it saw so far, not yet recorded
                    state.acceptance.record(state.num_shadow_matched, missed=False)
                    state.shadow = []
                num_tokens += k
                budget -= k
                expected += state.acceptance.expected_accepted(k)
                base = self.cost.seconds(num_tokens)
            elif not state.shadow:
                state.shadow = state.index.propose(self.k_shadow)
                state.num_shadow_matched = 0
        return drafts

    def verifying_is_cheap(self) -> bool:
        one, two = self.cost.seconds(1), self.cost.seconds(2)
        return one is not None and two is not None and two < self.cheap_ratio * one

    def _best_length(self, acceptance: Acceptance, most: int, num_tokens: int, expected: float,
                     base: float | None, margin: float) -> int:
        if most == 0 or base is None:
            return 0
        best_k, best_rate = 0, expected / base * (1.0 + margin)
        for k in sorted({k for k in _DRAFT_LENGTHS if k < most} | {most}):
            seconds = self.cost.seconds(num_tokens + k)
            if seconds is None:
                break
            rate = (expected + acceptance.expected_accepted(k)) / seconds
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def on_tokens(self, seq_id: int, token_ids: list[int]) -> None:
        """Tokens a sequence just produced: they are checked against its shadow proposal."""
        state = self._seqs.get(seq_id)
        if state is None:
            return
        if not state.shadow:
            state.streak = 0  # nothing was proposed: no evidence of a run
            return
        for token_id in token_ids:
            if token_id != state.shadow[state.num_shadow_matched]:
                state.acceptance.record(state.num_shadow_matched, missed=True)
                state.shadow = []
                state.streak = 0
                return
            state.num_shadow_matched += 1
            state.streak += 1
            if state.num_shadow_matched == len(state.shadow):
                state.acceptance.record(state.num_shadow_matched, missed=False)
                state.shadow = []
                return

    def on_verified(self, seq_id: int, num_proposed: int, num_accepted: int) -> None:
        state = self._seqs[seq_id]
        missed = num_accepted < num_proposed
        state.acceptance.record(num_accepted, missed=missed)
        state.streak = 0 if missed else state.streak + num_accepted

    def forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)


def verify(draft: Sequence[int], pick: Callable[[int], int]) -> tuple[list[int], int]:
    """(tokens to emit, draft tokens accepted) for one sequence's draft.

    pick(i) is the token the sequence takes from the model's row i (its next token after the
    prefix and draft[:i]): the argmax for a greedy request, a draw from its own RNG for a
    sampling one. Rows are picked in order, and only until a pick differs from the draft (or
    every draft was kept, and the last row gives one more token).

    Every emitted token is exactly the token plain decoding would have taken from that row,
    with the same draw from the same RNG: a draft only decides how many rows one step can
    use. So the output is the model's distribution, and a seed gives the same tokens with
    drafting on or off. For a sampling request a draft x is kept with probability p(x), as
    in speculative sampling (Leviathan et al. 2023) with a one-hot draft, of which this is
    the coupling that keeps each draft most often.

    >>> verify([5, 6, 7], [5, 6, 9, 2].__getitem__)
    ([5, 6, 9], 2)
    """
    emitted = []
    for i in range(len(draft) + 1):
        token = int(pick(i))
        emitted.append(token)
        if i == len(draft) or token != draft[i]:
            return emitted, i
    raise AssertionError("unreachable: the last row always returns")
