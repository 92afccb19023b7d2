"""The interface every runner implements: run a step's batch, keep KV in step with the BlockManager."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from localllm.engine.block_manager import KVListener
from localllm.engine.scheduler import SchedulerOutput
from localllm.tokenizer import Vocab


class Constraint(Protocol):
    """A grammar's state for one sequence: which next tokens it allows."""

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A float32 copy of logits (vocab,) with every token the grammar forbids at -inf;
        logits may be read-only (a view into the runner's memory)."""

    def accept(self, token_id: int) -> None:
        """Advance the grammar past a token that ``apply`` allowed."""

    def free(self) -> None:
        """Release the grammar; the sequence has ended."""


class ModelRunner(KVListener, Protocol):
    name: str
    vocab: Vocab
    n_ctx: int  # KV cells the runner holds: the BlockManager gets n_ctx // block_size blocks
    fingerprint: bytes  # names the model, runner and KV layout in chain hashes

    def execute(self, out: SchedulerOutput) -> np.ndarray:
        """Compute the scheduled tokens; return (n, vocab) logits, one row for each scheduled
        sequence whose ``needs_logits`` is true, in schedule order. The rows may be a view
        into the runner's memory, valid until the next call."""

    def make_constraint(self, gbnf: str) -> Constraint:
        """A fresh grammar constraint; a grammar that cannot be parsed raises UsageError."""

    def seq_pos_range(self, seq_id: int) -> tuple[int, int] | None:
        """The (min, max) positions the storage holds for an active sequence, or None."""

    def reset(self) -> None:
        """Forget every sequence and empty the KV storage, as just loaded (LLMEngine.reset,
        after every request has ended)."""

    def close(self) -> None: ...
