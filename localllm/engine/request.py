"""A request's sampling parameters and its Sequence: the state of one generation stream."""

from __future__ import annotations

import enum
import itertools
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from localllm.errors import ParameterError


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV is recomputed on readmission
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, or the context is full
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the request could not be served


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. Validated once here; a bad value raises ParameterError (a
    UsageError that names the parameter)."""

    max_tokens: int = 256
    temperature: float = 0.8
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1.0: off (llama.cpp / HF style, over prompt + output)
    frequency_penalty: float = 0.0  # OpenAI style, over the output only
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: also the k most likely tokens at each step
    # The grammar every output must match: Lark or GBNF text, or llguidance's JSON form (what
    # engine/constraint.py's functions build); compiled when the request is added.
    grammar: str | None = None
    # Prompt-lookup drafting: None follows the engine (drafts where it pays), True drafts at
    # every step where the prompt offers a match, False never.
    speculative: bool | None = None
    # OpenAI's logit_bias: token id -> a value in [-100, 100] added to that token's logit
    # before sampling (-100 in effect bans it, +100 in effect forces it). Given as a mapping
    # whose keys are ids or, as JSON has them, ids in decimal text ({"1234": -100}); kept as
    # (id, bias) pairs in id order.
    logit_bias: Mapping[int | str, float] | tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        def bad(name: str, value: object, want: str) -> ParameterError:
            return ParameterError(name, f"{name}={value!r} is invalid: {want}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "use a whole number of 1 or more")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, value, "use a finite number")
        if self.temperature < 0:
            raise bad("temperature", self.temperature, "use 0 (greedy) or more")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "use a number in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "use a number in [0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "use 0 (off) or a positive whole number")
        if not 1e-3 <= self.repetition_penalty <= 1e3:  # float32 logits divided by less overflow
            raise bad("repetition_penalty", self.repetition_penalty, "use a number in [0.001, 1000]")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, getattr(self, name), "use a number in [-2, 2]")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= 20:
            raise bad("top_logprobs", self.top_logprobs, "use a whole number in [0, 20]")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise bad("seed", self.seed, "use a whole number of 0 or more")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "stop strings must be non-empty text")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise bad("grammar", self.grammar, "give a grammar (Lark or GBNF text, or llguidance's JSON form), or leave it out")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))

    def check_vocab(self, n_vocab: int) -> None:
        """Raise ParameterError when logit_bias names a token outside a vocabulary of n_vocab."""
        for token_id, _ in self.logit_bias:
            if token_id >= n_vocab:
                raise ParameterError("logit_bias", f"logit_bias names token id {token_id}, outside the "
                                                   f"vocabulary of {n_vocab} (ids 0..{n_vocab - 1})")

    @cached_property
    def bias_arrays(self) -> tuple[np.ndarray, np.ndarray] | None:
        """logit_bias as (ids (k,) intp, values (k,) float32) for the sampler; None when empty."""
        if not self.logit_bias:
            return None
        ids, values = zip(*self.logit_bias)
        return np.array(ids, dtype=np.intp), np.array(values, dtype=np.float32)

    @property
    def is_greedy(self) -> bool:
        # Below GREEDY_BELOW all the probability is on the top token anyway, and float32
        # logits divided by such a temperature overflow to inf (then NaN).
        return self.temperature < GREEDY_BELOW


GREEDY_BELOW = 1e-6
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value, either way


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, value) pairs in id order, every key and value checked."""
    if isinstance(bias, tuple):
        items = bias
    elif isinstance(bias, Mapping):
        items = tuple(bias.items())
    else:
        raise ParameterError("logit_bias", f"logit_bias={bias!r} is invalid: give an object of token ids "
                                           'to values in [-100, 100], such as {"1234": -100}')
    pairs = {}
    for key, value in items:
        if isinstance(key, str) and key.isascii() and key.isdigit():
            token_id = int(key)
        elif isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            token_id = key
        else:
            raise ParameterError("logit_bias", f"logit_bias key {key!r} is not a token id: the keys are token "
                                               'ids in decimal, such as "1234" (see POST /tokenize)')
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise ParameterError("logit_bias", f"logit_bias value {value!r} for token {token_id} is invalid: "
                                               "use a number in [-100, 100]")
        pairs[token_id] = float(value)
    return tuple(sorted(pairs.items()))


_seq_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One generation stream: prompt tokens, output tokens and where its KV stands.

    ``num_computed_tokens`` tokens have KV in the cache (``num_cached_tokens`` of them came
    from the prefix cache instead of being computed, ``num_disk_tokens`` of those from the
    on-disk prefix store). ``block_table`` lists the KV blocks
    holding positions 0, block_size, 2*block_size, ... in order.
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_disk_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)  # this step's guesses, checked by the model
    num_draft_proposed: int = 0
    num_draft_accepted: int = 0
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = f"seq-{self.seq_id}"

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """True while the step would not yet produce a new token for this sequence."""
        return self.num_computed_tokens < len(self) - 1
