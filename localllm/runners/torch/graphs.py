"""DecodeGraphs: the torch runner's decode steps held in static tensors and, on CUDA,
replayed as CUDA graphs.

On a GPU a small model's decode step is a thousand tiny kernels, and launching them from
Python costs more than running them (docs/benchmarks.md: ~25 us a matmul at one row on an
H200, 39.5 tokens/s for one stream). A decode step (each sequence one new token) of up to
``max_seqs`` sequences is therefore captured once per batch-size bucket and replayed: every
input the step reads — token ids, positions, the slots its new K/V go to, the block tables
and context lengths that attention reads the pool through — lives in a static tensor that is
updated in place before each replay, and the logits come back in a static tensor too.

A bucket holds more rows than the step has sequences: the spare rows decode token 0 at
position 0 into a scratch block of the pool that no sequence owns (the runner allocates one
block more than the BlockManager hands out), so nothing they compute reaches a real
sequence. Every row is computed on its own, so a real row's logits do not depend on them.

Attention reads the pool through the block tables in place (DecodeBatch): on CUDA with the
Triton kernel (triton_attention.py), elsewhere with the pure-torch reference, which the
kernel is tested against. Without capture (``capture=False``: the CPU, or CUDA without
Triton) the same static path runs eagerly, which is how the suite checks it on machines
without a GPU. Prefill chunks and drafted-verify steps run eagerly (runner.py).
"""

from __future__ import annotations

import numpy as np
import torch

from localllm.runners.torch.attention import AttnBatch, KVPool, paged_attention


def buckets(max_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 8 up to max_seqs (and max_seqs)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_seqs] + list(range(16, max_seqs, 8))
    return sizes + [max_seqs]


class DecodeBatch:
    """The attention side of a decode step in static tensors: each sequence's new token goes to
    ``slots`` (B,) and attends over positions 0..ctx_lens-1 (B,) read through ``tables``
    (B, max_blocks) int32. ``kernel``: the Triton kernel (CUDA); else the reference."""

    native_meta = None  # (AttnBatch's, for the CPU's native attention and layers: never in a graph)

    def __init__(self, slots: torch.Tensor, tables: torch.Tensor, ctx_lens: torch.Tensor, block_size: int,
                 kernel: bool):
        self.slots, self.tables, self.ctx_lens = slots, tables, ctx_lens
        self.block_size, self.kernel = block_size, kernel

    def attend(self, q: torch.Tensor, pool: KVPool, layer: int, scale: float, n_swa: int = 0) -> torch.Tensor:
        q = pool.smooth_queries(q, layer)
        if self.kernel:
            from localllm.runners.torch import triton_attention

            scales = (pool.k_scales[layer], pool.v_scales[layer]) if pool.is_quantized else (None, None)
            return triton_attention.paged_decode_attention(q, pool.k[layer], pool.v[layer], self.tables,
                                                           self.ctx_lens, scale, n_swa,
                                                           k_scales=scales[0], v_scales=scales[1])
        # The reference reads the tables on the host: eager only, never captured.
        lens = self.ctx_lens.tolist()
        tables = self.tables.tolist()
        spans = [(table[:-(-n // self.block_size)], n - 1, 1, True) for table, n in zip(tables, lens)]
        return paged_attention(q, pool, layer, AttnBatch.build(spans, self.block_size, q.device), scale, n_swa)


class DecodeGraphs:
    """Decode steps of up to ``max_seqs`` sequences through static tensors; captured as CUDA
    graphs (one per bucket, on first use) when ``capture``."""

    def __init__(self, model, pool: KVPool, max_seqs: int, block_size: int, scratch_block: int, device,
                 capture: bool, kernel: bool):
        self.model, self.pool, self.block_size = model, pool, block_size
        self.capture, self.kernel = capture, kernel
        self.buckets = buckets(max_seqs)
        self.max_seqs = max_seqs
        self.scratch_block = scratch_block
        max_blocks = pool.num_slots // block_size
        self.ids = torch.zeros((3, max_seqs), dtype=torch.long, device=device)  # tokens, positions, slots
        self.ctx_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.tables = torch.zeros((max_seqs, max_blocks), dtype=torch.int32, device=device)
        # Host staging, in pinned memory on CUDA: the copies in and out run without a bounce.
        self._pin = torch.device(device).type == "cuda"
        self._host = [torch.zeros_like(t, device="cpu", pin_memory=self._pin)
                      for t in (self.ids, self.ctx_lens, self.tables)]
        self._ids, self._ctx_lens, self._tables = (t.numpy() for t in self._host)
        self.logits: torch.Tensor | None = None  # (max_seqs, vocab) float32, made by the first step
        self._host_logits: torch.Tensor | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._mempool = None

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, steps: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """steps: (token id, position, block table) per sequence, one new token each. -> the
        logits (len(steps), vocab) float32, a view of the static output (read it before the
        next step)."""
        n = len(steps)
        b = self.bucket(n)
        ids, lens, tables, bs = self._ids, self._ctx_lens, self._tables, self.block_size
        for i, (token, position, table) in enumerate(steps):
            used = position // bs + 1
            ids[:, i] = (token, position, table[position // bs] * bs + position % bs)
            lens[i] = position + 1
            tables[i, :used] = table[:used]
        # Spare rows: token 0 at position 0 of the scratch block.
        ids[:, n:b] = np.array([[0], [0], [self.scratch_block * bs]])
        lens[n:b] = 1
        tables[n:b, 0] = self.scratch_block
        host_ids, host_lens, host_tables = self._host
        self.ids.copy_(host_ids, non_blocking=self._pin)
        self.ctx_lens.copy_(host_lens, non_blocking=self._pin)
        self.tables[:b].copy_(host_tables[:b], non_blocking=self._pin)  # whole rows: one contiguous copy
        if not self.capture:
            self._step(b)
        else:
            graph = self.graphs.get(b)
            if graph is None:
                graph = self.graphs[b] = self._capture(b)
            graph.replay()
        return self.logits[:n]

    def host_logits(self, n: int) -> np.ndarray:
        """The last step's logits (n, vocab) on the host: a view of a buffer the next step
        overwrites (the engine samples from it before that)."""
        if self._host_logits is None:
            self._host_logits = torch.empty_like(self.logits, device="cpu", pin_memory=self._pin)
        out = self._host_logits[:n]
        out.copy_(self.logits[:n], non_blocking=self._pin)
        if self._pin:
            torch.cuda.current_stream().synchronize()
        return out.numpy()

    def _step(self, b: int) -> None:
        """The captured work: the model over the first b rows of the static inputs."""
        tokens, positions, slots = self.ids[0, :b], self.ids[1, :b], self.ids[2, :b]
        batch = DecodeBatch(slots, self.tables[:b], self.ctx_lens[:b], self.block_size, self.kernel)
        logits = self.model.logits(self.model.forward(tokens, positions, batch, self.pool))
        if self.logits is None:
            self.logits = torch.empty((self.max_seqs, logits.shape[-1]), dtype=torch.float32, device=logits.device)
        self.logits[:b].copy_(logits)

    def _capture(self, b: int) -> torch.cuda.CUDAGraph:
        """Run the step once on a side stream (kernels compile, libraries make their handles;
        the step's inputs are already in place, so this is the step itself, and the replay
        that follows writes the same K/V again), then capture it."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step(b)
        torch.cuda.current_stream().wait_stream(side)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: other engines (other models) may launch work from their own threads.
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            self._step(b)
        return graph
