"""Figures of one request and of the engine, as plain data."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from localllm.engine.request import Sequence


@dataclass(frozen=True)
class RequestMetrics:
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens whose KV came from the prefix cache (memory or disk)
    num_generated_tokens: int
    num_preemptions: int
    finish_reason: str | None
    ttft: float | None  # seconds from arrival to the first output token
    tpot: float | None  # mean seconds per output token after the first
    e2e: float | None  # seconds from arrival to finish
    num_draft_proposed: int = 0
    num_draft_accepted: int = 0
    num_disk_cached_tokens: int = 0  # of num_cached_tokens, those loaded from the on-disk cache

    @property
    def prefill_tokens_per_s(self) -> float | None:
        computed = self.num_prompt_tokens - self.num_cached_tokens
        return computed / self.ttft if self.ttft else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        return 1.0 / self.tpot if self.tpot else None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, seq: Sequence) -> RequestMetrics:
        ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time else None
        tpot = None
        if seq.finish_time and seq.first_token_time and seq.num_output_tokens > 1:
            tpot = (seq.finish_time - seq.first_token_time) / (seq.num_output_tokens - 1)
        return cls(
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_generated_tokens=seq.num_output_tokens,
            num_preemptions=seq.num_preemptions,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            ttft=ttft,
            tpot=tpot,
            e2e=seq.finish_time - seq.arrival_time if seq.finish_time else None,
            num_draft_proposed=seq.num_draft_proposed,
            num_draft_accepted=seq.num_draft_accepted,
            num_disk_cached_tokens=seq.num_disk_tokens,
        )


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_blocks_used: int
    num_blocks_total: int
    num_blocks_cached: int
    num_preemptions: int
    num_steps: int
    num_prompt_tokens_computed: int
    num_tokens_generated: int
    num_draft_proposed: int = 0  # speculative draft tokens checked, and of those accepted
    num_draft_accepted: int = 0
    num_disk_cached_tokens: int = 0  # prompt tokens loaded from the on-disk prefix cache
    # Sequences the runner holds KV storage for (llama.cpp's active slots); a runner that keeps
    # no per-sequence state reports 0. With no request left it must be 0, or storage leaked.
    num_runner_seqs: int = 0
    # CPU threads steps run on now (engine/threads.py), for decode and for prefill; the most the
    # engine may use; whether it adapts them to the machine's load (not --threads N). All 0 /
    # False where the CPU does not compute the steps (a GPU).
    threads_decode: int = 0
    threads_prefill: int = 0
    threads_max: int = 0
    threads_adaptive: bool = False

    @property
    def kv_usage(self) -> float:
        return self.num_blocks_used / self.num_blocks_total if self.num_blocks_total else 0.0

    def to_dict(self) -> dict:
        return asdict(self)
