"""Frozen configuration, built once at the edge (CLI, server start-up) and passed down."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from localllm.errors import UsageError

MIN_CTX = 128
RUNNERS = ("auto", "torch", "llamacpp")
KV_DTYPES = ("f16", "q8_0", "f32")
PREFIX_CACHE_SIZE = 2 * 1024**3  # bytes the on-disk prefix cache may take
PREFIX_CACHE_MIN_TOKENS = 256  # a prompt is stored once it has this many tokens not yet stored


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    ``block_size`` tokens form a block; ``num_blocks`` is derived from the context size so
    that the BlockManager's count of blocks is exactly the runner's KV capacity.
    """

    block_size: int = 16
    # Context (KV cells, all sequences together) the runner allocates; num_blocks = n_ctx //
    # block_size. None: sized to the machine when the model loads (localllm/memory.py).
    n_ctx: int | None = None
    # What K and V are stored as: "f16" (llama.cpp's default, with its flash attention);
    # "q8_0": 8-bit, about half the bytes per token (llama.cpp: its Q8_0 blocks of 32 values
    # with flash attention; the torch runner: int8 with a scale per token and head); or
    # "f32" (flash attention off: the exact reference the runners are compared in).
    kv_dtype: str = "f16"

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise UsageError(f"KV dtype {self.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise UsageError(f"block size {self.block_size} is not a power of two; use 16 or 32")
        if self.n_ctx is not None and self.n_ctx < MIN_CTX:
            raise UsageError(f"context {self.n_ctx} is too small; use --ctx {MIN_CTX} or more")

    @property
    def num_blocks(self) -> int:
        if self.n_ctx is None:
            raise ValueError("the context is not sized yet; localllm.memory.plan_for sizes it")
        return self.n_ctx // self.block_size


# The step token budget where the runner names none: 256 measured best for llama.cpp on the
# CPU (docs/benchmarks.md, chunked prefill).
DEFAULT_BATCH_TOKENS = 256


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching.

    ``max_num_batched_tokens`` is the per-step token budget: the TTFT / TPOT trade-off.
    A larger budget prefills a long prompt in fewer, longer steps (lower TTFT for it); a
    smaller one keeps each step short, so streams that are decoding meanwhile see smaller
    gaps between tokens (lower TPOT for them). None: the runner's own default
    (``default_batch_tokens``: DEFAULT_BATCH_TOKENS on the CPU, more on a GPU, where a long
    step costs little more than a short one), set by the engine once the runner is loaded.
    """

    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise UsageError(f"--parallel {self.max_num_seqs} must be at least 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise UsageError(
                f"step token budget {self.max_num_batched_tokens} is below the number of "
                f"parallel sequences {self.max_num_seqs}; raise --batch-tokens"
            )


def physical_cores() -> int:
    """Physical cores available to this process (hyper-threads do not speed up decode)."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # macOS
        return max(1, (os.cpu_count() or 2) // 2)
    cores = set()
    for cpu in cpus:
        try:
            topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
            cores.add(((topo / "physical_package_id").read_text().strip(),
                       (topo / "core_id").read_text().strip()))
        except OSError:
            cores.add(("0", str(cpu)))
    return max(1, len(cores))


@dataclass(frozen=True)
class EngineConfig:
    model_path: Path
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    n_threads: int = 0  # 0: physical cores
    n_gpu_layers: int = -1  # -1: every layer that the GPU backend takes; 0: CPU only
    runner: str = "auto"  # "auto" | "torch" | "llamacpp" (see engine.load_runner)
    speculative: bool = True  # prompt-lookup drafting where it pays (see engine/spec_decode.py)
    # The on-disk prefix cache (engine/prefix_store.py): None or a size of 0 turns it off.
    # The CLI passes paths.prefix_cache_dir(); a bare EngineConfig keeps nothing on disk.
    prefix_cache_dir: Path | None = None
    prefix_cache_size: int = PREFIX_CACHE_SIZE
    prefix_cache_min_tokens: int = PREFIX_CACHE_MIN_TOKENS
    # The torch runner's converted weights (runners/torch/weight_cache.py); None: not kept.
    weights_cache_dir: Path | None = None
    # Bytes the weights and KV cache may take (--memory); None: what the machine has free.
    memory_limit: int | None = None

    def __post_init__(self) -> None:
        if self.runner not in RUNNERS:
            raise UsageError(f"--runner {self.runner!r} is not a runner; use one of {', '.join(RUNNERS)}")
        if self.prefix_cache_size < 0:
            raise UsageError(f"--prefix-cache-size {self.prefix_cache_size} must be 0 (off) or more")
        if self.prefix_cache_min_tokens < 1:
            raise UsageError(f"prefix_cache_min_tokens {self.prefix_cache_min_tokens} must be 1 or more")
        if self.n_threads < 0:
            raise UsageError(f"--threads {self.n_threads} must be 0 (auto) or more")
        if self.memory_limit is not None and self.memory_limit <= 0:
            raise UsageError(f"--memory {self.memory_limit} must be more than 0; leave it out to use what is free")
        budget = self.scheduler.max_num_batched_tokens
        if self.cache.n_ctx is not None and budget is not None and budget > self.cache.n_ctx:
            raise UsageError(
                f"step token budget {self.scheduler.max_num_batched_tokens} exceeds the "
                f"context {self.cache.n_ctx}; lower --batch-tokens"
            )

    @property
    def threads(self) -> int:
        return self.n_threads or physical_cores()


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_queue: int = 64  # requests waiting for a sequence slot before new ones get a 503
    max_body_bytes: int = 8 * 1024 * 1024
    # Seconds a client has to send a request's headers, and then its whole body: a client
    # that stalls or trickles is cut off (uvicorn itself waits for either forever).
    read_timeout_s: float = 30.0
    embedding_model: Path | None = None  # a GGUF embedding model served at /v1/embeddings

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise UsageError(f"--port {self.port} is not a TCP port; use 1-65535 (0 picks a free one)")
        if self.api_key is not None and not self.api_key.strip():
            raise UsageError("--api-key is empty; give a key or leave the option out")
        if not (math.isfinite(self.read_timeout_s) and self.read_timeout_s > 0):
            raise UsageError(f"--read-timeout {self.read_timeout_s} is not a time; give seconds above 0, e.g. 30")
