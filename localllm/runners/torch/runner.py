"""TorchRunner: the ModelRunner over localllm's own PyTorch models and a paged KV pool.

The pool's blocks are the BlockManager's blocks, one for one, so keeping the storage in step
is bookkeeping only: a shared prefix is the same block ids (attach takes every hit block),
a released or evicted block keeps its bytes until the BlockManager hands it out again (and
a later write overwrites it), a truncation just moves the sequence's length back. The
prefix store's payload is the K/V of a sequence's positions as KVPool.export_slots writes it.

Tokenization uses llama.cpp's vocabulary of the same file (VocabFile: no
weights loaded), so both runners see the same token ids.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from localllm import memory
from localllm.config import DEFAULT_BATCH_TOKENS, EngineConfig
from localllm.engine.request import Sequence
from localllm.engine.scheduler import SchedulerOutput
from localllm.errors import EngineError, ModelLoadError
from localllm.runners.torch import models, native as native_kernels
from localllm.runners.torch import triton_attention
from localllm.runners.torch.attention import AttnBatch, KVPool, block_slots
from localllm.runners.torch.graphs import DecodeGraphs
from localllm.runners.torch.layers import LayerSource
from localllm.runners.torch.weight_cache import WeightCache
from localllm.runners.torch.weights import GGUFWeights

# CacheConfig.kv_dtype -> the KVPool's dtype (int8: q8_0, int8 K/V with a float16 scale per
# token and KV head; see attention.py).
KV_DTYPES = {"f16": torch.float16, "f32": torch.float32, "q8_0": torch.int8}
log = logging.getLogger("localllm.torch")


def pick_device() -> torch.device:
    """CUDA, then Apple's MPS, then the CPU: the first that torch finds usable."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


KEY_SMOOTHING = "smooth1"  # names key_smoothing's rule in the fingerprint: stored q8_0 keys depend on it


def key_smoothing(weights: GGUFWeights, c, alpha: float = 0.5) -> list[torch.Tensor]:
    """Per layer (n_kv, hd): how large each channel of K typically is, from the weights alone
    (the same for every run of the file, so stored prefixes stay valid), normalized to mean 1
    and raised to ``alpha`` (0.5 measured best on Qwen2.5-0.5B: top-1 94.7 % and KL 0.0046
    against llama.cpp f16 over the eval text, against 88.9 % and 0.025 unsmoothed and 95.5 %
    and 0.0036 for an f16 cache).

    A channel's size: with QK-norm, its norm weight; otherwise sqrt(sum_i (W_ci g_i)^2 + b_c^2)
    for the K projection W, its bias b and the attention norm's weight g (the spread of
    W (g * x) for a unit-RMS x). Rope turns pairs of channels into each other, either
    neighbours or halves by family, so each channel takes the larger of its two possible
    pairs' sizes: a pairing guessed wrong costs precision, never range (each token's scale
    still comes from its own absmax)."""
    out = []
    for layer in range(c.n_layer):
        p = f"blk.{layer}"
        if weights.has(f"{p}.attn_k_norm.weight"):
            size2 = weights.get(f"{p}.attn_k_norm.weight").abs().square().expand(c.n_head_kv, c.head_dim)
        else:
            w = weights.get(f"{p}.attn_k.weight") * weights.get(f"{p}.attn_norm.weight")
            size2 = w.square().sum(-1)
            if weights.has(f"{p}.attn_k.bias"):
                size2 = size2 + weights.get(f"{p}.attn_k.bias").square()
            size2 = size2.view(c.n_head_kv, c.head_dim)
        half = c.head_dim // 2
        halves = size2 + torch.cat([size2[:, half:], size2[:, :half]], -1)
        neighbours = size2 + size2.view(c.n_head_kv, half, 2).flip(-1).reshape(c.n_head_kv, c.head_dim)
        size = torch.maximum(halves, neighbours).sqrt().clamp(min=1e-6)
        out.append((size / size.mean(-1, keepdim=True)) ** alpha)
    return out


class TorchRunner:
    name = "torch"
    chosen_because: str | None = None  # set by engine.load_runner when --runner auto chose it

    def __init__(self, config: EngineConfig, device: torch.device | None = None, native: bool | None = None,
                 scheme: str | None = None, graphs: bool | None = None, vocab_file=None):
        """native: attend with the native kernel (native/attention.c); by default wherever it
        was built and the pool is on the CPU (False: the pure-torch reference, for comparing).
        scheme: the weight scheme of a quantized file (quant.SCHEMES; benchmarks compare them).
        graphs: decode steps through DecodeGraphs (graphs.py): by default on CUDA where Triton
        is there (captured as CUDA graphs); True elsewhere runs the same static path eagerly
        (for tests), False the plain eager path (for comparing).
        vocab_file: the file's VocabFile, loaded already (the engine loads it while torch is
        imported); this runner closes it.
        """
        from localllm.runners.llamacpp import VocabFile
        from localllm.runners.torch import quant

        path = Path(config.model_path)
        config, self.kv_plan = memory.sized(config, self.name)  # before anything is allocated
        self.device = device or pick_device()
        # On the CPU the engine chooses the threads of each step (set_threads): the native
        # kernels' pool and torch's own kernels follow the count (_torch_threads).
        self.uses_cpu_threads = self.device.type == "cpu"
        if self.uses_cpu_threads:  # torch's count until a first one is set (one a process)
            native_kernels.set_threads(config.threads or native_kernels.threads())
            torch.set_num_threads(native_kernels.threads())
        self.vocab_file = vocab_file if vocab_file is not None else VocabFile(path)
        self.vocab = self.vocab_file.vocab
        weights = GGUFWeights(path)
        self.config = weights.config()
        if not models.supported(self.config.arch):
            raise ModelLoadError(f"the torch runner has no model for the {self.config.arch!r} architecture; "
                                 "use --runner llamacpp")
        # Quantized files: int4 / int8 weights with bfloat16 matmuls (see quant.py); files of
        # floats: float32 throughout (the exact path the parity tests compare).
        # On the CPU with the native kernels: the file's own blocks (as llama.cpp computes them;
        # faster and more faithful there, docs/benchmarks.md); elsewhere int4 / int8.
        on_cpu_native = self.device.type == "cpu" and native_kernels.available()
        scheme = scheme or ("gguf-blocks" if on_cpu_native else quant.DEFAULT_SCHEME)
        if scheme not in quant.SCHEMES:
            raise EngineError(f"weight scheme {scheme!r} is not one of {', '.join(quant.SCHEMES)}")
        if scheme in quant.BLOCK_SCHEMES and not (native_kernels.available() and self.device.type == "cpu"):
            raise EngineError(f"the {scheme!r} weight scheme needs localllm's native kernels on the CPU")
        self.weights_scheme = scheme if weights.is_quantized else "f32"
        blocks = weights.is_quantized and scheme in quant.BLOCK_SCHEMES
        # Block layers take float32 activations (they quantize them to 8 bits themselves).
        dtype = torch.bfloat16 if weights.is_quantized and not blocks else torch.float32
        cache = None
        if config.weights_cache_dir is not None and weights.is_quantized and self.device.type == "cpu":
            # (which tensors stay blocks depends on what this CPU's native kernels read)
            layout = "+vector" if blocks and native_kernels.vector_loops() else ""
            cache = WeightCache(config.weights_cache_dir, path, self.weights_scheme + layout)
        source = LayerSource(weights, dtype, self.device, cache, int8_types=quant.SCHEMES[scheme], blocks=blocks)
        self.model = models.build(self.config, source, dtype, self.device)
        # What the load read: blocks in place from the file alone (nothing converted, nothing
        # kept), or also tensors converted now or taken from the cache of an earlier load.
        self.weights_in_place = not source.converted and not source.num_from_cache
        self.weights_from_cache = source.num_from_cache > 0
        if cache is not None and source.converted:
            cache.save({**source.cached(), **source.converted})
        self.block_size = config.cache.block_size
        # The step token budget where none is given: on a GPU a 2,048-token step costs little
        # more than a 256-token one (a 2,000-token prompt: 42 ms in one step against 142 ms in
        # eight, on an H200; docs/benchmarks.md).
        self.default_batch_tokens = 2048 if self.device.type == "cuda" else DEFAULT_BATCH_TOKENS
        self.n_ctx = config.cache.num_blocks * self.block_size
        c = self.config
        self.kv_dtype = KV_DTYPES[config.cache.kv_dtype]
        kernel = self.device.type == "cuda" and triton_attention.available()
        graphs = kernel if graphs is None else graphs
        # With graphs the pool has one block more than the BlockManager hands out: the scratch
        # block that a captured batch's spare rows write to.
        num_blocks = config.cache.num_blocks
        self.pool = KVPool(c.n_layer, num_blocks + graphs, self.block_size, c.n_head_kv, c.head_dim,
                           self.kv_dtype, self.device)
        if self.pool.is_quantized:
            self.pool.set_key_smoothing(key_smoothing(weights, c))
        # Nothing slides out of the pool, so rollbacks and prefixes are exact on every model:
        # to the engine this runner has no window.
        self.n_swa = 0
        on_cpu = self.device.type == "cpu"
        self.native = (native_kernels.available() and on_cpu) if native is None else (native and on_cpu)
        if on_cpu and native is None and native_kernels.is_outdated():
            log.warning("%s; using the slower pure-torch kernels: rebuild them with `pip install -e .`",
                        native_kernels.why_unavailable())
        self.graphs = None
        if graphs:
            capture = kernel  # a step through the reference reads its tables back: never captured
            if capture:
                self.model.reserve_positions(self.n_ctx)
            self.graphs = DecodeGraphs(self.model, self.pool, config.scheduler.max_num_seqs, self.block_size,
                                       num_blocks, self.device, capture=capture, kernel=kernel)
        st = path.stat()
        # (the native kernels' version and tier too: a stored prompt's K/V are the bits those
        # kernels computed, and a hit must give the cold answer of the code that reads it)
        kernels = f"|native {native_kernels.ABI_VERSION} {native_kernels.isa()}" if self.native else ""
        self.fingerprint = (f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|torch {torch.__version__}|"
                            f"{self.weights_scheme}|kv {config.cache.kv_dtype}"
                            f"{' ' + KEY_SMOOTHING if self.pool.is_quantized else ''}{kernels}").encode()
        self._lengths: dict[int, int] = {}  # seq_id -> positions it has KV for
        self.kv_bytes = self.pool.nbytes  # measured from the pool's tensors, scales included

    # -- a step -------------------------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> np.ndarray:
        tokens, positions, spans, rows = [], [], [], []
        n = 0
        if self._is_decode(out):
            return self._decode(out)
        for sched in out.scheduled:
            seq, k = sched.seq, sched.num_new_tokens
            start = seq.num_computed_tokens
            if sched.num_draft_tokens:
                ids = [seq.token_at(start)] + list(seq.draft_token_ids)
            elif start + k <= seq.num_prompt_tokens:
                ids = seq.prompt_token_ids[start:start + k]
            else:
                ids = seq.token_ids[start:start + k]
            if len(seq.block_table) * self.block_size < start + k:
                raise EngineError(f"sequence {seq.seq_id} has blocks for {len(seq.block_table) * self.block_size} "
                                  f"positions, not {start + k}")
            tokens += ids
            positions += range(start, start + k)
            spans.append((seq.block_table, start, k, start >= seq.num_prompt_tokens))
            if sched.needs_logits:
                rows += range(n + k - sched.num_logits, n + k)
            self._lengths[seq.seq_id] = start + k
            n += k
        if n == 0 or not rows:
            if n:
                self._forward(tokens, positions, spans, [])
            return np.empty((0, self.vocab.n_vocab), dtype=np.float32)
        return self._forward(tokens, positions, spans, rows)

    def _is_decode(self, out: SchedulerOutput) -> bool:
        """A step DecodeGraphs takes: each sequence one new token (no drafts), with logits."""
        if self.graphs is None or not out.scheduled or len(out.scheduled) > self.graphs.max_seqs:
            return False
        return all(s.num_new_tokens == 1 and not s.num_draft_tokens and s.needs_logits
                   and s.seq.num_computed_tokens >= s.seq.num_prompt_tokens for s in out.scheduled)

    @torch.inference_mode()
    def _decode(self, out: SchedulerOutput) -> np.ndarray:
        steps = []
        for sched in out.scheduled:
            seq = sched.seq
            position = seq.num_computed_tokens
            if len(seq.block_table) * self.block_size <= position:
                raise EngineError(f"sequence {seq.seq_id} has blocks for {len(seq.block_table) * self.block_size} "
                                  f"positions, not {position + 1}")
            steps.append((seq.token_at(position), position, seq.block_table))
            self._lengths[seq.seq_id] = position + 1
        self.graphs.run(steps)
        return self.graphs.host_logits(len(steps))

    @torch.inference_mode()
    def _forward(self, tokens, positions, spans, rows) -> np.ndarray:
        dev = self.device
        batch = AttnBatch.build(spans, self.block_size, dev, native=self.native)
        hidden = self.model.forward(torch.tensor(tokens, dtype=torch.long, device=dev),
                                    torch.tensor(positions, dtype=torch.long, device=dev), batch, self.pool)
        if self.uses_cpu_threads and torch.get_num_threads() != self._torch_threads():
            torch.set_num_threads(self._torch_threads())
        if not rows:
            return np.empty((0, self.vocab.n_vocab), dtype=np.float32)
        logits = self.model.logits(hidden[torch.tensor(rows, dtype=torch.long, device=dev)])
        return logits.float().cpu().numpy()

    # -- KV bookkeeping (KVListener) ----------------------------------------------------

    def attach(self, seq: Sequence, num_hit_blocks: int) -> int:
        self._lengths[seq.seq_id] = num_hit_blocks * self.block_size
        return num_hit_blocks

    def release(self, seq: Sequence, kept_block_ids: list[int]) -> list[int]:
        self._lengths.pop(seq.seq_id, None)
        return []

    def truncate(self, seq: Sequence, num_tokens: int, dropped_block_ids: list[int]) -> None:
        self._lengths[seq.seq_id] = num_tokens

    def evict(self, block_id: int) -> None:
        pass

    def reset(self) -> None:
        self._lengths.clear()
        self.pool.zero_()  # as allocated: nothing of earlier sequences is left to read

    # -- the on-disk prefix cache -------------------------------------------------------

    def export_kv(self, seq: Sequence, num_tokens: int) -> memoryview | None:
        """The KV of seq's first ``num_tokens`` positions (KVPool.export_slots bytes), when the
        runner holds exactly those for it; else None."""
        if num_tokens <= 0 or self._lengths.get(seq.seq_id) != num_tokens:
            return None
        return self.pool.export_slots(block_slots(seq.block_table, num_tokens, self.block_size))

    def import_kv(self, seq: Sequence, payload, num_tokens: int) -> str:
        """Write the first ``num_tokens`` positions of ``export_kv`` bytes into seq's attached,
        empty blocks: "ok", or "refused" (nothing loaded) when the bytes are of another layout
        or too short. Never "inexact": nothing slides out of the pool."""
        if len(seq.block_table) * self.block_size < num_tokens:
            return "refused"
        if not self.pool.import_slots(block_slots(seq.block_table, num_tokens, self.block_size), payload):
            return "refused"
        self._lengths[seq.seq_id] = num_tokens
        return "ok"

    # -- inspection ---------------------------------------------------------------------

    def seq_pos_range(self, seq_id: int) -> tuple[int, int] | None:
        n = self._lengths.get(seq_id)
        return (0, n - 1) if n else None

    @property
    def num_active_slots(self) -> int:
        """Sequences the runner holds KV positions for (released ones are forgotten)."""
        return len(self._lengths)

    @property
    def threads(self) -> int:
        """The CPU threads a step runs on (one count a process, as torch's)."""
        return native_kernels.threads()

    def set_threads(self, n: int) -> None:
        native_kernels.set_threads(n)
        torch.set_num_threads(self._torch_threads())

    def _torch_threads(self) -> int:
        """torch's own count: one where the native layers compute the steps (its few operations
        there are small, and its OpenMP workers, spinning after each, would take the cores from
        the kernels' pool); the step's count where torch computes the layers."""
        slot = getattr(self.model, "fused", None)
        return 1 if slot is not None and slot.computing else native_kernels.threads()

    def close(self) -> None:
        self.graphs = None  # its captured graphs hold their memory pool (VRAM) until dropped
        self.pool = None
        self.model = None
        if getattr(self, "vocab_file", None) is not None:
            self.vocab_file.close()
            self.vocab_file = None
