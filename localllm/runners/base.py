"""The interface every runner implements: run a step's batch, keep KV in step with the BlockManager."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from localllm.engine.block_manager import KVListener
from localllm.engine.scheduler import SchedulerOutput
from localllm.tokenizer import Vocab


class ModelRunner(KVListener, Protocol):
    name: str
    vocab: Vocab
    n_ctx: int  # KV cells the runner holds: the BlockManager gets n_ctx // block_size blocks
    fingerprint: bytes  # names the model, runner and KV layout in chain hashes
    chosen_because: str | None  # why --runner auto chose this runner; None where it was named

    def execute(self, out: SchedulerOutput) -> np.ndarray:
        """Compute the scheduled tokens; return (n, vocab) logits, one row for each scheduled
        sequence whose ``needs_logits`` is true, in schedule order. The rows may be a view
        into the runner's memory, valid until the next call."""

    def seq_pos_range(self, seq_id: int) -> tuple[int, int] | None:
        """The (min, max) positions the storage holds for an active sequence, or None."""

    def reset(self) -> None:
        """Forget every sequence and empty the KV storage, as just loaded (LLMEngine.reset,
        after every request has ended)."""

    def close(self) -> None: ...
