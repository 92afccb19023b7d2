"""Continuous batching: which sequences compute how many tokens in the next step."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from localllm.config import SchedulerConfig
from localllm.engine.block_manager import BlockManager
from localllm.engine.request import Sequence, SequenceStatus
from localllm.errors import ContextOverflowError


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # computed this step, from position seq.num_computed_tokens on
    num_draft_tokens: int = 0  # of those, guesses after the last known token (seq.draft_token_ids)

    @property
    def needs_logits(self) -> bool:
        """The step computes the sequence's last known token, so it yields a new one."""
        return self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq) + self.num_draft_tokens

    @property
    def num_logits(self) -> int:
        """Rows of logits this sequence gets: its last known token's, then one per draft."""
        return 1 + self.num_draft_tokens if self.needs_logits else 0


@dataclass
class SchedulerOutput:
    """The whole decision of one step, as plain data for the runner."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Every step fills a token budget: first one decode token for each running sequence,
    then prefill chunks (running ones first, then waiting ones in arrival order), so a long
    prompt is cut into chunks and never stalls the streams that are decoding.

    When blocks run out the newest running sequence is preempted: its blocks are given
    back (full ones stay cached) and it is recomputed later from the waiting queue.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 proposer: Callable[[list[tuple[Sequence, int]], int, int, int], dict[int, list[int]]] | None = None):
        self.config = config
        # (decoding sequences with their most draft tokens, the step's tokens, its outputs,
        # the budget left) -> {seq id: draft tokens}
        self.proposer = proposer
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if len(seq) >= self.max_model_len:
            raise ContextOverflowError(
                f"the prompt has {len(seq)} tokens and the context holds {self.max_model_len}; "
                f"shorten the prompt or raise --ctx above {len(seq)}"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Decoding sequences first (one token each), then those still prefilling.
        queue = sorted(self.running, key=lambda s: s.is_prefilling)
        scheduled_ids: set[int] = set()
        for seq in queue:
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            num_new = min(len(seq) - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate(seq, num_new):
                victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled_ids), None)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                scheduled_ids.add(seq.seq_id)
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new

        # After a preemption, blocks are short: admit no one new this step (the preempted
        # sequence would otherwise come straight back and thrash).
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            num_new = self.block_manager.allocate(seq, budget)
            if num_new == 0:
                break  # first come, first served: the next ones wait behind it
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        if self.proposer is not None and budget > 0 and not out.preempted:
            self._add_drafts(out, budget)
        return out

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Give decoding sequences draft tokens from what the step's budget has left once every
        decode token and prefill chunk has its place, within each one's context and
        max_tokens. A draft that would need blocks the pool lacks is dropped, never preempts."""
        decoding = [s for s in out.scheduled if s.num_new_tokens == 1 and s.needs_logits]
        rooms = [(s.seq, min(self.max_model_len - len(s.seq) - 1,
                             s.seq.params.max_tokens - s.seq.num_output_tokens - 1)) for s in decoding]
        num_tokens = sum(s.num_new_tokens for s in out.scheduled)
        num_outputs = sum(1 for s in out.scheduled if s.needs_logits)
        drafts = self.proposer([(seq, room) for seq, room in rooms if room > 0], num_tokens, num_outputs, budget)
        for sched in decoding:
            draft = drafts.get(sched.seq.seq_id)
            if draft and self.block_manager.allocate(sched.seq, 1 + len(draft)):
                sched.seq.draft_token_ids = draft
                sched.num_new_tokens, sched.num_draft_tokens = 1 + len(draft), len(draft)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted) sequence and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
